"""Native LoRA on glmkit's model, selecting exactly the recipe's table.

    KDA layers   q/k/v/o_proj, b_proj, forget_gate.f_a/f_b_proj, g_a/g_b_proj
    DSA layers   q_a/q_b_proj, kv_a_proj_with_mqa, o_proj
    MLP          dense and shared-expert gate/up/down_proj

`--target-modules attn,mlp` names every attention / MLP projection (kv_b_proj and the routed experts
included, as the recipe's launcher does), `--exclude-modules "*.mlp.experts.*,*.self_attn.kv_b_proj"`
removes the frozen ones, and anything frozen that is still selected fails validation with the reason.
Patterns match glmkit's module names and the recipe's in-memory aliases (`self_attn.forget_gate.f_a_proj`
for the checkpoint's `self_attn.f_a_proj`).
"""

from __future__ import annotations

import fnmatch
import math

import torch
import torch.nn.functional as F
from torch import nn

from glmkit.bounds import FLOAT32_MAX

ATTN_KDA = ("q_proj", "k_proj", "v_proj", "o_proj", "b_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj")
ATTN_DSA = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
MLP_PROJ = ("gate_proj", "up_proj", "down_proj")
DEFAULT_EXCLUDE = "*.mlp.experts.*,*.self_attn.kv_b_proj"

# Why a projection can never carry an adapter (checked in this order).
FROZEN = (
    ("*.mlp.experts.*", "the routed experts stay frozen: native LoRA has no per-expert adapter"),
    ("*.self_attn.kv_b_proj", "kv_b_proj is absorbed into the query and the output at decode and never runs "
                              "as a module there, so an adapter on it would never run"),
    ("*.self_attn.indexer.*", "the DSA indexer is not a LoRA target"),
    ("*.mlp.gate", "the MoE router (mlp.gate) is not a LoRA target"),
    ("*conv1d", "the KDA short convolutions are not LoRA targets"),
)


