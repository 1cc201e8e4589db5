"""Sampler behaviour: logprob agreement with training, (prompt, n) requests, padding, stops,
determinism, the compiled and flash layouts run on CPU, the engine's per-request checks."""

import math
from typing import Any

import pytest
import torch

from backends.torch.config import ModelConfig
from backends.torch.model import Decoder, token_logprobs
from backends.torch.sampler import Sampler
from pipeline.contracts.messages import Completion

VOCAB = 29
PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13], [8, 9]]


# Qwen3's layout: q/k norms, no biases, head_dim other than hidden_size / heads (16).
QWEN3 = {"qk_norm": True, "attention_bias": False, "head_dim": 24}


def _sampler(seed: int = 0, **variant: Any) -> Sampler:
    torch.manual_seed(seed)
    shape = {"attention_bias": True, "tie_word_embeddings": True} | variant
    model = Decoder(ModelConfig(vocab_size=VOCAB, hidden_size=64, **shape))
    # A sharper random model so that sampled tokens vary and greedy choices are not near-ties.
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(3)
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # not all ones: each dim its own
                param.uniform_(0.5, 1.5)
    return Sampler(model)


def _requests(
    sampler: Sampler, requests: list[tuple[list[int], int]], seed: int = 0, **kw
) -> list[list[Completion]]:
    args = dict(max_new_tokens=6, temperature=1.0, top_p=1.0, stop_token_ids=()) | kw
    return sampler.generate(requests, generator=torch.Generator().manual_seed(seed), **args)


def _generate(sampler: Sampler, prompts: list[list[int]], seed: int = 0, **kw) -> list[Completion]:
    """One completion for each prompt (requests of n = 1)."""
    return [c for (c,) in _requests(sampler, [(p, 1) for p in prompts], seed, **kw)]


def _handing_to(handed: dict[Any, Completion]) -> Any:
    """A `serve` sink keeping each admission's one completion under its key in ``handed``."""

    def sink(back: list[tuple[Any, list[Completion]]]) -> None:
        for admission, out in back:
            (handed[admission.key],) = out

    return sink


def _recomputed(
    model: Decoder, prompts: list[list[int]], outs: list[Completion], temperature: float
) -> list[list[float]]:
    seqs = [p + list(o.tokens) for p, o in zip(prompts, outs, strict=True)]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    with torch.no_grad():
        lp = token_logprobs(model, ids, mask, temperature=temperature)
    return [
        lp[i, len(p) - 1 : len(p) - 1 + len(o.tokens)].tolist()
        for i, (p, o) in enumerate(zip(prompts, outs, strict=True))
    ]


@pytest.mark.parametrize("learned_positions", [False, True], ids=["rotary", "rotary+learned"])
@pytest.mark.parametrize(("temperature", "top_p"), [(0.7, 0.9), (1.3, 1.0), (0.0, 1.0)])
def test_reported_logprobs_equal_training_recomputation(
    temperature: float, top_p: float, learned_positions: bool
) -> None:
    sampler = _sampler(learned_position_embeddings=learned_positions)
    outs = _generate(sampler, PROMPTS, temperature=temperature, top_p=top_p)
    # Greedy reports logprobs at temperature 1.
    want = _recomputed(sampler.model, PROMPTS, outs, temperature or 1.0)
    for out, expected in zip(outs, want, strict=True):
        assert len(out.tokens) == len(out.logprobs) == 6 and out.finish_reason == "length"
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(expected), atol=1e-5, rtol=0)


def test_prompt_alone_equals_prompt_in_padded_batch_greedy() -> None:
    sampler = _sampler()
    batch = _generate(sampler, PROMPTS, temperature=0.0)
    for prompt, out in zip(PROMPTS, batch, strict=True):
        alone = _generate(sampler, [prompt], temperature=0.0)[0]
        assert alone.tokens == out.tokens
        torch.testing.assert_close(
            torch.tensor(alone.logprobs), torch.tensor(out.logprobs), atol=1e-5, rtol=0
        )


def test_requests_get_n_rows_each_from_one_prefill_of_their_prompt() -> None:
    """A (prompt, n) request gets n completions in order, each continuing its own prompt (the
    rows share the prefill's keys and values): greedy, each equals the prompt alone; sampled,
    their logprobs equal a recomputation of their prompt and tokens."""
    sampler = _sampler()
    requests = [(PROMPTS[0], 3), (PROMPTS[1], 1), (PROMPTS[2], 2)]
    greedy = _requests(sampler, requests, temperature=0.0)
    assert [len(group) for group in greedy] == [3, 1, 2]
    for (prompt, _), group in zip(requests, greedy, strict=True):
        (alone,) = _generate(sampler, [prompt], temperature=0.0)
        assert [o.tokens for o in group] == [alone.tokens] * len(group)
    sampled = _requests(sampler, requests, temperature=1.0)
    prompts = [prompt for prompt, n in requests for _ in range(n)]
    flat = [o for group in sampled for o in group]
    assert len({o.tokens for o in flat[:3]}) > 1  # the rows of a request draw their own tokens
    for out, reference in zip(flat, _recomputed(sampler.model, prompts, flat, 1.0), strict=True):
        assert out.logprobs == pytest.approx(reference, abs=1e-5)


