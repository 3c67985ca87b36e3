"""GLM-5.3-Flash-4layer at full width on one GPU: glmkit against the transformers reference, same run.

    python benchmarks/bench_gpu.py [--rows kernels,train,forward,prefill,logprob-diff] [--reference-rows NAMES]
                                   [--backends kda=fla,dsa=auto,moe=auto] [--out FILE.json]

Weights: seeded random (glmkit's synth rules) made on the GPU in bf16, no disk; the reference gets
the very same tensors (shared, not copied, except its fused short conv). Every row times warm calls:
the first call of a shape (kernel compiles, autotune) is reported apart as `first_s`. Peak memory is
torch's max allocated over the row, weights (and gradients, for training) included. A row that runs
out of memory is reported as OOM; glmkit's training rows retry with per-block recompute when the
plain run does not fit (`recompute` in the row).

Rows
Rows run in the order forward, prefill, logprob-diff, train (kernels first when asked).

- train  forward + backward of the summed next-token log-prob (the LM head included) over one
         sequence of T, and over 8 packed sequences of T/8 (the reference: a batch of 8), T in
         4096, 8192, 16384, 32768; every parameter receives its gradient.
- forward  one sequence, no autograd, T in 8192, 32768, 131072.
- prefill  B prompts of 512 tokens into the rollout caches (the reference: use_cache=True), B in 8, 64.
- logprob-diff  the bf16 train-vs-rollout log-prob abs diff the recipe's health check reads: 8
         prompts of 512 random tokens, 512 tokens sampled at temperature 1 by the rollout engine
         (routing and DSA selections recorded), then the train path over the same sequences with
         routing replay (R3) and with both replays; mean |train - rollout| over the response tokens
         (the recipe's healthy bf16 range: 0.0068 - 0.0106). glmkit only.
- kernels  sparse MLA alone at T = 4096 (selection width 2063, 64 heads, latent 512) forward and
         forward+backward, in TFLOP/s counted over the selected keys:
             forward  4 * H * R * S   (scores 2R, probabilities x latents 2R per selected key and head)
             backward 10 * H * R * S  (scores recomputed, dP, dQ, and the two latent products)
         with S = the number of (query, selected key) pairs and R = 512; and KDA through glmkit's fla
         entry against fla's own chunk_kda on the same inputs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

GIB = 2 ** 30
TRAIN_T = (4096, 8192, 16384, 32768)
FORWARD_T = (8192, 32768, 131072)
PREFILL_B = (8, 64)


def sync():
    torch.cuda.synchronize()


def measure(fn, repeat: int) -> dict:
    """Warm-up call (timed apart), then `repeat` timed calls; peak memory over all of them."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    try:
        start = time.perf_counter()
        fn()
        sync()
        first = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        sync()
        seconds = (time.perf_counter() - start) / repeat
    except torch.OutOfMemoryError:
        gc.collect()
        torch.cuda.empty_cache()
        return {"status": "OOM"}
    return {"status": "ok", "s": seconds, "first_s": first, "peak_gib": torch.cuda.max_memory_allocated() / GIB}


# ---- models ------------------------------------------------------------------------------------
def build_glmkit(config, seed: int, dtype):
    from glmkit.model.synth import synth_model

    return synth_model(config, seed, dtype=dtype, device="cuda")


def share_with_reference(model, config):
    """transformers' Glm5NextForConditionalGeneration over glmkit's tensors (its in-memory names)."""
    from glmkit.reference import _block_fla_on_cpu

    _block_fla_on_cpu()
    import transformers
    from transformers import Glm5NextForConditionalGeneration

    from glmkit.config import full_config

    transformers.logging.set_verbosity_error()
    cfg = full_config(config)
    cfg.text_config._attn_implementation = "sdpa"
    with torch.device(model.device):
        ref = Glm5NextForConditionalGeneration._from_config(cfg, dtype=model.dtype, attn_implementation="sdpa")
    state = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if name == "lm_head.weight":
            state[name] = tensor
            continue
        layer_name = name
        for part in ("f_a_proj", "f_b_proj", "dt_bias", "A_log"):
            layer_name = layer_name.replace(f"self_attn.{part}", f"self_attn.forget_gate.{part}")
        for site in ("attn", "ffn"):
            for field in ("fn", "base", "scale"):
                layer_name = layer_name.replace(f"hc_{site}_{field}", f"{site}_hc.{field}")
        if "_conv1d." in name:
            continue
        state["model.language_model." + layer_name] = tensor
    for block in model.layers:
        if block.kind == "kda":
            a = block.self_attn
            state[f"model.language_model.layers.{block.layer}.self_attn.conv1d.weight"] = torch.cat(
                [a.q_conv1d.weight, a.k_conv1d.weight, a.v_conv1d.weight]).detach()
    missing, unexpected = ref.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not k.startswith("model.visual.")]
    if missing or unexpected:
        raise RuntimeError(f"reference weights do not line up: missing {missing[:5]}, unexpected {unexpected[:5]}")
    return ref.eval()


