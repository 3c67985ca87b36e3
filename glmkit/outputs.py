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
- A marked target being replaced is first renamed `.NAME.old-HOST-PID-XXXXXXXX` and deleted with its
  marker last, so a deletion cut short leaves a folder the next write to NAME recognises and finishes.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import time
from pathlib import Path

from glmkit.inputs import not_a_file
from glmkit.report import write_atomic

MARKER = ".glmkit-output"
STALE_ELSEWHERE_S = 24 * 3600  # another host's staging directory: stale when untouched this long
# a staging directory (.NAME.tmp-...) or an old target moved aside to be deleted (.NAME.old-...)
_STAGING = re.compile(r"\.(?P<name>.+)\.(?:tmp|old)-(?P<host>.+)-(?P<pid>\d+)-[a-z0-9_]{8}")


# markers hold file names and the command line, which may carry bytes that are not UTF-8 (surrogate-escaped
# by Python): written and read back as the same bytes
_NAMES = {"encoding": "utf-8", "errors": "surrogateescape"}


def _writer() -> str:
    from glmkit import __version__

    command = " ".join(Path(a).name if i == 0 else a for i, a in enumerate(sys.argv[:3]))
    return f"glmkit {__version__}, written by `{command}` (pid {os.getpid()} on {socket.gethostname()})"


def _write_marker(path: Path, text: str) -> None:
    """Whole or not at all (a temporary name, then a rename): a marker cut by a full disk would claim
    nothing, and the output it stands beside could then never be replaced by --overwrite."""
    write_atomic(path, text, **_NAMES)  # a fresh, exclusively created temporary: never through a planted link


def mark(folder: Path, what: str) -> None:
    """The marker of a directory glmkit wrote: its kind, glmkit's version and the command that wrote it."""
    _write_marker(Path(folder) / MARKER, f"kind: {what}\n{_writer()}\nglmkit --overwrite may replace this directory\n")


def _is_marker(path: Path) -> bool:
    """A marker glmkit wrote: a regular file (not a link) that begins as `mark` writes one. An empty or
    foreign file of that name claims nothing (a run cut short by a full disk can leave one empty)."""
    try:
        if not Path(path).is_file() or Path(path).is_symlink():
            return False
        with open(path, "rb") as f:
            return f.read(6) == b"kind: "
    except OSError:
        return False


def is_glmkit_output(folder: Path) -> bool:
    return _is_marker(Path(folder) / MARKER)


def record_entries(folder: Path) -> None:
    """Add the names of what a finished output directory holds to its marker: --overwrite later
    removes it only if nothing else was put there since."""
    names = sorted(p.name for p in Path(folder).iterdir() if p.name != MARKER)
    with open(Path(folder) / MARKER, "a", **_NAMES) as f:
        f.write("".join(f"entry: {name}\n" for name in names))


def recorded_entries(folder: Path) -> set[str]:
    """The names a marked directory's marker lists as glmkit's (none: a marker of a glmkit version
    before the lists, or one written by hand)."""
    lines = (Path(folder) / MARKER).read_text(**_NAMES).splitlines()
    return {line[len("entry: "):] for line in lines if line.startswith("entry: ")}


def foreign_entries(folder: Path) -> list[str]:
    """What a marked directory holds that glmkit did not record writing ([] for a marker of a glmkit
    version that recorded nothing: check_dir_out refuses to replace such a folder)."""
    recorded = recorded_entries(folder)
    if not recorded:
        return []
    return sorted(p.name for p in Path(folder).iterdir() if p.name != MARKER and p.name not in recorded)


def added_entries(folder: Path, prefix: str = "") -> list[str]:
    """What was put into a marked directory after glmkit wrote it, at any depth: its own unrecorded
    entries, and those of the marked directories it holds (a checkpoint's model/ keeps its own list)."""
    folder = Path(folder)
    foreign = foreign_entries(folder)
    found = [prefix + name for name in foreign]
    for entry in sorted(folder.iterdir()):  # a recorded subdirectory may have gained files of its own
        if entry.name not in foreign and entry.is_dir() and not entry.is_symlink() and is_glmkit_output(entry):
            found += added_entries(entry, f"{prefix}{entry.name}/")
    return found


