"""Multi-turn episodes through a Hugging Face chat template (stages/chat_turns.py): what is
trained is the prompt, the engine's tokens exactly as generated and the template's own tokens
between the turns; a template that cannot continue an episode exactly is refused with one line."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from pipeline.contracts.environments import Observation, Turn
from pipeline.contracts.errors import RecipeError
from pipeline.contracts.messages import Completion, Prompt, TrainGroup
from pipeline.shell.cli import main
from pipeline.testing import FakeEngine, FakeTime, FakeTrainer
from stages.chat_turns import ChatTurns
from stages.episodes import Episode
from stages.hf_tokenizer import HFTokenizer
from tests.conftest import TINY_CORPUS, write_tiny_tokenizer
from tests.stages.test_episodes import _play
from tests.stages.test_flow import drive, make_recipe

QUESTION = "What is 3 + 4?"
TINY_HF = Path(__file__).parents[1] / "data" / "tiny-hf.yaml"
# The conftest's ChatML template, but an assistant message before the latest one loses its
# reasoning (the text up to `</think>`), as Qwen3's does before a new user message.
DROPS_EARLIER_REASONING = (
    "{% for message in messages %}{% set content = message['content'] %}"
    "{% if message['role'] == 'assistant' and loop.index0 < messages|length - 2 %}"
    "{% set content = content.split('</think>')[-1] %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
EARLIER_TURNS_REFUSED = (  # at the character where the first turn's text changes
    "prompts.chat_template: the model's chat template cannot continue an episode: adding "
    "messages changes its text of the turns before them (as a template that drops earlier "
    "turns' reasoning, or writes a generation prompt unlike its assistant messages, does) "
    "(at character {at}: '<think>\\nFirst, think.\\n</' became '\\n\\nMy first answer.<|im_e')"
)
# ChatML with each message's content trimmed of surrounding whitespace.
TRIMS = DROPS_EARLIER_REASONING.replace("content.split('</think>')[-1]", "content").replace(
    "+ content +", "+ content | trim +"
)


def tokenizer_dir(directory: Path, template: str | None = None) -> Path:
    """A tiny Hugging Face tokenizer directory (conftest's ChatML template, or `template`)."""
    directory.mkdir(exist_ok=True)
    write_tiny_tokenizer(directory)
    if template is not None:
        config = json.loads((directory / "tokenizer_config.json").read_text())
        (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    return directory


@pytest.fixture(scope="module")
def chatml(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenizer_dir(tmp_path_factory.mktemp("chatml"))


class ScriptedChat(FakeEngine):
    """Answers call k with `turns[k]` (tokens, finish reason), logprob -1 - k on each token;
    records each context it was given."""

    def __init__(self, turns: Sequence[tuple[tuple[int, ...], str]]) -> None:
        super().__init__()
        self.turns = turns
        self.contexts: list[tuple[int, ...]] = []

    async def generate(
        self, prompt_tokens: Sequence[int], n: int, *, greedy: bool = False, episode: str | None = None
    ) -> list[Completion]:
        tokens, finish = self.turns[self.calls]
        self.calls += 1
        self.contexts.append(tuple(prompt_tokens))
        return [
            Completion(tokens=tokens, logprobs=(-float(self.calls),) * len(tokens), finish_reason=finish)
        ] * n


class Feedback:
    """Replies `higher`, then `lower`; ends the episode at the third turn, reward 1."""

    def __init__(self) -> None:
        self.turns: list[Turn] = []

    async def start(self, prompt: Prompt) -> Observation:
        return Observation()

    async def step(self, turn: Turn) -> Observation:
        self.turns.append(turn)
        if turn.index == 2:
            return Observation(text="right", reward=1.0, done=True)
        return Observation(text=("higher", "lower")[turn.index])


def _chat(directory: Path) -> tuple[HFTokenizer, ChatTurns, Prompt]:
    """The tokenizer of `directory`, its chat turns (tool messages) and a prompt through its template."""
    tokenizer = HFTokenizer(directory)
    prompt = Prompt(prompt_id="p0", text=QUESTION, tokens=tuple(tokenizer.encode_chat(QUESTION)), answer="7")
    return tokenizer, ChatTurns(tokenizer, system=None, role="tool"), prompt


async def _episode(
    directory: Path, turns: Sequence[tuple[tuple[int, ...], str]], env: Any = Feedback, **section: Any
) -> tuple[Episode | BaseException, ScriptedChat, Prompt]:
    tokenizer, chat, prompt = _chat(directory)
    engine = ScriptedChat(turns)
    episode, _ = await _play(
        env, engine, FakeTime(), prompt=prompt, tokenizer=tokenizer, chat=chat, **section
    )
    return episode, engine, prompt


async def test_a_three_turn_chat_trains_the_engines_tokens_and_the_templates_between(chatml: Path) -> None:
    """Turn 0 ends with the template's turn end (<|im_end|>) itself, turn 1 is cut at
    max_new_tokens, turn 2 ends the episode: between the turns stand exactly the template's
    rest of the assistant's turn, the tool message and the next assistant turn's start."""
    tokenizer = HFTokenizer(chatml)
    end = tokenizer.eos_id
    assert tokenizer.text_of([end]) == "<|im_end|>"
    first = (*tokenizer.encode_plain("I guess 5"), end)
    second = tuple(tokenizer.encode_plain("I guess 7 and"))
    third = (*tokenizer.encode_plain("It is 6"), end)
    env = Feedback()
    episode, engine, prompt = await _episode(
        chatml, [(first, "stop"), (second, "length"), (third, "stop")], lambda: env
    )
    assert isinstance(episode, Episode), episode
    between = [
        tuple(tokenizer.encode_plain(text))
        for text in (
            "\n<|im_start|>tool\nhigher<|im_end|>\n<|im_start|>assistant\n",
            "<|im_end|>\n<|im_start|>tool\nlower<|im_end|>\n<|im_start|>assistant\n",
        )
    ]
    assert episode.tokens == (*first, *between[0], *second, *between[1], *third)
    assert episode.loss_mask == (
        *[1] * len(first),
        *[0] * len(between[0]),
        *[1] * len(second),
        *[0] * len(between[1]),
        *[1] * len(third),
    )
    assert [lp for lp, m in zip(episode.logprobs, episode.loss_mask, strict=True) if m] == (
        [-1.0] * len(first) + [-2.0] * len(second) + [-3.0] * len(third)
    )
    # The engine continued exactly this context each turn, the prompt through the template first.
    starts = (0, len(first) + len(between[0]), len(episode.tokens) - len(third))
    assert engine.contexts == [prompt.tokens + episode.tokens[:n] for n in starts]
    assert [t.text for t in env.turns] == ["I guess 5", "I guess 7 and", "It is 6"]
    # The whole sequence spells what transformers renders for the conversation.
    messages = [{"role": "user", "content": QUESTION}]
    for content, reply in (("I guess 5", "higher"), ("I guess 7 and", "lower")):
        messages += [{"role": "assistant", "content": content}, {"role": "tool", "content": reply}]
    messages.append({"role": "assistant", "content": "It is 6"})
    reference = PreTrainedTokenizerFast.from_pretrained(chatml, local_files_only=True)
    rendered = reference.apply_chat_template(messages, tokenize=False)
    assert tokenizer.text_of(prompt.tokens + episode.tokens) + "\n" == rendered


async def test_observations_can_be_user_messages(chatml: Path) -> None:
    tokenizer, _, prompt = _chat(chatml)
    chat = ChatTurns(tokenizer, system=None, role="user")
    turn = (*tokenizer.encode_plain("I guess 5"), tokenizer.eos_id)
    between = chat.conversation(prompt).after(turn, "higher")
    assert tokenizer.text_of(between) == "\n<|im_start|>user\nhigher<|im_end|>\n<|im_start|>assistant\n"


def test_a_template_that_rewrites_earlier_turns_is_refused(tmp_path: Path) -> None:
    """Checked when built: a two-round conversation whose first turn's reasoning the template
    drops once a second turn follows."""
    with pytest.raises(RecipeError) as raised:
        _chat(tokenizer_dir(tmp_path, DROPS_EARLIER_REASONING))
    assert str(raised.value) == EARLIER_TURNS_REFUSED.format(at=65)


async def test_a_template_that_rewrites_the_models_turn_stops_the_episode(tmp_path: Path) -> None:
    """A template that trims each message passes the check when built, but a turn the model
    ends with a space cannot be continued as generated: the run stops, not the episode."""
    directory = tokenizer_dir(tmp_path, TRIMS)
    tokenizer = HFTokenizer(directory)
    turn = (*tokenizer.encode_plain("7 "), tokenizer.eos_id)
    raised, _, _ = await _episode(directory, [(turn, "stop")])
    assert isinstance(raised, RecipeError)
    assert str(raised) == (
        "prompts.chat_template: the model's chat template cannot continue an episode: it does not "
        "write the model's turn as generated (at character 1: ' <|im_end|>' became "
        "'<|im_end|>\\n<|im_start|>t')"
    )


class StartsWithText(Feedback):
    async def start(self, prompt: Prompt) -> Observation:
        return Observation(text="You have four guesses.")


class RepliesTokens(Feedback):
    async def step(self, turn: Turn) -> Observation:
        return Observation(tokens=(5, 6))


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        (
            StartsWithText,
            "start returned an observation to put before the first turn; with prompts.chat_template "
            "the prompt is the whole first user turn",
        ),
        (
            RepliesTokens,
            "observation given as tokens; with prompts.chat_template it is text, a message the "
            "template renders",
        ),
    ],
    ids=["start-observation", "tokens"],
)
async def test_an_observation_a_template_cannot_render_fails_its_episode(
    chatml: Path, env: Any, reason: str
) -> None:
    tokenizer = HFTokenizer(chatml)
    counts: Counter[str] = Counter()
    turn = (*tokenizer.encode_plain("5"), tokenizer.eos_id)
    episode, _, _ = await _episode(chatml, [(turn, "stop")], env, counts=counts)
    assert isinstance(episode, Episode), episode
    assert (episode.reward, episode.stats.failed) == (None, reason)


async def test_the_pipeline_trains_chat_episodes_through_the_template(chatml: Path, tmp_path: Path) -> None:
    """The real wiring on fakes: with prompts.chat_template the rollout's episodes go through
    the model's template, the environment's replies as tool messages between the turns."""
    fake = FakeTime()
    recipe = make_recipe(
        tmp_path,
        steps=1,
        model={"path": str(chatml)},
        prompts={"chat_template": True},
        rollout={"max_new_tokens": 4, "environment": "tests.stages.test_chat_turns:Feedback"},
        reward={"function": "tests.stages.test_episodes:never_called", "reward_s": 1.0e9},
    )
    trained: list[TrainGroup] = []
    trainer = FakeTrainer(time=fake, on_step=lambda version, groups: trained.extend(groups))
    await drive(recipe, FakeEngine(time=fake, response_len=4), trainer, fake)
    tokenizer = HFTokenizer(chatml)
    samples = [s for g in trained for s in g.samples]
    assert samples
    for sample in samples:
        text = tokenizer.text_of(sample.tokens)
        for reply in ("higher", "lower"):
            assert f"<|im_start|>tool\n{reply}<|im_end|>\n<|im_start|>assistant\n" in text
        assert sum(sample.loss_mask) == 3 * 4  # three turns of the engine's four tokens


def test_validate_refuses_a_template_that_rewrites_earlier_turns(
    tiny_qwen2_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`validate` exits 2 with the one line, before any weights are read."""
    model = tokenizer_dir(tmp_path / "model", DROPS_EARLIER_REASONING)
    shutil.copy(tiny_qwen2_dir / "config.json", model)
    data = tmp_path / "math.jsonl"
    data.write_text(json.dumps({"prompt": QUESTION, "answer": "7"}) + "\n")
    overrides = [
        f"model.path={model}",
        f"prompts.source.path={data}",
        "rollout.environment=tests.stages.test_chat_turns:Feedback",
        f"run.dir={tmp_path / 'run'}",  # not the default's, which a quickstart run may have left
    ]
    assert main(["validate", str(TINY_HF), *overrides]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    # Further in: tiny-hf.yaml's system prompt comes first.
    assert line == "error: " + EARLIER_TURNS_REFUSED.format(at=133)


# ChatML, but a tool message also reads a message the conversation does not have.
FAILS_ON_TOOL = TRIMS.replace(
    "{% set content = message['content'] %}",
    "{% set content = message['content'] %}{% if message['role'] == 'tool' %}"
    "{% set content = content ~ messages[99]['content'] %}{% endif %}",
)


def test_a_template_that_fails_to_render_is_refused_in_one_line(tmp_path: Path) -> None:
    """A template error (not `raise_exception`) is a `RecipeError` naming the field, not a traceback."""
    with pytest.raises(RecipeError) as raised:
        _chat(tokenizer_dir(tmp_path, FAILS_ON_TOOL))
    assert str(raised.value) == (
        "prompts.chat_template: the model's chat template fails to render: UndefinedError: "
        "list object has no element 99"
    )


def _metaspace_dir(directory: Path) -> Path:
    """The tiny tokenizer directory, its tokenizer a SentencePiece-style BPE that marks a word's
    space with "▁" and adds one before the text it encodes (Metaspace, prepend_scheme "first",
    as Mistral's and Llama's converted tokenizers do): never after a special token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer_dir(directory)
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tokenizer.decoder = decoders.Metaspace(prepend_scheme="first")
    corpus = ["system\nuser\nassistant\ntool\nhigher lower right", *TINY_CORPUS]
    special = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=special))
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


