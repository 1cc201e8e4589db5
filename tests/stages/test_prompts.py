"""Prompt sources: held-out prompts are never trained on."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

from stages.prompts import JsonlSource, PromptsSection, SyntheticSource, build_prompts


def test_jsonl_held_out_lines_never_reach_training(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n" for i in range(10)))
    prompts = build_prompts(PromptsSection(source=JsonlSource(path=str(path), num_heldout=3)), seed=0)
    assert [p.prompt_id for p in prompts.heldout] == ["line-8", "line-9", "line-10"]
    trained = {p.text for p in islice(prompts.train, 70)}
    assert trained == {f"q{i}" for i in range(7)}


def test_synthetic_held_out_strings_never_reach_training() -> None:
    section = PromptsSection(source=SyntheticSource(min_digits=2, max_digits=2, num_heldout=20))
    prompts = build_prompts(section, seed=0)
    heldout = {p.text for p in prompts.heldout}
    assert len(heldout) == 20
    assert not heldout & {p.text for p in islice(prompts.train, 2000)}
