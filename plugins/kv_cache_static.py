"""``kv_cache="static"``: one preallocated KV cache per patched model, reused by every generate call.
``kv_cache="static-int8"``: the same, storing keys and values as int8 (lossy; asked for by name only).

Stock transformers builds a new ``DynamicCache`` per call and grows it with ``torch.cat`` over the whole
history at every step (on SmolLM2 on a 2-core CPU, ~14 ms of a ~50 ms step at a 300-token context). This
cache is allocated once, written in place, reset between calls, and grown (rarely, by doubling) when a
call needs more room. The speculative loop uses the same cache and rolls it back by moving an index.
"""

from __future__ import annotations

import torch

from hf_accel.plugin import (
    Backend,
    CachedLM,
    Capabilities,
    Option,
    PatchContext,
    PreallocatedCache,
    PreallocatedLayer,
    ProbeInputs,
    cache_keyword,
    hookimpl,
)

#: Room for a typical chat prompt plus a few hundred new tokens; grows on demand.
INITIAL_CAPACITY = 1024


class Int8Layer(PreallocatedLayer):
    """Keys and values stored as int8, with one scale per row, head and position (absmax over the head's
    dimension): a quarter of fp32's bytes, half of fp16's, plus the scales. Dequantized when read."""

    def encode(self, states: torch.Tensor) -> list[torch.Tensor]:
        scale = states.abs().amax(dim=-1, keepdim=True).clamp_min(1e-8) / 127
        return [torch.round(states / scale).to(torch.int8), scale]

    def decode(self, parts: list[torch.Tensor]) -> torch.Tensor:
        quantized, scale = parts
        return quantized.to(scale.dtype) * scale


def install(context: PatchContext, layer_class: type[PreallocatedLayer] = PreallocatedLayer) -> None:
    capacity = int(context.option("cache_capacity", INITIAL_CAPACITY))
    cache = PreallocatedCache(context.model.config, capacity, layer_class)
    context.changes.setattr(context.state, "kv_cache", cache)
    context.account_memory("KV cache", cache.stored_bytes)
    # The verification probe filled it; calls that use it (those the compiled step does not serve) allocate
    # what they need.
    context.changes.on_commit(cache.release)
    context.report.details["initial_capacity_tokens"] = capacity
    if layer_class is not PreallocatedLayer:
        context.report.details.update(int8_cache_cost(context.model, cache))


def int8_cache_cost(model: torch.nn.Module, cache: PreallocatedCache) -> dict[str, float]:
    """What storing the cache in int8 costs on the verification probe: logit error and top-1 agreement of
    tokens read through it, greedy agreement over 16 tokens, and bytes per cached token."""
    probe = ProbeInputs.for_model(model)
    ids = probe.input_ids[:1]
    reference = _extend_logits(model, ids, PreallocatedCache(model.config))
    quantized = _extend_logits(model, ids, cache)
    error = ((quantized - reference).abs().max() / reference.abs().max()).item()
    full = PreallocatedCache(model.config)
    cache.reset()  # it holds the probe's first half, which generate would take as a prefix
    greedy = [model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **{cache_keyword(model): c},
                             max_new_tokens=16, do_sample=False, pad_token_id=probe.pad_token_id)
              for c in (full, cache)]
    start, n = ids.shape[1], min(g.shape[1] for g in greedy)  # generated tokens only, not the prompt
    agreement = (greedy[0][:, start:n] == greedy[1][:, start:n]).float().mean().item()
    return {"logit_error_vs_full_precision_cache": round(error, 5),
            "top1_agreement": round((quantized.argmax(-1) == reference.argmax(-1)).float().mean().item(), 4),
            "greedy_agreement_16_tokens": round(agreement, 4),
            "bytes_per_token": cache.bytes_per_token(), "bytes_per_token_full_precision": full.bytes_per_token()}


def _extend_logits(model: torch.nn.Module, ids: torch.Tensor, cache: PreallocatedCache) -> torch.Tensor:
    """Logits of the probe's second half, read through ``cache`` holding its first half."""
    lm = CachedLM(model, cache)
    half = ids.shape[1] // 2
    with torch.no_grad():
        lm.prefill(ids[:, :half], torch.ones_like(ids[:, :half]))
        return lm.extend(ids[:, half:])


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
        capabilities=Capabilities(partial_weights=True),  # its caches take their shapes from the states
        probe="generate",
        priority=10,
        options={"cache_capacity": Option.integer(INITIAL_CAPACITY, maximum=1 << 20)},
        description="preallocated KV cache written in place and reused across calls",
    ))
    register(Backend(
        name="static-int8",
        feature="kv_cache",
        apply=lambda context: install(context, Int8Layer),
        why_unsuitable=why_unsuitable,
        capabilities=Capabilities(partial_weights=True),
        probe=None,  # lossy by design: the backend measures and reports its own cost instead
        lossless=False,
        options={"cache_capacity": Option.integer(INITIAL_CAPACITY, maximum=1 << 20)},
        description="the static cache with keys and values stored in int8 (one scale per head and position)",
    ))
