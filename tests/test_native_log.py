"""torch's C++ stack traces in stderr, condensed to one line (glmkit/native_log.py)."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import textwrap

import pytest

from glmkit.native_log import KEEP_ENV, TraceFilter

# what c10d writes for one failed connect (paths and addresses shortened): a log line, the exception's
# origin, its frames, a blank line
C10D_LOG = (
    b"[W1207 20:37:03.937000264 TCPStore.cpp:340] [c10d] TCP client failed to connect/validate to host "
    b"127.0.0.1:29599 - retrying (try=0, timeout=3000ms, delay=3572ms): The client socket has timed out.\n"
    b"Exception raised from throwTimeoutError at /src/torch/csrc/distributed/c10d/socket.cpp:1030 "
    b"(most recent call first):\n"
    + b"".join(b"frame #%d: <unknown function> + 0x163b752 (0x7f531d63b752 in libtorch_cpu.so)\n" % i
               for i in range(11))
    + b"<omitting python frames>\n"
    b"frame #30: __libc_start_main + 0x85 (0x7f5332e45305 in /lib/x86_64-linux-gnu/libc.so.6)\n"
    b"\n")
SUMMARY = f"  (torch's C++ stack trace, 14 lines, left out; {KEEP_ENV}=1 keeps it)\n".encode()


def filtered(data: bytes, cuts) -> bytes:
    condense, out, start = TraceFilter(), [], 0
    for cut in sorted(cuts) + [len(data)]:
        out.append(condense.feed(data[start:cut]))
        start = cut
    return b"".join(out) + condense.close()


@pytest.mark.parametrize("seed", range(20))
def test_frames_become_one_line_however_the_bytes_arrive(seed):
    rng = random.Random(seed)
    data = b"serving on port 1\n" + C10D_LOG + b"INFO: 400 Bad Request\n" + C10D_LOG + b"\rloading 50%"
    cuts = rng.sample(range(1, len(data)), rng.randint(0, 40))
    expected = (b"serving on port 1\n" + C10D_LOG.splitlines(keepends=True)[0] + SUMMARY + b"INFO: 400 Bad Request\n"
                + C10D_LOG.splitlines(keepends=True)[0] + SUMMARY + b"\rloading 50%")
    assert filtered(data, cuts) == expected


def test_everything_else_passes_at_once_and_unchanged():
    """A progress bar's partial line is shown as it comes, not held for a newline; a Python traceback,
    a line that merely mentions frames, and a trace cut off by the end of the stream are all kept or
    summarised, never lost."""
    condense = TraceFilter()
    assert condense.feed(b"\rloading  10%") == b"\rloading  10%"
    assert condense.feed(b"\rloading  20%") == b"\rloading  20%"
    python = b'Traceback (most recent call last):\n  File "x.py", line 1\nframe #1 of a video\nValueError: x\n'
    assert condense.feed(python) == python
    assert condense.feed(b"Exc") == b""  # may be the start of a trace: held
    assert condense.feed(b"ellent\n") == b"Excellent\n"
    cut_short = TraceFilter()
    assert cut_short.feed(C10D_LOG[:C10D_LOG.index(b"frame #3:")]) == C10D_LOG.splitlines(keepends=True)[0]
    assert cut_short.close() == f"  (torch's C++ stack trace, 4 lines, left out; {KEEP_ENV}=1 keeps it)\n".encode()


RENDEZVOUS_NOBODY_HOSTS = textwrap.dedent("""
    import sys
    from glmkit import native_log
    from glmkit.serve.update_group import new_named_group
    if sys.argv[2] == "cli":
        native_log.allow()  # as glmkit's CLI does
    try:
        new_named_group("gloo", "127.0.0.1", int(sys.argv[1]), 2, 1, "g", timeout_s=1)
    except Exception as err:
        print("answered:", type(err).__name__, err, file=sys.stderr)
""")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("keep, caller", [(False, "cli"), (True, "cli"), (False, "library")])
def test_a_failed_rendezvous_leaves_one_line_per_c10d_message(keep, caller):
    """Hostile pass 12 (F09): a weights-update group whose trainer never came printed ~39 lines of C++
    frames. The same process with GLMKIT_NATIVE_TRACES=1 shows them, so the filter is what removes them;
    so does a process that calls glmkit as a library (its stderr is its own: nothing is rerouted)."""
    env = {**os.environ, KEEP_ENV: "1" if keep else "0"}
    run = subprocess.run([sys.executable, "-c", RENDEZVOUS_NOBODY_HOSTS, str(free_port()), caller],
                         capture_output=True, text=True, timeout=120, env=env)
    keep = keep or caller == "library"
    assert run.returncode == 0 and "answered: DistNetworkError" in run.stderr, run.stderr[-3000:]
    assert "[c10d]" in run.stderr  # torch's own message lines stay
    if keep:
        assert "frame #" in run.stderr and "left out" not in run.stderr
    else:
        assert "frame #" not in run.stderr and "Exception raised from" not in run.stderr, run.stderr[-3000:]
        assert "(torch's C++ stack trace, " in run.stderr and f"{KEEP_ENV}=1 keeps it)" in run.stderr


def test_what_a_dying_process_writes_still_gets_out():
    """The filter is a process of its own: a process that aborts right after writing (as a C++
    `terminate` does) loses none of its last lines, and the filter leaves when its writer is gone."""
    code = ("import os; from glmkit.native_log import allow, condense_native_traces\n"
            "allow(); assert condense_native_traces()\n"
            "os.write(2, b'last words\\n' * 2000); os.abort()")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.returncode == -6 and run.stderr == "last words\n" * 2000
