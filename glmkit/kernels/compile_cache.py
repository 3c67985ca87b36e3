"""One persistent compile cache for every glmkit process: the notebooks, the CLI and the server.

A fused or Triton path compiles on the first call of each shape: inductor's graphs (the fused
elementwise chains, their AOT autograd backward), Triton binaries (glmkit's kernels, fla's), fla's
autotune choices and TileLang's kernels. Each of those tools has its own on-disk cache, by default in
places that do not outlive a machine (`/tmp/torchinductor_<user>`) or that never record autotuning
(Triton re-benchmarks every fla config in each new process). `use_compile_cache` points all of them
at one folder per set of versions:

    <cache root>/compile/<torch-..._triton-..._fla-..._tilelang-..._cuda-...>/{inductor,triton,tilelang}

where the cache root is `$GLMKIT_CACHE_DIR`, else `$XDG_CACHE_HOME/glmkit`, else `~/.cache/glmkit`.
Within a folder each tool keys its entries by what it compiles (graph, shapes, device, source hash),
so the folder name only has to separate versions whose entries must never mix. A variable the user
has already set (`TORCHINDUCTOR_CACHE_DIR`, `TRITON_CACHE_DIR`, `TILELANG_CACHE_DIR`,
`TRITON_CACHE_AUTOTUNING`) is left as it is, except inductor's own default, which torch writes into
the environment when `torch._dynamo` is imported; `GLMKIT_COMPILE_CACHE=off` leaves every tool on its
own defaults. It is called when a kernel plan is made (`Backends.plan`), before anything compiles.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import sys
from pathlib import Path

OFF = ("off", "0", "false", "no")
VERSIONED = ("torch", "triton", "flash-linear-attention", "tilelang")
SHORT_NAMES = {"flash-linear-attention": "fla"}
TOOL_DIRS = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton", "TILELANG_CACHE_DIR": "tilelang"}


def cache_root() -> Path:
    """glmkit's cache folder for this user (see the module docstring), as an absolute path. A value
    that cannot name a folder is refused by the variable's name."""
    for variable, below in (("GLMKIT_CACHE_DIR", ""), ("XDG_CACHE_HOME", "glmkit")):
        value = os.environ.get(variable)
        if value:
            if not value.isprintable():
                raise ValueError(f"{variable}={value!r}: holds a line break or control character; give a folder path")
            try:
                root = Path(value).expanduser()
            except RuntimeError as err:  # ~user that does not exist
                raise ValueError(f"{variable}={value!r}: {err}; give a folder path") from None
            return Path(os.path.abspath(root / below))
    return Path.home() / ".cache" / "glmkit"


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def versions_key() -> str:
    """The folder name: the version of every tool whose compiled output is cached, and CUDA's."""
    import torch

    parts = [f"{SHORT_NAMES.get(p, p)}-{_version(p)}" for p in VERSIONED]
    parts.append(f"cuda-{torch.version.cuda or 'none'}")
    return re.sub(r"[^A-Za-z0-9._+-]", "_", "_".join(parts))


def compile_cache_dir() -> Path:
    return cache_root() / "compile" / versions_key()


def use_compile_cache() -> Path | None:
    """Point the compile caches of this process at glmkit's folder (once; later calls change nothing)
    and return it; None when `GLMKIT_COMPILE_CACHE` is off."""
    if os.environ.get("GLMKIT_COMPILE_CACHE", "").strip().lower() in OFF:
        return None
    directory = compile_cache_dir()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # a file in the way, a folder this user cannot write
        why = f"cannot make {directory} ({err.strerror or err})"
        if os.environ.get("GLMKIT_CACHE_DIR"):  # the user's choice: refused by its name
            raise ValueError(f"GLMKIT_CACHE_DIR: {why}; point it at a folder you can write, or set "
                             f"GLMKIT_COMPILE_CACHE=off") from None
        import warnings  # the default place (a read-only home): each tool keeps its own default instead

        warnings.warn(f"compile cache: {why}; compiled kernels are cached where each tool defaults to "
                      f"(set GLMKIT_CACHE_DIR to keep them)", stacklevel=2)
        return None
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if chosen is not None and chosen == _inductor_default():
        del os.environ["TORCHINDUCTOR_CACHE_DIR"]  # torch's default, written by an import, not a user's choice
    for variable, sub in TOOL_DIRS.items():
        os.environ.setdefault(variable, str(directory / sub))
    os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")  # fla autotunes: keep its choices on disk
    return directory


def _inductor_default() -> str | None:
    """The folder inductor picks when no one chose one (`/tmp/torchinductor_<user>`), if inductor's
    cache module is loaded: only that module writes its default into the environment, so when it is
    not loaded a set TORCHINDUCTOR_CACHE_DIR is the user's (and importing it would cost a second)."""
    module = sys.modules.get("torch._inductor.runtime.cache_dir_utils")
    return module.default_cache_dir() if module is not None else None
