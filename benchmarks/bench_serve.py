"""Load on `glmkit serve` over loopback: N concurrent clients, bounded in count and time.

    python benchmarks/bench_serve.py [--checkpoint DIR] [--device cpu|cuda] [--clients 16]
                                     [--requests 64] [--max-new-tokens 32] [--time-limit-s 120]
                                     [--teacher-forced 4 --teacher-len 8192] [--out FILE.json]

Starts the server as its own process (default: the shipped tiny checkpoint on the CPU), then
`--clients` threads send `--requests` single-prompt requests in all (random prompts of 8-64 tokens,
temperature 1, fixed lengths: stop tokens off), each thread one request at a time. Reports
requests/s, output tokens/s, p50 / p99 latency, and what was lost (a request without an answer of the
asked length counts as lost; the run fails if any is). For scale, the same prompts run through the
in-process engine in batches of the server's size, in this process: the ratio is the server's
tokens/s over the engine's (the price of HTTP, JSON and the batching window).
With `--teacher-forced N`, N prompts of `--teacher-len` tokens are then sent together as one
teacher-forced request (max_new_tokens 0, log-probs of every prompt token): its time, and the largest
difference of its log-probs from the train path's in this process (the server takes them from the
prefill's hidden states a few hundred rows at a time; the vocabulary never sits whole in memory for
all tokens).
On the GPU: synthesise the 4-layer slice first (`glmkit ckpt synth --variant GLM-5.3-Flash-4layer
--device cuda --out DIR`) and pass `--checkpoint DIR --device cuda`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def start_server(checkpoint, device, max_batch, kda_backend):
    proc = subprocess.Popen([sys.executable, "-m", "glmkit", "serve", "--checkpoint", str(checkpoint), "--port", "0",
                             "--device", device, "--max-batch-size", str(max_batch), "--kda-backend", kda_backend],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    seen = []  # what the server printed before it listened: its error, when it does not start
    line = proc.stdout.readline()
    while line and "on http://" not in line:
        seen.append(line)
        line = proc.stdout.readline()
    if "on http://" not in line:
        proc.kill()
        raise RuntimeError("server did not start; its last output:\n" + "".join(seen[-20:]))
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return proc, line.split(" on ")[1].split()[0]


def teacher_forced(client, vocab: int, count: int, length: int) -> dict:
    """`count` prompts of `length` random tokens in one teacher-forced request -> time and log-probs."""
    import torch

    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, vocab, (length,), generator=g).tolist() for _ in range(count)]
    start = time.perf_counter()
    answers = client.generate(input_ids=prompts, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                              logprob_start_len=0)
    seconds = time.perf_counter() - start
    logprobs = [[lp for lp, _, _ in a["meta_info"]["input_token_logprobs"][1:]] for a in answers]
    return {"prompts": prompts, "logprobs": logprobs, "seconds": seconds, "tokens_per_s": count * length / seconds}


def compare_with_train_path(model, prompts, logprobs, backends) -> dict:
    """The server's teacher-forced log-probs against TrainPath's, one prompt at a time."""
    import torch

    from glmkit.model import TrainPath

    path, worst, total, n = TrainPath(model, backends), 0.0, 0.0, 0
    with torch.no_grad():
        for prompt, got in zip(prompts, logprobs):
            want = path.forward([prompt]).logprobs[:-1].float().cpu()
            diff = (torch.tensor(got) - want).abs()
            worst, total, n = max(worst, float(diff.max())), total + float(diff.sum()), n + diff.numel()
    return {"max_abs_diff": worst, "mean_abs_diff": total / max(n, 1)}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=str(ROOT / "glmkit" / "assets" / "tiny_start"))
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--time-limit-s", type=float, default=120.0)
    parser.add_argument("--kda-backend", choices=["torch", "fla"],
                        help="both sides' KDA kernels (default: fla on cuda, torch on cpu)")
    parser.add_argument("--teacher-forced", type=int, default=0, metavar="N")
    parser.add_argument("--teacher-len", type=int, default=8192)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    args.kda_backend = args.kda_backend or ("fla" if args.device == "cuda" else "torch")
    for name in ("clients", "requests", "max_new_tokens", "max_batch"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1")

    import torch

    from glmkit.serve.client import SGLangClient, SGLangError

    proc, url = start_server(args.checkpoint, args.device, args.max_batch, args.kda_backend)
    try:
        client = SGLangClient(url, timeout_s=args.time_limit_s, retries=0)
        from glmkit.checkpoint import open_checkpoint

        vocab = open_checkpoint(args.checkpoint).config.vocab_size
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist()
                   for n in torch.randint(8, 65, (args.requests,), generator=g)]
        # warm-up: the first request compiles kernels (fla's autotuning, inductor); it took over 120 s on a
        # fresh H100 with --kda-backend fla, so it has its own bound, not the load's
        SGLangClient(url, timeout_s=max(1800.0, args.time_limit_s), retries=0).generate(
            input_ids=prompts[0], sampling_params={"max_new_tokens": 2})
        latencies, lost, next_index, lock = [], [], iter(range(args.requests)), threading.Lock()
        deadline = time.perf_counter() + args.time_limit_s
        sampling = {"max_new_tokens": args.max_new_tokens, "temperature": 1.0, "ignore_eos": True}

        def worker():
            while time.perf_counter() < deadline:
                with lock:
                    i = next(next_index, None)
                if i is None:
                    return
                start = time.perf_counter()
                try:
                    answer = client.generate(input_ids=prompts[i], sampling_params=sampling)
                    ok = len(answer["output_ids"]) == args.max_new_tokens
                except SGLangError as err:
                    ok, answer = False, str(err)
                with lock:
                    (latencies.append(time.perf_counter() - start) if ok else lost.append((i, answer)))

        began = time.perf_counter()
        threads = [threading.Thread(target=worker) for _ in range(args.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - began
        served = len(latencies)
        after = client.server_info()["internal_states"][0]
        teacher = teacher_forced(client, vocab, args.teacher_forced, args.teacher_len) if args.teacher_forced else None
    finally:
        proc.kill()
        proc.wait(30)

    from glmkit.model import RolloutEngine, load_model
    from glmkit.model.rollout import SamplingParams

    engine = RolloutEngine(load_model(args.checkpoint, device=args.device), f"kda={args.kda_backend}")
    params = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens)
    engine.generate(prompts[:1], SamplingParams(max_new_tokens=2))
    start = time.perf_counter()
    for s in range(0, served, args.max_batch):
        engine.generate(prompts[s:s + args.max_batch], params)
    if args.device == "cuda":
        torch.cuda.synchronize()
    engine_s = time.perf_counter() - start

    if teacher is not None:
        teacher.update(compare_with_train_path(engine.model, teacher.pop("prompts"), teacher.pop("logprobs"),
                                               f"kda={args.kda_backend}"))
    unsent = args.requests - served - len(lost)
    q = sorted(latencies)
    result = {"checkpoint": args.checkpoint, "device": args.device, "clients": args.clients,
              "requests": args.requests, "served": served, "lost": len(lost), "unsent_at_time_limit": unsent,
              "wall_s": wall, "requests_per_s": served / wall, "tokens_per_s": served * args.max_new_tokens / wall,
              "latency_p50_s": statistics.median(q) if q else None,
              "latency_p99_s": q[min(len(q) - 1, int(0.99 * len(q)))] if q else None,
              "engine_batches": after["engine_batches"], "in_process_tokens_per_s":
              served * args.max_new_tokens / engine_s if served else None}
    if served:
        result["ratio"] = result["tokens_per_s"] / result["in_process_tokens_per_s"]
    print(f"{served}/{args.requests} requests from {args.clients} clients in {wall:.1f} s: "
          f"{result['requests_per_s']:.1f} req/s, {result['tokens_per_s']:.0f} tok/s, "
          f"p50 {result['latency_p50_s'] or 0:.3f} s, p99 {result['latency_p99_s'] or 0:.3f} s, "
          f"lost {len(lost)}, not sent (time limit) {unsent}; {after['engine_batches']} engine calls")
    if served:
        print(f"in-process engine, same prompts in batches of {args.max_batch}: "
              f"{result['in_process_tokens_per_s']:.0f} tok/s; server / in-process: {result['ratio']:.2f}x")
    if teacher is not None:
        result["teacher_forced"] = teacher
        print(f"teacher-forced: {args.teacher_forced} x {args.teacher_len} tokens in one request, "
              f"{teacher['seconds']:.2f} s ({teacher['tokens_per_s']:.0f} tok/s); max |log-prob - train path's| "
              f"{teacher['max_abs_diff']:.3e}, mean {teacher['mean_abs_diff']:.3e}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    if lost:
        print(f"lost requests, first: {lost[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
