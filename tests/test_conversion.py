"""glmkit ckpt verify-conversion: real torch_dist checkpoints written with torch.distributed.checkpoint
through the framework's glm5_next name map, correct and broken each way a conversion goes wrong."""

import sys

sys.modules.setdefault("fla", None)

import io
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from glmkit.checkpoint import CheckpointError, expected_tensors, open_checkpoint, synth_checkpoint
from glmkit.checkpoint.conversion import framework_blobs, megatron_state, verify_conversion, write_torch_dist
from glmkit.checkpoint.megatron_names import megatron_rules
from glmkit.checkpoint.names import TEXT_PREFIX
from glmkit.checkpoint.torch_dist import TRACKER, TorchDistCheckpoint, save_torch_dist
from glmkit.cli import main
from glmkit.config import variant_config
from tests.conftest import CONFIGS, reference_checkpoint

FC1 = "decoder.layers.{}.mlp.linear_fc1.weight"
EXPERTS_FC1 = "decoder.layers.3.mlp.experts.experts.linear_fc1.weight"


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    return synth_checkpoint("tiny", 3, tmp_path_factory.mktemp("hf") / "tiny", progress=False)


@pytest.fixture(scope="module")
def good_state(hf):
    return megatron_state(hf)


def _write(state, folder, **kwargs):
    return save_torch_dist(state, folder, blobs=framework_blobs(state), **kwargs)


def _broken(good_state, tmp_path, change):
    state = {k: v.clone() for k, v in good_state.items()}
    change(state)
    return _write(state, tmp_path / "broken")


def _only(report, category):
    rows = getattr(report, category)
    assert len(rows) == 1, report.text()
    others = [c for c in ("missing", "extra", "misshaped", "differing", "narrowed") if c != category]
    assert all(not getattr(report, c) for c in others), report.text()
    return rows[0]


# --- the name map --------------------------------------------------------------------------------------

def test_the_map_gives_the_framework_keys_and_shapes_at_full_width():
    """Keys and global shapes of the recipe's checkpoint (GLM-5.3-Flash: 45 layers, 288 experts, layers
    0-2 dense), as the framework's bridge writes them."""
    config = variant_config("GLM-5.3-Flash")
    shapes = {k.removeprefix(TEXT_PREFIX): v for k, v in expected_tensors(config).items()}
    rules = megatron_rules(config, shapes)
    got = {key: rule.shape(shapes) for key, rule in rules.items()}
    assert got["embedding.word_embeddings.weight"] == (154880, 4096)
    assert got["output_layer.weight"] == (154880, 4096)
    assert got["decoder.layers.0.mlp.linear_fc1.weight"] == (2 * 12288, 4096)
    assert got["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"] == (4096,)
    assert "decoder.layers.0.pre_mlp_layernorm.weight" not in got  # dense: the norm is fused into fc1
    assert got["decoder.layers.3.pre_mlp_layernorm.weight"] == (4096,)
    assert got[EXPERTS_FC1] == (288, 4096, 4096)
    assert got["decoder.layers.3.mlp.experts.experts.linear_fc2.weight"] == (288, 4096, 2048)
    assert got["decoder.layers.3.mlp.router.expert_bias"] == (288,)
    assert got["decoder.layers.3.mlp.shared_experts.linear_fc1.weight"] == (4096, 4096)
    assert got["decoder.layers.0.self_attention.kda.conv1d.weight"] == (3 * 8192, 1, 4)
    assert got["decoder.layers.0.self_attention.kda.A_log"] == (64,)
    assert got["decoder.layers.3.self_attention.linear_kv_up_proj.weight"] == (64 * 512, 512)
    assert got["decoder.layers.3.self_attention.linear_q_up_proj.layer_norm_weight"] == (1536,)
    assert got["decoder.layers.3.self_attention.index_kpool_compress_ape"][1] == config.index_head_dim
    assert got["decoder.layers.7.self_attention_hyper_connection.mapping_proj.weight"] == (24, 4 * 4096)
    assert got["decoder.layers.7.mlp_hyper_connection.alpha_res"] == (1,)
    kda = [i for i in range(45) if f"decoder.layers.{i}.self_attention.kda.conv1d.weight" in got]
    dsa = [i for i in range(45) if f"decoder.layers.{i}.self_attention.linear_proj.weight" in got]
    assert (len(kda), len(dsa)) == (34, 11) and dsa == list(range(3, 45, 4))
    assert not any(".experts.experts." in k and "layers.2." in k for k in got)
    assert all(rule.keeps_fp32 for key, rule in rules.items()
               if key.endswith(("A_log", "dt_bias", "expert_bias", "compress_ape")) or "hyper_connection" in key)
    assert not rules["decoder.layers.3.mlp.router.weight"].keeps_fp32