def test_stop_token_ends_sequence_and_is_included() -> None:
    sampler = _sampler()
    free = _generate(sampler, PROMPTS, temperature=0.0, max_new_tokens=8)
    stop = free[0].tokens[2]
    outs = _generate(sampler, PROMPTS, temperature=0.0, max_new_tokens=8, stop_token_ids=[stop])
    for f, o in zip(free, outs, strict=True):
        if stop in f.tokens:
            cut = f.tokens.index(stop) + 1
            assert (o.tokens, o.logprobs, o.finish_reason) == (f.tokens[:cut], f.logprobs[:cut], "stop")
        else:
            assert (o.tokens, o.finish_reason) == (f.tokens, "length")
    assert outs[0].tokens[-1] == stop and len(outs[0].tokens) <= 3


def test_all_rows_stopping_ends_the_loop_early() -> None:
    sampler = _sampler()
    outs = _generate(sampler, PROMPTS, max_new_tokens=50, stop_token_ids=range(VOCAB))
    assert all(len(o.tokens) == 1 and o.finish_reason == "stop" for o in outs)


def test_same_generator_seed_gives_identical_outputs() -> None:
    sampler = _sampler()
    first = _generate(sampler, PROMPTS * 4, seed=5, temperature=0.9, top_p=0.95)
    again = _generate(_sampler(), PROMPTS * 4, seed=5, temperature=0.9, top_p=0.95)
    other = _generate(sampler, PROMPTS * 4, seed=6, temperature=0.9, top_p=0.95)
    assert first == again
    assert first != other


def test_tiny_top_p_is_greedy() -> None:
    sampler = _sampler()
    greedy = _generate(sampler, PROMPTS, temperature=0.0)
    nucleus = _generate(sampler, PROMPTS, temperature=0.5, top_p=1e-6)
    assert [o.tokens for o in nucleus] == [o.tokens for o in greedy]


def test_reused_and_released_cache_do_not_change_results() -> None:
    sampler = _sampler()
    big = [[3] * 12] * 9
    _generate(sampler, big, max_new_tokens=10)  # leaves a larger cache full of stale values
    reused = _generate(sampler, PROMPTS, seed=1)
    longer = _generate(sampler, PROMPTS[:2], seed=1, max_new_tokens=30)  # grows length only
    assert longer == _generate(_sampler(), PROMPTS[:2], seed=1, max_new_tokens=30)
    sampler.release()
    fresh = _generate(sampler, PROMPTS, seed=1)
    assert reused == fresh == _generate(_sampler(), PROMPTS, seed=1)


def test_invalid_arguments_are_rejected() -> None:
    sampler = _sampler()
    assert _generate(sampler, []) == []
    assert _requests(sampler, [([1, 2], 0)]) == [[]]
    for kw, match in [
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
    ]:
        with pytest.raises(ValueError, match=match):
            _generate(sampler, PROMPTS, **kw)
    with pytest.raises(ValueError, match="non-empty"):
        _generate(sampler, [[1], []])


def test_learned_positions_bound_prompt_plus_new_tokens() -> None:
    sampler = _sampler(learned_position_embeddings=True)
    limit = sampler.model.config.max_position_embeddings
    prompt = [3] * (limit - 6)
    assert len(_generate(sampler, [prompt], max_new_tokens=6)[0].tokens) == 6  # exactly fits
    with pytest.raises(ValueError, match=f"exceeds model.config.max_position_embeddings {limit}"):
        _generate(sampler, [prompt], max_new_tokens=7)


@pytest.mark.parametrize(
    "variant",
    [{}, {"learned_position_embeddings": True}, QWEN3],
    ids=["rotary", "rotary+learned", "qwen3"],
)
def test_compiled_decode_and_prefill_equal_the_eager_ones(variant: dict) -> None:
    """The sampler's torch.compile'd step and prefill (as on a GPU; bucketed rows) decode
    greedily as its eager ones do, and its sampled tokens' logprobs equal a full
    recomputation, drawn in the step and from its logits (top-p)."""
    eager = _sampler(**variant)
    compiled = Sampler(eager.model, compiled=True)
    expected = _generate(eager, PROMPTS, temperature=0.0)
    got = _generate(compiled, PROMPTS, temperature=0.0)
    assert [o.tokens for o in got] == [o.tokens for o in expected]
    for mine, theirs in zip(got, expected, strict=True):
        assert mine.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9)):
        sampled = _generate(compiled, PROMPTS, temperature=temperature, top_p=top_p)
        recomputed = _recomputed(eager.model, PROMPTS, sampled, temperature)
        for out, reference in zip(sampled, recomputed, strict=True):
            assert out.logprobs == pytest.approx(reference, abs=1e-5)


