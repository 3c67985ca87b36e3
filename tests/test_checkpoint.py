"""glmkit.checkpoint: names vs save_pretrained, lazy validated reading, atomic writing, synth, slice."""

import sys

sys.modules.setdefault("fla", None)  # on a CPU machine fla would route KDA to Triton and fail

import json
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import Glm5NextForConditionalGeneration

from glmkit.checkpoint import (
    TEXT_PREFIX,
    CheckpointError,
    expected_tensors,
    layer_of,
    open_checkpoint,
    save_checkpoint,
    slice_checkpoint,
    sliced_config,
    synth_checkpoint,
    synth_tensor,
)
from glmkit.checkpoint import hf as hf_module
from glmkit.checkpoint.slice import check_shared_indexers
from glmkit.checkpoint.names import keeps_fp32
from glmkit.config import DSA, KDA, full_config, variant_config

SIX_LAYERS = dict(
    num_hidden_layers=6,
    layer_types=[KDA, DSA, DSA, KDA, KDA, DSA],
    indexer_types=["full", "full", "shared", "full", "full", "full"],
    mlp_layer_types=["dense", "dense", "sparse", "sparse", "sparse", "sparse"],
)


def six_layer_config():
    return variant_config("tiny", **SIX_LAYERS)


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A fp32 tiny synthetic checkpoint shared by read-only tests."""
    return synth_checkpoint("tiny", seed=0, out=tmp_path_factory.mktemp("synth") / "tiny", progress=False)


def rewrite_weights(ckpt_dir, edit):
    """Load model.safetensors, let `edit` change the dict in place, write it back."""
    file = ckpt_dir / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def comparable(config):
    """Config fields that describe the model (not bookkeeping such as dtype or version)."""
    ignored = {"dtype", "transformers_version", "_name_or_path", "architectures"}
    return {k: v for k, v in config.to_dict().items() if k not in ignored}


def copy_ckpt(src, dst):
    dst.mkdir()
    for name in os.listdir(src):
        (dst / name).write_bytes((src / name).read_bytes())
    return dst


# ----------------------------------------------------------------------------- names


@pytest.mark.parametrize("overrides", [
    {},
    SIX_LAYERS,
    dict(attention_bias=True, tie_word_embeddings=True, n_shared_experts=2),
], ids=["tiny", "six-layers-shared-indexer", "bias-tied"])
def test_expected_tensors_match_save_pretrained(tmp_path, overrides):
    config = variant_config("tiny", **overrides)
    Glm5NextForConditionalGeneration(full_config(config)).save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        written = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys() if not k.startswith("model.visual.")}
    assert written == expected_tensors(config)


def test_shared_indexer_layer_has_no_indexer_tensors():
    names = expected_tensors(six_layer_config())
    assert any(n.startswith(TEXT_PREFIX + "layers.1.self_attn.indexer.") for n in names)
    assert not any(n.startswith(TEXT_PREFIX + "layers.2.self_attn.indexer.") for n in names)
    assert TEXT_PREFIX + "layers.2.self_attn.kv_b_proj.weight" in names


def test_layer_of():
    assert layer_of("model.language_model.layers.3.self_attn.kv_b_proj.weight") == 3
    assert layer_of("model.language_model.layers.45.shared_head.norm.weight") == 45
    assert layer_of("model.language_model.embed_tokens.weight") is None
    assert layer_of("lm_head.weight") is None
    assert layer_of("model.visual.blocks.0.attn.qkv.weight") is None


# ----------------------------------------------------------------------------- save / open


def test_round_trip_exact(tmp_path):
    config = variant_config("tiny")
    tensors = {name: torch.randn(shape, generator=torch.Generator().manual_seed(i))
               for i, (name, shape) in enumerate(expected_tensors(config).items())}
    path = save_checkpoint(tmp_path / "ck", config, iter(tensors.items()))
    assert sorted(os.listdir(path)) == [".glmkit-output", "config.json", "generation_config.json", "model.safetensors"]
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}

    ck = open_checkpoint(path)
    assert comparable(ck.config) == comparable(config)
    assert ck.text_keys() == sorted(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(ck.get(name), tensor), name
    assert ck.dtype == torch.float32
    assert ck.nbytes == sum(t.numel() * 4 for t in tensors.values())

    layer = ck.layer(3)
    assert torch.equal(layer["mlp.gate.weight"], tensors[TEXT_PREFIX + "layers.3.mlp.gate.weight"])
    assert set(ck.shared()) == {TEXT_PREFIX + "embed_tokens.weight", TEXT_PREFIX + "norm.weight", "lm_head.weight"}
    state = ck.state_dict()
    assert "lm_head.weight" in state and "embed_tokens.weight" in state and "layers.0.hc_attn_fn" in state
    assert len(state) == len(tensors)
    assert ck.get(TEXT_PREFIX + "norm.weight", dtype=torch.bfloat16).dtype == torch.bfloat16


def test_sharded_save_equals_single_file(tmp_path, tiny_ckpt):
    sharded = synth_checkpoint("tiny", seed=0, out=tmp_path / "sharded", progress=False, max_shard_bytes=40_000)
    files = sorted(os.listdir(sharded))
    shards = [f for f in files if f.startswith("model-")]
    assert len(shards) > 2 and "model.safetensors" not in files
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(shards)

    single, multi = open_checkpoint(tiny_ckpt), open_checkpoint(sharded)
    assert index["metadata"]["total_size"] == single.nbytes
    assert single.text_keys() == multi.text_keys()
    for name in single.text_keys():
        assert torch.equal(single.get(name), multi.get(name)), name


def test_refuses_to_overwrite_unless_asked(tmp_path):
    config = variant_config("tiny")
    target = tmp_path / "ck"
    synth_checkpoint(config, seed=1, out=target, progress=False)
    with pytest.raises(CheckpointError, match="overwrite"):
        synth_checkpoint(config, seed=2, out=target, progress=False)
    synth_checkpoint(config, seed=2, out=target, progress=False, overwrite=True)
    reread = open_checkpoint(target).get(TEXT_PREFIX + "norm.weight")
    assert torch.equal(reread, synth_tensor(TEXT_PREFIX + "norm.weight", (64,), seed=2))
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temporary or old directories left


@pytest.mark.parametrize("fault", ["shape", "unexpected", "missing", "raises"])
def test_failed_save_leaves_nothing(tmp_path, fault):
    config = variant_config("tiny")
    shapes = expected_tensors(config)
    victim = TEXT_PREFIX + "layers.1.self_attn.o_proj.weight"

    def stream():
        for name, shape in shapes.items():
            if name == victim:
                if fault == "shape":
                    yield name, torch.zeros(shape[0] + 1, shape[1])
                    continue
                if fault == "unexpected":
                    yield TEXT_PREFIX + "layers.1.self_attn.bogus.weight", torch.zeros(2)
                if fault == "missing":
                    continue
                if fault == "raises":
                    raise RuntimeError("producer failed")
            yield name, torch.zeros(shape)

    target = tmp_path / "ck"
    with pytest.raises((CheckpointError, RuntimeError)) as info:
        save_checkpoint(target, config, stream(), max_shard_bytes=30_000)
    assert not target.exists()
    assert os.listdir(tmp_path) == []
    if fault == "shape":
        assert victim in str(info.value) and "[65, 64]" in str(info.value) and "[64, 64]" in str(info.value)
    if fault == "missing":
        assert victim in str(info.value)


# ----------------------------------------------------------------------------- validation errors


def assert_error(path, *needles):
    with pytest.raises(CheckpointError) as info:
        open_checkpoint(path)
    message = str(info.value)
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


def test_error_missing_tensor(tmp_path, tiny_ckpt):
    ck = copy_ckpt(tiny_ckpt, tmp_path / "ck")
    key = TEXT_PREFIX + "layers.2.mlp.down_proj.weight"
    rewrite_weights(ck, lambda t: t.pop(key))
    assert_error(ck, "model.safetensors", key, "missing")


def test_error_unexpected_tensor(tmp_path, tiny_ckpt):
    ck = copy_ckpt(tiny_ckpt, tmp_path / "ck")
    key = TEXT_PREFIX + "layers.0.self_attn.extra.weight"
    rewrite_weights(ck, lambda t: t.update({key: torch.zeros(3)}))
    assert_error(ck, "model.safetensors", key, "unexpected")


def test_error_wrong_shape(tmp_path, tiny_ckpt):
    ck = copy_ckpt(tiny_ckpt, tmp_path / "ck")
    key = TEXT_PREFIX + "layers.3.self_attn.kv_b_proj.weight"
    rewrite_weights(ck, lambda t: t.update({key: torch.zeros(128, 31)}))
    assert_error(ck, "model.safetensors", key, "[128, 31]", "[128, 32]")


def test_error_wrong_model_type(tmp_path, tiny_ckpt):
    ck = copy_ckpt(tiny_ckpt, tmp_path / "ck")
    config = json.loads((ck / "config.json").read_text())
    config["model_type"] = "llama"
    (ck / "config.json").write_text(json.dumps(config))
    assert_error(ck, "config.json", "llama")


def test_error_unreadable_json(tmp_path, tiny_ckpt):
    ck = copy_ckpt(tiny_ckpt, tmp_path / "ck")
    (ck / "config.json").write_text('{"model_type": "glm5_next",')
    assert_error(ck, "config.json", "JSON")


@pytest.mark.parametrize("keep", ["body", "header"])
def test_error_truncated_safetensors(tmp_path, tiny_ckpt, keep):
    ck = copy_ckpt(tiny_ckpt, tmp_path / "ck")
    data = (ck / "model.safetensors").read_bytes()
    cut = len(data) - 100 if keep == "body" else 200
    (ck / "model.safetensors").write_bytes(data[:cut])
    assert_error(ck, "model.safetensors", "truncated")


def test_error_index_names_missing_shard(tmp_path):
    ck = synth_checkpoint("tiny", seed=0, out=tmp_path / "ck", progress=False, max_shard_bytes=40_000)
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[1]
    key = next(k for k, v in index["weight_map"].items() if v == shard)
    (ck / shard).unlink()
    assert_error(ck, "model.safetensors.index.json", shard, key)


def test_error_sharded_missing_tensor_names_index(tmp_path):
    ck = synth_checkpoint("tiny", seed=0, out=tmp_path / "ck", progress=False, max_shard_bytes=40_000)
    index_file = ck / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    key = TEXT_PREFIX + "layers.0.self_attn.A_log"
    shard = ck / index["weight_map"].pop(key)
    index_file.write_text(json.dumps(index))
    tensors = load_file(str(shard))
    del tensors[key]
    save_file(tensors, str(shard), metadata={"format": "pt"})
    assert_error(ck, "model.safetensors.index.json", key, "missing")


# ----------------------------------------------------------------------------- skipped tensors, flat config


def test_mtp_and_vision_tensors_are_skipped(tmp_path, tiny_ckpt):
    ck = copy_ckpt(tiny_ckpt, tmp_path / "ck")
    extra = {
        TEXT_PREFIX + "layers.4.eh_proj.weight": torch.zeros(64, 128),
        TEXT_PREFIX + "layers.4.self_attn.q_proj.weight": torch.zeros(64, 64),
        TEXT_PREFIX + "layers.4.shared_head.norm.weight": torch.zeros(64),
        "model.visual.patch_embed.proj.weight": torch.zeros(16, 3),
        "model.visual.blocks.0.norm1.weight": torch.zeros(16),
    }
    rewrite_weights(ck, lambda t: t.update(extra))
    opened = open_checkpoint(ck)
    assert opened.skipped_summary() == "skipped 2 vision tensors, 3 MTP tensors (layer 4, shared_head)"
    assert not set(extra) & set(opened.text_keys())
    assert opened.text_keys() == open_checkpoint(tiny_ckpt).text_keys()
    assert open_checkpoint(tiny_ckpt).skipped_summary() == "skipped nothing"


def test_flat_text_only_config(tmp_path, tiny_ckpt):
    ck = copy_ckpt(tiny_ckpt, tmp_path / "ck")
    nested = json.loads((ck / "config.json").read_text())
    flat = {**nested["text_config"], "model_type": "glm5_next", "architectures": nested["architectures"]}
    (ck / "config.json").write_text(json.dumps(flat))
    assert comparable(open_checkpoint(ck).config) == comparable(open_checkpoint(tiny_ckpt).config)


# ----------------------------------------------------------------------------- lazy reading


def test_reading_one_layer_reads_only_that_layer(tiny_ckpt, monkeypatch):
    requested = []
    real_safe_open = hf_module.safe_open

    class Recording:
        def __init__(self, *args, **kwargs):
            self._inner = real_safe_open(*args, **kwargs)

        def get_tensor(self, name):
            requested.append(name)
            return self._inner.get_tensor(name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(hf_module, "safe_open", Recording)
    ck = open_checkpoint(tiny_ckpt)
    assert requested == []  # opening reads headers only
    layer = ck.layer(1)
    prefix = TEXT_PREFIX + "layers.1."
    assert sorted(requested) == sorted(prefix + k for k in layer)
    assert all(name.startswith(prefix) for name in requested)


# ----------------------------------------------------------------------------- synth


def test_synth_is_reproducible_and_seed_dependent(tmp_path):
    a = synth_checkpoint("tiny", seed=7, out=tmp_path / "a", progress=False)
    b = synth_checkpoint("tiny", seed=7, out=tmp_path / "b", progress=False)
    c = synth_checkpoint("tiny", seed=8, out=tmp_path / "c", progress=False)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_synth_tensors_are_all_informative(tiny_ckpt):
    ck = open_checkpoint(tiny_ckpt)
    for name in ck.text_keys():
        tensor = ck.get(name)
        assert tensor.std() > 0.01, name  # nothing constant: every tensor can be told apart
        assert torch.equal(tensor, synth_tensor(name, tuple(tensor.shape), seed=0)), name  # order independent


def test_synth_bf16_keeps_transformers_fp32_tensors(tmp_path):
    ck = open_checkpoint(synth_checkpoint("tiny", seed=0, out=tmp_path / "bf16", dtype=torch.bfloat16, progress=False))
    assert ck.dtype == torch.bfloat16
    fp32 = {n for n in ck.text_keys() if ck.info(n).dtype == torch.float32}
    assert fp32 == {n for n in ck.text_keys() if keeps_fp32(n)}
    assert TEXT_PREFIX + "layers.3.mlp.gate.weight" in fp32
    assert TEXT_PREFIX + "layers.0.self_attn.q_conv1d.weight" in fp32
    assert TEXT_PREFIX + "layers.0.hc_attn_fn" not in fp32
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def assert_transformers_matches(path):
    """transformers loads `path` and its renamed/fused tensors equal the file's."""
    ck = open_checkpoint(path)
    model = Glm5NextForConditionalGeneration.from_pretrained(path)
    state = model.state_dict()
    text = "model.language_model."
    assert torch.equal(state["lm_head.weight"], ck.get("lm_head.weight"))
    assert torch.equal(state[text + "embed_tokens.weight"], ck.get(text + "embed_tokens.weight"))
    for i, kind in enumerate(ck.config.layer_types):
        disk = ck.layer(i)
        mem = text + f"layers.{i}."
        assert torch.equal(state[mem + "attn_hc.fn"], disk["hc_attn_fn"])
        assert torch.equal(state[mem + "ffn_hc.scale"], disk["hc_ffn_scale"])
        if kind == KDA:
            conv = torch.cat([disk[f"self_attn.{p}_conv1d.weight"] for p in "qkv"])
            assert torch.equal(state[mem + "self_attn.conv1d.weight"], conv)
            assert torch.equal(state[mem + "self_attn.forget_gate.f_a_proj.weight"], disk["self_attn.f_a_proj.weight"])
            assert torch.equal(state[mem + "self_attn.forget_gate.A_log"], disk["self_attn.A_log"])
        else:
            assert torch.equal(state[mem + "self_attn.kv_b_proj.weight"], disk["self_attn.kv_b_proj.weight"])
        if ck.config.mlp_layer_types[i] == "sparse":
            gate_up = torch.cat([disk["mlp.experts.1.gate_proj.weight"], disk["mlp.experts.1.up_proj.weight"]])
            assert torch.equal(state[mem + "mlp.experts.gate_up_proj"][1], gate_up)
            assert torch.equal(state[mem + "mlp.experts.down_proj"][5], disk["mlp.experts.5.down_proj.weight"])
    logits = model(input_ids=torch.arange(3, 23)[None]).logits
    assert torch.isfinite(logits).all()


