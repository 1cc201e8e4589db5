"""megatron's "an inference engine is using the model" flag, made per thread.

megatron 0.19 keeps the flag process-wide (`InferenceMode`): its dynamic engine sets it when
built and at each `resume()`, clears it at `suspend()`, and the model's forward reads it to take
the inference paths (its output layer then asserts the logits are gathered; attention, the
transformer block and the layers branch on it too). Colocated, the trainer's forward runs only
while the engine is suspended, so a process-wide flag is right. Apart (`colocated: false`) the
engine keeps serving its own copy of the model while the trainer steps in the same process, so
the trainer's forward would see the flag set and fail or take the engine's paths.

`install()` keeps the flag per thread instead: the engine sets and clears it on the one thread
that owns it (`MegatronInference`), and every other thread (the trainer's) reads it unset.
"""

from __future__ import annotations

import threading

from megatron.core.inference.utils import InferenceMode


class _Flag(threading.local):
    active = False


_FLAG = _Flag()


def _is_active(cls: type) -> bool:
    return _FLAG.active


def _set_active(cls: type) -> None:
    _FLAG.active = True


def _unset_active(cls: type) -> None:
    _FLAG.active = False


def install() -> None:
    """Make `InferenceMode` per thread (idempotent)."""
    InferenceMode.is_active = classmethod(_is_active)  # type: ignore[method-assign,assignment]
    InferenceMode.set_active = classmethod(_set_active)  # type: ignore[method-assign,assignment]
    InferenceMode.unset_active = classmethod(_unset_active)  # type: ignore[method-assign,assignment]
