"""Tiny variant on the CPU: glmkit's train path (forward + backward) and rollout decode, each as a
ratio against the transformers reference measured in the same run.

    python benchmarks/bench_paths.py [--variant tiny] [--device cpu|cuda] [--dtype float32|bfloat16]
                                        [--kda-backend torch|fla] [--batch 4] [--seq-len 256] [--new-tokens 64]

Train: B sequences of T tokens, log-prob loss, forward + backward. glmkit packs them (no padding);
the reference runs the same batch unpadded. Decode: prefill B prompts of T/2 tokens, then N greedy
decode steps; the reference uses its own DynamicCache, fed the same tokens.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from glmkit.reference import _block_fla_on_cpu  # noqa: E402

_block_fla_on_cpu()


def timed(fn, repeat: int, device: str) -> float:
    fn()  # warm-up (kernel compile / autotune, allocator)
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeat


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", default="tiny")
    parser.add_argument("--checkpoint", help="use this checkpoint instead of synthesising --variant")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kda-backend", default="torch")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                        help="override a config field of --variant, e.g. --set hidden_size=1024")
    args = parser.parse_args(argv)

    import json

    from glmkit.checkpoint import synth_checkpoint
    from glmkit.config import describe, variant_config
    from glmkit.model import RolloutEngine, TrainPath, load_model
    from glmkit.reference import left_pad, load_reference

    dtype = getattr(torch, args.dtype)
    overrides = {k: json.loads(v) for k, v in (item.split("=", 1) for item in args.set)}
    config = variant_config(args.variant, **overrides)
    path = args.checkpoint or synth_checkpoint(config, 0, Path(tempfile.mkdtemp()) / "ckpt", progress=False)
    ref = load_reference(path, dtype, args.device)
    model = load_model(path, dtype, args.device)
    V = model.config.vocab_size
    print(f"{describe(model.config)}; {args.device} {args.dtype}, KDA backend {args.kda_backend}")
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(3, V, (args.batch, args.seq_len), generator=g)
    ids = seqs.to(args.device)
    train = TrainPath(model, args.kda_backend)

    def ours_train():
        model.zero_grad(set_to_none=True)
        out = train.forward(seqs.tolist())
        out.logprobs.sum().backward()

    def ref_train():
        ref.zero_grad(set_to_none=True)
        logits = ref(input_ids=ids).logits[:, :-1].float()
        torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).sum().backward()

    tokens = args.batch * args.seq_len
    t_ours = timed(ours_train, args.repeat, args.device)
    print(f"  glmkit train step {t_ours * 1e3:.1f} ms", flush=True)
    t_ref = timed(ref_train, args.repeat, args.device)
    print(f"train fwd+bwd  B={args.batch} T={args.seq_len}: glmkit {tokens / t_ours:10.0f} tok/s  "
          f"reference {tokens / t_ref:10.0f} tok/s  ratio {t_ref / t_ours:5.2f}x", flush=True)

    prompts = seqs[:, :args.seq_len // 2].tolist()
    feed = torch.randint(3, V, (args.batch, args.new_tokens), generator=g)
    engine = RolloutEngine(model, args.kda_backend)

    def ours_decode():
        batch, _ = engine.prefill(prompts, args.seq_len // 2 + args.new_tokens)
        for s in range(args.new_tokens):
            engine.step(batch, feed[:, s].to(args.device))

    @torch.no_grad()
    def ref_decode():
        p_ids, mask = left_pad(prompts, model.config.pad_token_id, args.device)
        out = ref(input_ids=p_ids, attention_mask=mask, use_cache=True)
        cache = out.cache
        for s in range(args.new_tokens):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
            cache = ref(input_ids=feed[:, s:s + 1].to(args.device), attention_mask=mask, cache=cache,
                        use_cache=True).cache

    new = args.batch * args.new_tokens
    d_ours = timed(ours_decode, args.repeat, args.device)
    print(f"  glmkit prefill+decode {d_ours * 1e3:.1f} ms", flush=True)
    d_ref = timed(ref_decode, args.repeat, args.device)
    print(f"rollout prefill+decode B={args.batch} prompt={args.seq_len // 2} new={args.new_tokens}: "
          f"glmkit {new / d_ours:8.0f} tok/s  reference {new / d_ref:8.0f} tok/s  ratio {d_ref / d_ours:5.2f}x")


if __name__ == "__main__":
    main()
