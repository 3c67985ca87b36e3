"""The GPU benchmark's setup, checked on the CPU so a device run is not spent finding a wiring bug:
the model synthesised in place equals the synthesised checkpoint, and the transformers reference
built over glmkit's tensors computes the same logits; the data-parallel benchmark's comparison."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from glmkit.checkpoint.synth import synth_checkpoint
from glmkit.model.synth import synth_model
from glmkit.config import variant_config
from glmkit.model import TrainPath, load_model


def load_bench():
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_gpu.py"
    spec = importlib.util.spec_from_file_location("bench_gpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_synth_model_equals_the_synthesised_checkpoint(tmp_path):
    config = variant_config("tiny")
    in_place = synth_model(config, 5, dtype=torch.float32, device="cpu", progress=False)
    from_disk = load_model(synth_checkpoint(config, 5, tmp_path / "ck", progress=False))
    a, b = in_place.state_dict(), from_disk.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_reference_over_shared_weights_gives_glmkits_logits():
    """fp32 on the CPU: the two implementations agree to 5e-5 relative RMS (the bound the parity
    tests use for transformers vs glmkit), so the benchmark compares the same model."""
    bench = load_bench()
    config = variant_config("tiny")
    model = synth_model(config, 5, dtype=torch.float32, device="cpu", progress=False)
    ref = bench.share_with_reference(model, config)
    assert ref.model.language_model.embed_tokens.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    ids = torch.randint(3, config.vocab_size, (1, 70), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(input_ids=ids).logits[0].float()
        got = TrainPath(model).forward([ids[0].tolist()], return_logits=True).logits.float()
    assert ((want - got).norm() / want.norm()).item() < 5e-5


def test_layer_sweep_runs_on_the_cpu_and_writes_its_json(tmp_path):
    """The 45-layer sweep's logic on the tiny variant: every layer compared, train vs rollout small
    (bf16 rounding: rel RMS under 0.2 per layer), the JSON written."""
    import json
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "sweep_layers_gpu.py"
    out = tmp_path / "sweep.json"
    run = subprocess.run([sys.executable, script, "--variant", "tiny", "--device", "cpu", "--seq-len", "120",
                          "--decode", "12", "--backends", "kda=torch", "--out", out],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    assert [row["layer"] for row in data["layers"]] == [0, 1, 2, 3]
    assert all(row["rel_rms"] < 0.2 for row in data["layers"])
    assert data["layers"][3]["kind"] == "dsa" and "experts_same" in data["layers"][3]


def test_data_parallel_compare_keeps_two_runs_of_one_side_apart(tmp_path, capsys):
    """`bench_data_parallel.py --compare` on two files of the same side (one process run twice: the
    run-to-run noise a GPU comparison is read against) labels the second by its file and reports the
    largest difference per metric; perf/* keys are not compared."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_data_parallel.py"
    spec = importlib.util.spec_from_file_location("bench_data_parallel", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)

    def side(grad_norm, kl, step_time):
        rows = [{"train/grad_norm": grad_norm, "train/ppo_kl": kl},
                {"perf/step_time": step_time, "perf/sync_time": 0.01, "rollout/raw_reward": 0.5}]
        return {"runs": {"one process": bench.summary(rows)}, "rows": {"one process": rows}}

    a, b = tmp_path / "first.json", tmp_path / "second.json"
    a.write_text(json.dumps(side(1.0, 0.002, 2.0)))
    b.write_text(json.dumps(side(1.5, -0.001, 3.0)))
    out = tmp_path / "both.json"
    bench.main(["--compare", str(a), str(b), "--out", str(out)])
    result = json.loads(out.read_text())
    assert list(result["rows"]) == ["one process", "one process [second]"]
    assert result["largest_abs_difference"] == pytest.approx({"train/grad_norm": 0.5, "train/ppo_kl": 0.003,
                                                              "rollout/raw_reward": 0.0})
    assert "one process [second]" in capsys.readouterr().out


def test_the_decode_limit_counts_what_a_step_must_read():
    """bench_decode's limit (issue 37: decode within 1.15x of it): each weight once, the embedding's B
    rows, the routed experts B tokens touch under uniform routing, the caches once. Checked against the
    tiny model's tensors summed by hand."""
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_decode.py"
    spec = importlib.util.spec_from_file_location("bench_decode", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    config = variant_config("tiny")
    model = synth_model(config, 0, dtype=torch.float32, device="cpu", progress=False)
    sizes = {n: p.numel() * 4 for n, p in model.named_parameters()}
    routed = sum(v for n, v in sizes.items() if ".mlp.experts." in n)
    rest = sum(sizes.values()) - routed - sizes["embed_tokens.weight"]
    row = config.hidden_size * 4
    for batch in (1, 3, 1000):
        share = 1 - (1 - config.num_experts_per_tok / config.n_routed_experts) ** batch
        expected = rest + min(batch, config.vocab_size) * row + routed * share + 12345
        assert bench.decode_step_bytes(model, config, batch, 12345) == int(expected)
    assert routed > 0 and bench.copy_bandwidth("cpu") is None