def test_an_hf_tensor_the_map_does_not_know_is_an_error():
    config = variant_config("tiny")
    shapes = {k.removeprefix(TEXT_PREFIX): v for k, v in expected_tensors(config).items()}
    shapes["layers.0.self_attn.new_thing.weight"] = (4, 4)
    with pytest.raises(ValueError, match="no Megatron name for 1 HF tensors.*new_thing"):
        megatron_rules(config, shapes)


# --- correct conversions pass --------------------------------------------------------------------------

def test_a_conversion_written_the_framework_way_passes(hf, good_state, tmp_path):
    folder = _write(good_state, tmp_path / "td")
    assert (folder / TRACKER).read_text() == "release" and (folder / "release" / ".metadata").is_file()
    report = verify_conversion(hf, folder, progress=False)
    assert report.passed, report.text()
    assert report.checked == report.matched == len(good_state)
    assert report.skipped["non-tensor entries"] > 50  # _extra_state, rng and common state are skipped, not read
    assert good_state[EXPERTS_FC1].dtype == torch.bfloat16
    assert good_state["decoder.layers.0.self_attention.kda.A_log"].dtype == torch.float32


@pytest.mark.parametrize("name", ["shared-kpool2", "kpool8"])
def test_a_transformers_written_checkpoint_of_other_shapes_converts_and_passes(name, tmp_path):
    """HF checkpoints written by transformers' save_pretrained (bf16 and fp32 mixed as it stores them),
    other layer schedules: shared indexers (no indexer tensors), dense layers after MoE ones."""
    config = variant_config("tiny", **CONFIGS[name])
    hf = reference_checkpoint(config, 5, tmp_path / "hf")
    folder = write_torch_dist(hf, tmp_path / "td", iteration=12)
    assert (folder / TRACKER).read_text() == "12" and (folder / "iter_0000012" / ".metadata").is_file()
    report = verify_conversion(hf, folder, progress=False)
    assert report.passed, report.text()
    if name == "shared-kpool2":
        assert not any(k.startswith("decoder.layers.2.self_attention.wk") for k in TorchDistCheckpoint(folder).tensors)


def test_vocab_padding_is_a_note_not_a_failure(hf, good_state, tmp_path):
    def pad(state):
        for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
            state[key] = torch.cat([state[key], torch.zeros(64, state[key].shape[1], dtype=state[key].dtype)])
    report = verify_conversion(hf, _broken(good_state, tmp_path, pad), progress=False)
    assert report.passed, report.text()
    assert [r["rows"] - r["expected_rows"] for r in report.padded] == [64, 64]
    assert "padding" in report.text()


def test_optimizer_state_in_the_checkpoint_is_skipped_not_extra(hf, good_state, tmp_path):
    def with_optimizer(state):
        state["optimizer.state.exp_avg.decoder.final_layernorm.weight"] = torch.zeros(64)
    report = verify_conversion(hf, _broken(good_state, tmp_path, with_optimizer), progress=False)
    assert report.passed and report.skipped["optimizer / training-state tensors"] == 1


def test_per_expert_keys_and_wrapper_prefixes_are_read_as_the_map_names(hf, good_state, tmp_path):
    """Experts saved one key each (`...mlp.experts.linear_fc1.weight{e}`, Megatron's singleton local
    shards) and keys under a `module.module.` / `language_model.` wrapper: the same checkpoint."""
    def per_expert(state):
        for fc in ("linear_fc1", "linear_fc2"):
            stack = state.pop(f"decoder.layers.3.mlp.experts.experts.{fc}.weight")
            for e in range(stack.shape[0]):
                state[f"module.module.decoder.layers.3.mlp.experts.{fc}.weight{e}"] = stack[e].clone()
        state["language_model.decoder.final_layernorm.weight"] = state.pop("decoder.final_layernorm.weight")
    report = verify_conversion(hf, _broken(good_state, tmp_path, per_expert), progress=False)
    assert report.passed and report.checked == len(good_state), report.text()

    def permuted(state):
        per_expert(state)
        key = "module.module.decoder.layers.3.mlp.experts.linear_fc2.weight{}"
        state[key.format(0)], state[key.format(6)] = state[key.format(6)], state[key.format(0)]
    row = _only(verify_conversion(hf, _broken(good_state, tmp_path / "p", permuted), progress=False), "differing")
    assert row["key"] == "decoder.layers.3.mlp.experts.experts.linear_fc2.weight" and row["experts"] == [0, 6]


