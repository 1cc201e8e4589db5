"""The torch engine keeps an episode's keys and values between its turns (backends/torch/kv_keep.py):
greedy episodes played by the real `Episodes` against the real engine give the tokens and
logprobs of whole-context prefills while prefilling only each turn's new tokens; a wake or a
refit between turns, an eviction and a prompt that does not continue the kept tokens each
prefill the whole context again, counted; a turn frozen at a stand-down continues correctly."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import anyio
import pytest
import torch

from backends.torch.config import ModelConfig
from backends.torch.engine import TorchEngine
from backends.torch.kv_keep import KeptKV, KVKeep
from backends.torch.model import Decoder
from backends.torch.sampler import Sampler
from pipeline.clock import DeadlineClock
from pipeline.contracts.environments import Observation, Turn
from pipeline.contracts.messages import Completion, Prompt
from pipeline.gate import EngineGate
from stages.episodes import Episode, Episodes
from stages.rollout import RolloutSection
from stages.tokenizer import CharTokenizer
from tests.backends.test_torch_serving import _hold_draw

TOKENIZER = CharTokenizer("0123456789<>?")
PROMPT = Prompt(prompt_id="p0", text="12?", tokens=tuple(TOKENIZER.encode("12?")), answer="7")
NEW = 4  # tokens a turn generates (no stop tokens: every turn runs to its limit)
REPLIES = ((5, 6), (7,), (8, 9, 10))  # the environment's tokens: at the start, after turns 0 and 1


def _model(positions: int = 0) -> Decoder:
    """With ``positions``, learned position embeddings for that many (else rotary)."""
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=TOKENIZER.vocab_size,
        hidden_size=64,
        max_position_embeddings=positions or 64,
        learned_position_embeddings=bool(positions),
    )
    model = Decoder(config)
    with torch.no_grad():  # sharper, so greedy choices are not near-ties
        model.model.embed_tokens.weight.mul_(3)
    return model


def _engine(
    model: Decoder, keep_bytes: int, *, shared: bool = True, new: int = NEW, **options: Any
) -> TorchEngine:
    return TorchEngine(
        Sampler(model),
        shared=shared,
        source=model if shared else copy.deepcopy(model),
        max_new_tokens=new,
        temperature=1.0,
        top_p=1.0,
        stop_token_ids=(),
        seed=0,
        keep_bytes=keep_bytes,
        **options,
    )


def _prefills(model: Decoder) -> list[int]:
    """The tokens of each prefill the model runs from now on (a decode step embeds one token
    per row, [rows]; a prefill [rows, tokens])."""
    sizes: list[int] = []

    def count(_: Any, args: tuple[torch.Tensor, ...]) -> None:
        if args[0].dim() == 2:
            sizes.append(args[0].shape[1])

    model.model.embed_tokens.register_forward_pre_hook(count)
    return sizes


class Replies:
    """Starts with REPLIES[0], answers turn k with REPLIES[k + 1] (after `between(k)`), ends
    the episode at the third turn."""

    def __init__(self, between: Any = None) -> None:
        self.between = between

    async def start(self, prompt: Prompt) -> Observation:
        return Observation(tokens=REPLIES[0])

    async def step(self, turn: Turn) -> Observation:
        if self.between is not None:
            await self.between(turn.index)
        if turn.index == 2:
            return Observation(reward=1.0, done=True)
        return Observation(tokens=REPLIES[turn.index + 1])


async def _play(engine: TorchEngine, between: Any = None) -> tuple[Episode, EngineGate]:
    clock = DeadlineClock()
    gate = EngineGate(engine, clock)
    episodes = Episodes(
        RolloutSection(max_new_tokens=NEW, max_episode_tokens=64, max_retries=0),
        factory=lambda: Replies(None if between is None else lambda index: between(gate, index)),
        tokenizer=TOKENIZER,
        gate=gate,
        clock=clock,
    )
    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(clock.run)
                await anyio.wait_all_tasks_blocked()
                episode = await episodes.run(PROMPT, counts=Counter(), greedy=True)
                tg.cancel_scope.cancel()
    finally:
        engine.close()
    assert not episode.stats.failed, episode.stats.failed
    return episode, gate


def _contexts(episode: Episode) -> list[int]:
    """The length of each turn's context: the prompt and everything before the turn."""
    starts = [i for i, m in enumerate(episode.loss_mask) if m and (i == 0 or not episode.loss_mask[i - 1])]
    return [len(PROMPT.tokens) + start for start in starts]


