"""Framework dumps as parity paths: SGLang's dumper format read (engine and trainer), sequences lined up
across sides, the departing side named against the reference, ties told apart, gradients compared.

Dumps come from two writers: files written by sglang 0.5.23's own dumper (tests/data/sglang_dumper,
made by its make_fixture.py; every logical value known) and tests/framework_dumps.py, which writes
whole-model dumps of a tiny checkpoint with the same conventions (checked here against the real files).
Tolerances are compare()'s fp32 defaults (rel RMS 1e-4): a partial sum split across tp ranks and added
back is exact to ~1e-7; an injected divergence (a weight scaled by 1.1) moves its site by ~1e-1.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
import torch

from glmkit.checkpoint import open_checkpoint
from glmkit.config import variant_config
from glmkit.model import load_model
from glmkit.parity.builtin import dump_parity, gradient_parity, make_inputs, parity
from glmkit.parity.capture import capture_reference, capture_rollout, capture_train
from glmkit.parity.departure import capture_gradients, parameter_key
from glmkit.parity.framework_dump import dump_leaves, parse_dims, read_framework_dump
from glmkit.reference import load_reference
from tests.conftest import reference_checkpoint
from tests.framework_dumps import DumperFiles, sglang_info, write_engine_dump, write_trainer_dump
from tests.test_parity import altered, glmkit_cli
from tests.test_ties import TIE_CONFIGS

REAL = Path(__file__).parent / "data" / "sglang_dumper"


def known(r, p, c):  # make_fixture.value
    return 100.0 * r + p + c / 10.0


# --- files written by SGLang's own dumper ---------------------------------------------------------------------

def test_reads_the_engine_side_sglangs_dumper_wrote():
    dump = read_framework_dump(REAL / "engines")
    cap = dump.capture
    assert dump.side == "engine" and dump.not_read == [] and dump.incomplete == []
    # two requests, rows placed by rid and position across the prefill and two decode steps
    assert cap.input_ids.tolist() == [11, 12, 13, 14, 15, 21, 22, 23] and cap.cu_seqlens.tolist() == [0, 5, 8]
    expected = torch.tensor([[known(r, p, c) for c in range(4)] for r, n in ((0, 5), (1, 3)) for p in range(n)])
    torch.testing.assert_close(cap.tensors[(0, "attn_out")], expected, rtol=0, atol=1e-5)  # tp partial sums added
    torch.testing.assert_close(cap.tensors[(0, "mlp_in")], expected, rtol=0, atol=0)       # tp shards concatenated
    assert cap.tensors[(0, "router_experts")].tolist() == expected[:, :2].long().sort(-1).values.tolist()


def test_reads_the_trainer_side_sglangs_dumper_wrote():
    dump = read_framework_dump(REAL / "fwd_bwd")  # the one rollout folder below the phase
    assert dump.side == "trainer"
    expected = torch.tensor([[known(r, p, c) for c in range(4)] for r, n in ((0, 5), (1, 3)) for p in range(n)])
    # sequence-parallel halves joined, the 1 squeezed, the micro-batch's 2 padding rows dropped
    torch.testing.assert_close(dump.capture.tensors[(0, "attn_out")], expected, rtol=0, atol=0)
    torch.testing.assert_close(dump.grads.tensors[(0, "attn_out")], expected / 1000, rtol=0, atol=0)


def test_gradients_written_by_the_dumpers_backward_hooks_find_their_layers():
    """enable_grad=1: sglang's hooks name a gradient `grad__attn_output` with no layer_id; the reader gives
    each one its layer from the backward order (the fixture's chain: layer L's output is scaled by the later
    layers' factors on the way back; float32 products in autograd's order, so to float32 rounding)."""
    dump = read_framework_dump(REAL / "fwd_bwd_hooks")
    target = torch.tensor([[known(r, p, c) for c in range(4)] for r, n in ((0, 5), (1, 3)) for p in range(n)])
    after = {0: 3.0 * 5.0, 1: 5.0, 2: 1.0}  # make_fixture.HOOK_SCALE of the layers after each
    assert {layer for layer, _ in dump.grads.tensors} == {0, 1, 2}
    for layer, factor in after.items():
        torch.testing.assert_close(dump.grads.tensors[(layer, "attn_out")], target * factor, rtol=2e-7, atol=0)
    files = [f.name for f in (REAL / "fwd_bwd_hooks" / "rollout_0").glob("*grad__*")]
    assert files and all("layer_id" not in f for f in files)  # as the dumper wrote them


def test_hook_gradients_that_cannot_be_placed_are_refused_with_the_reason(tmp_path):
    shutil.copytree(REAL / "fwd_bwd_hooks", tmp_path / "d")
    next((tmp_path / "d" / "rollout_0").glob("step=0___rank=0___*name=grad__attn_output.pt")).unlink()
    with pytest.raises(ValueError, match=r"step 0 rank 0: 2 gradients grad__attn_output without layer_id for 3 "
                                         r"layers that dumped attn_output \(\[0, 1, 2\]\)"):
        read_framework_dump(tmp_path / "d")


def test_the_test_writer_follows_the_dumpers_conventions(tmp_path, tiny_ckpt):
    model = load_model(tiny_ckpt, torch.float32, "cpu")
    seqs, prompts = make_inputs(model.config.vocab_size, 2, 12)
    write_engine_dump(capture_rollout(model, seqs, prompts), prompts, tmp_path)
    write_trainer_dump(capture_train(model, seqs), tmp_path, phase="fwd_bwd")
    pattern = re.compile(r"step=\d+___rank=\d+___dump_index=\d+___name=\w+___recompute_status=\w+(___layer_id=\d+)?\.pt")
    for side in ("engines/engine_0", "fwd_bwd/rollout_0"):
        ours = sorted((tmp_path / side).glob("*.pt"))
        theirs = sorted((REAL / side).glob("*.pt"))
        assert ours and all(pattern.fullmatch(f.name) for f in ours + theirs)
        meta = lambda f: set(torch.load(f, weights_only=True)["meta"]) - {"dims", "layer_id"}  # noqa: E731
        assert meta(ours[0]) == meta(theirs[0])
        info = [k for k in meta(theirs[0]) if k.endswith("_parallel_info")]
        ours_info = torch.load(ours[0], weights_only=True)["meta"][info[0]]
        assert set(torch.load(theirs[0], weights_only=True)["meta"][info[0]]) <= set(ours_info)


# --- whole-model dumps of a tiny checkpoint ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("dump-tiny")
    ckpt = reference_checkpoint(variant_config("tiny"), seed=7, path=path / "ck")
    seqs, prompts = make_inputs(open_checkpoint(ckpt).config.vocab_size, 3, 24)
    return ckpt, seqs, prompts, path


def engine_dump(ckpt, seqs, prompts, out, **kw):
    return write_engine_dump(capture_rollout(load_model(ckpt, torch.float32, "cpu"), seqs, prompts), prompts, out,
                             **kw).parent


def trainer_dump(ckpt, seqs, out, **kw):
    return write_trainer_dump(capture_train(load_model(ckpt, torch.float32, "cpu"), seqs), out, **kw)


@pytest.mark.parametrize("bad_side", ["engine", "trainer"])
@pytest.mark.parametrize("layer,weight,site", [(1, "self_attn.o_proj.weight", "attn_out"),
                                               (2, "post_attention_layernorm.weight", "mlp_in")])
def test_an_injected_divergence_is_named_with_the_side_that_departs(tiny, bad_side, layer, weight, site):
    ckpt, seqs, prompts, path = tiny
    name = f"{bad_side}-{layer}"
    bad = altered(ckpt, path / f"bad-{name}", f"model.language_model.layers.{layer}.{weight}", lambda w: w * 1.1)
    engine = engine_dump(bad if bad_side == "engine" else ckpt, seqs, prompts, path / f"e-{name}")
    trainer = trainer_dump(bad if bad_side == "trainer" else ckpt, seqs, path / f"t-{name}")
    result, a, b = parity(ckpt, (str(trainer), str(engine)))
    assert result.verdict == "fail"
    assert (result.first_divergence.layer, result.first_divergence.site) == (layer, site)
    d = result.departure
    assert (d.side, d.layer, d.site) == ("b" if bad_side == "engine" else "a", layer, site)
    assert bad_side in d.path and "reference" in d.text and "stays within" in d.text
    # the engine never forwards the last token it samples: compared on the common prefix of each sequence
    assert a.lengths == b.lengths and sorted(a.lengths) == sorted(len(s) - 1 for s in seqs)  # in A's order
    assert any("compared on the first" in w for w in result.warnings)
    # every layer's sites were compared; layer 0 attn_out was split across tp ranks on the engine
    # (and the engine's streams dumped flat, [T, n*C], lined up with the trainer's [T, n, C])
    assert {(0, "attn_out"), (0, "streams_after_ffn"), (3, "indexer_topk"), (3, "router_experts"),
            (None, "final_hidden")} <= {(s.layer, s.site) for s in result.sites}
    assert not [k for r in result.versus_third.values() for k in r.skipped_sites if "shapes" in k]
    earlier = [s for s in result.sites if s.layer is not None and s.layer < layer]
    assert earlier and not any(s.diverged for s in earlier)


@pytest.mark.parametrize("dp", [1, 2])
def test_consistent_dumps_pass_and_agree_with_the_reference(tiny, dp):
    """dp 2: DP attention, each data-parallel group its own requests and steps (tp 4 = 2 groups of 2)."""
    ckpt, seqs, prompts, path = tiny
    engine = engine_dump(ckpt, seqs, prompts, path / f"e-ok{dp}", rids=["x", "y", "z"], dp=dp, tp=2 * dp)
    trainer = trainer_dump(ckpt, seqs, path / f"t-ok{dp}", micro_batches=2, recompute=True)
    result, _, _ = parity(ckpt, (str(trainer), str(engine)))
    assert result.verdict == "pass", result.first_divergence
    assert result.departure.side == "neither"
    assert all(r.verdict == "pass" for r in result.versus_third.values())
    data = json.loads(json.dumps(result.to_json()))
    assert data["departure"]["side"] == "neither" and data["versus_third"]["a"]["verdict"] == "pass"
    # without a checkpoint: the two sides alone, no third path
    alone, _, _ = dump_parity(None, str(trainer), str(engine))
    assert alone.verdict == "pass" and alone.departure is None


def test_ties_are_reported_as_ties_with_scores_recomputed_from_the_checkpoint(tmp_path):
    """The engine stand-in is transformers' reference (it breaks ties another way than glmkit's train
    path); its dump carries no candidate scores, so they are recomputed from its own attn_in / mlp_in."""
    ckpt = reference_checkpoint(variant_config("tiny", **TIE_CONFIGS["heads2-kpool4"]), seed=11, path=tmp_path / "ck")
    seqs, prompts = make_inputs(open_checkpoint(ckpt).config.vocab_size, 2, 64)
    ref = capture_reference(load_reference(ckpt, torch.float32, "cpu"), seqs)
    for key in [k for k in ref.tensors if k[1] in ("indexer_scores", "router_scores")]:
        del ref.tensors[key]
    engine = write_engine_dump(ref, prompts, tmp_path).parent
    trainer = write_trainer_dump(capture_train(load_model(ckpt, torch.float32, "cpu"), seqs), tmp_path)
    result, _, b = parity(ckpt, (str(trainer), str(engine)))
    topk = next(s for s in result.sites if (s.layer, s.site) == (3, "indexer_topk"))
    assert topk.tied > 0 and topk.different == 0 and not topk.diverged
    assert any("layer 3 indexer_scores recomputed" in w for w in result.warnings)
    assert (3, "indexer_scores") in b.tensors
    # each side against the reference: its selections at layer 3 differ by ties only (torch.topk breaks the
    # reference's ties by the number of candidates, so even the reference on a sequence one token shorter
    # picks other tied pools), and whatever departs does so downstream of those ties, named as such
    for r in result.versus_third.values():
        ties = next(s for s in r.sites if (s.layer, s.site) == (3, "indexer_topk"))
        assert ties.different == 0 and not ties.diverged
    d = result.departure
    assert d.layer == 3 and d.site != "indexer_topk" and "layer 3 indexer_topk" in d.tied_before
    assert "ties only: layer 3 indexer_topk" in d.text


def test_gradients_first_divergence_in_backward_order(tiny):
    """The trainer stand-in is glmkit's train path with a loss of its own (any loss: given by its gradient
    at the logits, which the dump holds as grad__logits); the third path, the reference, runs the same loss
    from each side's grad__logits, so the verdict names the side whose backward departs."""
    ckpt, seqs, prompts, path = tiny
    config = open_checkpoint(ckpt).config
    upstream = torch.randn(sum(map(len, seqs)), config.vocab_size, generator=torch.Generator().manual_seed(5)) / 100
    grads, params = capture_gradients("train", ckpt, seqs, logits_grad=upstream)
    assert "gradient at the logits" in grads.manifest["loss"]
    torch.testing.assert_close(grads.tensors[(None, "logits")], upstream, rtol=0, atol=0)
    cap = capture_train(load_model(ckpt, torch.float32, "cpu"), seqs)
    good = write_trainer_dump(cap, path / "g-ok", phase="fwd_bwd", grads=grads, param_grads=params)
    # a backward bug at layer 2's attention: that gradient and every one the backward computes after it
    from glmkit.parity.compare import site_order

    broken = {k: (v * 1.05 if site_order(k, True) >= site_order((2, "attn_out"), True) else v)
              for k, v in grads.tensors.items()}
    bad_grads = type(grads)(grads.input_ids, grads.cu_seqlens, broken, dict(grads.manifest))
    bad_params = {n: (g * 1.05 if parameter_key(n)[0] == 1 else g) for n, g in params.items()}
    bad = write_trainer_dump(cap, path / "g-bad", phase="fwd_bwd", grads=bad_grads, param_grads=bad_params)
    result, _, _ = parity(ckpt, (str(good), str(bad)))
    assert result.verdict == "pass"  # the forward agrees
    g = result.gradients
    assert g.verdict == "fail" and (g.first_divergence.layer, g.first_divergence.site) == (2, "attn_out")
    assert g.sites[0].layer is None  # the loss end first
    assert "loss" in g.warnings[0]
    p = result.parameter_gradients
    assert p.verdict == "fail" and p.first_divergence.layer == 1
    # against the reference's backward of the same loss: B departs there, A stays within (fp32 floor ~1e-4)
    d = g.departure
    assert (d.side, d.layer, d.site) == ("b", 2, "attn_out"), d.text
    assert g.versus_third["a"].verdict == "pass" and "stays within" in d.text
    # as a user runs it (--gradients is accepted with dumps; a dump without gradients is refused by name)
    out = glmkit_cli("parity", "--checkpoint", ckpt, "--paths", f"{good},{bad}", "--gradients")
    assert out.returncode == 1, out.stderr
    assert re.search(r"activation gradients: \d+ compared, 0 skipped; fail, first divergence in the backward order "
                     r"at layer 2 attn_out", out.stdout), out.stdout
    assert re.search(r"departure: B \S+g-bad\S+ gradients departs from reference first, at layer 2 attn_out; the other "
                     r"side \(A \S+g-ok\S+ gradients\) stays within", out.stdout), out.stdout
    values_only = write_trainer_dump(cap, path / "g-values")
    out = glmkit_cli("parity", "--checkpoint", ckpt, "--paths", f"{good},{values_only}", "--gradients")
    assert out.returncode == 2 and "--gradients: the dumps" in out.stderr and "hold no gradients" in out.stderr
    # without grad__logits there is no loss to give the third path: said, A and B compared alone
    for folder in (good, bad):
        for f in folder.glob("*name=grad__logits*"):
            f.unlink()
    result, _, _ = parity(ckpt, (str(good), str(bad)))
    assert result.gradients.departure is None and result.gradients.first_divergence.layer == 2
    assert any(w.startswith("no third path for gradients") and "grad__logits" in w for w in result.gradients.warnings)


