"""A Hugging Face model's own tokenizer, read from its directory with the `tokenizers` library.

Files read from the model directory (nothing is ever downloaded):
- `tokenizer.json` (required): the tokenizer itself;
- `tokenizer_config.json`: special tokens (`eos_token`, `pad_token`, `bos_token`) and the
  `chat_template` (transformers >= 4.50 writes the template to `chat_template.jinja` instead);
- `generation_config.json`: `eos_token_id` (an id or a list), the ids generation stops at.

The chat template is rendered with jinja2 in a sandbox, with the variables and helpers
transformers gives templates (`messages`, `add_generation_prompt`, the special tokens,
`raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text), so a prompt renders
to the same text as `transformers`' `apply_chat_template(..., tokenize=False)`. One difference:
`strftime_now` reads the time the tokenizer was built, not the time of each rendering, so a run
renders one date throughout (a template that writes today's date, as Llama 3.1's does, would
otherwise change an episode's earlier turns at midnight; stages/chat_turns.py refuses that).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from pipeline.contracts.errors import RecipeError
from pipeline.contracts.text import NotText, read_text

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# What `export` copies next to the weights when a run started from a Hugging Face model.
TOKENIZER_FILES = (
    TOKENIZER_FILE,
    TOKENIZER_CONFIG_FILE,
    GENERATION_CONFIG_FILE,
    CHAT_TEMPLATE_FILE,
    "chat_template.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


class HFTokenizer:
    """The tokenizer of the Hugging Face model directory `path` (see the module docstring).

    `eos_id` is `tokenizer_config.json`'s `eos_token` (else the first of
    `generation_config.json`'s `eos_token_id`); `stop_ids` holds it and every generation eos
    id; `pad_id` is the `pad_token`, else `eos_id`. `encode` adds the tokenizer's own special
    tokens (a Llama BOS); `encode_chat` renders the chat template, whose text carries them.
    """

    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        self.path = Path(path)
        file = self.path / TOKENIZER_FILE
        if not file.is_file():
            raise RecipeError(
                f"model.path: {file} not found: the model's tokenizer is needed to tokenize prompts "
                "(copy tokenizer.json and tokenizer_config.json next to config.json)"
            )
        try:
            self._tokenizer = Tokenizer.from_str(read_text(file))
        except NotText as error:
            raise RecipeError(str(error)) from None
        except Exception as error:  # the tokenizers library raises a plain Exception, whatever it finds
            raise RecipeError(f"{file}: not a tokenizer the tokenizers library reads: {error}") from None
        self.config: dict[str, Any] = _read_json(self.path / TOKENIZER_CONFIG_FILE)
        generation: dict[str, Any] = _read_json(self.path / GENERATION_CONFIG_FILE)
        self.special_tokens = {
            name: _token_text(self.config[name]) for name in _SPECIAL_NAMES if self.config.get(name)
        }
        generation_eos = generation.get("eos_token_id")
        generation_ids = [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
        eos_token = self.special_tokens.get("eos_token")
        eos_id = self._token_id(eos_token, TOKENIZER_CONFIG_FILE) if eos_token else None
        if eos_id is None and not generation_ids:
            raise RecipeError(
                f"model.path: no end-of-sequence token: neither {self.path / TOKENIZER_CONFIG_FILE} "
                f"has an eos_token nor {self.path / GENERATION_CONFIG_FILE} an eos_token_id"
            )
        self.eos_id: int = eos_id if eos_id is not None else generation_ids[0]
        self.stop_ids: tuple[int, ...] = tuple(dict.fromkeys([self.eos_id, *generation_ids]))
        self._stops = frozenset(self.stop_ids)
        pad_token = self.special_tokens.get("pad_token")
        self.pad_id: int = self._token_id(pad_token, TOKENIZER_CONFIG_FILE) if pad_token else self.eos_id
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        # What `encode_plain` encodes its text after: the end-of-sequence token's text, where it
        # encodes as that one token (an added token, split off before anything else), else nothing.
        eos_text = self._tokenizer.id_to_token(self.eos_id)
        encoded = self._tokenizer.encode(eos_text or "", add_special_tokens=False).ids
        self._anchor: str | None = eos_text if encoded == [self.eos_id] else None
        self._template: Any = None
        self._built = datetime.now()

    def _token_id(self, token: str, source: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise RecipeError(f"{self.path / source}: token {token!r} is not in {self.path / TOKENIZER_FILE}")
        return token_id

    def encode(self, text: str, *, where: str = "text") -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=True).ids

    def encode_plain(self, text: str, *, where: str = "text") -> list[int]:
        """`text` as it continues a sequence: no special tokens added, and encoded as it follows
        a special token (the end-of-sequence token, which the model's turns end with), so a
        tokenizer that marks a space before the text it encodes ("▁", SentencePiece style:
        Metaspace with prepend_scheme "first") puts no stray mark between the two."""
        if self._anchor is None:
            return self._tokenizer.encode(text, add_special_tokens=False).ids
        return self._tokenizer.encode(self._anchor + text, add_special_tokens=False).ids[1:]

    def encode_chat(self, text: str, *, system: str | None = None, where: str = "text") -> list[int]:
        """Ids of `text` as a user turn (after `system`, if given) rendered by the chat template."""
        rendered = self.render_chat(text, system=system)
        return self._tokenizer.encode(rendered, add_special_tokens=False).ids

    def render_chat(self, text: str, *, system: str | None = None) -> str:
        """The chat template's text for one user turn, ending with the assistant's prompt."""
        messages = [{"role": "system", "content": system}] if system is not None else []
        messages.append({"role": "user", "content": text})
        return self.render(messages, add_generation_prompt=True)

    def render(self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool) -> str:
        """The chat template's text for `messages` (`role` and `content` each); a template that
        fails to compile or render (a Jinja error, not its own `raise_exception`) is a
        `RecipeError` naming prompts.chat_template."""
        from jinja2 import TemplateError

        try:
            return self._chat_template().render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self.special_tokens,
            )
        except TemplateError as error:
            raise RecipeError(
                f"prompts.chat_template: the model's chat template fails to render: "
                f"{type(error).__name__}: {error}"
            ) from None

    def text_of(self, ids: Sequence[int]) -> str:
        """The text of `ids` exactly, special tokens (and stop ids) written out as their text."""
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def decode(self, ids: Sequence[int]) -> str:
        """Text up to the first stop id, special tokens skipped.

        Ids past the tokenizer's vocabulary (models pad theirs) decode as U+FFFD, so they can
        never match an answer.
        """
        pieces: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self._stops:
                break
            if 0 <= i < self.vocab_size:
                run.append(i)
                continue
            pieces.append(self._tokenizer.decode(run, skip_special_tokens=True))
            pieces.append("\ufffd")
            run = []
        pieces.append(self._tokenizer.decode(run, skip_special_tokens=True))
        return "".join(pieces)

    def _chat_template(self) -> Any:
        if self._template is None:
            source = self._template_source()
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = self._built.strftime
            self._template = env.from_string(source)
        return self._template

    def _template_source(self) -> str:
        template = self.config.get("chat_template")
        if isinstance(template, list):  # several named templates: the default one is used
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if isinstance(template, str):
            return template
        jinja = self.path / CHAT_TEMPLATE_FILE
        if jinja.is_file():
            try:
                return read_text(jinja)
            except NotText as error:
                raise RecipeError(str(error)) from None
        raise RecipeError(
            f"prompts.chat_template: the model has no chat template: neither {jinja} exists nor "
            f"{self.path / TOKENIZER_CONFIG_FILE} has a chat_template"
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(read_text(path))
    except NotText as error:
        raise RecipeError(str(error)) from None
    except json.JSONDecodeError as error:
        raise RecipeError(f"{path}: not valid JSON: {error.msg} (line {error.lineno})") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_text(token: Any) -> str:
    # tokenizer_config.json writes a special token as its text or as a serialized AddedToken.
    return token["content"] if isinstance(token, dict) else str(token)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _raise_exception(message: str) -> None:
    raise RecipeError(f"prompts.chat_template: the model's chat template refused the prompt: {message}")
