"""Dump directories written by SGLang's dumper (the engine, and the recipe framework's Megatron trainer
through the same dumper) read as a glmkit capture: one row per token, sites by glmkit's names.

What the dumper writes (sglang `srt/debug_utils/dumper.py`; the framework drives it with
`--dumper-enable`): `<dir>/<exp_name>/<tags>.pt`, the file name `key=value` pairs joined by `___`
(`step`, `rank`, `dump_index`, `name`, `recompute_status`, the dump's own tags such as `layer_id`), the
file `torch.save({"value": tensor, "meta": {...}})` with `meta["dims"]` naming each dim of the value and
its sharding (`t h[tp]`, `t h[tp:partial]`, `t 1 h # tp:replicated`, older `h(tp)`), and the parallel
ranks in `meta["sglang_parallel_info"]` or `meta["megatron_parallel_info"]` (`tp_rank`, `tp_size`, ...).
The framework puts the engine's dumps in `<dir>/engines/engine_<i>/` and the trainer's in
`<dir>/{fwd_only,fwd_bwd}/rollout_<id>/`.

Rows are placed by the batch fields the dumper records at each step (one step = one forward): the
engine's `input_ids`, `positions`, `seq_lens` and `rids` (or `req_pool_indices`), the trainer's
`input_ids` and `cu_seqlens_q`. Every token row becomes (request, position), so any number of
sequences, prefill and decode steps line up with a path that ran the sequences whole.

Files are read with `torch.load(weights_only=True)`: a dump holding anything else is refused by name.
Not handled (refused by name): context parallelism (`cp` size > 1, zigzag), a token dim split across
data-parallel ranks other than the dumper's one-non-empty-rank rule.
"""

from __future__ import annotations

import pickle
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from glmkit.parity.dump import Capture, input_hash

# The dump names glmkit reads, each a glmkit site (glmkit.model.sites). Names the framework's patcher
# configs already use for a site keep that name (layer_input, attn_output, pre_mlp_residual,
# pre_mlp_layernorm_output, mlp_output, layer_output, moe_topk_ids, final_hidden_states, logits); the
# rest are glmkit's. glmkit's own site names are accepted as they are. Value layouts per token row:
#   streams (layer_input, pre_mlp_residual, layer_output): the n mHC streams, [n*C] or [n, C] stream-major
#   mhc_*_pre / mhc_*_post [n]; mhc_*_comb [n, n] with new stream j = sum_i comb[i, j] * stream i
#   moe_topk_ids [k] expert ids; moe_topk_weights [k] in the order of moe_topk_ids;
#   moe_router_scores [experts] sigmoid(logits) + e_score_correction_bias (what top-k ranks)
#   indexer_topk [W] selected key tokens, -1 empty: absolute packed indices on the trainer (what
#   Glm5NextDSAAttention._kpool_select returns), sequence-local positions on the engine
#   indexer_scores [pools] the score of every pool, -inf where a pool is not a candidate
# `layer_input` of layer L is the streams leaving layer L-1 (layer 0's is the expanded embedding: skipped).
DUMP_SITES = {
    "input_layernorm_output": "attn_in",
    "attn_output": "attn_out",
    "pre_mlp_residual": "streams_after_attn",
    "pre_mlp_layernorm_output": "mlp_in",
    "mlp_output": "mlp_out",
    "layer_output": "streams_after_ffn",
    "moe_topk_ids": "router_experts",
    "moe_topk_weights": "router_weights",
    "moe_router_scores": "router_scores",
    "mhc_attn_pre": "attn_hc.pre", "mhc_attn_post": "attn_hc.post", "mhc_attn_comb": "attn_hc.comb",
    "mhc_ffn_pre": "ffn_hc.pre", "mhc_ffn_post": "ffn_hc.post", "mhc_ffn_comb": "ffn_hc.comb",
    "indexer_scores": "indexer_scores", "indexer_topk": "indexer_topk",
    "final_hidden_states": "final_hidden", "logits": "logits",
}
LAYER_INPUT = "layer_input"  # -> (layer - 1, streams_after_ffn)
# Names the framework's configs dump that glmkit reads but has no site for (listed, not compared).
KNOWN_UNCOMPARED = ("moe_router_logits", "attn_q", "attn_k", "attn_v", "attn_pre_o_proj", "kda_q", "kda_k",
                    "kda_v", "kda_forget_gate", "kda_beta", "kda_core_output", "kda_gated_norm_output",
                    "attention_input", "attention_output", "mlp_input")