async def test_a_three_turn_episode_prefills_only_its_new_tokens_with_the_tokens_of_full_prefills() -> None:
    """Greedy, the kept keys and values give the tokens (and logprobs, to float rounding) of
    whole-context prefills; each turn after the first prefills its last turn's last token (whose
    keys the engine did not keep) and the environment's reply, nothing else; none is counted as
    re-prefilled, and the ended episode leaves nothing kept."""
    full_model, kept_model = _model(), _model()
    full_prefills, kept_prefills = _prefills(full_model), _prefills(kept_model)
    full, _ = await _play(_engine(full_model, 0))
    engine = _engine(kept_model, 1 << 20)
    kept, _ = await _play(engine)

    assert kept.tokens == full.tokens
    assert kept.logprobs == pytest.approx(full.logprobs, abs=1e-5)
    contexts = _contexts(full)
    assert full_prefills == contexts
    assert full.stats.reprefilled_tokens == sum(contexts[1:])
    assert kept_prefills == [contexts[0], 1 + len(REPLIES[1]), 1 + len(REPLIES[2])]
    assert kept.stats.reprefilled_tokens == 0
    assert engine.kept is not None and engine.kept.resident_bytes == 0  # `end_episode` dropped it


@pytest.mark.parametrize("how", ["wake", "refit", "load"])
async def test_new_weights_between_two_turns_prefill_the_next_turn_whole_and_count_it(how: str) -> None:
    """New weights between turns 0 and 1 (a train step: a stand-down and a wake colocated, else
    a refit; or a load of weights sent from elsewhere): turn 1 prefills its whole context and
    counts it, even though the weights stayed as they were; turn 2 continues from turn 1's kept
    keys and values again. Colocated, the stand-down gives the kept keys and values' memory back."""
    model = _model()
    prefills = _prefills(model)
    shared = how == "wake"
    engine = _engine(model, 1 << 20, shared=shared)
    held: list[int | None] = []

    async def between(gate: EngineGate, index: int) -> None:
        async def train() -> None:
            held.append(engine.memory_in_use())

        if index == 0 and how == "load":
            await engine.load_weights({name: p.detach().clone() for name, p in model.named_parameters()})
        elif index == 0:
            await gate.step(train)

    episode, _ = await _play(engine, between)
    contexts = _contexts(episode)
    assert prefills == [contexts[0], contexts[1], 1 + len(REPLIES[2])]
    assert episode.stats.reprefilled_tokens == contexts[1]
    if shared:
        assert held == [0]
    full, _ = await _play(_engine(_model(), 0))
    assert episode.tokens == full.tokens


async def test_an_evicted_episode_prefills_its_next_turn_whole() -> None:
    """A budget that holds one turn's keys and values: keeping episode b's evicts a's, whose
    next turn prefills its whole context (and gives the tokens of a fresh engine), while b's
    continues from what it kept."""
    model = _model()
    config = model.config
    assert config.head_dim is not None
    per_token = config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * 4
    engine = _engine(model, per_token * (len(PROMPT.tokens) + NEW - 1))
    other = [2, 9, 8, 7]  # as long as PROMPT's tokens: its turn keeps as much
    try:
        with anyio.fail_after(60):
            (a,) = await engine.generate(PROMPT.tokens, 1, greedy=True, episode="a")
            (b,) = await engine.generate(other, 1, greedy=True, episode="b")
            a_next = (*PROMPT.tokens, *a.tokens, 5)
            b_next = (*other, *b.tokens, 5)
            (a2,) = await engine.generate(a_next, 1, greedy=True, episode="a")
            (b2,) = await engine.generate(b_next, 1, greedy=True, episode="b")
    finally:
        engine.close()
    # (a's second turn, longer than the budget, is not kept: b's stays.)
    assert engine.kept is not None and engine.kept.evicted == 1
    assert (a2.reused_tokens, b2.reused_tokens) == (0, len(other) + NEW - 1)
    fresh = _engine(_model(), 0)
    try:
        (a_fresh,) = await fresh.generate(a_next, 1, greedy=True)
        (b_fresh,) = await fresh.generate(b_next, 1, greedy=True)
    finally:
        fresh.close()
    assert (a2.tokens, b2.tokens) == (a_fresh.tokens, b_fresh.tokens)
    assert b2.logprobs == pytest.approx(b_fresh.logprobs, abs=1e-5)


