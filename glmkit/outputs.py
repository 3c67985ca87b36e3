"""Where glmkit writes: output paths checked before any work starts, the marker file that tells a
directory glmkit wrote from anyone else's, and the staging directories of atomic writes.

Rules:
- `--overwrite` replaces only a directory that carries the marker `.glmkit-output`, which glmkit writes
  into every checkpoint and capture directory it creates. Checkpoints written before the marker existed
  cannot be told from a transformers checkpoint by their contents, so they are refused: the user removes
  them (or adds the marker) themselves.
- A staging directory is `.NAME.tmp-HOST-PID-XXXXXXXX` beside the target NAME, marked as soon as it is
  made. Before the next write to the same target, marked staging directories of NAME are removed when
  they are stale: made on this host by a process that is no longer running, or (another host's,
  whose process cannot be checked) untouched for a day. A live concurrent write is never removed.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import tempfile
import time
from pathlib import Path

MARKER = ".glmkit-output"
STALE_ELSEWHERE_S = 24 * 3600  # another host's staging directory: stale when untouched this long
_STAGING = re.compile(r"\.(?P<name>.+)\.tmp-(?P<host>.+)-(?P<pid>\d+)-[a-z0-9_]{8}")


def mark(folder: Path, what: str) -> None:
    (Path(folder) / MARKER).write_text(f"glmkit {what}: glmkit --overwrite may replace this directory\n")


def is_glmkit_output(folder: Path) -> bool:
    return (Path(folder) / MARKER).is_file()


def _prefix(flag: str | None, path) -> str:
    return f"{flag} {path}" if flag else str(path)


def _check_ancestors(path: Path, flag: str | None) -> None:
    """The nearest existing ancestor of `path` must be a directory (it will be created below it)."""
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{_prefix(flag, path)}: {parent} is not a directory")
            return


def check_file_out(path, flag: str | None = None) -> Path:
    """An output file: not a directory, below a directory (or where one can be made)."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{_prefix(flag, path)}: is a directory; give a file path")
    _check_ancestors(path, flag)
    return path


def check_dir_out(path, flag: str | None = None, overwrite: bool | None = False, whole: bool = True) -> Path:
    """An output directory, as an absolute path (so `.` has a name and a parent).

    whole=True: the directory is written as a whole and renamed into place, so it must be absent, empty,
    or (overwrite=True) one glmkit wrote; overwrite=None: the command has no --overwrite.
    whole=False: files are written into it; it only has to be a directory (or absent)."""
    target = Path(os.path.abspath(path))
    if target.exists() and not target.is_dir():
        raise ValueError(f"{_prefix(flag, path)}: exists and is not a directory")
    _check_ancestors(target, flag)
    if not whole:
        return target
    if target.is_symlink():  # the swap would replace the link, not the directory it points to
        raise ValueError(f"{_prefix(flag, path)}: is a symbolic link; name the directory itself")
    # the swap renames the target away: never the directory we (or the shell) stand in, nor an ancestor
    real, cwd = target.resolve(), Path.cwd().resolve()
    if real == Path(real.anchor) or real == cwd or real in cwd.parents:
        raise ValueError(f"{_prefix(flag, path)}: is the current directory or contains it; name a new directory")
    if not target.exists() or not any(target.iterdir()):
        return target
    if not overwrite:
        hint = "choose a new or empty directory" if overwrite is None else "pass --overwrite to replace it"
        raise ValueError(f"{_prefix(flag, path)}: already exists and is not empty; {hint}")
    if not is_glmkit_output(target):
        raise ValueError(f"{_prefix(flag, path)}: --overwrite replaces only a directory glmkit wrote (one with a "
                         f"{MARKER} file), and this one has none (nor do those of glmkit versions before the marker); "
                         f"remove it yourself or choose another directory")
    return target


def _newest_change(folder: Path) -> float:
    times = [folder.stat().st_mtime]
    for entry in folder.iterdir():
        times.append(entry.lstat().st_mtime)
    return max(times)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    except (OverflowError, ValueError):  # not a PID this system can have: never treat it as gone
        return True
    return True


def is_stale_staging(folder: Path, name: str) -> bool:
    """Whether `folder` is a staging directory glmkit left beside `name` (see the module's rules)."""
    m = _STAGING.fullmatch(folder.name)
    if m is None or m["name"] != name or folder.is_symlink() or not is_glmkit_output(folder):
        return False
    if m["host"] == socket.gethostname():
        return not _running(int(m["pid"]))
    return time.time() - _newest_change(folder) > STALE_ELSEWHERE_S


def staging_dir(target: Path, what: str) -> Path:
    """A new, marked staging directory beside `target`, after removing stale ones of earlier writes to it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    for entry in target.parent.iterdir():
        try:
            if is_stale_staging(entry, target.name):
                shutil.rmtree(entry, ignore_errors=True)
        except OSError:  # it vanished or cannot be read: not ours to clean
            pass
    staged = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{socket.gethostname()}-{os.getpid()}-",
                                   dir=target.parent))
    mark(staged, what)
    return staged


def move_into_place(staged: Path, target: Path) -> None:
    """Swap the finished directory in; an old target is moved aside first and deleted last."""
    old = None
    if target.exists() or target.is_symlink():
        if target.is_dir() and not target.is_symlink() and not any(target.iterdir()):
            target.rmdir()
        else:
            old = Path(tempfile.mkdtemp(prefix=target.name + ".old-", dir=target.parent))
            old.rmdir()
            target.rename(old)
    staged.rename(target)
    if old is None:
        return
    if old.is_dir() and not old.is_symlink():
        shutil.rmtree(old)
    else:
        old.unlink()
