"""What an actor's death looks like from the controller."""

from __future__ import annotations

from typing import Any

import ray
import ray.exceptions

# Raised by awaiting a call on an actor whose process died (or whose node is gone).
ACTOR_LOST = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


def cause(error: BaseException) -> str:
    """Ray's account of a death, first line only (the rest is its advice on debugging)."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}".rstrip(": ")


def unwrapped(refs: Any) -> Any:
    """`ray.get(refs)`, raising what the actor raised as it was (a `DamagedState` stays one,
    with its own message), not inside Ray's account of the remote traceback."""
    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as error:
        raise error.cause from None