def test_transformers_loads_synth(tiny_ckpt):
    assert_transformers_matches(tiny_ckpt)


# ----------------------------------------------------------------------------- slice


@pytest.fixture(scope="module")
def six_layer_ckpt(tmp_path_factory):
    return synth_checkpoint(six_layer_config(), seed=3, out=tmp_path_factory.mktemp("six") / "six", progress=False)


def test_slice_keeps_first_layers_bit_for_bit(tmp_path, six_layer_ckpt, capsys):
    out = slice_checkpoint(six_layer_ckpt, 4, tmp_path / "four")
    assert "kept layers 0-3 of 6" in capsys.readouterr().err
    src, dst = open_checkpoint(six_layer_ckpt), open_checkpoint(out)
    assert dst.config.num_hidden_layers == 4
    assert dst.config.layer_types == SIX_LAYERS["layer_types"][:4]
    assert dst.config.indexer_types == SIX_LAYERS["indexer_types"][:4]
    assert dst.config.mlp_layer_types == SIX_LAYERS["mlp_layer_types"][:4]
    expected_names = [n for n in src.text_keys() if layer_of(n) is None or layer_of(n) < 4]
    assert dst.text_keys() == expected_names
    for name in expected_names:
        assert torch.equal(src.get(name), dst.get(name)), name
    assert_transformers_matches(out)


