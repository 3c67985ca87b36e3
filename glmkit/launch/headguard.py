"""Keeps a local Ray head from outliving the process that started it.

    python -m glmkit.launch.headguard --parent PID --temp-dir DIR --log FILE -- ray start --head --block ...

`LocalHead.start` runs this guard as its child; the guard runs `ray start --block` as its own child and
notes every process that descends from it (raylet, GCS, dashboard, workers, a job's driver and what
that driver starts), since a process whose parent dies is re-parented out of the tree. It stops all of
them and removes the head's temp dir when any of these happens:
- the starter asks (SIGTERM / SIGINT to the guard: `LocalHead.stop`);
- the starter is gone however it ended (exit, exception, SIGKILL, a notebook kernel shut down or
  killed): the guard is re-parented, which it sees within a poll;
- the head itself exits.
Stopping: SIGTERM to every process it noted, then SIGKILL to those still alive three seconds later. A pid is only signalled while its start time is the one noted, so a
reused pid is never hit.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time

POLL_S = 0.25
GRACE_S = 3.0   # between SIGTERM and SIGKILL


def _descendants(root) -> dict:
    """{pid: create_time} of `root` and everything below it now."""
    import psutil

    found = {}
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return found
    for p in procs:
        try:
            found[p.pid] = p.create_time()
        except psutil.Error:
            pass
    return found


def _reap():
    """Collect adopted children that exited (a subreaper must, or they stay zombies)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _alive(noted: dict) -> list:
    """The noted processes still running with the start time noted (zombies count as gone)."""
    import psutil

    alive = []
    for pid, created in noted.items():
        try:
            p = psutil.Process(pid)
            if p.create_time() == created and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.Error:
            pass
    return alive


def _become_subreaper():
    """Linux: orphans of the head's processes (a double-forked child) are re-parented to this guard, not
    to init, so they stay in view. Elsewhere a no-op."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def guard(parent: int, temp_dir: str, log_path: str, argv: list[str], poll_s: float = POLL_S,
          grace_s: float = GRACE_S) -> int:
    """Run `argv` until told to stop, the parent is gone or it exits; then stop everything it started.
    The log stays behind only when the head ended by itself (the starter reads why, then removes it)."""
    import psutil

    stop = {"asked": False}

    def ask(signum, frame):
        stop["asked"] = True

    signal.signal(signal.SIGTERM, ask)
    signal.signal(signal.SIGINT, ask)
    _become_subreaper()
    with open(log_path, "ab") as log:
        head = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    me, noted = psutil.Process(), {}

    def note():  # everything below this guard: the head's tree and orphans re-parented here (a subreaper)
        noted.update(_descendants(me))
        noted.pop(me.pid, None)

    while not stop["asked"] and os.getppid() == parent and head.poll() is None:
        note()
        _reap()
        time.sleep(poll_s)
    note()
    ended_by_itself = head.poll() is not None
    # everything at once (Ray's own orderly stop takes ~15 s on a head with a job; this head is
    # throwaway, its temp dir goes too): SIGTERM, then SIGKILL for what is left after the grace period
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, grace_s)):
        note()  # what started since the last poll (a restarted worker)
        for p in _alive(noted):
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and _alive(noted):
            head.poll()  # reap it, or it would linger as a zombie of ours
            _reap()
            time.sleep(poll_s / 5)
    head.poll()
    shutil.rmtree(temp_dir, ignore_errors=True)
    if not ended_by_itself:
        try:
            os.unlink(log_path)
        except OSError:
            pass
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m glmkit.launch.headguard")
    parser.add_argument("--parent", type=int, required=True, help="the starter's pid: its end stops the head")
    parser.add_argument("--temp-dir", required=True, help="the head's temp dir, removed at the end")
    parser.add_argument("--log", required=True, help="the head's output (kept only when the head ended by itself)")
    parser.add_argument("--grace", type=float, default=GRACE_S, help="seconds between SIGTERM and SIGKILL")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- ray start --head --block ...")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command to guard (give it after --)")
    return guard(args.parent, args.temp_dir, args.log, command, grace_s=args.grace)


if __name__ == "__main__":
    sys.exit(main())