def _flash_written_out(q, k, v, cu_q, cu_k, max_q, max_k, used):
    """`decode_step._flash_varlen` written out: sequence i's queries over its first used[i]
    keys from cu_k[i], one head, not causal."""
    out = []
    for i in range(cu_q.numel() - 1):
        keys = slice(int(cu_k[i]), int(cu_k[i]) + int(used[i]))
        qi, ki, vi = (
            q[cu_q[i] : cu_q[i + 1]].transpose(0, 1),
            k[keys].transpose(0, 1),
            v[keys].transpose(0, 1),
        )
        assert qi.shape[1] <= max_q and ki.shape[1] <= max_k
        out.append(torch.nn.functional.scaled_dot_product_attention(qi, ki, vi).transpose(0, 1))
    return torch.cat(out)


@pytest.mark.parametrize("variant", [{}, QWEN3], ids=["rotary", "qwen3"])
def test_flash_layout_of_the_decode_step_matches_the_masked_one(variant: dict, monkeypatch) -> None:
    """The GPU's decode layout (each (row, KV head) a sequence of its g query heads over that
    head's keys in the cache, `seqused_k` keys of each) gives the masked path's tokens and
    logprobs; here flash's kernel is written out."""
    from backends.torch import decode_step

    eager = _sampler(num_attention_heads=8, num_key_value_heads=2, **variant)
    flash = Sampler(eager.model)
    flash.steps.flash = True
    monkeypatch.setattr(decode_step, "_flash_varlen", _flash_written_out)
    requests = [(PROMPTS[0], 2), (PROMPTS[1], 3)]
    for temperature in (0.0, 1.0):
        got = _requests(flash, requests, temperature=temperature)
        want = _requests(eager, requests, temperature=temperature)
        for mine, theirs in zip(got, want, strict=True):
            assert [o.tokens for o in mine] == [o.tokens for o in theirs]
            for a, b in zip(mine, theirs, strict=True):
                assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)


async def test_engine_rejects_a_request_the_model_cannot_serve_without_failing_its_batch() -> None:
    import anyio

    from backends.torch.engine import TorchEngine
    from pipeline.contracts.errors import RequestRejected

    sampler = _sampler(learned_position_embeddings=True)
    limit = sampler.model.config.max_position_embeddings
    engine = TorchEngine(
        sampler,
        shared=True,
        source=sampler.model,
        max_new_tokens=6,
        temperature=1.0,
        top_p=1.0,
        stop_token_ids=(),
        seed=0,
    )
    results: dict[str, Any] = {}

    async def ask(name: str, prompt: list[int]) -> None:
        try:
            results[name] = await engine.generate(prompt, 2)
        except RequestRejected as error:
            results[name] = error

    try:
        async with anyio.create_task_group() as tg:  # gathered into one batch
            tg.start_soon(ask, "fits", [3] * (limit - 6))
            tg.start_soon(ask, "too long", [3] * (limit - 5))
    finally:
        engine.close()
    assert [len(c.tokens) for c in results["fits"]] == [6, 6]
    assert isinstance(results["too long"], RequestRejected)
    assert f"max_position_embeddings {limit}" in str(results["too long"])


def test_compiled_sampler_serves_every_batch_bucket_and_new_weights() -> None:
    """Compiled decode parts: no graph breaks, any number of batch-size buckets (dynamo's
    recompile limit is 8), and weights changed in place between calls (as the trainer changes
    them) are served, also after a stand-down and wake."""
    from torch._dynamo.utils import counters

    plain = _sampler(seed=1)
    cuda = Sampler(plain.model, compiled=True)
    for batch in (1, 9, 17, 33, 65, 129, 257, 513, 1025, 2049, 3000):
        outs = _generate(cuda, [[1, 2, 3]] * batch, max_new_tokens=2, temperature=0.0)
        assert len(outs) == batch
    assert not counters["graph_break"]
    with torch.no_grad():
        for layer in plain.model.model.layers:
            layer.self_attn.qkv_proj.weight[-12:].mul_(3)  # rows of v_proj's
            layer.self_attn.qkv_proj.bias.add_(0.5)
            layer.mlp.gate_up_proj.weight.mul_(-2)
    cuda.release()
    cuda.wake()
    got = _generate(cuda, PROMPTS, temperature=0.0)
    want = _generate(plain, PROMPTS, temperature=0.0)
    assert [o.tokens for o in got] == [o.tokens for o in want]
    for mine, theirs in zip(got, want, strict=True):
        assert mine.logprobs == pytest.approx(theirs.logprobs, abs=1e-5)


