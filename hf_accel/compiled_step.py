"""A compiled forward over a fixed-shape KV cache: stock ``generate``'s decode step, and the chunks the
speculative loop verifies and drafts.

``generate`` runs the prompt eagerly, then calls ``model.get_compiled_call(...)`` for every decode step when
the cache is a compileable one. :class:`CompiledDecodeStep` is what that call returns on a patched model: a
``torch.compile`` of the model's forward that counts its compilations, times them, checks each new graph
against the eager forward once, and falls back to eager (with the reason) if compiling fails.

Shapes stay fixed: the cache's length is a bucket (a multiple of :data:`BUCKET`) reused by every later call
that fits, so calls with other prompt lengths and ``max_new_tokens`` run the graph already compiled.
Sliding-window layers get window-sized layers (transformers' ``StaticCache`` builds them from the config).

Example::

    step = CompiledDecodeStep(model)
    kwargs = step.generate_kwargs(batch_size=1, needed_length=400)  # cache + compile config
    model.generate(**inputs, max_new_tokens=128, **kwargs)
"""

from __future__ import annotations

import logging
import time
import types
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
from transformers import StaticCache
from transformers.cache_utils import Cache
from transformers.generation import CompileConfig

from .kv_cache import RollbackStaticCache

logger = logging.getLogger(__name__)

#: Cache lengths are rounded up to a multiple of this, and a cache serves every later call that fits in it,
#: so most calls meet shapes already compiled.
BUCKET = 256
#: Relative logit error above which a freshly compiled graph is refused: exact fp32 graphs measure ~1e-6.
CHECK_TOLERANCE = 1e-3
#: The same where activations are rounded to bf16 (quantized Linear kernels): inductor fuses the casts, which
#: moves logits by about one bf16 rounding (SmolLM2 int4: 5.5e-3).
BF16_CHECK_TOLERANCE = 2e-2


