"""Prompt loading: sources of prompts and the stage that admits one batch per ticket.

Sources are a tagged union on `kind` in the recipe's `prompts.source`:
- `synthetic`: the built-in reverse-the-digits task (checkable answers, held-out split);
- `jsonl`: a file with one JSON object per line and `prompt`/`answer` fields (names configurable).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from pipeline.channel import Channel
from pipeline.errors import RecipeError
from pipeline.messages import Batch, Prompt
from pipeline.recipe import PositiveInt, Section
from pipeline.tickets import TicketBox
from pipeline.watchdog import Watchdog
from stages.progress import Progress
from stages.tokenizer import CharTokenizer


class SyntheticSource(Section, tag="synthetic", tag_field="kind"):
    """Digit-string tasks: `reverse` ("12345=" -> "54321") or `increment` each digit mod 10
    ("12349=" -> "23450"). Increment keeps every answer digit at a fixed distance from its
    source, which rotary attention learns fast; reverse needs the distance to change with the
    output position, which a tiny model learns far more slowly."""

    task: Literal["reverse", "increment"] = "reverse"
    min_digits: PositiveInt = 5
    max_digits: PositiveInt = 5
    num_heldout: Annotated[int, msgspec.Meta(ge=0)] = 256

    def __post_init__(self) -> None:
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits ({self.min_digits}) must be <= max_digits ({self.max_digits})")


class JsonlSource(Section, tag="jsonl", tag_field="kind"):
    path: str
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    num_heldout: Annotated[int, msgspec.Meta(ge=0)] = 0  # the file's last lines, never trained on
    alphabet: str = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ +-*/=?.,:;()'\"!"


class PromptsSection(Section):
    source: SyntheticSource | JsonlSource = msgspec.field(default_factory=SyntheticSource)
    prompts_per_step: PositiveInt = 32


DIGITS = "0123456789"


class PromptStream:
    """An endless, deterministic stream of training prompts that counts what it has handed out.

    Resuming is replay: a fresh stream built from the same recipe and seed, advanced by
    `skip(n)`, continues exactly where one that had handed out n prompts stood.
    """

    def __init__(self, prompts: Iterator[Prompt]) -> None:
        self._prompts = prompts
        self.drawn = 0

    def __iter__(self) -> Iterator[Prompt]:
        return self

    def __next__(self) -> Prompt:
        self.drawn += 1
        return next(self._prompts)

    def skip(self, n: int) -> None:
        for _ in range(n):
            next(self)


class PromptSet:
    """A tokenizer, an endless stream of training prompts and a held-out list."""

    def __init__(self, tokenizer: CharTokenizer, train: Iterator[Prompt], heldout: list[Prompt]) -> None:
        self.tokenizer = tokenizer
        self.train = PromptStream(train)
        self.heldout = heldout


def build_prompts(section: PromptsSection, seed: int) -> PromptSet:
    source = section.source
    if isinstance(source, SyntheticSource):
        return _digit_task(source, seed)
    return _jsonl(source, seed)


ANSWERS = {
    "reverse": lambda digits: digits[::-1],
    "increment": lambda digits: "".join(str((int(d) + 1) % 10) for d in digits),
}


def _digit_task(source: SyntheticSource, seed: int) -> PromptSet:
    tokenizer = CharTokenizer(DIGITS + "=")
    # The held-out split comes from its own stream and is excluded from training.
    heldout_rng = random.Random(f"heldout-{seed}")
    heldout_texts: dict[str, None] = {}
    while len(heldout_texts) < source.num_heldout:
        heldout_texts[_digits(heldout_rng, source)] = None

    def make(text: str, prompt_id: str) -> Prompt:
        return Prompt(
            prompt_id=prompt_id,
            text=text + "=",
            tokens=tuple(tokenizer.encode(text + "=")),
            answer=ANSWERS[source.task](text),
        )

    heldout = [make(text, f"heldout-{i}") for i, text in enumerate(heldout_texts)]

    def train() -> Iterator[Prompt]:
        rng = random.Random(f"train-{seed}")
        index = 0
        while True:
            text = _digits(rng, source)
            if text in heldout_texts:
                continue
            yield make(text, f"train-{index}")
            index += 1

    return PromptSet(tokenizer, train(), heldout)


def _digits(rng: random.Random, source: SyntheticSource) -> str:
    length = rng.randint(source.min_digits, source.max_digits)
    return "".join(rng.choice(DIGITS) for _ in range(length))


def _jsonl(source: JsonlSource, seed: int) -> PromptSet:
    path = Path(source.path)
    if not path.is_file():
        raise RecipeError(f"prompts.source.path: file not found: {path}")
    tokenizer = CharTokenizer(source.alphabet)
    prompts = []
    with path.open() as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise RecipeError(f"{path}:{number}: not valid JSON: {error.msg}") from None
            for field in (source.prompt_field, source.answer_field):
                if not isinstance(row, dict) or field not in row:
                    raise RecipeError(f"{path}:{number}: missing field {field!r}")
            text = str(row[source.prompt_field])
            prompts.append(
                Prompt(
                    prompt_id=f"line-{number}",
                    text=text,
                    tokens=tuple(tokenizer.encode(text, where=f"{path}:{number}")),
                    answer=str(row[source.answer_field]),
                )
            )
    heldout = prompts[len(prompts) - source.num_heldout :] if source.num_heldout else []
    prompts = prompts[: len(prompts) - len(heldout)]
    if not prompts:
        raise RecipeError(
            f"{path}: no training prompts ({len(heldout)} lines held out by prompts.source.num_heldout)"
        )

    def train() -> Iterator[Prompt]:
        rng = random.Random(f"jsonl-{seed}")
        epoch = 0
        while True:
            order = list(range(len(prompts)))
            rng.shuffle(order)
            for i in order:
                p = prompts[i]
                yield msgspec.structs.replace(p, prompt_id=f"{p.prompt_id}-e{epoch}")
            epoch += 1

    return PromptSet(tokenizer, train(), heldout)


class PromptStage:
    """Admits one batch of `prompts_per_step` prompts per ticket until the run has enough."""

    name = "prompts"

    def __init__(
        self,
        prompts: Iterator[Prompt],
        *,
        prompts_per_step: int,
        tickets: TicketBox,
        out: Channel[Batch],
        progress: Progress,
        watchdog: Watchdog,
    ) -> None:
        self.prompts = prompts
        self.prompts_per_step = prompts_per_step
        self.tickets = tickets
        self.out = out
        self.progress = progress
        self.watchdog = watchdog

    async def run(self) -> None:
        try:
            while True:
                with self.watchdog.waiting(self.name, "more batches to be needed"):
                    if not await self.progress.wait_batch_needed():
                        return
                with self.watchdog.waiting(self.name, "an admission ticket"):
                    ticket = await self.tickets.take()
                if ticket is None:
                    return
                batch = Batch(
                    batch=ticket.batch,
                    prompts=tuple(next(self.prompts) for _ in range(self.prompts_per_step)),
                )
                self.progress.batch_admitted()
                with self.watchdog.waiting(self.name, "room in the rollout channel"):
                    await self.out.send(batch)
        finally:
            self.out.close()
            self.watchdog.done(self.name)
