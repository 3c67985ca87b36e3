"""Data-parallel GRPO (glmkit.rl.parallel): two real trainer ranks started by torchrun, talking over
gloo on loopback, train as the one-process trainer does on the same seed.

Tolerances: both runs roll out the same completions (rank 0 samples with the one process's seed and
weights), and the two ranks' gradients, summed by all-reduce, are the one process's up to fp32
summation order; so metrics agree to fp32 rounding (grad norm measured <= 5e-6 relative: bound 1e-4;
losses ~1e-7 absolute on values of ~1e-3: bound 1e-6 + 1e-4 relative). The weights after 8 Adam steps:
relative RMS 3.0e-6 measured, bound 1e-4; a single element can differ by up to 2 x lr per step where
its gradient is rounding noise (Adam divides by its own scale): bound 2 x 2e-4 x 8 = 3.2e-3, measured
8.2e-5. Metrics that are themselves rounding noise (the train-vs-rollout log-prob diff and KL, ~1e-7
in fp32) are compared to 1e-6 absolute.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

from glmkit.launch.cluster import free_port
from glmkit.model.rollout import Completion
from glmkit.rl.parallel import _buckets, decode_rollout, encode_rollout, share

NOISE = ("train/train_rollout_logprob_abs_diff", "train/train_rollout_kl")


# torch's gloo runtime has twice (in some hundred runs, on a loaded 2-core CI machine) aborted a rank
# with this line from C++ and no Python error, while that rank waited in a broadcast; it has not
# reproduced in 30 runs under load here. A run that ends so is made once more (with a warning that
# the test summary shows); every other failure, and a second abort, fails the test. PYTHONFAULTHANDLER
# prints each thread's Python stack should it happen again.
GLOO_ABORT = "terminate called without an active exception"


def train(tmp_path, name, ranks=None, extra=()):
    args = ["-m", "glmkit", "train", "--model-name", "tiny", "--num-rollout", "2", "--metrics-out",
            str(tmp_path / f"{name}.jsonl"), "--save", str(tmp_path / name), "--save-interval", "2", *extra]
    if ranks:
        args = ["-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-addr", "127.0.0.1",
                "--master-port", str(free_port()), *args, "--data-parallel", "gloo"]
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, env=env)
    if ranks and out.returncode != 0 and GLOO_ABORT in out.stderr:
        warnings.warn(f"a gloo rank aborted in torch ({GLOO_ABORT!r}); running {name} once more. Its output: "
                      + out.stderr[-3000:])
        shutil.rmtree(tmp_path / name, ignore_errors=True)
        (tmp_path / f"{name}.jsonl").unlink(missing_ok=True)
        args[args.index("--master-port") + 1] = str(free_port())
        out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return out


def test_two_gloo_ranks_train_as_one_process(tmp_path):
    train(tmp_path, "one")
    out = train(tmp_path, "two", ranks=2)
    assert out.stdout.count("run verdict:") == 1  # rank 0 reports, rank 1 stays quiet
    one = [json.loads(line) for line in open(tmp_path / "one.jsonl")]
    two = [json.loads(line) for line in open(tmp_path / "two.jsonl")]
    # 2 rollouts x (4 optimizer steps + the rollout row), and the held-out evaluations before and after
    assert len(one) == len(two) == 12
    for a, b in zip(one, two):
        assert a.keys() == b.keys()
        for key, want in a.items():
            if key.startswith("perf/") or not isinstance(want, (int, float)):
                continue
            bound = 1e-6 if key in NOISE else 1e-6 + 1e-4 * abs(want)
            assert abs(b[key] - want) <= bound, (key, want, b[key])
    assert sum(r.get("train/grad_norm", 0) > 0 for r in two) >= 4  # the steps did train

    from glmkit.checkpoint import open_checkpoint

    alone, ranked = (open_checkpoint(glob.glob(str(tmp_path / name / "iter_*" / "model"))[0]).state_dict()
                     for name in ("one", "two"))
    assert alone.keys() == ranked.keys()
    diff = sum((alone[k].float() - ranked[k].float()).square().sum() for k in alone)
    norm = sum(alone[k].float().square().sum() for k in alone)
    assert (diff / norm).sqrt() < 1e-4
    assert max((alone[k].float() - ranked[k].float()).abs().max() for k in alone) < 3.2e-3


def test_an_optimizer_step_all_reduces_its_metrics_in_one_call(tmp_path, monkeypatch):
    """Under data parallelism an optimizer step all-reduces the step's sample count once, the gradients
    once per bucket and every metric together in one more call (the count, grad norm and losses used to
    take ~16 small blocking calls a step); with one rank in a real gloo group the rows are the one-process
    trainer's.

    Tolerances: the first optimizer step runs the same code on the same weights in both, so its losses are
    bit-equal. Its gradient norm is not: the ranked trainer also feeds the gradients no token reached, as
    zeros, to the norm, which changes its fp32 summation order (1e-7 relative measured, bound 1e-6); the
    norm scales the clipped update, so from the second step on the weights differ by fp32 rounding
    amplified through Adam, and the losses, means of per-token terms of size ~1 that cancel (advantages sum
    to zero within a group), differ by ~1e-7 absolute (measured 1.1e-7 on values of 2.5e-3; bound 1e-6 +
    1e-4 relative, as in the two-rank test above). Counts and step numbers are exact."""
    import torch.distributed as dist

    from glmkit.rl.loop import GRPOTrainer
    from glmkit.rl.parallel import BUCKET_BYTES, DataParallel
    from tests.test_train import tiny

    alone = GRPOTrainer(tiny(tmp_path / "alone", num_rollout=1)).step(0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        calls, real = [], dist.all_reduce
        monkeypatch.setattr(dist, "all_reduce", lambda t, *a, **k: (calls.append(t.numel()), real(t, *a, **k))[1])
        trainer = GRPOTrainer(tiny(tmp_path / "ranked", num_rollout=1), dp=DataParallel())
        ranked = trainer.step(0)
    finally:
        dist.destroy_process_group()
    steps = sum("train/step" in r for r in ranked)
    buckets = len(_buckets(list(trainer.trainable), BUCKET_BYTES))
    # plus one call a rollout: its log-prob and advantage means (rollout/log_probs, ..., over every rank)
    assert steps >= 2 and len(calls) == steps * (2 + buckets) + 1, (steps, buckets, calls)
    assert len(alone) == len(ranked)
    first = True
    for a, b in zip(alone, ranked):
        assert set(a) == set(b)
        for key, want in a.items():
            got = b[key]
            if key.startswith("perf/"):
                continue
            if not isinstance(want, float) or key.endswith("/step") or key == "step":  # counts, flags, lists: exact
                assert got == want, (key, want, got)
            elif key == "train/grad_norm":
                assert got == pytest.approx(want, rel=1e-6), (key, want, got)
            elif first and "train/step" in a:
                assert got == want, (key, want, got)  # same code, same weights: bit-equal
            else:
                assert abs(got - want) <= 1e-6 + 1e-4 * abs(want), (key, want, got)
        first = first and "train/step" not in a


def test_data_parallel_refuses_the_distributed_weight_update_before_joining(tmp_path):
    """Both want the process's default group: the trainer says so before it joins one (without the
    check, this would fail on the missing launcher environment instead)."""
    from glmkit.rl.loop import GRPOTrainer
    from glmkit.serve.client import SGLangRollout
    from tests.test_train import tiny

    rollout = SGLangRollout("http://127.0.0.1:9", mode="distributed", master="127.0.0.1:9")
    with pytest.raises(ValueError, match="'distributed' weight update"):
        GRPOTrainer(tiny(tmp_path, data_parallel="gloo"), rollout=rollout)
    # the CLI refuses on every rank alike, before any rank joins a group (no rank waits for another)
    out = subprocess.run([sys.executable, "-m", "glmkit", "train", "--model-name", "tiny", "--data-parallel", "gloo",
                          "--rollout-url", "http://127.0.0.1:9", "--weight-update", "distributed",
                          "--weight-update-master", "127.0.0.1:9", "--metrics-out", str(tmp_path / "m.jsonl")],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "RANK": "1"})
    assert out.returncode != 0 and "--data-parallel and --weight-update distributed" in out.stderr, out.stderr


def test_data_parallel_without_a_launcher_says_what_is_missing(tmp_path):
    out = subprocess.run([sys.executable, "-m", "glmkit", "train", "--model-name", "tiny", "--num-rollout", "1",
                          "--data-parallel", "gloo", "--metrics-out", str(tmp_path / "m.jsonl")],
                         capture_output=True, text=True, timeout=300,
                         env={k: v for k, v in os.environ.items()
                              if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")})
    assert out.returncode != 0
    assert "missing RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT" in out.stderr
    assert not (tmp_path / "m.jsonl").exists()


def test_more_ranks_than_samples_per_step_is_refused(tmp_path):
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "3", "--master-addr",
                          "127.0.0.1", "--master-port", str(free_port()), "-m", "glmkit", "train", "--model-name",
                          "tiny", "--num-rollout", "1", "--rollout-batch-size", "1", "--n-samples-per-prompt", "2",
                          "--global-batch-size", "2", "--data-parallel", "gloo", "--metrics-out",
                          str(tmp_path / "m.jsonl")], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0
    assert "3 data-parallel ranks need at least as many samples per optimizer step; --global-batch-size is 2" \
        in out.stderr
    assert not (tmp_path / "m.jsonl").exists()


def test_rollout_buffer_round_trips_exactly_and_refuses_garbage():
    completions = [
        Completion(prompt=[1, 2, 3], tokens=[4, 5], logprobs=[-0.1234567891234, -2.5], finish_reason="stop",
                   routing={3: torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8]])},
                   topk={3: torch.tensor([[0, -1], [1, 0], [2, 1], [3, 2]], dtype=torch.int32)}),
        Completion(prompt=[7], tokens=[], logprobs=[], finish_reason="length"),
    ]
    rewards = torch.tensor([1.0, 0.0])
    back, got_rewards = decode_rollout(encode_rollout(completions, rewards))
    assert torch.equal(got_rewards, rewards)
    for a, b in zip(completions, back):
        assert (a.prompt, a.tokens, a.logprobs, a.finish_reason) == (b.prompt, b.tokens, b.logprobs, b.finish_reason)
        assert (a.routing is None) == (b.routing is None) and (a.topk is None) == (b.topk is None)
        for kind in ("routing", "topk"):
            for layer, value in (getattr(a, kind) or {}).items():
                assert torch.equal(getattr(b, kind)[layer], value) and getattr(b, kind)[layer].dtype == value.dtype
    with pytest.raises(ValueError, match="not a glmkit rollout buffer"):
        decode_rollout(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all}")
    from safetensors.torch import save

    with pytest.raises(ValueError, match="lacks tensor '0.tokens'"):
        decode_rollout(save({"rewards": rewards, "0.prompt": torch.tensor([1])}, metadata={
            "glmkit_rollout": json.dumps([{"finish_reason": "stop", "routing": None, "topk": None}])}))


def test_announced_weights_name_their_dtypes_and_an_unknown_one_is_refused_first():
    """announce lists every tensor's name, dtype and shape in the order sent; a receiver refuses a dtype
    torch does not have (or any other attribute of torch) by the tensor's name, before receiving."""
    from glmkit.collectives import announce, receive_announced

    tensors = {"b": torch.ones(2, 3, dtype=torch.bfloat16), "a": torch.arange(4).view(2, 2).t()}
    ordered, announced = announce(tensors, "cpu")
    assert announced == [("b", "bfloat16", [2, 3]), ("a", "int64", [2, 2])]
    assert [n for n, _ in ordered] == ["b", "a"] and all(t.is_contiguous() for _, t in ordered)
    for bad in ("float33", "__class__", "nn"):
        with pytest.raises(ValueError, match=f"tensor 'w': unknown dtype '{bad}'"):
            receive_announced([("w", bad, [2])], "cpu")


def test_shares_cover_every_sample_once_in_order():
    for n in (1, 7, 32, 64):
        for world in (1, 2, 3, 8):
            parts = [share(list(range(n)), rank, world) for rank in range(world)]
            assert [i for part in parts for i in part] == list(range(n))
            assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_gradient_buckets_keep_order_dtype_and_size():
    grads = [torch.zeros(10), torch.zeros(20), torch.zeros(5, dtype=torch.bfloat16), torch.zeros(100), torch.zeros(3)]
    buckets = _buckets(grads, bucket_bytes=128)  # 32 floats
    assert [[g.numel() for g in b] for b in buckets] == [[10, 20], [5], [100], [3]]
    assert [g for b in buckets for g in b] == grads and all(len({g.dtype for g in b}) == 1 for b in buckets)
