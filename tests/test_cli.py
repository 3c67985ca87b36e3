"""The `glmkit` command line as a user runs it (subprocesses, real files)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def glmkit(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "glmkit", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd, timeout=600)


def test_help_lists_subcommands():
    out = glmkit("--help")
    assert out.returncode == 0
    for command in ("check", "ckpt", "variants"):
        assert command in out.stdout
    ckpt = glmkit("ckpt", "--help")
    for action in ("synth", "slice", "info"):
        assert action in ckpt.stdout


def test_check_on_tiny_writes_a_passing_report(tmp_path):
    out = glmkit("check", "--variant", "tiny", "--out", tmp_path / "report")
    assert out.returncode == 0, out.stderr
    assert "verdict: pass" in out.stdout
    data = json.loads((tmp_path / "report" / "check.json").read_text())
    assert data["verdict"] == "pass" and len(data["checks"]) == 8
    assert all(c["pass"] for c in data["checks"])
    page = (tmp_path / "report" / "check.html").read_text()
    assert "verdict: PASS" in page and page.count("data:image/png;base64,") == 2
    assert "version: torch" in page


def test_check_verdict_fails_when_a_path_is_wrong(tmp_path, monkeypatch):
    """The check can fail: with glmkit's Sinkhorn cut to one pass (a plausible porting slip), every
    comparison against the reference leaves tolerance and the verdict is fail."""
    from glmkit import check
    from glmkit.model import mhc

    real = mhc.sinkhorn
    monkeypatch.setattr(mhc, "sinkhorn", lambda comb, iters, eps: real(comb, 1, eps))
    result = check.run_check(check.CheckSettings(decode_steps=4), work_dir=tmp_path)
    assert result["verdict"] == "fail"
    assert not any(c["pass"] for c in result["checks"] if c["name"].startswith("reference"))


def test_synth_slice_info_roundtrip(tmp_path):
    src = tmp_path / "six"
    # a 6-layer tiny-width checkpoint is not a registered variant; synthesise tiny and slice to 2
    assert glmkit("ckpt", "synth", "--variant", "tiny", "--seed", "3", "--out", src).returncode == 0
    out = glmkit("ckpt", "slice", "--src", src, "--layers", "2", "--out", tmp_path / "two")
    assert out.returncode == 0, out.stderr
    info = glmkit("ckpt", "info", tmp_path / "two")
    assert info.returncode == 0 and "2 layers (2 KDA + 0 DSA)" in info.stdout


@pytest.mark.parametrize("args, message", [
    (["ckpt", "info", "/nonexistent/ckpt"], "/nonexistent/ckpt"),
    (["check", "--checkpoint", "/nonexistent/ckpt"], "/nonexistent/ckpt"),
    (["ckpt", "slice", "--src", "/nonexistent/ckpt", "--layers", "4", "--out", "/tmp/x"], "/nonexistent/ckpt"),
])
def test_bad_input_exits_2_with_one_line(args, message):
    out = glmkit(*args)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0], out.stderr


def test_existing_output_is_not_overwritten(tmp_path):
    target = tmp_path / "ckpt"
    assert glmkit("ckpt", "synth", "--variant", "tiny", "--out", target).returncode == 0
    again = glmkit("ckpt", "synth", "--variant", "tiny", "--seed", "1", "--out", target)
    assert again.returncode == 2 and str(target) in again.stderr


def test_an_in_process_call_leaves_the_callers_sigterm_handler_and_stderr(tmp_path, capsys, monkeypatch):
    """The review of pass 12: main() called in-process (a test, a notebook) kept SIGTERM ignored after a
    stop and could reroute the caller's stderr. In-process it restores the caller's handler, after a
    failure and after its own SIGTERM stop, and leaves native-trace condensing to glmkit's command line."""
    import signal

    import glmkit.commands.ckpt as ckpt_commands
    from glmkit import native_log
    from glmkit.cli import EXIT_TERMINATED, main

    def mine(signum, frame):
        raise AssertionError("not expected to run")

    def stopped(args):  # as _terminate raises it, and with the stopping handler in place
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)

    before = signal.signal(signal.SIGTERM, mine)
    try:
        assert main(["ckpt", "info", str(tmp_path / "missing")]) == 2
        assert signal.getsignal(signal.SIGTERM) is mine
        monkeypatch.setattr(ckpt_commands, "cmd_ckpt_info", stopped)
        assert main(["ckpt", "info", str(tmp_path / "missing")]) == EXIT_TERMINATED
        assert signal.getsignal(signal.SIGTERM) is mine
    finally:
        signal.signal(signal.SIGTERM, before)
    assert not native_log._allowed
    assert "terminated" in capsys.readouterr().err