ENGINE_FIELDS = ("input_ids", "positions", "seq_lens", "rids", "req_pool_indices")
TRAINER_FIELDS = ("input_ids", "position_ids", "cu_seqlens_q", "cu_seqlens_kv", "qkv_format")
_INT_TAGS = ("step", "rank", "dump_index", "layer_id")


def is_framework_dump(path) -> bool:
    """A folder of dumper files (`*.pt` whose names carry `name=`), directly or in exactly one leaf."""
    try:
        return bool(_leaf(Path(path), quiet=True))
    except ValueError:
        return False


def _leaf(path: Path, quiet: bool = False) -> Path | None:
    if any(f.name.startswith("step=") for f in path.glob("*.pt")):
        return path
    leaves = sorted({f.parent for f in path.rglob("step=*.pt")})
    if len(leaves) == 1:
        return leaves[0]
    if quiet and not leaves:
        return None
    raise ValueError(f"{path}: " + ("no dumper files (step=...___name=....pt) in it" if not leaves else
                                    f"{len(leaves)} dump folders in it ({', '.join(str(p.relative_to(path)) for p in leaves[:4])}"
                                    f"{', ...' if len(leaves) > 4 else ''}); give one of them"))


def parse_name(stem: str) -> dict:
    """`step=0___rank=3___name=attn_output___layer_id=2` -> tags (step, rank, dump_index, layer_id as ints)."""
    tags = {}
    for part in stem.split("___"):
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"{stem}: {part!r} is not key=value")
        tags[key] = int(value) if key in _INT_TAGS and re.fullmatch(r"-?\d+", value) else value
    for key in ("step", "rank", "name"):
        if key not in tags:
            raise ValueError(f"{stem}: no {key}= in the file name")
    return tags


# --- dims -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Dim:
    name: str
    shards: tuple  # ((axis, qualifier), ...) in the order written; the rightmost is undone first


def parse_dims(text: str) -> tuple[list[Dim], set, str | None]:
    """`t h[tp:partial] # ep:replicated dp:=attn_dp` -> (dims, replicated axes, dp alias)."""
    body, _, comment = text.partition("#")
    dims = []
    for token in re.findall(r"\([^)]*\*[^)]*\)(?:[\[(][^\])]*[\])])?|[^\s]+", body):
        match = re.fullmatch(r"(?P<name>\([^)]*\)|[^\[(]+)(?:[\[(](?P<mods>[^\])]*)[\])])?", token)
        if not match:
            raise ValueError(f"dims {text!r}: cannot read {token!r}")
        shards = []
        for mod in filter(None, (m.strip() for m in (match["mods"] or "").split(","))):
            axis, _, quals = mod.partition(":")
            shards.append((axis.strip(), quals.strip() or "sharded"))
        dims.append(Dim(match["name"], tuple(shards)))
    replicated, dp_alias = set(), None
    for word in comment.split():
        if word.startswith("dp:="):
            dp_alias = word[4:]
        elif word.endswith(":replicated"):
            replicated.add(word[:-len(":replicated")])
    return dims, replicated, dp_alias


def _parallel(meta: dict) -> dict:
    """{axis: (rank, size)} from the dumper's parallel info (an info dict carrying an *_error key is not one)."""
    out = {}
    for key in ("sglang_parallel_info", "megatron_parallel_info"):
        info = meta.get(key)
        if not isinstance(info, dict) or any(str(k).endswith("_error") for k in info):
            continue
        for k, v in info.items():
            if str(k).endswith("_rank") and isinstance(v, int) and isinstance(info.get(k[:-5] + "_size"), int):
                out.setdefault(k[:-5], (v, info[k[:-5] + "_size"]))
    return out


# --- reading ----------------------------------------------------------------------------------------------

@dataclass
class _Record:
    tags: dict
    meta: dict
    value: object
    file: Path


def _load(file: Path) -> _Record:
    try:
        data = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        raise ValueError(f"{file}: needs pickle to read ({found.group(1) if found else 'not weights-only'}); "
                         f"glmkit reads dumps with torch.load(weights_only=True) only") from None
    except (RuntimeError, EOFError, OSError) as err:
        raise ValueError(f"{file}: not a readable dump file ({type(err).__name__})") from None
    if not (isinstance(data, dict) and "value" in data):
        raise ValueError(f"{file}: not a dumper file (expected {{'value': ..., 'meta': {{...}}}})")
    tags = parse_name(file.stem)
    meta = {**(data.get("meta") or {}), **tags}
    return _Record(tags, meta, data["value"], file)


