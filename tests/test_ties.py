"""Parity that tells a tie from a bug: tie-aware index comparison, top-k replay, selections from a file.

The checkpoints are written by transformers' own save_pretrained for configurations with few indexer
heads (2), kpool 2 and 4, a shared-indexer layer and 2 mHC streams: with 2 heads a pool's weighted
sum of ReLUs is exactly 0 whenever both heads' ReLUs are, so the top-k boundary is often a tie, and
glmkit (ties to the lower pool) and transformers' topk (another order) pick different pools.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from glmkit.checkpoint import open_checkpoint
from glmkit.config import DSA, KDA, variant_config
from glmkit.model.dsa import SparseMLA
from glmkit.parity.builtin import parity, selections_of
from glmkit.parity.compare import compare_indices
from glmkit.parity.dump import read_selections
from tests.conftest import reference_checkpoint
from tests.test_parity import altered, glmkit_cli

TIE_CONFIGS = {
    "heads2-kpool2-shared": dict(num_hidden_layers=6, layer_types=[KDA, DSA, DSA, KDA, DSA, DSA],
                                 indexer_types=["full", "full", "shared", "full", "full", "shared"],
                                 mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse", "sparse"],
                                 index_kpool=2, index_topk=6, index_n_heads=2, hc_mult=2),
    "heads2-kpool4": dict(index_kpool=4, index_topk=8, index_n_heads=2, hc_mult=2),
}
FIRST_DSA = {"heads2-kpool2-shared": 1, "heads2-kpool4": 3}


@pytest.fixture(scope="module", params=sorted(TIE_CONFIGS))
def tie_ckpt(request, tmp_path_factory):
    name = request.param
    path = tmp_path_factory.mktemp(f"ties-{name}") / "ck"
    return name, reference_checkpoint(variant_config("tiny", **TIE_CONFIGS[name]), seed=11, path=path)


@pytest.mark.parametrize("paths", [("reference", "train"), ("reference", "rollout")])
def test_ties_are_told_apart_and_replay_compares_like_for_like(tie_ckpt, paths):
    name, path = tie_ckpt
    plain, _, _ = parity(path, paths, seq_len=64, batch=2, replay_topk="off")
    first = FIRST_DSA[name]
    site = next(s for s in plain.sites if (s.layer, s.site) == (first, "indexer_topk"))
    # the paths do select differently at the first DSA layer, and every such row is a tie
    assert site.tied > 0 and site.different == 0 and not site.diverged
    assert any(f"layer {first} indexer_topk" in w and "ties" in w for w in plain.warnings)
    # without replay the tie changes the attention downstream: that is what replay is for
    assert plain.verdict == "fail" and plain.first_divergence.site != "indexer_topk"

    result, _, b = parity(path, paths, seq_len=64, batch=2)  # auto: the reference is path A, ties seen
    assert result.topk_replay and "ties were seen" in result.topk_replay and b.manifest["topk_replayed"]
    assert result.verdict == "pass", result.first_divergence
    index = [s for s in result.sites if s.site == "indexer_topk"]
    assert all(s.different == 0 for s in index) and any(s.tied > 0 for s in index)
    # downstream at the fp32 floor (the bound the parity tests use for the untied configurations)
    assert result.logprob.value < 1e-5
    assert max(s.rel_rms for s in result.sites if s.kind == "values") < 1e-4
    assert result.to_json()["sites"][0].keys() >= {"tied", "different", "identical"}


def unnormalised_indexer_query(monkeypatch) -> None:
    """The reported indexer bug, put into glmkit's model: the indexer fed q_a's output before its RMSNorm."""
    project = SparseMLA._project

    def unnormalised(self, x):
        _, q, latent = project(self, x)
        return self.q_a_proj(x), q, latent

    monkeypatch.setattr(SparseMLA, "_project", unnormalised)


def test_an_unnormalised_indexer_query_still_fails_at_that_layers_topk(tie_ckpt, monkeypatch):
    """The reported indexer bug: its rows differ for real (not at a tied boundary), so neither the tie
    judgement nor the automatic replay hides it."""
    name, path = tie_ckpt
    unnormalised_indexer_query(monkeypatch)
    result, _, _ = parity(path, ("reference", "train"), seq_len=64, batch=2)
    first = result.first_divergence
    assert result.verdict == "fail" and (first.layer, first.site) == (FIRST_DSA[name], "indexer_topk")
    assert first.different > 0.01


def test_check_and_parity_agree_on_ties_and_on_an_indexer_bug(tie_ckpt, tmp_path, monkeypatch):
    """Issue 34: `glmkit check` compared at its own threshold without tie handling, so it failed on
    these checkpoints where parity correctly reported ties. Both now use glmkit.comparison's engine:
    both pass here, with the same tied layers replayed; and with the indexer bug both fail (replay does
    not hide selections that differ for real)."""
    from glmkit import check

    name, path = tie_ckpt
    first = FIRST_DSA[name]
    result = check.run_check(check.CheckSettings(checkpoint=path, decode_steps=8), work_dir=tmp_path)
    assert result["verdict"] == "pass", [c for c in result["checks"] if not c["pass"]]
    assert result["topk_replay"] and "ties were seen at layer(s)" in result["topk_replay"]
    assert all(c["topk_replayed"] for c in result["checks"] if c["name"].startswith("reference"))
    rows = [r for r in result["selections"] if r["layer"] == first]
    assert {r["path"] for r in rows} == {"train", "rollout"} and any(r["tied"] > 0 for r in rows)
    assert all(r["different"] == 0 and r["pass"] for r in result["selections"])
    for paths in (("reference", "train"), ("reference", "rollout")):
        assert parity(path, paths, seq_len=64, batch=2)[0].verdict == "pass"

    unnormalised_indexer_query(monkeypatch)
    broken = check.run_check(check.CheckSettings(checkpoint=path, decode_steps=8), work_dir=tmp_path)
    assert broken["verdict"] == "fail"
    assert any(r["layer"] == first and not r["pass"] for r in broken["selections"])
    assert parity(path, ("reference", "train"), seq_len=64, batch=2)[0].verdict == "fail"


def test_check_and_parity_agree_on_every_parity_configuration(ref_ckpt, tmp_path, monkeypatch):
    """Issue 34's done-when, on the parity configurations (kpool 2, 4 and 8, shared indexers): check's
    sequences and parity's, shorter than one pool and across several, pass on both; with the indexer
    bug both fail."""
    from glmkit import check

    _, path = ref_ckpt
    lives = (("reference", "train"), ("reference", "rollout"))
    assert check.run_check(check.CheckSettings(checkpoint=path, decode_steps=4), tmp_path)["verdict"] == "pass"
    assert [parity(path, paths, seq_len=n, batch=2)[0].verdict for paths in lives for n in (3, 37)] == ["pass"] * 4
    unnormalised_indexer_query(monkeypatch)
    assert check.run_check(check.CheckSettings(checkpoint=path, decode_steps=4), tmp_path)["verdict"] == "fail"
    assert [parity(path, paths, seq_len=37, batch=2)[0].verdict for paths in lives] == ["fail"] * 2


def test_a_perturbed_indexer_weight_fails(tie_ckpt, tmp_path):
    name, path = tie_ckpt
    layer = FIRST_DSA[name]
    key = f"model.language_model.layers.{layer}.self_attn.indexer.wq_b.weight"
    bad = altered(path, tmp_path / "bad", key, lambda w: w + 0.5 * torch.randn_like(w))
    result, _, _ = parity(path, ("reference", "train"), checkpoint_b=bad, seq_len=64, batch=2)
    assert result.verdict == "fail"
    assert (result.first_divergence.layer, result.first_divergence.site) == (layer, "indexer_topk")


def test_replay_on_uses_path_as_selection_and_reports_its_own(tie_ckpt):
    """--replay-topk on: path B attends over path A's selection; its indexer_topk site still shows
    what its own indexer chose, so the tie rows remain visible."""
    name, path = tie_ckpt
    result, a, b = parity(path, ("reference", "train"), seq_len=64, batch=2, replay_topk="on")
    assert "--replay-topk on" in result.topk_replay and result.verdict == "pass"
    layer = FIRST_DSA[name]
    assert not torch.equal(a.tensors[(layer, "indexer_topk")], b.tensors[(layer, "indexer_topk")])


def test_selections_from_a_file_drive_both_paths(tie_ckpt, tmp_path):
    """A framework's per-token indexer_topk (int32 [tokens, DSA layers, k], sequence-local) as the
    replay source: both paths use it and agree at the fp32 floor; bad files are refused clearly."""
    name, path = tie_ckpt
    _, ref_cap, _ = parity(path, ("reference", "train"), seq_len=64, batch=2, replay_topk="off")
    config = open_checkpoint(path).config
    sel = selections_of(ref_cap)
    layers = sorted(sel)
    array = torch.stack([sel[layer] for layer in layers], dim=1).to(torch.int32)
    save_file({"indexer_topk": array}, str(tmp_path / "sel.safetensors"))
    np.save(tmp_path / "sel.npy", array.numpy())
    for file in ("sel.safetensors", "sel.npy"):
        loaded = read_selections(tmp_path / file, config)
        assert sorted(loaded) == layers and all(torch.equal(loaded[k], sel[k]) for k in layers)
    result, _, _ = parity(path, ("reference", "train"), seq_len=64, batch=2, replay_from=loaded,
                          replay_from_name="sel.npy")
    assert result.verdict == "pass" and "sel.npy" in result.topk_replay and result.logprob.value < 1e-5

    save_file({"other": array}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="no tensor 'indexer_topk'"):
        read_selections(tmp_path / "bad.safetensors", config)
    np.save(tmp_path / "flat.npy", array[:, 0].numpy())
    with pytest.raises(ValueError, match=r"expected int32 \[tokens, DSA layers, k\]"):
        read_selections(tmp_path / "flat.npy", config)
    with pytest.raises(ValueError, match="must be .safetensors or .npy"):
        read_selections(tmp_path / "sel.pt", config)
    (tmp_path / "garbage.safetensors").write_bytes(b"garbage, not a safetensors file")
    with pytest.raises(ValueError, match="garbage.safetensors: not a readable selections file"):
        read_selections(tmp_path / "garbage.safetensors", config)
    far = array.clone()
    far[0, 0, 0] = 1_000_000
    save_file({"indexer_topk": far}, str(tmp_path / "far.safetensors"))
    with pytest.raises(ValueError, match=r"allowed: -1 \(empty\) or a token position below the"):
        read_selections(tmp_path / "far.safetensors", config)
    with pytest.raises(ValueError, match="token rows; the input has"):
        parity(path, ("reference", "train"), seq_len=32, batch=1, replay_from=loaded)


def test_cli_reports_ties_replay_and_exit_codes(tie_ckpt, tmp_path):
    name, path = tie_ckpt
    ok = glmkit_cli("parity", "--checkpoint", path, "--paths", "reference,train", "--json", tmp_path / "r.json")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "top-k replay:" in ok.stdout and "warning: layer" in ok.stdout and "ok (ties)" in ok.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["topk_replay"] and data["warnings"]
    assert any(s["site"] == "indexer_topk" and s["tied"] > 0 and s["different"] == 0 for s in data["sites"])
    off = glmkit_cli("parity", "--checkpoint", path, "--paths", "reference,train", "--replay-topk", "off")
    assert off.returncode == 1 and "verdict: fail" in off.stdout
    bad = glmkit_cli("parity", "--checkpoint", path, "--paths", "reference,train", "--replay-topk-from",
                     tmp_path / "missing.npy")
    assert bad.returncode == 2 and "missing.npy" in bad.stderr


def test_compare_indices_counts_identical_tied_and_different():
    """kpool 2: rows of token positions over 4 pools. Row 0 identical; row 1 differs by pools 1 and 2
    that both score the boundary (0) on both sides: tied; row 2 picks pool 3 over pool 1 although
    pool 1 scores higher: not a top-k of its scores, so different."""
    a = torch.tensor([[0, 1, 2, 3], [0, 1, 4, 5], [0, 1, 2, 3]])
    b = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 6, 7]])
    scores = torch.tensor([[3.0, 1.0, 0.0, 0.0], [3.0, 0.0, 0.0, -1.0], [3.0, 2.0, 0.0, 0.0]])
    r = compare_indices(a, b, 3, "indexer_topk", 0.99, scores, scores, group=2, atol=1e-6, rtol=1e-5)
    assert (r.identical, r.tied, r.different) == pytest.approx((1 / 3, 1 / 3, 1 / 3)) and r.diverged
    # a tie needs equal scores on both sides: a difference beyond the tolerance is not one
    shifted = scores.clone()
    shifted[1, 2] = 1e-3
    r = compare_indices(a, b, 3, "indexer_topk", 0.5, scores, shifted, group=2, atol=1e-6, rtol=1e-5)
    assert r.tied == 0 and r.different == pytest.approx(2 / 3)
    # without scores nothing can be judged a tie
    r = compare_indices(a, b, 3, "indexer_topk", 0.5, group=2)
    assert r.tied == 0 and r.different == pytest.approx(2 / 3)
    # experts: group 1, ties in score + bias
    experts_a, experts_b = torch.tensor([[0, 1], [0, 2]]), torch.tensor([[0, 1], [0, 3]])
    choice = torch.tensor([[0.9, 0.5, 0.1, 0.1], [0.9, 0.1, 0.4, 0.4]])
    r = compare_indices(experts_a, experts_b, 1, "router_experts", 0.99, choice, choice, atol=1e-6, rtol=1e-5)
    assert (r.identical, r.tied, r.different) == (0.5, 0.5, 0.0) and not r.diverged


def test_grpo_topk_replay_follows_the_rollout_through_ties(tmp_path, monkeypatch):
    """The rollout engine here breaks index ties toward the higher pool (as another engine may), the
    trainer toward the lower. Without replay the response tokens' selections differ, first by ties
    and then, once the rollout's states have moved, for real, and the log-probs move. With
    `--use-rollout-indexer-replay` the trainer attends over the rollout's positions: its states
    follow the rollout's, its own indexer now differs only by ties (`train/topk_tie_frac` =
    `train/topk_mismatch_frac` > 0), and the train-vs-rollout log-prob diff is at the fp32 floor
    (< 1e-5, as the tiny run's)."""
    from glmkit.model import indexer as indexer_module
    from glmkit.model.indexer import LightningIndexer
    from glmkit.rl.loop import ASSETS, GRPOTrainer, TrainConfig, train_rows

    path = reference_checkpoint(variant_config("tiny", **TIE_CONFIGS["heads2-kpool2-shared"]), seed=11,
                                path=tmp_path / "ck")
    lowest_first = indexer_module.topk_lowest_index_first

    def highest_first(scores, k):
        return scores.shape[-1] - 1 - lowest_first(scores.flip(-1), k)

    decode_step = LightningIndexer.select_step

    def step_with_other_ties(self, *args, **kwargs):
        with monkeypatch.context() as m:
            m.setattr(indexer_module, "topk_lowest_index_first", highest_first)
            return decode_step(self, *args, **kwargs)

    monkeypatch.setattr(LightningIndexer, "select_step", step_with_other_ties)
    metrics = {}
    for replay in (False, True):
        cfg = TrainConfig(model_name="tiny", checkpoint=str(path), tokenizer=str(ASSETS / "tiny_tokenizer"),
                          num_rollout=1, rollout_batch_size=4, n_samples_per_prompt=4, global_batch_size=16,
                          rollout_max_response_len=24, enable_r3=True, use_rollout_indexer_replay=replay,
                          metrics_out=str(tmp_path / f"m{replay}.jsonl"), progress=False)
        metrics[replay] = train_rows(GRPOTrainer(cfg).step(0))[0]  # one optimizer step of all 16 samples
    plain, replayed = metrics[False], metrics[True]
    assert 0 < plain["train/topk_tie_frac"] < plain["train/topk_mismatch_frac"]
    assert plain["train/train_rollout_logprob_abs_diff"] > 1e-4
    assert replayed["train/topk_mismatch_frac"] > 0
    assert replayed["train/topk_tie_frac"] == pytest.approx(replayed["train/topk_mismatch_frac"])
    assert replayed["train/train_rollout_logprob_abs_diff"] < 1e-5


def test_notebook_01_passes_on_ties_and_shows_them(tmp_path, capsys):
    """The report a user shares: on a checkpoint whose DSA rows tie, notebook 01 replays the
    reference's selections, passes, and its JSON and page show the tied rows and the replay."""
    from glmkit.notebook import main
    from tests.test_notebooks import LAYER_PARITY

    path = reference_checkpoint(variant_config("tiny", **TIE_CONFIGS["heads2-kpool4"]), seed=11, path=tmp_path / "ck")
    out = tmp_path / "report"
    assert main(["report", str(LAYER_PARITY), "--out", str(out), "-p", "checkpoint", str(path)]) == 0
    data = json.loads((out / "parity.json").read_text())
    assert data["verdict"] == "pass" and data["topk_replay"] and data["warnings"]
    assert any(s["site"] == "indexer_topk" and s["tied"] > 0 for s in data["sites"])
    text = (out / "01_layer_parity.html").read_text()
    assert "top-k replay" in text and "differ only by ties" in text


def test_views_show_tied_rows(tie_ckpt):
    from glmkit.parity.builtin import index_agreement
    from widgets import TopkOverlap, VerdictBanner

    name, path = tie_ckpt
    result, _, _ = parity(path, ("reference", "train"), seq_len=64, batch=2)
    layer = FIRST_DSA[name]
    agreement = index_agreement(result, "indexer_topk")
    assert agreement[layer]["tied"] > 0 and agreement[layer]["different"] == 0
    heights = [p.get_height() for p in TopkOverlap(agreement).figure(("tied",)).axes[0].patches]
    assert heights[sorted(agreement).index(layer)] == pytest.approx(agreement[layer]["tied"])
    banner = VerdictBanner(result).text
    assert banner.startswith("PASS") and "top-k replay:" in banner and "differ only by ties" in banner


def test_a_selections_file_that_is_a_pipe_or_a_bad_npy_is_refused_by_name(tmp_path):
    """Hostile pass 6: a FIFO as --replay-topk-from hung parity (a .safetensors one ignored SIGTERM);
    .npy files with an object dtype, a header declaring more than the file holds, or a truncated
    header ended in exit 3. Each is a ValueError naming the file."""
    import os

    import numpy as np

    config = variant_config("tiny")
    os.mkfifo(tmp_path / "pipe.safetensors")
    with pytest.raises(ValueError, match=r"pipe.safetensors: is a named pipe \(FIFO\); a selections file"):
        read_selections(tmp_path / "pipe.safetensors", config)
    np.save(tmp_path / "floats.npy", np.zeros((4, 1, 2), dtype=np.float32))
    good = np.zeros((4, 1, 2), dtype=np.int32)
    np.save(tmp_path / "good.npy", good)
    raw = (tmp_path / "good.npy").read_bytes()
    # the header declares 10^10 rows (padded to the same length); the file holds 4
    header_end = raw.index(b"\n") + 1
    huge_header = raw[:header_end].replace(b"(4, 1, 2), }", b"(10000000000, 1, 2), }").replace(b"          \n", b"\n")
    (tmp_path / "huge.npy").write_bytes(huge_header + raw[header_end:])
    (tmp_path / "cut.npy").write_bytes(raw[:20])
    for name in ("floats.npy", "huge.npy", "cut.npy"):
        with pytest.raises(ValueError, match=f"{name}: not a readable selections file"):
            read_selections(tmp_path / name, config)
    assert read_selections(tmp_path / "good.npy", config)[3].shape == (4, 2)
