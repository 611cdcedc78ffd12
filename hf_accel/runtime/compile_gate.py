"""Keeps patched calls in other threads from running while a patched model compiles.

While any thread compiles, torch (2.13) holds ``torch.compiler.is_compiling()`` True in every thread: a
process-wide flag for the whole compile session. Code that branches on it then takes its compiling path in
threads that merely run meanwhile: transformers' kernel wrappers (``use_kernelized_func``, on the attention of
Llama-family models) switch a context variable to a process-wide one and raise ``TypeError`` when two threads
interleave, and transformers' own checks are skipped. So a compile waits until no patched call of another
thread is running, and patched calls wait while a compile runs. Calls of other code in other threads are not
covered (see docs/reliability.md).

Example::

    with COMPILE_GATE.call():           # around a patched generate call
        ...
        with COMPILE_GATE.compiling():  # around a compile inside it: other threads' calls finish first
            ...
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

logger = logging.getLogger(__name__)


class CompileGate:
    """A readers-writer lock: patched calls share it, a compile holds it alone. A thread's calls may nest, and
    a compile inside a call does not wait for that call (it puts its share down while it waits and compiles).
    Once a compile waits, new calls wait behind it, so a busy server still gets its compile: what that costs
    them is the rest of the longest call in progress (at most ``patience``) and the compile, once per shape
    class a model compiles."""

    def __init__(self, patience: float = 60.0) -> None:
        #: Seconds a compile waits for other threads' calls to end before it compiles beside them (a call
        #: that waits on the compiling thread, e.g. for a model it holds, would otherwise never end).
        self.patience = patience
        self._changed = threading.Condition(threading.Lock())
        self._calls: dict[int, int] = {}  # thread id -> depth of its calls in progress
        self._compiling: int | None = None  # the thread compiling, if one is
        self._waiting = 0  # compiles waiting for the calls in progress

    def __repr__(self) -> str:
        return (f"<CompileGate: {len(self._calls)} threads in calls, compiling: {self._compiling is not None}, "
                f"{self._waiting} compiles waiting>")

    @contextmanager
    def call(self) -> Iterator[None]:
        me = threading.get_ident()
        entered = False
        try:
            with self._changed:
                if not self._calls.get(me):
                    self._changed.wait_for(
                        lambda: self._compiling == me or (self._compiling is None and not self._waiting))
                self._calls[me] = self._calls.get(me, 0) + 1
                entered = True
            yield
        finally:
            if entered:
                with self._changed:
                    self._calls[me] -= 1
                    if not self._calls[me]:
                        del self._calls[me]
                        self._changed.notify_all()

    @contextmanager
    def compiling(self) -> Iterator[None]:
        me = threading.get_ident()
        mine: int | None = None  # this thread's calls put down while it compiles; None: held it already
        try:
            with self._changed:
                if self._compiling != me:
                    mine = self._take_alone(me)
            yield
        finally:
            if mine is not None:
                with self._changed:
                    self._compiling = None
                    self._restore(me, mine)

    def _take_alone(self, me: int) -> int:
        """Wait (holding the condition) until no other thread is in a call or compiling, then hold the gate;
        this thread's own calls are put down meanwhile. Returns their depth."""
        mine = self._calls.pop(me, 0)
        self._waiting += 1
        self._changed.notify_all()  # calls waiting on this thread's share see it gone
        try:
            if not self._changed.wait_for(lambda: self._compiling is None and not self._calls,
                                          timeout=self.patience):
                # A call that outlasts the patience, or one waiting on this thread (for a model whose lock it
                # holds): compiling beside it is what torch does without the gate.
                logger.warning("hf_accel: compiling while %d other threads' calls run, after waiting %.0f s for "
                               "them; code in them that asks torch.compiler.is_compiling() sees True meanwhile",
                               len(self._calls), self.patience)
                self._changed.wait_for(lambda: self._compiling is None)
        except BaseException:
            self._restore(me, mine)
            raise
        finally:
            self._waiting -= 1
        self._compiling = me
        return mine

    def _restore(self, me: int, depth: int) -> None:
        if depth:
            self._calls[me] = depth
        self._changed.notify_all()

    def _forget(self) -> None:
        """In a forked child: only the thread that forked is there, with its own calls and compile, if any."""
        me = threading.get_ident()
        calls, compiling = self._calls.get(me), self._compiling == me
        self.__init__(self.patience)
        if calls:
            self._calls[me] = calls
        if compiling:
            self._compiling = me


_PROXY = torch._C._TorchDispatchModeKey.PROXY


def is_tracing() -> bool:
    """Whether this thread's code is being traced rather than run: by dynamo, or by make_fx (AOT tracing, and
    ``torch.export``'s default non-strict mode, which traces in pre-dispatch mode). Not
    ``torch.compiler.is_compiling()`` or ``is_exporting()``: torch holds those True in every thread while any
    thread compiles or exports."""
    if torch.compiler.is_dynamo_compiling():
        return True
    if torch._C._get_dispatch_mode(_PROXY) is not None:  # the dispatch mode stack is per thread
        return True
    # The pre-dispatch mode stack is process-wide; only the thread tracing has the PreDispatch key included.
    return (torch._C._dispatch_tls_is_dispatch_key_included(torch._C.DispatchKey.PreDispatch)
            and torch._ops._get_dispatch_mode_pre_dispatch(_PROXY) is not None)


#: The process's gate: every patched model's calls and compiles go through it.
COMPILE_GATE = CompileGate()
if hasattr(os, "register_at_fork"):  # not on Windows
    os.register_at_fork(after_in_child=COMPILE_GATE._forget)
