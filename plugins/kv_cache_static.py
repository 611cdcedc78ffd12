"""``kv_cache="static"``: one preallocated KV cache per patched model, reused by every generate call.

Stock transformers builds a new ``DynamicCache`` per call and grows it with ``torch.cat`` over the whole
history at every step (on SmolLM2 on a 2-core CPU, ~14 ms of a ~50 ms step at a 300-token context). This
cache is allocated once, written in place, reset between calls, and grown (rarely, by doubling) when a
call needs more room. The speculative loop uses the same cache and rolls it back by moving an index.
"""

from __future__ import annotations

from hf_accel import Backend, PatchContext, hookimpl
from hf_accel.kv_cache import PreallocatedCache

#: Room for a typical chat prompt plus a few hundred new tokens; grows on demand.
INITIAL_CAPACITY = 1024


def install(context: PatchContext) -> None:
    capacity = int(context.option("cache_capacity", INITIAL_CAPACITY))
    context.changes.setattr(context.state, "kv_cache", PreallocatedCache(context.model.config, capacity))
    context.report.details["initial_capacity_tokens"] = capacity


def why_unsuitable(context: PatchContext) -> str | None:
    model = context.model
    if model.config.is_encoder_decoder:
        return "encoder-decoder models keep two caches; only decoder-only models are supported"
    if getattr(model, "_is_stateful", False):
        return f"{type(model).__name__} keeps recurrent state, not a key/value cache"
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "num_hidden_layers", None) is None:
        return "the config does not say how many layers to allocate"
    return None


@hookimpl
def hf_accel_register_backends(register):
    register(Backend(
        name="static",
        feature="kv_cache",
        apply=install,
        why_unsuitable=why_unsuitable,
        probe="generate",
        priority=10,
        options={"cache_capacity": INITIAL_CAPACITY},
        description="preallocated KV cache written in place and reused across calls",
    ))
