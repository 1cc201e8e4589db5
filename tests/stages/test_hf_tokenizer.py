"""The Hugging Face tokenizer: ids and chat text as transformers makes them; clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from pipeline.contracts.errors import RecipeError
from stages.hf_tokenizer import HFTokenizer

QUESTION = "What is 3 + 4?"


def _reference(directory: Path) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast.from_pretrained(directory, local_files_only=True)


def test_special_ids_come_from_the_config_files(tiny_qwen2_dir: Path) -> None:
    tokenizer = HFTokenizer(tiny_qwen2_dir)
    reference = _reference(tiny_qwen2_dir)
    im_end, endoftext = reference.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert (tokenizer.eos_id, tokenizer.pad_id) == (im_end, endoftext)
    assert tokenizer.stop_ids == (im_end, endoftext)  # generation_config.json adds <|endoftext|>
    assert tokenizer.vocab_size == len(reference)


@pytest.mark.parametrize("system", [None, "Put your final answer within \\boxed{}."])
def test_chat_prompt_matches_transformers(tiny_qwen2_dir: Path, system: str | None) -> None:
    tokenizer = HFTokenizer(tiny_qwen2_dir)
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": QUESTION})
    expected = _reference(tiny_qwen2_dir).apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert tokenizer.render_chat(QUESTION, system=system) == expected
    assert tokenizer.encode_chat(QUESTION, system=system) == _reference(tiny_qwen2_dir).encode(
        expected, add_special_tokens=False
    )


def test_encode_decode_round_trip_stops_at_eos(tiny_qwen2_dir: Path) -> None:
    tokenizer = HFTokenizer(tiny_qwen2_dir)
    ids = tokenizer.encode("The answer is \\boxed{31}.")
    assert ids == _reference(tiny_qwen2_dir).encode("The answer is \\boxed{31}.")
    assert tokenizer.decode([*ids, tokenizer.eos_id, *ids]) == "The answer is \\boxed{31}."
    # Ids past the tokenizer's vocabulary (the model's is padded) never decode to real text.
    assert tokenizer.decode([*ids[:2], tokenizer.vocab_size + 5]) == tokenizer.decode(ids[:2]) + "\ufffd"


def test_missing_tokenizer_json_is_named(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(tiny_qwen2_dir, tmp_path / "model")
    (tmp_path / "model" / "tokenizer.json").unlink()
    with pytest.raises(RecipeError) as raised:
        HFTokenizer(tmp_path / "model")
    assert str(raised.value) == (
        f"model.path: {tmp_path / 'model' / 'tokenizer.json'} not found: the model's tokenizer is needed "
        "to tokenize prompts (copy tokenizer.json and tokenizer_config.json next to config.json)"
    )


def test_a_tokenizer_json_not_utf8_or_not_a_tokenizer_is_named(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    """One line each (the tokenizers library's plain Exception was a traceback)."""
    shutil.copytree(tiny_qwen2_dir, tmp_path / "model")
    file = tmp_path / "model" / "tokenizer.json"
    file.write_bytes(b'{"version": "caf\xe9"}')
    with pytest.raises(RecipeError) as raised:
        HFTokenizer(tmp_path / "model")
    assert str(raised.value) == f"{file}: not UTF-8 text: byte 0xe9 at column 17"
    file.write_text("{}")
    with pytest.raises(RecipeError) as raised:
        HFTokenizer(tmp_path / "model")
    assert str(raised.value) == (
        f"{file}: not a tokenizer the tokenizers library reads: Model missing. at line 1 column 2"
    )


def test_missing_chat_template_is_named(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_qwen2_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(RecipeError) as raised:
        HFTokenizer(model).encode_chat(QUESTION)
    assert str(raised.value) == (
        f"prompts.chat_template: the model has no chat template: neither {model / 'chat_template.jinja'} "
        f"exists nor {model / 'tokenizer_config.json'} has a chat_template"
    )


def test_chat_template_jinja_file_is_used(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_qwen2_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "chat_template.jinja").write_text(config.pop("chat_template"))
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    assert HFTokenizer(model).render_chat(QUESTION) == HFTokenizer(tiny_qwen2_dir).render_chat(QUESTION)


def test_no_eos_anywhere_is_named(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(tiny_qwen2_dir, model)
    (model / "generation_config.json").unlink()
    (model / "tokenizer_config.json").write_text("{}")
    with pytest.raises(RecipeError) as raised:
        HFTokenizer(model)
    assert str(raised.value) == (
        f"model.path: no end-of-sequence token: neither {model / 'tokenizer_config.json'} has an "
        f"eos_token nor {model / 'generation_config.json'} an eos_token_id"
    )


def test_a_template_reads_one_time_for_the_whole_run(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    """`strftime_now` is the time the tokenizer was built: an episode's earlier turns, rendered
    again after each turn, keep their date."""
    model = tmp_path / "model"
    shutil.copytree(tiny_qwen2_dir, model)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ strftime_now('%H:%M:%S.%f') }}{{ messages[-1]['content'] }}"
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = HFTokenizer(model)
    first = tokenizer.render_chat(QUESTION)
    assert tokenizer.render_chat(QUESTION) == first
