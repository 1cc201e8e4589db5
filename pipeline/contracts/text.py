"""Text files the user hands the pipeline (recipes, data, model and checkpoint files), read as
UTF-8 with a mistake named where it is: `read_text` raises `NotText`, a `ValueError` whose message
names the file, the byte and its line and column, so every reader can turn it into its own
one-line error (`RecipeError`, a damaged checkpoint, ...) instead of a traceback."""

from __future__ import annotations

from pathlib import Path


class NotText(ValueError):
    """A file (or line) that is not UTF-8 text; the message names it and the first bad byte."""


def read_text(path: Path) -> str:
    """`path`'s text (`OSError` as `Path.read_text` raises it; `NotText` for bytes not UTF-8)."""
    return decode(path.read_bytes(), str(path))


def decode(data: bytes, where: str) -> str:
    """`data` decoded as UTF-8, or `NotText` naming `where`, the bad byte and its line (where
    `data` has several) and column."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
        at = f"line {line}, column {column}" if b"\n" in data.rstrip(b"\r\n") else f"column {column}"
        raise NotText(f"{where}: not UTF-8 text: byte 0x{data[error.start]:02x} at {at}") from None
