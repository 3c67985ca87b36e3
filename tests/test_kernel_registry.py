"""One registry per operator (issue 34): each backend's verifier, the one rule for "auto", the plan a
path chooses once, and `glmkit kernels`, which answers which kernel runs where and why.

CUDA targets are described here, not run: a Target names a device, dtype, capability and shape facts,
so the rules are checked for an H100 (SM90) and an A100 (SM80) on a machine without either; the
package checks are set present for those cases (the GPU suite runs the kernels themselves)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from glmkit.kernels import dsa, fuse, indexer, kda, mhc, moe, registry
from glmkit.kernels.backends import Backends
from glmkit.kernels.registry import KernelBackend, OpRegistry, Target

ROOT = Path(__file__).resolve().parents[1]
FLASH = dict(heads=64, latent=512, hidden=6144, expert_intermediate=2048)  # GLM-5.3-Flash's facts


def h100(dtype=torch.bfloat16, **facts):
    return Target("cuda", dtype, (9, 0), tuple(sorted((FLASH | facts).items())))


@pytest.fixture
def packages_present(monkeypatch):
    """fla, triton and tilelang reported installed and importable (their kernels are not called)."""
    monkeypatch.setattr(registry, "_installed", lambda package: True)
    monkeypatch.setattr(registry, "_import_failure", lambda backend: None)
    monkeypatch.setattr(fuse, "_inductor_runs_on_cuda", lambda: True)


def test_every_operator_has_a_registry_with_its_reference():
    references = {r.op: r.reference.name for r in (kda.REGISTRY, dsa.REGISTRY, indexer.REGISTRY, moe.REGISTRY,
                                                   mhc.REGISTRY, fuse.REGISTRY)}
    assert references == {"kda": "torch", "dsa": "naive", "indexer": "torch", "moe": "loop", "mhc": "torch",
                          "fuse": "off"}
    for reg in (dsa.REGISTRY, indexer.REGISTRY, moe.REGISTRY, mhc.REGISTRY, fuse.REGISTRY):
        assert reg.names[0] == "auto" and set(reg.auto_order) <= set(reg.backends)
    assert kda.BACKENDS == ("torch", "fla")  # no auto for KDA: the reference is the default, fla asked for


def test_auto_on_the_cpu_is_the_reference_or_the_torch_fast_form_with_reasons():
    plan = Backends().plan(Target.of("cpu", torch.float32, **FLASH))
    assert plan.names() == {"kda": "torch", "dsa": "absorbed", "indexer": "torch", "moe": "loop", "fuse": "off",
                            "mhc": "torch"}
    assert "triton:" in plan["dsa"].reason and "grouped: CUDA tensors only (here: cpu)" in plan["moe"].reason
    assert len(plan.explain()) == 6 and plan.explain()[1].startswith("dsa      auto      -> absorbed")


def test_auto_on_cuda_follows_device_dtype_capability_and_shapes(packages_present):
    plan = Backends().plan(h100())
    assert plan.names() == {"kda": "torch", "dsa": "tilelang", "indexer": "torch", "moe": "grouped", "fuse": "on",
                            "mhc": "triton"}
    assert plan["dsa"].reason == "auto on cuda sm_90 bfloat16"  # the first choice: nothing passed over
    # heads that are not a multiple of 64, an A100, fp16: Triton; fp32: the torch absorbed form
    for target, why in ((h100(heads=32), "heads a multiple of 64 only (got 32)"),
                        (Target("cuda", torch.bfloat16, (8, 0), h100().facts), "SM90 (Hopper) only (this GPU is SM80)"),
                        (h100(torch.float16), "bfloat16 only (here: float16)")):
        choice = dsa.REGISTRY.resolve("auto", target)
        assert choice.name == "triton" and why in choice.reason, choice
    fp32 = Backends().plan(h100(torch.float32))
    assert fp32["dsa"].name == "absorbed" and "triton: bfloat16, float16 only (here: float32)" in fp32["dsa"].reason
    assert fp32["moe"].name == "loop" and "grouped: bfloat16 only" in fp32["moe"].reason
    odd = moe.REGISTRY.resolve("auto", h100(expert_intermediate=2044))
    assert odd.name == "loop" and "multiples of 8 only (got expert_intermediate 2044)" in odd.reason
    unfused = Backends(fuse="off").plan(h100())
    assert unfused["mhc"].name == "torch" and "fused (compiled) mHC site only" in unfused["mhc"].reason


def test_a_backend_asked_for_by_name_that_cannot_run_is_refused_with_the_reason(monkeypatch):
    cpu = Target.of("cpu", torch.bfloat16, **FLASH)
    with pytest.raises(ValueError, match=r"DSA backend 'tilelang' cannot run on cpu bfloat16: "):
        Backends(dsa="tilelang").plan(cpu)
    monkeypatch.setattr(registry, "_installed", lambda package: package != "fla")
    with pytest.raises(ValueError, match=r"KDA backend 'fla' cannot run on cuda sm_90 bfloat16: needs the fla package"):
        Backends(kda="fla").plan(h100())
    # an explicit Triton DSA runs fp32 (the kernel takes it), though auto leaves fp32 to torch
    assert Backends(dsa="triton").plan(h100(torch.float32))["dsa"].reason == "asked for"
    with pytest.raises(ValueError, match="unknown MOE backend 'fast'; allowed: auto, loop, grouped"):
        moe.REGISTRY.get("fast")


def test_a_broken_package_is_passed_over_by_auto(monkeypatch):
    monkeypatch.setattr(registry, "_installed", lambda package: True)
    monkeypatch.setattr(fuse, "_inductor_runs_on_cuda", lambda: True)
    real_load = KernelBackend.load

    def load(self):
        if self.name == "tilelang":
            raise ImportError("libcuda.so: cannot open shared object file")
        return real_load(self)

    monkeypatch.setattr(KernelBackend, "load", load)
    monkeypatch.setattr(registry, "_import_failure", registry._import_failure)
    choice = dsa.REGISTRY.resolve("auto", h100())
    assert choice.name != "tilelang" and "tilelang: cannot be imported (libcuda.so" in choice.reason


def test_a_new_backend_is_one_registration():
    ops = OpRegistry("demo", auto_order=("fast", "plain"))
    ops.register(KernelBackend("plain", "glmkit.kernels.indexer.naive", "reference", reference=True))
    ops.register(KernelBackend("fast", "glmkit.kernels.indexer.naive", "fast on CUDA", verify=registry.cuda_in()))
    assert ops.names == ("auto", "plain", "fast")
    assert ops.resolve("auto", Target()).name == "plain" and ops.resolve("auto", h100()).name == "fast"
    with pytest.raises(ValueError, match="'plain' is registered already"):
        ops.register(KernelBackend("plain", "x", "again"))


def test_a_path_chooses_its_plan_once_and_again_only_when_the_model_moves(monkeypatch):
    from glmkit.config import variant_config
    from glmkit.model import Glm5Model, TrainPath
    from glmkit.model import plan as plan_module
    from glmkit.model.block import Run

    model = Glm5Model(variant_config("tiny"))
    calls = []
    real = plan_module.plan_kernels
    monkeypatch.setattr(plan_module, "plan_kernels", lambda m, b=None: calls.append(1) or real(m, b))
    path = TrainPath(model, "dsa=naive")
    first = path.forward([[1, 2, 3, 4, 5]]).logprobs
    path.forward([[5, 4, 3]])
    assert len(calls) == 1 and path.kernels.plan["dsa"].name == "naive"
    model.to(torch.float64)
    again = path.forward([[1, 2, 3, 4, 5]]).logprobs
    assert len(calls) == 2 and path.kernels.plan.target.dtype == torch.float64
    assert torch.allclose(first, again.float(), atol=1e-4)  # fp64 vs fp32 of the same weights: rounding only
    with pytest.raises(TypeError, match="Run takes a KernelPlan"):
        Run("dsa=naive")


def test_the_kernels_command_answers_which_kernel_runs_and_why():
    out = subprocess.run([sys.executable, "-m", "glmkit", "kernels", "--variant", "tiny", "--dtype", "float32"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "kernels for tiny on cpu float32:" in out.stdout
    assert "dsa      auto      -> absorbed  auto on cpu float32; passed over tilelang" in out.stdout
    assert out.stdout.splitlines()[-1].startswith("compile cache: ") and "/glmkit/compile/torch-" in out.stdout
    refused = subprocess.run([sys.executable, "-m", "glmkit", "kernels", "--moe-backend", "grouped"],
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert refused.returncode == 2
    assert refused.stderr.strip() == ("glmkit kernels: error: MOE backend 'grouped' cannot run on cpu bfloat16: "
                                      "CUDA tensors only (here: cpu)")


def test_the_fuse_mode_a_run_sets_keeps_an_asked_auto_per_call(packages_present):
    """On CUDA an asked "auto" resolves to "on" in the plan, and the run keeps the mode "auto": fused for
    the model's CUDA tensors as chosen, eager for any call on host tensors (as before the registry)."""
    assert Backends().plan(h100())["fuse"].name == "on" and Backends().plan(h100()).fuse_mode == "auto"
    assert Backends(fuse="on").plan(h100()).fuse_mode == "on"
    assert Backends(fuse="off").plan(h100()).fuse_mode == "off"
    assert Backends().plan(Target.of("cpu", torch.float32, **FLASH)).fuse_mode == "auto"  # eager there either way