def refuse_package_paths(path, flag: str) -> None:
    """glmkit's own installed files (its shipped checkpoint and data) are never an output."""
    package = Path(__file__).resolve().parent
    target = Path(os.path.abspath(path))
    if target == package or package in target.parents or package in target.resolve().parents:
        raise ValueError(f"{flag} {path}: inside glmkit's own package ({package}); outputs never go there "
                         f"(copy what you need elsewhere)")


def file_marker(path: Path) -> Path:
    """A file glmkit writes (a metrics stream) is marked by `.NAME.glmkit-output` beside it."""
    path = Path(path)
    return path.with_name(f".{path.name}{MARKER}")


def mark_file(path: Path, what: str) -> None:
    _write_marker(file_marker(path), f"kind: {what}\n{_writer()}\nglmkit --overwrite may replace {Path(path).name}\n")


def is_glmkit_file(path: Path) -> bool:
    return _is_marker(file_marker(path))


def through_link(path: Path) -> bool:
    """Whether `path` or any folder above it is a symbolic link."""
    path = Path(os.path.abspath(path))
    return any(p.is_symlink() for p in (path, *path.parents))


def refuse_replacing(path: Path, flag: str, what: str, inputs: dict | None = None,
                     action: str = "--overwrite replaces") -> None:
    """Checks before --overwrite removes the file `path` (or --resume writes into it, `action` saying
    which): it must be a regular file glmkit marked as `what`, reached through no symbolic link, and
    none of this command's inputs. One-line refusals."""
    path = Path(path)
    for name, given in (inputs or {}).items():
        if given and os.path.exists(given) and os.path.exists(path) and os.path.samefile(given, path):
            raise ValueError(f"{flag} {path} is this run's {name}: it is never written; choose another {flag}")
    if through_link(path):
        raise ValueError(f"{flag} {path}: reached through a symbolic link; {action} nothing through one "
                         f"(name the file itself)")
    if not path.is_file():
        raise ValueError(f"{flag} {path}: not a regular file; {action} only files glmkit wrote")
    if not is_glmkit_file(path):
        raise ValueError(f"{flag} {path}: not a {what} glmkit wrote (no {file_marker(path).name} beside it); "
                         f"{action} only those: remove it yourself or choose another {flag}")


def claim_file(path, flag: str, what: str, inputs: dict | None = None, nested: bool = False) -> Path:
    """An output file a command (re)writes whole, checked before any work: not a directory, none of
    the command's inputs (with `nested`, not inside an input folder either), and when something is
    there already, a `what` glmkit marked, reached through no link (so a re-run replaces its own result
    and nothing else)."""
    path = check_file_out(path, flag)
    refuse_input_as_output(path, flag, inputs or {}, nested)
    if path.exists() or path.is_symlink():
        refuse_replacing(path, flag, what, inputs, action="glmkit replaces")
    return path


def write_marked(path, data: bytes | str, what: str) -> Path:
    """Write `path` atomically (a reader never sees half of it) and mark it as glmkit's `what`."""
    from glmkit.report import write_atomic

    write_atomic(Path(path), data)
    mark_file(path, what)
    return Path(path)


def refuse_input_as_output(path: Path, flag: str, inputs: dict, nested: bool = False) -> None:
    """An output path must not be one of the same command's inputs (same file, or a folder holding it);
    with `nested`, not inside an input folder either (a checkpoint written into the one it is made from)."""
    target = Path(os.path.abspath(path))
    for name, given in inputs.items():
        if not given:
            continue
        source = Path(os.path.abspath(given))
        if target == source or (os.path.exists(target) and os.path.exists(source) and os.path.samefile(target, source)):
            raise ValueError(f"{flag} {path} is this run's {name}; an output never replaces an input")
        if target in source.parents or target.resolve() in source.resolve().parents:
            raise ValueError(f"{flag} {path} holds this run's {name} ({given}); an output never replaces an input")
        if nested and (source in target.parents or source.resolve() in target.resolve().parents):
            raise ValueError(f"{flag} {path} is inside this run's {name} ({given}); write it beside its input, "
                             f"not into it")


