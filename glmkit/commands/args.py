"""The argument types and shared options of every command group: ASCII numbers with bounds named in
the error, the backends of a run, dtypes and devices, and which paths a command was given."""

from __future__ import annotations

import argparse
import os

from glmkit.inputs import ascii_float, ascii_int


DTYPES = {"float32": "float32", "bfloat16": "bfloat16"}


DEVICES = ["cpu", "cuda"]


def _backends(args):
    """The one Backends value of a run, from --kda-backend / --dsa-backend / --moe-backend / --fuse."""
    from glmkit.kernels.backends import Backends

    return Backends(kda=args.kda_backend, dsa=args.dsa_backend, moe=args.moe_backend, fuse=args.fuse)


def _backend_arguments(p):
    from glmkit.kernels.backends import DSA_BACKENDS, FUSE_MODES, KDA_BACKENDS, MOE_BACKENDS, Backends

    default = Backends()
    p.add_argument("--kda-backend", default=default.kda, choices=list(KDA_BACKENDS),
                   help="KDA kernels: torch (reference) or fla (CUDA)")
    p.add_argument("--dsa-backend", default=default.dsa, choices=list(DSA_BACKENDS),
                   help="sparse MLA for full sequences: naive (reference), absorbed, triton (CUDA) or auto")
    p.add_argument("--moe-backend", default=default.moe, choices=list(MOE_BACKENDS),
                   help="routed experts: loop (reference), grouped (torch._grouped_mm, CUDA bf16) or auto")
    p.add_argument("--fuse", default=default.fuse, choices=list(FUSE_MODES),
                   help="fused elementwise kernels (torch.compile): auto (on CUDA), on, off (eager reference)")


def _int_at_least(least: int, name: str, most: int | None = None, sanity_cap: bool = False):
    """An argparse type: an int >= `least` (and <= `most`); `name` is what argparse calls a value it
    cannot parse. `sanity_cap`: `most` only stops typos, so each bound is named on its own side."""
    def parse(text: str) -> int:
        value = ascii_int(text)
        if value < least or (most is not None and value > most):
            if most is None or (sanity_cap and value < least):
                bound = f">= {least}"
            else:
                bound = f"at most {most}" if sanity_cap else f"in {least}..{most}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value
    parse.__name__ = name
    return parse


def _finite(text: str) -> float:
    try:
        return ascii_float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}") from None


_finite.__name__ = "finite number"


def _finite_positive(text: str) -> float:
    value = _finite(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return value


_finite_positive.__name__ = "positive number"


MAX_LORA_RANK = 1 << 16  # far above any projection's smaller side; past it the adapter sizes overflow


MAX_DECODE_STEPS = 1 << 16


# counts and sizes past 2^62 are typos; beyond 2^63 they would overflow inside torch or numpy
_positive = _int_at_least(1, "positive integer", 1 << 62, sanity_cap=True)
_integer = _int_at_least(-(1 << 63), "integer", (1 << 63) - 1, sanity_cap=True)
# torch and numpy seed from a signed 64-bit int; a larger seed fails deep inside a run
_seed = _int_at_least(0, "seed", (1 << 63) - 1)
_non_negative = _int_at_least(0, "non-negative integer", 1 << 62, sanity_cap=True)


def _gpu_fraction(text: str) -> float:
    """An argparse type: a GPU share in (0, 1]."""
    value = _finite(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return value


_gpu_fraction.__name__ = "GPU fraction"


def _dtype(name: str):
    import torch

    return getattr(torch, name)


def _given_paths(args, *outputs: str) -> dict:
    """The command's arguments that name something on disk (its inputs), by flag; `outputs` (argument
    names) left out. --paths' comma-separated entries count one by one."""
    found = {}
    for name, value in vars(args).items():
        if name in outputs or name == "func":
            continue
        values = value.split(",") if name == "paths" and isinstance(value, str) else \
            value if isinstance(value, list) else [value]
        for v in values:
            if isinstance(v, str) and v.strip() and os.path.exists(v.strip()):
                found[f"--{name.replace('_', '-')}" + (f" {v.strip()}" if len(values) > 1 else "")] = v.strip()
    return found


def _json_lock(args):
    """The --json file's lock while the command runs (nothing when no --json is given)."""
    import contextlib

    from glmkit.outputs import RunLock

    return RunLock(args.json, "--json") if getattr(args, "json", None) else contextlib.nullcontext()


def _finding_command(args, run) -> int:
    """A check of the user's artefacts: `run()` -> a result with text(), to_json() and verdict; printed,
    written to --json (strict JSON, atomically), exit 0 on pass and 1 on a finding."""
    import json

    from glmkit.outputs import claim_file, write_marked
    from glmkit.report import json_safe

    with _json_lock(args):
        if args.json:
            # before any work; beside the checkpoints and files it reads, never into them
            claim_file(args.json, "--json", "JSON result", _given_paths(args, "json"), nested=True)
        result = run()
        print(result.text())
        if args.json:
            write_marked(args.json, json.dumps(json_safe(result.to_json()), indent=2), "JSON result")
    return 0 if result.verdict == "pass" else 1


def _print_verdict(label: str, verdict: dict) -> None:
    print(f"{label}: {verdict['verdict']}" + "".join(f"\n  - {r}" for r in verdict["reasons"]))
