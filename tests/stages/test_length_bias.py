"""No length bias: every group that generation finishes is trained once, whole, with the lengths
it was generated with, whatever those lengths, also with long-tailed lengths, partial rollouts
across stand-downs (L = 1) and micro-batches under a token budget."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import anyio
import pytest

import pipeline
from backends.torch.engine import TorchEngine
from backends.torch.trainer import TorchTrainer


def test_every_finished_group_is_trained_once_with_its_generated_lengths(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real torch engine and trainer on the CPU quickstart's model: lengths drawn long-
    tailed (1-5 tokens), L = 1 with partial rollouts and a loop of one batch's rows, and
    micro-batches under a token budget that splits groups. The lengths each trained group
    carries are those its generate call returned, each finished group is trained at most once,
    the only ones not trained are those admitted past the last step (at most L batches), and
    the micro-batches compute every sample of the trained groups once."""
    generated: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    trained: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    computed: Counter[tuple[tuple[int, ...], int]] = Counter()  # (prompt, length) per micro-batch sample
    generate, train_step, micro_batches = (
        TorchEngine.generate,
        TorchTrainer._train_step,
        TorchTrainer.micro_batches,
    )

    async def recording_generate(self: TorchEngine, prompt: Any, n: int, **kw: Any) -> Any:
        out = await generate(self, prompt, n, **kw)
        if not kw.get("greedy"):
            generated.append((tuple(prompt), tuple(len(c.tokens) for c in out)))
        return out

    def recording_train_step(self: TorchTrainer, groups: list[Any]) -> Any:
        trained.extend((g.prompt_tokens, tuple(len(s.tokens) for s in g.samples)) for g in groups)
        return train_step(self, groups)

    def recording_micro_batches(self: TorchTrainer, groups: list[Any]) -> Any:
        chunks = micro_batches(self, groups)
        for chunk in chunks:
            inputs = chunk.inputs
            computed.update(
                (tuple(inputs.prompts[o]), len(r))
                for o, r in zip(inputs.owner, inputs.responses, strict=True)
            )
        return chunks

    monkeypatch.setattr(TorchEngine, "generate", recording_generate)
    monkeypatch.setattr(TorchTrainer, "micro_batches", recording_micro_batches)
    monkeypatch.setattr(TorchTrainer, "_train_step", recording_train_step)
    recipe = pipeline.load_recipe(
        "recipes/quickstart.yaml",
        [
            f"run.dir={tmp_path / 'run'}",
            "run.steps=4",
            "run.progress=false",
            "run.plot=false",
            "eval.every_steps=0",
            "prompts.prompts_per_step=8",
            "rollout.partial=true",
            "rollout.max_rows=64",
            "rollout.bench_lengths={median_tokens: 2, sigma: 1.0}",
            "train.micro_batch_tokens=20",
        ],
    )
    anyio.run(pipeline.run, recipe)
    assert len(trained) == 4 * 8
    assert len({length for _, lengths in trained for length in lengths}) >= 4  # long-tailed
    left = Counter(generated)
    left.subtract(Counter(trained))
    assert all(count >= 0 for count in left.values()), "a trained group was not generated so"
    assert sum(left.values()) <= 8, "more untrained groups than the one batch past the last step"
    # What the micro-batches computed: every sample of the trained groups, once each.
    assert computed == Counter((prompt, n) for prompt, lengths in trained for n in lengths)