def test_gradient_parity_train_against_reference(tiny):
    ckpt = tiny[0]
    acts, params = gradient_parity(ckpt, seq_len=24, batch=2)
    assert acts.verdict == "pass" and params.verdict == "pass", (acts.first_divergence, params.first_divergence)
    assert {(0, "attn_out"), (3, "mlp_out"), (None, "final_hidden")} <= {(s.layer, s.site) for s in acts.sites}
    families = {s.site for s in params.sites}
    assert "param:hc_attn_fn" in families and "param:self_attn.q_a_proj.weight" in families
    assert all("loss: mean over predicted tokens" in r.warnings[0] for r in (acts, params))


def test_parameter_names_of_each_framework_share_keys():
    assert parameter_key("module.module.decoder.layers.7.mlp.router.weight") == (7, "decoder.mlp.router.weight")
    assert parameter_key("model.language_model.layers.2.attn_hc.fn") == parameter_key("layers.2.hc_attn_fn")


def test_cli_names_the_departing_side(tiny, tmp_path):
    ckpt, seqs, prompts, path = tiny
    bad = altered(ckpt, tmp_path / "bad", "model.language_model.layers.1.self_attn.o_proj.weight", lambda w: w * 1.1)
    engine = engine_dump(bad, seqs, prompts, tmp_path / "e")
    trainer = trainer_dump(ckpt, seqs, tmp_path / "t")
    out = glmkit_cli("parity", "--checkpoint", ckpt, "--paths", f"{trainer},{engine}", "--json", tmp_path / "r.json")
    assert out.returncode == 1, out.stderr
    assert "departs from reference first, at layer 1 attn_out" in out.stdout
    data = json.loads((tmp_path / "r.json").read_text())
    assert data["departure"]["side"] == "b" and data["first_divergence"]["site"] == "attn_out"


