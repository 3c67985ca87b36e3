"""The first call of a shape in a new process, with glmkit's compile cache cold and then warm.

    python benchmarks/bench_first_call.py [--paths forward,train,decode] [--cache-dir DIR] [--out FILE]

What a user waits for before a notebook cell, a CLI run or the server answers: each path runs in a new
process twice over one compile cache folder (`GLMKIT_CACHE_DIR`, see glmkit/kernels/compile_cache.py),
first empty (cold: every graph, Triton binary, autotune choice and TileLang kernel is made), then as
the first run left it (warm). Paths, on `GLM-5.3-Flash-4layer` at full width in bf16 with the
default GPU backends and `kda=fla`:

- forward  one sequence of 8192 tokens, no autograd
- train    forward + backward of the summed log-probs over one sequence of 4096 tokens
- decode   8 prompts of 512 tokens prefilled, one eager decode step, the step captured as a CUDA
           graph and replayed once (what the server does before its first answer)

Each child reports the model's build apart (seeded random weights made on the GPU; a real checkpoint
loads instead) and the first and second calls; the table shows the first call against the targets
(<= 20 s warm, <= 90 s cold). Without --cache-dir each path gets its own new folder, removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PATHS = ("forward", "train", "decode")
TARGET_S = {"cold": 90.0, "warm": 20.0}
MARK = "FIRST_CALL "
AUTOTUNED = re.compile(r"Triton autotuning for function (\S+?),?\s.*?finished after ([0-9.]+)s", re.S)
BACKENDS = "kda=fla,dsa=auto,moe=auto"


def record_autotune_keys() -> list:
    """Every Triton autotune's disk-cache lookup of this process, as a list that fills as they happen:
    {function, hit, key_text}, key_text being the exact text Triton hashes into the cache file's name
    (its build, the GPU backend, the function's source key, the cache-invalidating environment, the
    tuning key, the configs), caught where Triton's autotuner hashes it, so a miss in a warm process
    shows what moved since the cold one whatever Triton version builds the key."""
    import hashlib

    from triton.runtime import autotuner

    seen, last = [], {}

    class HashRecorder:  # the autotuner module's `hashlib`: records what it hashes, hashes as before
        def __getattr__(self, name):
            return getattr(hashlib, name)

        def sha256(self, data=b"", *args, **kwargs):
            last["key_text"] = data.decode("utf-8", "replace") if isinstance(data, bytes) else str(data)
            return hashlib.sha256(data, *args, **kwargs)

    original = autotuner.Autotuner.check_disk_cache

    def check_disk_cache(self, tuning_key, configs, bench_fn):
        last.clear()
        hit = original(self, tuning_key, configs, bench_fn)
        fn = self.fn
        while hasattr(fn, "fn"):
            fn = fn.fn
        seen.append({"function": getattr(fn, "__name__", repr(fn)), "hit": bool(hit),
                     "key_text": last.get("key_text", "(not seen: this Triton names its cache another way)")})
        return hit

    if hasattr(autotuner, "hashlib"):
        autotuner.hashlib = HashRecorder()
    autotuner.Autotuner.check_disk_cache = check_disk_cache
    return seen


def child(path: str) -> dict:
    """Build the slice, then time the first and the second call of `path` (seconds, synchronised)."""
    import torch

    autotunes = record_autotune_keys()

    from benchmarks.bench_gpu import build_glmkit, glmkit_forward, glmkit_train, token_batch
    from glmkit.config import variant_config

    def timed(call):
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    config = variant_config("GLM-5.3-Flash-4layer")
    start = time.perf_counter()
    model = build_glmkit(config, 0, torch.bfloat16)
    torch.cuda.synchronize()
    result = {"path": path, "build_s": time.perf_counter() - start}
    if path == "forward":
        length = int(os.environ.get("FIRST_CALL_T", 8192))  # a shorter forward tunes the same kernels
        call = glmkit_forward(model, BACKENDS, token_batch(config.vocab_size, 1, length))
    elif path == "train":
        call = glmkit_train(model, BACKENDS, token_batch(config.vocab_size, 1, 4096), False)
    else:
        call = decode_call(model, token_batch(config.vocab_size, 8, 512))
    result["first_s"] = timed(call)
    result["second_s"] = timed(call)
    from triton import knobs

    result["autotune_lookups"] = autotunes
    result["triton_cache_dir"] = knobs.cache.dir
    result["cache_env"] = {k: os.environ.get(k) for k in ("TRITON_CACHE_DIR", "TRITON_CACHE_AUTOTUNING",
                                                          "TORCHINDUCTOR_CACHE_DIR", "TILELANG_CACHE_DIR")}
    from torch._dynamo.utils import compile_times, counters

    result["counters"] = {group: dict(counts) for group, counts in counters.items()
                          if group in ("inductor", "aot_autograd", "stats")}
    try:
        result["compile_times"] = compile_times(repr="str", aggregate=True)
    except Exception as err:  # noqa: BLE001 - a private helper of torch's; the row stands without it
        result["compile_times"] = f"compile times unavailable ({err})"
    return result


def decode_call(model, ids):
    import torch

    from glmkit.model import RolloutEngine
    from glmkit.model.rollout import GraphedStep

    engine = RolloutEngine(model, BACKENDS)
    prompts = ids.tolist()

    @torch.no_grad()
    def call():
        batch, logits = engine.prefill(prompts, capacity=ids.shape[1] + 16)
        tokens = engine.step(batch, logits.argmax(-1)).argmax(-1)
        if engine.can_graph():
            GraphedStep(engine, batch)(tokens)
    return call


def autotune_misses(cold: list, warm: list) -> list[str]:
    """Why each autotune the warm process ran again missed the disk cache: where its hashed key text
    first differs from the cold process's nearest lookup of the same function."""
    lines = []
    for lookup in warm:
        if lookup["hit"]:
            continue
        before = [c["key_text"] for c in cold if c["function"] == lookup["function"]]
        if not before:
            lines.append(f"autotune miss {lookup['function']}: not looked up in the cold process")
            continue
        text = lookup["key_text"]
        nearest = max(before, key=lambda b: _common_prefix(b, text))
        if nearest == text:
            lines.append(f"autotune miss {lookup['function']}: same key text as the cold process (it did not store it)")
            continue
        at = _common_prefix(nearest, text)
        lines.append(f"autotune miss {lookup['function']}: key text differs at character {at} of {len(text)}: "
                     f"cold ...{nearest[max(0, at - 60):at + 100]!r} warm ...{text[max(0, at - 60):at + 100]!r}")
    return lines