async def test_the_templates_tokens_after_a_closed_turn_are_encoded_as_they_follow_its_end(
    tmp_path: Path,
) -> None:
    """With a tokenizer that adds a "▁" before the text it encodes, the template's text after a
    turn the model closed with <|im_end|> is encoded as it follows that token (no "▁" of its
    own): a turn tokenized as the template's text would be gives the whole conversation's text
    encoded in one piece, as a single-turn prompt would be."""
    directory = _metaspace_dir(tmp_path / "model")
    tokenizer, _, prompt = _chat(directory)
    end = tokenizer.eos_id
    whole = tokenizer.encode_plain(tokenizer.text_of(prompt.tokens) + "7<|im_end|>")
    turn = tuple(whole[len(prompt.tokens) :])
    assert turn[-1] == end
    episode, _, _ = await _episode(directory, [(turn, "stop")] * 3)
    assert isinstance(episode, Episode), episode
    messages = [{"role": "user", "content": QUESTION}]
    for reply in ("higher", "lower"):
        messages += [{"role": "assistant", "content": "7"}, {"role": "tool", "content": reply}]
    messages.append({"role": "assistant", "content": "7"})
    rendered = tokenizer.encode_plain(tokenizer.render(messages, add_generation_prompt=False))
    assert prompt.tokens + episode.tokens == tuple(rendered[:-1])  # all but the closing newline