def test_slice_drops_mtp_and_vision(tmp_path, six_layer_ckpt, capsys):
    src = copy_ckpt(six_layer_ckpt, tmp_path / "src")
    rewrite_weights(src, lambda t: t.update({
        TEXT_PREFIX + "layers.6.eh_proj.weight": torch.zeros(4),
        "model.visual.patch_embed.proj.weight": torch.zeros(4),
    }))
    out = slice_checkpoint(src, 2, tmp_path / "two")
    err = capsys.readouterr().err
    assert "skipped 1 vision tensor, 1 MTP tensor (layer 6)" in err
    assert open_checkpoint(out).skipped_summary() == "skipped nothing"


def test_slice_rejects_bad_layer_counts(tmp_path, six_layer_ckpt):
    for layers in (0, 7):
        with pytest.raises(CheckpointError, match=f"cannot keep {layers} layers"):
            slice_checkpoint(six_layer_ckpt, layers, tmp_path / f"bad{layers}", progress=False)
        assert not (tmp_path / f"bad{layers}").exists()


def test_shared_indexer_must_follow_full_dsa_layer():
    check_shared_indexers(sliced_config(six_layer_config(), 3))  # layer 2 shares layer 1's top-k
    orphan = variant_config("tiny", **{**SIX_LAYERS, "indexer_types": ["full", "full", "full", "full", "full", "shared"]})
    with pytest.raises(CheckpointError, match="layer 5"):
        check_shared_indexers(orphan)
    with pytest.raises(CheckpointError, match="layer 5"):
        sliced_config(orphan, 6)