@pytest.mark.parametrize("stable", [False, True], ids=["new-addresses", "same-addresses"])
def test_sampler_ignores_what_fresh_cache_memory_holds(stable: bool) -> None:
    """Uninitialised pool memory may hold NaN bit patterns; keys and values the SDPA path masks
    (positions not yet written) must not turn them into NaN logprobs. With a pool that keeps its
    addresses across a stand-down (as the GPU's virtual-memory pool does) the wake clears the
    same views the first call made: they must be ordinary tensors, not inference tensors."""
    from backends.torch.kv_pool import PlainPool

    class NaNPool(PlainPool):
        def release(self) -> None:
            if not stable:
                super().release()

        def restore(self) -> torch.Tensor:
            return super().restore().fill_(0xFF)  # every float is NaN

    pool = NaNPool(torch.device("cpu"))
    pool.stable = stable
    plain = _sampler()
    cuda = Sampler(plain.model, pool=pool)
    want = _generate(plain, PROMPTS, temperature=0.0)
    for _ in range(2):  # fresh memory, then memory restored after a stand-down
        got = _generate(cuda, PROMPTS, temperature=0.0)
        assert [o.tokens for o in got] == [o.tokens for o in want]
        assert all(math.isfinite(lp) for o in got for lp in o.logprobs)
        cuda.release()
        cuda.wake()


def _samplers() -> list[Any]:
    """The eager sampler, and a compiled one (as on a GPU: rows padded to a bucket, whose
    padding rows take no limit), over the same model."""
    plain = _sampler(learned_position_embeddings=True)
    return [plain, Sampler(plain.model, compiled=True)]