# --- what a reader must refuse ------------------------------------------------------------------------------------

class _Boom:
    def __reduce__(self):
        return (print, ("pwned",))


def test_a_dump_needing_pickle_is_refused_by_name(tmp_path, capsys):
    folder = tmp_path / "engines" / "engine_0"
    folder.mkdir(parents=True)
    torch.save({"value": _Boom(), "meta": {}}, folder / "step=0___rank=0___dump_index=1___name=input_ids.pt",
               pickle_protocol=2)
    with pytest.raises(ValueError, match="weights_only"):
        read_framework_dump(tmp_path)
    assert "pwned" not in capsys.readouterr().out


def _copy_real(tmp_path, side="engines/engine_0", drop=None, edit=None):
    out = tmp_path / side
    out.mkdir(parents=True)
    for f in (REAL / side).glob("*.pt"):
        if drop and re.search(drop, f.name):
            continue
        data = torch.load(f, weights_only=True)
        if edit:
            edit(f.name, data)
        torch.save(data, out / f.name)
    return out


def test_a_missing_rank_file_is_named(tmp_path):
    _copy_real(tmp_path, drop=r"step=1___rank=1___.*name=attn_output")
    with pytest.raises(ValueError, match=r"attn_out layer 0 step 1: tp ranks \[0\] dumped it; tp size is 2"):
        read_framework_dump(tmp_path / "engines")