async def _second_turns(
    engine: TorchEngine,
    prompts: dict[str, list[int]],
    replies: dict[str, list[int]],
    others: dict[str, list[int]] | None = None,
) -> tuple[dict[str, Completion], dict[str, list[int]], list[tuple[int, int]]]:
    """Each episode's first turn from ``prompts`` (greedy, one by one), then their second turns
    (each its first turn's context and ``replies``) and requests of no episode (``others``)
    sent together, in one loop (asserted): the second turns' Completions, their contexts, and
    the shape of each prefill's tokens for the second turns. Closes the engine."""
    model = engine.sampler.model
    shapes: list[tuple[int, int]] = []
    second: dict[str, Completion] = {}

    def count(_: Any, args: tuple[torch.Tensor, ...]) -> None:
        if args[0].dim() == 2:
            shapes.append(tuple(args[0].shape))

    async def turn(key: str, context: list[int], episode: str | None) -> None:
        (second[key],) = await engine.generate(context, 1, greedy=True, episode=episode)

    try:
        with anyio.fail_after(60):
            first = {
                key: (await engine.generate(p, 1, greedy=True, episode=key))[0] for key, p in prompts.items()
            }
            contexts = {key: [*prompts[key], *first[key].tokens, *replies[key]] for key in prompts}
            model.model.embed_tokens.register_forward_pre_hook(count)
            while engine._loop is not None:  # the last loop may still look for requests to admit
                await anyio.sleep(0.01)
            loops = engine.calls
            async with anyio.create_task_group() as tg:
                for key, context in contexts.items():
                    tg.start_soon(turn, key, context, key)
                for key, context in (others or {}).items():
                    tg.start_soon(turn, key, context, None)
    finally:
        engine.close()
    assert engine.calls == loops + 1  # the second turns shared one loop
    assert [second[key].reused_tokens for key in prompts] == [len(prompts[key]) + NEW - 1 for key in prompts]
    return second, contexts, shapes


async def _as_whole_prefills(
    second: dict[str, Completion], contexts: dict[str, list[int]], model: Decoder, new: int = NEW
) -> None:
    """Each of ``second`` has the tokens and logprobs of its context prefilled whole by a fresh
    engine on ``model`` that keeps nothing."""
    whole = _engine(model, 0, new=new)
    try:
        for key, context in contexts.items():
            (want,) = await whole.generate(context, 1, greedy=True)
            assert second[key].tokens == want.tokens
            assert second[key].logprobs == pytest.approx(want.logprobs, abs=1e-5)
    finally:
        whole.close()


async def test_turns_entering_together_restore_their_own_keys_and_values_in_one_prefill() -> None:
    """Two episodes' second turns (kept contexts of different lengths, new tokens of different
    lengths) and a request of no episode open one loop together: the two continue in one
    right-padded forward pass, the other is prefilled whole beside them, and each gives the
    tokens and logprobs of a whole-context prefill. Learned positions, every request at the
    table's end: a's padding stays inside it (at a's last position, not past it)."""
    prompts = {"a": [2, 3, 4, 5, 6, 7, 8, 9, 10, 11], "b": [2, 6, 7, 8]}
    replies = {"a": [11], "b": [12, 13, 14, 15, 12, 13, 14]}
    other = [2, 5, 5, 6, 7]
    engine = _engine(_model(positions=19), 1 << 20)
    second, contexts, shapes = await _second_turns(engine, prompts, replies, {"other": other})
    assert sorted(shapes) == [(1, len(other)), (2, 1 + len(replies["b"]))]
    await _as_whole_prefills(second, {**contexts, "other": other}, _model(positions=19))