# --- each break is named by tensor, with its likely cause ----------------------------------------------

def _swap_halves(t):
    a, b = t.chunk(2)
    return torch.cat([b, a])


BREAKS = {
    "gate/up halves (dense fc1)": (lambda s: s.__setitem__(FC1.format(0), _swap_halves(s[FC1.format(0)])),
                                   FC1.format(0), "gate/up halves swapped"),
    "gate/up halves (shared expert)": (
        lambda s: s.__setitem__("decoder.layers.3.mlp.shared_experts.linear_fc1.weight",
                                _swap_halves(s["decoder.layers.3.mlp.shared_experts.linear_fc1.weight"])),
        "decoder.layers.3.mlp.shared_experts.linear_fc1.weight", "gate/up halves swapped"),
    "gate/up halves (every routed expert)": (
        lambda s: s.__setitem__(EXPERTS_FC1, torch.cat([s[EXPERTS_FC1][:, 32:], s[EXPERTS_FC1][:, :32]], dim=1)),
        EXPERTS_FC1, "gate/up halves swapped in experts 0-7"),
    "q/k/v conv order": (
        lambda s: s.__setitem__("decoder.layers.1.self_attention.kda.conv1d.weight",
                                s["decoder.layers.1.self_attention.kda.conv1d.weight"][
                                    torch.cat([torch.arange(128, 192), torch.arange(0, 128)])]),
        "decoder.layers.1.self_attention.kda.conv1d.weight", "parts in the order v, q, k"),
    "transposed (square)": (
        lambda s: s.__setitem__("decoder.layers.2.self_attention.kda.q_proj.weight",
                                s["decoder.layers.2.self_attention.kda.q_proj.weight"].T.contiguous()),
        "decoder.layers.2.self_attention.kda.q_proj.weight", "transposed"),
    "experts permuted": (
        lambda s: s.__setitem__("decoder.layers.3.mlp.experts.experts.linear_fc2.weight",
                                s["decoder.layers.3.mlp.experts.experts.linear_fc2.weight"][[0, 1, 2, 5, 4, 3, 6, 7]]),
        "decoder.layers.3.mlp.experts.experts.linear_fc2.weight", "experts permuted (2 experts"),
    "scaled": (
        lambda s: s.__setitem__("decoder.layers.3.self_attention.linear_kv_up_proj.weight",
                                s["decoder.layers.3.self_attention.linear_kv_up_proj.weight"] * 0.5),
        "decoder.layers.3.self_attention.linear_kv_up_proj.weight", "scaled by 0.5"),
    "mHC alphas swapped": (
        lambda s: s.__setitem__("decoder.layers.2.self_attention_hyper_connection.alpha_res",
                                s["decoder.layers.2.self_attention_hyper_connection.alpha_pre"].clone()),
        "decoder.layers.2.self_attention_hyper_connection.alpha_res", "holds layers.2.hc_attn_scale[0] (alpha_pre"),
    "indexer weight never written": (
        lambda s: s.__setitem__("decoder.layers.3.self_attention.wk.weight",
                                torch.zeros_like(s["decoder.layers.3.self_attention.wk.weight"])),
        "decoder.layers.3.self_attention.wk.weight", "all zeros"),
}


@pytest.mark.parametrize("kind", list(BREAKS))
def test_each_break_is_named_by_tensor_with_its_cause(kind, hf, good_state, tmp_path):
    change, key, cause = BREAKS[kind]
    report = verify_conversion(hf, _broken(good_state, tmp_path, change), progress=False)
    row = _only(report, "differing")
    assert row["key"] == key and cause in row["cause"], row
    assert row["differing"] > 0 and row["max_abs_diff"] > 0
    assert report.matched == report.checked - 1


