"""One registry per operator: its backends, a verifier per backend that says whether it can run here,
and one rule for "auto".

    REGISTRY = OpRegistry("dsa", auto_order=("tilelang", "triton", "absorbed"))
    REGISTRY.register(KernelBackend("triton", "glmkit.kernels.dsa.sparse_triton", "...",
                                    packages=("triton",), verify=cuda_in(torch.bfloat16, torch.float16)))
    REGISTRY.resolve("auto", Target("cuda", torch.bfloat16, heads=64, latent=512))
        -> Choice(op="dsa", asked="auto", name="tilelang", reason="auto: the first of tilelang, triton, ...")

A Target is where an operator will run: the device type, the dtype, the CUDA capability and the shape
facts its backends care about (heads, latent rank, hidden size, ...). A backend's verifier returns None
when it can run on a target, else why not (a missing package is checked before the verifier). "auto"
takes the first backend of the operator's `auto_order` that can run and whose `auto_when` (where it is
worth choosing unasked: e.g. the Triton attention runs fp32 but is tuned for 2-byte inputs) holds; a
backend asked for by name that cannot run is refused with the reason. Each operator package (`kernels/<op>/__init__.py`) owns its
registry; a new backend is one module plus one `register` call there.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Callable

import torch


@dataclass(frozen=True)
class Target:
    """Where an operator runs. `facts` are the shape facts a verifier may read (`target.fact("heads")`)."""

    device: str = "cpu"                           # torch device type: "cpu", "cuda", "meta"
    dtype: torch.dtype = torch.float32
    capability: tuple[int, int] | None = None     # CUDA compute capability; None off CUDA
    facts: tuple[tuple[str, object], ...] = ()
    fused: bool = False                           # inside a fused (torch.compile) region: see kernels.fuse

    @classmethod
    def of(cls, device="cpu", dtype=torch.float32, fused: bool = False, **facts) -> "Target":
        device = torch.device(device)
        capability = None
        if device.type == "cuda" and torch.cuda.is_available():
            capability = torch.cuda.get_device_capability(device)
        return cls(device.type, dtype, capability, tuple(sorted(facts.items())), fused)

    def fact(self, name: str, default=None):
        return dict(self.facts).get(name, default)

    def with_facts(self, **facts) -> "Target":
        return Target(self.device, self.dtype, self.capability, tuple(sorted((dict(self.facts) | facts).items())),
                      self.fused)

    def __str__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        cap = f" sm_{self.capability[0]}{self.capability[1]}" if self.capability else ""
        return f"{self.device}{cap} {dtype}"


def anywhere(target: Target) -> str | None:
    return None


def cuda_in(*dtypes: torch.dtype) -> Callable[[Target], str | None]:
    """A verifier: CUDA tensors of one of `dtypes` (any dtype when none are named)."""
    def verify(target: Target) -> str | None:
        if target.device != "cuda":
            return f"CUDA tensors only (here: {target.device})"
        if dtypes and target.dtype not in dtypes:
            allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
            return f"{allowed} only (here: {str(target.dtype).removeprefix('torch.')})"
        return None
    return verify


def all_of(*verifiers: Callable[[Target], str | None]) -> Callable[[Target], str | None]:
    def verify(target: Target) -> str | None:
        return next((why for why in (v(target) for v in verifiers) if why is not None), None)
    return verify


@dataclass(frozen=True)
class KernelBackend:
    """One implementation of an operator: the module holding it, a line saying what it is, the
    packages it imports and the verifier of where it runs."""

    name: str
    module: str
    summary: str
    packages: tuple[str, ...] = ()
    verify: Callable[[Target], str | None] = anywhere
    reference: bool = False
    auto_when: Callable[[Target], str | None] = anywhere  # where "auto" picks it, beyond where it runs

    def why_not(self, target: Target) -> str | None:
        """None when the backend can run on `target`, else the reason it cannot."""
        for package in self.packages:
            if not _installed(package):
                return f"needs the {package} package (not installed; pip install -e '.[gpu]' on a CUDA machine)"
        return self.verify(target)

    def load(self):
        return importlib.import_module(self.module)


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a module set to None in sys.modules (blocked) or without a spec
        return False


def _import_failure(backend: KernelBackend) -> str | None:
    """Why a backend's module cannot be imported (a package present but broken), or None."""
    try:
        backend.load()
    except ImportError as err:
        return f"cannot be imported ({err})"
    return None


