"""The sampler on a GPU (graphs, decode attention, compiled parts): logprobs against full
recomputation, (prompt, n) requests, and graphs across stand-down/wake."""

from __future__ import annotations

import pytest
import torch

from backends.torch.config import ModelConfig
from backends.torch.model import Decoder, token_logprobs
from backends.torch.sampler import Sampler
from pipeline.algorithms.losses import mismatch_metrics
from pipeline.contracts.messages import Completion

pytestmark = pytest.mark.gpu

VOCAB = 1000


def _model(
    dtype: torch.dtype, *, learned_positions: bool = False, qwen3: bool = False, positions: int = 128
) -> Decoder:
    """A Qwen2-shaped model, or with `qwen3` a Qwen3-shaped one (q/k norms, no biases, head_dim
    other than hidden_size / heads)."""
    torch.manual_seed(0)
    config = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=128 if qwen3 else 64,
        attention_bias=not qwen3,
        qk_norm=qwen3,
        tie_word_embeddings=True,
        max_position_embeddings=positions,
        learned_position_embeddings=learned_positions,
    )
    model = Decoder(config)
    with torch.no_grad():  # sharper than the 0.02 init, so sampled tokens and greedy choices vary
        model.model.embed_tokens.weight.mul_(20)
        for name, param in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):  # each dim its own scale
                param.uniform_(0.5, 1.5)
    return model.to(device="cuda", dtype=dtype)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 40, (n,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (n_,), generator=g).tolist() for n_ in lengths]


def _generate(sampler: Sampler, prompts: list[list[int]], **kw) -> list[Completion]:
    """One completion for each prompt (requests of n = 1)."""
    return [c for (c,) in sampler.generate([(p, 1) for p in prompts], **kw)]


def _recomputed(model: Decoder, prompts: list[list[int]], outs: list[Completion], temperature: float):
    seqs = [p + list(o.tokens) for p, o in zip(prompts, outs, strict=True)]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs], device="cuda")
    real = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs], device="cuda")
    with torch.no_grad():
        lp = token_logprobs(model, ids, real, temperature=temperature)
    gen = torch.zeros_like(lp)
    mask = torch.zeros_like(lp)
    for i, (p, o) in enumerate(zip(prompts, outs, strict=True)):
        gen[i, len(p) - 1 : len(p) - 1 + len(o.tokens)] = torch.tensor(o.logprobs, device="cuda")
        mask[i, len(p) - 1 : len(p) - 1 + len(o.tokens)] = 1.0
    # Prompt positions carry the recomputed values, so no exp overflows there (mask * inf = nan).
    return lp, torch.where(mask.bool(), gen, lp), mask


@pytest.mark.parametrize(
    ("dtype", "temperature", "top_p", "variant"),
    [
        (torch.float32, 1.0, 1.0, {}),
        (torch.float32, 0.7, 0.9, {}),
        (torch.float32, 0.0, 1.0, {}),
        (torch.float32, 1.0, 1.0, {"learned_positions": True}),
        (torch.bfloat16, 1.0, 1.0, {}),
        (torch.bfloat16, 0.0, 1.0, {}),
        (torch.bfloat16, 1.0, 1.0, {"qwen3": True}),
    ],
)
def test_logprobs_match_full_recomputation(
    dtype: torch.dtype, temperature: float, top_p: float, variant: dict[str, bool]
) -> None:
    model = _model(dtype, **variant)
    sampler = Sampler(model)
    # 37 rows, not a bucket size (padding rows ride along); groups share their prompt's prefill.
    requests = [(p, 3) for p in _prompts(12)] + [(_prompts(1, seed=9)[0], 1)]
    groups = sampler.generate(
        requests,
        max_new_tokens=70,  # past the first stop check
        temperature=temperature,
        top_p=top_p,
        generator=torch.Generator("cuda").manual_seed(0),
    )
    assert [len(g) for g in groups] == [n for _, n in requests]
    prompts = [p for p, n in requests for _ in range(n)]
    outs = [o for group in groups for o in group]
    assert sampler.captures == 1 and sampler.steps.flash == (dtype == torch.bfloat16)
    assert all(len(o.tokens) == len(o.logprobs) == 70 for o in outs)
    lp, gen, mask = _recomputed(model, prompts, outs, temperature or 1.0)
    if dtype == torch.float32:
        torch.testing.assert_close(gen * mask, lp * mask, atol=2e-4, rtol=0)
    else:
        metrics = mismatch_metrics(lp, gen, mask)
        assert metrics["train/token_mult_prob_error"] < 1.01, metrics
        assert metrics["train/gen_kl_error"] < 1e-3, metrics


