"""The shipped tiny tokenizer and local tokenizer loading."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

from glmkit.tokenizer import TINY_TOKENIZER, load_tokenizer

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


def test_special_token_ids(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert (tok.pad_token, tok.bos_token, tok.eos_token) == ("<pad>", "<bos>", "<eos>")
    assert len(tok) <= 1024
    for tag in ("<|user|>", "<|assistant|>", "<think>", "</think>"):
        ids = tok.encode(tag, add_special_tokens=False)
        assert len(ids) == 1 and tok.decode(ids) == tag


def test_chat_prompt_round_trip(tok):
    messages = [{"role": "user", "content": "12+7="}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<bos><|user|>12+7=<|assistant|><think>"
    ids = tok.encode(text, add_special_tokens=False)
    assert ids[0] == 1 and all(0 <= i < 1024 for i in ids)
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert "<think>" in tok.decode(ids, skip_special_tokens=True)  # tags are not "special"


def test_text_round_trip(tok):
    text = "Let x = 3.5; then (x^2 - 1)/2 != \\frac{a}{b}.\n\tDone!"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text and max(ids) < 1024
    assert tok.convert_ids_to_tokens(tok.encode("é", add_special_tokens=False)) == ["<unk>"]


def test_tiny_alias_and_directory(tok):
    assert load_tokenizer("tiny").get_vocab() == tok.get_vocab()
    assert load_tokenizer(TINY_TOKENIZER).get_vocab() == tok.get_vocab()


def test_checkpoint_directory_with_tokenizer(tmp_path, tok):
    for f in TINY_TOKENIZER.iterdir():
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm5_next"}))
    loaded = load_tokenizer(tmp_path)
    assert loaded.encode("1+1=") == tok.encode("1+1=") and loaded.chat_template == tok.chat_template


def test_missing_tokenizer_names_the_directory(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=f"no tokenizer in {tmp_path}"):
        load_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "absent")


def test_build_script_reproduces_the_shipped_files(tmp_path):
    spec = importlib.util.spec_from_file_location("build_tiny_tokenizer", ROOT / "scripts" / "build_tiny_tokenizer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        assert (tmp_path / name).read_text() == (TINY_TOKENIZER / name).read_text(), name