def test_a_plain_value_change_is_named_without_a_guessed_cause(hf, good_state, tmp_path):
    def nudge(state):
        state["decoder.final_layernorm.weight"][5] += 1
    row = _only(verify_conversion(hf, _broken(good_state, tmp_path, nudge), progress=False), "differing")
    assert row["key"] == "decoder.final_layernorm.weight" and row["cause"] is None and row["differing"] == 1


def test_a_non_square_transpose_is_mis_shaped_and_named(hf, good_state, tmp_path):
    key = "decoder.layers.3.self_attention.linear_q_down_proj.weight"
    report = verify_conversion(hf, _broken(good_state, tmp_path, lambda s: s.__setitem__(key, s[key].T.contiguous())),
                               progress=False)
    row = _only(report, "misshaped")
    assert row["key"] == key and row["cause"] == "transposed" and row["expected"] == list(good_state[key].shape)


def test_missing_extra_and_narrowed_tensors_are_named(hf, good_state, tmp_path):
    def change(state):
        del state["decoder.layers.1.input_layernorm.weight"]
        state["decoder.layers.1.self_attention.kda.extra_proj.weight"] = torch.zeros(2, 2)
        state["decoder.layers.0.mlp_hyper_connection.mapping_proj.weight"] = \
            state["decoder.layers.0.mlp_hyper_connection.mapping_proj.weight"].bfloat16()
    report = verify_conversion(hf, _broken(good_state, tmp_path, change), progress=False)
    assert [r["key"] for r in report.missing] == ["decoder.layers.1.input_layernorm.weight"]
    assert report.missing[0]["hf"] == ["layers.1.input_layernorm.weight"]
    assert [r["key"] for r in report.extra] == ["decoder.layers.1.self_attention.kda.extra_proj.weight"]
    assert report.narrowed == [{"key": "decoder.layers.0.mlp_hyper_connection.mapping_proj.weight", "dtype": "bfloat16"}]
    assert not report.differing and not report.passed


# --- a checkpoint several ranks wrote -------------------------------------------------------------------

def _save_from_rank(rank, world, state_file, folder, port):
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        state = load_file(state_file)
        # expert stacks and the big matrices sharded over ranks on dim 0, as expert / tensor parallel
        # saves do; the rest replicated (written once)
        sharded = {k: distribute_tensor(v, mesh, [Shard(0)]) if v.dim() >= 2 and v.shape[0] % world == 0 else v
                   for k, v in state.items()}
        dcp.save(sharded, checkpoint_id=folder)
    finally:
        dist.destroy_process_group()