@pytest.mark.parametrize("which", [0, 1], ids=["eager", "compiled"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_row_limits_end_each_row_at_its_own_length_and_change_no_other_token(
    which: int, temperature: float
) -> None:
    """`limits` (the bench lengths; a continued row's remaining length) end each row where it
    says, with the same tokens and logprobs as an unlimited call up to there; a finished row's
    position stays put, so a long prompt with a short limit fits a learned position table."""
    sampler = _samplers()[which]
    prompts = [*PROMPTS, PROMPTS[0]]
    limits = [2, 6, 1, 4, 3]
    free = _generate(sampler, prompts, temperature=temperature)
    got = _generate(sampler, prompts, temperature=temperature, limits=limits)
    assert [len(o.tokens) for o in got] == limits
    assert {o.finish_reason for o in got} == {"length"}
    for mine, theirs in zip(got, free, strict=True):
        assert mine.tokens == theirs.tokens[: len(mine.tokens)]
        assert mine.logprobs == pytest.approx(theirs.logprobs[: len(mine.tokens)], abs=1e-5)
    table = sampler.model.config.max_position_embeddings
    long, short = [5] * (table - 2), PROMPTS[0]
    both = _generate(sampler, [long, short], temperature=0.0, limits=[2, 6])
    alone = [
        _generate(sampler, [p], temperature=0.0, max_new_tokens=n)[0] for p, n in ((long, 2), (short, 6))
    ]
    assert [o.tokens for o in both] == [o.tokens for o in alone]
    with pytest.raises(ValueError, match=f"a prompt of {table - 2} tokens \\+ max_new_tokens 3 exceeds"):
        _generate(sampler, [long], limits=[3])


@pytest.mark.parametrize("which", [0, 1], ids=["eager", "compiled"])
def test_a_freeze_returns_the_unfinished_rows_with_their_tokens_so_far(which: int) -> None:
    """Partial rollouts: with the freeze flag up the call returns at its next step boundary,
    rows that had not finished marked "frozen" with the tokens drawn so far, a row that had
    already stopped as it was."""
    import threading

    sampler = _samplers()[which]
    free = _generate(sampler, PROMPTS, temperature=0.0)
    stop = free[1].tokens[0]  # row 1 stops at its first token; so may others that draw it
    freeze = threading.Event()
    freeze.set()
    got = _generate(sampler, PROMPTS, temperature=0.0, stop_token_ids=(stop,), freeze=freeze)
    assert [o.tokens for o in got] == [o.tokens[:1] for o in free]
    assert [o.logprobs[0] for o in got] == pytest.approx([o.logprobs[0] for o in free], abs=1e-5)
    assert [o.finish_reason for o in got] == ["stop" if o.tokens[0] == stop else "frozen" for o in free]


@pytest.mark.parametrize("which", [0, 1], ids=["eager", "compiled"])
def test_a_finished_row_frees_its_slot_for_a_waiting_request_before_the_longest_row_ends(which: int) -> None:
    """The continuous loop: A (2 tokens) and B (9) open a loop; the source gives C once A is
    back, and D once C is back: each takes the lowest free slot, A's, and both finish before
    B does, in one loop of 9 steps. Greedy, every request's tokens and logprobs equal its own
    call alone: C's prefill (a longer prompt) and D's (shorter, over C's stale keys) and their
    positions are their own, and B is undisturbed."""
    from backends.torch.sampler import Admission

    sampler = _samplers()[which]
    a, b = Admission(PROMPTS[1], [2], "A"), Admission(PROMPTS[2], [9], "B")
    c, d = Admission(PROMPTS[0], [3], "C"), Admission(PROMPTS[3], [2], "D")
    after = {"A": c, "C": d}  # who waits for whom to be back
    free_when_given: list[int | None] = []
    handed: dict[str, Completion] = {}

    def source(rows: int | None, positions: int | None) -> list[Admission]:
        if rows is None:
            return [a, b]
        assert positions is not None and positions >= len(c.prompt) + 3
        ready = [after.pop(key) for key in list(after) if key in handed]
        free_when_given.extend(rows for _ in ready)
        return ready

    sink = _handing_to(handed)

    sampler.serve(source, sink, max_new_tokens=9, temperature=0.0, generator=torch.Generator().manual_seed(0))
    width = 8 if which else 2  # compiled: the rows padded to the first bucket
    assert list(handed) == ["A", "C", "D", "B"]
    assert free_when_given == [width - 1] * 2  # B's slot taken, A's then C's free
    assert sampler.slot_steps == width * 9
    for admission in (a, b, c, d):
        ((alone,),) = _requests(
            sampler, [(admission.prompt, 1)], temperature=0.0, max_new_tokens=admission.limits[0]
        )
        got = handed[admission.key]
        assert got.tokens == alone.tokens and len(got.tokens) == admission.limits[0], admission.key
        assert got.logprobs == pytest.approx(alone.logprobs, abs=1e-5), admission.key


def test_a_freeze_hands_back_every_live_row_including_those_admitted_mid_loop() -> None:
    """Partial rollouts in the continuous loop: A (2 tokens) ends, C takes its slot and the
    freeze goes up with it; at the next step boundary the loop hands back B and C with their
    tokens so far ("frozen"; the prefixes of their calls alone) and asks the source no more."""
    import threading

    from backends.torch.sampler import Admission

    sampler = _samplers()[0]
    freeze = threading.Event()
    a, b, c = (
        Admission(PROMPTS[1], [2], "A"),
        Admission(PROMPTS[2], [9], "B"),
        Admission(PROMPTS[0], [3], "C"),
    )
    asked: list[int | None] = []
    handed: dict[str, Completion] = {}

    def source(rows: int | None, positions: int | None) -> list[Admission]:
        asked.append(rows)
        if rows is None:
            return [a, b]
        if "A" in handed and not freeze.is_set():
            freeze.set()
            return [c]
        return []

    sink = _handing_to(handed)

    sampler.serve(
        source,
        sink,
        max_new_tokens=9,
        temperature=0.0,
        freeze=freeze,
        generator=torch.Generator().manual_seed(0),
    )
    assert asked == [None, 1]  # at step 1 nothing had finished; at step 2 A had
    assert {key: (len(o.tokens), o.finish_reason) for key, o in handed.items()} == {
        "A": (2, "length"),
        "B": (3, "frozen"),
        "C": (1, "frozen"),
    }
    for admission in (b, c):
        ((alone,),) = _requests(sampler, [(admission.prompt, 1)], temperature=0.0, max_new_tokens=9)
        got = handed[admission.key]
        assert got.tokens == alone.tokens[: len(got.tokens)]
        assert got.logprobs == pytest.approx(alone.logprobs[: len(got.tokens)], abs=1e-5)


def _led(
    source_after: dict[str, Any],
    freeze: Any = None,
    limits: tuple[int, int] = (2, 9),
    given_up: frozenset[str] = frozenset(),
) -> tuple[Sampler, dict[str, Completion], list[tuple[str, int]]]:
    """A loop of A (``limits[0]`` tokens) and B (``limits[1]``; none with 0) checked every 4
    steps with an `admit_lead` of 2; the source gives ``source_after[key]`` once ``key`` is back
    (and raises ``freeze`` with it); ``dropped`` says the keys in ``given_up`` are; returns the
    sampler, what came back, and (admission, decode steps launched before its prefill) for each
    prefill."""
    from backends.torch.sampler import Admission

    sampler = Sampler(_samplers()[0].model, check_every=4, admit_lead=2)
    opening = [Admission(PROMPTS[1], [limits[0]], "A")] + (
        [Admission(PROMPTS[2], [limits[1]], "B")] if limits[1] else []
    )
    handed: dict[str, Completion] = {}
    prefills: list[tuple[str, int]] = []
    runs = [0]
    run, first_tokens = sampler.steps.run, sampler._first_tokens

    def counted_run(*args: Any) -> None:
        runs[0] += 1
        run(*args)

    def noted_first_tokens(admissions: list[Admission], *args: Any) -> Any:
        prefills.extend((a.key, runs[0]) for a in admissions)
        return first_tokens(admissions, *args)

    sampler.steps.run = counted_run  # type: ignore[method-assign]
    sampler._first_tokens = noted_first_tokens  # type: ignore[method-assign]

    def source(rows: int | None, positions: int | None) -> list[Admission]:
        if rows is None:
            return opening
        ready = [source_after.pop(key) for key in list(source_after) if key in handed]
        if ready and freeze is not None:
            freeze.set()
        return ready

    sink = _handing_to(handed)

    generator = torch.Generator().manual_seed(0)
    sampler.serve(
        source,
        sink,
        max_new_tokens=9,
        temperature=0.0,
        freeze=freeze,
        generator=generator,
        dropped=lambda admission: admission.key in given_up,
    )
    return sampler, handed, prefills


def test_a_checks_admissions_are_prefilled_admit_lead_steps_after_it_while_rows_decode() -> None:
    """A ends at step 2; the check at step 4 takes C, whose prefill goes in 2 steps later (6
    steps launched), so its kernel launches overlap B's steps on a device; greedy, C and B get
    the tokens and logprobs of their calls alone."""
    from backends.torch.sampler import Admission

    c = Admission(PROMPTS[0], [3], "C")
    sampler, handed, prefills = _led({"A": c})
    assert prefills == [("A", 0), ("B", 0), ("C", 6)]
    assert list(handed) == ["A", "B", "C"]
    for key, prompt, limit in (("B", PROMPTS[2], 9), ("C", c.prompt, 3)):
        ((alone,),) = _requests(sampler, [(prompt, 1)], temperature=0.0, max_new_tokens=limit)
        assert handed[key].tokens == alone.tokens, key
        assert handed[key].logprobs == pytest.approx(alone.logprobs, abs=1e-5), key


def test_a_loop_with_no_live_row_prefills_a_checks_admissions_at_once() -> None:
    """A alone ends at step 2, its last, where a check takes C: no step is left to overlap
    C's prefill with, so it goes in at once (2 steps launched, not 4)."""
    from backends.torch.sampler import Admission

    _, handed, prefills = _led({"A": Admission(PROMPTS[0], [3], "C")}, limits=(2, 0))
    assert prefills == [("A", 0), ("C", 2)]
    assert [(key, len(o.tokens)) for key, o in handed.items()] == [("A", 2), ("C", 3)]


def test_admissions_waiting_for_their_lead_survive_a_check_that_empties_the_loop() -> None:
    """C, taken at step 4, waits for step 6; B's last step, 5, is checked first: B comes back,
    the source is not asked again while C holds its slot, and C goes in at once (the loop is
    empty), none lost."""
    from backends.torch.sampler import Admission

    _, handed, prefills = _led({"A": Admission(PROMPTS[0], [3], "C")}, limits=(2, 5))
    assert prefills == [("A", 0), ("B", 0), ("C", 5)]
    assert [(key, len(o.tokens)) for key, o in handed.items()] == [("A", 2), ("B", 5), ("C", 3)]


def test_an_admission_given_up_while_it_waits_for_its_lead_is_never_prefilled() -> None:
    """C, taken at step 4, is given up by its caller before step 6: it is not prefilled and
    never comes back; B is undisturbed."""
    from backends.torch.sampler import Admission

    _, handed, prefills = _led({"A": Admission(PROMPTS[0], [3], "C")}, given_up=frozenset({"C"}))
    assert prefills == [("A", 0), ("B", 0)]
    assert [(key, len(o.tokens)) for key, o in handed.items()] == [("A", 2), ("B", 9)]


def test_a_freeze_while_admissions_wait_for_their_lead_prefills_them_and_hands_them_back() -> None:
    """The freeze goes up with C at the check of step 4: C is prefilled at the next step
    boundary instead of 2 steps later, and comes back frozen with its first token beside B;
    nothing the source gave is lost."""
    import threading

    from backends.torch.sampler import Admission

    freeze = threading.Event()
    _, handed, prefills = _led({"A": Admission(PROMPTS[0], [3], "C")}, freeze=freeze)
    assert prefills == [("A", 0), ("B", 0), ("C", 5)]
    assert {key: (len(o.tokens), o.finish_reason) for key, o in handed.items()} == {
        "A": (2, "length"),
        "B": (6, "frozen"),
        "C": (1, "frozen"),
    }


def test_each_check_times_the_hosts_wait_for_the_device() -> None:
    """`timing/loop_wait_s`: each check's read of its rows' state, where the host waits for the
    device's queued steps, is timed as the host's wait: a loop of 9 steps checked every 4 (and
    at its last) waits 3 times."""
    from contextlib import contextmanager

    from backends.torch.sampler import Admission

    sampler = Sampler(_samplers()[0].model, check_every=4, admit_lead=0)
    waits = []
    waiting = sampler.times.waiting

    @contextmanager
    def counted():  # type: ignore[no-untyped-def]
        waits.append(sampler.times.decode_steps)
        with waiting():
            yield

    sampler.times.waiting = counted  # type: ignore[method-assign]
    sampler.serve(
        lambda rows, positions: [Admission(PROMPTS[2], [9], "B")] if rows is None else [],
        lambda back: None,
        max_new_tokens=9,
        temperature=0.0,
        generator=torch.Generator().manual_seed(0),
    )
    assert waits == [4, 8, 9]  # the decode steps counted by each check, before its wait
    assert sampler.times.wait_s > 0


def test_a_dropped_admission_frees_its_slots_at_the_next_check_and_is_never_handed_back() -> None:
    """A caller that gives up: B is dropped after the loop's third draw; its slot goes to C
    at that check, B never reaches the sink, and A and C decode as their prompts alone."""
    from backends.torch.sampler import Admission

    sampler = _samplers()[0]
    a, b, c = (
        Admission(PROMPTS[1], [6], "A"),
        Admission(PROMPTS[2], [6], "B"),
        Admission(PROMPTS[0], [3], "C"),
    )
    gone: set[str] = set()
    draws = 0

    def count_draws(*_: Any) -> None:
        nonlocal draws
        draws += 1
        if draws == 3:
            gone.add("B")

    hook = sampler.model.lm_head.register_forward_hook(count_draws)
    handed: dict[str, Completion] = {}
    waiting = [c]

    def source(rows: int | None, positions: int | None) -> list[Admission]:
        return [a, b] if rows is None else [waiting.pop()] if waiting else []

    sink = _handing_to(handed)

    sampler.serve(
        source,
        sink,
        max_new_tokens=6,
        temperature=0.0,
        generator=torch.Generator().manual_seed(0),
        dropped=lambda admission: admission.key in gone,
    )
    hook.remove()
    assert sorted(handed) == ["A", "C"]
    assert sampler.slot_steps == 2 * 6  # C within A's 6 steps, in B's slot
    for admission in (a, c):
        ((alone,),) = _requests(
            sampler, [(admission.prompt, 1)], temperature=0.0, max_new_tokens=admission.limits[0]
        )
        assert handed[admission.key].tokens == alone.tokens


def test_a_narrowed_loop_widens_for_requests_that_come_later() -> None:
    """A bucketed loop opened `width` 16 by two rows (1 and 9 tokens) narrows to 8 slots once
    the short row ends and nothing waits; ten one-row requests (2 tokens each: the next batch)
    then arrive at once. The loop still offers its 16 slots, widens back to them, and takes
    all ten at that check (one hand-back), instead of seven through its narrow width and the
    rest after them. Greedy: the same tokens as each row alone."""
    from backends.torch.sampler import Admission

    sampler = _samplers()[1]
    first = [Admission(PROMPTS[0], [1], "short"), Admission(PROMPTS[1], [9], "long")]
    later = [Admission(PROMPTS[i % len(PROMPTS)], [2], i) for i in range(10)]
    offered: list[int] = []
    handed: dict[Any, Completion] = {}
    backs: list[list[Any]] = []

    def source(rows: int | None, positions: int | None) -> list[Admission]:
        if rows is None:
            return first
        offered.append(rows)
        if len(offered) == 3:  # narrowed at the first check, the crowd arrives at the third
            given = later[:]
            while sum(len(a.limits) for a in given) > rows:
                given.pop()
            return given
        return []

    def sink(back: list[tuple[Admission, list[Completion]]]) -> None:
        backs.append([admission.key for admission, _ in back])
        for admission, out in back:
            (handed[admission.key],) = out

    sampler.serve(
        source, sink, max_new_tokens=9, temperature=0.0, generator=torch.Generator().manual_seed(0), width=16
    )
    assert offered[:3] == [15, 15, 15]  # the 16 slots, less the long row's, even when 8 wide
    assert list(range(10)) in backs  # the ten admitted together come back together
    # 16 wide for the first step, 8 for two, 16 for the two steps of the ten, then 8 wide.
    assert sampler.slot_steps == 16 + 8 * 2 + 16 * 2 + 8 * 4
    for admission in [*first, *later]:
        ((alone,),) = _requests(
            sampler, [(admission.prompt, 1)], temperature=0.0, max_new_tokens=admission.limits[0]
        )
        assert handed[admission.key].tokens == alone.tokens, admission.key


def test_a_narrowed_loop_widens_at_the_check_where_its_last_row_ends() -> None:
    """The tail's last row ends at the very check where more rows come than the narrow width
    holds: the loop widens with no live row to move (an empty move, not a failure) and serves
    the newcomers as alone. A loop opened 16 wide by rows of 1 and 3 tokens narrows to 8 at
    the first check; at the third the long row ends and ten one-row requests arrive."""
    from backends.torch.sampler import Admission

    sampler = _samplers()[1]
    first = [Admission(PROMPTS[0], [1], "short"), Admission(PROMPTS[1], [3], "long")]
    later = [Admission(PROMPTS[i % len(PROMPTS)], [2], i) for i in range(10)]
    offered: list[int] = []
    handed: dict[Any, Completion] = {}

    def source(rows: int | None, positions: int | None) -> list[Admission]:
        if rows is None:
            return first
        offered.append(rows)
        return later if len(offered) == 3 else []

    sink = _handing_to(handed)

    sampler.serve(
        source, sink, max_new_tokens=3, temperature=0.0, generator=torch.Generator().manual_seed(0), width=16
    )
    assert offered[:3] == [15, 15, 16]  # 8 wide at the third check, with no row live
    # 16 wide for the first step, 8 for two, 16 for the ten's two steps.
    assert sampler.slot_steps == 16 + 8 * 2 + 16 * 2
    for admission in [*first, *later]:
        ((alone,),) = _requests(
            sampler, [(admission.prompt, 1)], temperature=0.0, max_new_tokens=admission.limits[0]
        )
        assert handed[admission.key].tokens == alone.tokens, admission.key


def test_a_long_tail_s_last_rows_decode_in_a_narrower_step() -> None:
    """A bucketed loop of 12 rows (16 slots): ten end after 1-2 tokens, two run to 9. Once
    nothing waits and the live rows fit half the slots, the loop moves them (keys and values,
    tokens so far, positions) to the lowest slots and goes on 8 wide: the same tokens and
    logprobs as each row alone (greedy), in fewer slot-steps than the full width's 16 x 9."""
    from backends.torch.sampler import Admission

    sampler = _samplers()[1]
    limits = [1, 2, 9, 1, 2, 1, 2, 1, 2, 9, 1, 2]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(limits))]
    handed: dict[int, Completion] = {}

    def source(rows: int | None, positions: int | None) -> list[Admission]:
        if rows is None:
            return [Admission(p, [n], i) for i, (p, n) in enumerate(zip(prompts, limits, strict=True))]
        return []

    sink = _handing_to(handed)

    sampler.serve(source, sink, max_new_tokens=9, temperature=0.0, generator=torch.Generator().manual_seed(0))
    # Checked after each step: seven rows live after step 1 (five ended at their first
    # token), so steps 2-9 run 8 wide.
    assert sampler.slot_steps == 16 * 1 + 8 * 8
    for i, (prompt, n) in enumerate(zip(prompts, limits, strict=True)):
        ((alone,),) = _requests(sampler, [(prompt, 1)], temperature=0.0, max_new_tokens=n)
        assert handed[i].tokens == alone.tokens and len(alone.tokens) == n, i
        assert handed[i].logprobs == pytest.approx(alone.logprobs, abs=1e-5), i


