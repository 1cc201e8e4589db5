"""An episode's conversation through a Hugging Face chat template, token-exact.

With `prompts.chat_template: true`, an episode (stages/episodes.py) is a chat: the prompt is the
user turn (after `prompts.system_prompt`, as `stages.prompts` renders it), each model turn is
the assistant's message and each observation a message of `rollout.observation_role`. The
context the engine continues, and what is trained, is the model's tokens exactly as generated
(never re-encoded from their text) and, between two turns, the template's own text for "end of
the assistant's turn + the observation's message + start of the next assistant turn", encoded.

Those tokens come from rendering and diffing: `Conversation.text` is the template's text of the
conversation so far (ending with its generation prompt), which is the exact text of the
context's tokens; after a turn, the conversation is rendered with the turn and the observation
added, and what follows the model's turn in it is encoded. Two checks keep it exact, each
refused with one `RecipeError` naming prompts.chat_template rather than training on drifted
tokens:
- the new rendering begins with the old one: a template whose text of earlier turns changes as
  messages are added (one that drops earlier turns' reasoning) cannot be continued, since the
  context the model saw is not what the template would now write;
- after the old text, the template writes the model's turn as generated.

The template's end of an assistant turn (`turn_end`: the stop id whose text it writes right
after a message's content, `<|im_end|>` in ChatML) is the model's own when it generated it:
trained (loss mask 1), its text not part of the message's content, and the template's text
after it encoded as it follows that token (a tokenizer that marks a space before the text it
encodes, SentencePiece style, marks none after a special token). A turn without it (cut at
`max_new_tokens`, or ended by another stop id, whose text then stays in the content) has the
template's turn end written after it, with the observation.

`ChatTurns` checks the template when built (at `validate` as at `run`) by playing a two-round
conversation, with reasoning in the model's turns, through the same code.
"""

from __future__ import annotations

from collections.abc import Sequence

from pipeline.contracts.errors import RecipeError
from pipeline.contracts.messages import Prompt
from stages.prompts import PromptsSection
from stages.rollout import RolloutSection
from stages.tokenizer import ChatTokenizer, Tokenizer

Message = dict[str, str]
_PROBE = Prompt(prompt_id="probe", text="Probe question.", tokens=(), answer="")
_PROBE_TURNS = (
    "<think>\nFirst, think.\n</think>\n\nMy first answer.",
    "<think>\nAgain.\n</think>\n\nMy second.",
)


def chat_turns(prompts: PromptsSection, rollout: RolloutSection, tokenizer: Tokenizer) -> ChatTurns | None:
    """The recipe's `ChatTurns`: with `prompts.chat_template` and `rollout.environment`, else None."""
    if not (prompts.chat_template and rollout.environment):
        return None
    # build_prompts refuses prompts.chat_template without a tokenizer that has a template.
    assert isinstance(tokenizer, ChatTokenizer)
    return ChatTurns(tokenizer, system=prompts.system_prompt, role=rollout.observation_role)


class ChatTurns:
    """Starts each episode's `Conversation`; built only for a template it has checked (see the
    module docstring), else it raises `RecipeError`."""

    def __init__(self, tokenizer: ChatTokenizer, *, system: str | None, role: str) -> None:
        self.tokenizer = tokenizer
        self.system = system
        self.role = role
        self.turn_end = self._turn_end()
        probe = self.conversation(_PROBE)
        for text in _PROBE_TURNS:
            ending = () if self.turn_end is None else (self.turn_end,)
            probe.after((*tokenizer.encode_plain(text), *ending), "Probe reply.")

    def conversation(self, prompt: Prompt) -> Conversation:
        """The conversation of an episode from `prompt`, whose tokens are its rendering."""
        messages = [{"role": "system", "content": self.system}] if self.system is not None else []
        messages.append({"role": "user", "content": prompt.text})
        return Conversation(self, messages)

    def _turn_end(self) -> int | None:
        """The stop id whose text the template writes right after an assistant message's content
        (None for none, or for a template that does not write the content there as given: the
        probe refuses that one)."""
        asked = self.conversation(_PROBE)
        head = asked.text + "Probe answer."
        answered = [
            {"role": "assistant", "content": "Probe answer."},
            {"role": self.role, "content": "Probe reply."},
        ]
        text = self.tokenizer.render([*asked.messages, *answered], add_generation_prompt=True)
        after = text[len(head) :] if text.startswith(head) else ""
        for stop in self.tokenizer.stop_ids:
            written = self.tokenizer.text_of([stop])
            if written and after.startswith(written):
                return stop
        return None


class Conversation:
    """One episode's messages and `text`, the template's text of them, which the episode's
    context (the prompt's tokens and every token after them) spells exactly."""

    def __init__(self, chat: ChatTurns, messages: list[Message]) -> None:
        self.chat = chat
        self.messages = messages
        self.text = chat.tokenizer.render(messages, add_generation_prompt=True)

    def after(self, turn: Sequence[int], observation: str) -> tuple[int, ...]:
        """The tokens that follow the model's `turn` (its tokens exactly as generated) to answer it
        with `observation` and open the next assistant turn; both become messages. Raises
        `RecipeError` where the template would not continue the context exactly."""
        tokenizer = self.chat.tokenizer
        closed = bool(turn) and turn[-1] == self.chat.turn_end
        content = tokenizer.text_of(turn[:-1] if closed else turn)
        messages = [
            *self.messages,
            {"role": "assistant", "content": content},
            {"role": self.chat.role, "content": observation},
        ]
        text = tokenizer.render(messages, add_generation_prompt=True)
        if not text.startswith(self.text):
            raise _refused(
                "adding messages changes its text of the turns before them (as a template that drops "
                "earlier turns' reasoning, or writes a generation prompt unlike its assistant "
                f"messages, does){_difference(self.text, text)}"
            )
        written = content + tokenizer.text_of(turn[-1:]) if closed else content
        added = text[len(self.text) :]
        if not added.startswith(written):
            raise _refused(f"it does not write the model's turn as generated{_difference(written, added)}")
        self.messages, self.text = messages, text
        rest = added[len(written) :]
        if not closed:
            return tuple(tokenizer.encode_plain(rest, where="the chat template's text"))
        # Encoded as it follows the turn's end token: a tokenizer that marks a space before the
        # text it encodes ("▁", SentencePiece style) marks none after a special token.
        ids = tokenizer.encode_plain(tokenizer.text_of(turn[-1:]) + rest, where="the chat template's text")
        if ids[:1] != [turn[-1]]:
            raise _refused("its tokenizer does not encode the text of the turn's end as that token")
        return tuple(ids[1:])


def _refused(reason: str) -> RecipeError:
    return RecipeError(
        f"prompts.chat_template: the model's chat template cannot continue an episode: {reason}"
    )


def _difference(expected: str, got: str) -> str:
    """Where `got` stops following `expected`, as a short quote of each."""
    at = next(
        (i for i, (a, b) in enumerate(zip(expected, got, strict=False)) if a != b),
        min(len(expected), len(got)),
    )
    return f" (at character {at}: {expected[at : at + 24]!r} became {got[at : at + 24]!r})"