def test_a_checkpoint_written_by_two_ranks_is_read_chunk_by_chunk(hf, good_state, tmp_path):
    from safetensors.torch import save_file

    from glmkit.launch.cluster import free_port

    save_file({k: v.contiguous() for k, v in good_state.items()}, tmp_path / "state.safetensors")
    folder = tmp_path / "td" / "iter_0000003"
    mp.start_processes(_save_from_rank, args=(2, str(tmp_path / "state.safetensors"), str(folder), free_port()),
                       nprocs=2, join=True, start_method="spawn")
    (tmp_path / "td" / TRACKER).write_text("3")
    assert sorted(p.name for p in folder.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    report = verify_conversion(hf, tmp_path / "td", progress=False)
    assert report.passed and report.checked == len(good_state), report.text()


# --- the command: exit codes, JSON, unreadable and hostile input ----------------------------------------

def test_the_command_exits_0_1_2_and_writes_json(hf, good_state, tmp_path, capsys):
    good = _write(good_state, tmp_path / "good")
    assert main(["ckpt", "verify-conversion", "--hf", str(hf), "--torch-dist", str(good)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("verdict: pass")

    bad = _broken(good_state, tmp_path, BREAKS["experts permuted"][0])
    out = tmp_path / "out" / "result.json"
    assert main(["ckpt", "verify-conversion", "--hf", str(hf), "--torch-dist", str(bad), "--json", str(out)]) == 1
    text = capsys.readouterr().out
    assert "decoder.layers.3.mlp.experts.experts.linear_fc2.weight" in text and "experts permuted" in text
    data = json.loads(out.read_text())
    assert data["verdict"] == "fail" and data["differing"][0]["experts"] == [3, 5]
    assert not list(out.parent.glob(".*tmp"))

    assert main(["ckpt", "verify-conversion", "--hf", str(hf), "--torch-dist", str(tmp_path / "nowhere")]) == 2
    assert "nowhere: not found" in capsys.readouterr().err
    assert main(["ckpt", "verify-conversion", "--hf", str(tmp_path / "nohf"), "--torch-dist", str(good)]) == 2
    assert main(["ckpt", "verify-conversion", "--hf", str(hf), "--torch-dist", str(good), "--atol", "-1"]) == 2
    assert "--atol" in capsys.readouterr().err


def _copy(good_state, tmp_path, name):
    folder = _write(good_state, tmp_path / name)
    return folder, folder / "release"


@pytest.mark.parametrize("damage, message", [
    ("tracker", "expected 'release' or an iteration number"),
    ("no-iteration", "an incomplete checkpoint"),
    ("index", "not a readable torch.distributed.checkpoint index"),
    ("missing-data", "data files the index names are missing: __0_0.distcp"),
    ("truncated-data", "cannot read"),
    ("escape", "outside the checkpoint folder"),
    ("huge-shape", "but its chunks store"),       # was allocated as declared (hostile pass 4: 10 GB, exit 3)
    ("nul-name", "a data file with a NUL character"),
    # hostile pass 10: a chunk covering half the tensor left the rest uninitialised, compared as weights
    ("half-chunk", "embedding.word_embeddings.weight [1024, 64]: its chunks hold 32768 of its 65536 elements"),
    ("chunk-outside", "lies outside [1024, 64]"),
    ("zeroed-data", "the data file is damaged or holds more than tensors"),  # and no weights_only=False advice
    # hostile pass 14: each was called missing (and a FIFO index would have blocked the read)
    ("fifo-index", "release/.metadata: is a named pipe (FIFO); a torch_dist index is a regular file"),
    ("folder-index", "release/.metadata: is a directory; a torch_dist index is a regular file"),
    ("fifo-data", "1 of the 1 data files the index names are not regular files: __0_0.distcp is a named pipe (FIFO)"),
    ("folder-data", "1 of the 1 data files the index names are not regular files: __0_0.distcp is a directory"),
])
def test_unreadable_checkpoints_are_exit_2_with_the_reason(damage, message, hf, good_state, tmp_path, capsys):
    folder, release = _copy(good_state, tmp_path, "td")
    if damage == "tracker":
        (folder / TRACKER).write_text("latest\n")
    elif damage == "no-iteration":
        (folder / TRACKER).write_text("7")
    elif damage == "index":
        (release / ".metadata").write_bytes(b"not a pickle")
    elif damage == "missing-data":
        (release / "__0_0.distcp").unlink()
    elif damage == "truncated-data":
        data = release / "__0_0.distcp"
        data.write_bytes(data.read_bytes()[:2000])
    elif damage in ("escape", "nul-name"):
        index = TorchDistCheckpoint(folder).metadata
        for info in index.storage_data.values():
            info.relative_path = "../../../etc/passwd" if damage == "escape" else "__0\0_0.distcp"
        (release / ".metadata").write_bytes(pickle.dumps(index))
    elif damage in ("half-chunk", "chunk-outside"):
        index = TorchDistCheckpoint(folder).metadata
        chunk = index.state_dict_metadata["embedding.word_embeddings.weight"].chunks[0]
        if damage == "half-chunk":
            chunk.sizes = torch.Size([chunk.sizes[0] // 2, chunk.sizes[1]])
        else:
            chunk.offsets = torch.Size([chunk.sizes[0], 0])
        (release / ".metadata").write_bytes(pickle.dumps(index))
    elif damage in ("fifo-index", "folder-index", "fifo-data", "folder-data"):
        target = release / (".metadata" if damage.endswith("index") else "__0_0.distcp")
        target.unlink()
        os.mkfifo(target) if damage.startswith("fifo") else target.mkdir()
    elif damage == "zeroed-data":
        data = release / "__0_0.distcp"
        data.write_bytes(bytes(data.stat().st_size))
    elif damage == "huge-shape":
        index = TorchDistCheckpoint(folder).metadata
        meta = index.state_dict_metadata["embedding.word_embeddings.weight"]
        meta.size = torch.Size([1 << 40, meta.size[1]])
        (release / ".metadata").write_bytes(pickle.dumps(index))
    assert main(["ckpt", "verify-conversion", "--hf", str(hf), "--torch-dist", str(folder)]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and "weights_only" not in err, err


class _RunsCode:
    def __reduce__(self):
        return (os.system, ("touch pwned-by-index",))


def test_an_index_that_would_run_code_is_refused_and_runs_nothing(hf, good_state, tmp_path, monkeypatch, capsys):
    folder, release = _copy(good_state, tmp_path, "td")
    (release / ".metadata").write_bytes(pickle.dumps(_RunsCode()))
    monkeypatch.chdir(tmp_path)
    assert main(["ckpt", "verify-conversion", "--hf", str(hf), "--torch-dist", str(folder)]) == 2
    assert "posix.system is not part of a torch.distributed.checkpoint index" in capsys.readouterr().err
    assert not (tmp_path / "pwned-by-index").exists()


def test_framework_objects_in_the_index_are_read_as_inert_placeholders(hf, good_state, tmp_path):
    """Megatron may leave its own objects in the index's planner data: read, not imported."""
    folder, release = _copy(good_state, tmp_path, "td")
    (release / ".metadata").write_bytes(_pickle_with_megatron_object(TorchDistCheckpoint(folder).metadata))
    assert verify_conversion(hf, folder, progress=False).passed


class _Megatronish:
    def __init__(self, n):
        self.n = n


def _pickle_with_megatron_object(index) -> bytes:
    """`index` with a planner-data entry whose class lives in a megatron module (rewritten by name, since
    Megatron itself is not installed here)."""
    index.planner_data = {"mcore_data": _Megatronish(3)}
    data = pickle.dumps(index, protocol=2)
    ours, theirs = b"c" + __name__.encode() + b"\n_Megatronish\n", b"cmegatron.core.fake\n_Megatronish\n"
    assert ours in data
    return data.replace(ours, theirs)


def test_an_hf_checkpoint_named_as_the_framework_exports_it_is_the_same_checkpoint(hf, good_state, tmp_path):
    """The framework's own HF export names text tensors `model.layers.N...` (no `language_model.`):
    read under the released names, checked the same, and loaded by the model alike."""
    from safetensors.torch import load_file, save_file

    flat = tmp_path / "flat"
    shutil.copytree(hf, flat)
    tensors = load_file(flat / "model.safetensors")
    save_file({k.replace("model.language_model.", "model.", 1): v for k, v in tensors.items()},
              flat / "model.safetensors")
    ckpt = open_checkpoint(flat)
    assert ckpt.text_keys() == open_checkpoint(hf).text_keys()
    name = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(ckpt.get(name), open_checkpoint(hf).get(name))
    assert verify_conversion(flat, _write(good_state, tmp_path / "td"), progress=False).passed


def test_a_dotted_name_in_the_index_is_refused_before_any_lookup(hf, good_state, tmp_path, monkeypatch, capsys):
    """Pickle protocol 4 resolves `module` + dotted `name` attribute by attribute: the DCP metadata
    module's own `os.system` must not be reachable through it."""
    folder, release = _copy(good_state, tmp_path, "td")

    def short(text):
        return b"\x8c" + bytes([len(text)]) + text

    payload = (b"\x80\x04" + short(b"torch.distributed.checkpoint.metadata") + short(b"os.system") + b"\x93"
               + short(b"touch pwned-by-dotted-name") + b"\x85R.")
    (release / ".metadata").write_bytes(payload)
    monkeypatch.chdir(tmp_path)
    assert main(["ckpt", "verify-conversion", "--hf", str(hf), "--torch-dist", str(folder)]) == 2
    assert "a dotted name is not part of" in capsys.readouterr().err
    assert not (tmp_path / "pwned-by-dotted-name").exists()


def test_integers_nan_gaps_and_duplicates_are_reported_not_passed(hf, good_state, tmp_path, capsys):
    norm = "decoder.final_layernorm.weight"

    def ints(state):
        state[norm] = state[norm].to(torch.int32)
    assert _only(verify_conversion(hf, _broken(good_state, tmp_path / "i", ints), progress=False),
                 "mistyped") == {"key": norm, "dtype": "int32"}

    def nan_in_stored(state):
        state[norm][3] = float("nan")
    row = _only(verify_conversion(hf, _broken(good_state, tmp_path / "n", nan_in_stored), progress=False), "differing")
    assert row["differing"] == 1 and row["cause"].startswith("non-finite values")
    out = tmp_path / "nan.json"
    assert main(["ckpt", "verify-conversion", "--hf", str(hf), "--torch-dist", str(tmp_path / "n" / "broken"),
                 "--json", str(out)]) == 1
    json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))

    def experts_with_a_gap(state):
        stack = state.pop("decoder.layers.3.mlp.experts.experts.linear_fc2.weight")
        for e in range(stack.shape[0]):
            if e not in (2, 3):
                state[f"decoder.layers.3.mlp.experts.linear_fc2.weight{e}"] = stack[e].clone()
    row = _only(verify_conversion(hf, _broken(good_state, tmp_path / "g", experts_with_a_gap), progress=False),
                "missing")
    assert row["key"] == "decoder.layers.3.mlp.experts.experts.linear_fc2.weight" and row["experts"] == [2, 3]

    def twice(state):
        state["module." + norm] = state[norm] * 2
    row = _only(verify_conversion(hf, _broken(good_state, tmp_path / "d", twice), progress=False), "extra")
    assert row["duplicate_of"] in (norm, "module." + norm)
    capsys.readouterr()


def test_nan_kept_by_a_faithful_conversion_is_a_finding(hf, tmp_path, capsys):
    """Hostile pass 14: a NaN in the HF checkpoint, converted faithfully, passed (exit 0): NaN matched
    NaN and nothing said the weights are unusable. Now the stored tensor is listed as not finite, its
    HF source named as holding the same, and the verdict is fail (exit 1); `ckpt slice` copies such a
    tensor with a warning naming it."""
    from glmkit.checkpoint import slice_checkpoint
    from safetensors.torch import load_file, save_file

    source = tmp_path / "hf"
    shutil.copytree(hf, source)
    tensors = load_file(str(source / "model.safetensors"))
    tensors["model.language_model.norm.weight"][5] = float("inf")
    save_file(tensors, str(source / "model.safetensors"), metadata={"format": "pt"})
    folder = _write(megatron_state(source), tmp_path / "td")
    report = verify_conversion(source, folder, progress=False)
    assert report.nonfinite == [{"key": "decoder.final_layernorm.weight", "count": 1, "numel": 64}]
    assert report.matched == report.checked and not report.differing and report.verdict == "fail"
    assert "decoder.final_layernorm.weight: 1 of 64 elements NaN or infinite; its HF tensors hold the same" in report.text()
    assert main(["ckpt", "verify-conversion", "--hf", str(source), "--torch-dist", str(folder)]) == 1
    capsys.readouterr()
    with pytest.warns(UserWarning, match=r"tensor model.language_model.norm.weight holds 1 NaN or infinite value\(s\) "
                                         r"of 64; copied as is"):
        slice_checkpoint(source, 2, tmp_path / "sliced", progress=False)


def test_an_fp8_tensor_is_compared_and_counted_not_crashed_on(hf, good_state, tmp_path):
    """The review of pass 14's fix: counting NaN in a matched fp8 tensor hit fp8's missing isfinite
    (exit 3 again). A tensor stored as float8 (its values exactly representable) goes through the whole
    check: compared, counted, reported."""
    key = "decoder.layers.0.mlp.linear_fc2.weight"

    def fp8(state):  # bf16 then fp8 rounds 238 of the 8192 elements one fp8 step (1/64) off the HF
        state[key] = state[key].to(torch.float8_e4m3fn)  # values rounded once: within --atol 0.02
    report = verify_conversion(hf, _broken(good_state, tmp_path / "kept", fp8), atol=0.02, progress=False)
    assert report.passed and report.matched == report.checked, report.text()

    def zeros(state):
        state[key] = torch.zeros_like(state[key]).to(torch.float8_e4m3fn)
    report = verify_conversion(hf, _broken(good_state, tmp_path / "zeros", zeros), progress=False)
    row = _only(report, "differing")
    assert row["key"] == key and row["cause"] == "all zeros (never written?)" and not report.nonfinite


def test_likely_cause_reads_fp8_tensors():
    """Hostile pass 4: a torch_dist tensor stored as float8 ended verify-conversion in exit 3 (fp8 has no
    isfinite); its causes are read in fp32."""
    from glmkit.checkpoint.conversion import likely_cause

    expected = torch.arange(8, dtype=torch.float32).reshape(2, 4)
    assert likely_cause(torch.zeros(2, 4, dtype=torch.float8_e4m3fn), expected, [], 0.0) == "all zeros (never written?)"
    nan = torch.full((2, 4), float("nan")).to(torch.float8_e4m3fn)
    assert likely_cause(nan, expected, [], 0.0) == "non-finite values (NaN or inf) where the HF tensor has none"
