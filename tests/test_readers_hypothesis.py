"""Property-based tests (hypothesis) of glmkit's readers and its argument space: whatever bytes or
values they are given, they answer with a result or a ValueError (glmkit's bad-input error, a
CheckpointError among them) naming the input, never another exception. The examples are generated
and shrunk by hypothesis with a fixed seed (derandomize), so a failure reproduces."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from glmkit.config import variant_config

ROOT = Path(__file__).resolve().parents[1]
CKPT = ROOT / "glmkit" / "assets" / "tiny_start"
SETTINGS = settings(max_examples=60, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=True) | st.text(max_size=20),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                       max_size=4), max_leaves=12)


def scratch() -> Path:
    return Path(tempfile.mkdtemp(prefix="glmkit-hyp-"))


@SETTINGS
@given(st.binary(max_size=300))
def test_a_safetensors_header_of_any_bytes_is_read_or_refused(blob):
    from glmkit.checkpoint.hf import read_header

    folder = scratch()
    try:
        path = folder / "model.safetensors"
        path.write_bytes(blob)
        try:
            read_header(path)
        except ValueError as err:
            assert str(err)
    finally:
        shutil.rmtree(folder)


@SETTINGS
@given(st.dictionaries(st.text(max_size=12), json_values, max_size=6),
       st.integers(min_value=0, max_value=2 ** 64), st.binary(max_size=64))
def test_a_header_with_any_json_is_read_or_refused(header, length_fudge, tail):
    from glmkit.checkpoint.hf import read_header

    folder = scratch()
    try:
        raw = json.dumps(header).encode()
        path = folder / "x.safetensors"
        size = len(raw) if length_fudge % 3 else length_fudge
        path.write_bytes(min(size, 2 ** 64 - 1).to_bytes(8, "little") + raw + tail)
        try:
            read_header(path)
        except ValueError as err:
            assert str(err)
    finally:
        shutil.rmtree(folder)


@SETTINGS
@given(json_values)
def test_a_checkpoint_index_of_any_json_is_read_or_refused(index):
    from glmkit.checkpoint import open_checkpoint

    folder = scratch()
    try:
        shutil.copy(CKPT / "config.json", folder / "config.json")
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
        try:
            open_checkpoint(folder)
        except ValueError as err:
            assert str(err)
    finally:
        shutil.rmtree(folder)


@SETTINGS
@given(st.lists(st.one_of(json_values.map(json.dumps), st.text(max_size=40)), max_size=6))
def test_prompt_rows_of_any_content_are_samples_or_named_problems(lines):
    from glmkit.rl.data import load_prompts

    folder = scratch()
    try:
        path = folder / "p.jsonl"
        path.write_text("\n".join(line.replace("\n", " ") for line in lines) + "\n")
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            samples, problems = load_prompts(path, tokenizer=None, apply_chat_template=False)
        assert len(samples) + len(problems) <= len(lines)
        assert all(p.line >= 1 and p.reason for p in problems)
    finally:
        shutil.rmtree(folder)


@SETTINGS
@given(st.binary(max_size=200))
def test_a_capture_file_of_any_bytes_is_refused_by_name(blob):
    from glmkit.parity.dump import load_capture

    folder = scratch()
    try:
        (folder / "capture.safetensors").write_bytes(blob)
        (folder / "manifest.json").write_bytes(blob[:50])
        try:
            load_capture(folder)
        except (ValueError, FileNotFoundError) as err:
            assert str(err)
    finally:
        shutil.rmtree(folder)


@SETTINGS
@given(json_values)
def test_a_selections_file_of_any_json_is_read_or_refused(content):
    from glmkit.parity.dump import read_selections

    folder = scratch()
    try:
        path = folder / "selections.json"
        path.write_text(json.dumps(content))
        try:
            read_selections(path, variant_config("tiny"))
        except (ValueError, FileNotFoundError) as err:
            assert str(err)
    finally:
        shutil.rmtree(folder)


@SETTINGS
@given(json_values)
def test_rollout_data_of_any_json_is_read_or_refused(content):
    from glmkit.parity.rollout_data import load_rollout_data

    folder = scratch()
    try:
        path = folder / "rollout.json"
        path.write_text(json.dumps(content))
        try:
            load_rollout_data(path, vocab_size=1024)
        except (ValueError, FileNotFoundError) as err:
            assert str(err)
    finally:
        shutil.rmtree(folder)


CLI_VALUES = st.sampled_from(["0", "-1", "1", "1e309", "nan", "inf", "-inf", "", " ", "x", "10" * 20, "/", "/dev/null",
                              "..", "'; rm -rf /", "\u00e9", "--", "--help-me"])
CLI_OPTIONS = st.sampled_from(["--batch", "--seq-len", "--seed", "--threshold", "--paths", "--dtype", "--device",
                               "--third", "--replay-topk-from", "--json", "--lr", "--num-rollout", "--variant",
                               "--out", "--max-context", "--port", "--layers", "--src"])


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.sampled_from([["parity", "--checkpoint", str(CKPT)], ["train", "--model-name", "tiny"],
                        ["ckpt", "synth"], ["ckpt", "slice"], ["check"], ["serve", "--checkpoint", str(CKPT)]]),
       st.lists(st.tuples(CLI_OPTIONS, CLI_VALUES), min_size=1, max_size=3))
def test_the_command_line_answers_bad_values_with_exit_2_and_no_traceback(command, pairs):
    """Each command with odd values for its options: argparse's usage error or glmkit's one-line
    refusal (exit 2); never a traceback. A combination that happens to be valid may run (exit 0 or 1)
    but is cut short by --help-free timeouts: only bad-value handling is judged here."""
    folder = scratch()
    try:
        args = [*command]
        for option, value in pairs:
            args += [option, value]
        if command[0] in ("train", "ckpt", "check", "serve"):
            args += ["--out" if command[0] != "train" else "--metrics-out", str(folder / "out")]
        try:
            done = subprocess.run([sys.executable, "-m", "glmkit", *args], capture_output=True, text=True, cwd=folder,
                                  timeout=60)
        except subprocess.TimeoutExpired:
            return  # a valid combination that started real work (e.g. a server): not a bad-value case
        assert "Traceback" not in done.stderr, (args, done.stderr[-2000:])
        assert done.returncode in (0, 1, 2), (args, done.returncode, done.stderr[-500:])
    finally:
        shutil.rmtree(folder)


@pytest.mark.parametrize("flag", ["--batch", "--seq-len"])
def test_the_shapes_options_take_positive_integers_only(flag, tmp_path):
    done = subprocess.run([sys.executable, "-m", "glmkit", "parity", "--checkpoint", str(CKPT), flag, "0"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert done.returncode == 2 and "must be >= 1" in done.stderr


@SETTINGS
@given(st.binary(max_size=200))
@example(b"r")  # a lone BININT opcode: the unpickler raises struct.error
def test_a_framework_dump_file_of_any_bytes_is_refused_by_name(blob):
    from glmkit.parity.framework_dump import _load

    folder = scratch()
    try:
        path = folder / "step=0___rank=0___dump_index=1___name=x.pt"
        path.write_bytes(blob)
        try:
            _load(path)
        except ValueError as err:
            assert str(err)
    finally:
        shutil.rmtree(folder)


@SETTINGS
@given(st.binary(max_size=200))
@example(b"r")  # a lone BININT opcode: the unpickler raises struct.error
def test_rollout_data_of_any_bytes_is_refused_by_name(blob):
    from glmkit.parity.rollout_data import load_rollout_data

    folder = scratch()
    try:
        path = folder / "rollout.pt"
        path.write_bytes(blob)
        try:
            load_rollout_data(path, vocab_size=1024)
        except ValueError as err:
            assert str(err)
    finally:
        shutil.rmtree(folder)


@SETTINGS
@given(st.binary(max_size=200))
@example(b"r")
def test_a_torch_dist_index_of_any_bytes_is_refused_by_name(blob):
    from glmkit.checkpoint.hf import CheckpointError
    from glmkit.checkpoint.torch_dist import TorchDistCheckpoint

    folder = scratch()
    try:
        (folder / ".metadata").write_bytes(blob)
        try:
            TorchDistCheckpoint(folder)
        except CheckpointError as err:
            assert ".metadata" in str(err)
    finally:
        shutil.rmtree(folder)


def test_a_torch_dist_index_cannot_make_the_reader_allocate_what_the_stream_declares():
    """A 20-byte index whose LONG_BINPUT names memo slot 2.3e9 made the C unpickler zero 18 GB; one
    declaring a 2**40-byte BYTEARRAY8 would allocate a terabyte. Both are refused by name, within a few
    MB of memory (the test runs them in a child with its address space capped at 2 GiB)."""
    script = (
        "import resource, sys, tempfile, pathlib\n"
        "resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))\n"
        "from glmkit.checkpoint.hf import CheckpointError\n"
        "from glmkit.checkpoint.torch_dist import TorchDistCheckpoint\n"
        "for blob in (b'\\x88rXt\\x93T\\x88\\xf6]d', b'\\x80\\x05\\x96' + (1 << 40).to_bytes(8, 'little')):\n"
        "    folder = pathlib.Path(tempfile.mkdtemp())\n"
        "    (folder / '.metadata').write_bytes(blob)\n"
        "    try:\n"
        "        TorchDistCheckpoint(folder)\n"
        "    except CheckpointError as err:\n"
        "        assert 'MemoryError' not in str(err), err\n"
        "        print('refused:', err)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("refused:") == 2 and "not a readable torch.distributed.checkpoint index" in done.stdout
