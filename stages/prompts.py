"""Prompt sources: the recipe's `prompts` section and the prompt sets built from it.

The stage that admits one batch of them per ticket is `stages.admission.PromptStage`.

Sources are a tagged union on `kind` in the recipe's `prompts.source`:
- `synthetic`: the built-in digit tasks (checkable answers, held-out split);
- `jsonl` / `parquet`: a file of rows with a prompt and an answer field (names configurable);
- `reasoning_gym`: a procedural task of the `reasoning-gym` package, which also supplies the
  answer checker (`reward.function: reasoning_gym`).

Tokenization: with `model.path` (a Hugging Face directory) prompts are tokenized by the model's
own tokenizer, and `prompts.chat_template: true` renders each one as a user turn (after
`prompts.system_prompt`, if given) through the model's chat template; without it, a character
tokenizer over the source's alphabet.
"""

from __future__ import annotations

import itertools
import json
import random
import string
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec

from pipeline.contracts.errors import RecipeError
from pipeline.contracts.messages import Prompt
from pipeline.contracts.sections import PositiveInt, Section
from pipeline.contracts.text import NotText, decode
from stages.tokenizer import CharTokenizer, ChatTokenizer, Tokenizer

NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
FILE_ALPHABET = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ +-*/=?.,:;()'\"!"
# Printable ASCII and the newline: what procedurally generated questions are written in.
PRINTABLE_ALPHABET = string.digits + string.ascii_letters + string.punctuation + " \n"


MAX_HELDOUT = 100_000


class SyntheticSource(Section, tag="synthetic", tag_field="kind", frozen=True):
    """Digit-string tasks: `reverse` ("12345=" -> "54321") or `increment` each digit mod 10
    ("12349=" -> "23450"). Increment keeps every answer digit at a fixed distance from its
    source, which rotary attention learns fast; reverse needs the distance to change with the
    output position, which a tiny model learns far more slowly. `guess`: every prompt is `?` and
    its answer a hidden number 0..`high` that the prompt does not reveal, drawn for each training
    prompt from the seed (held-out prompt i hides i mod (high + 1), so every number is evaluated
    alike; the digit counts do not apply): the game of `pipeline.environments.guess` (the
    alphabet adds `<>?`)."""

    task: Literal["reverse", "increment", "guess"] = "reverse"
    min_digits: PositiveInt = 5
    max_digits: PositiveInt = 5
    num_heldout: NonNegativeInt = 256
    high: Annotated[int, msgspec.Meta(ge=1, le=999)] = 9  # task guess: the largest hidden number

    def __post_init__(self) -> None:
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits ({self.min_digits}) must be <= max_digits ({self.max_digits})")
        # Held-out prompts are distinct strings, made up front: they must leave some to train on.
        distinct = sum(10**d for d in range(self.min_digits, min(self.max_digits, 12) + 1))
        if self.task != "guess" and self.max_digits <= 12 and self.num_heldout >= distinct:
            raise ValueError(
                f"num_heldout ({self.num_heldout}) must be below the {distinct} distinct prompts of "
                f"{self.min_digits}-{self.max_digits} digits (the others are trained on)"
            )
        if self.num_heldout > MAX_HELDOUT:
            raise ValueError(
                f"num_heldout ({self.num_heldout}) must be at most {MAX_HELDOUT} (held-out prompts are "
                "made up front and kept in memory)"
            )


class FileSource(Section, frozen=True):
    """A file of rows, each with a prompt and an answer; the last `num_heldout` rows are held out
    (never trained on). `alphabet` is the character tokenizer's (used without `model.path`)."""

    path: str
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    num_heldout: NonNegativeInt = 0
    alphabet: str = FILE_ALPHABET


class JsonlSource(FileSource, tag="jsonl", tag_field="kind", frozen=True):
    """One JSON object per line."""


class ParquetSource(FileSource, tag="parquet", tag_field="kind", frozen=True):
    """A Parquet file (needs the `parquet` extra: pyarrow)."""


class ReasoningGymSource(Section, tag="reasoning_gym", tag_field="kind", frozen=True):
    """`reasoning_gym.create_dataset(name, size=size, seed=seed, **config)` (the `reasoning-gym`
    extra); its last `num_heldout` entries are held out. `seed` None uses `run.seed`."""

    name: str
    size: PositiveInt = 1000
    seed: int | None = None
    config: dict[str, Any] = msgspec.field(default_factory=dict)
    num_heldout: NonNegativeInt = 0
    alphabet: str = PRINTABLE_ALPHABET


Source = SyntheticSource | JsonlSource | ParquetSource | ReasoningGymSource


