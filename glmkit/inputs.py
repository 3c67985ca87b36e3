"""What a path given as an input file really is, in words, for errors that name it."""

from __future__ import annotations

import contextlib
import math
import os
import pickle
import re
import signal
import stat
import struct
import threading
import time
from pathlib import Path

# What unpickling arbitrary bytes can raise (torch.load weights_only included): a reader that catches these
# names the file as unreadable instead of ending in a traceback.
UNPICKLE_ERRORS = (pickle.UnpicklingError, RuntimeError, EOFError, IndexError, KeyError, TypeError, ValueError,
                   AttributeError, ImportError, UnicodeDecodeError, MemoryError, OverflowError, struct.error)

_KINDS = ((stat.S_ISDIR, "is a directory"), (stat.S_ISFIFO, "is a named pipe (FIFO)"),
          (stat.S_ISCHR, "is a character device"), (stat.S_ISBLK, "is a block device"),
          (stat.S_ISSOCK, "is a socket"))


def breaks_a_line(c: str) -> bool:
    """A C0 or C1 control character, DEL, or a Unicode line or paragraph separator: what would turn a
    one-line message echoing a value into two lines (or recolour a terminal)."""
    return ord(c) < 32 or 127 <= ord(c) < 160 or c in "\u2028\u2029"


