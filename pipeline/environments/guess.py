"""Guess the number: a game no policy wins reliably without reading the replies.

The prompt's answer (`prompts.source: {kind: synthetic, task: guess, high: 9}`) is a hidden
number in 0..high; the prompt's text (`?`) says nothing about it. Each turn the model
replies with a number in decimal digits (leading zeros allowed: with `high` 99 and two new tokens
a turn, `07` is 7); the environment answers `>` (the hidden number is greater), `<` (it is
smaller) or `=` (found: the episode ends), or `?` for a reply that is not a number. After
`max_guesses` wrong guesses the episode ends lost. The turn that ends the episode carries its
reward: 1 for a win, 0 for a loss; `info` logs `success` and `guesses`.

With numbers 0-9 and four guesses, halving the range each turn (a binary search) finds every
number, while a policy that ignores the replies finds four numbers of ten at best; with 0-99 and
seven guesses, every number against seven of a hundred (eight of a hundred with eight guesses).
"""

from __future__ import annotations

from pipeline.contracts.environments import Observation, Turn
from pipeline.contracts.messages import Prompt


class GuessNumber:
    def __init__(self, max_guesses: int = 4) -> None:
        if max_guesses < 1:
            raise ValueError(f"max_guesses ({max_guesses}) must be at least 1")
        self.max_guesses = max_guesses
        self.secret = -1
        self.guesses = 0

    async def start(self, prompt: Prompt) -> Observation:
        if not (prompt.answer.isascii() and prompt.answer.isdigit()):
            raise ValueError(f"prompt {prompt.prompt_id}: hidden number {prompt.answer!r} is not a number")
        self.secret = int(prompt.answer)
        return Observation()

    async def step(self, turn: Turn) -> Observation:
        self.guesses += 1
        text = turn.text.strip()
        guess = int(text) if text.isascii() and text.isdigit() else None
        if guess == self.secret:
            return self._end("=", won=True)
        reply = "?" if guess is None else ("<" if guess > self.secret else ">")
        if self.guesses >= self.max_guesses:
            return self._end(reply, won=False)
        return Observation(text=reply)

    def _end(self, reply: str, *, won: bool) -> Observation:
        return Observation(
            text=reply,
            reward=float(won),
            done=True,
            info={"success": float(won), "guesses": float(self.guesses)},
        )
