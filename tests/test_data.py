"""DAPO-format prompt reading: malformed rows reported by line, both error modes, keys, shuffling."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from glmkit.rl.data import DEFAULT_DAPO_PATH, Problem, format_response, load_prompts
from glmkit.tokenizer import load_tokenizer

ARITH = Path(__file__).resolve().parents[1] / "glmkit" / "assets" / "arith"
COPY = ARITH.parent / "copy"


def write_rows(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def good(i):
    return {"prompt": [{"role": "user", "content": f"{i}+1="}], "label": str(i + 1)}


MIXED = [
    good(1),                                          # line 1
    "{not json",                                      # line 2
    {"label": "3"},                                   # line 3: no prompt
    {"prompt": "2+2="},                               # line 4: no label
    {"prompt": 5, "label": "5"},                      # line 5: prompt of the wrong type
    {"prompt": [{"role": "user"}], "label": "6"},     # line 6: message without content
    {"prompt": "plain string prompt", "label": 7},    # line 7: fine (string prompt, integer label)
    "[1, 2]",                                         # line 8: not an object
    {"prompt": "x", "label": ["8"]},                  # line 9: label of the wrong type
    "",                                               # line 10: blank, not a row
    good(11),                                         # line 11
]


def test_malformed_rows_are_reported_by_line(tmp_path):
    path = write_rows(tmp_path / "d.jsonl", MIXED)
    with pytest.warns(UserWarning, match=r"skipped 7 malformed row\(s\) at line\(s\) 2, 3, 4, 5, 6, 8, 9") as record:
        samples, problems = load_prompts(path, shuffle_seed=None)
    assert len(record) == 1  # warned once, with the count
    assert [p.line for p in problems] == [2, 3, 4, 5, 6, 8, 9]
    assert all(isinstance(p, Problem) and p.reason for p in problems)
    assert "not valid JSON" in problems[0].reason
    assert "missing key 'prompt'" in problems[1].reason and "missing key 'label'" in problems[2].reason
    assert [s.index for s in samples] == [1, 7, 11]
    assert samples[1].label == "7" and samples[1].prompt_text == "plain string prompt"
    assert len(samples) + len(problems) == 10  # every non-blank line accounted for


def test_raise_mode_names_the_line(tmp_path):
    path = write_rows(tmp_path / "d.jsonl", MIXED)
    with pytest.raises(ValueError, match=r"line 2: not valid JSON"):
        load_prompts(path, on_error="raise")
    with pytest.raises(ValueError, match="on_error"):
        load_prompts(path, on_error="ignore")


def test_clean_file_does_not_warn(tmp_path):
    path = write_rows(tmp_path / "d.jsonl", [good(i) for i in range(5)])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        samples, problems = load_prompts(path, on_error="raise")
    assert len(samples) == 5 and problems == []


def test_custom_keys_and_metadata(tmp_path):
    path = write_rows(tmp_path / "d.jsonl", [{"question": "1+1=", "answer": "2", "source": "s"}])
    samples, _ = load_prompts(path, input_key="question", label_key="answer")
    assert samples[0].label == "2" and samples[0].metadata == {"source": "s"}
    with pytest.raises(ValueError, match="line 1: missing key 'prompt'"):
        load_prompts(path, on_error="raise")


def test_chat_template_and_tokens(tmp_path):
    tokenizer = load_tokenizer(None)
    path = write_rows(tmp_path / "d.jsonl", [good(11), {"prompt": "3-5=", "label": "-2"}])
    samples, _ = load_prompts(path, tokenizer=tokenizer, shuffle_seed=None)
    assert samples[0].prompt_text == "<bos><|user|>11+1=<|assistant|><think>"
    assert samples[1].prompt_text == "<bos><|user|>3-5=<|assistant|><think>"  # a string is one user message
    assert samples[0].prompt_ids[0] == tokenizer.bos_token_id and samples[0].prompt_ids.count(1) == 1
    assert tokenizer.decode(samples[0].prompt_ids) == samples[0].prompt_text
    plain, _ = load_prompts(path, tokenizer=tokenizer, apply_chat_template=False, shuffle_seed=None)
    assert plain[0].prompt_text == "11+1=" and tokenizer.decode(plain[0].prompt_ids) == "11+1="


def test_chat_template_failure_is_a_row_problem(tmp_path):
    tokenizer = load_tokenizer(None)
    path = write_rows(tmp_path / "d.jsonl", [good(1), {"prompt": [{"role": "robot", "content": "x"}], "label": "1"}])
    with pytest.warns(UserWarning, match="line.s. 2"):
        samples, problems = load_prompts(path, tokenizer=tokenizer)
    assert len(samples) == 1 and "chat template failed" in problems[0].reason


def test_shuffle_is_seeded(tmp_path):
    path = write_rows(tmp_path / "d.jsonl", [good(i) for i in range(50)])
    order = lambda seed: [s.index for s in load_prompts(path, shuffle_seed=seed)[0]]  # noqa: E731
    assert order(0) == order(0)
    assert order(0) != order(1)
    assert sorted(order(0)) == order(None) == list(range(1, 51))


def test_shipped_arith_set():
    tokenizer = load_tokenizer(None)
    train, problems = load_prompts(ARITH / "train.jsonl", tokenizer=tokenizer, on_error="raise")
    test, _ = load_prompts(ARITH / "test.jsonl", tokenizer=tokenizer, on_error="raise")
    assert len(train) >= 2000 and len(test) >= 50 and problems == []
    assert all(s.metadata["source"] == "synthetic" for s in train + test)
    train_prompts = {s.prompt_text for s in train}
    assert not train_prompts & {s.prompt_text for s in test}  # held out
    for s in test[:20]:
        a, op, b = s.prompt_text.split("<|user|>")[1].split("=")[0].partition("+" if "+" in s.prompt_text else "-")
        assert int(s.label) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert max(s.prompt_ids) < 1024
    sizes = sum(f.stat().st_size for f in ARITH.glob("*.jsonl"))
    assert sizes < 300 * 1024


def test_shipped_copy_set():
    """The tiny preset's set: `a+0=` -> a for 0 <= a < 1000, 900 training and 100 held-out numbers,
    no number in both."""
    tokenizer = load_tokenizer(None)
    train, problems = load_prompts(COPY / "train.jsonl", tokenizer=tokenizer, on_error="raise")
    test, _ = load_prompts(COPY / "test.jsonl", tokenizer=tokenizer, on_error="raise")
    assert (len(train), len(test), problems) == (900, 100, [])
    assert all(s.metadata["source"] == "synthetic" for s in train + test)
    numbers = [int(s.label) for s in train + test]
    assert sorted(numbers) == list(range(1000))  # each number once: held out means never trained on
    for s in train + test:
        assert s.prompt_text == f"<bos><|user|>{s.label}+0=<|assistant|><think>"


def test_format_response_is_short_and_rewarded():
    from glmkit.rl.rewards import deepscaler

    tokenizer = load_tokenizer(None)
    response = format_response("-20")
    assert response == "</think>\\boxed{-20}<eos>"
    ids = tokenizer.encode(response, add_special_tokens=False)
    assert len(ids) == 7 and ids[-1] == tokenizer.eos_token_id
    assert deepscaler(tokenizer.decode(ids, skip_special_tokens=False), "-20")["score"] == 1.0
    assert deepscaler(tokenizer.decode(ids, skip_special_tokens=True), "-20")["score"] == 1.0


def test_default_path():
    assert DEFAULT_DAPO_PATH == "/root/datasets/dapo-math-17k/dapo-math-17k.jsonl"


def test_a_byte_order_mark_and_a_lone_surrogate(tmp_path):
    """Row 1 after a UTF-8 BOM is read (it was dropped as invalid JSON); a row escaping half a UTF-16 pair
    is skipped by line (it ended the run with a TypeError in the tokenizer)."""
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + json.dumps(good(1)).encode() + b"\n"
                     + b'{"prompt": "x\\ud800", "label": "2"}\n'
                     + b'{"prompt": "\\ud83d\\ude00 paired is fine", "label": "3"}\n')
    with pytest.warns(UserWarning, match=r"line\(s\) 2"):
        samples, problems = load_prompts(path, shuffle_seed=None)
    assert [s.index for s in samples] == [1, 3] and samples[1].prompt_text.startswith("\U0001F600")
    assert "lone UTF-16 surrogate" in problems[0].reason


def test_a_file_that_reads_on_and_on_or_is_not_jsonl_is_refused(tmp_path, monkeypatch):
    """Hostile pass 6: `--prompt-data /proc/self/pagemap` (size 0 on disk, terabytes when read) read until
    killed. Bytes are now counted as they are read (bounded by MAX_FILE_BYTES, lowered here so the test
    is quick), and a file whose malformed rows outnumber its prompts past MAX_MALFORMED_ROWS is refused
    instead of collecting a problem per line."""
    import os

    from glmkit.rl import data

    monkeypatch.setattr(data, "MAX_FILE_BYTES", 8 << 20)
    if os.path.exists("/proc/self/pagemap"):
        with pytest.raises(ValueError, match=r"pagemap: read past 8388608 bytes, the most a prompt file may hold"):
            load_prompts("/proc/self/pagemap", apply_chat_template=False)
    binary = tmp_path / "binary.jsonl"
    good = json.dumps({"prompt": [{"role": "user", "content": "1+1"}], "label": "2"})
    binary.write_bytes(((good + "\n") * 5).encode() + b"\xff\xfe not json\n" * 1500)
    with pytest.raises(ValueError, match=r"binary.jsonl: 1001 malformed rows and 5 prompts by line 1006 \(first: line 6: "):
        load_prompts(binary, apply_chat_template=False)
    mostly_good = tmp_path / "mostly_good.jsonl"  # many bad rows, more good ones: read, the bad ones reported
    mostly_good.write_text((good + "\n") * 1500 + "not json\n" * 1200)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        samples, problems = load_prompts(mostly_good, apply_chat_template=False)
    assert len(samples) == 1500 and len(problems) == 1200