def _prefix(flag: str | None, path) -> str:
    return f"{flag} {path}" if flag else str(path)


def _check_ancestors(path: Path, flag: str | None) -> None:
    """The nearest existing ancestor of `path` must be a directory this process may write in (checked
    before the work, not after it)."""
    import errno

    for parent in Path(os.path.abspath(path)).parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{_prefix(flag, path)}: {parent} is not a directory")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise PermissionError(errno.EACCES, f"{flag or 'output'}: cannot write in the folder", str(parent))
            return


def check_file_out(path, flag: str | None = None) -> Path:
    """An output file: not a directory, below a directory (or where one can be made)."""
    if str(path) == "":
        raise ValueError(f"{flag or 'the output path'} is empty; name a file")
    if str(path) == "-":
        raise ValueError(f"{flag or 'the output path'} -: glmkit writes to a file, not to standard output; name a file")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{_prefix(flag, path)}: is a directory; give a file path")
    if path.exists() and (why := not_a_file(path)) is not None:  # a pipe or a device is nobody's output file
        raise ValueError(f"{_prefix(flag, path)}: {why}; give the path of a regular file")
    _check_ancestors(path, flag)
    return path


def _refuse_unwritable(folder: Path | None, flag: str | None, given) -> None:
    """A folder outputs go into that takes no new file (a read-only file system, no write permission) is
    the environment's error, named before any work rather than after it."""
    import errno

    if folder is None or os.access(folder, os.W_OK | os.X_OK):
        return
    try:
        read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
    except OSError:
        read_only = False
    code = errno.EROFS if read_only else errno.EACCES
    raise OSError(code, f"{_prefix(flag, given)}: {os.strerror(code).lower()} where it would be written", str(folder))


def check_dir_out(path, flag: str | None = None, overwrite: bool | None = False, whole: bool = True) -> Path:
    """An output directory, as an absolute path (so `.` has a name and a parent).

    whole=True: the directory is written as a whole and renamed into place, so it must be absent, empty,
    or (overwrite=True) one glmkit wrote; overwrite=None: the command has no --overwrite.
    whole=False: files are written into it; it only has to be a directory (or absent)."""
    if str(path) == "":
        raise ValueError(f"{flag or 'the output path'} is empty; name a directory")
    target = Path(os.path.abspath(path))
    if target.exists() and not target.is_dir():
        raise ValueError(f"{_prefix(flag, path)}: exists and is not a directory")
    _check_ancestors(target, flag)
    if not whole:
        _refuse_unwritable(target if target.is_dir() else None, flag, path)
        return target
    if target.is_symlink():  # the swap would replace the link, not the directory it points to
        raise ValueError(f"{_prefix(flag, path)}: is a symbolic link; name the directory itself")
    if target.is_dir() and os.path.ismount(target):  # nothing can be renamed over a mount point (EBUSY)
        raise ValueError(f"{_prefix(flag, path)}: is a mount point; glmkit writes a new folder beside the target and "
                         f"renames it into place, which a mount point cannot take: give a folder inside it")
    _refuse_unwritable(target.parent if target.parent.is_dir() else None, flag, path)
    # the swap renames the target away: never the directory we (or the shell) stand in, nor an ancestor
    real, cwd = target.resolve(), Path.cwd().resolve()
    if real == Path(real.anchor) or real == cwd or real in cwd.parents:
        raise ValueError(f"{_prefix(flag, path)}: is the current directory or contains it; name a new directory")
    if not target.exists() or not any(target.iterdir()):
        return target
    if not overwrite:
        hint = "choose a new or empty directory" if overwrite is None else "pass --overwrite to replace it"
        raise ValueError(f"{_prefix(flag, path)}: already exists and is not empty; {hint}")
    if through_link(target):  # as for files: a link in the path may lead anywhere
        raise ValueError(f"{_prefix(flag, path)}: reached through a symbolic link; --overwrite replaces nothing "
                         f"through one (name the directory by its real path, {target.resolve()})")
    if not is_glmkit_output(target):
        raise ValueError(f"{_prefix(flag, path)}: --overwrite replaces only a directory glmkit wrote (one with a "
                         f"{MARKER} file), and this one has none (nor do those of glmkit versions before the marker); "
                         f"remove it yourself or choose another directory")
    if not recorded_entries(target):  # everything in it would go, and nothing says glmkit put it there
        raise ValueError(f"{_prefix(flag, path)}: its {MARKER} lists none of what the directory holds (a marker of a "
                         f"glmkit version before the lists, or one written by hand), so --overwrite cannot tell "
                         f"glmkit's files from others there; remove it yourself or choose another directory")
    foreign = foreign_entries(target)
    if foreign:
        raise ValueError(f"{_prefix(flag, path)}: holds {', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''} "
                         f"that glmkit did not write there; --overwrite would delete them: move them out or choose "
                         f"another directory")
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


