"""Compiled decode-step graphs kept between processes, under a directory the user can set and clear.

hf_accel compiles its decoder-layer graphs with the compiler's own cache pointed at ``compile/code`` inside
the store (the compile backend's :class:`~hf_accel.runtime.layer_graphs.GraphCompiler` says how: inductor's
through its cache directory), for the duration of its own compiles only, so that everything those compiles
produce (generated code, compiled kernels, AOTAutograd graphs, keyed by torch itself) lives, and is cleared, in
one place, and a later process compiling the same shape class hits that cache: ~0.5-3 s instead of ~4-15 s on
a 2-core CPU. Beside it an index records each compiled shape class with its measured compile times and, once
measured, the fraction of a decode step its graph saves, which the compile policy uses.

Index entries are keyed by a fingerprint of what the graph depends on: the model and layer classes, the layer's
parameter shapes and module types (prepacked or quantized Linears), the text config, dtype, device, the
attention implementation, the compile settings and where torch is installed. Weights are graph inputs, so one
entry serves every checkpoint of an architecture. Everything is validated when read: an entry written by other
versions of torch, transformers or hf_accel is stale, one whose recorded fingerprint is not the model's is
foreign, and an unreadable index or a malformed entry is corrupt. Each is discarded from the index with a log
line, never used; a compile that fails inside the store empties it and is retried once. Whatever the store
holds, every graph is checked against the eager layer before a call uses it. Compiled code itself is keyed by
torch (by graph, versions and CPU), so stale code is never loaded; it stays on disk until ``hf-accel cache
clear``.

Location: ``HF_ACCEL_CACHE``, else ``$XDG_CACHE_HOME/hf_accel``, else ``~/.cache/hf_accel`` (a directory under
the system's temporary directory where there is no home); ``compile/`` inside it. ``hf-accel cache info``
shows it, ``hf-accel cache clear`` empties it. A store that cannot be written costs compiles, nothing more.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch
from torch import nn

from hf_accel.runtime.compile_policy import valid_saving

if TYPE_CHECKING:
    from hf_accel.runtime.layer_graphs import GraphCompiler

#: The index key of a shape class's measured saving: from median step times (an earlier "saved_fraction" came
#: from means, which one slow step could pin at the floor, and is not read).
SAVING_KEY = "median_saving"

logger = logging.getLogger(__name__)

FORMAT = 2  # 2: compiled code under compile/code (it was compile/inductor), the compiler in the fingerprint
#: Compiles into a store hold this lock: a compiler may point a setting of the whole process at the store (an
#: environment variable), so two threads' compiles must not interleave their changes to it.
_COMPILING = threading.RLock()


def default_cache_dir() -> Path:
    """``HF_ACCEL_CACHE``, else ``$XDG_CACHE_HOME/hf_accel``, else ``~/.cache/hf_accel``."""
    if os.environ.get("HF_ACCEL_CACHE"):
        return Path(os.environ["HF_ACCEL_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "hf_accel"
    try:
        return Path.home() / ".cache" / "hf_accel"
    except RuntimeError:  # no home directory to be found (a container user without one)
        return Path(tempfile.gettempdir()) / f"hf_accel-{os.getuid()}"


def versions() -> dict[str, str]:
    import transformers

    from hf_accel.version import __version__

    return {"torch": torch.__version__, "transformers": transformers.__version__, "hf_accel": __version__}


def fingerprint(model: nn.Module, layer: nn.Module, kind: str, **settings: Any) -> dict[str, Any]:
    """What a compiled decoder layer depends on, versions apart (see :func:`versions`). Where torch is installed
    too: inductor keys its compiled C++ on the install's include paths, so another virtual environment compiles
    it anew (a compile the store expected to take ~3 s took 13 s there); its entries are its own, and two
    environments sharing the cache directory keep theirs side by side."""
    from hf_accel.runtime.layer_graphs import GRAPH_INPUTS  # here: `hf-accel cache` needs no transformers

    config = model.config.get_text_config(decoder=True).to_dict()
    for volatile in ("_name_or_path", "transformers_version", "architectures", "torch_dtype", "dtype"):
        config.pop(volatile, None)
    structure = [[name, type(module).__name__] for name, module in layer.named_modules()]
    tensors = [[name, list(t.shape), str(t.dtype)] for name, t in (*layer.named_parameters(), *layer.named_buffers())]
    linears = sorted({type(m).__name__ for m in layer.modules() if "Linear" in type(m).__name__})
    param = next(layer.parameters(), None)
    return {
        "model": type(model).__name__, "kind": kind, "linears": linears,
        "device": param.device.type if param is not None else "cpu",
        "attention": getattr(model.config, "_attn_implementation", None),
        "config": hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()).hexdigest()[:16],
        "layer": hashlib.sha256(json.dumps([structure, tensors]).encode()).hexdigest()[:16],
        "inputs": GRAPH_INPUTS,
        "settings": {k: v for k, v in sorted(settings.items())},
        "torch_at": str(Path(torch.__file__).resolve().parent),
    }


@dataclass(frozen=True)
class StoreEntry:
    key: str
    model: str
    shape: str
    cold_seconds: float | None
    warm_seconds: float | None
    created: str


@dataclass(frozen=True)
class Stored:
    """A shape class the store has compiled: how long compiling it took from the store, and the fraction of a
    decode step compiling saved, where measured."""

    warm_seconds: float | None
    saved_fraction: float | None = None


class CompileStore:
    """The compile cache in ``directory`` (see the module docs).

    Example::

        store = CompileStore(default_cache_dir())
        with store.compiling(compiler):                      # the compiler's cache is the store's
            compiled(...)
        store.record(fingerprint, shape, seconds, warm=False)
        store.lookup(fingerprint, shape)                     # in a later process: Stored(...), or None
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(directory) if directory is not None else default_cache_dir()
        self.directory = self.root / "compile"
        self.code_directory = self.directory / "code"
        self._pruned = False
        self._unwritable = False

    def __repr__(self) -> str:
        return f"<CompileStore {self.directory}>"

    # -- for the compiled step ------------------------------------------------------------------------------
    def lookup(self, fp: dict[str, Any], shape: Any) -> Stored | None:
        """What the store knows of ``shape`` compiled for ``fp``, or None."""
        key = _key(fp, shape)
        entry = self._entries().get(key)
        if entry is None or not self._valid(entry, fp, key):
            return None
        return Stored(entry.get("warm_seconds"), entry.get(SAVING_KEY))

    @contextlib.contextmanager
    def compiling(self, compiler: GraphCompiler) -> Iterator[None]:
        """The compiler keeps its compiled code in this store while a compile runs (under a lock); a store that
        cannot be created is skipped."""
        with _COMPILING:
            try:
                self.code_directory.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                self._warn_unwritable(exc)
                yield
                return
            with compiler.caching_in(self.code_directory):
                yield

    def record(self, fp: dict[str, Any], shape: Any, seconds: float, warm: bool) -> None:
        """Keep a compiled shape class and how long compiling it took (``warm``: the store already had it)."""
        def edit(entry: Any) -> dict[str, Any]:
            entry = entry if _well_formed_entry(entry) else {}
            entry.update(fingerprint=fp, versions=versions(), shape=str(shape), created=entry.get("created", _now()))
            entry["warm_seconds" if warm else "cold_seconds"] = round(seconds, 3)
            return entry

        self._edit_entry(fp, shape, edit)

    def record_saving(self, fp: dict[str, Any], shape: Any, fraction: float) -> None:
        """Keep what compiling ``shape`` saved of a decode step here (the shape class must be recorded)."""
        def edit(entry: Any) -> dict[str, Any] | None:
            if not _well_formed_entry(entry):
                return None
            kept = {k: v for k, v in entry.items() if k != "saved_fraction"}  # from means, not read any more
            return {**kept, SAVING_KEY: fraction}

        self._edit_entry(fp, shape, edit)

    def _edit_entry(self, fp: dict[str, Any], shape: Any, edit: Callable[[Any], dict[str, Any] | None]) -> None:
        """Replace the index's entry for ``shape`` by ``edit(entry)`` (None: leave it), under the index's lock."""
        key = _key(fp, shape)
        try:
            with self._locked_index() as index:
                entry = edit(index["entries"].get(key))
                if entry is not None:
                    index["entries"][key] = entry
        except OSError as exc:
            self._warn_unwritable(exc)

    def reset(self, why: str) -> None:
        """Empty the store (its compiled code could not be used), with a log line saying why."""
        logger.warning("hf_accel: emptying the compile cache %s: %s", self.directory, why)
        self.clear()

    # -- for the CLI -------------------------------------------------------------------------------------
    def entries(self) -> list[StoreEntry]:
        return [StoreEntry(key, _model_label(e["fingerprint"]), str(e.get("shape", "?")), e.get("cold_seconds"),
                           e.get("warm_seconds"), str(e.get("created", "?")))
                for key, e in sorted(self._entries().items(), key=lambda kv: str(kv[1].get("created", "")))]

    def size_bytes(self) -> int:
        if not self.directory.is_dir():
            return 0
        return sum(p.stat().st_size for p in self.directory.rglob("*") if p.is_file())

    def clear(self) -> int:
        """Delete what the store holds (its index and compiled code, nothing else in its directory); the
        bytes freed."""
        size = self.size_bytes()
        for code in (self.code_directory, self.directory / "inductor"):  # and where format 1 kept it
            shutil.rmtree(code, ignore_errors=True)
        with contextlib.suppress(OSError):
            (self.directory / "index.json").unlink(missing_ok=True)
        return size - self.size_bytes()

    # -- the index ---------------------------------------------------------------------------------------
    def _entries(self) -> dict[str, dict[str, Any]]:
        """The index's well-formed entries of these versions; the first read in a process discards the rest
        from the index, each with a log line."""
        path = self.directory / "index.json"
        if not path.is_file():
            return {}
        try:
            index = json.loads(path.read_text())
            if not _well_formed(index):
                raise ValueError(f"not a format-{FORMAT} index")
        except (OSError, ValueError) as exc:
            logger.warning("hf_accel: discarding the compile cache index %s, which is unreadable (%s)", path, exc)
            with contextlib.suppress(OSError):
                path.unlink()
            return {}
        current = versions()
        usable = {}
        for key, entry in index["entries"].items():
            if not _well_formed_entry(entry):
                self._discard_once(key, "it is malformed")
            elif entry["versions"] != current:
                self._discard_once(key, f"it was written by {_versions_text(entry['versions'])}, this is "
                                        f"{_versions_text(current)}", level=logging.INFO)
            else:
                usable[key] = entry
        self._pruned = True
        return usable

    def _valid(self, entry: dict[str, Any], fp: dict[str, Any], key: str) -> bool:
        if entry["fingerprint"] != fp:
            self._discard(key, f"it records another model ({entry['fingerprint'].get('model', '?')}) under this "
                               "model's key")
            return False
        if not self.code_directory.is_dir():
            self._discard(key, "its compiled code is gone")
            return False
        return True

    def _discard_once(self, key: str, why: str, level: int = logging.WARNING) -> None:
        if not self._pruned:
            self._discard(key, why, level)

    def _discard(self, key: str, why: str, level: int = logging.WARNING) -> None:
        logger.log(level, "hf_accel: discarding compile cache entry %s: %s", key, why)
        with contextlib.suppress(OSError), self._locked_index() as index:
            index["entries"].pop(key, None)

    @contextlib.contextmanager
    def _locked_index(self) -> Iterator[dict[str, Any]]:
        """The index, read and rewritten under a lock (several processes may compile at once)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / "index.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            path = self.directory / "index.json"
            try:
                index = json.loads(path.read_text()) if path.is_file() else None
            except ValueError:
                index = None
            if not _well_formed(index):
                index = {"format": FORMAT, "entries": {}}
            yield index
            _write_atomic(path, json.dumps(index, indent=1).encode())

    def _warn_unwritable(self, exc: OSError) -> None:
        if not self._unwritable:
            self._unwritable = True
            logger.warning("hf_accel: the compile cache %s cannot be written (%s); compiled code is not kept "
                           "between processes (set HF_ACCEL_CACHE to a writable directory)", self.directory, exc)


def _well_formed(index: Any) -> bool:
    return isinstance(index, dict) and index.get("format") == FORMAT and isinstance(index.get("entries"), dict)


def _well_formed_entry(entry: Any) -> bool:
    if not isinstance(entry, dict):
        return False
    seconds_ok = all(isinstance(entry.get(k), (int, float)) or entry.get(k) is None
                     for k in ("cold_seconds", "warm_seconds"))
    saving = entry.get(SAVING_KEY)
    return (seconds_ok and (saving is None or valid_saving(saving)) and isinstance(entry.get("fingerprint"), dict)
            and isinstance(entry.get("versions"), dict))


def _model_label(fp: dict[str, Any]) -> str:
    linears = fp.get("linears")
    return f"{fp.get('model', '?')} ({', '.join(linears)})" if linears else str(fp.get("model", "?"))


def _key(fp: dict[str, Any], shape: Any) -> str:
    return hashlib.sha256(json.dumps([fp, str(shape)], sort_keys=True).encode()).hexdigest()[:24]


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _versions_text(v: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v.get(k)}" for k in ("torch", "transformers", "hf_accel"))


def _now() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")
