"""The plugin API: everything a backend plugin imports from hf_accel, and nothing else.

A plugin is a module of the ``hf_accel`` entry-point group that implements the hooks (``docs/hooks.md``);
built-in backends are plugins like any other. Example::

    from hf_accel.plugin import Backend, PatchContext, hookimpl, set_attention

    @hookimpl
    def hf_accel_register_backends(register):
        register(Backend(name="mine", feature="attention",
                         apply=lambda context: set_attention(context, "sdpa")))

What is here, by use:

- registering: :func:`hookimpl`, :class:`Backend`, :class:`Capabilities`, :class:`Option`, the
  :class:`PatchContext` a backend's functions get, the errors;
- attention backends: switching a model instance's implementation (:mod:`hf_accel.plugin.attention`);
- quantization backends: choosing Linear layers (and those a kernel takes: :func:`kernel_selection`),
  replacing them so they save and load as floats, freeing a weight a copy replaces (:func:`free_weight`),
  reporting (:mod:`hf_accel.plugin.quantize`);
- cache and compile backends: what they install (a :class:`RollbackCache`, a :class:`DecodeStep`), the
  preallocated and fixed-length caches, the compiled decode step and the :class:`GraphCompiler` it takes, when
  to compile, where compiled code persists, whether code is being traced rather than run (:func:`is_tracing`);
- speculative backends: what they install (a :class:`GenerateRunner`, given each :class:`Call`), the loop's
  contracts (:class:`Drafter`, :class:`Draft`), the draft-length rule, and :func:`install_runner`, which
  routes a model's generate calls through the loop.
"""

from hf_accel.patching.backends import Backend, Capabilities, Option, PatchContext
from hf_accel.patching.errors import BackendUnavailableError, PatchError, VerificationError
from hf_accel.patching.hookspecs import hookimpl
from hf_accel.patching.mapped_files import free_weight
from hf_accel.patching.memory import free_bytes, shortfall
from hf_accel.patching.verify import ProbeInputs
from hf_accel.plugin.attention import configs_of, head_dim, register_implementation, set_attention, transformers_refusal
from hf_accel.plugin.quantize import (
                                       SELECTION_OPTIONS,
                                       SavedAsFloat,
                                       children_of_type,
                                       held_outside,
                                       kernel_selection,
                                       linear_children,
                                       quantized_bytes,
                                       record_quantization,
                                       selected_embeddings,
                                       selected_linears,
                                       tensor_bytes,
                                       weight_and_bias,
)
from hf_accel.runtime.cached_lm import CachedLM
from hf_accel.runtime.compile_cache import CompileStore
from hf_accel.runtime.compile_gate import is_tracing
from hf_accel.runtime.compile_policy import CompilePolicy
from hf_accel.runtime.compiled_step import BF16_CHECK_TOLERANCE, CHECK_TOLERANCE, CompiledDecodeStep
from hf_accel.runtime.contracts import Call, CallState, DecodeStep, GenerateRunner
from hf_accel.runtime.generation import GenerateCall, cache_keyword
from hf_accel.runtime.kv_cache import PreallocatedCache, PreallocatedLayer, RollbackCache, RollbackStaticCache
from hf_accel.runtime.layer_graphs import GraphCompiler
from hf_accel.runtime.regions import decoder_layers, is_routed
from hf_accel.runtime.speculative.loop import Draft, Drafter, DraftLength, SpeculativeLoop
from hf_accel.runtime.speculative.runner import install_runner, object_request_problem

__all__ = [
    # registering a backend
    "Backend", "BackendUnavailableError", "Capabilities", "Option", "PatchContext", "PatchError",
    "VerificationError", "hookimpl",
    # checks a backend makes
    "ProbeInputs", "free_bytes", "shortfall",
    # attention
    "configs_of", "head_dim", "register_implementation", "set_attention", "transformers_refusal",
    # quantization
    "SELECTION_OPTIONS", "SavedAsFloat", "children_of_type", "free_weight", "held_outside", "kernel_selection",
    "linear_children", "quantized_bytes", "record_quantization", "selected_embeddings", "selected_linears",
    "tensor_bytes", "weight_and_bias",
    # caches and the compiled step (what a kv_cache or compile backend installs: a RollbackCache, a DecodeStep)
    "BF16_CHECK_TOLERANCE", "CHECK_TOLERANCE", "CachedLM", "CompileStore", "CompilePolicy", "CompiledDecodeStep",
    "DecodeStep", "GraphCompiler", "PreallocatedCache", "PreallocatedLayer", "RollbackCache", "RollbackStaticCache",
    "cache_keyword", "decoder_layers", "is_routed", "is_tracing",
    # generate calls and speculative decoding (what a speculative backend installs: a GenerateRunner)
    "Call", "CallState", "Draft", "DraftLength", "Drafter", "GenerateCall", "GenerateRunner", "SpeculativeLoop",
    "install_runner", "object_request_problem",
]