def test_dims_that_do_not_fit_the_tensor_are_refused(tmp_path):
    def edit(name, data):
        if "attn_output" in name:
            data["meta"]["dims"] = "t 1 h[tp:partial]"
    _copy_real(tmp_path, edit=edit)
    with pytest.raises(ValueError, match=r"name 3 dims; the tensor has 2"):
        read_framework_dump(tmp_path / "engines")


def test_context_parallel_dumps_are_refused_by_name(tmp_path):
    def edit(name, data):
        data["meta"]["megatron_parallel_info"].update(cp_rank=0, cp_size=2)
        if "attn_output" in name:
            data["meta"]["dims"] = "t[cp:zigzag,sp] 1 h"
    _copy_real(tmp_path, "fwd_bwd/rollout_0", edit=edit)
    with pytest.raises(ValueError, match="context parallel"):
        read_framework_dump(tmp_path / "fwd_bwd")


def test_without_batch_fields_rows_cannot_be_placed(tmp_path):
    _copy_real(tmp_path, drop=r"name=(input_ids|positions|seq_lens|rids|req_pool_indices)___")
    with pytest.raises(ValueError, match="no step with input_ids"):
        read_framework_dump(tmp_path / "engines")


def test_a_cached_prefix_is_named(tmp_path):
    _copy_real(tmp_path, drop=r"step=0___")
    with pytest.raises(ValueError, match="prefix cache"):
        read_framework_dump(tmp_path / "engines")