def _unshard(records: list, where: str) -> torch.Tensor:
    """One logical tensor from its ranks' pieces, as its dims say (rightmost shard axis first)."""
    dims_text = records[0].meta.get("dims")
    if len(records) == 1 and not dims_text:
        return records[0].value
    if not dims_text:
        raise ValueError(f"{where}: {len(records)} ranks dumped it and it has no dims to say how they combine")
    dims, replicated, dp_alias = parse_dims(dims_text)
    pieces = [(_parallel(r.meta), r.value) for r in records]
    dp = dp_alias or "dp"
    if any(p.get(dp, (0, 1))[1] > 1 for p, _ in pieces):  # the dumper's rule: one data-parallel rank holds it
        full = [(p, v) for p, v in pieces if v.numel() > 0]
        ranks = {p[dp][0] for p, _ in full}
        if len(ranks) > 1:
            raise ValueError(f"{where}: non-empty on data-parallel ranks {sorted(ranks)}; expected exactly one")
        pieces = full
    for axis in replicated:
        first = [(p, v) for p, v in pieces if p.get(axis, (0, 1))[0] == 0]
        for p, v in pieces:
            twin = next(w for q, w in first if all(q.get(a) == p.get(a) for a in q if a != axis))
            if v.shape != twin.shape or not torch.allclose(v.float(), twin.float(), atol=1e-6, rtol=0):
                raise ValueError(f"{where}: declared {axis}:replicated but {axis} rank {p[axis][0]} differs from rank 0")
        pieces = first
    if len(dims) != pieces[0][1].dim():
        raise ValueError(f"{where}: dims {dims_text!r} name {len(dims)} dims; the tensor has {pieces[0][1].dim()} "
                         f"{list(pieces[0][1].shape)}")
    for d, dim in enumerate(dims):
        for axis, qual in reversed(dim.shards):
            if axis == "cp" or "zigzag" in qual:
                size = pieces[0][0].get(axis, (0, 1))[1]
                if size > 1 or "zigzag" in qual:
                    raise ValueError(f"{where}: context parallelism ({axis}:{qual}) is not supported; dump with cp 1")
            if pieces[0][0].get(axis, (0, 1))[1] <= 1:
                continue
            groups = defaultdict(list)
            for p, v in pieces:
                groups[tuple(sorted((a, r) for a, (r, _) in p.items() if a != axis))].append((p, v))
            merged = []
            for group in groups.values():
                group.sort(key=lambda pv: pv[0][axis][0])
                values = [v for _, v in group]
                combined = torch.stack(values).sum(0) if qual == "partial" else torch.cat(values, dim=d)
                merged.append(({a: rv for a, rv in group[0][0].items() if a != axis}, combined))
            pieces = merged
    active = {a for p, _ in pieces for a, (_, size) in p.items() if size > 1} - {dp, "pp", "dp"}
    if len(pieces) > 1:
        raise ValueError(f"{where}: ranks on axes {sorted(active)} are neither sharded nor declared replicated in "
                         f"dims {dims_text!r}")
    value = pieces[0][1]
    # squeeze singleton dims ("1", a batch of 1) so rows are tokens first
    keep = [i for i, dim in enumerate(dims) if not (dim.name == "1" or (dim.name == "b" and value.shape[i] == 1))]
    value = value.reshape([value.shape[i] for i in keep])
    token_dim = next((k for k, i in enumerate(keep) if dims[i].name in ("t", "s")), 0)
    return value.movedim(token_dim, 0)


def _rows_of_step(fields: dict, step: int, where: str) -> list[tuple]:
    """(sequence id, position) of each token row of one step."""
    ids = fields.get("input_ids")
    if ids is None:
        raise ValueError(f"{where}: step {step} has no input_ids dump (the dumper's batch fields: run with its "
                         f"default 'core' non-intrusive mode)")
    n = ids.reshape(-1).numel()
    if "seq_lens" in fields:  # engine: requests in batch order, each a run of positions
        positions = fields.get("positions")
        if positions is None:
            raise ValueError(f"{where}: step {step} has seq_lens but no positions")
        positions, seq_lens = positions.reshape(-1).tolist(), fields["seq_lens"].reshape(-1).tolist()
        names = fields.get("rids")
        if not isinstance(names, (list, tuple)) or len(names) != len(seq_lens):
            pool = fields.get("req_pool_indices")
            names = [f"slot{int(x)}" for x in pool.reshape(-1).tolist()] if pool is not None else \
                [f"step{step}-req{j}" for j in range(len(seq_lens))]
        rows, r = [], 0
        for name, total in zip(names, seq_lens):
            if r >= n:
                break
            length = total - positions[r]
            rows += [(str(name), positions[r] + k) for k in range(length)]
            r += length
        if r != n:
            raise ValueError(f"{where}: step {step}: seq_lens {seq_lens} and positions account for {r} of {n} tokens")
        return rows
    cu = fields.get("cu_seqlens_q")
    if cu is not None:  # trainer: packed sequences
        bounds = cu.reshape(-1).tolist()
        return [(f"step{step}-seq{j}", pos) for j in range(len(bounds) - 1) for pos in range(bounds[j + 1] - bounds[j])]
    return [(f"step{step}-seq0", pos) for pos in range(n)]


