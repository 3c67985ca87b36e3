"""Ownership and locks of what glmkit writes, and the CLI's error contract (issue 33)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from glmkit.outputs import (RunLock, file_marker, is_glmkit_file, mark, mark_file, refuse_input_as_output,
                            refuse_replacing)

ROOT = Path(__file__).resolve().parents[1]


def test_markers_say_kind_version_and_writer(tmp_path):
    from glmkit import __version__

    mark(tmp_path, "checkpoint")
    text = (tmp_path / ".glmkit-output").read_text()
    assert text.startswith("kind: checkpoint\n") and f"glmkit {__version__}, written by `" in text
    metrics = tmp_path / "m.jsonl"
    metrics.write_text("")
    assert not is_glmkit_file(metrics)
    mark_file(metrics, "metrics file")
    assert is_glmkit_file(metrics) and file_marker(metrics).name == ".m.jsonl.glmkit-output"


def test_replacing_is_refused_for_what_glmkit_did_not_write(tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="not a metrics file glmkit wrote"):
        refuse_replacing(data, "--metrics-out", "metrics file")
    mark_file(data, "metrics file")
    refuse_replacing(data, "--metrics-out", "metrics file")  # marked: allowed
    with pytest.raises(ValueError, match="is this run's --prompt-data"):
        refuse_replacing(data, "--metrics-out", "metrics file", {"--prompt-data": data})
    link = tmp_path / "link.jsonl"
    link.symlink_to(data)
    with pytest.raises(ValueError, match="symbolic link"):
        refuse_replacing(link, "--metrics-out", "metrics file")
    linked_dir = tmp_path / "linked"
    linked_dir.symlink_to(tmp_path)
    with pytest.raises(ValueError, match="symbolic link"):
        refuse_replacing(linked_dir / "data.jsonl", "--metrics-out", "metrics file")
    with pytest.raises(ValueError, match="not a regular file"):
        refuse_replacing(Path("/dev/null"), "--metrics-out", "metrics file")
    with pytest.raises(ValueError, match="an output never replaces an input"):
        refuse_input_as_output(tmp_path / "data.jsonl", "--metrics-out", {"--prompt-data": str(data)})


def test_a_second_writer_is_refused_with_the_holder_named(tmp_path):
    target = tmp_path / "m.jsonl"
    with RunLock(target, "--metrics-out"):
        lock_file = tmp_path / ".m.jsonl.glmkit-lock"
        assert f"pid={os.getpid()} host={socket.gethostname()}" in lock_file.read_text()
        other = subprocess.run([sys.executable, "-c", "from glmkit.outputs import RunLock\n"
                                f"RunLock({str(target)!r}, '--metrics-out').__enter__()"],
                               capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert other.returncode == 1 and f"is in use by another glmkit run (pid={os.getpid()}" in other.stderr
        with pytest.raises(ValueError, match="in use by another glmkit run"):  # another open file, same process
            RunLock(target, "--metrics-out").__enter__()
    assert not lock_file.exists()  # released at the end


def test_a_stale_lock_is_taken_over_and_another_hosts_is_refused(tmp_path):
    target = tmp_path / "out"
    lock_file = tmp_path / ".out.glmkit-lock"
    lock_file.write_text(f"pid=999999999 host={socket.gethostname()} started=2026-01-01T00:00:00\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with RunLock(target, "--out"):
            assert f"pid={os.getpid()}" in lock_file.read_text()
    assert any("took over the lock" in str(w.message) and "pid=999999999" in str(w.message) for w in caught)
    lock_file.write_text("pid=12 host=elsewhere.example started=2026-01-01T00:00:00\n")
    with pytest.raises(ValueError, match="locked by a run on another host .*host=elsewhere.example"):
        RunLock(target, "--out").__enter__()
    # hostile pass 12: a lock naming no host was "locked by a run on another host (host=)"
    lock_file.write_text("pid=12 host= started=2026-01-01T00:00:00\n")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with RunLock(target, "--out"):
            assert f"host={socket.gethostname()}" in lock_file.read_text()
    assert any("took over the lock" in str(w.message) for w in caught)


def test_an_output_that_is_a_pipe_or_a_device_is_refused_by_what_it_is(tmp_path):
    """Hostile pass 7: `--metrics-out /proc/self/fd/1` resolved to the pseudo-name `pipe:[N]` and ended in
    a raw 'No such file or directory' about a lock beside it. An output that is a pipe or a device
    (directly or through a link) is now refused by what it is, and nothing is created beside it."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "to-fifo").symlink_to(fifo)
    for given, what in ((fifo, r"is a named pipe \(FIFO\);"), (tmp_path / "to-fifo", r"\(through a symbolic link\)"),
                        ("/dev/null", "is a character device")):
        with pytest.raises(ValueError, match=rf"^--metrics-out {given}: .*{what}.* regular file or folder"):
            RunLock(given, "--metrics-out").__enter__()
    read_end, write_end = os.pipe()  # what /proc/self/fd/N names when a run's output is piped
    try:
        with pytest.raises(ValueError, match=r"is a named pipe \(FIFO\) \(through a symbolic link\)"):
            RunLock(f"/proc/self/fd/{write_end}", "--metrics-out").__enter__()
    finally:
        os.close(read_end), os.close(write_end)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "to-fifo"]


