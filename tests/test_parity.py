"""Parity: captures of every path, site-by-site comparison, first divergence, the CLI contract."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from glmkit.checkpoint import open_checkpoint, save_checkpoint, synth_checkpoint
from glmkit.model import TrainPath, load_model
from glmkit.parity.builtin import (fp32_vs_bf16, index_agreement, kda_error_vs_position, make_inputs,
                                   mhc_residuals, parity)
from glmkit.parity.capture import HookCapturer, capture_train
from glmkit.parity.compare import compare, compare_indices, compare_values, logprob_abs_diff
from glmkit.parity.dump import FORMAT, Capture, load_capture, save_capture

KV_B = "model.language_model.layers.3.self_attn.kv_b_proj.weight"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return synth_checkpoint("tiny", 0, tmp_path_factory.mktemp("parity") / "tiny", progress=False)


def altered(src, out, name, change):
    """A copy of checkpoint `src` with one tensor changed, as a faulty conversion would leave it."""
    source = open_checkpoint(src)
    return save_checkpoint(out, source.config, ((k, change(source.get(k)) if k == name else source.get(k))
                                                for k in source.text_keys()))


def swap_kv_halves(w, heads=4, dk=16):
    per_head = w.view(heads, -1, w.shape[-1])
    return torch.cat([per_head[:, dk:], per_head[:, :dk]], dim=1).reshape_as(w)


def glmkit_cli(*args):
    return subprocess.run([sys.executable, "-m", "glmkit", *map(str, args)], capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("paths", [("reference", "train"), ("reference", "rollout"), ("train", "rollout")])
def test_paths_agree_on_a_consistent_checkpoint(ckpt, paths):
    result, a, b = parity(ckpt, paths, seq_len=48, batch=2)
    assert result.verdict == "pass", result.first_divergence
    sites = {(s.layer, s.site) for s in result.sites}
    assert (3, "indexer_topk") in sites and (3, "router_experts") in sites and (0, "attn_out") in sites
    assert result.logprob.value < 1e-5
    assert index_agreement(result, "indexer_topk")[3]["identical"] == 1.0
    if "reference" in paths:  # the reference does not expose the pre-mix weights
        assert "0/attn_hc.pre" in result.skipped_sites


@pytest.mark.parametrize("change, paths", [
    (swap_kv_halves, "train,train"),
    (lambda w: w * 1.01, "reference,train"),
])
def test_cli_names_a_faulty_dsa_tensor_as_first_divergence(ckpt, tmp_path, change, paths):
    bad = altered(ckpt, tmp_path / "bad", KV_B, change)
    out = glmkit_cli("parity", "--checkpoint", ckpt, "--checkpoint-b", bad, "--paths", paths, "--seq-len", 40,
                     "--json", tmp_path / "r.json")
    assert out.returncode == 1, out.stdout + out.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["verdict"] == "fail"
    assert (data["first_divergence"]["layer"], data["first_divergence"]["site"]) == (3, "attn_out")
    assert "layer 3, site attn_out" in out.stdout
    # everything before layer 3's attention output agrees
    early = [s for s in data["sites"] if s["layer"] is not None and s["layer"] < 3]
    assert early and not any(s["diverged"] for s in early)


def test_cli_pass_and_json_schema(ckpt, tmp_path):
    out = glmkit_cli("parity", "--checkpoint", ckpt, "--paths", "reference,rollout", "--seq-len", 40,
                     "--json", tmp_path / "r.json")
    assert out.returncode == 0, out.stderr
    data = json.loads((tmp_path / "r.json").read_text())
    assert (tmp_path / ".r.json.glmkit-output").read_text().startswith("kind: JSON result\n")  # a re-run replaces it
    assert set(data) >= {"verdict", "first_divergence", "logprob_abs_diff", "sites"}
    assert data["verdict"] == "pass" and data["first_divergence"] is None
    assert {"layer", "site", "max_abs", "rel_rms", "cosine"} <= set(data["sites"][0])
    assert "verdict: pass" in out.stdout


@pytest.mark.parametrize("args, message", [
    (["--paths", "train,megatron"], "unknown path 'megatron'"),
    (["--paths", "train"], "two paths"),
    (["--threshold", "speed=3"], "rel_rms=FLOAT"),
])
def test_cli_bad_input_exits_2(ckpt, args, message):
    out = glmkit_cli("parity", "--checkpoint", ckpt, "--seq-len", 16, *args)
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_unreadable_checkpoint_exits_2(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    out = glmkit_cli("parity", "--checkpoint", tmp_path, "--paths", "train,rollout")
    assert out.returncode == 2 and "config.json" in out.stderr


def test_dumps_round_trip_and_compare_against_live_paths(ckpt, tmp_path):
    out = glmkit_cli("capture", "--checkpoint", ckpt, "--path", "train", "--out", tmp_path / "train", "--seq-len", 32)
    assert out.returncode == 0, out.stderr
    manifest = json.loads((tmp_path / "train" / "manifest.json").read_text())
    assert manifest["path"] == "train" and manifest["mode"] == "end-to-end" and len(manifest["input_sha256"]) == 64
    # a dump as one side: the live side runs on the dump's own input
    live = glmkit_cli("parity", "--checkpoint", ckpt, "--paths", f"{tmp_path / 'train'},rollout")
    assert live.returncode == 0, live.stdout + live.stderr
    # dumps of different inputs cannot be compared
    assert glmkit_cli("capture", "--checkpoint", ckpt, "--path", "train", "--out", tmp_path / "other",
                      "--seq-len", 32, "--seed", "1").returncode == 0
    mixed = glmkit_cli("parity", "--checkpoint", ckpt, "--paths", f"{tmp_path / 'train'},{tmp_path / 'other'}")
    assert mixed.returncode == 2 and "different inputs" in mixed.stderr


def test_capture_save_load_is_exact(ckpt, tmp_path):
    seqs, _ = make_inputs(1024, 2, 24)
    cap = capture_train(load_model(ckpt), seqs)
    again = load_capture(save_capture(cap, tmp_path / "cap"))
    assert again.input_sha256 == cap.input_sha256 and set(again.tensors) == set(cap.tensors)
    assert all(torch.equal(again.tensors[k], cap.tensors[k]) for k in cap.tensors)
    with pytest.raises(FileExistsError):
        save_capture(cap, tmp_path / "cap")


def test_hook_capturer_writes_the_same_format(ckpt):
    model = load_model(ckpt)
    seqs, _ = make_inputs(1024, 2, 24)
    site_map = {r"^layers\.(\d+)\.mlp$": "mlp_out", r"^norm$": "final_hidden"}
    with HookCapturer(model, site_map, rows=lambda name, out: out[0] if isinstance(out, tuple) else out) as hooks:
        TrainPath(model).forward(seqs)
    ids = torch.cat([torch.tensor(s) for s in seqs])
    generic = hooks.to_capture(ids, torch.tensor([0, len(seqs[0]), len(ids)]), path="hooks")
    native = capture_train(model, seqs)
    result = compare(native, generic)
    assert {(s.layer, s.site) for s in result.sites} == {(i, "mlp_out") for i in range(4)} | {(None, "final_hidden")}
    assert result.verdict == "pass" and max(s.rel_rms for s in result.sites) == 0.0


def test_streaming_matches_end_to_end_on_tiny(ckpt, tmp_path):
    out = glmkit_cli("parity", "--checkpoint", ckpt, "--paths", "reference,train", "--streaming", "--seq-len", 32,
                     "--json", tmp_path / "s.json")
    assert out.returncode == 0, out.stdout + out.stderr
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["mode"] == "streaming" and "(streaming" in out.stdout
    assert len({s["layer"] for s in data["sites"]}) == 5  # 4 layers + final
    bad = glmkit_cli("parity", "--checkpoint", ckpt, "--paths", "train,rollout", "--streaming")
    assert bad.returncode == 2 and "streaming" in bad.stderr


def test_compare_metrics_on_known_values():
    a = torch.tensor([[1.0, 0.0], [0.0, 2.0]])
    r = compare_values(a, a + torch.tensor([[0.0, 0.0], [0.0, 0.2]]), 0, "attn_out", threshold=0.05)
    assert r.max_abs == pytest.approx(0.2) and r.rel_rms == pytest.approx(0.2 / 5 ** 0.5) and r.diverged
    assert r.per_row == pytest.approx([0.0, 0.1])
    nan = compare_values(a, torch.tensor([[1.0, float("nan")], [0.0, 2.0]]), 0, "attn_out", threshold=1.0)
    assert nan.nan == 1 and nan.diverged
    idx = compare_indices(torch.tensor([[0, 1, 2], [-1, 4, 5]]), torch.tensor([[0, 1, 3], [-1, 4, 5]]), 3,
                          "indexer_topk", identical_needed=0.99)
    assert idx.jaccard == pytest.approx((2 / 4 + 1) / 2) and idx.identical == 0.5 and idx.diverged


def test_logprob_abs_diff_is_the_recipes_mean_of_sample_means():
    ids, cu = torch.arange(7), torch.tensor([0, 4, 7])
    a = Capture(ids, cu, {(None, "logprobs"): torch.zeros(7)})
    b = Capture(ids, cu, {(None, "logprobs"): torch.tensor([9.0, 0.1, 0.3, 9.0, 9.0, 0.4, 9.0])})
    # responses start at position 1 and 1; the last token of each sequence has no target
    got = logprob_abs_diff(a, b, response_starts=[1, 1])
    assert got.value == pytest.approx(((0.1 + 0.3) / 2 + 0.4) / 2)
    assert got.worst[0]["abs_diff"] == pytest.approx(0.4) and got.worst[0]["sequence"] == 1


def test_builtin_comparisons(ckpt):
    model = load_model(ckpt)
    curves = kda_error_vs_position(model, list(range(3, 150)))
    assert sorted(curves) == [0, 1, 2] and all(len(c) == 147 for c in curves.values())
    assert max(max(c) for c in curves.values()) < 1e-4  # fp32 chunked vs recurrent
    seqs, _ = make_inputs(1024, 2, 40)
    residuals = mhc_residuals(capture_train(model, seqs))
    # 20 Sinkhorn passes do not fully balance every comb of this synthetic checkpoint (up to ~4e-3);
    # the residual is a property of the weights, so the reference reports the same numbers
    from glmkit.reference import load_reference
    from glmkit.parity.capture import capture_reference

    expected = mhc_residuals(capture_reference(load_reference(ckpt), seqs))
    assert sorted(residuals) == [0, 1, 2, 3] and all(set(v) == {"attn", "ffn"} for v in residuals.values())
    assert all(abs(residuals[k][s] - expected[k][s]) < 1e-6 for k in residuals for s in ("attn", "ffn"))
    half = fp32_vs_bf16(ckpt, seq_len=40)
    assert half.dtype == "bfloat16" and half.logprob is not None
    assert 1e-4 < max(s.rel_rms for s in half.sites if s.kind == "values") < 1.0


def test_a_site_with_nan_is_shown_as_non_finite_not_as_agreeing(ckpt, tmp_path):
    """A capture whose first site holds NaN: the verdict fails there, and the table and the verdict
    line say the values are not finite (its rel RMS, over the finite part only, would read 0)."""
    capture = tmp_path / "cap"
    assert glmkit_cli("capture", "--checkpoint", ckpt, "--path", "reference", "--seq-len", 8, "--batch", 1,
                      "--out", capture).returncode == 0
    tensors = load_file(str(capture / "tensors.safetensors"))
    key = sorted(k for k in tensors if k.startswith("L000/") and tensors[k].is_floating_point())[0]
    tensors[key] = torch.full_like(tensors[key], float("nan"))
    save_file(tensors, str(capture / "tensors.safetensors"), metadata={"format": FORMAT})
    out = glmkit_cli("parity", "--checkpoint", ckpt, "--paths", f"reference,{capture}", "--seq-len", 8, "--batch", 1)
    assert out.returncode == 1, out.stderr
    layer0 = next(line for line in out.stdout.splitlines() if line.strip().startswith("0 "))
    assert "non-finite" in layer0 and "DIVERGED" in layer0
    assert re.search(r"verdict: fail, first divergence at layer 0, site \S+ \(\d+ NaN and 0 Inf values\)", out.stdout)
    tensors["input/ids"][3] = 10 ** 6  # a token the checkpoint cannot embed: named, exit 2 (was an IndexError)
    save_file(tensors, str(capture / "tensors.safetensors"), metadata={"format": FORMAT})
    bad = glmkit_cli("parity", "--checkpoint", ckpt, "--paths", f"reference,{capture}")
    assert bad.returncode == 2 and "input/ids holds token 1000000, outside the checkpoint's vocabulary" in bad.stderr


def test_sites_not_compared_are_said_not_passed_silently():
    """Dumps (skip_mismatched): a site one side lacks and a site whose shapes differ (a wrong dims
    annotation unshards to 4x the width) are warned by name, and the result lists them as skipped."""
    from glmkit.parity.compare import compare
    from glmkit.parity.dump import Capture

    ids, cu = torch.arange(6), torch.tensor([0, 6])
    a = Capture(ids, cu, manifest={"path": "engine dump"})
    b = Capture(ids, cu, manifest={"path": "trainer dump"})
    for cap in (a, b):
        cap.put(0, "attn_out", torch.ones(6, 8))
    a.put(1, "streams_after_ffn", torch.ones(6, 2, 8))
    b.put(1, "streams_after_ffn", torch.ones(6, 8, 8))
    b.put(1, "mlp_out", torch.ones(6, 8))
    result = compare(a, b, skip_mismatched=True)
    assert result.verdict == "pass" and [s.site for s in result.sites] == ["attn_out"]
    assert result.skipped_sites == ["1/mlp_out", "1/streams_after_ffn (shapes [6, 2, 8] vs [6, 8, 8])"]
    assert "only trainer dump has 1/mlp_out: not compared" in result.warnings
    assert ("layer 1 streams_after_ffn: shapes [6, 2, 8] vs [6, 8, 8], not compared (a dump's dims annotation "
            "that does not match the model?)") in result.warnings


def test_capture_sites_of_odd_dtypes_and_bad_prompt_lengths_are_refused_by_name(tmp_path):
    """Hostile pass 9: a site stored as float8 was exit 3 ('isinf not implemented') and a manifest's
    prompt_lengths as an object was a KeyError; both are named when the capture is read."""
    import json

    from glmkit.parity.dump import Capture, load_capture, save_capture

    ids = torch.tensor([5, 6, 7, 8, 9])
    cu = torch.tensor([0, 3, 5])
    cap = Capture(ids, cu, tensors={(0, "attn_out"): torch.randn(5, 4).to(torch.float8_e4m3fn)},
                  manifest={"path": "train"})
    folder = save_capture(cap, tmp_path / "f8")
    with pytest.raises(ValueError, match=r"tensor 'L000/attn_out' is float8_e4m3fn; a capture's sites are float64, "
                                         r"float32, bfloat16 or float16"):
        load_capture(folder)
    for bad in ({"a": 1}, [3], [3, 9], [0, 2], [True, 1]):
        cap = Capture(ids, cu, tensors={(0, "attn_out"): torch.randn(5, 4)}, manifest={"path": "train",
                                                                                      "prompt_lengths": bad})
        folder = save_capture(cap, tmp_path / f"p{len(list(tmp_path.iterdir()))}")
        with pytest.raises(ValueError, match=r"manifest.json: prompt_lengths must list one length in 1..len\(sequence\) "
                                             r"for each of the 2 sequences"):
            load_capture(folder)
        json.loads((folder / "manifest.json").read_text())  # the file itself is fine JSON
    good = Capture(ids, cu, tensors={(0, "attn_out"): torch.randn(5, 4)}, manifest={"path": "t", "prompt_lengths": [3, 1]})
    assert load_capture(save_capture(good, tmp_path / "good")).manifest["prompt_lengths"] == [3, 1]


def test_captures_that_disagree_on_a_sites_shape_name_both_captures():
    """Hostile pass 10: a capture whose site had the wrong shape was refused as "site 1/attn_out: shapes
    differ", naming neither capture."""
    from glmkit.parity.compare import compare
    from glmkit.parity.dump import Capture

    ids, cu = torch.tensor([3, 4, 5]), torch.tensor([0, 3])
    a = Capture(ids, cu, {(1, "attn_out"): torch.zeros(3, 8)}, {"path": "reference"}, source="/runs/a")
    b = Capture(ids, cu, {(1, "attn_out"): torch.zeros(3, 9)}, {"path": "train"}, source="/runs/b")
    with pytest.raises(ValueError, match=re.escape("site 1/attn_out is [3, 8] in /runs/a and [3, 9] in /runs/b: "
                                                   "the captures disagree")):
        compare(a, b)