class PromptsSection(Section, frozen=True):
    source: Source = msgspec.field(default_factory=SyntheticSource)
    prompts_per_step: PositiveInt = 32
    chat_template: bool = False  # render prompts through the model's chat template (needs model.path)
    system_prompt: str | None = None  # the system turn before each prompt (needs chat_template)

    def __post_init__(self) -> None:
        if self.system_prompt is not None and not self.chat_template:
            raise ValueError("system_prompt needs chat_template: true")


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


SourceReward = Callable[[Prompt, str], float]


class PromptSet:
    """A tokenizer, an endless stream of training prompts, a held-out list, the most tokens any
    of them has (`longest`) and, for sources that bring their own answer checker, that checker
    (`reward`)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        train: Iterator[Prompt],
        heldout: list[Prompt],
        *,
        longest: int,
        reward: SourceReward | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.longest = longest
        self.train = PromptStream(train)
        self.heldout = heldout
        self.reward = reward


Encode = Callable[[str, str], tuple[int, ...]]


def build_tokenizer(section: PromptsSection, model_path: str | None) -> Tokenizer:
    """The model's own tokenizer when `model_path` is set, else a character tokenizer."""
    if model_path is not None:
        from stages.hf_tokenizer import HFTokenizer

        return HFTokenizer(model_path)
    source = section.source
    if isinstance(source, SyntheticSource):
        return CharTokenizer(DIGITS + ("=<>?" if source.task == "guess" else "="))
    return CharTokenizer(source.alphabet)


def build_prompts(section: PromptsSection, seed: int, *, model_path: str | None = None) -> PromptSet:
    tokenizer = build_tokenizer(section, model_path)
    encode = _encoder(section, tokenizer)
    source = section.source
    if isinstance(source, SyntheticSource):
        if source.task == "guess":
            return _guess_task(source, seed, tokenizer, encode)
        return _digit_task(source, seed, tokenizer, encode)
    if isinstance(source, ReasoningGymSource):
        return _reasoning_gym(source, seed, tokenizer, encode)
    rows = _jsonl_rows(source) if isinstance(source, JsonlSource) else _parquet_rows(source)
    prompts = [
        Prompt(
            prompt_id=prompt_id,
            text=str(row[source.prompt_field]),
            tokens=encode(str(row[source.prompt_field]), where),
            answer=str(row[source.answer_field]),
        )
        for prompt_id, where, row in rows
    ]
    where = str(Path(source.path))
    train, heldout = _split(prompts, source.num_heldout, where)
    return PromptSet(tokenizer, _epochs(train, f"jsonl-{seed}"), heldout, longest=_longest(prompts))


def _longest(prompts: list[Prompt]) -> int:
    return max(len(p.tokens) for p in prompts)


def _encoder(section: PromptsSection, tokenizer: Tokenizer) -> Encode:
    if section.chat_template:
        if not isinstance(tokenizer, ChatTokenizer):
            raise RecipeError(
                "prompts.chat_template: needs model.path (a Hugging Face model with a chat template); "
                "the character tokenizer has none"
            )

        def chat(text: str, where: str) -> tuple[int, ...]:
            return _nonempty(tokenizer.encode_chat(text, system=section.system_prompt, where=where), where)

        return chat
    return lambda text, where: _nonempty(tokenizer.encode(text, where=where), where)


def _nonempty(tokens: list[int], where: str) -> tuple[int, ...]:
    if not tokens:
        raise RecipeError(f"{where}: the prompt is empty after tokenization")
    return tuple(tokens)


ANSWERS = {
    "reverse": lambda digits: digits[::-1],
    "increment": lambda digits: "".join(str((int(d) + 1) % 10) for d in digits),
}