def not_a_file(path: str | os.PathLike) -> str | None:
    """None when `path` is (or links to) a regular file; else why not, e.g. 'is a named pipe (FIFO)'.
    A pipe or a device would block or never end, so readers refuse them before opening."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return "is a symbolic link to nothing" if path.is_symlink() else "no such file"
    except PermissionError:
        raise  # the environment's (a folder above it this user may not enter), not the input's kind
    except OSError as err:  # a link loop, a name too long, a component that is a file
        return err.strerror.lower() if err.strerror else str(err)
    if stat.S_ISREG(mode):
        return None
    kind = next((words for test, words in _KINDS if test(mode)), "is not a regular file")
    return kind + (" (through a symbolic link)" if path.is_symlink() else "")


def read_marker(path: str | os.PathLike, limit: int = 256) -> str:
    """The text of a small marker file (an iteration number, 'release'), stripped; at most `limit` bytes
    are read. A pipe or device in its place is refused by what it is (reading one blocks or never ends)."""
    if (why := not_a_file(path)) is not None:
        raise ValueError(f"{path}: {why}; expected a small text file")
    with open(path, "rb") as f:
        return f.read(limit).decode("utf-8", errors="replace").strip()


# Python's int() and float() also take Unicode digits ('١٠'), underscores ('1_0') and spaces; a
# command line or a JSON string that means a number is written in ASCII, so only that is read.
_INTEGER = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def ascii_int(text: str) -> int:
    """An integer written in ASCII digits, with an optional sign; ValueError otherwise."""
    if not isinstance(text, str) or not _INTEGER.fullmatch(text):
        raise ValueError(f"not an integer: {text!r}")
    return int(text)


def ascii_float(text: str) -> float:
    """A finite decimal number written in ASCII (1, -0.5, 2e-4); ValueError otherwise (nan and inf too)."""
    if not isinstance(text, str) or not _DECIMAL.fullmatch(text) or not math.isfinite(value := float(text)):
        raise ValueError(f"not a finite decimal number: {text!r}")
    return value


# A tensor read from a file may be a view declaring far more elements than its storage holds (torch.save
# keeps `x.expand(n)` as one stored element and a stride of 0); reading its values would materialise all
# of them (and readers widen them: int8 ids become int64). Such views are read while all of a file's
# together stay under this many elements; beyond it the file is refused by name.
MAX_EXPANDED_ELEMENTS = 1 << 24


def check_loaded_tensors(value, file: str) -> None:
    """Refuse, naming the file and the place (e.g. `samples[0].tokens`), any tensor in a torch.load result
    (nested in dicts, lists and tuples) that holds no data (meta), is not dense (sparse, quantized,
    nested), or is an expanded view, when a file's expanded views declare more than
    MAX_EXPANDED_ELEMENTS elements together; such a tensor fails later in a far less telling way, or
    fills memory."""
    expanded = [0]
    _check_tensors(value, file, "", 0, expanded, {})


def shown_key(key, limit: int = 40) -> str:
    """A key read from a file, as a message names it: its text cut to `limit` characters (a key
    nested too deeply to print, such as a tuple 3000 levels deep, is named by its type)."""
    try:
        return str(key)[:limit]
    except RecursionError:
        return f"<a {type(key).__name__} nested too deeply to show>"


_PLAIN = (int, float, str, bool, type(None))  # nothing to check inside: a list of token ids is skimmed


def _check_tensors(value, file: str, place: str, depth: int, expanded: list, seen: dict) -> None:
    if depth > 64:  # no file glmkit reads nests deeper; not worth walking
        return
    if not isinstance(value, (dict, list, tuple)):
        return _check_tensor(value, file, place, expanded)
    # one container the file refers to from many places (torch.save keeps one copy) is walked once, where
    # it is first met; its expanded views count at every place (a reader may widen each)
    if id(value) in seen:
        return _count_expanded(seen[id(value)][1], file, place, expanded)
    before = expanded[0]
    seen[id(value)] = (value, 0)
    _check_items(value, file, place, depth, expanded, seen)
    seen[id(value)] = (value, expanded[0] - before)


def _check_items(value, file: str, place: str, depth: int, expanded: list, seen: dict) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            if type(item) in _PLAIN:
                continue
            name = key if isinstance(key, str) and key.isidentifier() else f"[{shown_key(key)!r}]"
            _check_tensors(item, file, f"{place}.{name}" if place and name[0] != "[" else place + name, depth + 1,
                           expanded, seen)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            if type(item) not in _PLAIN:
                _check_tensors(item, file, f"{place}[{i}]", depth + 1, expanded, seen)


def _count_expanded(elements: int, file: str, place: str, expanded: list, stored: int | None = None) -> None:
    expanded[0] += elements
    if expanded[0] > MAX_EXPANDED_ELEMENTS:
        where = f"{file}: {place}" if place else file
        what = f"an expanded view of {elements} elements over {stored} stored" if stored is not None else \
            f"expanded views of {elements} elements, met again"
        raise ValueError(f"{where}: {what} ({expanded[0]} in the file's expanded views so far); glmkit reads such "
                         f"views up to {MAX_EXPANDED_ELEMENTS} elements in all")


def _check_tensor(value, file: str, place: str, expanded: list) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        where = f"{file}: {place}" if place else file
        if value.is_meta:
            raise ValueError(f"{where}: a meta (data-less) tensor; the file must hold the values")
        if value.is_nested or value.is_quantized or value.layout != torch.strided:
            kind = "nested" if value.is_nested else "quantized" if value.is_quantized else str(value.layout)
            raise ValueError(f"{where}: a {kind} tensor; glmkit reads dense tensors")
        stored = value.untyped_storage().nbytes() // max(1, value.element_size())
        if value.numel() > stored:
            _count_expanded(value.numel(), file, place, expanded, stored)


class TimeLimitExceeded(Exception):
    """Raised inside code run under `time_limit` when its seconds are up."""


@contextlib.contextmanager
def time_limit(seconds: float, what: str):
    """Interrupt the Python code inside after `seconds` (TimeLimitExceeded naming `what`): for work
    driven by an input that may never end, such as a chat template's loops. Only the main thread can
    take a signal, so elsewhere the code runs unbounded; an alarm already set is restored after."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise TimeLimitExceeded(f"{what} ran past {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    left, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    started = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if left:  # someone else's alarm: what remained of it, less the time spent here
            signal.setitimer(signal.ITIMER_REAL, max(left - (time.monotonic() - started), 1e-3))
