"""Decode speed of the rollout engine against the transformers reference, same run.

    python benchmarks/bench_decode.py                                  # tiny, CPU: the logic, quickly
    python benchmarks/bench_decode.py --variant GLM-5.3-Flash-4layer --device cuda --dtype bfloat16 \\
        --kda-backend fla --batches 1,8,64,256 --prompt-len 512 --steps 64 --mixed 64 --mixed-max 2048

Weights: seeded random (glmkit's synth rules) made on the device, shared with the reference. Rows:
- decode-B: B prompts of `--prompt-len` random tokens prefilled, then `--steps` greedy decode steps
  timed (after 2 warm-up steps); ms per step and tokens/s for glmkit (`RolloutEngine.step`, eager),
  glmkit with the step as a CUDA graph (`GraphedStep`, where the engine can graph it; its capture is
  timed apart) and the reference (`forward` with its cache), the ratio reference / glmkit's best.
  The prefill is timed apart, warm: a first prefill of the same shape (compiles, autotune) is
  timed as `*_prefill_first_s`, the second one is the row's prefill time and tokens/s.
- mixed: `--mixed` requests, prompts of `--prompt-len`, response lengths drawn from 16..`--mixed-max`
  (seeded), through `generate_continuous` with `--mixed-slots` slots (default: one per request) and
  `--prefill-chunk` (default: whole prompts at each join), end to end in tokens/s (graph captures
  included: each run is a new SlotBatch), against the same requests all at the mean length (fixed):
  the ratio fixed / mixed is what the target bounds. A warm-up run first steps every slot bucket
  once (compiles for each batch size stay out of both).
On the GPU each decode row also prints its limit: the bytes a step must move at the least (weights once,
the embedding's B rows and the routed experts B tokens touch under uniform routing, the caches once,
`decode_step_bytes`) over the device-to-device copy bandwidth measured at the start of the run, and
glmkit's ms per step against it (the target is 1.15x). A reference row that runs out of memory is
reported as such. Writes JSON with --out after every row.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def first_and_warm(call, device):
    """(result of the second call, seconds of the first call (compiles), seconds of the second)."""
    times = []
    for _ in range(2):
        start = time.perf_counter()
        result = call()
        sync(device)
        times.append(time.perf_counter() - start)
    return result, times[0], times[1]


def ms_per_step(step, steps, device):
    """Call step(i) for i < steps + 2: ms per call over the last `steps` (two warm-up calls)."""
    for i in range(steps + 2):
        if i == 2:
            sync(device)
            start = time.perf_counter()
        step(i)
    sync(device)
    return (time.perf_counter() - start) / steps * 1e3


def decode_step_bytes(model, config, batch: int, cache_bytes: int) -> int:
    """The bytes one decode step of `batch` requests must move at the least, for its limit: every
    weight read once, except the token embedding (`batch` rows) and the routed experts (the share that
    `batch` tokens x top-k of E touch under uniform routing, E (1 - (1 - k/E)^batch) experts a layer),
    plus every byte of the requests' caches read once."""
    experts, top_k = config.n_routed_experts, config.num_experts_per_tok
    touched = 1 - (1 - top_k / experts) ** batch
    total = cache_bytes
    for name, weight in model.named_parameters():
        size = weight.numel() * weight.element_size()
        if name == "embed_tokens.weight":
            size = min(batch, weight.shape[0]) * weight.shape[1] * weight.element_size()
        elif ".mlp.experts." in name:
            size *= touched
        total += size
    return int(total)


