"""What patch() did, per feature: `hf_accel.report(model)`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from hf_accel.patching.features import FEATURE_NAMES


@dataclass
class Verification:
    """How a backend's probe compared with the model before it was applied."""

    probe: str
    passed: bool
    error: float | None = None
    tolerance: float | None = None
    top1_agreement: float | None = None
    detail: str = ""
    #: Where the error was largest: a layer the backend replaced, or a row and position of the probe.
    where: str = ""

    def __str__(self) -> str:
        if not self.passed and self.error is None:
            return f"FAILED: {self.detail}"
        if self.probe == "generate":
            if self.passed:
                return "ok: greedy tokens identical"
            return f"FAILED: greedy tokens differ{' from ' + self.where if self.where else ''}"
        what = "output error" if self.probe == "layer" else "logit error"
        where = f" at {self.where}" if self.where and not self.passed else ""
        parts = [f"{'ok' if self.passed else 'FAILED'}: {what} {self.error:.1e}{where} (bound {self.tolerance:.0e})"]
        if self.top1_agreement is not None and self.top1_agreement < 1:
            parts.append(f"top-1 agreement {self.top1_agreement:.0%}")
        return ", ".join(parts)


@dataclass
class FeatureReport:
    """One feature's outcome. ``backend`` is None when the feature is off or nothing could serve it."""

    feature: str
    backend: str | None = None
    plugin: str | None = None
    reason: str = ""
    skipped: list[dict[str, str]] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)
    weight_bytes_before: int | None = None
    weight_bytes_after: int | None = None
    verification: Verification | None = None
    details: dict[str, Any] = field(default_factory=dict)
    #: Bytes this feature holds beyond the unpatched model, by what holds them (negative: freed), as of the
    #: last ``hf_accel.report(model)``.
    memory: dict[str, int] = field(default_factory=dict)

    def skip(self, backend: str, reason: str) -> None:
        self.skipped.append({"backend": backend, "reason": reason})

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(asdict(self))


@dataclass
class PatchReport:
    """Per-feature outcome of ``hf_accel.patch``.

    Example::

        >>> print(hf_accel.report(model))          # a table
        >>> hf_accel.report(model).to_dict()["attention"]["backend"]
        'sdpa'
    """

    model: str
    device: str
    dtype: str
    features: dict[str, FeatureReport]

    def __getitem__(self, feature: str) -> FeatureReport:
        return self.features[feature]

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable; the feature names are top-level keys."""
        out: dict[str, Any] = {name: self.features[name].to_dict() for name in FEATURE_NAMES}
        out["model"] = {"class": self.model, "device": self.device, "dtype": self.dtype}
        out["memory_bytes"] = self.memory_bytes
        return out

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @property
    def memory_bytes(self) -> int:
        """Bytes the patch holds beyond the unpatched model, every feature together (freed bytes subtracted)."""
        return sum(sum(feat.memory.values()) for feat in self.features.values())

    def __repr__(self) -> str:
        chosen = ", ".join(f"{n}={self.features[n].backend}" for n in FEATURE_NAMES)
        return f"<PatchReport {self.model} on {self.device}/{self.dtype}: {chosen}>"

    def __str__(self) -> str:
        rows = [("feature", "backend", "why", "verification")]
        for name in FEATURE_NAMES:
            feat = self.features[name]
            rows.append((name, feat.backend or "-", feat.reason, str(feat.verification or "")))
        lines = [f"hf_accel report for {self.model} ({self.device}, {self.dtype})", *_table(rows)]
        for name in FEATURE_NAMES:
            feat = self.features[name]
            lines += [f"  {name}: skipped {s['backend']}: {s['reason']}" for s in feat.skipped]
            if feat.weight_bytes_before is not None and feat.weight_bytes_after is not None:
                lines.append(
                    f"  {name}: weights {feat.weight_bytes_before / 2**20:.1f} MiB -> "
                    f"{feat.weight_bytes_after / 2**20:.1f} MiB over {len(feat.modules)} modules"
                )
            lines += [f"  {name}: {key} = {_short(value)}" for key, value in feat.details.items()]
            lines += [f"  {name}: memory: {item} {_mib(held)}" for item, held in feat.memory.items()]
        lines.append(f"memory held beyond the unpatched model: {_mib(self.memory_bytes)} (compiled graphs' own "
                     "buffers and allocator overhead not counted)")
        return "\n".join(lines)


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [fmt.format(*rows[0]).rstrip(), "  ".join("-" * w for w in widths)]
    out += [fmt.format(*row).rstrip() for row in rows[1:]]
    return out


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:+.1f} MiB"


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(dict(value)) if isinstance(value, dict) else str(value)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