# ---- rows --------------------------------------------------------------------------------------
def token_batch(vocab, n, length, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(3, vocab, (n, length), generator=g, device="cuda")


def glmkit_train(model, backends, ids, recompute):
    from glmkit.model import TrainPath

    path = TrainPath(model, backends, recompute=recompute)
    seqs = list(ids)

    def step():
        model.zero_grad(set_to_none=True)
        path.forward(seqs).logprobs.sum().backward()
    return step


def reference_train(ref, ids):
    def step():
        ref.zero_grad(set_to_none=True)
        logits = ref(input_ids=ids).logits[:, :-1].float()
        torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).sum().backward()
    return step


def glmkit_forward(model, backends, ids):
    """The final hidden states (no LM head), as the reference's text model returns them."""
    from glmkit.model.block import Run
    from glmkit.model.packed import Packed
    from glmkit.model.plan import plan_kernels

    kernels = plan_kernels(model, backends)

    @torch.no_grad()
    def step():
        model.hidden(ids.flatten(), Run(kernels, packed=Packed.from_lengths([ids.shape[1]] * ids.shape[0], device="cuda")))
    return step


def reference_forward(ref, ids):
    @torch.no_grad()
    def step():
        ref.model.language_model(input_ids=ids)
    return step


def glmkit_prefill(model, backends, ids):
    from glmkit.model import RolloutEngine

    engine = RolloutEngine(model, backends)
    prompts = list(ids)
    return lambda: engine.prefill(prompts, capacity=ids.shape[1] + 64)


def reference_prefill(ref, ids):
    @torch.no_grad()
    def step():
        ref(input_ids=ids, use_cache=True)
    return step


def logprob_diff_row(model, backends, prompts=8, prompt_len=512, new_tokens=512) -> dict:
    from glmkit.model import RolloutEngine, TrainPath
    from glmkit.model.rollout import SamplingParams
    from glmkit.rl.loop import pack_completions

    ids = token_batch(model.config.vocab_size, prompts, prompt_len, seed=1)
    start = time.perf_counter()
    completions = RolloutEngine(model, backends).generate(
        ids.tolist(), SamplingParams(temperature=1.0, max_new_tokens=new_tokens), seed=0, record_routing=True,
        record_topk=True)
    sync()
    generate_s = time.perf_counter() - start
    input_ids, packed, mask, rollout_logp, routing, topk = pack_completions(completions, model.device)
    row = {"row": "logprob-diff", "prompts": prompts, "prompt_len": prompt_len, "new_tokens": new_tokens,
           "generate_s": generate_s, "response_tokens": int(mask.sum())}
    path = TrainPath(model, backends)
    with torch.no_grad():
        for label, replay in (("r3", dict(routing=routing)), ("r3+topk", dict(routing=routing, topk_replay=topk)),
                              ("none", {})):
            train = path.forward(input_ids=input_ids, packed=packed, **replay).logprobs.float().cpu()
            diff = (train - rollout_logp).abs()[mask]
            row[label] = {"mean": diff.mean().item(), "max": diff.max().item()}
    return row


