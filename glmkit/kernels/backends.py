"""Which kernel runs each operator, chosen once per run and passed around as one value.

    Backends()                                   torch KDA; DSA, MoE and fusion picked by device
    Backends.parse("kda=fla,dsa=absorbed")       the CLI's and notebooks' spelling
    Backends.parse({"kda": "fla"})               the same as a dict (a notebook's parameters cell)
    Backends.parse("fla")                        a bare name is the KDA backend (the older spelling)
    Backends().plan(target)                      every operator's backend on a target, and why

Every operator has a registry in its package (`kernels/<op>/__init__.py`, see kernels.registry): a
pure-torch reference (`naive.py`) beside its fast forms, each with a verifier of where it runs, and
one rule for "auto". An unknown name fails with the allowed values; a backend that cannot run on the
target fails with the reason (a missing package named).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from glmkit.kernels import dsa, fuse, indexer, kda, mhc, moe
from glmkit.kernels.dsa import BACKENDS as DSA_BACKENDS, get_backend as dsa_backend
from glmkit.kernels.compile_cache import use_compile_cache
from glmkit.kernels.fuse import FUSE_MODES
from glmkit.kernels.kda import BACKENDS as KDA_BACKENDS, get_backend as kda_backend
from glmkit.kernels.registry import KernelPlan, Target

MOE_BACKENDS = moe.BACKENDS
INDEXER_BACKENDS = indexer.BACKENDS
ALLOWED = {"kda": KDA_BACKENDS, "dsa": DSA_BACKENDS, "moe": MOE_BACKENDS, "fuse": FUSE_MODES,
           "indexer": INDEXER_BACKENDS}


@dataclass(frozen=True)
class Backends:
    """kda: "torch" (reference, CPU and GPU) or "fla" (Triton, CUDA); no "auto" (the reference is the default).
    dsa: "naive" (un-absorbed gather, the reference), "absorbed" (MQA over the shared latent, torch),
         "triton" (the absorbed form's forward as one Triton kernel, CUDA), "tilelang" (the forward as
         a warp-specialised TileLang kernel, Hopper bf16, heads a multiple of 64, latent 512; Triton backward) or
         "auto" (tilelang where it runs, else triton for bf16 / fp16 CUDA, else absorbed).
    indexer: "torch" (the reference; the only backend so far) or "auto".
    moe: "loop" (per-expert, the reference), "grouped" (`torch._grouped_mm`, CUDA bf16) or "auto".
    fuse: elementwise chains (mHC, norms, gates) compiled into fused kernels: "auto" (on CUDA),
          "on" (any device) or "off" (eager, the reference); see glmkit.kernels.fuse. mHC's Sinkhorn
          kernel follows it (Triton inside fused sites on CUDA)."""

    kda: str = "torch"
    dsa: str = "auto"
    moe: str = "auto"
    fuse: str = "auto"
    indexer: str = "auto"

    def __post_init__(self):
        for op, allowed in ALLOWED.items():
            value = getattr(self, op)
            if value not in allowed:
                what = "fuse mode" if op == "fuse" else f"{op.upper()} backend"
                raise ValueError(f"unknown {what} {value!r}; allowed: {', '.join(allowed)}")

    @classmethod
    def parse(cls, spec: "str | dict | Backends | None") -> "Backends":
        """None -> defaults; a Backends -> itself; "kda=fla,dsa=naive" or {"kda": "fla", "dsa": "naive"}
        -> those; "fla" -> kda=fla. (A notebook's parameters cell uses the dict: papermill cannot read a
        line holding more than one '='.)"""
        if spec is None:
            return cls()
        if isinstance(spec, Backends):
            return spec
        if isinstance(spec, dict):
            unknown = [op for op in spec if op not in ALLOWED]
            if unknown:
                raise ValueError(f"unknown operator {unknown[0]!r} in backends {spec!r}; allowed: {', '.join(ALLOWED)}")
            if not all(isinstance(v, str) for v in spec.values()):
                raise TypeError(f"backends {spec!r}: each operator's backend is a name (a string)")
            return cls(**spec)
        if not isinstance(spec, str):
            raise TypeError(f"backends must be a Backends, a spec string, a dict or None, got {type(spec).__name__}")
        chosen = {}
        for item in (part.strip() for part in spec.split(",")):
            if not item:
                continue
            op, sep, value = item.partition("=")
            if not sep:  # a bare name: the KDA backend, as --kda-backend always meant
                op, value = "kda", op
            op, value = op.strip(), value.strip()
            if op not in ALLOWED:
                raise ValueError(f"unknown operator {op!r} in backends {spec!r}; allowed: {', '.join(ALLOWED)}")
            chosen[op] = value
        return cls(**chosen)

    def with_(self, **changes) -> "Backends":
        """A copy with some operators changed; None values leave that operator as it is."""
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def __str__(self) -> str:
        # the indexer is named only when set: runs recorded before it had a registry compare equal on resume
        return ",".join(f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                        if not (f.name == "indexer" and self.indexer == "auto"))

    def kda_ops(self):
        return kda_backend(self.kda)

    def dsa_ops(self):
        return dsa_backend(self.dsa)

    def plan(self, target: Target) -> KernelPlan:
        """Every operator's backend on `target` (its device, dtype and shape facts), with the reason:
        the one place that answers which kernel runs and why. A named backend that cannot run there
        raises ValueError with the reason. Points the compile caches at glmkit's persistent folder
        first (kernels.compile_cache), before any backend's module is imported."""
        cache = use_compile_cache()
        fused = fuse.REGISTRY.resolve(self.fuse, target)
        choices = (kda.REGISTRY.resolve(self.kda, target), dsa.REGISTRY.resolve(self.dsa, target),
                   indexer.REGISTRY.resolve(self.indexer, target), moe.REGISTRY.resolve(self.moe, target), fused,
                   mhc.REGISTRY.resolve("auto", replace(target, fused=fused.name == "on")))
        return KernelPlan(target, choices, None if cache is None else str(cache))
