"""All 45 layers of GLM-5.3-Flash at full width on one GPU, one layer in memory at a time: the
train path against the rollout path, layer by layer, at the recipe's length.

    python benchmarks/sweep_layers_gpu.py [--checkpoint DIR] [--seq-len 4096] [--decode 128]
                                          [--backends kda=fla,dsa=absorbed] [--out FILE.json]

Without --checkpoint every layer gets seeded random weights made on the GPU (glmkit's synth rules,
no disk); with it, layer i is read from the checkpoint's files (the ~320B-parameter model never has
to fit). Per layer, fed the same input streams (teacher-forced by the train path):
- train: the packed full-sequence block (chunked KDA / the DSA kernel backend / MoE);
- rollout: the first T - decode tokens prefilled into fresh caches, then `decode` tokens one per
  step through the cached decode forms (recurrent KDA, absorbed DSA over the latent cache);
and reports the relative RMS of the block outputs over all T tokens, the decode tokens alone, and
the share of routed experts that agree. bf16 rounding makes the two differ slightly; an error that
grows layer over layer, or one layer far above its neighbours, is what to look for.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from glmkit.comparison import rel_rms  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint")
    parser.add_argument("--variant", default="GLM-5.3-Flash")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--layers", type=int, help="only the first N layers")
    parser.add_argument("--backends", default="kda=fla,dsa=absorbed,moe=auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda", help="cpu runs the logic on a small variant")
    parser.add_argument("--out", default="benchmarks/results/sweep_layers.json")
    args = parser.parse_args(argv)

    from glmkit.checkpoint import open_checkpoint
    from glmkit.checkpoint.names import EMBED, layer_prefix
    from glmkit.checkpoint.synth import synth_tensor
    from glmkit.config import variant_config
    from glmkit.kernels.backends import Backends
    from glmkit.model import cast_model
    from glmkit.model.block import Carry, DecoderBlock, Run
    from glmkit.model.packed import Packed

    dtype, device = torch.bfloat16, args.device
    ckpt = open_checkpoint(args.checkpoint) if args.checkpoint else None
    config = ckpt.config if ckpt else variant_config(args.variant)
    backends = Backends.parse(args.backends)
    from glmkit.model.plan import config_target

    kernels = backends.plan(config_target(config, device, dtype))  # every layer runs this plan
    print("\n".join(kernels.explain()), flush=True)
    T, P = args.seq_len, args.seq_len - args.decode
    if not 0 < P < T:
        raise ValueError(f"--decode {args.decode} must be in 1..{T - 1}")
    ids = torch.randint(3, config.vocab_size, (T,), generator=torch.Generator().manual_seed(args.seed)).to(device)
    if ckpt:
        embed = ckpt.get(EMBED, dtype=dtype, device=device)
    else:
        embed = synth_tensor(EMBED, (config.vocab_size, config.hidden_size), args.seed, dtype, device, keep_on_device=True)
    streams = embed[ids].unsqueeze(-2).expand(-1, config.hc_mult, -1).contiguous()
    del embed
    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    packed, prompt = Packed.from_lengths([T], device=device), Packed.from_lengths([P], device=device)
    n_layers = min(args.layers or config.num_hidden_layers, config.num_hidden_layers)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save(rows, total, complete):
        """After every layer, so a run cut short still leaves the layers it finished (complete: false)."""
        tmp = out.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"seq_len": T, "decode": args.decode, "backends": str(backends),
                                   "checkpoint": args.checkpoint, "total_s": total, "complete": complete,
                                   "layers": rows}, indent=1))
        os.replace(tmp, out)

    rows, carry_train, carry_prefill = [], Carry(), Carry()  # what each path hands its next layer
    carry_steps = [Carry()] * args.decode
    start = time.perf_counter()
    for i in range(n_layers):
        t0 = time.perf_counter()
        with torch.device("meta"):
            block = cast_model(DecoderBlock(config, i), dtype)
        block = block.to_empty(device=device)
        with torch.no_grad():
            if ckpt:
                block.load_state_dict(ckpt.layer(i, dtype=dtype, device=device), strict=True)
            else:
                for name, target in block.state_dict().items():
                    target.copy_(synth_tensor(layer_prefix(i) + name, tuple(target.shape), args.seed, dtype,
                                              device, keep_on_device=True))
        t_load = time.perf_counter() - t0
        seen = {}

        def keep(layer, site, value, into):
            if site in ("router_experts", "indexer_topk"):
                into.setdefault(site, []).append(value)

        with torch.no_grad():
            t0 = time.perf_counter()
            run = Run(kernels, packed=packed, record=lambda l, s, v: keep(l, s, v, seen.setdefault("train", {})))
            train, carry_train = block(streams, run, carry_train)
            sync()
            t_train = time.perf_counter() - t0
            t0 = time.perf_counter()
            states = [None] * config.num_hidden_layers
            states[i] = (block.self_attn.empty_state(1, dtype, device) if block.kind == "kda"
                         else block.self_attn.empty_state(1, T, dtype, device))
            rolled = seen.setdefault("rollout", {})
            run = Run(kernels, packed=prompt, states=states, record=lambda l, s, v: keep(l, s, v, rolled))
            piece, carry_prefill = block(streams[:P], run, carry_prefill)
            outs = [piece]
            lengths = torch.tensor([P], device=device)
            for s in range(args.decode):
                run = Run(kernels, lengths=lengths, states=states, record=lambda l, s_, v: keep(l, s_, v, rolled))
                piece, carry_steps[s] = block(streams[P + s:P + s + 1], run, carry_steps[s])
                outs.append(piece)
                lengths = lengths + 1
            rollout = torch.cat(outs)
            sync()
            t_rollout = time.perf_counter() - t0
        row = {"layer": i, "kind": block.kind, "moe": block.is_moe, "rel_rms": rel_rms(train, rollout),
               "rel_rms_decode": rel_rms(train[P:], rollout[P:]), "load_s": t_load, "train_s": t_train,
               "rollout_s": t_rollout}
        if block.is_moe:
            a = seen["train"]["router_experts"][0].sort(-1).values
            b = torch.cat(rolled["router_experts"]).sort(-1).values
            row["experts_same"] = (a == b).all(-1).float().mean().item()
        rows.append(row)
        print(f"layer {i:2d} {block.kind} {'moe  ' if block.is_moe else 'dense'} rel RMS {row['rel_rms']:.2e} "
              f"(decode {row['rel_rms_decode']:.2e})"
              + (f" experts same {row['experts_same']:.1%}" if "experts_same" in row else "")
              + f"  load {t_load:.1f} s train {t_train:.2f} s rollout {t_rollout:.2f} s", flush=True)
        save(rows, time.perf_counter() - start, complete=False)
        streams = train  # teacher forcing by the train path
        del block, states, train, rollout, outs
        if device == "cuda":
            torch.cuda.empty_cache()
    total = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    print(f"{n_layers} layers in {total:.1f} s (peak {peak:.1f} GiB)")
    save(rows, total, complete=True)

if __name__ == "__main__":
    main()
