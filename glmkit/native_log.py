"""torch's C++ stack traces, condensed to one line in this process's stderr.

torch.distributed's C++ side (c10d) logs every failed connect, listen or rendezvous with the C++
exception's whole backtrace: an "Exception raised from ..." line and some 17 `frame #N: ...` lines per
attempt, written by C++ straight to file descriptor 2. Python's `sys.stderr` never sees them, and
`TORCH_CPP_LOG_LEVEL` can only drop such a message together with its reason. The reason then reaches
Python as the exception glmkit answers with, so the frames say nothing a user can act on.

`condense_native_traces()` routes descriptor 2 through a small filter process that passes every byte
on at once, except those frames, which become one line saying how many were left out. It does so only
in a process that `allow()`ed it, which glmkit's CLI does: a library call (glmkit's client inside
someone's trainer, a notebook) leaves the host process's stderr as it is. It is a
separate process so that whatever this one writes as it dies (an abort's last words, faulthandler's
dump) still gets out, and it leaves when the last writer closes its end. `GLMKIT_NATIVE_TRACES=1`
keeps the frames (nothing is filtered).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

KEEP_ENV = "GLMKIT_NATIVE_TRACES"
TRACE_START = b"Exception raised from "
TRACE_LINES = (b"frame #", b"<omitting python frames>")

_lock = threading.Lock()
_installed = False
_allowed = False


def allow() -> None:
    """Let this process condense its native traces once it forms a process group (glmkit's CLI: the
    process is glmkit's own)."""
    global _allowed
    _allowed = True


def condense_native_traces() -> bool:
    """Descriptor 2 through the filter from now on (once per process, where `allow()`ed) -> whether it is."""
    global _installed
    if not _allowed or os.environ.get(KEEP_ENV) == "1":
        return False
    with _lock:
        if _installed:
            return True
        try:
            target = os.dup(2)
        except OSError:  # no stderr at all: nothing to condense
            return False
        read_end, write_end = os.pipe()  # both not inheritable: the filter sees the end once this process closes it
        try:
            # its own session: a terminal's Ctrl-C or a launcher's signal to this process group must not
            # stop the filter before it has passed on what the dying process wrote. posix_spawn, not
            # Popen: the filter outlives every Popen object (which would warn that it still runs).
            os.posix_spawn(sys.executable, [sys.executable, "-m", "glmkit.native_log"], _child_env(),
                           file_actions=[(os.POSIX_SPAWN_DUP2, read_end, 0), (os.POSIX_SPAWN_DUP2, target, 1),
                                         (os.POSIX_SPAWN_OPEN, 2, os.devnull, os.O_WRONLY, 0)], setsid=True)
        except (OSError, NotImplementedError):  # (a platform without posix_spawn's setsid)
            os.close(write_end)
            return False
        finally:
            os.close(read_end)
            os.close(target)
        try:
            sys.stderr.flush()
        except (AttributeError, OSError, ValueError):
            pass
        os.dup2(write_end, 2)
        os.close(write_end)
        _installed = True
        return True


def _child_env() -> dict:
    """This environment, with the folder glmkit was imported from first on the filter's path."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": here + (os.pathsep + path if path else "")}


class TraceFilter:
    """Bytes in, bytes out: everything but C++ backtrace lines, each backtrace replaced by one line.
    A line is held back only while it could still turn out to be part of a backtrace."""

    def __init__(self):
        self.pending = b""
        self.dropped = 0  # lines of the backtrace being left out; 0 outside one

    def feed(self, data: bytes) -> bytes:
        out = []
        self.pending += data
        while True:
            end = self.pending.find(b"\n")
            if end < 0:
                break
            line, self.pending = self.pending[:end + 1], self.pending[end + 1:]
            out.append(self._line(line))
        if self.pending and not self._may_drop(self.pending):
            out.append(self._line(self.pending))
            self.pending = b""
        return b"".join(out)

    def close(self) -> bytes:
        tail = self._line(self.pending) if self.pending else b""
        self.pending = b""
        return tail + self._summary()

    def _may_drop(self, partial: bytes) -> bool:
        markers = TRACE_LINES if self.dropped else (TRACE_START,)
        return any(m.startswith(partial[:len(m)]) for m in markers)

    def _line(self, line: bytes) -> bytes:
        if line.startswith(TRACE_START) or (self.dropped and line.startswith(TRACE_LINES)):
            self.dropped += 1
            return b""
        if self.dropped and line.strip() == b"":  # the blank line that closes a backtrace
            return self._summary()
        return self._summary() + line

    def _summary(self) -> bytes:
        if not self.dropped:
            return b""
        text = f"  (torch's C++ stack trace, {self.dropped} lines, left out; {KEEP_ENV}=1 keeps it)\n"
        self.dropped = 0
        return text.encode()


def run_filter(source: int = 0, sink: int = 1) -> None:
    """The filter process: `source` to `sink` until every writer has closed `source`."""
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    condense = TraceFilter()
    while True:
        try:
            data = os.read(source, 1 << 16)
        except InterruptedError:
            continue
        out = condense.feed(data) if data else condense.close()
        _write_all(sink, out)
        if not data:
            return


def _write_all(fd: int, data: bytes) -> None:
    while data:
        try:
            data = data[os.write(fd, data):]
        except InterruptedError:
            continue
        except OSError:  # the reader of stderr went away: nothing more can be shown
            return


if __name__ == "__main__":
    run_filter()