def copy_bandwidth(device) -> float | None:
    """Bytes a second this GPU moves in a device-to-device copy of 1 GiB (read + write), measured now:
    the bandwidth a decode step can use at best. None off the GPU."""
    if device != "cuda":
        return None
    source = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    torch.cuda.synchronize()
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        target.copy_(source)
    torch.cuda.synchronize()
    moved = 2 * source.numel() * reps / (time.perf_counter() - start)
    del source, target
    return moved


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", default="tiny")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--kda-backend", default="torch")
    parser.add_argument("--batches", default="1,8", help="decode batch sizes, comma-separated ('' for none)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--mixed", type=int, default=8, help="requests in the mixed workload (0 skips it)")
    parser.add_argument("--mixed-max", type=int, default=64)
    parser.add_argument("--mixed-slots", default="", help="slot counts of the mixed workload, comma-separated: "
                        "one mixed row each (default: --mixed)")
    parser.add_argument("--prefill-chunk", type=int, help="prompt tokens prefilled per step in the mixed workload")
    parser.add_argument("--no-reference", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.prompt_len < 1 or args.steps < 1 or args.mixed_max < 16:
        raise SystemExit("--prompt-len and --steps must be >= 1, --mixed-max >= 16")
    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    slot_counts = ([int(n) for n in args.mixed_slots.split(",") if n.strip()] or [args.mixed]) if args.mixed else []
    if any(n < 1 for n in batches + slot_counts) or (args.prefill_chunk is not None and args.prefill_chunk < 1):
        raise SystemExit("--batches, --mixed-slots and --prefill-chunk must be >= 1")

    from benchmarks.bench_gpu import share_with_reference
    from glmkit.model.synth import synth_model
    from glmkit.config import describe, variant_config
    from glmkit.model import RolloutEngine
    from glmkit.model.rollout import GraphedStep, SamplingParams

    dev, dtype = args.device, getattr(torch, args.dtype)
    config = variant_config(args.variant)
    model = synth_model(config, 0, dtype=dtype, device=dev, progress=False)
    engine = RolloutEngine(model, f"kda={args.kda_backend}")
    ref = None if args.no_reference else share_with_reference(model, config)
    bandwidth = copy_bandwidth(dev)
    print(f"{describe(config)}; {dev} {args.dtype}, KDA {args.kda_backend}"
          + (f"; device-to-device copy {bandwidth / 1e12:.2f} TB/s (the decode limits below use it)"
             if bandwidth else ""), flush=True)
    g = torch.Generator().manual_seed(0)
    rows = []
    for B in batches:
        ids = torch.randint(3, config.vocab_size, (B, args.prompt_len), generator=g).to(dev)
        row = {"row": f"decode-{B}", "batch": B, "prompt_len": args.prompt_len, "steps": args.steps}
        with torch.no_grad():
            capacity = args.prompt_len + 2 * (args.steps + 2) + 4
            (batch, logits), row["glmkit_prefill_first_s"], row["glmkit_prefill_s"] = first_and_warm(
                lambda: engine.prefill(ids.tolist(), capacity), dev)
            row["glmkit_prefill_tok_s"] = B * args.prompt_len / row["glmkit_prefill_s"]
            ours = [logits.argmax(-1)]
            row["glmkit_ms_per_step"] = row["glmkit_eager_ms_per_step"] = ms_per_step(
                lambda i: ours.append(engine.step(batch, ours[-1]).argmax(-1)), args.steps, dev)
            if engine.can_graph():  # the same batch goes on, one graph replay a step
                start = time.perf_counter()
                graphed = GraphedStep(engine, batch)
                sync(dev)
                row["graph_capture_s"] = time.perf_counter() - start
                more = [ours[-1]]
                row["glmkit_graph_ms_per_step"] = ms_per_step(lambda i: more.append(graphed(more[-1]).argmax(-1)),
                                                              args.steps, dev)
                row["glmkit_ms_per_step"] = min(row["glmkit_ms_per_step"], row["glmkit_graph_ms_per_step"])
            if ref is not None:
                try:
                    reference_row(ref, ids, ours, row, args.steps, dev)
                except torch.OutOfMemoryError:
                    row["reference"] = "OOM"
                    torch.cuda.empty_cache()
        # the limit at the steps' mean length: weights and caches moved once at the copy bandwidth
        row["step_bytes"] = decode_step_bytes(model, config, B, engine.cache_bytes(B, args.prompt_len + args.steps // 2 + 2))
        if bandwidth:
            row["limit_ms_per_step"] = row["step_bytes"] / bandwidth * 1e3
            row["over_limit"] = row["glmkit_ms_per_step"] / row["limit_ms_per_step"]
        rows.append(row)
        write(args.out, args, rows)
        graph_note = (f", eager {row['glmkit_eager_ms_per_step']:.2f} ms, graph capture {row['graph_capture_s']:.1f} s"
                      if "graph_capture_s" in row else "")
        print(f"decode B={B:4d}: glmkit {row['glmkit_ms_per_step']:8.2f} ms/step "
              f"({B / row['glmkit_ms_per_step'] * 1e3:8.0f} tok/s, prefill {row['glmkit_prefill_s']:.3f} s, "
              f"{row['glmkit_prefill_tok_s']:.0f} tok/s{graph_note})"
              + (f"   reference {row['reference_ms_per_step']:8.2f} ms/step (prefill {row['reference_prefill_s']:.3f} s)"
                 f"   ratio {row['ratio']:.2f}x, greedy tokens agree {row['greedy_agree']:.0%}"
                 if "ratio" in row else "") + ("   reference OOM" if row.get("reference") == "OOM" else ""), flush=True)
        if "limit_ms_per_step" in row:
            print(f"              limit {row['limit_ms_per_step']:.2f} ms/step ({row['step_bytes'] / 1e9:.2f} GB a step "
                  f"at the copy bandwidth): glmkit takes {row['over_limit']:.2f}x the limit (target <= 1.15x)",
                  flush=True)
    if args.mixed:
        lengths = torch.randint(16, args.mixed_max + 1, (args.mixed,), generator=g).tolist()
        prompts = torch.randint(3, config.vocab_size, (args.mixed, args.prompt_len), generator=g).tolist()
        params = SamplingParams(temperature=1.0, max_new_tokens=args.mixed_max)
        fixed = [round(sum(lengths) / len(lengths))] * args.mixed
        for slots in slot_counts:
            run = lambda limits: engine.generate_continuous(prompts, params, slots, max_new_tokens=limits,  # noqa: E731
                                                            prefill_chunk=args.prefill_chunk)
            run([1 + i % slots for i in range(args.mixed)])  # warm-up: requests leave one a step, every bucket runs
            result = {"row": f"mixed-{slots}", "requests": args.mixed, "slots": slots,
                      "prefill_chunk": args.prefill_chunk, "lengths": [16, args.mixed_max]}
            for name, limits in (("mixed", lengths), ("fixed", fixed)):
                start = time.perf_counter()
                done = run(limits)
                sync(dev)
                seconds = time.perf_counter() - start
                result[f"{name}_tok_s"] = sum(len(c.tokens) for c in done) / seconds
            result["fixed_over_mixed"] = result["fixed_tok_s"] / result["mixed_tok_s"]
            rows.append(result)
            print(f"mixed workload, {args.mixed} requests of 16-{args.mixed_max} tokens over {slots} slots"
                  f"{f', prompts in {args.prefill_chunk}-token chunks' if args.prefill_chunk else ''}: "
                  f"{result['mixed_tok_s']:.0f} tok/s; all at the mean length: {result['fixed_tok_s']:.0f} tok/s; "
                  f"fixed / mixed {result['fixed_over_mixed']:.2f}x", flush=True)
            write(args.out, args, rows)


def reference_row(ref, ids, ours, row, steps, dev):
    """The reference's warm prefill and decode steps (fed glmkit's tokens `ours`, so both decode the
    same sequences) into `row`, with the ratio and how often both sides' greedy tokens agree."""
    out, row["reference_prefill_first_s"], row["reference_prefill_s"] = first_and_warm(
        lambda: ref(input_ids=ids, use_cache=True), dev)
    cache = [out.past_key_values]
    theirs = [out.logits[:, -1].argmax(-1)]
    del out

    def reference_step(i):
        step_out = ref(input_ids=ours[i][:, None], cache=cache[0], use_cache=True)
        cache[0] = step_out.past_key_values
        theirs.append(step_out.logits[:, -1].argmax(-1))

    row["reference_ms_per_step"] = ms_per_step(reference_step, steps, dev)
    row["ratio"] = row["reference_ms_per_step"] / row["glmkit_ms_per_step"]
    # sanity: both sides predict the same next tokens (bf16 may flip a few near-ties)
    row["greedy_agree"] = (torch.stack(ours[:len(theirs)]) == torch.stack(theirs)).float().mean().item()


def write(out, args, rows):
    """The rows so far as JSON (a command cut short still leaves what it measured), written whole."""
    if out:
        tmp = Path(out).with_suffix(".tmp")
        tmp.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
        tmp.replace(out)


if __name__ == "__main__":
    main()