class CountingBackend:
    """Inductor, counting the graphs it compiles. ``mode`` as in ``torch.compile`` (``"reduce-overhead"``
    turns on CUDA graphs)."""

    def __init__(self, mode: str | None = None) -> None:
        self.mode = mode
        self.graphs = 0

    def __call__(self, graph: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> Any:
        from torch._inductor import list_mode_options
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        return compile_fx(graph, example_inputs, config_patches=list_mode_options(self.mode) if self.mode else None)


@dataclass
class CompileStats:
    """What compiling has cost and done so far, for the report."""

    graphs_compiled: int = 0
    compile_seconds: float = 0.0
    compiled_steps: int = 0
    eager_steps: int = 0
    shapes: int = 0  # distinct (batch, cache length) signatures seen
    check_error: float | None = None  # worst relative logit error of a new graph against the eager forward
    failure: str | None = None  # why the step fell back to eager for good


class CompiledDecodeStep:
    """The model's forward, compiled for decode steps, and the fixed-shape caches it runs over."""

    def __init__(self, model: torch.nn.Module, mode: str | None = None, bucket: int = BUCKET,
                 details: dict[str, Any] | None = None, tolerance: float = CHECK_TOLERANCE) -> None:
        self.model = model
        self.tolerance = tolerance
        self.details = {} if details is None else details  # kept up to date with the stats (the report's)
        self.bucket = bucket
        self.backend = CountingBackend(mode)
        self.eager = model.__call__
        # dynamic=None: a number that changes between steps (a sliding layer's fill level) is made symbolic after
        # its first change instead of recompiling at every step.
        self.compiled = torch.compile(_calling(model), backend=self.backend, dynamic=None, fullgraph=False)
        self.stats = CompileStats()
        # Only turns on transformers' switch to get_compiled_call (which returns self); its settings are unused.
        self.compile_config = CompileConfig()
        self.compile_config._compile_all_devices = True  # transformers only auto-compiles on accelerators otherwise
        self._caches: dict[tuple[int, bool], tuple[int, Cache]] = {}  # (batch size, rollback) -> (positions, cache)
        self._checked: set[tuple] = set()
        self._publish()

    def __repr__(self) -> str:
        s = self.stats
        return (f"<CompiledDecodeStep: {s.graphs_compiled} graphs in {s.compile_seconds:.1f}s, "
                f"{s.compiled_steps} compiled steps{', failed: ' + s.failure if s.failure else ''}>")

    # -- what generate is given ---------------------------------------------------------------------------
    def generate_kwargs(self, batch_size: int, needed_length: int) -> dict[str, Any]:
        """``past_key_values`` and ``compile_config`` for a ``generate`` call of this batch size and length."""
        return {"past_key_values": self.cache_for(batch_size, needed_length), "compile_config": self.compile_config}

    def cache_for(self, batch_size: int, needed_length: int, rollback: bool = False) -> Cache:
        """The cache for this batch size, emptied; reallocated (one bucket larger) only when it is too short.
        ``rollback=True``: a :class:`~hf_accel.kv_cache.RollbackStaticCache` (full-length layers that can be
        cropped and realigned), for the speculative loop."""
        length, cache = self._caches.get((batch_size, rollback), (0, None))
        if cache is None or length < needed_length:
            length = -(-needed_length // self.bucket) * self.bucket
            kind = RollbackStaticCache if rollback else StaticCache
            cache = kind(self.model.config, max_cache_len=length)
            self._caches[batch_size, rollback] = (length, cache)
            logger.debug("%s for batch %d: %d positions", kind.__name__, batch_size, length)
        else:
            cache.reset()
        return cache

    def for_model(self, model: torch.nn.Module, details: dict[str, Any] | None = None,
                  tolerance: float | None = None) -> CompiledDecodeStep:
        """A compiled forward with this one's settings for ``model`` (the same one, or a draft model), with
        graphs, caches and statistics of its own."""
        return CompiledDecodeStep(model, mode=self.backend.mode, bucket=self.bucket, details=details,
                                  tolerance=self.tolerance if tolerance is None else tolerance)

    def get_compiled_call(self, compile_config: Any = None) -> CompiledDecodeStep:  # noqa: ARG002
        """Stands in for ``PreTrainedModel.get_compiled_call`` on the patched instance."""
        return self

    # -- one decode step ----------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.stats.failure is not None:
            return self._eager_step(args, kwargs)
        signature = _signature(kwargs)
        if signature not in self._checked:
            out = self._first_call(signature, args, kwargs)
            self._publish()
            return out
        graphs, start = self.backend.graphs, time.perf_counter()
        try:
            out = self.compiled(*args, **kwargs)
        except Exception as exc:  # a recompile that fails (compiling happens before the graph runs)
            self._fail(f"recompiling raised {_describe(exc)}")
            return self._eager_step(args, kwargs)
        self.stats.compiled_steps += 1
        if self.backend.graphs != graphs:
            self._count_compile(graphs, start)
        self.details["compiled_steps"] = self.stats.compiled_steps
        return out

    def _count_compile(self, graphs_before: int, start: float) -> None:
        self.stats.compile_seconds += time.perf_counter() - start
        self.stats.graphs_compiled += self.backend.graphs - graphs_before
        self._publish()

    def _publish(self) -> None:
        self.details.update(asdict(self.stats), bucket=self.bucket, mode=self.backend.mode or "default")

    def _first_call(self, signature: tuple, args: tuple, kwargs: dict[str, Any]) -> Any:
        """Compile for a new shape, then check the graph against the eager forward on the same step; the
        eager result is the one returned, so a wrong graph never reaches the output."""
        cache = _cache_in(kwargs)
        snapshot = _snapshot(cache)
        graphs, start = self.backend.graphs, time.perf_counter()
        try:
            compiled = self.compiled(*args, **kwargs)
        except Exception as exc:  # a missing compiler, an op inductor cannot lower, ...
            self._fail(f"compiling raised {_describe(exc)}")
            _restore(cache, snapshot)
            return self._eager_step(args, kwargs)
        self._count_compile(graphs, start)
        self.stats.shapes += 1
        _restore(cache, snapshot)
        eager = self.eager(*args, **kwargs)
        error = _relative_error(eager.logits, compiled.logits)
        self.stats.check_error = max(error, self.stats.check_error or 0.0)
        if not error <= self.tolerance:
            self._fail(f"the compiled step's logits differ from eager by {error:.2e} (limit {self.tolerance:.0e})")
        self._checked.add(signature)
        self.stats.eager_steps += 1
        return eager

    def _eager_step(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        self.stats.eager_steps += 1
        self.details["eager_steps"] = self.stats.eager_steps
        return self.eager(*args, **kwargs)

    def _fail(self, reason: str) -> None:
        self.stats.failure = reason
        self._publish()
        logger.warning("hf_accel: the compiled decode step is off, running eager: %s", reason)


def _calling(model: torch.nn.Module) -> Callable[..., Any]:
    """``model(*args, **kwargs)`` as a function with a code object of its own. Dynamo keeps compiled graphs,
    and its limit on recompiles, per code object; every model's ``__call__`` shares one, so without this a
    second patched model would reuse (or exhaust) the first one's entries."""

    def decode_step(*args: Any, **kwargs: Any) -> Any:
        return model(*args, **kwargs)

    code = decode_step.__code__.replace(co_name=f"decode_step_{id(model):x}")
    return types.FunctionType(code, decode_step.__globals__, code.co_name, None, decode_step.__closure__)


def _describe(exc: Exception) -> str:
    """The exception that caused it all (dynamo wraps a backend's error), as ``Type: first line``."""
    inner = getattr(exc, "inner_exception", None) or exc
    text = str(inner).strip()
    return f"{type(inner).__name__}: {text.splitlines()[0] if text else ''}"


def _signature(kwargs: dict[str, Any]) -> tuple:
    """The shapes a compiled graph is specialized on: every tensor argument's, and which cache (each cache
    has one length for good)."""
    shapes = []
    for name, value in sorted(kwargs.items()):
        if isinstance(value, torch.Tensor):
            shapes.append((name, tuple(value.shape)))
        elif isinstance(value, dict):  # per-layer-type masks
            shapes.append((name, tuple((k, tuple(v.shape)) for k, v in sorted(value.items()) if v is not None)))
    return tuple(shapes) + (id(_cache_in(kwargs)),)


def _cache_in(kwargs: dict[str, Any]) -> Cache | None:
    """The KV cache a forward call was given, whatever the argument is called (``past_key_values``, or
    ``cache`` in later transformers)."""
    return next((value for value in kwargs.values() if isinstance(value, Cache)), None)


def _snapshot(cache: Any) -> list[dict[str, Any]] | None:
    """Each layer's tensors (copied) and numbers (e.g. the Python-int length a sliding layer keeps)."""
    if cache is None:
        return None
    return [{name: value.clone() if isinstance(value, torch.Tensor) else value
             for name, value in vars(layer).items() if isinstance(value, (torch.Tensor, int, float))}
            for layer in cache.layers]


def _restore(cache: Any, snapshot: list[dict[str, Any]] | None) -> None:
    """Put the saved state back, tensors in place (compiled graphs hold the cache's addresses)."""
    if cache is None or snapshot is None:
        return
    for layer, saved in zip(cache.layers, snapshot):
        for name, value in saved.items():
            current = getattr(layer, name)
            if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor) and current.shape == value.shape:
                current.copy_(value)
            else:
                setattr(layer, name, value)


def _relative_error(reference: torch.Tensor, actual: torch.Tensor) -> float:
    reference, actual = reference.float(), actual.float()
    return ((actual - reference).abs().max() / reference.abs().max().clamp_min(1e-12)).item()
