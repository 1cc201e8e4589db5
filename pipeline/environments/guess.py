"""Guess the number: a game no policy wins reliably without reading the replies.

The prompt's answer (`prompts.source: {kind: synthetic, task: guess, high: 9}`) is a hidden
number in 0..high; the prompt's text (`?`) says nothing about it. Each turn the model
replies with a number; the environment answers `>` (the hidden number is greater), `<` (it is
smaller) or `=` (found: the episode ends), or `?` for a reply that is not a number. After
`max_guesses` wrong guesses the episode ends lost. The turn that ends the episode carries its
reward: 1 for a win, 0 for a loss; `info` logs `success` and `guesses`. With `consistency_bonus`
each turn whose guess agrees with every reply so far (inside the range they leave) also gets that
reward: with `rollout.episode_reward: sum` it pays for reading the replies before any win.

With numbers 0-9 and four guesses, halving the range each turn (a binary search) finds every
number, while a policy that ignores the replies finds four numbers of ten at best.
"""

from __future__ import annotations

from pipeline.contracts.environments import Observation, Turn
from pipeline.contracts.messages import Prompt


class GuessNumber:
    def __init__(self, max_guesses: int = 4, consistency_bonus: float = 0.0) -> None:
        if max_guesses < 1:
            raise ValueError(f"max_guesses ({max_guesses}) must be at least 1")
        self.max_guesses = max_guesses
        self.bonus = consistency_bonus
        self.secret = -1
        self.guesses = 0
        self.low, self.top = 0, 9  # the range the replies so far leave

    async def start(self, prompt: Prompt) -> Observation:
        if not (prompt.answer.isdigit() and len(prompt.answer) == 1):
            raise ValueError(f"prompt {prompt.prompt_id}: hidden number {prompt.answer!r} is not one digit")
        self.secret = int(prompt.answer)
        return Observation()

    async def step(self, turn: Turn) -> Observation:
        self.guesses += 1
        text = turn.text.strip()
        guess = int(text) if text.isdigit() else None
        bonus = self.bonus if guess is not None and self.low <= guess <= self.top else 0.0
        if guess == self.secret:
            return self._end("=", won=True, bonus=bonus)
        if guess is not None and guess > self.secret:
            reply, self.top = "<", min(self.top, guess - 1)
        elif guess is not None:
            reply, self.low = ">", max(self.low, guess + 1)
        else:
            reply = "?"
        if self.guesses >= self.max_guesses:
            return self._end(reply, won=False, bonus=bonus)
        return Observation(text=reply, reward=bonus)

    def _end(self, reply: str, *, won: bool, bonus: float) -> Observation:
        return Observation(
            text=reply,
            reward=float(won) + bonus,
            done=True,
            info={"success": float(won), "guesses": float(self.guesses)},
        )