@contextlib.contextmanager
def removed_if_left_empty(folder):
    """A command's output folder that it creates: if the command ends (done, refused, failed or
    interrupted) with nothing in it, the folder goes too, so no empty output looks like a result."""
    folder = Path(folder)
    made = not folder.exists()
    try:
        yield folder
    finally:
        if made and folder.is_dir() and not folder.is_symlink() and not any(folder.iterdir()):
            folder.rmdir()


def _umask() -> int:
    mask = os.umask(0o022)  # reading it means setting it: set back at once
    os.umask(mask)
    return mask


def usual_modes(folder: Path) -> None:
    """The files a finished output folder holds get the modes the umask gives new files (some writers,
    safetensors' among them, create theirs 0600)."""
    mode = 0o666 & ~_umask()
    for entry in Path(folder).rglob("*"):
        if entry.is_file() and not entry.is_symlink():
            entry.chmod(mode)


def _staging_prefix(target: Path) -> str:
    return f".{target.name}.tmp-{socket.gethostname()}-{os.getpid()}-"


def refuse_name_without_room(target: Path, flag: str | None = None) -> None:
    """Beside an output NAME glmkit makes `.NAME.glmkit-lock` and a staging `.NAME.tmp-HOST-PID-XXXXXXXX`:
    a NAME the file system takes but those not (a 250-byte name) is refused naming the user's path."""
    target = Path(target)
    extra = len(os.fsencode(_staging_prefix(target))) + 8 - len(os.fsencode(target.name))
    parent = next((p for p in (target.parent, *target.parent.parents) if p.exists()), Path("/"))
    try:
        longest = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError, AttributeError):
        longest = 255
    if len(os.fsencode(target.name)) + extra > longest:
        raise ValueError(f"{_prefix(flag, target)}: a name of {len(os.fsencode(target.name))} bytes leaves no room "
                         f"for the names glmkit writes beside it ({extra} bytes more; the file system allows "
                         f"{longest}); use a shorter name")


def make_folder(folder: Path, flag: str | None, given=None) -> None:
    """`folder` and its parents made for the output `flag` names (`given`, as the user wrote it). A place
    no folder can be made in (a file on the way, /proc, /sys) is bad input naming the flag; a full or
    read-only disk, or a permission, stays the environment's error."""
    import errno

    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as err:
        if err.errno not in (errno.ENOENT, errno.ENOTDIR, errno.EEXIST):
            raise
        where = f"{flag} {given if given is not None else folder}" if flag else str(given or folder)
        raise ValueError(f"{where}: no folder can be made at {err.filename or folder} ({err.strerror}); give a "
                         f"path in a writable folder") from None