def test_greedy_equals_the_eager_sampler_and_stops() -> None:
    model = _model(torch.float32)
    prompts = _prompts(9, seed=1)
    # 80 tokens: past the loop's first checks (every 32 steps).
    kw = dict(max_new_tokens=80, temperature=0.0, generator=torch.Generator("cuda"))
    want = _generate(Sampler(model, graphs=False, compiled=False), prompts, **kw)
    got = _generate(Sampler(model), prompts, **kw)
    assert [o.tokens for o in got] == [o.tokens for o in want]
    stop = got[0].tokens[5]
    stopped = _generate(Sampler(model), prompts, stop_token_ids=(stop,), **kw)
    assert stopped[0].tokens == got[0].tokens[: got[0].tokens.index(stop) + 1]
    assert stopped[0].finish_reason == "stop"


def test_graphs_stay_valid_across_stand_down_and_wake() -> None:
    model = _model(torch.bfloat16)
    sampler = Sampler(model)
    prompts = _prompts(16, seed=2)
    kw = dict(max_new_tokens=40, temperature=0.0, generator=torch.Generator("cuda"))
    before = _generate(sampler, prompts, **kw)
    pointer = sampler.cache.keys[0].data_ptr()
    assert sampler.cache_bytes() > 0
    for _ in range(3):
        sampler.release()
        assert sampler.cache_bytes() == 0
        # Memory freed at stand-down is usable by others (the trainer) meanwhile.
        scratch = torch.full((1 << 20,), 7.0, device="cuda")
        sampler.wake()
        del scratch
    assert sampler.cache_bytes() > 0
    after = _generate(sampler, prompts, **kw)
    assert sampler.cache.pool.stable and sampler.cache.keys[0].data_ptr() == pointer
    assert sampler.captures == 1  # replayed, not captured again
    assert [o.tokens for o in after] == [o.tokens for o in before]
    # New weights (updated in place, as the trainer does) are served by the same graphs.
    with torch.no_grad():
        model.model.norm.weight.mul_(-1)  # negates every logit
    flipped = _generate(sampler, prompts, **kw)
    assert sampler.captures == 1
    assert [o.tokens for o in flipped] != [o.tokens for o in before]
    # So are new projection weights (the fused ones), after a stand-down and wake too.
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.qkv_proj.weight.mul_(3)
            layer.mlp.gate_up_proj.weight.mul_(-2)
    sampler.release()
    sampler.wake()
    changed = _generate(sampler, prompts, **kw)
    assert sampler.captures == 1
    assert [o.tokens for o in changed] == [o.tokens for o in _generate(Sampler(model), prompts, **kw)]
    assert [o.tokens for o in changed] != [o.tokens for o in flipped]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_growing_the_cache_after_captures_and_waking_in_either_dtype(dtype: torch.dtype) -> None:
    """More rows, then a longer length, than the graphs were captured for: the cache grows and
    the graphs are captured again (in a new graph pool: reusing the pool of destroyed graphs
    hit the caching allocator's `use_count > 0` assert); stand-down and wake between calls in
    float32 too (the SDPA path clears the woken cache in place). Greedy tokens equal a fresh
    sampler's for every call."""
    model = _model(dtype)
    sampler = Sampler(model)
    calls = [(_prompts(9, seed=3), 20), (_prompts(40, seed=4), 20), (_prompts(12, seed=5), 60)]
    for prompts, new in calls:
        kw = dict(max_new_tokens=new, temperature=0.0, generator=torch.Generator("cuda"))
        got = _generate(sampler, prompts, **kw)
        sampler.release()
        sampler.wake()
        again = _generate(sampler, prompts, **kw)
        want = _generate(Sampler(model), prompts, **kw)
        assert [o.tokens for o in got] == [o.tokens for o in again] == [o.tokens for o in want]
    assert sampler.captures == 3