def test_a_whole_dumper_dir_asks_for_one_side(tmp_path):
    with pytest.raises(ValueError, match=r"3 dump folders in it .*engines/engine_0.*fwd_bwd/rollout_0"):
        dump_leaves(REAL)
    assert dump_leaves(REAL / "engines") == [REAL / "engines" / "engine_0"]


def test_a_replicated_mark_without_an_axis_is_refused():
    with pytest.raises(ValueError, match="':replicated' names no axis"):
        parse_dims("t h # :replicated")


def test_dims_grammar():
    dims, replicated, dp = parse_dims("t[cp:zigzag,sp] 1 (num_heads*head_dim)[tp] # ep:replicated dp:=attn_dp")
    assert [d.name for d in dims] == ["t", "1", "(num_heads*head_dim)"]
    assert dims[0].shards == (("cp", "zigzag"), ("sp", "sharded")) and dims[2].shards == (("tp", "sharded"),)
    assert replicated == {"ep"} and dp == "attn_dp"
    legacy, _, _ = parse_dims("t(cp:zigzag,sp) 1 h(tp:partial)")
    assert legacy[0].shards == (("cp", "zigzag"), ("sp", "sharded")) and legacy[2].shards == (("tp", "partial"),)


def test_notebook_01_takes_dump_directories_and_its_report_names_the_departing_side(tiny, tmp_path, capsys):
    from glmkit.notebook import main as report_main
    from tests.test_notebooks import LAYER_PARITY, report_header
    from tests.test_report_offline import assert_offline

    ckpt, seqs, prompts, path = tiny
    bad = altered(ckpt, tmp_path / "bad", "model.language_model.layers.2.self_attn.o_proj.weight", lambda w: w * 1.1)
    engine = engine_dump(bad, seqs, prompts, tmp_path / "e")
    trainer = trainer_dump(ckpt, seqs, tmp_path / "t")
    out = tmp_path / "report"
    assert report_main(["report", str(LAYER_PARITY), "--out", str(out), "-p", "checkpoint", str(ckpt),
                        "-p", "paths", f"{trainer},{engine}", "-p", "seq_len", "16"]) == 1
    data = json.loads((out / "parity.json").read_text())
    assert data["departure"]["side"] == "b" and (data["departure"]["layer"], data["departure"]["site"]) == (2, "attn_out")
    header = report_header((out / "01_layer_parity.html").read_text())
    assert "which side departs: engine engines departs from reference first, at layer 2 attn_out" in header
    assert_offline((out / "01_layer_parity.html").read_text())