def test_a_turn_end_its_tokenizer_does_not_encode_as_that_token_is_refused(tmp_path: Path) -> None:
    """<|im_end|> in the vocabulary but not an added token: its text encodes as pieces, so the
    text after a closed turn cannot be encoded as it follows the token; refused when built."""
    directory = tokenizer_dir(tmp_path)
    spec = json.loads((directory / "tokenizer.json").read_text())
    spec["added_tokens"] = [t for t in spec["added_tokens"] if t["content"] != "<|im_end|>"]
    spec["model"]["vocab"].setdefault("<|im_end|>", len(spec["model"]["vocab"]))
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(RecipeError) as raised:
        _chat(directory)
    assert str(raised.value) == (
        "prompts.chat_template: the model's chat template cannot continue an episode: its "
        "tokenizer does not encode the text of the turn's end as that token"
    )


async def test_a_plain_episodes_text_replies_are_encoded_as_they_follow_the_models_turn(
    tmp_path: Path,
) -> None:
    """Without a chat template, with a tokenizer that adds a "▁" before the text it encodes: each
    reply's text is encoded as it follows the model's turn (ended by its end-of-sequence token),
    with no "▁" of its own, so the episode's context is the whole conversation's text encoded in
    one piece (a reply encoded alone would put a stray "▁" token in it)."""
    directory = _metaspace_dir(tmp_path / "model")
    tokenizer = HFTokenizer(directory)
    prompt = Prompt(prompt_id="p0", text=QUESTION, tokens=tuple(tokenizer.encode(QUESTION)), answer="7")
    turn = (*tokenizer.encode(" 7"), tokenizer.eos_id)
    engine = ScriptedChat([(turn, "stop")] * 3)
    episode, _ = await _play(Feedback, engine, FakeTime(), prompt=prompt, tokenizer=tokenizer)
    assert isinstance(episode, Episode), episode
    assert episode.loss_mask.count(0) == len(tokenizer.encode_plain("higher")) + len(
        tokenizer.encode_plain("lower")
    )
    context = prompt.tokens + episode.tokens
    text = tokenizer.text_of(context)
    assert text == QUESTION + " 7<|im_end|>higher 7<|im_end|>lower 7<|im_end|>"
    assert tuple(tokenizer.encode(text)) == context
