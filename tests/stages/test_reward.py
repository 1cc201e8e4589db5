"""Reward functions: math-verify equivalence, reasoning-gym checkers, named errors."""

from __future__ import annotations

import pytest

from pipeline.errors import RecipeError
from pipeline.messages import Prompt
from stages.reward import resolve


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
        resolve("stages.reward:no_such_function")
    assert str(raised.value) == "reward.function: module 'stages.reward' has no function 'no_such_function'"


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
    from stages.reward import is_cheap, positional_reward, score_all

    class Scorer:
        __hash__ = None  # type: ignore[assignment]

        def __call__(self, prompt: Prompt, completion: str) -> float:
            return float(completion == prompt.answer)

    scorer = Scorer()
    assert is_cheap(positional_reward) and not is_cheap(scorer)
    scored = await score_all(scorer, [(_prompt("12"), "12"), (_prompt("12"), None), (_prompt("3"), "4")])
    assert scored == [{"reward": 1.0}, None, {"reward": 0.0}]