def test_dumped_logits_give_the_logprob_metric_and_unalignable_names_say_why(tiny, tmp_path):
    ckpt, seqs, prompts, path = tiny
    cap = capture_train(load_model(ckpt, torch.float32, "cpu"), seqs, keep_logits=True)
    a = write_trainer_dump(cap, tmp_path / "a")
    b = write_trainer_dump(cap, tmp_path / "b", micro_batches=3)
    rank0 = next(a.glob("step=0___rank=0___*name=attn_output___*layer_id=1.pt"))
    data = torch.load(rank0, weights_only=True)
    data["meta"]["name"] = "attn_k"
    torch.save(data, a / rank0.name.replace("attn_output", "attn_k"))
    result, _, _ = dump_parity(ckpt, str(a), str(b), third="none")
    assert result.verdict == "pass" and result.logprob is not None and result.logprob.value < 1e-6
    assert any("attn_k (dumped before RoPE" in w for w in result.warnings)


def test_module_outputs_of_the_all_mode_are_read_by_their_module_paths(tiny, tmp_path):
    """non_intrusive__<module path>.output names (no dims), as the dumper's "all" mode writes them for the
    Megatron glm5_next model (decoder.layers.<i>...) and SGLang's (model.layers.<i>...), at tp 1."""
    ckpt, seqs, prompts, path = tiny
    cap = capture_train(load_model(ckpt, torch.float32, "cpu"), seqs)
    folder = write_trainer_dump(cap, tmp_path, tp=1, sequence_parallel=False, micro_batches=1)
    renamed = {"attn_output": "non_intrusive__module.module.decoder.layers.{}.self_attention.output.0",
               "pre_mlp_layernorm_output": "non_intrusive__module.module.decoder.layers.{}.pre_mlp_layernorm.output"}
    for f in list(folder.glob("*.pt")):
        data = torch.load(f, weights_only=True)
        name = data["meta"]["name"]
        if name in renamed:
            layer = data["meta"]["layer_id"]
            data["meta"].pop("dims")
            new = renamed[name].format(layer)
            data["meta"]["name"] = new
            torch.save(data, folder / f.name.replace(f"name={name}", f"name={new}"))
            f.unlink()
    extra = folder / "step=0___rank=0___dump_index=999___name=non_intrusive__module.module.embedding.output___recompute_status=disabled.pt"
    torch.save({"value": torch.zeros(3), "meta": {"name": "x"}}, extra)
    dump = read_framework_dump(folder)
    for site in ("attn_out", "mlp_in"):
        torch.testing.assert_close(dump.capture.tensors[(1, site)], cap.tensors[(1, site)], rtol=0, atol=0)
    assert any("1 module inputs/outputs" in n for n in dump.not_read)