def test_row_limits_and_a_freeze_under_graphs() -> None:
    """The bench lengths' per-row limits (a device tensor compared each step, finished rows'
    positions held) and the partial rollouts' freeze (a host flag at each step boundary) with
    captured graphs: limited rows are the unlimited ones' prefixes, a frozen call returns each
    row's first token."""
    import threading

    sampler = Sampler(_model(torch.bfloat16))
    prompts = _prompts(12)
    kw = dict(max_new_tokens=40, temperature=0.0, generator=torch.Generator("cuda"))
    free = _generate(sampler, prompts, **kw)
    limits = [1 + 3 * i for i in range(12)]
    got = _generate(sampler, prompts, limits=limits, **kw)
    assert [len(o.tokens) for o in got] == limits
    assert [o.tokens for o in got] == [f.tokens[:n] for f, n in zip(free, limits, strict=True)]
    freeze = threading.Event()
    freeze.set()
    cut = _generate(sampler, prompts, freeze=freeze, **kw)
    assert [o.tokens for o in cut] == [f.tokens[:1] for f in free]
    assert {o.finish_reason for o in cut} == {"frozen"}


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_slots_refilled_mid_loop_under_graphs(temperature: float) -> None:
    """The continuous loop with a captured graph: 20 requests of 2 rows, each row ending at
    its own limit, through 16 slots, each request admitted as 2 slots free up (prefilled into
    recycled rows between replays, its first token drawn outside the graph). Greedy, each
    row is its prompt's greedy continuation alone; sampled, its logprobs match a full
    recomputation."""
    from backends.torch.sampler import Admission

    model = _model(torch.float32)
    sampler = Sampler(model)
    prompts = _prompts(20, seed=6)
    g = torch.Generator().manual_seed(7)
    limits = [torch.randint(1, 70, (2,), generator=g).tolist() for _ in prompts]
    waiting = [Admission(p, n, i) for i, (p, n) in enumerate(zip(prompts, limits, strict=True))]
    out: dict[int, list[Completion]] = {}

    def source(free: int | None, positions: int | None) -> list[Admission]:
        given, free = [], 16 if free is None else free
        while waiting and free >= 2:
            given.append(waiting.pop(0))
            free -= 2
        return given

    def sink(back: list[tuple[Admission, list[Completion]]]) -> None:
        for admission, completions in back:
            out[admission.key] = completions

    kw = dict(max_new_tokens=70, temperature=temperature, generator=torch.Generator("cuda").manual_seed(0))
    # Refills alone (no narrowing to a tail's bucket, which captures a graph of its own: tested
    # on the CPU in tests/backends/test_torch_sampler.py): one graph serves every refill.
    sampler.serve(source, sink, narrow=False, **kw)
    assert not waiting and sampler.captures == 1
    flat = [c for i in range(len(prompts)) for c in out[i]]
    assert [len(c.tokens) for c in flat] == [n for pair in limits for n in pair]
    if temperature == 0:
        greedy = _generate(Sampler(model), prompts, **kw)
        assert [c.tokens for c in flat] == [
            greedy[i // 2].tokens[: len(c.tokens)] for i, c in enumerate(flat)
        ]
    else:
        lp, gen, mask = _recomputed(model, [p for p in prompts for _ in range(2)], flat, temperature)
        torch.testing.assert_close(gen * mask, lp * mask, atol=2e-4, rtol=0)


# torch warns, once a process, that its sync debug mode is a prototype (not that a sync happened).
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype:UserWarning")
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_admission_mid_loop_waits_for_nothing_on_the_device(temperature: float) -> None:
    """A check's admissions are prefilled `admit_lead` steps after it so that the prefill's
    launches overlap those steps' device work; a copy that waits for the stream (a host list
    copied from pageable memory waits for every step queued before it) would undo that. Under
    torch's sync debug mode set to raise, every admission after the first (a refill while rows
    decode: its slots, positions, limits, prefill and first draw) goes in without a wait, and
    comes back as its prompt's own continuation (greedy)."""
    from backends.torch.sampler import Admission

    model = _model(torch.float32)
    sampler = Sampler(model)
    prompts = _prompts(6, seed=8)
    limits = [1, 60, 40, 40, 40, 40]  # the 60-token row still decodes when the others go in
    waiting = [Admission(p, [n], i) for i, (p, n) in enumerate(zip(prompts, limits, strict=True))]
    out: dict[int, list[Completion]] = {}
    refills: list[list[int]] = []  # each refill: the requests back by then
    times = sampler.times
    begins, ends = times.prefill_begins, times.prefill_ends

    def strict_begins() -> None:  # `serve` brackets an admission with these two
        begins()
        if out:  # a refill: a row of the loop's opening admissions is back
            refills.append(sorted(out))
            torch.cuda.set_sync_debug_mode("error")

    def strict_ends() -> None:
        torch.cuda.set_sync_debug_mode(0)
        ends()

    times.prefill_begins, times.prefill_ends = strict_begins, strict_ends  # type: ignore[method-assign]

    def source(free: int | None, positions: int | None) -> list[Admission]:
        if free is None:
            return waiting[:2]
        given = waiting[2 : 2 + free]
        del waiting[2 : 2 + len(given)]
        return given

    def sink(back: list[tuple[Admission, list[Completion]]]) -> None:
        for admission, completions in back:
            out[admission.key] = completions

    kw = dict(max_new_tokens=60, temperature=temperature, generator=torch.Generator("cuda").manual_seed(0))
    for part in (prompts[:2], prompts[2:]):  # compiled for a second prefill shape (any) before
        _generate(sampler, part, max_new_tokens=2, temperature=0.0, generator=kw["generator"])
    try:
        sampler.serve(source, sink, width=2, narrow=False, **kw)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert refills == [[0]] and sorted(out) == list(range(6)), (refills, sorted(out))
    assert [len(out[i][0].tokens) for i in range(6)] == limits
    if temperature == 0:
        greedy = _generate(Sampler(model), prompts, **kw)
        assert [out[i][0].tokens for i in range(6)] == [
            g.tokens[: len(out[i][0].tokens)] for i, g in enumerate(greedy)
        ]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_narrowed_loop_widens_again_under_graphs(temperature: float) -> None:
    """A loop opened 16 wide by two rows (1 and 100 tokens) narrows to 8 slots once the short
    row is back and nothing waits (32 steps a check); ten one-row requests (40 tokens each)
    then come at its next check: it offers its 16 slots, widens back (its 16-wide graph
    replayed again, no third capture) and takes all ten. Greedy, each row is its prompt's
    greedy continuation alone; sampled, its logprobs match a full recomputation."""
    from backends.torch.sampler import Admission

    model = _model(torch.float32)
    sampler = Sampler(model)
    prompts = _prompts(12, seed=8)
    first = [Admission(prompts[0], [1], 0), Admission(prompts[1], [100], 1)]
    later = [Admission(p, [40], i + 2) for i, p in enumerate(prompts[2:])]
    offered: list[int] = []
    out: dict[int, Completion] = {}

    def source(free: int | None, positions: int | None) -> list[Admission]:
        if free is None:
            return first
        offered.append(free)
        return later if len(offered) == 2 else []

    def sink(back: list[tuple[Admission, list[Completion]]]) -> None:
        for admission, (completion,) in back:
            out[admission.key] = completion

    kw = dict(max_new_tokens=100, temperature=temperature, generator=torch.Generator("cuda").manual_seed(0))
    sampler.serve(source, sink, width=16, **kw)
    assert offered[:2] == [15, 15] and sampler.captures == 2
    flat = [out[i] for i in range(len(prompts))]
    assert [len(c.tokens) for c in flat] == [1, 100] + [40] * 10
    if temperature == 0:
        greedy = _generate(Sampler(model), prompts, **kw)
        assert [c.tokens for c in flat] == [
            g.tokens[: len(c.tokens)] for g, c in zip(greedy, flat, strict=True)
        ]
    else:
        lp, gen, mask = _recomputed(model, prompts, flat, temperature)
        torch.testing.assert_close(gen * mask, lp * mask, atol=2e-4, rtol=0)


@pytest.mark.parametrize("qwen3", [False, True])
def test_a_narrow_step_over_many_keys_attends_by_split_keys(
    monkeypatch: pytest.MonkeyPatch, qwen3: bool
) -> None:
    """Four rows over prompts of 520-900 tokens: the step attends by `paged_decode` with each
    row's keys split over programs (a spy sees its launches at the capture; none with
    `split_keys` off, flash's path), and the logprobs of both paths match a full recomputation."""
    from backends.torch import paged_decode

    model = _model(torch.bfloat16, positions=1024, qwen3=qwen3)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (700, 520, 900, 610)]
    calls: list[int] = []
    attend = paged_decode.attend
    monkeypatch.setattr(paged_decode, "attend", lambda *a, **k: calls.append(1) or attend(*a, **k))
    for split in (True, False):
        sampler = Sampler(model)
        sampler.steps.split_keys = split
        calls.clear()
        kw = dict(max_new_tokens=40, temperature=1.0, generator=torch.Generator("cuda").manual_seed(0))
        outs = _generate(sampler, prompts, **kw)
        assert paged_decode.splits(8 * 2, sampler.cache.length, torch.device("cuda")) > 1
        assert bool(calls) == split
        metrics = mismatch_metrics(*_recomputed(model, prompts, outs, 1.0))
        assert metrics["train/token_mult_prob_error"] < 1.01, (split, metrics)
        assert metrics["train/gen_kl_error"] < 1e-3, (split, metrics)