async def test_cache_positions_past_a_row_s_tokens_never_reach_its_continuation() -> None:
    """Two episodes continue together, one with fewer tokens than the other, over a cache whose
    memory past what is restored and prefilled holds NaN (as fresh memory under flash decode
    may): the shorter row's attention spans the longer's positions, masked, and its token and
    logprob are still a whole-context prefill's. One new token a turn: no decode step reads the
    cache (the eager CPU step would read NaN as well)."""
    model = _model()
    engine = _engine(model, 1 << 20, new=1)
    contexts: dict[str, list[int]] = {"a": [2, 3, 4], "b": [2, 6, 7, 8, 9, 10, 11]}
    second: dict[str, Completion] = {}

    async def turn(key: str) -> None:
        (second[key],) = await engine.generate(contexts[key], 1, greedy=True, episode=key)

    try:
        with anyio.fail_after(60):
            await engine.generate([2, *range(3, 14)], 2)  # a cache that no later loop grows (anew)
            for key in contexts:
                await turn(key)
                contexts[key] = [*contexts[key], *second[key].tokens, 12]
            while engine._loop is not None:
                await anyio.sleep(0.01)
            for part in engine.sampler.cache.flat:
                part.fill_(float("nan"))
            loops = engine.calls
            async with anyio.create_task_group() as tg:
                for key in contexts:
                    tg.start_soon(turn, key)
    finally:
        engine.close()
    assert engine.calls == loops + 1  # continued together
    assert [second[key].reused_tokens for key in contexts] == [3, 7]
    await _as_whole_prefills(second, contexts, _model(), new=1)


def test_the_keep_evicts_the_least_recently_kept_and_gives_back_only_a_continued_prefix() -> None:
    def entry(*tokens: int) -> KeptKV:
        return KeptKV(tokens, torch.zeros(len(tokens), 1, 2, 1, 2))  # 4 float32 per token

    keep = KVKeep(budget=16 * 4)
    keep.keep("a", entry(1, 2))
    keep.keep("b", entry(3, 4))
    keep.keep("a", entry(1, 2))  # kept again: now the most recent
    keep.keep("c", entry(5))  # 64 + 16 > 64: evicts b, the least recently kept
    assert (keep.evicted, keep.resident_bytes) == (1, 48)
    assert keep.take("b", [3, 4, 0]) is None
    assert keep.take("a", [1, 2]) is None  # nothing new after it to prefill
    assert keep.take("a", [1, 2, 3]) is None  # taken (and dropped) by the miss before
    keep.keep("a", entry(1, 2))
    assert keep.take("a", [1, 3, 3]) is None  # does not continue the kept tokens
    keep.keep("a", entry(1, 2))
    hit = keep.take("a", [1, 2, 3])
    assert hit is not None and hit.tokens == (1, 2)
    keep.keep("d", entry(*range(6)))  # larger than the whole budget: not kept
    keep.forget("c")
    assert keep.resident_bytes == 0


async def test_a_turn_frozen_at_a_stand_down_continues_under_new_weights_and_the_next_turn_reuses() -> None:
    """Partial rollouts: turn 1 starts from turn 0's kept keys and values, freezes after two
    tokens at a stand-down whose step changes the weights, and continues re-prefilled under the
    new weights; turn 2 continues from what turn 1 kept, under the new weights: every token as
    whole-context prefills of the weights that made it."""
    model = _model()
    before = copy.deepcopy(model)
    engine = _engine(model, 1 << 20, partial=True)
    gate = EngineGate(engine, DeadlineClock())
    out: list[Completion] = []

    async def turn(context: tuple[int, ...]) -> None:
        async with gate.serving():
            out.extend(await engine.generate(context, 1, greedy=True, episode="e"))

    async def train() -> None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate_up_proj.weight.mul_(-1)

    try:
        with anyio.fail_after(60):
            await turn(PROMPT.tokens)
            second = (*PROMPT.tokens, *out[0].tokens, 5)
            at_second, go = _hold_draw(model, 2)
            async with anyio.create_task_group() as tg:
                tg.start_soon(turn, second)
                while not at_second.is_set():
                    await anyio.sleep(0.01)
                tg.start_soon(gate.step, train)
                while not engine._freeze.is_set():
                    await anyio.sleep(0.01)
                go.set()
            third = (*second, *out[1].tokens, 6)
            await turn(third)
    finally:
        engine.close()

    def greedy(weights: Decoder, context: tuple[int, ...], n: int) -> Completion:
        ((completion,),) = Sampler(weights).generate(
            [(list(context), 1)], max_new_tokens=n, temperature=0.0, generator=torch.Generator()
        )
        return completion

    old = greedy(before, second, 2)
    new = greedy(model, second + old.tokens, NEW - 2)
    assert out[1].tokens == old.tokens + new.tokens
    assert out[1].logprobs == pytest.approx(old.logprobs + new.logprobs, abs=1e-5)
    assert (out[1].reused_tokens, out[1].reprefilled_tokens) == (len(second) - 2, len(second) + 2)
    last = greedy(model, third, NEW)
    assert out[2].reused_tokens == len(third) - 2
    assert out[2].tokens == last.tokens
    assert out[2].logprobs == pytest.approx(last.logprobs, abs=1e-5)