def _slot_engine(folder, with_rids=(True, True, True, True)):
    """One engine rank, requests known by slot: A (tokens 11..14) in slot 1, then B (21, 22) in the same
    slot once A is done; attn_output of a row is 100 * request + position."""
    r = DumperFiles(folder / "engines" / "engine_0", 0, 1, "sglang_parallel_info", sglang_info(0, 1))
    steps = [("A", [0, 1, 2]), ("A", [3]), ("B", [0, 1]), ("B", [2])]
    tokens = {"A": [11, 12, 13, 14], "B": [21, 22, 23]}
    for step, ((request, positions), rids) in enumerate(zip(steps, with_rids)):
        r.dump(step, "input_ids", torch.tensor([tokens[request][p] for p in positions]))
        r.dump(step, "positions", torch.tensor(positions))
        r.dump(step, "seq_lens", torch.tensor([positions[-1] + 1]))
        r.dump(step, "req_pool_indices", torch.tensor([1]))
        if rids:
            r.dump(step, "rids", [f"rid-{request}"])
        value = torch.tensor([[100.0 * (request == "B") + p] for p in positions])
        r.dump(step, "attn_output", value, dims="t h", layer_id=0)
    return folder / "engines"


def test_without_rids_a_reused_slot_holds_a_new_request(tmp_path):
    """SGLang gives a finished request's req_pool_indices slot to the next one: without rids, a slot that
    starts again at position 0 is a new request (found by the unseen-dump check)."""
    dump = read_framework_dump(_slot_engine(tmp_path, with_rids=(False,) * 4))
    cap = dump.capture
    assert cap.lengths == [4, 3] and cap.input_ids.tolist() == [11, 12, 13, 14, 21, 22, 23]
    assert cap.tensors[(0, "attn_out")].flatten().tolist() == [0, 1, 2, 3, 100, 101, 102]
    with_rids = read_framework_dump(_slot_engine(tmp_path / "r"))
    assert with_rids.capture.lengths == [4, 3]


