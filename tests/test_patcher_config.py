"""The dumper source-patcher configs glmkit ships for glm5_next, and the check that replays the patcher."""

from __future__ import annotations

import math
import textwrap

import pytest
import torch

from glmkit.parity import patcher_config as pc
from glmkit.parity.framework_dump import DUMP_SITES, KNOWN_UNCOMPARED, LAYER_INPUT, parse_dims

SHIPPED = {side: pc.load_patcher_config(pc.config_path(side)) for side in pc.SIDES}


# --- the shipped configs ----------------------------------------------------------------------------------

@pytest.mark.parametrize("side", pc.SIDES)
def test_shipped_config_parses_and_is_packaged(side):
    path = pc.config_path(side)
    assert path.is_file() and path.parent.name == "dumper" and path.parent.parent.name == "assets"
    config = SHIPPED[side]
    assert config.patches and all(p.edits for p in config.patches)
    assert all(e.mode in pc.MODES for p in config.patches for e in p.edits)


@pytest.mark.parametrize("side", pc.SIDES)
def test_every_dumped_name_is_one_the_reader_knows(side):
    names = pc.dump_names(SHIPPED[side])
    unknown = [n for n in names if n not in DUMP_SITES and n != LAYER_INPUT and n not in KNOWN_UNCOMPARED]
    assert not unknown, unknown
    if side == "sglang-0.5.23":  # the release's residual objects hide the streams: routing and norm outputs
        assert set(names) == {"moe_topk_ids", "moe_topk_weights", "moe_router_scores", "pre_mlp_layernorm_output",
                              "final_hidden_states"}
        return
    # the residual path on both sides, whole
    assert {"layer_input", "input_layernorm_output", "attn_output", "pre_mlp_residual", "pre_mlp_layernorm_output",
            "mlp_output", "layer_output", "mhc_attn_post", "mhc_attn_comb", "mhc_ffn_post", "mhc_ffn_comb",
            "final_hidden_states"} <= set(names)


def test_sides_cover_what_each_can_dump():
    megatron, sglang = (set(pc.dump_names(SHIPPED[s])) for s in ("megatron", "sglang"))
    assert {"mhc_attn_pre", "mhc_ffn_pre", "moe_topk_ids", "moe_topk_weights", "moe_router_scores", "indexer_topk",
            "indexer_scores", "logits"} <= megatron
    # documented gaps of the engine side (DUMPS.md): no h_pre out of hc_pre, routing / indexer / logits left out
    assert not sglang & {"mhc_attn_pre", "mhc_ffn_pre", "moe_topk_ids", "indexer_topk", "indexer_scores", "logits"}
    assert sglang < megatron


@pytest.mark.parametrize("side", pc.SIDES)
def test_every_dims_parses_and_names_the_token_dim(side):
    calls = pc.dump_calls(SHIPPED[side])
    assert calls
    for call in calls:
        assert call.dims, call
        dims, replicated, dp = parse_dims(call.dims)
        names = [d.name for d in dims]
        assert names.count("t") == 1, call
        if side == "megatron":
            assert names[:2] == ["t", "1"] or names[0] == "t" and call.name in ("moe_topk_ids", "moe_topk_weights",
                                                                                  "indexer_scores"), call
            # never zigzag / cp: glmkit's reader refuses it, and the kpool indexer raises for cp > 1
            assert all(axis != "cp" for d in dims for axis, _ in d.shards)
        else:
            assert names[0] == "t" and replicated == {"tp"} and dp == "attn_dp", call
    assert pc.check_dims(SHIPPED[side]) == []


def test_megatron_sp_and_replication_declarations():
    by_name = {c.name: parse_dims(c.dims) for c in pc.dump_calls(SHIPPED["megatron"])}
    for name in ("layer_input", "attn_output", "mlp_output", "mhc_attn_comb", "moe_topk_ids", "final_hidden_states"):
        dims, replicated, _ = by_name[name]
        assert dims[0].shards == (("sp", "sharded"),) and replicated == set(), name  # SP splits t over TP
    dims, replicated, _ = by_name["indexer_topk"]
    assert dims[0].shards == () and replicated == {"tp"}  # gathered over SP before the selection
    dims, _, _ = by_name["logits"]
    assert dims[-1].name == "vocab" and dims[-1].shards == (("tp", "sharded"),)
    assert [d.name for d in by_name["mhc_attn_comb"][0]] == ["t", "1", "hc_in", "hc_out"]