def test_a_turn_given_up_as_its_row_finishes_keeps_nothing() -> None:
    """The caller gives up after the loop asked whether to drop the turn (as it went in, and at
    the check) and before its finished row's keys and values are kept (its episode may be
    forgotten already): nothing is kept under the episode's key; a turn not given up is kept."""
    from backends.torch.sampler import Admission

    sampler = Sampler(_model())
    kept = KVKeep(1 << 20)
    asked: dict[str, int] = {}

    def given_up(admission: Admission) -> bool:
        """The turn of episode "gone" is given up once the loop has asked twice."""
        asked[admission.key] = asked.get(admission.key, 0) + 1
        return admission.key == "gone" and asked[admission.key] > 2

    def serve(key: str) -> list[str]:
        """One turn of episode ``key``, of one token: asked as it goes in, its row finishes by
        the loop's first check, which asks again; the keys handed back."""
        handed: list[str] = []
        sampler.serve(
            lambda rows, positions: (
                [Admission(list(PROMPT.tokens), [1], key, keep=key)] if rows is None else []
            ),
            lambda back: handed.extend(admission.key for admission, _ in back),
            max_new_tokens=1,
            temperature=0.0,
            generator=torch.Generator().manual_seed(0),
            dropped=given_up,
            kept=kept,
        )
        return handed

    for key in ("gone", "kept"):
        assert serve(key) == [key]  # finished before the caller gave up: handed back
    assert kept.take("gone", [*PROMPT.tokens, 5]) is None
    assert kept.take("kept", [*PROMPT.tokens, 5]) is not None


