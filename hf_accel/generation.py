"""How a patched model's ``generate`` runs: through the ``hf_accel_generate`` hook."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from .hookspecs import hookimpl
from .state import get_state

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .state import PatchState


@dataclass
class GenerateCall:
    """One call of a patched model's ``generate``: what the user passed, and the patch it runs under."""

    model: PreTrainedModel
    state: PatchState
    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def run_stock(self, **overrides: Any) -> Any:
        """The model's original ``generate`` with the user's arguments (and ``overrides``), using the
        patch's KV cache unless the call brings its own cache or cache implementation."""
        kwargs = {**self.kwargs, **overrides}
        cache = self.reusable_cache()
        if cache is not None:
            kwargs["past_key_values"] = cache
        return self.state.original_generate(*self.args, **kwargs)

    def reusable_cache(self) -> Any:
        """The patch's KV cache, emptied, if this call may use it; else None."""
        cache = self.state.kv_cache
        config = self.kwargs.get("generation_config")
        if cache is None or self.kwargs.get("past_key_values") is not None or "cache_implementation" in self.kwargs:
            return None
        if getattr(config or self.model.generation_config, "cache_implementation", None) is not None:
            return None
        cache.reset()
        return cache


def make_patched_generate(model: PreTrainedModel, original: Callable[..., Any]) -> Callable[..., Any]:
    """A ``generate`` for this instance that sends every call through the plugin hook."""

    @functools.wraps(original)
    def generate(*args: Any, **kwargs: Any) -> Any:
        state = get_state(model)
        if state is None:  # unpatched while a reference to this function was kept
            return original(*args, **kwargs)
        return run_generate(state, args, kwargs)

    return generate


def run_generate(state: PatchState, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    call = GenerateCall(model=state.model, state=state, args=args, kwargs=kwargs)
    return state.pm.hook.hf_accel_generate(call=call)


class CoreHooks:
    """The core's own hook implementations; each runs last, so any plugin can take precedence."""

    @hookimpl(trylast=True)
    def hf_accel_generate(self, call: GenerateCall) -> Any:
        runner = call.state.runner
        return runner(call) if runner is not None else call.run_stock()

    @hookimpl(trylast=True)
    def hf_accel_select_backend(self, feature, candidates, context):  # noqa: ARG002
        return candidates[0] if candidates else None
