"""Prompt sources: held-out prompts are never trained on."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import pytest

from pipeline.contracts.errors import RecipeError
from stages.hf_tokenizer import HFTokenizer
from stages.prompts import JsonlSource, ParquetSource, PromptsSection, SyntheticSource, build_prompts


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


def test_guess_prompts_hide_their_number_and_held_out_ones_cover_every_number() -> None:
    """Every guess prompt is the same `?`: only the environment, through its replies, can tell
    the hidden number (the answer); held-out prompt i hides i mod 10."""
    prompts = build_prompts(PromptsSection(source=SyntheticSource(task="guess", num_heldout=20)), seed=0)
    trained = list(islice(prompts.train, 1000))
    assert {p.tokens for p in [*trained, *prompts.heldout]} == {tuple(prompts.tokenizer.encode("?"))}
    assert [p.answer for p in prompts.heldout] == [str(i % 10) for i in range(20)]
    assert {p.answer for p in trained} == {str(i) for i in range(10)}
    again = build_prompts(PromptsSection(source=SyntheticSource(task="guess")), seed=0)
    assert [p.answer for p in islice(again.train, 1000)] == [p.answer for p in trained]  # the seed's


def _write_jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    return path


def _jsonl(path: Path, **fields: object) -> PromptsSection:
    return PromptsSection(source=JsonlSource(path=str(path), **fields))  # type: ignore[arg-type]


def test_jsonl_line_that_is_not_json_is_named_by_number(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "data.jsonl", [{"prompt": "1+1", "answer": "2"}, "", "{prompt: 1+2}"])
    with pytest.raises(RecipeError) as raised:
        build_prompts(_jsonl(path), seed=0)
    assert str(raised.value) == f"{path}:3: not valid JSON: Expecting property name enclosed in double quotes"


def test_jsonl_missing_answer_field_is_named(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "data.jsonl", [{"question": "1+1", "answer": "2"}, {"question": "1+2"}])
    with pytest.raises(RecipeError) as raised:
        build_prompts(_jsonl(path, prompt_field="question"), seed=0)
    assert str(raised.value) == f"{path}:2: missing field 'answer'"


def test_parquet_reads_configured_fields_like_jsonl(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    questions, answers = [f"q{i}" for i in range(6)], [str(i) for i in range(6)]
    pq.write_table(
        pa.table({"question": questions, "solution": answers, "extra": [1] * 6}), tmp_path / "d.pq"
    )
    source = ParquetSource(path=str(tmp_path / "d.pq"), prompt_field="question", answer_field="solution")
    prompts = build_prompts(PromptsSection(source=source), seed=0)
    jsonl = _write_jsonl(
        tmp_path / "d.jsonl",
        [{"question": q, "solution": a} for q, a in zip(questions, answers, strict=True)],
    )
    same = build_prompts(_jsonl(jsonl, prompt_field="question", answer_field="solution"), seed=0)
    got = [(p.text, p.tokens, p.answer) for p in islice(prompts.train, 12)]
    assert got == [(p.text, p.tokens, p.answer) for p in islice(same.train, 12)]
    assert sorted(text for text, _, _ in got[:6]) == questions


def test_parquet_missing_column_is_named(tmp_path: Path) -> None:
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"prompt": ["q"], "solution": ["1"]}), tmp_path / "d.parquet")
    with pytest.raises(RecipeError) as raised:
        build_prompts(PromptsSection(source=ParquetSource(path=str(tmp_path / "d.parquet"))), seed=0)
    assert (
        str(raised.value) == f"{tmp_path / 'd.parquet'}: missing column 'answer' (columns: prompt, solution)"
    )


def test_chat_template_needs_a_model_tokenizer(tmp_path: Path) -> None:
    path = _write_jsonl(tmp_path / "data.jsonl", [{"prompt": "1+1", "answer": "2"}])
    section = PromptsSection(source=JsonlSource(path=str(path)), chat_template=True)
    with pytest.raises(RecipeError) as raised:
        build_prompts(section, seed=0)
    assert str(raised.value) == (
        "prompts.chat_template: needs model.path (a Hugging Face model with a chat template); "
        "the character tokenizer has none"
    )


def test_model_path_tokenizes_through_the_chat_template(tmp_path: Path, tiny_qwen2_dir: Path) -> None:
    path = _write_jsonl(tmp_path / "data.jsonl", [{"prompt": "What is 3 + 4?", "answer": "7"}])
    section = PromptsSection(
        source=JsonlSource(path=str(path)), chat_template=True, system_prompt="Be brief."
    )
    prompts = build_prompts(section, seed=0, model_path=str(tiny_qwen2_dir))
    prompt = next(prompts.train)
    assert prompt.text == "What is 3 + 4?"
    assert prompt.tokens == tuple(
        HFTokenizer(tiny_qwen2_dir).encode_chat("What is 3 + 4?", system="Be brief.")
    )
    assert prompt.answer == "7"
