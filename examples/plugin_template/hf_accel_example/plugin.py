"""The plugin: hf_accel loads this module through the ``hf_accel`` entry point in ``pyproject.toml`` and calls
its hook, which registers the backends it offers.

A plugin imports from hf_accel only ``hf_accel.plugin``, the plugin API (its ``__all__`` lists everything).
"""

from __future__ import annotations

from hf_accel.plugin import (
    Backend,
    Capabilities,
    PatchContext,
    hookimpl,
    register_implementation,
    set_attention,
    transformers_refusal,
)
from hf_accel_example.attention import build_mask, forward

#: What users pass: ``hf_accel.patch(model, attention="example")``.
BACKEND = "example"
#: The name under which transformers looks up the attention function and its mask builder. Not "flash...":
#: transformers takes names containing "flash" for its own FlashAttention integrations.
IMPLEMENTATION = "hf_accel_example"


def apply(context: PatchContext) -> None:
    """Switch this model instance (and only it) to the example attention, undoably."""
    set_attention(context, IMPLEMENTATION)


def why_unsuitable(context: PatchContext) -> str | None:
    """Why this model cannot use the backend (it does not route attention through transformers'
    ``AttentionInterface``, say), asked before anything changes; None when it can."""
    return transformers_refusal(context, IMPLEMENTATION)


@hookimpl
def hf_accel_register_backends(register):
    # The mask builder is transformers' sdpa_mask (boolean 4-D masks, or None where the forward's causal rule
    # is exact): transformers looks both up by the implementation's name.
    register_implementation(IMPLEMENTATION, forward, build_mask)
    register(Backend(
        name=BACKEND,
        feature="attention",
        apply=apply,
        why_unsuitable=why_unsuitable,
        # Any device and dtype (plain PyTorch ops). Sliding windows arrive in the mask and soft-capping is
        # computed; the kernel only sees activations, so sharded or offloaded weights are no obstacle.
        capabilities=Capabilities(sliding_window=True, softcap=True, partial_weights=True),
        # "auto" tries higher priorities first: below sdpa (10), whose fused kernels are faster, above eager (0).
        priority=5,
        description="chunked online-softmax attention in plain PyTorch (the plugin template's example)",
    ))


# -- Other features ------------------------------------------------------------------------------------------
# A plugin may register backends for any feature from the same hook; each is a Backend with its own `feature`.
# Sketches of the other kinds, with the helpers hf_accel.plugin provides for them:
#
# Quantization (feature="quantize"): replace the chosen Linear layers, record how, report the bytes.
#     def quantize(context):
#         context.report.weight_bytes_before = tensor_bytes(context.model)
#         for parent, name, qualified, linear in selected_linears(context):
#             context.changes.set_submodule(parent, name, MyInt4Linear(linear))  # a SavedAsFloat subclass
#             context.report.modules.append(qualified)
#         record_quantization(context, "int4, one scale per 32 weights")
#     Backend(name="my_int4", feature="quantize", apply=quantize, lossless=False, tolerance=0.1,
#             variants=("int4",), options=SELECTION_OPTIONS, memory_needed=lambda c: quantized_bytes(c, 0.5))
#
# KV cache (feature="kv_cache"): leave a RollbackCache in the patch state for generate to use.
#     def install(context):
#         cache = PreallocatedCache(context.model.config, context.option("cache_capacity", 256))
#         context.changes.setattr(context.state, "kv_cache", cache)
#         context.account_memory("KV cache", cache.stored_bytes)
#     Backend(name="my_cache", feature="kv_cache", apply=install, probe="generate",
#             options={"cache_capacity": Option.integer(256)})
#
# Speculative decoding (feature="speculative"): a Drafter proposes tokens, the core's loop verifies them exactly.
#     class MyDrafter:  # start(loop), propose(loop, k) -> Draft(tokens [batch, k], lengths [batch]), accepted(...)
#         ...
#     def install(context):
#         install_runner(context, lambda model, generation_config: MyDrafter(), DraftLength(k=4, low=1, high=8))
#     Backend(name="my_drafter", feature="speculative", apply=install, why_unsuitable=object_request_problem,
#             probe="generate")
