"""The guess-the-number game: replies, rewards, and that it cannot be won without reading them."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.contracts.environments import Observation, Turn
from pipeline.contracts.errors import RecipeError
from pipeline.contracts.messages import Prompt
from pipeline.environments import resolve
from pipeline.environments.guess import GuessNumber


async def play(secret: int, policy, **kwargs) -> list[Observation]:  # type: ignore[no-untyped-def]
    env = GuessNumber(**kwargs)
    await env.start(Prompt(prompt_id="p", text="123?", tokens=(2,), answer=str(secret)))
    replies: list[Observation] = []
    while not (replies and replies[-1].done):
        guess = policy([r.text for r in replies])
        replies.append(
            await env.step(Turn(text=guess, tokens=(), finish_reason="length", index=len(replies)))
        )
    return replies


def bisect(replies: list[str], top: int = 9, width: int = 1) -> str:
    """Binary search over 0..top, replaying the replies so far; guesses `width` digits wide."""
    low, high = 0, top
    for reply in replies:
        guess = (low + high) // 2
        low, high = (guess + 1, high) if reply == ">" else (low, guess - 1)
    return str((low + high) // 2).zfill(width)


def scripted(guesses: list[str]):  # type: ignore[no-untyped-def]
    it = iter(guesses)
    return lambda replies: next(it)


async def test_binary_search_finds_every_number_and_a_blind_policy_at_most_four() -> None:
    searched = [(await play(n, bisect))[-1] for n in range(10)]
    assert all(r.reward == 1.0 and r.info["success"] == 1.0 for r in searched)
    blind = [(await play(n, lambda replies: str(len(replies))))[-1] for n in range(10)]
    assert [r.info["success"] for r in blind] == [1.0] * 4 + [0.0] * 6


async def test_two_digit_guesses_with_leading_zeros_find_every_number_below_a_hundred() -> None:
    searched = [(await play(n, lambda r: bisect(r, 99, 2), max_guesses=7))[-1] for n in range(100)]
    assert all(r.info["success"] == 1.0 for r in searched)
    assert max(r.info["guesses"] for r in searched) == 7.0
    blind = [(await play(n, lambda r: f"{len(r):02d}", max_guesses=7))[-1] for n in range(100)]
    assert sum(r.info["success"] for r in blind) == 7.0
    assert [r.text for r in await play(5, scripted(["٣", "05"]))] == ["?", "="]  # ASCII digits only


async def test_replies_and_rewards() -> None:
    replies = await play(3, scripted(["5", "x", "1", "4"]))
    assert [r.text for r in replies] == ["<", "?", ">", "<"]
    assert [r.reward for r in replies] == [None, None, None, 0.0]
    assert replies[-1].done and replies[-1].info == {"success": 0.0, "guesses": 4.0}
    won = await play(3, scripted(["5", "3"]))
    assert (won[-1].reward, won[-1].done, won[-1].info) == (1.0, True, {"success": 1.0, "guesses": 2.0})


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (
            "pipeline.environments.guess:Nope",
            "rollout.environment: module 'pipeline.environments.guess' has no class 'Nope'",
        ),
        ("guess", "rollout.environment: 'guess' is not module:Class"),
        (
            "pipeline.contracts.messages:Prompt",
            "rollout.environment: pipeline.contracts.messages:Prompt needs async methods start(prompt) "
            "and step(turn); missing or not async: start, step",
        ),
    ],
)
def test_resolve_names_what_cannot_be_an_environment(name: str, message: str) -> None:
    with pytest.raises(RecipeError) as raised:
        resolve(name, {})
    assert str(raised.value) == message


def test_resolve_names_a_module_that_fails_as_it_imports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "raising_env.py").write_text("raise RuntimeError('no server')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RecipeError) as raised:
        resolve("raising_env:Game", {})
    assert str(raised.value) == (
        "rollout.environment: cannot import module 'raising_env': RuntimeError: no server "
        f"({tmp_path / 'raising_env.py'}, line 1)"
    )


def test_resolve_builds_one_environment_per_episode() -> None:
    factory = resolve("pipeline.environments.guess:GuessNumber", {"max_guesses": 5})
    first, second = factory(), factory()
    assert first is not second and first.max_guesses == 5  # type: ignore[attr-defined]
