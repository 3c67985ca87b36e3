"""CUDA-only checks, run on the device machine (CI has no GPU, so they are skipped there and the
closing notes say so): the fla backend against the torch reference, and both paths on the GPU.

Tolerances: fla's kernels run fp32 inputs through tf32/bf16-accumulated tiles, so outputs agree with
the fp32 torch reference to a relative RMS of 5e-3 (fla's own test bound for bf16 kernels vs an fp32
reference); bf16 inputs get the same bound.
"""

from __future__ import annotations

import pytest
import torch

from glmkit.kernels.kda import get_backend, naive

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
RATIO = 5e-3


def rel_rms(ref, x):
    return ((ref.float() - x.float()).norm() / ref.float().norm()).item()


def kda_inputs(T, H=4, K=64, lengths=None, dtype=torch.float32):
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g, device="cuda")  # noqa: E731
    q, k, v = r(1, T, H, K), r(1, T, H, K), r(1, T, H, K)
    gate = -5 * torch.sigmoid(r(1, T, H, K))
    beta = torch.rand(1, T, H, generator=g, device="cuda")
    cu = None if lengths is None else torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda")
    return [t.to(dtype) for t in (q, k, v, gate, beta)], cu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fla_chunk_matches_torch_reference(dtype):
    fla = get_backend("fla")
    lengths = [100, 1, 300, 64]
    (q, k, v, g, beta), cu = kda_inputs(sum(lengths), lengths=lengths, dtype=dtype)
    args = dict(output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    o_ref, s_ref = naive.chunk_kda(q.float(), k.float(), v.float(), g.float(), beta.float(), **args)
    o, s = fla.chunk_kda(q, k, v, g, beta, **args)
    print(f"fla chunk_kda {dtype}: rel RMS o {rel_rms(o_ref, o):.2e}, state {rel_rms(s_ref, s):.2e}")
    assert rel_rms(o_ref, o) < RATIO and rel_rms(s_ref, s) < RATIO


def test_fla_recurrent_step_matches_torch_reference():
    fla = get_backend("fla")
    (q, k, v, g, beta), _ = kda_inputs(1, H=4, K=64)
    B = 8
    q, k, v, g = (t.expand(B, -1, -1, -1)[:, 0].contiguous() + 0.1 * torch.randn(B, 4, 64, device="cuda")
                  for t in (q, k, v, g))
    g = -torch.rand_like(g)
    q, k = naive.l2norm(q) * 64 ** -0.5, naive.l2norm(k)
    beta = torch.rand(B, 4, device="cuda")
    state = torch.randn(B, 4, 64, 64, device="cuda")
    o_ref, s_ref = naive.recurrent_step(q, k, v, g, beta, state.clone())
    o, s = fla.recurrent_step(q, k, v, g, beta, state.clone())
    print(f"fla fused_recurrent step: rel RMS o {rel_rms(o_ref, o):.2e}, state {rel_rms(s_ref, s):.2e}")
    assert rel_rms(o_ref, o) < RATIO and rel_rms(s_ref, s) < RATIO


def test_model_paths_on_cuda_with_fla(tiny_ckpt):
    """Train and rollout with the fla backend against the torch backend on the GPU (fp32 weights), and
    train vs rollout log-probs after a greedy rollout."""
    from glmkit.model import RolloutEngine, SamplingParams, TrainPath, load_model

    model = load_model(tiny_ckpt, device="cuda")
    prompts = [list(range(3, 80)), list(range(100, 113)), [7, 8, 9]]
    with torch.no_grad():
        ref = TrainPath(model, "torch").forward(prompts, return_logits=True)
        fast = TrainPath(model, "fla").forward(prompts, return_logits=True)
    print(f"train logits fla vs torch: rel RMS {rel_rms(ref.logits, fast.logits):.2e}")
    assert rel_rms(ref.logits, fast.logits) < RATIO
    params = SamplingParams(temperature=0, max_new_tokens=16)
    outs = {b: RolloutEngine(model, b).generate(prompts, params) for b in ("torch", "fla")}
    for backend, completions in outs.items():
        with torch.no_grad():
            rescored = TrainPath(model, backend).forward([c.prompt + c.tokens for c in completions])
        worst = max((rescored.logprobs[s + len(c.prompt) - 1:e - 1].cpu() - torch.tensor(c.logprobs)).abs().max().item()
                    for c, (s, e) in zip(completions, rescored.packed.bounds()))
        print(f"{backend}: train vs rollout log-prob max |diff| {worst:.2e}")
        assert worst < (1e-4 if backend == "torch" else 2e-2)