def read_framework_dump(path) -> Capture:
    """A dumper folder -> a Capture (sequences in order of first appearance, rows by position)."""
    root = Path(path)
    leaf = _leaf(root)
    records = [_load(f) for f in sorted(leaf.glob("*.pt"))]
    if not records:
        raise ValueError(f"{leaf}: no dumper files")
    grads = [r for r in records if str(r.tags["name"]).startswith("grad__")]
    fields, sites = defaultdict(dict), defaultdict(list)
    unknown = set()
    for r in records:
        if r in grads:
            continue
        name = str(r.tags["name"])
        if name in ENGINE_FIELDS + TRAINER_FIELDS:
            if "layer_id" not in r.tags:  # the root's copy (layers receive some of these too)
                fields[r.tags["step"]].setdefault(name, []).append(r)
            continue
        site = DUMP_SITES.get(name, name if name in set(DUMP_SITES.values()) else None)
        if site is None:
            unknown.add(name)
            continue
        extra = tuple(sorted((k, str(v)) for k, v in r.tags.items()
                             if k not in ("step", "rank", "dump_index", "name", "layer_id", "recompute_status")))
        sites[(r.tags.get("layer_id"), site, extra, r.tags["step"])].append(r)
    steps = sorted({key[3] for key in sites} | set(fields))
    batch = {}
    for step in steps:
        merged = {}
        for name, recs in fields.get(step, {}).items():
            merged[name] = recs[0].value if name == "rids" else _unshard(recs, f"{leaf}: {name} step {step}")
        batch[step] = merged
    rows_of = {step: _rows_of_step(batch[step], step, str(leaf)) for step in steps if batch.get(step)}
    # tokens of every sequence, by position
    tokens = defaultdict(dict)
    order = []
    for step in sorted(rows_of):
        ids = batch[step]["input_ids"].reshape(-1).tolist()
        for (seq, pos), token in zip(rows_of[step], ids):
            if seq not in tokens:
                order.append(seq)
            tokens[seq][pos] = int(token)
    sequences = []
    for seq in order:
        length = len(tokens[seq])
        if sorted(tokens[seq]) != list(range(length)):
            raise ValueError(f"{leaf}: sequence {seq} lacks positions below {max(tokens[seq])} (a cached prefix is "
                             f"not dumped: turn the prefix cache off for a parity dump)")
        sequences.append([tokens[seq][p] for p in range(length)])
    starts, total = {}, 0
    for seq, s in zip(order, sequences):
        starts[seq], total = total, total + len(s)
    cu = torch.tensor([0] + [len(s) for s in sequences]).cumsum(0)
    ids = torch.tensor([t for s in sequences for t in s])
    capture = Capture(ids, cu, manifest={"path": f"dump:{leaf}", "input_sha256": input_hash(ids, cu),
                                         "lengths": [len(s) for s in sequences], "source": "framework dumper"})
    by_site = defaultdict(dict)
    for (layer, site, extra, step), recs in sites.items():
        if extra:
            unknown.add(f"{site} with tags {dict(extra)}")
            continue
        value = _unshard(recs, f"{leaf}: {site} layer {layer} step {step}")
        rows = rows_of.get(step)
        if rows is None or value.shape[0] != len(rows):
            raise ValueError(f"{leaf}: {site} layer {layer} step {step} has {value.shape[0]} token rows; the step's "
                             f"batch fields give {len(rows) if rows else 0}")
        for (seq, pos), row in zip(rows, value):
            by_site[(layer, site)][starts[seq] + pos] = row
    for key, rows in by_site.items():
        if len(rows) != total:
            capture.manifest.setdefault("incomplete_sites", []).append(f"{key[0]}/{key[1]}")
            continue
        stacked = torch.stack([rows[i] for i in range(total)])
        if key[1] == "indexer_topk" and stacked.dtype.is_floating_point:
            stacked = stacked.long()
        capture.tensors[key] = stacked
    capture.manifest["not_read"] = sorted(unknown)
    capture.manifest["gradients"] = len(grads)
    return capture
