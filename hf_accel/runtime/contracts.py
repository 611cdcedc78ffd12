"""What the generate path asks of what backends install on a patched model (``PatchState``'s ``runner`` and
``compiled_step``; its ``kv_cache`` is a :class:`~hf_accel.runtime.kv_cache.RollbackCache`), and what a runner
gets. The built-in classes satisfy these structurally; so must a plugin's."""

from __future__ import annotations

from typing import Any, Protocol

import torch

from hf_accel.runtime.kv_cache import RollbackCache


class DecodeStep(Protocol):
    """The model's forward for decode steps, compiled, with the fixed-length caches it runs over."""

    #: The model it runs.
    model: torch.nn.Module
    #: Relative logit error its graphs were allowed against eager: above fp32 rounding it does not serve the
    #: target's verification.
    tolerance: float

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The model's forward (``input_ids=``, ``attention_mask=``, the cache, ...), through the graphs."""
        ...

    def generate_kwargs(self, batch_size: int, needed_length: int) -> dict[str, Any]:
        """What stock ``generate`` needs to run its decode steps through this step: the cache, under the
        model's cache keyword (``cache`` or ``past_key_values``), and a compile config."""
        ...

    def cache_for(self, batch_size: int, needed_length: int) -> RollbackCache:
        """A fixed-length cache, emptied, for a call the speculative loop runs through this step."""
        ...

    def begin_call(self, new_tokens: int) -> None:
        """A call starts that may make up to ``new_tokens`` tokens (when to compile is decided per call)."""
        ...

    def end_call(self, tokens: int) -> None:
        """The call made ``tokens`` tokens per row."""
        ...

    def for_model(self, model: torch.nn.Module, details: dict[str, Any] | None = None,
                  tolerance: float | None = None) -> DecodeStep | None:
        """A step with the same settings for another model (a draft), or None where it cannot run compiled."""
        ...

    def cache_bytes(self) -> int:
        """Bytes its caches hold now."""
        ...


class CallState(Protocol):
    """The part of a model's patch a runner reads."""

    @property
    def compiled_step(self) -> DecodeStep | None: ...

    @property
    def kv_cache(self) -> RollbackCache | None: ...


class Call(Protocol):
    """One ``generate`` call, as a runner gets it (:class:`~hf_accel.runtime.generation.GenerateCall`)."""

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def state(self) -> CallState: ...

    @property
    def args(self) -> tuple[Any, ...]: ...

    @property
    def kwargs(self) -> dict[str, Any]: ...

    def run_stock(self, **overrides: Any) -> Any:
        """The model's original ``generate``, over the patch's cache or compiled step where they serve."""
        ...

    def reusable_cache(self) -> RollbackCache | None:
        """The patch's KV cache, emptied, if this call may use it."""
        ...


class GenerateRunner(Protocol):
    """Replaces stock ``generate`` for the calls it covers (a speculative backend's loop)."""

    def __call__(self, call: Call) -> Any:
        """Run the call, or hand it to ``call.run_stock()``."""
        ...