@dataclass(frozen=True)
class Choice:
    """The backend chosen for an operator, what was asked and why."""

    op: str
    asked: str
    backend: KernelBackend
    reason: str

    @property
    def name(self) -> str:
        return self.backend.name

    @functools.cached_property
    def ops(self):
        """The backend's module, imported once (a run reads it every forward and decode step)."""
        return self.backend.load()

    def __str__(self) -> str:
        return f"{self.op}={self.name} ({self.reason})"


class OpRegistry:
    """The backends of one operator and its rule for "auto"."""

    def __init__(self, op: str, auto_order: tuple[str, ...]):
        self.op, self.auto_order = op, auto_order
        self.backends: dict[str, KernelBackend] = {}

    def register(self, backend: KernelBackend) -> KernelBackend:
        if backend.name in self.backends or backend.name == "auto":
            raise ValueError(f"{self.op} backend {backend.name!r} is registered already")
        self.backends[backend.name] = backend
        return backend

    @property
    def names(self) -> tuple[str, ...]:
        return ("auto", *self.backends) if self.auto_order else tuple(self.backends)

    @property
    def reference(self) -> KernelBackend:
        return next(b for b in self.backends.values() if b.reference)

    def get(self, name: str) -> KernelBackend:
        if name not in self.backends:
            raise ValueError(f"unknown {self.op.upper()} backend {name!r}; allowed: {', '.join(self.names)}")
        return self.backends[name]

    def resolve(self, asked: str, target: Target) -> Choice:
        """The backend that runs `asked` ("auto" or a name) on `target`, with the reason; a named backend
        that cannot run there is refused with why."""
        if asked == "auto" and self.auto_order:
            skipped = []
            for name in self.auto_order:
                backend = self.backends[name]
                why = backend.why_not(target) or backend.auto_when(target) or _import_failure(backend)
                if why is None:
                    passed = f"; passed over {'; '.join(skipped)}" if skipped else ""
                    return Choice(self.op, asked, self.backends[name], f"auto on {target}{passed}")
                skipped.append(f"{name}: {why}")
            raise ValueError(f"no {self.op.upper()} backend runs on {target}: {'; '.join(skipped)}")
        backend = self.get(asked)
        why = backend.why_not(target)
        if why is not None:
            raise ValueError(f"{self.op.upper()} backend {asked!r} cannot run on {target}: {why}")
        return Choice(self.op, asked, backend, "asked for")


@dataclass(frozen=True)
class KernelPlan:
    """Every operator's choice for one model on one device, made once when a path is built."""

    target: Target
    choices: tuple[Choice, ...] = field(default=())
    compile_cache: str | None = None              # where compiled kernels persist (kernels.compile_cache)

    def __getitem__(self, op: str) -> Choice:
        return next(c for c in self.choices if c.op == op)

    @property
    def fuse_mode(self) -> str:
        """The mode `kernels.fuse.fusing` runs with: the fuse choice, except that an asked "auto" stays
        "auto" (fused for CUDA tensors, as chosen; a call on host tensors inside a CUDA run stays eager)."""
        choice = self["fuse"]
        return "auto" if choice.asked == "auto" else choice.name

    def names(self) -> dict[str, str]:
        return {c.op: c.name for c in self.choices}

    def explain(self) -> list[str]:
        """One line per operator: what was asked, what runs and why."""
        return [f"{c.op:8s} {c.asked:9s} -> {c.name:9s} {c.reason}" for c in self.choices]