# --- what the inserted code computes (run on stand-in values) --------------------------------------------------

class _Recorder:
    def __init__(self):
        self.dumps = {}

    def dump(self, name, value, dims=None, **kwargs):
        self.dumps[name] = (value, dims)


def _snippet(side, target_suffix, name):
    """The code one edit inserts, found by the dump name it contains."""
    for patch in SHIPPED[side].patches:
        if patch.target.endswith(target_suffix):
            for edit in patch.edits:
                if f'"{name}"' in edit.code:
                    return textwrap.dedent(edit.code)
    raise AssertionError(f"{name} not in {target_suffix}")


def test_megatron_indexer_scores_snippet_gives_sequence_local_pools():
    kpool, lengths = 4, [10, 3, 9]  # pools per sequence: 2, 0, 2
    cu = torch.tensor([0, 10, 13, 22])
    pools_cu = torch.tensor([0, 2, 2, 4])
    T = int(cu[-1])
    token_ids = torch.arange(T)
    seq = torch.searchsorted(cu, token_ids, right=True) - 1
    pool_base = pools_cu[seq].int()
    local = (token_ids - cu[seq]).int()
    eligible = torch.div(local + 1, kpool, rounding_mode="floor")
    total_pools = T // kpool
    raw = torch.randn(T, total_pools)
    cols = torch.arange(total_pools)
    window = (cols[None] >= pool_base[:, None]) & (cols[None] < (pool_base + eligible)[:, None])
    pool_logits = raw.masked_fill(~window, float("-inf"))  # indexer_fwd_interface(clean_logits=True)
    rec = _Recorder()
    exec(_snippet("megatron", "kpool_select_topk", "indexer_scores"),
         {"torch": torch, "dumper": rec, "pool_logits": pool_logits, "pool_base": pool_base, "eligible_pools": eligible,
          "num_tokens": T, "device": torch.device("cpu")})
    scores, dims = rec.dumps["indexer_scores"]
    assert dims == "t pools # tp:replicated"
    assert scores.shape == (T, max(L // kpool for L in lengths))
    for t in range(T):
        s, q = int(seq[t]), int(local[t])
        for j in range(scores.shape[1]):
            if j < (q + 1) // kpool:  # pool j of the row's own sequence is complete and visible
                assert scores[t, j] == raw[t, int(pools_cu[s]) + j]
            else:
                assert scores[t, j] == -math.inf


def test_megatron_router_snippets_give_sorted_ids_weights_and_biased_scores():
    tokens, experts, k = 5, 8, 3
    logits = torch.randn(tokens, 1, experts)
    bias = torch.randn(experts)
    rec = _Recorder()
    self = type("Router", (), {"expert_bias": bias, "topk": k})()
    exec(_snippet("megatron", "TopKRouter.forward", "moe_router_scores"),
         {"torch": torch, "dumper": rec, "logits": logits, "self": self})
    scores, _ = rec.dumps["moe_router_scores"]
    assert torch.allclose(scores, torch.sigmoid(logits) + bias)
    choice = torch.randn(tokens, experts).topk(k).indices
    probs = torch.zeros(tokens, experts).scatter(1, choice, torch.rand(tokens, k))
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, choice, True)
    exec(_snippet("megatron", "TopKRouter.forward", "moe_topk_ids"),
         {"torch": torch, "dumper": rec, "probs": probs, "routing_map": routing_map, "self": self})
    ids, _ = rec.dumps["moe_topk_ids"]
    weights, _ = rec.dumps["moe_topk_weights"]
    assert torch.equal(ids, choice.sort(-1).values)
    assert torch.equal(weights, probs.gather(1, ids)) and (weights > 0).all()


# --- replaying the patcher on a real module ---------------------------------------------------------------------

MODULE = '''\
import math


def helper(x):
    return x


class Block:
    def forward(self, x, y):
        h = self.norm(x)
        out = self.attn(h)
        out = out + y
        return out

    def twice(self, x):
        x = x + 1
        x = x + 1
        return x

    @staticmethod
    def decorated(x):
        return x

    def with_super(self, x):
        return super().forward(x)
'''


@pytest.fixture
def module(tmp_path, monkeypatch):
    pkg = tmp_path / "pcfixture"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "model.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _config(tmp_path, body: str, name="c.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return pc.load_patcher_config(path)


GOOD = """\
    patches:
      - target: pcfixture.model.Block.forward
        edits:
          - match: "h = self.norm(x)"
            append: |
              dumper.dump("input_layernorm_output", h, dims="t h")
          - match: |
              out = self.attn(h)
              out = out + y
            prepend: dumper.dump("attn_output", self.attn(h), dims="t h")
          - match: "return out"
            replacement: |
              dumper.dump("layer_output", out, dims="t h")
              return out
"""


@pytest.mark.parametrize("how", ["import", "root", "sources"])
def test_check_against_source_found(module, how):
    config = _config(module, GOOD)
    if how == "import":
        assert pc.check_against_source(config) == []
    elif how == "root":
        assert pc.check_against_source(config, module) == []
        assert pc.check_against_source(config, [module / "elsewhere", module]) == []
    else:
        import inspect

        import pcfixture.model as m
        assert pc.check_against_source(config, sources={"pcfixture.model.Block.forward":
                                                        inspect.getsource(m.Block.forward)}) == []
    assert pc.dump_names(config) == ["input_layernorm_output", "attn_output", "layer_output"]


def test_apply_edits_as_the_patcher_does(module):
    import inspect

    import pcfixture.model as m
    config = _config(module, GOOD)
    out = pc.apply_edits(inspect.getsource(m.Block.forward), config.patches[0].edits)
    assert out.splitlines() == [
        "    def forward(self, x, y):",
        "        h = self.norm(x)",
        '        dumper.dump("input_layernorm_output", h, dims="t h")',
        '        dumper.dump("attn_output", self.attn(h), dims="t h")',
        "        out = self.attn(h)",
        "        out = out + y",
        '        dumper.dump("layer_output", out, dims="t h")',
        "        return out",
    ]


def test_check_against_source_not_found_and_ambiguous(module):
    config = _config(module, """\
        patches:
          - target: pcfixture.model.Block.forward
            edits:
              - match: "h = self.norm(hidden)"
                append: dumper.dump("a", h, dims="t h")
              - match: |
                  out = self.attn(h)
                  return out
                append: dumper.dump("b", out, dims="t h")
          - target: pcfixture.model.Block.twice
            edits:
              - match: "x = x + 1"
                append: dumper.dump("c", x, dims="t h")
          - target: pcfixture.model.Block.missing
            edits:
              - match: "x = 1"
                append: dumper.dump("d", x, dims="t h")
    """)
    for problems in (pc.check_against_source(config), pc.check_against_source(config, module)):
        assert len(problems) == 4, problems
        assert "patch 0 (pcfixture.model.Block.forward) edit 0: match not found: 'h = self.norm(hidden)'" in problems[0]
        assert "edit 1: match not found" in problems[1] and "not followed by the rest" in problems[1]
        assert problems[2].startswith("patch 1 (pcfixture.model.Block.twice) edit 0: match found 2 times")
        assert problems[3].startswith("patch 2 (pcfixture.model.Block.missing)")


def test_check_sees_through_earlier_edits(module):
    # the second edit's match appears only once the first edit has inserted a copy of it: ambiguous then
    config = _config(module, """\
        patches:
          - target: pcfixture.model.Block.forward
            edits:
              - match: "h = self.norm(x)"
                append: "out = self.attn(h)"
              - match: "out = self.attn(h)"
                append: dumper.dump("a", out, dims="t h")
    """)
    [problem] = pc.check_against_source(config)
    assert "edit 1: match found 2 times" in problem


def test_check_refuses_code_that_cannot_be_swapped_in_or_does_not_compile(module):
    config = _config(module, """\
        patches:
          - target: pcfixture.model.Block.decorated
            edits:
              - match: "return x"
                prepend: dumper.dump("a", x, dims="t h")
          - target: pcfixture.model.Block.with_super
            edits:
              - match: "return super().forward(x)"
                prepend: dumper.dump("a", x, dims="t h")
          - target: pcfixture.model.Block.forward
            edits:
              - match: "h = self.norm(x)"
                append: "dumper.dump('a', h, dims='t h'"
          - target: pcfixture.model.Block.twice
            edits:
              - match: "return x"
                prepend: dumper.dump("a", torch.sigmoid(x) + math.pi + helper(x), dims="t h")
    """)
    for problems in (pc.check_against_source(config), pc.check_against_source(config, module)):
        assert len(problems) == 4, problems
        assert "patch 0" in problems[0] and "decorated" in problems[0]
        assert "patch 1" in problems[1] and "super()" in problems[1]
        assert "patch 2" in problems[2] and "does not compile" in problems[2]
        # math and helper are module globals; torch is not imported by the module
        assert "patch 3" in problems[3] and "reads torch," in problems[3] and "math" not in problems[3]


def test_cli(module, capsys):
    good = module / "good.yaml"
    good.write_text(textwrap.dedent(GOOD))
    assert pc.main([str(good), "--source-root", str(module)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK ") and "input_layernorm_output, attn_output, layer_output" in out
    bad = module / "bad.yaml"
    bad.write_text(textwrap.dedent(GOOD).replace("h = self.norm(x)", "h = self.norm(y)"))
    assert pc.main([str(bad)]) == 1
    out = capsys.readouterr().out
    assert "1 problem(s)" in out and "match not found: 'h = self.norm(y)'" in out
    nodims = module / "nodims.yaml"
    nodims.write_text(textwrap.dedent(GOOD).replace(', dims="t h")', ")", 1))
    assert pc.main([str(nodims), "--source-root", str(module)]) == 1
    assert "'input_layernorm_output': no dims" in capsys.readouterr().out
    assert pc.main([str(module / "absent.yaml")]) == 1
    assert "cannot read" in capsys.readouterr().out


# --- bad configs ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("body, message", [
    ("patches: [", "not valid YAML"),
    ("- 1\n", "expected a mapping with a 'patches' list"),
    ("patches: []\n", "'patches' must be a non-empty list"),
    ("patches: []\nextra: 1\n", "unknown top-level key(s) ['extra']"),
    ("patches:\n  - edits: [{match: a, append: b}]\n", "patch 0: 'target' must be a dotted name"),
    ("patches:\n  - target: nodots\n    edits: [{match: a, append: b}]\n", "patch 0: 'target' must be a dotted name"),
    ("patches:\n  - target: a.b\n    edits: []\n", "patch 0 (a.b): 'edits' must be a non-empty list"),
    ("patches:\n  - target: a.b\n    edits: [{match: a, append: b}]\n  - target: a.c\n    edits: [{append: b}]\n",
     "patch 1 (a.c) edit 0: 'match' must be a non-empty string"),
    ("patches:\n  - target: a.b\n    edits: [{match: '  ', append: b}]\n", "edit 0: 'match' must be a non-empty"),
    ("patches:\n  - target: a.b\n    edits: [{match: a}]\n", "edit 0: no append/prepend/replacement"),
    ("patches:\n  - target: a.b\n    edits: [{match: a, append: b, prepend: c}]\n", "edit 0: give one of"),
    ("patches:\n  - target: a.b\n    edits: [{match: a, apend: b}]\n", "edit 0: unknown key(s) ['apend']"),
    ("patches:\n  - target: a.b\n    edits: [{match: a, append: 3}]\n", "edit 0: 'append' must be a string"),
    ("patches:\n  - target: a.b\n    edits: [{match: a, append: ''}]\n", "edit 0: 'append' is empty"),
    ("patches:\n  - target: a.b\n    preamble: [1]\n    edits: [{match: a, append: b}]\n", "'preamble' must be a string"),
    ("patches:\n  - target: a.b\n    edit: []\n", "patch 0: unknown key(s) ['edit']"),
])
def test_bad_config_gives_a_named_error(tmp_path, body, message):
    path = tmp_path / "bad.yaml"
    path.write_text(body)
    with pytest.raises(pc.PatcherConfigError) as err:
        pc.load_patcher_config(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_dump_name_must_be_a_literal(tmp_path):
    config = _config(tmp_path, """\
        patches:
          - target: a.b
            edits:
              - match: x
                append: dumper.dump(name, x, dims="t")
    """)
    with pytest.raises(pc.PatcherConfigError, match=r"patch 0 \(a.b\) edit 0: dumper.dump's name must be a string"):
        pc.dump_names(config)


def test_config_path_rejects_an_unknown_side():
    with pytest.raises(ValueError, match="megatron, sglang"):
        pc.config_path("vllm")