@pytest.mark.parametrize("seq_len", [2, 3])
def test_sequences_shorter_than_one_indexer_pool_compare_on_every_path(seq_len, capsys):
    """Hostile pass 12: with fewer tokens than index_kpool (4 on tiny) the reference capture failed to
    flatten its empty pool scores, and the rollout's decode step read a pool's span past its cache
    (both exit 3). Every path pair now compares them."""
    from glmkit.cli import main

    tiny = str(Path(__file__).resolve().parents[1] / "glmkit/assets/tiny_start")
    for paths in ("reference,train", "train,rollout", "reference,rollout"):
        assert main(["parity", "--checkpoint", tiny, "--seq-len", str(seq_len), "--paths", paths]) == 0, paths
        assert "verdict: pass" in capsys.readouterr().out


def test_nan_log_probs_behind_finite_hidden_states_fail():
    """Hostile pass 15: a head weight of 3e38 left every hidden site finite and equal, and parity passed
    (exit 0) with a NaN log-prob diff and NaN in its JSON. Log-probs that are NaN or infinite on either
    side are judged, and fail there."""
    from glmkit.parity.compare import compare
    from glmkit.parity.dump import Capture

    def capture(logprobs):
        cap = Capture(torch.arange(3, 9), torch.tensor([0, 6]), manifest={"path": "x"})
        cap.put(None, "final_hidden", torch.ones(6, 4))
        cap.put(None, "logprobs", logprobs)
        return cap

    finite = torch.full((6,), -1.0)
    assert compare(capture(finite), capture(finite.clone())).verdict == "pass"
    broken = finite.clone()
    broken[2] = float("nan")
    result = compare(capture(finite), capture(broken))
    assert result.verdict == "fail" and result.first_divergence.site == "logprobs"
