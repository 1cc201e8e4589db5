"""Reward functions: the built-ins, `resolve` from the recipe's name, and scoring.

A reward function takes `(prompt: Prompt, completion: str)` and returns a float or a dict of
floats with a `"reward"` key (the other keys are logged as `reward/<key>`). `prompt.text` is
the prompt as the source gave it (before any chat template), `prompt.answer` the reference
answer, `prompt.prompt_id` its id; `completion` is the decoded text up to the end-of-sequence
token. It may be a plain or an `async` function; plain ones run in a worker thread. Built-ins
are named: `positional`, `exact_match`, `math` (math-verify equivalence of the final answer,
`pipeline.rewards.math`) and `reasoning_gym` (the prompt source's own answer checker); anything
else is given as `module:function`, importable from the working directory or the environment.
`score_all` scores a group's pairs, returning a function's exception rather than raising it
(an `Exception`, `SystemExit`, or a `CancelledError` nothing asked for: a counted failure); any
other `BaseException` (`KeyboardInterrupt`) raises `RewardAborted`, which stops the run.
The reward stage (`stages.reward`) and Ray's reward workers (`backends.ray.actors`) both use it.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

from pipeline.contracts.errors import PipelineError, RecipeError
from pipeline.contracts.messages import Prompt
from pipeline.contracts.user_code import import_named
from pipeline.rewards.threads import run_abandonable, run_async

log = logging.getLogger("pipeline.rewards")

RewardFn = Callable[[Prompt, str], float | dict[str, float] | Awaitable[float | dict[str, float]]]


def positional_reward(prompt: Prompt, completion: str) -> dict[str, float]:
    """Positions correct / max(len(answer), len(completion)); exact match logged beside."""
    answer = prompt.answer
    longest = max(len(answer), len(completion))
    correct = sum(a == b for a, b in zip(answer, completion, strict=False))
    return {
        "reward": correct / longest if longest else 1.0,
        "exact_match": float(completion == answer),
    }


def exact_match_reward(prompt: Prompt, completion: str) -> float:
    return float(completion.strip() == prompt.answer.strip())


def _math(prompt: Prompt, completion: str) -> dict[str, float]:
    from pipeline.rewards.math import math_reward

    return math_reward(prompt, completion)


BUILTIN: dict[str, RewardFn] = {
    "positional": positional_reward,
    "exact_match": exact_match_reward,
    "math": _math,
}
# Microseconds a sample: scored on the event loop.
CHEAP: tuple[RewardFn, ...] = (positional_reward, exact_match_reward)


def is_cheap(fn: RewardFn) -> bool:
    """A cheap built-in (by identity: a user's callable need not be hashable)."""
    return any(fn is cheap for cheap in CHEAP)


SOURCE_CHECKER = "reasoning_gym"


def resolve(name: str, *, source_reward: RewardFn | None = None) -> RewardFn:
    """The reward function `reward.function` names; `source_reward` is the prompt source's own
    answer checker, if it has one. Raises `RecipeError` for a name that cannot be used."""
    if name == "math":
        from pipeline.rewards.math import _math_verify

        _math_verify()  # a missing package is a recipe error now, not a failure per sample
    if name in BUILTIN:
        return BUILTIN[name]
    if name == SOURCE_CHECKER:
        if source_reward is None:
            raise RecipeError(
                "reward.function: 'reasoning_gym' scores with the prompt source's own checker; "
                "it needs prompts.source.kind: reasoning_gym"
            )
        return source_reward
    module_name, sep, attr = name.partition(":")
    if not sep:
        raise RecipeError(
            f"reward.function: {name!r} is neither a built-in "
            f"({', '.join(sorted([*BUILTIN, SOURCE_CHECKER]))}) nor module:function"
        )
    module = import_named("reward.function", module_name)
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RecipeError(f"reward.function: module {module_name!r} has no function {attr!r}")
    return fn


class NonFiniteReward(ValueError):
    """A reward function returned NaN or an infinity: a reward failure, never a trained value."""


def _normalise(result: Any) -> dict[str, float]:
    if isinstance(result, dict):
        if "reward" not in result:
            raise ValueError(f"reward function returned a dict without a 'reward' key: {sorted(result)}")
        values = {key: float(value) for key, value in result.items()}
    else:
        values = {"reward": float(result)}
    bad = {key: value for key, value in values.items() if not math.isfinite(value)}
    if bad:
        raise NonFiniteReward(f"reward function returned non-finite values: {bad}")
    return values


Scored = dict[str, float] | Exception | None


# What a reward function raises is a counted failure of its sample, unless it asks to end the
# process: `SystemExit` (sys.exit) and `CancelledError` (nobody cancelled it: the function's own)
# are failures too, since either would otherwise end a worker thread or the reward stage silently
# and the run would look finished. `KeyboardInterrupt` and other non-`Exception`s stop the run
# (`RewardAborted`).
_REWARD_ERRORS = (Exception, SystemExit, asyncio.CancelledError)


class RewardAborted(PipelineError):
    """The reward function raised a `BaseException` that is no data failure (`KeyboardInterrupt`,
    `GeneratorExit`, ...): the run stops with this one line and saves what it trained."""


def _aborted(fn: RewardFn, error: BaseException) -> RewardAborted:
    name = getattr(fn, "__qualname__", repr(fn))
    return RewardAborted(
        f"reward.function: {name} raised {type(error).__name__}"
        f"{f'({error})' if str(error) else ''}; a reward function returns a float or raises an "
        "Exception (a counted failure): the run stops"
    )


def score_all_sync(fn: RewardFn, items: list[tuple[Prompt, str | None]]) -> list[Scored]:
    results: list[Scored] = []
    for prompt, text in items:
        if text is None:
            results.append(None)
            continue
        try:
            results.append(_normalise(fn(prompt, text)))
        except _REWARD_ERRORS as error:  # a reward bug is a counted data failure, not a crash
            results.append(_as_exception(error))
        except BaseException as error:
            raise _aborted(fn, error) from None
    return results


async def _score_all_async(fn: RewardFn, items: list[tuple[Prompt, str | None]]) -> list[Scored]:
    results: list[Scored] = []
    for prompt, text in items:
        if text is None:
            results.append(None)
            continue
        try:
            results.append(_normalise(await fn(prompt, text)))  # type: ignore[misc]
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():  # ours: a deadline or a stop
                raise
            results.append(RewardCancelled("the reward function raised CancelledError"))
        except _REWARD_ERRORS as error:
            results.append(_as_exception(error))
        except BaseException as error:
            raise _aborted(fn, error) from None
    return results


class RewardExited(Exception):
    """The reward function raised `SystemExit` (called sys.exit)."""


class RewardCancelled(Exception):
    """The reward function raised `CancelledError` itself (nothing cancelled it)."""


def _as_exception(error: BaseException) -> Exception:
    if isinstance(error, SystemExit):
        return RewardExited(f"the reward function called sys.exit({error.code!r})")
    if isinstance(error, asyncio.CancelledError):
        return RewardCancelled("the reward function raised CancelledError")
    assert isinstance(error, Exception), error  # _REWARD_ERRORS
    return error


async def score_all(fn: RewardFn, items: list[tuple[Prompt, str | None]]) -> list[Scored]:
    """Score each (prompt, text) pair (text None: skip); an exception is returned, not raised.

    A plain function scores all pairs in one call on a daemon thread, an async one on the
    reward loop (`pipeline.rewards.threads`): either can be abandoned by a deadline. A cheap
    built-in scores on the event loop: the thread hop would cost more than the scoring.
    """
    if is_cheap(fn):
        return score_all_sync(fn, items)
    if not inspect.iscoroutinefunction(fn):
        return await run_abandonable(score_all_sync, fn, items)
    return await run_async(_score_all_async, fn, items, name=getattr(fn, "__name__", repr(fn)))