async def test_continued_turns_prefill_in_passes_of_at_most_the_prefill_s_tokens(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Two episodes continue together under a prefill bound of 4 tokens a forward pass: a's 2 new
    tokens go in one pass, b's 8 (a long reply) in two of 4, the second attending over the keys
    the first wrote; each still gives the tokens and logprobs of a whole-context prefill."""
    from backends.torch import sampler

    monkeypatch.setattr(sampler, "_PREFILL_TOKENS", 4)
    prompts = {"a": [2, 3, 4], "b": [2, 6, 7, 8]}
    replies = {"a": [11], "b": [12, 13, 14, 15, 12, 13, 14]}
    second, contexts, shapes = await _second_turns(_engine(_model(), 1 << 20), prompts, replies)
    assert sorted(shapes) == [(1, 2), (1, 4), (1, 4)]
    await _as_whole_prefills(second, contexts, _model())


FIRSTS = {"a": [2, 3, 4, 5, 6], "b": [2, 6, 7], "c": [3, 9, 8, 7, 6, 5, 4], "d": [4, 4]}
LIMITS = {"a": 3, "b": 3, "c": 5, "d": 2}  # a and b finish at the same check; c and d at their own


def _serve_kept(
    model: Decoder, keys: list[str], kept: KVKeep, *, cached: dict[str, KeptKV | None] | None = None,
    prompts: dict[str, list[int]] | None = None, temperature: float = 0.0, seed: int = 0,
) -> dict[str, Completion]:  # fmt: skip
    """One loop of a fresh sampler on ``model`` over ``keys``'s admissions (all in its first
    admission, in order), each keeping its row's keys and values in ``kept``; with ``cached``,
    each continues from the keys and values given."""
    from backends.torch.sampler import Admission

    prompts = prompts or FIRSTS
    given = [Admission(prompts[k], [LIMITS[k]], k, (cached or {}).get(k), keep=k) for k in keys]
    out: dict[str, Completion] = {}

    def sink(back: list[tuple[Admission, list[Completion]]]) -> None:
        for admission, (completion,) in back:
            out[admission.key] = completion

    Sampler(model).serve(
        lambda rows, positions: given if rows is None else [],
        sink,
        max_new_tokens=5,
        temperature=temperature,
        generator=torch.Generator().manual_seed(seed),
        kept=kept,
    )
    return out


def test_rows_finishing_together_are_kept_in_one_pack_equal_to_each_row_kept_alone() -> None:
    """Four rows in one loop: a and b finish at the same check and are kept in one copy, into
    one pack (one storage, counted once, freed with its last entry); each entry holds the keys
    and values that the row kept alone, in a loop of its own, holds (its prompt and every
    generated token but the last)."""
    model = _model()
    together = KVKeep(1 << 24)
    out = _serve_kept(model, list(FIRSTS), together)
    entries = {k: together._entries[k][0] for k in FIRSTS}
    for key in FIRSTS:
        alone = KVKeep(1 << 24)
        single = _serve_kept(model, [key], alone)[key]
        want = alone._entries[key][0]
        assert out[key].tokens == single.tokens
        assert entries[key].tokens == want.tokens == (*FIRSTS[key], *single.tokens[:-1])
        torch.testing.assert_close(entries[key].kv, want.kv, atol=1e-5, rtol=0)
    storages = {k: e.kv.untyped_storage() for k, e in entries.items()}
    assert storages["a"].data_ptr() == storages["b"].data_ptr()
    assert len({s.data_ptr() for s in storages.values()}) == 3
    pack = storages["a"].nbytes()
    assert pack == entries["a"].kv.nbytes + entries["b"].kv.nbytes
    assert together.resident_bytes == pack + storages["c"].nbytes() + storages["d"].nbytes()
    together.forget("c")
    together.forget("a")  # b still holds the pack
    assert together.resident_bytes == pack + storages["d"].nbytes()
    together.forget("b")
    assert together.resident_bytes == storages["d"].nbytes()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_wave_of_continued_turns_gives_the_tokens_of_whole_prefills(temperature: float) -> None:
    """Four episodes' second turns admitted together, each restoring what its first turn kept
    (kept in packs at the hand-over): greedy, and sampled with a fixed seed, the tokens of the
    same wave prefilled whole (the same draws: the same rows in the same order), and their
    logprobs to float rounding."""
    model = _model()
    kept = KVKeep(1 << 24)
    first = _serve_kept(model, list(FIRSTS), kept)
    seconds = {k: [*FIRSTS[k], *first[k].tokens, 11, 12] for k in FIRSTS}
    cached = {k: kept.take(k, seconds[k]) for k in FIRSTS}
    assert all(c is not None for c in cached.values())
    kw: dict[str, Any] = {"prompts": seconds, "temperature": temperature, "seed": 3}
    continued = _serve_kept(model, list(FIRSTS), KVKeep(1 << 24), cached=cached, **kw)
    whole = _serve_kept(model, list(FIRSTS), KVKeep(1 << 24), **kw)
    for key in FIRSTS:
        assert continued[key].tokens == whole[key].tokens
        assert continued[key].logprobs == pytest.approx(whole[key].logprobs, abs=1e-5)


async def test_episodes_played_together_give_the_tokens_of_each_played_alone() -> None:
    """Eight greedy episodes of three turns at once through the engine: their turns enter in
    waves, are handed back together and each answered caller (and only it) goes on; every turn
    gives the tokens and logprobs of the same episode played alone, reusing what it kept."""

    async def episode(engine: TorchEngine, i: int, out: dict[int, list[Completion]]) -> None:
        context = [2 + i % 5, 3 + i % 7, 4]
        out[i] = []
        for turn in range(3):
            (completion,) = await engine.generate(context, 1, greedy=True, episode=f"e{i}")
            out[i].append(completion)
            context = [*context, *completion.tokens, 5 + turn, 6 + i % 4]
        engine.end_episode(f"e{i}")

    model = _model()
    together: dict[int, list[Completion]] = {}
    engine = _engine(model, 1 << 20)
    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(episode, engine, i, together)
    finally:
        engine.close()
    alone: dict[int, list[Completion]] = {}
    engine = _engine(model, 1 << 20)
    try:
        with anyio.fail_after(60):
            for i in range(8):
                await episode(engine, i, alone)
    finally:
        engine.close()
    for i in range(8):
        assert [c.tokens for c in together[i]] == [c.tokens for c in alone[i]]
        for got, want in zip(together[i], alone[i], strict=True):
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)
        assert all(c.reused_tokens for c in together[i][1:])
