"""The per-instance record of a patch, stored on the patched model."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from hf_accel.patching.changes import Changes
from hf_accel.patching.report import PatchReport
from hf_accel.runtime.contracts import DecodeStep, GenerateRunner
from hf_accel.runtime.kv_cache import RollbackCache

if TYPE_CHECKING:
    import pluggy
    from transformers import PreTrainedModel

STATE_ATTR = "_hf_accel_state"


@dataclass
class PatchState:
    """Lives at ``model._hf_accel_state`` while a model is patched; ``unpatch`` removes it."""

    model: PreTrainedModel
    pm: pluggy.PluginManager
    device: torch.device
    dtype: torch.dtype
    report: PatchReport
    original_generate: Callable[..., Any]
    #: What ``patch`` was called with (features, ``verify``, ``plugins`` and options): patching again with the
    #: same is a no-op, with others an error.
    arguments: dict[str, Any] = field(default_factory=dict)
    #: One entry per applied backend, in order; unpatch undoes them newest first.
    changes: list[Changes] = field(default_factory=list)
    #: A loop that replaces stock generate (set by a speculative backend), or None.
    runner: GenerateRunner | None = None
    #: The KV cache every generate call reuses (set by a kv_cache backend), or None for transformers' default.
    kv_cache: RollbackCache | None = None
    #: The compiled decode step stock generate runs (set by a compile backend), or None.
    compiled_step: DecodeStep | None = None
    #: Held by each generate call and by unpatch: concurrent calls on one model run one at a time, so each
    #: returns what it would alone (the caches, compiled steps and draft-length state are per model).
    lock: threading.RLock = field(default_factory=threading.RLock)
    #: generate calls of this model in progress on the thread holding the lock: a call made from inside
    #: another (a plugin's hook) runs stock generate, since the patch's caches are in use.
    depth: int = 0
    #: Run at the start of each generate call: backends' checks that what they prepared still matches.
    call_checks: list[Callable[[], None]] = field(default_factory=list)
    #: feature -> what its backend holds -> bytes now (negative: what it freed), read at each ``report``.
    memory: dict[str, dict[str, Callable[[], int]]] = field(default_factory=dict)

    def __repr__(self) -> str:
        return f"<PatchState of {type(self.model).__name__}: {len(self.changes)} backends applied>"


def get_state(model: PreTrainedModel) -> PatchState | None:
    return vars(model).get(STATE_ATTR)
