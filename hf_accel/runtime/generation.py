"""How a patched model's ``generate`` runs: through the ``hf_accel_generate`` hook."""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from hf_accel.patching.state import PatchState, get_state
from hf_accel.runtime.compile_gate import COMPILE_GATE
from hf_accel.runtime.kv_cache import RollbackCache

if TYPE_CHECKING:
    from transformers import PreTrainedModel


#: generate arguments that are model inputs, not generation settings.
_MODEL_INPUTS = frozenset({"inputs", "input_ids", "attention_mask", "past_key_values", "cache", "streamer",
                           "logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus",
                           "negative_prompt_ids", "negative_prompt_attention_mask", "use_model_defaults",
                           "custom_generate"})


@dataclass(frozen=True)
class _CallShape:
    batch_size: int
    prompt_length: int
    length: int  # prompt plus new tokens
    disable_compile: bool


@dataclass
class GenerateCall:
    """One call of a patched model's ``generate``: what the user passed, and the patch it runs under."""

    model: PreTrainedModel
    state: PatchState
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def __repr__(self) -> str:  # short: HF_ACCEL_TRACE prints it at every call
        arguments = [_brief(a) for a in self.args] + [f"{k}={_brief(v)}" for k, v in self.kwargs.items()]
        return f"<GenerateCall {type(self.model).__name__}({', '.join(arguments)})>"

    def run_stock(self, **overrides: Any) -> Any:
        """The model's original ``generate`` with the user's arguments (and ``overrides``), running over the
        patch's compiled decode step or KV cache where the call is one they serve."""
        kwargs = {**self.kwargs, **overrides}
        shape = self._served_shape(kwargs)
        step = self.state.compiled_step
        if shape is not None and step is not None and not shape.disable_compile:
            kwargs.update(step.generate_kwargs(shape.batch_size, shape.length))
            step.begin_call(shape.length - shape.prompt_length)
            made = 0
            try:
                out = self.state.original_generate(*self.args, **kwargs)
                sequences = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
                made = sequences.shape[-1] - shape.prompt_length if sequences is not None else 0
            finally:
                step.end_call(made)
            return _without_cache(out, kwargs[cache_keyword(self.model)])
        if shape is not None and (cache := self.reusable_cache()) is not None:
            kwargs[cache_keyword(self.model)] = cache
            return _without_cache(self.state.original_generate(*self.args, **kwargs), cache)
        return self.state.original_generate(*self.args, **kwargs)

    def _served_shape(self, kwargs: dict[str, Any]) -> _CallShape | None:
        """Batch size and total length of a call the patch's caches may serve: greedy or sampling, without
        a cache or cache implementation of its own; None for anything else (beam search, assisted, ...)."""
        if _brings_a_cache(kwargs):
            return None
        input_ids = self.args[0] if self.args else kwargs.get("input_ids", kwargs.get("inputs"))
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
            return None
        settings = {k: v for k, v in kwargs.items() if k not in _MODEL_INPUTS}
        config, _ = self.model._prepare_generation_config(
            settings.get("generation_config"), **{k: v for k, v in settings.items() if k != "generation_config"})
        if (config.num_beams != 1 or config.prompt_lookup_num_tokens or config.cache_implementation is not None
                or settings.get("assistant_model") is not None):
            return None
        rows, prompt = input_ids.shape
        new_tokens = generated_length(self.model, config, settings, input_ids)
        batch_size = rows * (config.num_return_sequences or 1)  # stock expands the rows before the cache sees them
        return _CallShape(batch_size, prompt, prompt + max(new_tokens, 1), bool(config.disable_compile))

    def reusable_cache(self) -> RollbackCache | None:
        """The patch's KV cache, emptied, if this call may use it; else None."""
        cache = self.state.kv_cache
        config = self.kwargs.get("generation_config")
        if cache is None or _brings_a_cache(self.kwargs):
            return None
        if getattr(config or self.model.generation_config, "cache_implementation", None) is not None:
            return None
        cache.reset()
        return cache


def generated_length(model: Any, config: Any, call_kwargs: dict[str, Any], input_ids: torch.Tensor) -> int:
    """The most new tokens stock ``generate`` makes for this call, by its own rule (``max_new_tokens``; else a
    ``max_length`` set anywhere, by the call, its ``generation_config`` or the model's; else 20 counted from the
    end of the prompt, capped by the model's positions), which also sets ``config.min_length`` from
    ``min_new_tokens``. Updates ``config``. ``call_kwargs``: the call's settings, ``generation_config`` included."""
    passed = call_kwargs.get("generation_config")

    def unset(name: str) -> bool:
        return (call_kwargs.get(name) is None and getattr(passed, name, None) is None
                and getattr(model.generation_config, name, None) is None)

    model._prepare_generated_length(config, unset("max_length"), unset("min_length"), "input_ids", input_ids.shape[1],
                                    input_ids)
    return config.max_length - input_ids.shape[1]


def _without_cache(out: Any, cache: Any) -> Any:
    """``out`` without the patch's own cache (``return_dict_in_generate=True`` returns the cache it ran over,
    as ``cache``, or ``past_key_values`` before transformers 5.24): the next call reuses that cache, so a
    user who kept it would continue from another call's state."""
    if isinstance(out, torch.Tensor) or not any(value is cache for value in out.values()):
        return out
    return type(out)(**{key: value for key, value in out.items() if value is not cache})


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword transformers reads a KV cache from, in ``forward`` and ``generate`` alike: ``cache`` from
    5.24 on (``past_key_values`` is deprecated there, to be removed in 5.40 and 6.0), ``past_key_values``
    before."""
    return _cache_keyword(type(model))


@functools.cache
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def _brings_a_cache(kwargs: dict[str, Any]) -> bool:
    """Whether a call brings its own cache (``past_key_values``, or ``cache`` from transformers 5.24) or
    cache implementation."""
    return (kwargs.get("past_key_values") is not None or kwargs.get("cache") is not None
            or "cache_implementation" in kwargs)


def make_patched_generate(model: PreTrainedModel, original: Callable[..., Any]) -> Callable[..., Any]:
    """A ``generate`` for this instance that sends every call through the plugin hook."""

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        state = get_state(model)
        if state is None:  # unpatched while a reference to this function was kept
            return original(*args, **kwargs)
        # The patch's caches, compiled steps and draft lengths serve one call at a time; the gate keeps the
        # call from running while another patched model compiles.
        with state.lock, COMPILE_GATE.call():
            if state.depth:  # called from inside a call (a plugin's hook): the patch's caches are in use
                return original(*args, **kwargs)
            state.depth += 1
            try:
                for check in state.call_checks:
                    check()
                return run_generate(state, args, kwargs)
            finally:
                state.depth -= 1

    return generate


def run_generate(state: PatchState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    call = GenerateCall(model=state.model, state=state, args=args, kwargs=kwargs)
    return state.pm.hook.hf_accel_generate(call=call)


def _brief(value: Any) -> str:
    """A value in a few words: a tensor by its shape and dtype, a module by its class."""
    if isinstance(value, torch.Tensor):
        return f"tensor{list(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, torch.nn.Module):
        return f"<{type(value).__name__}>"
    text = repr(value)
    return text if len(text) <= 80 else f"<{type(value).__name__}>"
