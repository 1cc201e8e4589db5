"""A character tokenizer for built-in synthetic tasks (no files, no downloads)."""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.errors import RecipeError

PAD, EOS = "<pad>", "<eos>"


class CharTokenizer:
    """One token per character of `alphabet`, plus padding (id 0) and end of sequence (id 1)."""

    def __init__(self, alphabet: str) -> None:
        if len(set(alphabet)) != len(alphabet):
            raise ValueError("alphabet has repeated characters")
        self.alphabet = alphabet
        self.pad_id = 0
        self.eos_id = 1
        self._ids = {ch: i + 2 for i, ch in enumerate(alphabet)}
        self.vocab_size = len(alphabet) + 2

    def encode(self, text: str, *, where: str = "text") -> list[int]:
        try:
            return [self._ids[ch] for ch in text]
        except KeyError as error:
            raise RecipeError(
                f"{where}: character {error.args[0]!r} is not in the tokenizer's alphabet {self.alphabet!r}"
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        """Text of `ids` up to the first end-of-sequence token.

        Padding is skipped; ids past the alphabet (a model's vocabulary may be padded beyond the
        tokenizer's) decode as U+FFFD, so they can never match an answer.
        """
        chars = []
        for i in ids:
            if i == self.eos_id:
                break
            if i >= 2:
                chars.append(self.alphabet[i - 2] if i - 2 < len(self.alphabet) else "\ufffd")
        return "".join(chars)
