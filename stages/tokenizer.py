"""The tokenizer protocol the stages use, and a character tokenizer for built-in tasks.

Two implementations: `CharTokenizer` here (no files, no downloads; models trained from random
weights) and `stages.hf_tokenizer.HFTokenizer` (a Hugging Face model's own tokenizer files).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

from pipeline.contracts.errors import RecipeError
from pipeline.contracts.text import NotText, read_text


class Tokenizer(Protocol):
    """Text to token ids and back.

    `encode` raises `RecipeError` naming `where` for text it cannot encode. `decode` returns
    the text up to the first stop token (`stop_ids`, which holds `eos_id`), special tokens
    skipped. `vocab_size` counts every id the tokenizer can produce.
    """

    @property
    def eos_id(self) -> int: ...
    @property
    def pad_id(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def stop_ids(self) -> tuple[int, ...]: ...
    def encode(self, text: str, *, where: str = "text") -> list[int]: ...
    def encode_plain(self, text: str, *, where: str = "text") -> list[int]:
        """`text` as it continues a sequence (an environment's reply): no special tokens added."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...


@runtime_checkable
class ChatTokenizer(Tokenizer, Protocol):
    """A tokenizer with a chat template (optional: the character tokenizer has none): `encode_chat`
    encodes `text` as a user turn, after a system turn when `system` is given, ending where the
    assistant's reply begins; `render` is the template's text of any conversation; `text_of`
    decodes ids exactly (special tokens written out), as the template writes them."""

    def encode_chat(self, text: str, *, system: str | None = None, where: str = "text") -> list[int]: ...
    def render(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool) -> str: ...
    def text_of(self, ids: Sequence[int]) -> str: ...


SPECIAL = 3  # padding (0), end of sequence (1), beginning of sequence (2)
# Beside an exported model trained with a character tokenizer: {"alphabet": "..."}.
CHAR_TOKENIZER_FILE = "char_tokenizer.json"


class CharTokenizer:
    """One token per character of `alphabet`, after padding (0), end (1) and beginning (2).

    `encode` starts every text with the beginning-of-sequence token, as Llama tokenizers do:
    with rotary (relative) positions only, attending to that fixed first token is how a small
    model finds out how far into the sequence it is.
    """

    def __init__(self, alphabet: str) -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("alphabet has repeated characters")
        self.alphabet = alphabet
        self.pad_id = 0
        self.eos_id = 1
        self.bos_id = 2
        self._ids = {ch: i + SPECIAL for i, ch in enumerate(alphabet)}
        self.vocab_size = len(alphabet) + SPECIAL
        self.stop_ids = (self.eos_id,)

    def save(self, directory: Path) -> None:
        (directory / CHAR_TOKENIZER_FILE).write_text(json.dumps({"alphabet": self.alphabet}) + "\n")

    @classmethod
    def load(cls, directory: Path) -> CharTokenizer:
        path = directory / CHAR_TOKENIZER_FILE
        try:
            return cls(json.loads(read_text(path))["alphabet"])
        except NotText as error:
            raise RecipeError(str(error)) from None
        except (json.JSONDecodeError, KeyError, TypeError):
            raise RecipeError(f'{path}: expected {{"alphabet": "..."}}') from None

    def encode(self, text: str, *, where: str = "text") -> list[int]:
        try:
            return [self.bos_id] + [self._ids[ch] for ch in text]
        except KeyError as error:
            raise RecipeError(
                f"{where}: character {error.args[0]!r} is not in the tokenizer's alphabet {self.alphabet!r}"
            ) from None

    def encode_plain(self, text: str, *, where: str = "text") -> list[int]:
        return self.encode(text, where=where)[1:]  # without the beginning-of-sequence token

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` up to the first end-of-sequence token.

        Special tokens are skipped; ids past the alphabet (a model's vocabulary may be padded beyond the
        tokenizer's) decode as U+FFFD, so they can never match an answer.
        """
        chars = []
        for i in ids:
            if i == self.eos_id:
                break
            if i >= SPECIAL:
                chars.append(self.alphabet[i - SPECIAL] if i - SPECIAL < len(self.alphabet) else "\ufffd")
        return "".join(chars)
