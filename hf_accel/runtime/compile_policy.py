"""When to compile a shape class of decoder layers: at first use, or once waiting for it has cost enough.

Until a shape class is compiled its layers run eagerly on the patch's other backends (prepacked weights,
the static cache, speculation), which is already most of the speedup: on SmolLM2 on a 2-core CPU the loop
over prepacked weights ran 2.79x stock uncompiled and 3.13x compiled (docs/benchmarks.md). So a short script,
or the first call of a notebook, need not wait for a compiler; a long-running process should compile soon.

``when="auto"`` is the ski-rental rule: compile a shape class once running eagerly has lost, in the time a
compiled graph would have saved, as much as compiling is expected to take. What counts as lost is the
decode time that waited for this shape class so far plus what the rest of the current call is expected to
take (its ``max_new_tokens`` at the model's measured eager seconds per token), times the fraction of a
step a compiled graph saves: what this machine measured for that shape class before (:class:`StepTimer`,
kept by the compile cache), else :data:`SAVED_FRACTION`. Each shape class pays for itself: a server's
first batch of three does not stop for a compile because batch-1 calls waited before. So a call long enough
to pay for a compile by itself compiles at its start, and a run of short calls compiles once they have paid. The
estimate is what compiling took on this machine before (from the compile cache, whose compiled code makes
the compile a cache hit), or :data:`COLD_COMPILE_SECONDS` for a shape class this machine never compiled.
``when="first_use"`` compiles every shape class the first time a call needs it.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Collection, Hashable, Iterable, Iterator
from dataclasses import dataclass, field

#: Measured on the 2-core development CPU (SmolLM2-135M, inductor's on-disk cache empty): 13-15 s for the
#: first graph of a process, 4-7 s for later ones.
COLD_COMPILE_SECONDS = 10.0
#: The same for shape classes whose artifacts this machine has (measured: 2.3 s for a process's first graph,
#: 0.5 s for later ones); used until the store has measured a warm compile of its own.
WARM_COMPILE_SECONDS = 2.0
#: What compiling saves of an eager decode step: on SmolLM2, side by side in one `hf-accel bench` run
#: (docs/benchmarks.md), the default patch compiled made 50.1 tok/s and its loop over the same prepacked
#: weights uncompiled (the packing backend alone) 44.6: 11% less time.
SAVED_FRACTION = 0.11
#: Decode steps of each kind (eager, compiled) a process must have timed before it measures what compiling a
#: shape class saved on this machine; the store keeps the measurement for later processes.
MEASURED_STEPS = 8
#: A measured saving is kept within these bounds: a noisy measurement near zero must not stop ``auto`` from
#: ever compiling again on this machine (a later process that waits and then compiles measures anew).
SAVED_FRACTION_BOUNDS = (0.05, 0.9)
#: Timed decode steps of each kind a shape class keeps for the measurement.
KEPT_STEPS = 64

WHEN = ("auto", "first_use")

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Decision:
    """Whether to compile a shape class now, and why (shown in the report)."""

    compile: bool
    reason: str


@dataclass(frozen=True)
class CompilePolicy:
    """:param when: ``"auto"`` (compile once what a graph would have saved exceeds the compile's expected time)
        or ``"first_use"``."""

    when: str = "auto"
    cold_estimate: float = COLD_COMPILE_SECONDS
    warm_estimate: float = WARM_COMPILE_SECONDS
    saved_fraction: float = SAVED_FRACTION

    def __post_init__(self) -> None:
        if self.when not in WHEN:
            raise ValueError(f"compile_when={self.when!r} is not one of {', '.join(map(repr, WHEN))}")

    def decide(self, estimate: tuple[float, str], eager_seconds: float, call_remaining: float = 0.0,
               measured_saving: float | None = None) -> Decision:
        """:param estimate: seconds compiling is expected to take, and where that figure comes from.
        :param eager_seconds: time the model's decode steps have run eagerly waiting for this shape class.
        :param call_remaining: eager seconds the rest of the current call is expected to take.
        :param measured_saving: the fraction of a decode step compiling saved on this machine before (see
            :class:`StepTimer`), instead of ``saved_fraction``."""
        seconds, source = estimate
        if self.when == "first_use":
            return Decision(True, f"compiled at first use (compile_when='first_use'; {source})")
        saved = self.saved_fraction if measured_saving is None else measured_saving
        lost, expected = eager_seconds * saved, call_remaining * saved
        account = f"waiting has lost ~{lost:.1f} s so far" + (
            f" and would lose ~{expected:.1f} s more in this call" if call_remaining else "")
        if measured_saving is not None:
            account += f" (a compiled step measured {measured_saving:.0%} faster here)"
        if lost + expected >= seconds:
            return Decision(True, f"compiled: {account}, more than the ~{seconds:.1f} s compiling takes ({source})")
        return Decision(False, f"eager for now: compiling is expected to take ~{seconds:.1f} s ({source}); "
                               f"{account} (compile_when='first_use' compiles at once)")


@dataclass
class StepTimes:
    """The decode steps of one shape class a process has timed: the latest :data:`KEPT_STEPS` eager ones and
    the first :data:`KEPT_STEPS` compiled ones, the two ends nearest each other in context length where the
    compile lands within a call (one at a call's start follows the longest contexts of the call before)."""

    eager: deque[float] = field(default_factory=lambda: deque(maxlen=KEPT_STEPS))
    compiled: list[float] = field(default_factory=list)

    def add(self, seconds: float, compiled: bool) -> None:
        if not compiled:
            self.eager.append(seconds)
        elif len(self.compiled) < KEPT_STEPS:
            self.compiled.append(seconds)

    def saving(self) -> float | None:
        """``1 - compiled / eager`` of the median step times, once :data:`MEASURED_STEPS` of each were timed.
        Medians, because one compiled step of a busy moment moves a mean of eight by a third or more (and one
        such mean could store the 5% floor for a class that saves 20-37%), and a process's first eager step
        (5-7x a later one, measured on SmolLM2's draft) moves a mean of eight eager steps by half or more."""
        if min(len(self.eager), len(self.compiled)) < MEASURED_STEPS:
            return None
        eager = statistics.median(self.eager)
        return None if eager <= 0 else 1 - statistics.median(self.compiled) / eager


def bounded(saving: float) -> float:
    """A measured saving as the policy counts with it (see :data:`SAVED_FRACTION_BOUNDS`)."""
    low, high = SAVED_FRACTION_BOUNDS
    return round(min(max(saving, low), high), 3)


def valid_saving(value: object) -> bool:
    """Whether a stored saving is one :func:`bounded` could have written (a hand-edited 0 would stop ``auto``)."""
    low, high = SAVED_FRACTION_BOUNDS
    return isinstance(value, (int, float)) and not isinstance(value, bool) and low <= value <= high


@dataclass
class StepTimer:
    """What compiling saves, as a process measures it: each decode step's time, counted for its shape classes
    where they all ran eagerly (waiting) or all compiled, and no compile ran in it. The eager steps come
    first, at shorter contexts than the compiled ones, so the figure is an estimate, which is all the
    policy needs. Example::

        timer.add(shapes, seconds, compiled=False)               # each decode step
        for shape, saving in timer.measured(compiled_shapes):    # at the end of a call
            store.record_saving(fingerprint, shape, saving)
    """

    times: dict[Hashable, StepTimes] = field(default_factory=dict)

    def add(self, shapes: Iterable[Hashable], seconds: float, compiled: bool) -> None:
        for shape in shapes:
            self.times.setdefault(shape, StepTimes()).add(seconds, compiled)

    def measured(self, compiled: Collection[Hashable]) -> Iterator[tuple[Hashable, float]]:
        """Each compiled shape class whose saving is measured now, once (bounded; the raw figure logged)."""
        for shape, times in list(self.times.items()):
            saving = times.saving() if shape in compiled else None
            if saving is not None:
                logger.info("hf_accel: a compiled step of %s measured %.0f%% faster than an eager one", shape,
                            100 * saving)
                self.times[shape] = StepTimes()  # told once: the class runs no eager steps from now on
                yield shape, bounded(saving)