def staging_dir(target: Path, what: str) -> Path:
    """A new, marked staging directory beside `target`, after removing stale ones of earlier writes to it."""
    target.parent.mkdir(parents=True, exist_ok=True)
    for entry in target.parent.iterdir():
        try:
            if is_stale_staging(entry, target.name):
                remove_marker_last(entry)
        except OSError:  # it vanished or cannot be read: not ours to clean
            pass
    prefix = _staging_prefix(target)
    refuse_name_without_room(target)
    staged = Path(tempfile.mkdtemp(prefix=prefix, dir=target.parent))
    try:
        staged.chmod(0o777 & ~_umask())  # a usual folder's mode, not mkdtemp's 0700
        mark(staged, what)
    except BaseException:  # a full disk: the empty, unmarked folder would stay, since only marked ones are cleaned
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return staged


def move_into_place(staged: Path, target: Path) -> None:
    """Swap the finished directory in (its marker then lists what it holds); an old target is moved
    aside first and deleted last."""
    if is_glmkit_output(staged):
        record_entries(staged)
    usual_modes(staged)
    old = None
    if target.exists() or target.is_symlink():
        if target.is_dir() and not target.is_symlink() and not any(target.iterdir()):
            target.rmdir()
        else:
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-{socket.gethostname()}-{os.getpid()}-",
                                        dir=target.parent))
            old.rmdir()
            target.rename(old)
    staged.rename(target)
    if old is None:
        return
    if old.is_dir() and not old.is_symlink():
        remove_marker_last(old)
    else:
        old.unlink()


def remove_marker_last(folder: Path) -> None:
    """Delete a marked folder with its marker last: cut short, it is still recognisably glmkit's."""
    for entry in folder.iterdir():
        if entry.name == MARKER:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    with contextlib.suppress(FileNotFoundError):
        (folder / MARKER).unlink()
    folder.rmdir()


LOCK_TEXT_CHARS = 200  # a lock file holds one short line: pid, host, start time