class LoRALinear(nn.Linear):
    """y = x W^T + (x A^T B^T) * alpha / r. W keeps its name (`weight`), so checkpoints and syncs of the
    base are unchanged; only lora_A [r, in] and lora_B [out, r] (zero-initialised) train."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None, device="meta")
        self.weight, self.bias = base.weight, base.bias
        self.rank, self.scaling = rank, alpha / rank
        self.lora_A = nn.Parameter(torch.empty(rank, base.in_features, device=base.weight.device, dtype=torch.float32))
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, rank, device=base.weight.device, dtype=torch.float32))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))

    def forward(self, x):
        delta = F.linear(F.linear(x.to(self.lora_A.dtype), self.lora_A), self.lora_B) * self.scaling
        return super().forward(x) + delta.to(x.dtype)


def aliases(name: str) -> list[str]:
    """glmkit's name and the recipe's in-memory alias of the same module."""
    out = [name]
    for part in ("f_a_proj", "f_b_proj"):
        if name.endswith(f"self_attn.{part}"):
            out.append(name.replace(f"self_attn.{part}", f"self_attn.forget_gate.{part}"))
    return out


def candidates(model, targets: list[str]) -> dict[str, nn.Module]:
    """Projections named by the targets: "attn", "mlp", or a projection's leaf name. The routed experts
    are stacked (no Linear per expert), so each of them counts as its checkpoint projections
    `{experts}.{e}.gate_proj` ... (mapped to the GroupedExperts module): selected like any MLP projection,
    they then fail validation as frozen and are never wrapped."""
    from glmkit.model.moe import GroupedExperts

    projections = []
    for name, module in model.named_modules():
        if isinstance(module, GroupedExperts):
            projections += [(f"{name}.{e}.{proj}", module) for e in range(module.num_experts) for proj in MLP_PROJ]
        elif isinstance(module, nn.Linear) and name != "lm_head":
            projections.append((name, module))
    found = {}
    for name, module in projections:
        parts = name.split(".")
        leaf, in_attn = parts[-1], ".self_attn." in f".{name}."
        in_indexer, in_mlp = ".indexer." in name, ".mlp." in f".{name}."
        attn = in_attn and not in_indexer and leaf in ATTN_KDA + ATTN_DSA
        mlp = in_mlp and leaf in MLP_PROJ
        for target in targets:
            if (target == "attn" and attn) or (target == "mlp" and mlp) or target == leaf or \
                    any(fnmatch.fnmatch(a, target) for a in aliases(name)):
                found[name] = module
    return found


def frozen_reason(name: str) -> str | None:
    for pattern, why in FROZEN:
        if any(fnmatch.fnmatch(a, pattern) for a in aliases(name)):
            return why
    return None


def select(model, target_modules: str, exclude_modules: str = DEFAULT_EXCLUDE) -> list[str]:
    """Names of the projections to adapt. Raises ValueError when a frozen projection is selected."""
    targets = [t.strip() for t in target_modules.split(",") if t.strip()]
    excludes = [p.strip() for p in (exclude_modules or "").split(",") if p.strip()]
    if not targets:
        raise ValueError("--target-modules names nothing; use attn, mlp or projection names")
    chosen = {n: m for n, m in candidates(model, targets).items()
              if not any(fnmatch.fnmatch(a, p) for p in excludes for a in aliases(n))}
    # explicitly named non-Linear or frozen modules are errors too, not silent no-ops
    for target in targets:
        if target not in ("attn", "mlp") and not any(target == n.split(".")[-1] for n in chosen):
            why = frozen_reason(f"x.{target}") or frozen_reason(f"x.self_attn.{target}") or frozen_reason(f"x.mlp.{target}")
            if why:
                raise ValueError(f"--target-modules {target!r} cannot be adapted: {why}")
    bad = sorted((n, frozen_reason(n)) for n in chosen if frozen_reason(n))
    if bad:
        name, why = bad[0]
        raise ValueError(f"--target-modules selects {name} (and {len(bad) - 1} more frozen projections): {why}; "
                         f"exclude them, e.g. --exclude-modules \"{DEFAULT_EXCLUDE}\"")
    if not chosen:
        raise ValueError(f"--target-modules {target_modules!r} with --exclude-modules {exclude_modules!r} selects nothing")
    return sorted(chosen)


def check_settings(rank: int, alpha: float) -> None:
    """A rank of at least 1, and a positive alpha that float32 holds (as training requires of every setting)."""
    if rank < 1:
        raise ValueError(f"--lora-rank must be >= 1, got {rank}")
    if not abs(alpha) <= FLOAT32_MAX:
        raise ValueError(f"--lora-alpha {alpha:g}: beyond float32's range (|x| <= {FLOAT32_MAX:.3g}); the "
                         f"framework's launchers use 32")
    if not alpha > 0:  # alpha / rank scales every adapter's output: 0 trains adapters that change nothing
        raise ValueError(f"--lora-alpha must be > 0 (alpha / rank scales the adapters' output), got {alpha:g}; the "
                         f"framework's launchers use 32")


def check_rank_fits(model, names: list[str], rank: int) -> None:
    """A rank no adapted projection can use is refused: past a projection's smaller side (min of in and
    out features) an adapter gains parameters and no capacity (--lora-rank 65536 on tiny's 64-wide
    projections made 336M trainable parameters and 7.7 GB)."""
    modules = dict(model.named_modules())
    widest = max((min(modules[n].in_features, modules[n].out_features) for n in names), default=0)
    if names and rank > widest:
        raise ValueError(f"--lora-rank {rank}: above every adapted projection's smaller side (the largest is "
                         f"{widest}); use a rank of at most {widest}")


def apply_lora(model, names: list[str], rank: int, alpha: float) -> list[str]:
    """Freeze every parameter, then wrap the named projections with trainable adapters."""
    check_settings(rank, alpha)
    check_rank_fits(model, names, rank)
    for p in model.parameters():
        p.requires_grad_(False)
    modules = dict(model.named_modules())
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        setattr(modules[parent_name], leaf, LoRALinear(modules[name], rank, alpha))
    return names


def adapter_state(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if n.endswith((".lora_A", ".lora_B"))}


def table(model, names: list[str]) -> list[dict]:
    """One row per adapted projection: name, kind of layer, shape, adapter parameters."""
    modules = dict(model.named_modules())
    rows = []
    for name in names:
        m = modules[name]
        layer = int(name.split(".")[1])
        kind = model.layers[layer].kind if ".self_attn." in name else "mlp"
        rank = getattr(m, "rank", None)
        rows.append({"module": name, "layer_type": kind, "shape": [m.out_features, m.in_features],
                     "adapter_params": None if rank is None else rank * (m.in_features + m.out_features)})
    return rows
