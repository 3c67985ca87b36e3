"""`glmkit` command line: the parser, made of one module per command group (glmkit/commands/), and the
error contract every command answers by.

Exit codes: 0 success / verdict pass, 1 verdict fail, 2 bad input (the reason on stderr: one line naming the
file, tensor or flag, then any detail lines the library gave, at most MAX_ERROR_LINES).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

from glmkit import native_log
from glmkit.inputs import breaks_a_line
from glmkit.commands import check, ckpt, kernels, launch, parity, rollout_data, serve, train
from glmkit.commands.check import cmd_check
from glmkit.commands.ckpt import cmd_ckpt_synth
from glmkit.commands.parity import cmd_capture, cmd_parity
from glmkit.commands.rollout_data import cmd_rollout_data
from glmkit.commands.serve import cmd_serve
from glmkit.commands.train import _train_config, cmd_train  # noqa: F401 - _train_config: the tests build configs

# in the order `glmkit --help` lists them
COMMAND_GROUPS = (check, parity, train, ckpt, rollout_data, launch, serve, kernels)
MAX_ERROR_LINES = 14  # a checkpoint error lists 10 tensors, a header and a count; longer reasons are cut


class _Parser(argparse.ArgumentParser):
    """argparse with the CLI's one-line errors: the command (subcommands included) and the reason,
    and where the usage is, instead of the whole usage block. Subparsers are of this class too."""

    def error(self, message):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (usage: {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """The CLI: one subcommand group per module of glmkit/commands/, plus report and reward."""
    from glmkit.notebook import add_report_command
    from glmkit.rl.rewards import add_reward_command

    parser = _Parser(prog="glmkit", description="GLM-5.3-Flash RL bring-up kit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for group in COMMAND_GROUPS:
        group.add_commands(sub)
    add_report_command(sub)
    add_reward_command(sub)
    return parser


def _require_device(args) -> None:
    """--device cuda where this process runs the model (not launch: its --device is the cluster's)."""
    if getattr(args, "device", None) != "cuda" or args.func not in (cmd_check, cmd_parity, cmd_capture, cmd_train,
                                                                     cmd_ckpt_synth, cmd_serve, cmd_rollout_data):
        return
    import torch

    if not torch.cuda.is_available():
        why = "this torch is built without CUDA" if torch.version.cuda is None else "no CUDA GPU is visible"
        raise ValueError(f"--device cuda: {why} (torch {torch.__version__}); use --device cpu")


def _error_text(command: str, err: BaseException) -> str:
    """The whole reason, bounded: the library's messages put the file / tensor on the first line and list
    the offending tensors (at most 10, and a count) on the next ones."""
    lines = str(err).splitlines() or [type(err).__name__]
    if len(lines) > MAX_ERROR_LINES:
        lines = lines[:MAX_ERROR_LINES - 1] + [f"  ... ({len(lines) - MAX_ERROR_LINES + 1} more lines)"]
    return f"glmkit {command}: error: " + "\n".join(lines)


def _glmkit_warnings(command: str, default):
    """A warnings.showwarning that prints glmkit's own warnings as "glmkit CMD: warning: ..." (other
    packages' as Python does)."""
    package = str(Path(__file__).resolve().parent)

    def show(message, category, filename, lineno, file=None, line=None):
        if str(Path(filename).resolve()).startswith(package):
            print(f"glmkit {command}: warning: {message}", file=sys.stderr)
        else:
            default(message, category, filename, lineno, file, line)

    return show


# Options whose value is itself a command line (`--extra-args "--lr 2e-6"`, as the launchers take it):
# argparse would read such a value as an option, so it is joined to its flag before parsing.
_COMMAND_LINE_VALUES = ("--extra-args", "--extra-env-vars")


def _values_that_look_like_options(argv: list) -> list:
    out, i = [], 0
    while i < len(argv):
        if argv[i] in _COMMAND_LINE_VALUES and i + 1 < len(argv) and argv[i + 1].startswith("-"):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def main(argv=None) -> int:
    import warnings

    try:
        args = build_parser().parse_args(_values_that_look_like_options(sys.argv[1:] if argv is None else list(argv)))
    except KeyboardInterrupt:
        print("glmkit: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as err:  # noqa: BLE001 - a fault in an argument's type function: glmkit's, not the input's
        return _internal_error("arguments", err)
    bad_path = _bad_path(args, sys.argv[1:] if argv is None else [str(a) for a in argv])
    if bad_path:
        print(f"glmkit {args.command}: error: {bad_path}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if argv is None:  # the process is glmkit's own command line (not a caller's, in-process)
        native_log.allow()
    default_show = warnings.showwarning
    default_term = _on_sigterm(_terminate)
    try:
        try:
            warnings.showwarning = _glmkit_warnings(args.command, default_show)
            _require_device(args)
            return args.func(args)
        except Exception as err:  # noqa: BLE001 - the error contract: each kind of failure its exit code
            return _answer_failure(args.command, err)  # a stop while this answers is caught below
    except KeyboardInterrupt as stop:
        _on_sigterm(_already_stopping)  # a scheduler's repeated SIGTERM must not break this last line
        how = "terminated" if isinstance(stop, Terminated) else "interrupted"
        print(f"glmkit {args.command}: {how} (outputs are renamed into place only when complete: nothing "
              f"half-written is left as if it were whole)", file=sys.stderr)
        return EXIT_TERMINATED if isinstance(stop, Terminated) else EXIT_INTERRUPTED
    finally:
        import signal

        warnings.showwarning = default_show
        stopping = threading.current_thread() is threading.main_thread() and \
            signal.getsignal(signal.SIGTERM) is _already_stopping
        # a stopped command line ends now: later SIGTERMs are no news (SIG_IGN, set straight from the
        # stopping handler: Python's shutdown resets its own handlers to the default, which kills);
        # a caller in this process (argv given: a test, a notebook) gets its own handler back
        _on_sigterm(signal.SIG_IGN if stopping and argv is None else default_term)


# options whose value is a path: given as '' (an unset shell variable) it would silently mean the default
PATH_OPTIONS = ("checkpoint", "checkpoint_b", "prompt_data", "eval_prompt_data", "metrics_out", "job_metrics_out",
                "miles_dir", "out", "path", "replay_topk_from", "save", "save_captures", "src", "tokenizer",
                "train_data", "weight_update_dir", "hf", "torch_dist", "allow_updates_from", "load", "ref_load", "json",
                # the launcher's paths on the cluster: never read here, but written into its plan and commands
                "hf_checkpoint", "model_dir", "ckpt_dir", "data_dir", "save_dir", "megatron_path", "train_offload_dir",
                "output_dir")


def _bad_path(args, given: list) -> str | None:
    """Why the first path option given as an empty string, or holding a control character, cannot be
    taken; None when all can. A line break or an escape in a path would be echoed into the one-line
    error (or a report) as a second line the user did not write; no dataset needs one."""
    for name in (*PATH_OPTIONS, "notebook"):
        value = getattr(args, name, None)
        for one in value if isinstance(value, list) else [value]:
            if not isinstance(one, str) or (one and not any(breaks_a_line(c) for c in one)):
                continue
            flag = f"--{name.replace('_', '-')}"
            if any(a.startswith("--") and len(a) > 2 and flag.startswith(a.split("=", 1)[0]) for a in given):
                shown = flag
            else:  # a positional argument: named as its usage line shows it
                shown = f"the {name.upper()} argument"
            if not one:
                return f"{shown} is an empty path; give a file or directory" + (
                    " (or leave the option out)" if shown == flag else "")
            return f"{shown} {one!r} holds a control character (a line break, tab or escape); give a plain path"
    return None


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler or `kill`): unwound like Ctrl-C, so locks are released and staging removed."""


def _terminate(signum, frame):
    # Only the first SIGTERM unwinds: schedulers repeat theirs (and escalate to SIGKILL), and a second
    # Terminated raised inside the cleanup the first one started would cut that cleanup short.
    _on_sigterm(_already_stopping)
    raise Terminated()


def _already_stopping(signum, frame):
    """SIGTERM while the process already unwinds from one: it is stopping; nothing more to do."""


def _on_sigterm(handler):
    """Set SIGTERM's handler (main thread only; elsewhere nothing changes) -> the previous one."""
    import signal
    import threading

    if handler is None or threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, handler)


def _answer_failure(command: str, err: Exception) -> int:
    """What the user sees of a failed command: one line and its exit code (see the contract below)."""
    import errno

    from glmkit.checkpoint import CheckpointError

    if isinstance(err, BrokenPipeError):  # the reader of our output went away (`glmkit ... | head`)
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except OSError:
            pass
        return EXIT_BROKEN_PIPE
    if isinstance(err, OSError):
        if _environment_error(err):
            where = f": {err.filename}" if getattr(err, "filename", None) else ""
            print(f"glmkit {command}: environment error: {err.strerror or err}{where} (nothing half-written is "
                  f"left in place)", file=sys.stderr)
            return EXIT_ENVIRONMENT
        if err.errno == errno.ELOOP:
            print(f"glmkit {command}: error: {err.filename or 'a path given'}: a loop of symbolic links", file=sys.stderr)
            return EXIT_BAD_INPUT
        if err.errno == errno.ENAMETOOLONG:
            name = str(getattr(err, "filename", "") or "")
            print(f"glmkit {command}: error: a path is too long for the file system "
                  f"({len(os.path.basename(name))} characters in its last part): {name[:80]}...", file=sys.stderr)
            return EXIT_BAD_INPUT
        if isinstance(err, (FileNotFoundError, FileExistsError, NotADirectoryError, IsADirectoryError,
                            ConnectionError)):
            print(_error_text(command, err), file=sys.stderr)
            return EXIT_BAD_INPUT
        return _wrapped_environment_error(command, err) or _internal_error(command, err)
    if isinstance(err, RuntimeError) and str(err).startswith("Symlink loop"):  # Path.resolve() (Python < 3.13)
        print(f"glmkit {command}: error: {str(err).splitlines()[0][:300]}: a path given is a loop of symbolic links",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    if _out_of_memory(err):
        print(f"glmkit {command}: environment error: out of memory ({str(err).splitlines()[0][:160] if str(err) else type(err).__name__}); "
              f"a smaller input, or a machine with more free memory (nothing half-written is left in place)",
              file=sys.stderr)
        return EXIT_ENVIRONMENT
    if isinstance(err, (CheckpointError, ValueError, ImportError)):
        if isinstance(err, ValueError) and not isinstance(err, CheckpointError) and not _raised_by_glmkit(err):
            return _wrapped_environment_error(command, err) or _internal_error(command, err)
        print(_error_text(command, err), file=sys.stderr)
        return EXIT_BAD_INPUT
    return _wrapped_environment_error(command, err) or _internal_error(command, err)


def _out_of_memory(err: BaseException) -> bool:
    """Memory the machine could not give: Python's MemoryError, torch's CUDA out-of-memory error and its
    CPU allocator's RuntimeError."""
    import torch

    return isinstance(err, (MemoryError, torch.OutOfMemoryError)) or (
        isinstance(err, RuntimeError) and "can't allocate memory" in str(err))


def _wrapped_environment_error(command: str, err: BaseException) -> int | None:
    """A library's own error around an OS one (safetensors' Rust `... (os error 28)`, torch.save's
    `file write failed`): the environment's (exit 4) when the OS error is one, else None."""
    import re

    seen, chain = set(), err
    while chain is not None and id(chain) not in seen:
        seen.add(id(chain))
        if isinstance(chain, OSError) and chain.errno is not None and _environment_error(chain):
            code = chain.errno
            break
        found = re.search(r"\(os error (\d+)\)", str(chain))
        if found and _environment_error(OSError(int(found.group(1)), "")):
            code = int(found.group(1))
            break
        chain = chain.__cause__ or chain.__context__
    else:
        return None
    print(f"glmkit {command}: environment error: {os.strerror(code)} ({type(err).__name__}; nothing half-written is "
          f"left in place)", file=sys.stderr)
    return EXIT_ENVIRONMENT


# The CLI's error contract: 0 done, 1 a run that fails its check, 2 bad input (one line naming it),
# 3 an internal error (traceback saved to a file), 4 the environment (disk full, permission denied,
# read-only), 130 interrupted.
EXIT_CHECK_FAILED, EXIT_BAD_INPUT, EXIT_INTERNAL, EXIT_ENVIRONMENT, EXIT_INTERRUPTED = 1, 2, 3, 4, 130
EXIT_BROKEN_PIPE = 141  # as a shell reports a process that SIGPIPE ended
EXIT_TERMINATED = 143  # as a shell reports a process that SIGTERM ended


def _environment_error(err: OSError) -> bool:
    import errno

    return isinstance(err, PermissionError) or err.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES,
                                                             errno.EPERM, errno.EMFILE, errno.ENOMEM,
                                                             errno.EFBIG, errno.EIO)


def _raised_by_glmkit(err: BaseException) -> bool:
    """Whether the innermost frame that raised `err` is glmkit's own code (its checks of the user's
    input raise ValueError with the reason) rather than a library's."""
    tb = err.__traceback__
    last = None
    while tb is not None:
        last, tb = tb, tb.tb_next
    if last is None:
        return True
    package = Path(__file__).resolve().parent
    filename = Path(last.tb_frame.f_code.co_filename).resolve()
    return package in filename.parents or package.parent / "widgets" in filename.parents


def _error_folder() -> Path:
    """This user's folder for tracebacks: $TMPDIR/glmkit-errors-UID, made 0700 and owned by this user
    (a folder of that name someone else made, or a symlink, is refused: the file is not written)."""
    import stat
    import tempfile

    folder = Path(tempfile.gettempdir()) / f"glmkit-errors-{os.getuid()}"
    try:
        folder.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(folder)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{folder} is not a private folder of this user")
    return folder


def _internal_error(command: str, err: BaseException) -> int:
    """A bug, not the user's input: one line, and the traceback in a file whose path is printed (a new
    file, never one that exists or a link)."""
    import traceback

    import tempfile

    text = "".join(traceback.format_exception(err))
    name = f"glmkit-{command}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.txt"
    saved = "the traceback could not be saved (no writable temporary folder)"
    for folder in (_error_folder, lambda: Path(tempfile.mkdtemp(prefix="glmkit-errors-"))):  # the 2nd: made private, new
        try:
            path = folder() / name
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(text)
            saved = f"traceback saved to {path}"
            break
        except OSError:
            continue
    first = (str(err).splitlines() or [""])[0][:300]
    print(f"glmkit {command}: internal error: {type(err).__name__}: {first} ({saved}; please report it)",
          file=sys.stderr)
    return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