class RunLock:
    """An advisory lock on an output (a file or a directory) while a command writes it:
    `.NAME.glmkit-lock` beside it, held with flock and naming its holder (pid, host, start time).
    A second writer is refused with the holder named. A lock file left by a process that died (flock
    free, and its pid on this host gone) is taken over with a warning; one of another host, whose
    process cannot be checked, is refused until its holder ends or a user removes the file."""

    def __init__(self, target, flag: str, shown=None):
        """`shown`: the path the user gave for `flag` where the locked output is a name inside it
        (`check --out DIR` locks DIR/check): messages name what was given."""
        # one lock per output, however its path is spelled: a link to the same folder finds the same lock
        self.given, self.flag = target, flag
        self.shown = target if shown is None else shown
        self.target = Path(os.path.realpath(os.path.abspath(target)))
        self.path = self.target.with_name(f".{self.target.name}.glmkit-lock")
        self.handle = None

    def _open(self):
        """The lock file, opened without following a link, and only when it is a regular file (a link,
        a FIFO or a folder in its place is someone else's: refused by what it is, never written)."""
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as err:
            if err.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO) or self.path.is_symlink():
                what = "a symbolic link" if self.path.is_symlink() else not_a_file(self.path) or "not a file"
                raise ValueError(f"{self.flag} {self.target}: its lock file {self.path} is {what.removeprefix('is ')}"
                                 f", not glmkit's; remove it if no run holds it") from None
            if err.errno in (errno.ENOENT, errno.ENOTDIR):  # a folder that takes no new files (/proc, /sys)
                raise ValueError(f"{self.flag} {self.shown}: no file can be made in {self.path.parent} "
                                 f"({err.strerror}); give a path in a writable folder") from None
            raise
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            os.close(fd)
            raise ValueError(f"{self.flag} {self.target}: its lock file {self.path} is "
                             f"{(not_a_file(self.path) or 'not a regular file').removeprefix('is ')}, not glmkit's; "
                             f"remove it if no run holds it")
        if info.st_nlink > 1:  # a hard link to another file: writing the holder's line would replace its text
            os.close(fd)
            raise ValueError(f"{self.flag} {self.target}: its lock file {self.path} is a hard link to another file "
                             f"({info.st_nlink} names), not glmkit's; remove it if no run holds it")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "r+", encoding="utf-8", errors="replace")

    def __enter__(self):
        import fcntl
        import warnings

        # a pipe, a device or a socket (/dev/stdout, /proc/self/fd/1) is nobody's output: refused by what it
        # is before a lock is placed beside it (its resolved name may not even be a path)
        try:
            mode = os.stat(self.given).st_mode
        except OSError:  # absent (made below), or unreadable: the open below says which
            mode = None
        if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            why = not_a_file(self.given) or "is not a regular file"
            raise ValueError(f"{self.flag} {self.given}: {why}; give the path of a regular file or folder")
        refuse_name_without_room(self.target, self.flag)
        self._refuse_inside_a_locked_output()
        make_folder(self.path.parent, self.flag, self.shown)
        for _ in range(100):
            handle = self._open()
            handle.seek(0)
            # what a lock file says is shown to the user: a short line of printable text at most
            before = "".join(c for c in handle.read(LOCK_TEXT_CHARS) if c.isprintable()).strip()
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                handle.close()
                raise ValueError(f"{self.flag} {self.target} is in use by another glmkit run "
                                 f"({before or 'holder unknown'}); wait for it to end or choose another "
                                 f"{self.flag}") from None
            try:  # a holder that ended unlinked the file we opened: lock the one that is there now
                same = os.stat(self.path).st_ino == os.fstat(handle.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()
        else:
            raise ValueError(f"{self.flag} {self.target}: its lock file {self.path} keeps changing; try again")
        holder = dict(part.split("=", 1) for part in before.split() if "=" in part)
        if holder.get("host") not in (None, "", socket.gethostname()):  # no host named: no other host's run
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()
            raise ValueError(f"{self.flag} {self.target} is locked by a run on another host ({before}); if that run "
                             f"has ended, remove {self.path}")
        if before:
            warnings.warn(f"{self.flag} {self.target}: took over the lock of a run that ended without releasing it "
                          f"({before})", stacklevel=2)
        self.handle = handle
        try:
            handle.seek(0)
            handle.truncate()
            handle.write(f"pid={os.getpid()} host={socket.gethostname()} started={time.strftime('%Y-%m-%dT%H:%M:%S')}\n")
            handle.flush()
        except BaseException:  # a full disk: no half-written lock is left for the next run to puzzle over
            self.__exit__()
            raise
        return self

    def _refuse_inside_a_locked_output(self) -> None:
        """An output inside another run's locked output (a --save folder's iter_* of a run still
        writing it) would be replaced under that run: refused with its holder named. A lock file no
        process holds is a stale one, and is left for its own output's next run to take over."""
        import fcntl

        for folder in self.target.parents:
            if not folder.name:  # the root has no name, and no lock beside it
                continue
            lock = folder.with_name(f".{folder.name}.glmkit-lock")
            try:
                fd = os.open(lock, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
            except OSError:  # none there (the usual case), or a link or a FIFO: not a lock a run holds
                continue
            try:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    continue
                try:
                    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                except OSError:
                    holder = "".join(c for c in os.read(fd, LOCK_TEXT_CHARS).decode("utf-8", "replace")
                                     if c.isprintable()).strip()
                    raise ValueError(f"{self.flag} {self.target} is inside {folder}, which another glmkit run is "
                                     f"writing ({holder or 'holder unknown'}); wait for it to end or choose a path "
                                     f"outside it") from None
                fcntl.flock(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)

    def __exit__(self, *exc):
        import fcntl

        if self.handle is not None:
            self.path.unlink(missing_ok=True)
            fcntl.flock(self.handle, fcntl.LOCK_UN)
            self.handle.close()
            self.handle = None
        return False
