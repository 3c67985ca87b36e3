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


def copy_tiny(folder: Path) -> Path:
    folder.mkdir(exist_ok=True)
    for f in TINY_TOKENIZER.iterdir():
        shutil.copy(f, folder / f.name)
    return folder


def test_tokenizer_files_that_would_block_or_abort_the_reader_are_refused_by_name(tmp_path):
    """Hostile pass 8: a FIFO as tokenizer_config.json read as 'no chat template' (or blocked), and a
    tokenizer.json nested thousands deep ended in an internal error. Each is named with what it is."""
    import os

    fifo = copy_tiny(tmp_path / "fifo")
    (fifo / "tokenizer_config.json").unlink()
    os.mkfifo(fifo / "tokenizer_config.json")
    with pytest.raises(ValueError, match=r"tokenizer_config.json is a named pipe \(FIFO\); expected a regular file"):
        load_tokenizer(fifo)
    deep = copy_tiny(tmp_path / "deep")
    (deep / "tokenizer.json").write_text("[" * 5000 + "]" * 5000)
    with pytest.raises(ValueError, match="tokenizer.json nests past 64 levels"):
        load_tokenizer(deep)
    broken = copy_tiny(tmp_path / "broken")
    (broken / "tokenizer.json").write_text('{"model": {"type": "NoSuchModel"}}')
    with pytest.raises(ValueError, match=f"tokenizer in {broken} cannot be read"):
        load_tokenizer(broken)


@pytest.mark.parametrize("template, needle", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}x{% endfor %}{% endfor %}", "ran past 5 s"),
    ("{% for i in range(100000) %}{{ 'y' * 100 }}{% endfor %}", "the chat template made 10000000 characters"),
])
def test_a_chat_template_that_never_ends_or_floods_is_a_bad_row(tmp_path, template, needle, monkeypatch):
    """A chat template is code from the tokenizer's folder: one whose loops would run for hours is
    stopped after CHAT_TEMPLATE_SECONDS (made 1 s here), one that writes 10 M characters for a row is
    refused above MAX_PROMPT_CHARS; either is that row's problem, named, not a hang or an abort."""
    from glmkit.rl import data

    monkeypatch.setattr(data, "CHAT_TEMPLATE_SECONDS", 1.0)
    folder = copy_tiny(tmp_path / "tok")
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = load_tokenizer(folder)
    with pytest.raises(data.RowError, match="chat template") as err:
        data.parse_row('{"prompt": "1+1=", "label": "2"}', 1, "prompt", "label", tok, True)
    assert needle.replace("5 s", "1 s") in str(err.value)