def test_rids_missing_in_some_steps_are_named_not_blamed_on_the_prefix_cache(tmp_path):
    with pytest.raises(ValueError, match=r"engine steps \[2\] have no rids \(or not one per request\) while other "
                                         r"steps do"):
        read_framework_dump(_slot_engine(tmp_path, with_rids=(True, True, False, True)))


def _first(pattern):
    """An edit applied to the files whose names match `pattern`."""
    def apply(change):
        def edit(name, data):
            if re.search(pattern, name):
                change(data)
        return edit
    return apply


@pytest.mark.parametrize("pattern, change, message", [
    (r"step=0___rank=0___.*attn_output", lambda d: d.update(meta=[1, 2]), "meta is a list; the dumper writes a dict"),
    (r"attn_output", lambda d: d["meta"].update(dims=5), "dims is a int; the dumper writes a string"),
    (r"step=1___.*name=(positions|seq_lens)___", lambda d: d.update(value=d["value"] + 10 ** 12),
     r"has no token at position \d+ "),
    (r"step=1___.*name=positions___", lambda d: d.update(value=d["value"] - 100), "positions holds -"),
    (r"name=positions___", lambda d: d.update(value=d["value"].float() + 0.5), "positions is a torch.float32 tensor"),
    (r"step=0___rank=0___.*attn_output", lambda d: d.update(value=d["value"].to_sparse()), "sparse_coo tensor"),
    (r"step=0___rank=0___.*attn_output", lambda d: d.update(value=torch.empty(2, 3, device="meta")),
     r"meta \(data-less\) tensor"),
    # Hostile pass 5: one stored element declaring 2**31 ran the reader out of memory (exit 4, not a refusal).
    (r"step=0___rank=0___.*input_ids", lambda d: d.update(value=torch.zeros(1, dtype=torch.long).expand(2 ** 31)),
     r"value: an expanded view of 2147483648 elements"),
    (r"step=0___rank=1___.*attn_output", lambda d: d.update(value=d["value"][:, :3]), "pieces of shapes"),
    (r"step=0___rank=1___.*attn_output", lambda d: d["meta"]["sglang_parallel_info"].update(tp_size=7),
     "the ranks' parallel info gives tp sizes"),
    (r"name=attn_output", lambda d: d.update(value=torch.tensor(1.0), meta={k: v for k, v in d["meta"].items()
                                                                             if k != "dims"}), "not a tensor with a token dim"),
])
def test_malformed_dump_fields_are_refused_by_name(tmp_path, pattern, change, message):
    """Hostile pass 4: each of these ended in exit 3 (a TypeError, KeyError, IndexError or torch error deep
    in the reader) or, for positions of 10**12, built a set of 10**12 positions. Each is a ValueError
    naming the field, read in well under a second."""
    _copy_real(tmp_path, edit=_first(pattern)(change))
    with pytest.raises(ValueError, match=message):
        read_framework_dump(tmp_path / "engines")


def test_a_dump_file_that_is_a_pipe_or_a_bad_tag_is_refused_by_name(tmp_path):
    folder = _copy_real(tmp_path)
    os.mkfifo(folder / "step=0___rank=0___dump_index=900___name=attn_output___layer_id=0.pt")
    with pytest.raises(ValueError, match=r"is a named pipe \(FIFO\); a dump file is a regular file"):
        read_framework_dump(tmp_path / "engines")  # blocked in torch.load for ever before
    (folder / "step=0___rank=0___dump_index=900___name=attn_output___layer_id=0.pt").unlink()
    one = next(folder.glob("step=2___rank=0___*"))
    one.rename(folder / one.name.replace("step=2", "step=x"))
    with pytest.raises(ValueError, match=r"step='x' in the file name is not an integer"):
        read_framework_dump(tmp_path / "engines")
