"""The hooks a plugin can implement. Every hook is documented in docs/hooks.md."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence

import pluggy

if TYPE_CHECKING:
    from hf_accel.patching.backends import Backend, PatchContext
    from hf_accel.runtime.generation import GenerateCall

hookspec = pluggy.HookspecMarker("hf_accel")
hookimpl = pluggy.HookimplMarker("hf_accel")


@hookspec
def hf_accel_register_backends(register: Callable[[Backend], None]) -> None:
    """Register this plugin's backends by calling ``register(Backend(...))`` once per backend.

    :param register: adds one backend; raises ``ValueError`` if its name is already taken.
    """


@hookspec(firstresult=True)
def hf_accel_select_backend(
    feature: str, candidates: Sequence[Backend], context: PatchContext
) -> Backend | None:
    """Pick the backend that ``"auto"`` uses for ``feature``, or return ``None`` to let the next plugin decide.

    :param feature: one of ``hf_accel.FEATURES``.
    :param candidates: the backends that can run here, best first (by ``Backend.priority``).
    :param context: the model being patched, its device and dtype, and the user's options.
    """


@hookspec(firstresult=True)
def hf_accel_generate(call: GenerateCall) -> Any:
    """Run one ``generate`` call of a patched model. Implement it with ``wrapper=True`` to act around the call.

    The core's own implementation runs last and executes ``call``: a backend's replacement loop if one
    was installed (speculative decoding), else the model's original ``generate``.

    :param call: the model, its patch state, and the ``args``/``kwargs`` the user passed.
    """
