"""Reward functions: math-verify equivalence, reasoning-gym checkers, named errors."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Awaitable, Callable

import pytest

from pipeline.contracts.errors import RecipeError
from pipeline.contracts.messages import Prompt
from pipeline.rewards.scoring import resolve
from pipeline.rewards.threads import BLOCKING_S


def _prompt(answer: str) -> Prompt:
    return Prompt(prompt_id="p", text="q", tokens=(1,), answer=answer)


@pytest.mark.parametrize(
    ("answer", "completion", "reward"),
    [
        ("72", "She sold 48 + 24 = 72 clips, so \\boxed{72}.", 1.0),
        ("\\frac{1}{2}", "The probability is \\boxed{0.5}", 1.0),
        ("3", "x = \\boxed{3.0}", 1.0),
        ("48 / 2 = 24 clips in May.\n#### 72", "\\boxed{72}", 1.0),  # a GSM8K reference
        ("72", "\\boxed{71}", 0.0),
        ("72", "I do not know", 0.0),
    ],
    ids=["boxed", "fraction-decimal", "float-int", "gsm8k-reference", "wrong", "no-answer"],
)
def test_math_reward(answer: str, completion: str, reward: float) -> None:
    result = resolve("math")(_prompt(answer), completion)
    assert isinstance(result, dict)
    assert result["reward"] == reward


def test_reward_module_that_does_not_import_is_named() -> None:
    with pytest.raises(RecipeError) as raised:
        resolve("no_such_module_xyz:score")
    assert str(raised.value) == (
        "reward.function: cannot import module 'no_such_module_xyz': No module named 'no_such_module_xyz'"
    )


def test_reward_function_missing_from_module_is_named() -> None:
    with pytest.raises(RecipeError) as raised:
        resolve("pipeline.rewards.scoring:no_such_function")
    assert str(raised.value) == (
        "reward.function: module 'pipeline.rewards.scoring' has no function 'no_such_function'"
    )


def test_unknown_reward_name_lists_the_built_ins() -> None:
    with pytest.raises(RecipeError) as raised:
        resolve("maths")
    assert str(raised.value) == (
        "reward.function: 'maths' is neither a built-in "
        "(exact_match, math, positional, reasoning_gym) nor module:function"
    )


def test_reasoning_gym_reward_needs_its_source() -> None:
    with pytest.raises(RecipeError) as raised:
        resolve("reasoning_gym")
    assert str(raised.value) == (
        "reward.function: 'reasoning_gym' scores with the prompt source's own checker; "
        "it needs prompts.source.kind: reasoning_gym"
    )


async def test_an_unhashable_reward_callable_is_scored() -> None:
    """Built-ins are recognised by identity: a callable object without `__hash__` still works."""
    from pipeline.rewards.scoring import is_cheap, positional_reward, score_all

    class Scorer:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, prompt: Prompt, completion: str) -> float:
            return float(completion == prompt.answer)

    scorer = Scorer()
    assert is_cheap(positional_reward) and not is_cheap(scorer)
    scored = await score_all(scorer, [(_prompt("12"), "12"), (_prompt("12"), None), (_prompt("3"), "4")])
    assert scored == [{"reward": 1.0}, None, {"reward": 0.0}]


def _exits(prompt: Prompt, completion: str) -> float:
    raise SystemExit(3)


async def test_a_reward_that_calls_sys_exit_is_a_failure_of_that_sample() -> None:
    from pipeline.rewards.scoring import score_all

    (result,) = await score_all(_exits, [(_prompt("1"), "1")])
    assert isinstance(result, Exception)
    assert f"{type(result).__name__}: {result}" == "RewardExited: the reward function called sys.exit(3)"


ABANDON_SCRIPT = """
import time, anyio
from pipeline.contracts.messages import Prompt
from pipeline.rewards.scoring import score_all

def forever(prompt, completion):
    time.sleep(3600)

async def main():
    with anyio.move_on_after(0.2):
        await score_all(forever, [(Prompt(prompt_id="p", text="q", tokens=(1,), answer="a"), "a")])
    print("abandoned")

anyio.run(main)
"""


def test_a_reward_abandoned_by_its_deadline_does_not_keep_the_process_alive() -> None:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", ABANDON_SCRIPT], capture_output=True, text=True, timeout=240)
    assert (done.returncode, done.stdout) == (0, "abandoned\n"), done.stderr


def _blocking(release: threading.Event) -> Callable[[Prompt, str], Awaitable[float]]:
    """An async reward that holds whatever loop runs it, in a synchronous wait, until `release`
    is set and for more than BLOCKING_S; `release` unset after a minute is a hang."""

    async def _blocks(prompt: Prompt, completion: str) -> float:
        held = time.monotonic() + BLOCKING_S + 0.2
        release.wait(timeout=60)
        time.sleep(max(0.0, held - time.monotonic()))
        return 1.0

    return _blocks


def _seconds(text: str) -> str:
    """`text` with its one figure of seconds written `N.N` (it depends on the machine's speed)."""
    return re.sub(r"for \d+\.\d s", "for N.N s", text)


async def test_an_async_reward_that_blocks_cannot_freeze_the_pipeline_and_is_reported(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import anyio

    from pipeline.logs import reset_warnings
    from pipeline.rewards.scoring import score_all

    reset_warnings()  # the warning is said once a run; each test is a run here
    ticked = threading.Event()  # the reward holds its loop until the pipeline's has ticked
    ticks = 0

    async def tick() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.05)
            ticks += 1
            if ticks == 10:
                ticked.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(tick)
        scored = await score_all(_blocking(ticked), [(_prompt("1"), "1")])
        tg.cancel_scope.cancel()
    assert scored == [{"reward": 1.0}]
    assert ticks >= 10  # the pipeline's loop kept running while the reward held its own
    (message,) = [r.getMessage() for r in caplog.records if r.name == "pipeline.rewards"]
    assert _seconds(message) == (
        "async reward function _blocks blocked its event loop for N.N s in one step: make it a plain "
        "def (it then runs in a worker thread) or await its slow work"
    )


async def test_a_deadline_on_a_blocked_async_reward_fires_and_says_why() -> None:
    import anyio

    from pipeline.rewards.scoring import score_all
    from pipeline.rewards.threads import blocking_note

    release = threading.Event()
    with anyio.fail_after(60):  # a hang guard only
        with anyio.move_on_after(0.1) as scope:
            await score_all(_blocking(release), [(_prompt("1"), "1")])
        assert scope.cancelled_caught
        while not blocking_note():  # said once the reward has held its loop past BLOCKING_S
            await anyio.sleep(0.01)
        assert _seconds(blocking_note()) == (
            "; an async reward function has blocked its event loop for N.N s (make it a plain def or "
            "await its slow work)"
        )
        release.set()
        # The slice ends: the next test finds the reward loop free.
        assert await score_all(_async_one, [(_prompt("1"), "1")]) == [{"reward": 1.0}]


async def _async_one(prompt: Prompt, completion: str) -> float:
    return 1.0


def _nan_part(prompt: Prompt, completion: str) -> dict[str, float]:
    return {"reward": 1.0, "length": float("nan")}


async def test_a_non_finite_reward_or_reward_part_is_a_failure_of_that_sample_not_a_value() -> None:
    from pipeline.rewards.scoring import score_all, score_all_sync

    pairs = [(_prompt("1"), "1")]
    for result in [*score_all_sync(lambda p, c: float("inf"), pairs), *await score_all(_nan_part, pairs)]:
        assert isinstance(result, ValueError) and "non-finite" in str(result)