def test_a_loop_s_time_is_split_into_its_checks_its_prefills_and_its_decode_steps(monkeypatch) -> None:
    """`Sampler.times`: A (2 tokens) and B (9) open a loop, C enters when A is back. The loop
    counts its 9 steps; the host's work at its checks (a source that sleeps 20 ms each time it
    is asked) and the prefills (each held 30 ms longer: two of them, the opening one and C's) are
    counted apart, and each within the loop's own time, which a second loop adds to."""
    import time

    from backends.torch.sampler import Admission

    sampler = _sampler()
    a, b, c = (
        Admission(PROMPTS[1], [2], "A"),
        Admission(PROMPTS[2], [9], "B"),
        Admission(PROMPTS[0], [3], "C"),
    )
    handed: list[str] = []
    asked = []
    prefill = sampler._prefill_admissions

    def slow_prefill(*args: Any) -> Any:
        time.sleep(0.03)
        return prefill(*args)

    monkeypatch.setattr(sampler, "_prefill_admissions", slow_prefill)

    def source(rows: int | None, positions: int | None) -> list[Admission]:
        if rows is None:
            return [a, b]
        asked.append(rows)
        time.sleep(0.02)
        return [c] if handed == ["A"] and c.key not in handed else []

    def sink(back: list[tuple[Admission, list[Completion]]]) -> None:
        handed.extend(admission.key for admission, _ in back)

    began = time.perf_counter()
    sampler.serve(source, sink, max_new_tokens=9, temperature=0.0, generator=torch.Generator().manual_seed(0))
    wall = time.perf_counter() - began
    times = sampler.times
    assert handed == ["A", "C", "B"]
    assert times.decode_steps == 9
    assert len(asked) >= 5  # at the checks with a free slot
    assert times.check_s >= len(asked) * 0.02
    assert times.prefill_s >= 2 * 0.03
    assert times.check_s + times.prefill_s <= times.serve_s <= wall
    first = times.serve_s
    _generate(sampler, [PROMPTS[0]], max_new_tokens=4)
    assert times.decode_steps == 9 + 4
    assert times.serve_s > first