def test_a_lock_file_that_is_a_link_a_fifo_or_a_folder_is_refused_and_links_share_one_lock(tmp_path):
    """Hostile pass 6: a lock file replaced by a symlink had its target truncated and overwritten (and its
    first bytes printed); a FIFO was exit 3; an output reached through a linked folder took a second
    lock of its own, so two runs wrote one folder. Now the lock never follows a link, refuses what is
    not a regular file by name, and is found through the output's real path."""
    victim = tmp_path / "precious.txt"
    victim.write_text("the user's data\n" * 100)
    target = tmp_path / "run"
    lock_file = tmp_path / ".run.glmkit-lock"
    lock_file.symlink_to(victim)
    with pytest.raises(ValueError, match=r"its lock file .* is a symbolic link, not glmkit's"):
        RunLock(target, "--save").__enter__()
    assert victim.read_text() == "the user's data\n" * 100
    lock_file.unlink()
    os.link(victim, lock_file)  # hostile pass 12: a hard link was truncated and written as a stale lock
    with pytest.raises(ValueError, match=r"its lock file .* is a hard link to another file \(2 names\), not glmkit's"):
        RunLock(target, "--save").__enter__()
    assert victim.read_text() == "the user's data\n" * 100
    lock_file.unlink()
    os.mkfifo(lock_file)
    with pytest.raises(ValueError, match=r"is a named pipe \(FIFO\), not glmkit's"):
        RunLock(target, "--save").__enter__()
    lock_file.unlink()
    lock_file.mkdir()
    with pytest.raises(ValueError, match="is a directory, not glmkit's"):
        RunLock(target, "--save").__enter__()
    lock_file.rmdir()
    target.mkdir()
    (tmp_path / "alias").symlink_to(target)
    with RunLock(target, "--save"):
        with pytest.raises(ValueError, match="in use by another glmkit run"):
            RunLock(tmp_path / "alias", "--save").__enter__()
    lock_file.write_bytes(b"\xff\xfe" + b"x" * 100000)  # not text, and long: read short and printable
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with RunLock(target, "--save"):
            pass
    assert all(len(str(w.message)) < 400 for w in caught)