def _common_prefix(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def files_under(folder: Path) -> tuple[int, int]:
    sizes = [p.stat().st_size for p in folder.rglob("*") if p.is_file()]
    return len(sizes), sum(sizes)


def run_child(path: str, cache: Path, timeout_s: float) -> dict:
    env = {**os.environ, "GLMKIT_CACHE_DIR": str(cache), "TRITON_PRINT_AUTOTUNING": "1"}
    for variable in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "TILELANG_CACHE_DIR"):
        env.pop(variable, None)  # the folder under test, not one set outside
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, __file__, "--child", path], env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"path": path, "status": f"timed out after {timeout_s:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        return {"path": path, "status": f"failed (exit {done.returncode}): " + " | ".join(tail)}
    result = json.loads(lines[-1][len(MARK):])
    result["status"] = "ok"
    tuned = AUTOTUNED.findall(done.stdout)  # (function, seconds) of each autotune not answered from the cache
    result["autotuned"], result["autotune_s"] = len(tuned), sum(float(s) for _, s in tuned)
    result["autotuned_functions"] = sorted({name for name, _ in tuned})
    result["process_s"] = time.perf_counter() - start
    result["cache_files"], result["cache_bytes"] = files_under(cache)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--cache-dir", help="one cache folder for every path (kept); default: a new one per path")
    parser.add_argument("--timeout-s", type=float, default=400.0, help="per child process")
    parser.add_argument("--out", default="benchmarks/results/gpu_first_call.json")
    parser.add_argument("--child", choices=PATHS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(MARK + json.dumps(child(args.child)), flush=True)
        return
    paths = [p for p in args.paths.split(",") if p]
    unknown = [p for p in paths if p not in PATHS]
    if unknown:
        raise SystemExit(f"unknown path {unknown[0]!r}; allowed: {', '.join(PATHS)}")

    import torch

    rows = []
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    header = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
              "backends": BACKENDS, "targets_s": TARGET_S}
    print(json.dumps(header), flush=True)
    print(f"{'path':8s} {'cache':5s} {'first call':>11s} {'target':>7s} {'second':>8s} {'build':>7s} "
          f"{'process':>8s} {'cache files':>12s}", flush=True)
    for path in paths:
        cache = Path(args.cache_dir) if args.cache_dir else Path(tempfile.mkdtemp(prefix=f"glmkit-cache-{path}-"))
        try:
            for state in ("cold", "warm"):
                row = {**run_child(path, cache, args.timeout_s), "cache": state}
                rows.append(row)
                if row["status"] == "ok":
                    met = "ok" if row["first_s"] <= TARGET_S[state] else "MISSED"
                    print(f"{path:8s} {state:5s} {row['first_s']:9.1f} s {TARGET_S[state]:5.0f} s {met:6s} "
                          f"{row['second_s']:6.2f} s {row['build_s']:5.1f} s {row['process_s']:6.1f} s "
                          f"{row['cache_files']:6d} ({row['cache_bytes'] / 2**20:.0f} MiB)", flush=True)
                    print(f"         Triton autotuned {row['autotuned']} kernels in {row['autotune_s']:.1f} s "
                          f"({', '.join(row['autotuned_functions'])}); "
                          f"counters {json.dumps(row['counters'])}", flush=True)
                    print(textwrap.indent(row["compile_times"].strip(), "         "), flush=True)
                    lookups = row["autotune_lookups"]
                    print(f"         autotune disk-cache lookups {len(lookups)} ({sum(x['hit'] for x in lookups)} hits); "
                          f"Triton's cache {row['triton_cache_dir']}; {json.dumps(row['cache_env'])}", flush=True)
                    if state == "warm":
                        cold = next((r for r in rows if r["path"] == path and r["cache"] == "cold"), {})
                        for line in autotune_misses(cold.get("autotune_lookups", []), row["autotune_lookups"]):
                            print("         " + line, flush=True)
                else:
                    print(f"{path:8s} {state:5s} {row['status']}", flush=True)
                tmp = out.with_suffix(".json.tmp")
                tmp.write_text(json.dumps({"header": header, "rows": rows}, indent=1))
                os.replace(tmp, out)
        finally:
            if not args.cache_dir:
                shutil.rmtree(cache, ignore_errors=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