def _digit_task(source: SyntheticSource, seed: int, tokenizer: Tokenizer, encode: Encode) -> PromptSet:
    # The held-out split comes from its own stream and is excluded from training.
    heldout_rng = random.Random(f"heldout-{seed}")
    heldout_texts: dict[str, None] = {}
    while len(heldout_texts) < source.num_heldout:
        heldout_texts[_digits(heldout_rng, source)] = None

    def make(text: str, prompt_id: str) -> Prompt:
        return Prompt(
            prompt_id=prompt_id,
            text=text + "=",
            tokens=encode(text + "=", "prompts.source"),
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

    longest = len(encode("0" * source.max_digits + "=", "prompts.source"))
    return PromptSet(tokenizer, train(), heldout, longest=longest)


def _guess_task(source: SyntheticSource, seed: int, tokenizer: Tokenizer, encode: Encode) -> PromptSet:
    tokens = encode("?", "prompts.source")

    def make(number: int, prompt_id: str) -> Prompt:
        return Prompt(prompt_id=prompt_id, text="?", tokens=tokens, answer=str(number))

    heldout = [make(i % (source.high + 1), f"heldout-{i}") for i in range(source.num_heldout)]

    def train() -> Iterator[Prompt]:
        rng = random.Random(f"guess-{seed}")
        for index in itertools.count():
            yield make(rng.randint(0, source.high), f"train-{index}")

    return PromptSet(tokenizer, train(), heldout, longest=len(tokens))


def _digits(rng: random.Random, source: SyntheticSource) -> str:
    length = rng.randint(source.min_digits, source.max_digits)
    return "".join(rng.choice(DIGITS) for _ in range(length))


Row = tuple[str, str, dict[str, Any]]  # prompt id, where (for messages), the row


def _jsonl_rows(source: FileSource) -> list[Row]:
    path = _existing(source.path)
    rows: list[Row] = []
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            where = f"{path}:{number}"
            try:
                line = decode(raw, where)
            except NotText as error:
                raise RecipeError(f"{error}; save it as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise RecipeError(f"{where}: not valid JSON: {error.msg}") from None
            rows.append((f"line-{number}", where, _check_row(row, source, where)))
    return rows


def _parquet_rows(source: FileSource) -> list[Row]:
    path = _existing(source.path)
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise RecipeError(
            "prompts.source.kind: parquet needs pyarrow: pip install 'grpo-pipeline[parquet]'"
        ) from None
    try:
        schema = pq.read_schema(path)
    except Exception as error:  # pyarrow raises its own types for unreadable files
        raise RecipeError(f"{path}: not a Parquet file: {error}") from None
    for field in (source.prompt_field, source.answer_field):
        if field not in schema.names:
            raise RecipeError(f"{path}: missing column {field!r} (columns: {', '.join(schema.names)})")
    table = pq.read_table(path, columns=list(dict.fromkeys([source.prompt_field, source.answer_field])))
    return [
        (f"row-{number}", f"{path}: row {number}", _check_row(row, source, f"{path}: row {number}"))
        for number, row in enumerate(table.to_pylist(), start=1)
    ]


def _existing(path_text: str) -> Path:
    path = Path(path_text)
    if not path.is_file():
        raise RecipeError(f"prompts.source.path: file not found: {path}")
    return path


def _check_row(row: Any, source: FileSource, where: str) -> dict[str, Any]:
    for field in (source.prompt_field, source.answer_field):
        if not isinstance(row, dict) or row.get(field) is None:
            raise RecipeError(f"{where}: missing field {field!r}")
    return row


def _split(prompts: list[Prompt], num_heldout: int, where: str) -> tuple[list[Prompt], list[Prompt]]:
    heldout = prompts[len(prompts) - num_heldout :] if num_heldout else []
    train = prompts[: len(prompts) - len(heldout)]
    if not train:
        raise RecipeError(
            f"{where}: no training prompts ({len(heldout)} held out by prompts.source.num_heldout)"
        )
    return train, heldout


def _epochs(prompts: list[Prompt], rng_name: str) -> Iterator[Prompt]:
    """Every prompt once per epoch, in a fresh shuffled order; ids get an `-e<epoch>` suffix."""
    rng = random.Random(rng_name)
    epoch = 0
    while True:
        order = list(range(len(prompts)))
        rng.shuffle(order)
        for i in order:
            p = prompts[i]
            yield msgspec.structs.replace(p, prompt_id=f"{p.prompt_id}-e{epoch}")
        epoch += 1


def _reasoning_gym(source: ReasoningGymSource, seed: int, tokenizer: Tokenizer, encode: Encode) -> PromptSet:
    try:
        import reasoning_gym
    except ImportError:
        raise RecipeError(
            "prompts.source.kind: reasoning_gym needs the reasoning-gym package: "
            "pip install 'grpo-pipeline[reasoning-gym]'"
        ) from None
    data_seed = seed if source.seed is None else source.seed
    try:
        dataset = reasoning_gym.create_dataset(source.name, size=source.size, seed=data_seed, **source.config)
    except (ValueError, TypeError, AssertionError) as error:
        raise RecipeError(f"prompts.source: reasoning_gym dataset {source.name!r}: {error}") from None
    entries: dict[str, dict[str, Any]] = {}
    prompts = []
    for index, entry in enumerate(dataset):
        prompt_id = f"{source.name}-{index}"
        entries[prompt_id] = entry
        where = f"prompts.source: {source.name} entry {index}"
        prompts.append(
            Prompt(
                prompt_id=prompt_id,
                text=entry["question"],
                tokens=encode(entry["question"], where),
                answer=str(entry["answer"]),
            )
        )

    def score(prompt: Prompt, completion: str) -> float:
        # Training ids carry an `-e<epoch>` suffix; held-out ids are the entry's own.
        entry = entries.get(prompt.prompt_id) or entries[prompt.prompt_id.rpartition("-e")[0]]
        return float(dataset.score_answer(completion.strip(), entry))

    train, heldout = _split(prompts, source.num_heldout, f"prompts.source: {source.name}")
    return PromptSet(
        tokenizer, _epochs(train, f"reasoning_gym-{seed}"), heldout, longest=_longest(prompts), reward=score
    )