def kernel_rows(config, repeat):
    """Sparse MLA core at T = 4096 with a realistic selection; KDA entry vs fla's own."""
    from glmkit.kernels.dsa import absorbed
    from glmkit.model.indexer import LightningIndexer

    rows = []
    T, H, R = 4096, config.num_attention_heads, config.kv_lora_rank
    with torch.device("meta"):
        indexer = LightningIndexer(config)
    g = torch.Generator(device="cuda").manual_seed(0)
    scores = torch.rand(T, T // config.index_kpool, generator=g, device="cuda")
    idx = indexer._expand(scores, torch.arange(1, T + 1, device="cuda"))
    selected = int((idx >= 0).sum())
    q = (torch.randn(T, H, R, generator=g, device="cuda") * R ** -0.5).bfloat16().requires_grad_()
    lat = torch.randn(T, R, generator=g, device="cuda").bfloat16().requires_grad_()
    scale = config.qk_nope_head_dim ** -0.5
    bounds = [(0, T)]
    fwd_flop, bwd_flop = 4 * H * R * selected, 10 * H * R * selected

    @torch.no_grad()
    def forward():
        absorbed.SparseMQA.apply(q, lat, idx, bounds, scale)

    out = absorbed.SparseMQA.apply(q, lat, idx, bounds, scale)
    grad = torch.randn_like(out)

    def backward_only():
        torch.autograd.grad(out, (q, lat), grad, retain_graph=True)

    f, b = measure(forward, repeat), measure(backward_only, repeat)
    rows.append({"row": "kernel sparse-mla", "T": T, "width": idx.shape[1], "selected_pairs": selected,
                 "forward": f, "backward": b,
                 "forward_tflops": fwd_flop / f["s"] / 1e12 if f["status"] == "ok" else None,
                 "backward_tflops": bwd_flop / b["s"] / 1e12 if b["status"] == "ok" else None})
    del out, grad, q, lat
    try:
        from fla.ops.kda import chunk_kda

        from glmkit.kernels.kda import get_backend
    except ImportError as err:
        rows.append({"row": "kernel kda", "status": f"skipped: {err}"})
        return rows
    ours = get_backend("fla")
    Hk, K = config.linear_num_heads, config.linear_head_dim
    for T in (4096, 8192):
        r = lambda *s: torch.randn(*s, generator=g, device="cuda").bfloat16()  # noqa: E731
        qk, kk, vk = r(1, T, Hk, K), r(1, T, Hk, K), r(1, T, Hk, K)
        gk = (-5 * torch.sigmoid(r(1, T, Hk, K).float())).bfloat16()
        beta = torch.rand(1, T, Hk, generator=g, device="cuda").bfloat16()
        cu = torch.tensor([0, T], device="cuda")
        args = dict(use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        a = measure(lambda: ours.chunk_kda(qk, kk, vk, gk, beta, **args), repeat)
        b = measure(lambda: chunk_kda(qk, kk, vk, g=gk, beta=beta, **args), repeat)
        rows.append({"row": "kernel kda-forward", "T": T, "glmkit": a, "fla": b,
                     "ratio": b["s"] / a["s"] if "s" in a and "s" in b else None})
    return rows


def fmt(m):
    if not m:
        return "-"
    if m.get("status") != "ok":
        return m.get("status", "-")
    return f"{m['s'] * 1e3:9.1f} ms {m['peak_gib']:6.1f} GiB (first {m['first_s']:.1f} s)"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="kernels,train,forward,prefill,logprob-diff")
    parser.add_argument("--reference-rows", default="train-4096x1,train-4096x8,train-8192x1,forward-8192,"
                        "forward-32768,prefill-8x512,prefill-64x512",
                        help="rows the reference also runs ('all' or 'none')")
    parser.add_argument("--backends", default="kda=fla,dsa=auto,moe=auto")
    parser.add_argument("--sparse-backward", choices=("torch", "triton"), default=None,
                        help="backward of the Triton sparse-MLA forward (default: the kernel module's choice)")
    parser.add_argument("--train-t", default=",".join(map(str, TRAIN_T)))
    parser.add_argument("--forward-t", default=",".join(map(str, FORWARD_T)))
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=float("inf"),
                        help="start no new row after this many seconds (the rest are listed as not run)")
    parser.add_argument("--out", default="benchmarks/results/gpu.json")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                        help="override a config field of the 4-layer slice (e.g. for a smaller smoke run)")
    args = parser.parse_args(argv)

    from glmkit.config import describe, variant_config
    from glmkit.kernels.backends import Backends

    overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    config = variant_config("GLM-5.3-Flash-4layer", **overrides)
    backends = Backends.parse(args.backends)
    if args.sparse_backward:
        from glmkit.kernels.dsa import sparse_triton

        sparse_triton.TRITON_BACKWARD = args.sparse_backward == "triton"
    wanted = set(args.rows.split(","))
    ref_rows = args.reference_rows
    props = torch.cuda.get_device_properties(0)
    header = {"date": time.strftime("%Y-%m-%d"), "gpu": props.name, "gpu_mem_gib": props.total_memory / GIB,
              "torch": torch.__version__, "config": describe(config), "backends": str(backends),
              "sparse_backward": args.sparse_backward,
              "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])}
    print(json.dumps(header))
    results = {"header": header, "rows": [], "complete": False}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(results, indent=1))
        os.replace(tmp, out)

    def add(row):
        results["rows"].append(row)
        save()
        g, r = row.get("glmkit"), row.get("reference")
        ratio = row.get("ratio")
        print(f"{row['row']:22s} glmkit {fmt(g):45s} reference {fmt(r):45s}"
              + (f" ratio {ratio:5.2f}x" if ratio else "") + (" [recompute]" if (g or {}).get("recompute") else ""),
              flush=True)

    if "kernels" in wanted:
        for row in kernel_rows(config, args.repeat):
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
        save()

    t0 = time.perf_counter()
    model = build_glmkit(config, 0, torch.bfloat16)
    print(f"glmkit model on the GPU in {time.perf_counter() - t0:.1f} s "
          f"({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters)", flush=True)
    ref = None
    if ref_rows != "none":
        t0 = time.perf_counter()
        ref = share_with_reference(model, config)
        print(f"reference shares the weights ({time.perf_counter() - t0:.1f} s)", flush=True)
    V = config.vocab_size

    def with_reference(name):
        return ref is not None and (ref_rows == "all" or name in ref_rows.split(","))

    began = time.perf_counter()

    def row(name, tokens, ours, theirs, **extra):
        if time.perf_counter() - began > args.budget_s:
            add({"row": name, "tokens": tokens, "glmkit": {"status": "not run (time budget)"}})
            return
        g = ours()
        if with_reference(name):  # glmkit's side is on disk before the reference's first call compiles
            results["rows"].append({"row": name, "tokens": tokens, "glmkit": g, "reference": {"status": "running"}})
            save()
            r = theirs()
            results["rows"].pop()
        else:
            r = None
        entry = {"row": name, "tokens": tokens, "glmkit": g, "reference": r, **extra}
        for side, m in (("glmkit", g), ("reference", r)):
            if m and m.get("status") == "ok":
                m["tok_s"] = tokens / m["s"]
        if g and r and g.get("status") == r.get("status") == "ok":
            entry["ratio"] = r["s"] / g["s"]
            entry["memory_fraction"] = g["peak_gib"] / r["peak_gib"]
        add(entry)

    if "forward" in wanted:
        for T in map(int, args.forward_t.split(",")):
            ids = token_batch(V, 1, T)
            row(f"forward-{T}", T, lambda: measure(glmkit_forward(model, backends, ids), args.repeat),
                lambda: measure(reference_forward(ref, ids), args.repeat))
    if "prefill" in wanted:
        for B in PREFILL_B:
            ids = token_batch(V, B, 512)
            row(f"prefill-{B}x512", B * 512, lambda: measure(glmkit_prefill(model, backends, ids), args.repeat),
                lambda: measure(reference_prefill(ref, ids), args.repeat))
    if "logprob-diff" in wanted:
        entry = logprob_diff_row(model, backends)
        results["rows"].append(entry)
        save()
        print(f"logprob-diff           {entry['response_tokens']} response tokens (generate {entry['generate_s']:.1f} s): "
              + ", ".join(f"{k} mean {entry[k]['mean']:.4f} max {entry[k]['max']:.3f}" for k in ("r3", "r3+topk", "none")),
              flush=True)
    if "train" in wanted:
        for T in map(int, args.train_t.split(",")):
            for n in (1, 8):
                ids = token_batch(V, n, T // n)
                state = {}

                def ours():
                    m = measure(glmkit_train(model, backends, ids, False), args.repeat)
                    if m["status"] == "OOM":
                        state["recompute"] = True
                        m = measure(glmkit_train(model, backends, ids, True), args.repeat)
                        m["recompute"] = True
                    return m

                row(f"train-{T}x{n}", T, ours, lambda: measure(reference_train(ref, ids), args.repeat))
                results["rows"][-1]["recompute"] = state.get("recompute", False)
                save()
                model.zero_grad(set_to_none=True)
    results["complete"] = True
    save()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