def test_opens_transformers_sharded_save_with_vision(tmp_path):
    config = variant_config("tiny", tie_word_embeddings=False)
    model = Glm5NextForConditionalGeneration(full_config(config))
    model.save_pretrained(tmp_path, max_shard_size="300KB")
    ck = open_checkpoint(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert ck.skipped_summary().startswith("skipped ") and "vision tensors" in ck.skipped_summary()
    assert ck.text_keys() == sorted(expected_tensors(config))
    state = model.state_dict()
    assert torch.equal(ck.get(TEXT_PREFIX + "layers.3.self_attn.kv_b_proj.weight"),
                       state[TEXT_PREFIX + "layers.3.self_attn.kv_b_proj.weight"])
    assert torch.equal(ck.get(TEXT_PREFIX + "layers.0.hc_ffn_fn"), state[TEXT_PREFIX + "layers.0.ffn_hc.fn"])


def test_tied_embeddings_load_compute_the_reference_and_save_once(tmp_path):
    """tie_word_embeddings: the checkpoint (written by transformers) holds no lm_head.weight; glmkit
    loads lm_head as the embedding itself (one parameter), computes the reference's logits (fp32,
    1e-4 relative, the bound of test_model_parity) and writes the embedding once, reloading equal."""
    from glmkit.model import TrainPath, load_model, save_model
    from glmkit.reference import load_reference, reference_logits
    from tests.conftest import reference_checkpoint

    path = reference_checkpoint(variant_config("tiny", tie_word_embeddings=True), seed=3, path=tmp_path / "tied")
    model = load_model(path)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert "lm_head.weight" not in dict(model.named_parameters())
    seqs = [[5, 9, 13, 2, 7, 11, 40, 3]]
    expected = reference_logits(load_reference(path), seqs)[0]
    ours = TrainPath(model, "kda=torch").forward(seqs, return_logits=True).logits
    assert ((expected - ours).norm() / expected.norm()).item() < 1e-4
    saved = save_model(model, tmp_path / "saved")
    with safe_open(str(Path(saved) / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    again = load_model(saved)
    assert again.lm_head.weight is again.embed_tokens.weight
    assert torch.equal(again.embed_tokens.weight, model.embed_tokens.weight)


@pytest.mark.parametrize("field, value, reason", [
    ("num_experts_per_tok", 100, "num_experts_per_tok 100 is larger than n_routed_experts 8"),
    # hostile pass 10: the reference's router divides the experts into n_group groups (exit 3 before)
    ("n_group", 3, "n_group 3 must divide n_routed_experts 8 (equal groups)"),
    ("n_group", 0, "n_group must be a positive integer, got 0"),
    ({"n_group": 2, "topk_group": 5}, None, "topk_group 5 must be in 1..n_group (2)"),
    ({"n_group": 4, "topk_group": 1}, None, None),  # 2 experts a group, 1 group kept: top-2 fits
    ({"n_group": 8, "topk_group": 1}, None, "num_experts_per_tok 2 is more than the 1 experts of the topk_group 1"),
    # hostile pass 11: an indexer_types list longer than the layers was taken as it was
    ("indexer_types", ["full"] * 204, "indexer_types lists 204 layers and num_hidden_layers is 4"),
    ("index_topk", 0, "index_topk must be a positive integer, got 0"),
    ("vocab_size", -5, "vocab_size must be a positive integer, got -5"),
    ("vocab_size", 0, "vocab_size must be a positive integer, got 0"),  # pass 13: 3 transformers warnings first
])
def test_a_config_no_model_can_run_is_refused_by_name(tmp_path, field, value, reason, capfd):
    """transformers' config accepts these; the checkpoint reader names the field (exit 2 in the CLI),
    where the model would fail later with an indexing error."""
    import json

    from glmkit.checkpoint.hf import text_config_from_json

    raw = json.loads((Path(__file__).resolve().parents[1] / "glmkit" / "assets" / "tiny_start" / "config.json").read_text())
    text = raw["text_config"] if "text_config" in raw else raw
    text.update(field if isinstance(field, dict) else {field: value})
    if reason is None:
        text_config_from_json(raw, tmp_path / "config.json")  # a valid grouping
        return
    with pytest.raises(ValueError, match=re.escape(reason)):
        text_config_from_json(raw, tmp_path / "config.json")
    assert "[transformers]" not in capfd.readouterr().err  # the one line glmkit says is all the user sees


@pytest.mark.parametrize("changes, needle", [
    ({"n_routed_experts": 10 ** 7}, "the config describes 30000108 text tensors (num_hidden_layers 4, n_routed_experts "
                                    "10000000) and the checkpoint stores 132"),
    ({"n_routed_experts": 10 ** 9}, "n_routed_experts 1000000000) and the checkpoint stores 132"),
    # (since pass 15 a layer count past 10000 is refused before the count: transformers' per-layer lists)
    ("layers", "num_hidden_layers must be an integer in 1..10000, got 200000"),
])
def test_counts_far_beyond_the_stored_tensors_are_refused_before_any_name_is_made(tmp_path, changes, needle):
    """Hostile pass 10: n_routed_experts 10**7 took 7.5 GB listing the missing experts, 10**9 crashed
    the interpreter (rc 139), 200000 layers listed 5.2M problems. The tensor count is worked out first."""
    import json
    import resource
    import shutil

    from glmkit.checkpoint import CheckpointError, open_checkpoint

    folder = tmp_path / "ck"
    shutil.copytree(Path(__file__).resolve().parents[1] / "glmkit" / "assets" / "tiny_start", folder)
    config = json.loads((folder / "config.json").read_text())
    text = config["text_config"] if "text_config" in config else config
    if changes == "layers":
        n = 200_000
        text["num_hidden_layers"] = n
        for key in ("layer_types", "mlp_layer_types", "indexer_types"):
            if isinstance(text.get(key), list):
                text[key] = (text[key] * (n // len(text[key]) + 1))[:n]
    else:
        text.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        open_checkpoint(folder)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1_000_000  # KiB: well under 1 GiB


@pytest.mark.parametrize("where, key, value, needle", [
    ("text", "hc_eps", float("nan"), "hc_eps must be a finite number within float32's range, got nan"),
    ("text", "linear_lower_bound", "-5", "linear_lower_bound must be a finite number within float32's range, got '-5'"),
    ("text", "routed_scaling_factor", 1e308, "routed_scaling_factor must be a positive finite number within float32's range"),
    ("text", "tie_word_embeddings", "yes", "tie_word_embeddings must be true or false, got 'yes'"),
    ("top", "tie_word_embeddings", 1, "tie_word_embeddings must be true or false, got 1"),
    ("text", "hidden_act", "gelu", "hidden_act 'gelu'; glmkit's experts compute silu (SwiGLU)"),
])
def test_config_values_no_forward_can_use_are_refused_at_load(tmp_path, where, key, value, needle):
    """Hostile pass 9: configs that `ckpt info` accepted and `check` then crashed on (exit 3) or served
    as NaN: a NaN epsilon, a scaling factor past float32, a text where a bool goes, an activation
    glmkit's experts do not compute. Each is refused when the checkpoint is opened, naming the field."""
    import json
    import shutil

    from glmkit.checkpoint import CheckpointError, open_checkpoint

    folder = tmp_path / "ck"
    shutil.copytree(Path(__file__).resolve().parents[1] / "glmkit" / "assets" / "tiny_start", folder)
    config = json.loads((folder / "config.json").read_text())
    (config["text_config"] if where == "text" else config)[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=re.escape(needle)):
        open_checkpoint(folder)


def test_a_checkpoint_transformers_cannot_read_is_bad_input_naming_it(tmp_path, capsys):
    """Hostile pass 12: an index without "metadata" passes glmkit's reader (the field is optional to it)
    but transformers' loader raised KeyError: 'metadata', and `glmkit check` ended in exit 3."""
    import json
    import shutil

    from glmkit.cli import main
    from glmkit.checkpoint import open_checkpoint

    folder = tmp_path / "ck"
    shutil.copytree(Path(__file__).resolve().parents[1] / "glmkit" / "assets" / "tiny_start", folder)
    (folder / "model.safetensors").rename(folder / "shard.safetensors")
    names = open_checkpoint(Path(__file__).resolve().parents[1] / "glmkit" / "assets" / "tiny_start").text_keys()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: "shard.safetensors"
                                                                                    for n in names}}))
    assert len(open_checkpoint(folder).text_keys()) == len(names)  # glmkit reads it
    assert main(["check", "--checkpoint", str(folder), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].endswith("ck: the transformers reference cannot load this checkpoint (KeyError: 'metadata')"), err