def glmkit(*args, env=None):
    return subprocess.run([sys.executable, "-m", "glmkit", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=300, env={**os.environ, **(env or {})})


def failing_check(body: str, tmp_path) -> subprocess.CompletedProcess:
    """`glmkit check` whose command function is replaced by `body` (a statement raising something)."""
    code = ("import errno, sys, numpy\nimport glmkit.cli as c\nreal = c.build_parser\n"
            "def fail(args):\n    " + body + "\n"
            "def build():\n    p = real()\n"
            "    for action in p._subparsers._group_actions:\n"
            "        action.choices['check'].set_defaults(func=fail)\n    return p\n"
            "c.build_parser = build\nsys.exit(c.main(['check']))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, "TMPDIR": str(tmp_path)})


def test_the_error_contract(tmp_path):
    """2: bad input, one line naming it; 3: an internal error (a library's ValueError is not the
    user's input), one line and the traceback in a file; 4: the environment; 130: interrupted."""
    bad = glmkit("ckpt", "synth", "--variant", "nope", "--out", tmp_path / "x")
    assert len(bad.stderr.strip().splitlines()) == 1  # one line: the command, the input and the allowed values
    last = bad.stderr.strip()
    assert bad.returncode == 2 and "invalid choice: 'nope' (choose from" in last
    internal = failing_check("numpy.zeros(3).reshape(2, 2)", tmp_path)
    assert internal.returncode == 3, internal.stderr
    assert "glmkit check: internal error: ValueError: cannot reshape" in internal.stderr
    saved = Path(internal.stderr.split("traceback saved to ")[1].split(";")[0])
    assert saved.is_file() and "Traceback" in saved.read_text() and saved.is_relative_to(tmp_path)
    crash = failing_check("raise KeyError('bug')", tmp_path)
    assert crash.returncode == 3 and "internal error: KeyError" in crash.stderr
    full = failing_check("raise OSError(errno.ENOSPC, 'No space left on device', '/data/out')", tmp_path)
    assert full.returncode == 4 and "environment error: No space left on device: /data/out" in full.stderr
    denied = failing_check("open('/proc/1/mem', 'w')", tmp_path)
    assert denied.returncode in (3, 4) and "Traceback" not in denied.stderr
    interrupted = failing_check("raise KeyboardInterrupt", tmp_path)
    assert interrupted.returncode == 130 and "interrupted" in interrupted.stderr
    closed = failing_check("raise BrokenPipeError(32, 'Broken pipe')", tmp_path)  # `glmkit ... | head`
    assert closed.returncode == 141 and closed.stderr == ""
    long_name = failing_check("open('x' * 300, 'w')", tmp_path)
    assert long_name.returncode == 2 and "a path is too long for the file system (300 characters" in long_name.stderr
    refused = glmkit("train", "--lr", "-1", "--metrics-out", tmp_path / "m.jsonl")  # glmkit's own check
    assert refused.returncode == 2 and refused.stderr.strip() == "glmkit train: error: --lr must be > 0, got -1.0"


def test_a_traceback_is_never_written_through_a_link_or_into_a_shared_folder(tmp_path):
    """The traceback folder is this user's own (0700): a symlink or an open folder planted at its name
    is not written through (the traceback goes to a new private folder instead, never to the
    terminal), and a file is always new."""
    folder = tmp_path / f"glmkit-errors-{os.getuid()}"
    victim = tmp_path / "victim"
    victim.mkdir()
    folder.symlink_to(victim)
    planted = failing_check("raise KeyError('bug')", tmp_path)
    assert planted.returncode == 3 and "Traceback" not in planted.stderr
    elsewhere = Path(planted.stderr.split("traceback saved to ")[1].split(";")[0])
    assert elsewhere.parent.name.startswith("glmkit-errors-") and elsewhere.parent != folder
    assert oct(elsewhere.parent.stat().st_mode & 0o777) == "0o700" and "KeyError" in elsewhere.read_text()
    assert list(victim.iterdir()) == []
    folder.unlink()
    folder.mkdir(mode=0o777)
    folder.chmod(0o777)
    open_folder = failing_check("raise KeyError('bug')", tmp_path)
    assert "Traceback" not in open_folder.stderr and list(folder.iterdir()) == []
    folder.chmod(0o700)
    private = failing_check("raise KeyError('bug')", tmp_path)
    saved = Path(private.stderr.split("traceback saved to ")[1].split(";")[0])
    assert saved.parent == folder and oct(saved.stat().st_mode & 0o777) == "0o600"


def test_sizes_are_bounded_before_anything_is_allocated(tmp_path):
    """A huge batch is refused at once with the numbers (it used to hang); a prompt row over the row
    limit is skipped unread, naming the limit, and the rows after it are kept."""
    import json

    from glmkit.rl.data import MAX_ROW_BYTES, load_prompts

    huge = glmkit("parity", "--checkpoint", ROOT / "glmkit/assets/tiny_start", "--batch", 10 ** 12)
    assert huge.returncode == 2 and "tokens need at least" in huge.stderr and "GiB free" in huge.stderr
    # Hostile pass 12: one sequence of 40000 tokens passed the per-token bound, and the reference's
    # T x T scores (25.6 GB) ran the machine out of memory; the square is counted too
    for command in (("parity",), ("capture", "--path", "reference", "--out", tmp_path / "cap")):
        long = glmkit(*command, "--checkpoint", ROOT / "glmkit/assets/tiny_start", "--batch", 1, "--seq-len", 100000)
        assert long.returncode == 2, long.stderr
        assert "--seq-len: 100000 tokens through the reference need at least" in long.stderr, long.stderr
    typo = glmkit("parity", "--checkpoint", ROOT / "glmkit/assets/tiny_start", "--batch", 10 ** 30)
    assert typo.returncode == 2 and "argument --batch: must be at most 4611686018427387904" in typo.stderr
    data = tmp_path / "rows.jsonl"
    with open(data, "w") as f:
        f.write(json.dumps({"prompt": "x" * (3 * MAX_ROW_BYTES), "label": "1"}) + "\n")
        f.write(json.dumps({"prompt": "1+1=", "label": "2"}) + "\n")
    with pytest.warns(UserWarning, match="longer than 1048576 bytes"):
        samples, problems = load_prompts(data, tokenizer=None, apply_chat_template=False)
    assert [s.label for s in samples] == ["2"] and problems[0].line == 1


def test_a_slice_never_replaces_its_own_source(tmp_path):
    import shutil

    src = tmp_path / "ck"
    shutil.copytree(ROOT / "glmkit/assets/tiny_start", src)  # marked: --overwrite could replace it otherwise
    before = (src / "model.safetensors").read_bytes()
    done = glmkit("ckpt", "slice", "--src", src, "--layers", "2", "--out", src, "--overwrite")
    assert done.returncode == 2 and "is this run's --src; an output never replaces an input" in done.stderr
    assert (src / "model.safetensors").read_bytes() == before and (src / "tokenizer.json").is_file()


def test_an_output_holding_an_input_is_refused(tmp_path):
    inner = tmp_path / "out" / "iter_0000005" / "model"
    inner.mkdir(parents=True)
    with pytest.raises(ValueError, match="holds this run's --checkpoint"):
        refuse_input_as_output(tmp_path / "out", "--save", {"--checkpoint": str(inner)})


TINY = ROOT / "glmkit" / "assets" / "tiny_start"


def test_single_file_outputs_replace_only_what_glmkit_wrote(tmp_path):
    """--json and check's report files: someone's file at that path, a link, or one of the command's
    own inputs is refused before any work (exit 2, the file unchanged); a result glmkit wrote is replaced."""
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    refused = glmkit("parity", "--checkpoint", TINY, "--paths", "reference,train", "--json", notes)
    assert refused.returncode == 2 and "not a JSON result glmkit wrote" in refused.stderr
    assert notes.read_text() == '{"mine": 1}'
    config = tmp_path / "ckpt"
    config.mkdir()
    for f in TINY.iterdir():
        (config / f.name).symlink_to(f)  # a checkpoint folder whose files are links to the shipped ones
    (config / "config.json").unlink()
    (config / "config.json").write_text((TINY / "config.json").read_text())
    as_input = glmkit("parity", "--checkpoint", config, "--paths", "reference,train", "--json", config / "config.json")
    assert as_input.returncode == 2 and "--json" in as_input.stderr
    assert (config / "config.json").read_text() == (TINY / "config.json").read_text()
    selections = tmp_path / "selections.json"  # a result glmkit wrote, named as this run's input too: kept
    selections.write_text("{}")
    mark_file(selections, "JSON result")
    marked_input = glmkit("parity", "--checkpoint", TINY, "--paths", "reference,train", "--replay-topk-from",
                          selections, "--json", selections)
    assert marked_input.returncode == 2 and "is this run's --replay-topk-from" in marked_input.stderr
    assert selections.read_text() == "{}"
    out = tmp_path / "check"
    out.mkdir()
    (out / "check.json").write_text("{}")
    foreign = glmkit("check", "--variant", "tiny", "--out", out)
    assert foreign.returncode == 2 and "not a check report glmkit wrote" in foreign.stderr
    assert (out / "check.json").read_text() == "{}"
    fresh = tmp_path / "fresh"  # a check that fails leaves no empty --out folder behind
    failed = glmkit("check", "--checkpoint", tmp_path / "nowhere", "--out", fresh)
    assert failed.returncode == 2 and not fresh.exists()


def test_launch_metrics_are_replaced_or_appended_only_when_glmkit_wrote_them(tmp_path):
    from glmkit.launch.jobs import _Store
    from glmkit.launch.run import _fresh

    rows = tmp_path / "data.jsonl"
    rows.write_text('{"prompt": "1+1=", "label": "2"}\n')  # JSON objects, but a dataset: never deleted
    with pytest.raises(ValueError, match="not a metrics file glmkit wrote"):
        _fresh(rows)
    with pytest.raises(ValueError, match="a follow appends to only those"):
        _Store(rows)
    assert rows.read_text() == '{"prompt": "1+1=", "label": "2"}\n'
    metrics = tmp_path / "m.jsonl"
    store = _Store(metrics)
    store.add([{"rollout/step": 0, "rollout/raw_reward": 0.5}])
    assert is_glmkit_file(metrics)
    assert _Store(metrics).known == store.known  # a re-attach continues it
    _fresh(metrics)
    assert not metrics.exists()


def test_a_second_follower_of_one_metrics_file_is_refused(tmp_path):
    from glmkit.launch.run import _owns_metrics

    @_owns_metrics
    def nested(*, metrics_out=None):  # the same file while this process holds it: refused, holder named
        with pytest.raises(ValueError, match=f"is in use by another glmkit run .*pid={os.getpid()}"):
            with RunLock(metrics_out, "--metrics-out"):
                pass
        return "held"

    assert nested(metrics_out=tmp_path / "m.jsonl") == "held"
    with RunLock(tmp_path / "m.jsonl", "--metrics-out"):
        with pytest.raises(ValueError, match="is in use by another glmkit run"):
            nested(metrics_out=tmp_path / "m.jsonl")


def test_a_capture_is_marked(tmp_path):
    import torch

    from glmkit.parity.dump import Capture, load_capture, save_capture

    cap = Capture(tensors={(0, "attn_out"): torch.ones(3, 2)}, input_ids=torch.arange(3), cu_seqlens=torch.tensor([0, 3]),
                  manifest={"path": "train"})
    save_capture(cap, tmp_path / "cap")
    marker = (tmp_path / "cap" / ".glmkit-output").read_text()
    assert marker.startswith("kind: parity capture\n")
    assert "entry: manifest.json\nentry: tensors.safetensors\n" in marker  # what --overwrite may later remove
    mask = os.umask(0o022)
    os.umask(mask)
    assert (tmp_path / "cap").stat().st_mode & 0o777 == 0o777 & ~mask        # the umask's modes, not 0700 / 0600
    assert (tmp_path / "cap" / "tensors.safetensors").stat().st_mode & 0o777 == 0o666 & ~mask
    assert torch.equal(load_capture(tmp_path / "cap").tensors[(0, "attn_out")], torch.ones(3, 2))


def test_outputs_are_checked_writable_and_named_before_any_work(tmp_path, monkeypatch):
    """An empty output path is bad input; a folder this process cannot write in is an environment
    error (exit 4) raised by the check that runs before the work, not after it. (Root writes
    anywhere, so the test asks os.access as a user without the right would get it answered.)"""
    from glmkit.outputs import check_dir_out, check_file_out

    for check in (check_file_out, check_dir_out):
        with pytest.raises(ValueError, match="--out is empty"):
            check("", "--out")
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != tmp_path)
    for check in (check_file_out, check_dir_out):
        with pytest.raises(PermissionError, match="cannot write in the folder"):
            check(tmp_path / "new" / "x", "--out")


def test_an_interrupted_replacement_is_finished_by_the_next_write(tmp_path, monkeypatch):
    """Hostile pass 6: `ckpt synth --overwrite` killed while deleting the old checkpoint left a visible,
    half-removed `ck.old-*` that nothing cleaned. The old target is now moved aside under a hidden
    `.ck.old-HOST-PID-*` name and deleted with its marker last, so what a kill leaves is still marked and
    the next write to `ck` removes it (once its process is gone), as it removes stale staging folders."""
    import shutil

    from glmkit.outputs import MARKER, move_into_place, staging_dir

    def write(content: str) -> Path:
        staged = staging_dir(tmp_path / "ck", "checkpoint")
        (staged / "weights.bin").write_text(content)
        (staged / "sub").mkdir()
        (staged / "sub" / "part").write_text(content)
        return staged

    move_into_place(write("one"), tmp_path / "ck")
    real_rmtree, cut = shutil.rmtree, []

    def killed_midway(path, *args, **kwargs):  # the process dies after deleting one entry
        cut.append(path)
        raise KeyboardInterrupt

    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        move_into_place(write("two"), tmp_path / "ck")
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    assert (tmp_path / "ck" / "weights.bin").read_text() == "two"
    (left,) = [p for p in tmp_path.iterdir() if ".old-" in p.name]
    assert left.name.startswith(f".ck.old-{socket.gethostname()}-{os.getpid()}-") and (left / MARKER).is_file()
    # a live process's leftover is kept; once that process is gone the next write to ck removes it
    move_into_place(write("three"), tmp_path / "ck")
    assert left.exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    as_dead = left.with_name(left.name.replace(f"-{os.getpid()}-", f"-{dead.stdout.strip()}-"))
    left.rename(as_dead)
    move_into_place(write("four"), tmp_path / "ck")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"] and (tmp_path / "ck" / "weights.bin").read_text() == "four"


def test_atomic_writes_never_go_through_a_planted_temporary(tmp_path, monkeypatch):
    """Hostile pass 7: markers, the latest-checkpoint marker and --resume's cut-back metrics were written
    through fixed (or pid-derived) temporary names, so a symbolic link planted at that name made glmkit
    overwrite its target. Temporaries are now random names created exclusively, never through a link."""
    from glmkit import report
    from glmkit.report import write_atomic

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    names = iter(["planted", "planted", "fresh"])
    monkeypatch.setattr(report.secrets, "token_hex", lambda n: next(names))
    (tmp_path / ".out.txt.planted.tmp").symlink_to(victim)
    write_atomic(tmp_path / "out.txt", "new")
    assert victim.read_text() == "precious" and (tmp_path / "out.txt").read_text() == "new"
    assert not (tmp_path / "out.txt").is_symlink() and (tmp_path / ".out.txt.planted.tmp").is_symlink()
    assert not (tmp_path / ".out.txt.fresh.tmp").exists()  # renamed into place


def test_a_symlink_loop_is_bad_input_and_a_notebook_without_a_kernel_runs(tmp_path):
    """Hostile pass 7: a loop of symbolic links as --out was exit 3 (Path.resolve raises RuntimeError),
    and `report` of a notebook whose metadata names no kernel was exit 3 (papermill's ValueError; then
    refused, and since pass 12 run as the Python notebook it is)."""
    import nbformat

    (tmp_path / "loop1").symlink_to(tmp_path / "loop2")
    (tmp_path / "loop2").symlink_to(tmp_path / "loop1")
    out = subprocess.run([sys.executable, "-m", "glmkit", "ckpt", "synth", "--variant", "tiny", "--out",
                          str(tmp_path / "loop1")], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 2 and "loop of symbolic links" in out.stderr and "Traceback" not in out.stderr, out.stderr
    notebook = tmp_path / "nokernel.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1", metadata={"tags": ["parameters"]})])
    nbformat.write(nb, str(notebook))
    out = subprocess.run([sys.executable, "-m", "glmkit", "report", str(notebook), "--out", str(tmp_path / "r")],
                         capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr
    assert (tmp_path / "r" / "nokernel.html").is_file()


def test_check_never_writes_into_its_checkpoint_and_a_failing_read_names_its_file(tmp_path):
    """Hostile pass 7: `check --out CKPT` wrote check.html / check.json into the checkpoint (a later
    `ckpt synth --overwrite` of it was then refused); `--prompt-data /proc/self/mem` failed with an
    Input/output error that named no file."""
    from glmkit.checkpoint import synth_checkpoint

    ckpt = synth_checkpoint("tiny", 0, tmp_path / "ck", progress=False)
    before = sorted(p.name for p in ckpt.iterdir())
    for out in (ckpt, ckpt / "report"):
        run = subprocess.run([sys.executable, "-m", "glmkit", "check", "--checkpoint", str(ckpt), "--out", str(out)],
                             capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert run.returncode == 2 and "is inside --checkpoint" in run.stderr, run.stderr
    assert sorted(p.name for p in ckpt.iterdir()) == before
    if os.path.exists("/proc/self/mem"):
        run = subprocess.run([sys.executable, "-m", "glmkit", "train", "--prompt-data", "/proc/self/mem",
                              "--num-rollout", "1", "--metrics-out", str(tmp_path / "m.jsonl")],
                             capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert run.returncode == 4 and "/proc/self/mem" in run.stderr, run.stderr


def test_an_output_name_too_long_for_glmkits_names_beside_it_is_refused_by_the_users_path(tmp_path, capsys):
    """Hostile pass 9: a 250-byte --out (which the file system takes) was refused naming glmkit's 263-byte
    lock file. Now the user's path is named with the room it lacks; a 200-byte name works."""
    from glmkit.cli import main

    long = tmp_path / ("n" * 250)
    assert main(["ckpt", "synth", "--variant", "tiny", "--out", str(long)]) == 2
    err = capsys.readouterr().err
    assert f"--out {long}: a name of 250 bytes leaves no room for the names glmkit writes beside it" in err
    assert err.count("\n") == 1 and list(tmp_path.iterdir()) == []
    assert main(["ckpt", "synth", "--variant", "tiny", "--out", str(tmp_path / ("n" * 200))]) == 0


def test_an_output_inside_another_runs_locked_output_is_refused_with_the_holder(tmp_path):
    """Hostile pass 10: while run A wrote --save s, run B with --save s/iter_0000001 --overwrite replaced
    A's save folder. An output inside a held output is refused, naming the holder, however the path is
    spelled (a link finds the same lock); a stale lock above does not stand in the way."""
    from glmkit.outputs import check_dir_out

    save = tmp_path / "s"
    (save / "iter_0000001").mkdir(parents=True)
    (tmp_path / "here").symlink_to(tmp_path)
    with RunLock(save, "--save"):
        for inner in (save / "iter_0000001", save / "iter_0000002" / "model", tmp_path / "here" / "s" / "x"):
            with pytest.raises(ValueError, match=f"is inside {save}, which another glmkit run is writing "
                                                 f"\\(pid={os.getpid()} host="):
                RunLock(inner, "--save").__enter__()
        with RunLock(tmp_path / "sibling", "--save"):  # beside it: free
            pass
    (tmp_path / ".s.glmkit-lock").write_text("pid=999999999 host=elsewhere\n")  # left by a run that died
    with RunLock(save / "iter_0000001", "--save"):
        pass
    # --overwrite of a directory reached through a symbolic link in its path is refused, as for files
    mark(save / "iter_0000001", "checkpoint")
    (save / "iter_0000001" / "model.safetensors").write_bytes(b"x")
    from glmkit.outputs import record_entries

    record_entries(save / "iter_0000001")
    with pytest.raises(ValueError, match="reached through a symbolic link; --overwrite replaces nothing through one"):
        check_dir_out(tmp_path / "here" / "s" / "iter_0000001", "--out", overwrite=True)
    assert check_dir_out(save / "iter_0000001", "--out", overwrite=True) == save / "iter_0000001"


def test_overwrite_refuses_a_marker_that_lists_nothing(tmp_path):
    """A marker without entry lines (glmkit before the lists, or forged by hand) would let --overwrite
    delete all the folder holds: refused, the folder untouched; a marker listing its entries is replaced."""
    from glmkit.outputs import check_dir_out, record_entries

    old = tmp_path / "old"
    old.mkdir()
    (old / ".glmkit-output").write_text("kind: checkpoint\n")
    (old / "thesis.tex").write_text("years of work")
    with pytest.raises(ValueError, match=r"old: its \.glmkit-output lists none of what the directory holds .*"
                                         r"remove it yourself or choose another directory"):
        check_dir_out(old, "--out", overwrite=True)
    assert (old / "thesis.tex").read_text() == "years of work"
    listed = tmp_path / "listed"
    listed.mkdir()
    mark(listed, "checkpoint")
    (listed / "model.safetensors").write_bytes(b"x")
    record_entries(listed)
    assert check_dir_out(listed, "--out", overwrite=True) == listed


def test_free_memory_is_what_the_processs_cgroup_still_allows(tmp_path):
    """Hostile pass 12: in a 3 GiB memory cgroup psutil reported the host's 22 GiB free, a sample
    needing 5.2 GiB passed the check and the kernel killed the process (137, no message). The room
    under the tightest limit of the cgroup and its ancestors counts (v1 and v2 layouts)."""
    from glmkit.bounds import cgroup_room

    def tree(lines, files):
        (tmp_path / "proc").write_text("\n".join(lines) + "\n")
        for name, text in files.items():
            (tmp_path / "sys" / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_path / "sys" / name).write_text(text)
        return cgroup_room(str(tmp_path / "proc"), str(tmp_path / "sys"))

    gib = 1 << 30
    # v1: the process's group has no limit of its own; its parent allows 3 GiB and uses 1 GiB
    assert tree(["4:memory:/jobs/run1", "0::/"], {
        "memory/jobs/run1/memory.limit_in_bytes": str(9223372036854771712),
        "memory/jobs/run1/memory.usage_in_bytes": str(gib),
        "memory/jobs/memory.limit_in_bytes": str(3 * gib), "memory/jobs/memory.usage_in_bytes": str(gib)}) == 2 * gib
    # v2: "max" is no limit; the tighter of two limits wins
    assert tree(["0::/a/b"], {"a/b/memory.max": str(4 * gib), "a/b/memory.current": str(3 * gib),
                              "a/memory.max": "max", "a/memory.current": "5"}) == gib
    assert tree(["0::/"], {"memory.max": "max", "memory.current": "5"}) is None  # no limit anywhere
    assert cgroup_room(str(tmp_path / "missing"), str(tmp_path / "sys")) is None


def test_a_full_disk_at_the_first_marker_leaves_no_lock_and_no_staging_folder(tmp_path, monkeypatch):
    """Hostile pass 12: out of disk while writing the metrics file's marker, `train` left its lock file
    (the next run took it over with a warning); while writing a staging folder's marker, `capture` left
    an empty unmarked folder that no later run would clean. Both are gone now."""
    import errno

    from glmkit import outputs
    from glmkit.rl import loop
    from glmkit.rl.loop import GRPOTrainer, TrainConfig

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    trainer = GRPOTrainer(TrainConfig(model_name="tiny", num_rollout=1, metrics_out=str(tmp_path / "m.jsonl"),
                                      progress=False))
    monkeypatch.setattr(loop, "mark_file", full)
    with pytest.raises(OSError, match="No space left"):
        trainer.run()
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither the lock nor a marker nor the file
    monkeypatch.setattr(outputs, "mark", full)
    with pytest.raises(OSError, match="No space left"):
        outputs.staging_dir(tmp_path / "cap", "parity capture")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_conflicting_train_options_and_an_empty_json_path_are_bad_input(tmp_path):
    """Hostile pass 12: `--data-parallel` with `--weight-update distributed` ended in exit 1 (a bare
    SystemExit), and `--json ''` was silently taken as no --json at all."""
    out = glmkit("train", "--data-parallel", "gloo", "--rollout-url", "http://127.0.0.1:1", "--weight-update",
                 "distributed", "--metrics-out", tmp_path / "m.jsonl")
    assert out.returncode == 2 and "glmkit train: error: --data-parallel and --weight-update distributed" in out.stderr
    out = glmkit("parity", "--checkpoint", ROOT / "glmkit/assets/tiny_start", "--json", "")
    assert out.returncode == 2 and "--json" in out.stderr and "empty path" in out.stderr, out.stderr


def test_an_output_in_a_folder_that_takes_no_files_names_its_flag():
    """Hostile pass 13: `--json /proc/self/x.json` said only "[Errno 2] No such file or directory:
    '/proc/N/.x.json.glmkit-lock'", a file the user never named. It is the environment's error (exit 4)
    naming the flag and the output. Since the review of pass 13: bad input (exit 2), as the same place is
    when a folder must be made there first."""
    with pytest.raises(ValueError, match=r"^--json /proc/self/x.json: no file can be made in /proc/\d+ "
                                         r"\(No such file or directory\); give a path in a writable folder$"):
        RunLock("/proc/self/x.json", "--json").__enter__()


def test_an_output_folder_that_takes_no_files_or_is_a_mount_point_is_named_before_work(tmp_path, monkeypatch):
    """Hostile pass 15: `train --save` on a read-only mount trained the whole run and failed at its first
    save (its metrics left beside no checkpoint); `ckpt synth --out` on a mount point did all the work
    and then failed to rename over it (EBUSY, exit 3). Both are named by check_dir_out, up front: the
    read-only folder as the environment's error (exit 4), the mount point as bad input (exit 2). (The
    file system's answers are stood in for: mounting needs root, and root writes anywhere.)"""
    import errno
    import os

    from glmkit.outputs import check_dir_out

    folder = tmp_path / "ro"
    folder.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if Path(p) == folder else real_access(p, mode))
    monkeypatch.setattr(os, "statvfs", lambda p: type("V", (), {"f_flag": os.ST_RDONLY})())
    with pytest.raises(OSError) as raised:
        check_dir_out(folder, "--save", whole=False)
    assert raised.value.errno == errno.EROFS and "--save" in str(raised.value) and raised.value.filename == str(folder)
    with pytest.raises(OSError, match="--out"):
        check_dir_out(folder / "new", "--out")  # written beside the target: its parent must take files
    monkeypatch.setattr(os, "access", real_access)
    assert check_dir_out(folder, "--save", whole=False) == folder
    monkeypatch.setattr(os.path, "ismount", lambda p: Path(p) == folder)
    with pytest.raises(ValueError, match=r"--out .*ro: is a mount point; .* give a folder inside it"):
        check_dir_out(folder, "--out")
    assert check_dir_out(folder / "inside", "--out") == folder / "inside"
