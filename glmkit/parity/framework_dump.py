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

Data-parallel ranks (SGLang's DP attention) each run their own requests: each is read as its own stream
of steps. The trainer's micro-batch padding (miles appends it to cu_seqlens as one more segment of one
repeated pad token) is dropped. The "all" non-intrusive mode's module outputs
(`non_intrusive__<module path>.output`) are read by the glm5_next module paths in MODULE_OUTPUTS.

Files are read with `torch.load(weights_only=True)`: a dump holding anything else is refused by name.
Not handled (refused by name): context parallelism (`cp` size > 1, zigzag).
"""

from __future__ import annotations

import pickle
import re
import warnings
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

from glmkit.inputs import UNPICKLE_ERRORS, check_loaded_tensors, not_a_file
from glmkit.parity.dump import Capture

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
# Names that cannot line up across the two sides, and what is compared instead.
NOT_ALIGNABLE = {
    "attn_k": "dumped before RoPE on one side and after on the other; attn_output, after it, is compared",
    "moe_expert_output": "expert-parallel ranks hold different token counts; mlp_output, the combined output, is "
                         "compared",
    "moe_router_logits": "a tie judgement ranks sigmoid(logits) + correction bias: moe_router_scores is read instead",
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
    """A folder holding dumper files (`step=...___name=....pt`), directly or below it."""
    path = Path(path)
    return path.is_dir() and next(path.rglob("step=*.pt"), None) is not None


def dump_leaves(path) -> list[Path]:
    """The dump folders a path stands for: itself when it holds dumper files; else the one folder below
    it that does; else every `engine_<i>` of one engine side (the framework gives each engine its own
    folder: together they are the engine side). Anything else (a whole `--dumper-dir` with engine and
    trainer phases) is refused, naming the folders to choose from."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: not a directory")
    if next(path.glob("step=*.pt"), None) is not None:
        return [path]
    leaves = sorted({f.parent for f in path.rglob("step=*.pt")})
    if not leaves:
        raise ValueError(f"{path}: no dumper files (step=...___name=....pt) in it")
    if len(leaves) == 1:
        return leaves
    engines = [p for p in leaves if re.fullmatch(r"engine_\d+", p.name)]
    if len(engines) == len(leaves) and len({p.parent for p in engines}) == 1:
        return engines
    shown = ", ".join(str(p.relative_to(path)) for p in leaves[:6]) + (", ..." if len(leaves) > 6 else "")
    raise ValueError(f"{path}: {len(leaves)} dump folders in it ({shown}); give one side: an engines/ folder or "
                     f"one trainer phase folder such as fwd_only/rollout_0")


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
            if not word[:-len(":replicated")]:
                raise ValueError(f"dims {text!r}: ':replicated' names no axis")
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
    if (why := not_a_file(file)) is not None:  # a pipe would block torch.load for ever
        raise ValueError(f"{file}: {why}; a dump file is a regular file")
    try:
        with warnings.catch_warnings():  # torch warns before failing on a legacy pickle; the error says it all
            warnings.simplefilter("ignore", UserWarning)
            data = torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"GLOBAL ([\w.]+)", str(err))
        raise ValueError(f"{file}: needs pickle to read ({found.group(1) if found else 'not weights-only'}); "
                         f"glmkit reads dumps with torch.load(weights_only=True) only") from None
    except UNPICKLE_ERRORS as err:
        raise ValueError(f"{file}: not a readable dump file ({type(err).__name__})") from None
    if not (isinstance(data, dict) and "value" in data):
        raise ValueError(f"{file}: not a dumper file (expected {{'value': ..., 'meta': {{...}}}})")
    tags = parse_name(file.stem)
    for key in ("step", "rank", "dump_index", "layer_id"):
        if key in tags and not isinstance(tags[key], int):
            raise ValueError(f"{file}: {key}={tags[key]!r} in the file name is not an integer")
    meta = data.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise ValueError(f"{file}: meta is a {type(meta).__name__}; the dumper writes a dict")
    if (meta or {}).get("dims") is not None and not isinstance(meta["dims"], str):
        raise ValueError(f"{file}: dims is a {type(meta['dims']).__name__}; the dumper writes a string such as 't h[tp]'")
    value = data["value"]
    check_loaded_tensors(data, str(file))  # meta, sparse and hugely expanded tensors, before any is read
    meta = {**(meta or {}), **tags}
    cp = _parallel(meta).get("cp", (0, 1))[1]
    if cp > 1:
        raise ValueError(f"{file}: context parallel size {cp}; glmkit does not read context-parallel dumps (dump "
                         f"with context parallel size 1)")
    return _Record(tags, meta, value, file)


def _same(values) -> bool:
    first = values[0]
    if not isinstance(first, torch.Tensor):
        return all(v == first for v in values)
    return all(isinstance(v, torch.Tensor) and v.shape == first.shape and
               torch.equal(v.to(first.dtype), first) for v in values[1:])


def _unshard(records: list, where: str) -> torch.Tensor:
    """One logical tensor from its ranks' pieces, as its dims say (rightmost shard axis first), with its
    token dim first: `t ...`, or `s b ...` / `b s ...` flattened batch-major (row = b * s_len + s)."""
    dims_text = records[0].meta.get("dims")
    if not dims_text:  # the batch fields, or a site dumped without dims: every rank must hold the same
        values = [r.value for r in records]
        nonempty = [v for v in values if not isinstance(v, torch.Tensor) or v.numel() > 0] or values
        if not _same(nonempty):
            raise ValueError(f"{where}: {len(records)} ranks dumped different values and it has no dims to say "
                             f"how they combine (dump it with dims=...)")
        return nonempty[0]
    try:
        dims, replicated, dp_alias = parse_dims(dims_text)
    except ValueError as err:
        raise ValueError(f"{records[0].file}: {err}") from None
    pieces = [(_parallel(r.meta), r.value) for r in records]
    for r, (_, v) in zip(records, pieces):
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"{r.file}: holds a {type(v).__name__}, not a tensor")
    dp = dp_alias or "dp"
    if any(p.get(dp, (0, 1))[1] > 1 for p, _ in pieces):  # the dumper's rule: one data-parallel rank holds it
        full = [(p, v) for p, v in pieces if v.numel() > 0]
        ranks = {p[dp][0] for p, _ in full}
        if len(ranks) > 1:
            raise ValueError(f"{where}: non-empty on {dp} ranks {sorted(ranks)}; expected exactly one")
        pieces = full or pieces[:1]
    sharded_axes = {axis for dim in dims for axis, _ in dim.shards}
    named = sharded_axes | replicated
    for axis in sorted(replicated):
        # an axis that moves with a sharded one (Megatron's tp with sp: the same ranks) holds no copies
        if any(all(p.get(axis, (0, 1))[0] == p.get(a, (0, 1))[0] for p, _ in pieces) and
               pieces[0][0].get(a, (0, 1))[1] > 1 for a in sharded_axes):
            named.discard(axis)
            continue
        first = [(p, v) for p, v in pieces if p.get(axis, (0, 1))[0] == 0]
        for p, v in pieces:
            twin = next((w for q, w in first if all(q.get(a) == p.get(a) for a in named - {axis})), None)
            if twin is None or v.shape != twin.shape or not torch.allclose(v.float(), twin.float(), atol=1e-6,
                                                                           rtol=1e-5, equal_nan=True):
                raise ValueError(f"{where}: declared {axis}:replicated but {axis} rank {p.get(axis, (0,))[0]} "
                                 f"differs from rank 0")
        pieces = first
    if len(dims) != pieces[0][1].dim():
        raise ValueError(f"{where}: dims {dims_text!r} name {len(dims)} dims; the tensor has {pieces[0][1].dim()} "
                         f"{list(pieces[0][1].shape)}")
    for d, dim in enumerate(dims):
        for axis, qual in reversed(dim.shards):
            sizes = {p.get(axis, (0, 1))[1] for p, _ in pieces}
            if len(sizes) > 1 or min(sizes) < 1:
                raise ValueError(f"{where}: the ranks' parallel info gives {axis} sizes {sorted(sizes)[:4]}; "
                                 f"expected one size >= 1")
            size = sizes.pop()
            if size > 1 and any(axis not in p for p, _ in pieces):
                raise ValueError(f"{where}: dims shard it over {axis}, but a rank's parallel info has no integer "
                                 f"{axis}_rank and {axis}_size")
            if (axis == "cp" and size > 1) or ("zigzag" in qual and size > 1):
                raise ValueError(f"{where}: context parallelism ({axis}:{qual}, size {size}) is not read by glmkit; "
                                 f"dump with context parallel size 1")
            if size <= 1:
                continue
            groups = defaultdict(list)
            for p, v in pieces:
                # grouped by the other axes the dims name: an axis it does not name moves with this one
                # (SGLang's attn_tp with tp) or holds copies, checked equal at the end
                groups[tuple(sorted((a, r) for a, (r, _) in p.items() if a != axis and a in named))].append((p, v))
            merged = []
            for group in groups.values():
                group.sort(key=lambda pv: pv[0][axis][0])
                if [pv[0][axis][0] for pv in group] != list(range(size)):
                    raise ValueError(f"{where}: {axis} ranks {[pv[0][axis][0] for pv in group]} dumped it; "
                                     f"{axis} size is {size}: a rank's file is missing")
                values = [v for _, v in group]
                try:
                    combined = torch.stack(values).sum(0) if "partial" in qual else torch.cat(values, dim=d)
                except RuntimeError:
                    raise ValueError(f"{where}: its {axis} pieces of shapes {[list(v.shape) for v in values][:4]} do "
                                     f"not combine as dims {dims_text!r} say") from None
                merged.append(({a: rv for a, rv in group[0][0].items() if a != axis}, combined))
            pieces = merged
    if len(pieces) > 1 and not _same([v for _, v in pieces]):
        active = sorted({a for p, _ in pieces for a, (_, size) in p.items() if size > 1} - {dp})
        raise ValueError(f"{where}: ranks on axes {active} hold different values that dims {dims_text!r} neither "
                         f"shards nor declares replicated")
    value = pieces[0][1]
    names = [dim.name for dim in dims]
    keep = [i for i, name in enumerate(names) if name != "1"]
    value, names = value.reshape([value.shape[i] for i in keep]), [names[i] for i in keep]
    if "t" in names:
        return value.movedim(names.index("t"), 0)
    if "s" in names and "b" in names:  # sequence-first or batch-first: rows batch-major
        value = value.movedim(names.index("b"), 0)
        s_at = [n for n in names if n != "b"].index("s") + 1
        return value.movedim(s_at, 1).flatten(0, 1)
    if "s" in names:
        return value.movedim(names.index("s"), 0)
    return value


# --- rows: which (sequence, position) each token row of a step is -------------------------------------------

SLOT = "slot"  # a request known only by its req_pool_indices slot (no rids dumped)


def _has_rids(fields: dict) -> bool:
    names, seq_lens = fields.get("rids"), fields.get("seq_lens")
    return isinstance(names, (list, tuple)) and seq_lens is not None and len(names) == seq_lens.numel()


def _requests_by_slot(rows_of: dict, batch: dict, where: str) -> None:
    """Without rids a request is its req_pool_indices slot, and SGLang gives a finished request's slot to
    the next one: a slot that starts again at position 0 holds a new request (`slot4#2`). Steps of one
    engine stream either all have rids or none do; a mix cannot be matched and is refused by step."""
    streams = defaultdict(list)
    for step in sorted(rows_of):
        if "seq_lens" in batch[step]:
            streams[step[0]].append(step)
    for stream, steps in streams.items():
        named = [s for s in steps if _has_rids(batch[s])]
        if not named:
            generation = {}
            for step in steps:
                rows = rows_of[step][0]
                for i, row in enumerate(rows):
                    if row is None:
                        continue
                    slot, pos = row
                    if pos == 0 or slot not in generation:
                        generation[slot] = generation.get(slot, 0) + 1
                    rows[i] = (f"{slot}#{generation[slot]}", pos)
        elif len(named) != len(steps):
            missing = sorted(s[1] for s in steps if s not in named)
            raise ValueError(f"{where}: engine steps {missing[:8]}{' ...' if len(missing) > 8 else ''} have no rids "
                             f"(or not one per request) while other steps do: their rows cannot be matched to "
                             f"requests (keep the dumper's non_intrusive_mode=core for every step)")


def _integers(fields: dict, name: str, step: int, where: str) -> list[int]:
    """A batch field as a flat list of non-negative ints; refused by name unless an integer tensor."""
    value = fields[name]
    if not isinstance(value, torch.Tensor) or value.dtype == torch.bool or value.is_floating_point() or \
            value.is_complex():
        kind = f"{value.dtype} tensor" if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(f"{where}: step {step}: {name} is a {kind}; the dumper writes an integer tensor")
    flat = value.reshape(-1).tolist()
    if flat and min(flat) < 0:
        raise ValueError(f"{where}: step {step}: {name} holds {min(flat)}; expected values >= 0")
    return flat


def _rows_of_step(fields: dict, step: int, where: str) -> tuple[list, list]:
    """-> ((sequence id, position) of each token row, packed start of each row's sequence in the step)."""
    if fields.get("input_ids") is None:
        raise ValueError(f"{where}: step {step} has no input_ids dump (the dumper's batch fields: run with "
                         f"non_intrusive_mode=core, its default)")
    ids = fields["input_ids"]
    n = len(_integers(fields, "input_ids", step, where))
    if "seq_lens" in fields:  # engine: requests in batch order, each a run of consecutive positions
        if fields.get("positions") is None:
            raise ValueError(f"{where}: step {step} has seq_lens but no positions")
        positions, seq_lens = _integers(fields, "positions", step, where), _integers(fields, "seq_lens", step, where)
        if len(positions) != n:
            raise ValueError(f"{where}: step {step}: {len(positions)} positions for {n} input_ids")
        names = fields.get("rids")
        if not _has_rids(fields):
            if fields.get("req_pool_indices") is None:
                raise ValueError(f"{where}: step {step}: no rids and no req_pool_indices to tell requests apart")
            names = [f"{SLOT}{x}" for x in _integers(fields, "req_pool_indices", step, where)]
        rows, starts, r = [], [], 0
        for name, total in zip(names, seq_lens):
            if r >= n:
                break
            length = int(total) - int(positions[r])
            if length <= 0 or r + length > n:
                raise ValueError(f"{where}: step {step}: request {name} has seq_len {total} and first position "
                                 f"{positions[r]}; the step has {n} tokens")
            rows += [(str(name), int(positions[r]) + k) for k in range(length)]
            starts += [r] * length
            r += length
        if r != n:
            raise ValueError(f"{where}: step {step}: seq_lens {seq_lens} and positions account for {r} of {n} tokens")
        return rows, starts
    if ids.dim() == 2 and "cu_seqlens_q" not in fields:  # trainer, BSHD: one sequence per batch row
        b, s = ids.shape
        return [(f"step{step}-seq{j}", p) for j in range(b) for p in range(s)], [j * s for j in range(b) for _ in range(s)]
    bounds = _integers(fields, "cu_seqlens_q", step, where) if fields.get("cu_seqlens_q") is not None else [0, n]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] > n or any(b > c for b, c in zip(bounds, bounds[1:])):
        raise ValueError(f"{where}: step {step}: cu_seqlens_q {bounds} does not fit its {n} tokens")
    # miles pads the packed micro-batch with pad tokens and appends the padding to cu_seqlens as one more
    # segment (miles/backends/training_utils/data.py, get_batch): a last segment of one repeated token
    # after real sequences is that padding, not a sequence
    flat = ids.reshape(-1).tolist()
    segments = len(bounds) - 1
    if segments > 1 and len(set(flat[bounds[-2]:bounds[-1]])) == 1:
        segments -= 1
    rows = [(f"step{step}-seq{j}", p) for j in range(segments) for p in range(bounds[j + 1] - bounds[j])]
    starts = [bounds[j] for j in range(segments) for _ in range(bounds[j + 1] - bounds[j])]
    # rows past the last sequence are padding
    return rows + [None] * (n - bounds[segments]), starts + [None] * (n - bounds[segments])


# --- the dump as a capture ------------------------------------------------------------------------------------

@dataclass
class FrameworkDump:
    """A dump read: `capture` (activations), `grads` (activation gradients `grad__<name>` as a capture on the
    same rows), `param_grads` {parameter name: gradient} (`grad__param__<name>`), and what was not used."""

    capture: Capture
    grads: Capture
    param_grads: dict
    side: str                       # "engine" or "trainer"
    not_read: list
    incomplete: list

    @property
    def manifest(self) -> dict:
        return self.capture.manifest


# The dumper's non-intrusive "all" mode names module outputs by their path:
# `non_intrusive__<module path>.output` (`.output.<i>` for a tuple of several tensors). These are the
# paths of the Megatron glm5_next model (HyperConnectionTransformerLayer under decoder.layers) and of
# SGLang's glm5_next.py (Glm5NextDecoderLayer under model.layers) whose outputs are glmkit sites.
# They carry no dims: read at tensor parallel size 1 (ranks holding different values are refused).
MODULE_OUTPUTS = [
    (re.compile(r"(?:.*\.)?decoder\.layers\.(\d+)\.input_layernorm\.output"), "attn_in"),
    (re.compile(r"(?:.*\.)?decoder\.layers\.(\d+)\.self_attention\.output(?:\.0)?"), "attn_out"),
    (re.compile(r"(?:.*\.)?decoder\.layers\.(\d+)\.pre_mlp_layernorm\.output"), "mlp_in"),
    (re.compile(r"(?:.*\.)?decoder\.layers\.(\d+)\.mlp\.output(?:\.0)?"), "mlp_out"),
    (re.compile(r"(?:.*\.)?decoder\.layers\.(\d+)\.output(?:\.0)?"), "streams_after_ffn"),
    (re.compile(r"(?:.*\.)?decoder\.final_layernorm\.output"), "final_hidden"),
    (re.compile(r"(?:.*\.)?model\.layers\.(\d+)\.self_attn\.output(?:\.0)?"), "attn_out"),
    (re.compile(r"(?:.*\.)?model\.layers\.(\d+)\.mlp\.output(?:\.0)?"), "mlp_out"),
    (re.compile(r"(?:.*\.)?model\.layers\.(\d+)\.mlp\.topk\.output\.1"), "router_experts"),
    (re.compile(r"(?:.*\.)?model\.layers\.(\d+)\.mlp\.topk\.output\.0"), "router_weights"),
]
NON_INTRUSIVE = "non_intrusive__"


def _site_of(name: str, layer):
    """dump name (and layer: the dump's layer_id, global) -> (layer, glmkit site), or None."""
    if name.startswith(NON_INTRUSIVE):
        path = name[len(NON_INTRUSIVE):]
        for pattern, site in MODULE_OUTPUTS:
            m = pattern.fullmatch(path)
            if m:
                if site == "final_hidden":
                    return None, site
                return (layer if layer is not None else int(m.group(1))), site
        return None
    if name == LAYER_INPUT:
        return None if layer is None or layer == 0 else (layer - 1, "streams_after_ffn")
    site = DUMP_SITES.get(name, name if name in set(DUMP_SITES.values()) else None)
    if site is None:
        return None
    return (None if site in ("final_hidden", "logits") else layer), site


def _dp_group(meta: dict) -> str:
    """Data-parallel ranks run their own requests (SGLang's DP attention): each is its own stream of steps.
    An idle rank's empty dumps form a stream with no tokens."""
    info = _parallel(meta)
    for axis in ("attn_dp", "dp"):
        rank, size = info.get(axis, (0, 1))
        if size > 1:
            return f"{axis}{rank}/"
    return ""


def _place_hook_gradients(records: list, where: str) -> None:
    """Give layer_id to gradients written by the dumper's backward hooks. Such a file carries only the name
    and the dump call's own keywords (sglang dumper `_register_dump_grad_hook`), not the layer context the
    forward value had. Backward runs from the last layer to the first, so on one rank in one step the k-th
    `grad__<name>` to fire (by dump_index) belongs to the k-th highest layer that dumped `<name>` (with
    activation recompute too: a layer is recomputed just before its own backward)."""
    layers, grads = defaultdict(set), defaultdict(list)
    for r in records:
        key = (r.file.parent, r.tags["step"], r.tags["rank"])
        name = str(r.tags["name"])
        if name.startswith("grad__") and not name.startswith("grad__param__"):
            if "layer_id" not in r.tags:
                grads[key + (name[len("grad__"):],)].append(r)
        elif r.tags.get("layer_id") is not None:
            layers[key + (name,)].add(r.tags["layer_id"])
    for key, recs in grads.items():
        forward = sorted(layers.get(key, ()), reverse=True)
        if not forward:
            continue  # a site without layers (final_hidden_states, logits)
        if len(forward) != len(recs):
            raise ValueError(f"{where}: step {key[1]} rank {key[2]}: {len(recs)} gradients grad__{key[3]} without "
                             f"layer_id for {len(forward)} layers that dumped {key[3]} ({sorted(forward)}); a "
                             f"gradient's layer cannot be told (pass layer_id= in the dump call, or dump one "
                             f"micro-batch per step)")
        for layer, r in zip(forward, sorted(recs, key=lambda r: r.tags.get("dump_index", 0))):
            r.tags["layer_id"] = layer


def read_framework_dump(path) -> FrameworkDump:
    """A dump folder (or an engines/ folder of several engines) -> FrameworkDump. Sequences are ordered by
    first appearance; each token row is placed by (request or packed sequence, position)."""
    from glmkit.parity.capture import canonical

    root = Path(path)
    leaves = dump_leaves(root)
    records = []
    for leaf in leaves:
        files = sorted(leaf.glob("*.pt"))
        records += [_load(f) for f in files if f.name.startswith("step=")]
    _place_hook_gradients(records, str(root))
    engine_tag = {leaf: f"{leaf.name}/" if len(leaves) > 1 else "" for leaf in leaves}
    fields, sites = defaultdict(dict), defaultdict(list)
    not_read, side, other_modules = set(), None, 0
    for r in records:
        if r.tags.get("recompute_status") == "recompute":
            continue  # activation recompute dumps each site again: the original is kept
        leaf = r.file.parent
        step = (engine_tag[leaf] + _dp_group(r.meta), r.tags["step"])
        name = str(r.tags["name"])
        if name in ENGINE_FIELDS + TRAINER_FIELDS:
            side = side or ("engine" if name in ENGINE_FIELDS[2:] or "sglang_parallel_info" in r.meta else None)
            if name in TRAINER_FIELDS[2:] or "megatron_parallel_info" in r.meta:
                side = "trainer"
            if "layer_id" not in r.tags:  # the root's copy (modules inside layers are given some of these too)
                fields[step].setdefault(name, []).append(r)
            continue
        kind = "value"
        if name.startswith("grad__param__"):
            kind, key = "param_grad", name[len("grad__param__"):]
        elif name.startswith("grad__"):
            kind, name = "grad", name[len("grad__"):]
        elif name.startswith("param__"):
            not_read.add("param__* (parameter values)")
            continue
        extra = tuple(sorted((k, str(v)) for k, v in r.tags.items()
                             if k not in ("step", "rank", "dump_index", "name", "layer_id", "recompute_status")))
        if kind == "param_grad":
            sites[("param_grad", key, extra)].append(r)
            continue
        target = _site_of(name, r.tags.get("layer_id"))
        if target is None or extra:
            if name.startswith(NON_INTRUSIVE) and not extra:
                other_modules += 1  # the "all" mode dumps every module: counted, not listed
                continue
            not_read.add(name if not extra else f"{name} (tags {dict(extra)})")
            continue
        sites[(kind, target, step)].append(r)
    if other_modules:
        not_read.add(f"{NON_INTRUSIVE}* ({other_modules} module inputs/outputs that are no glmkit site)")
    where = str(root)
    batch = {step: {name: _unshard(recs, f"{where}: {name} at step {step[1]}") for name, recs in f.items()}
             for step, f in fields.items()}
    rows_of = {}
    for step, f in batch.items():
        if "input_ids" in f:
            rows, starts = _rows_of_step(f, step[1], f"{where} {step[0]}".strip())
            rows_of[step] = ([None if r is None else (step[0] + r[0], r[1]) for r in rows], starts)
    _requests_by_slot(rows_of, batch, where)
    tokens, order = defaultdict(dict), []
    for step in sorted(rows_of):
        for row, token in zip(rows_of[step][0], batch[step]["input_ids"].reshape(-1).tolist()):
            if row is None:
                continue
            seq, pos = row
            if seq not in tokens:
                order.append(seq)
            if tokens[seq].setdefault(pos, int(token)) != int(token):
                raise ValueError(f"{where}: request {seq} position {pos} holds token {tokens[seq][pos]} at one "
                                 f"step and {token} at another")
    if not order:
        raise ValueError(f"{where}: no step with input_ids: the dumper's batch fields are needed to place rows "
                         f"(non_intrusive_mode=core)")
    sequences = []
    for seq in order:
        length = max(tokens[seq]) + 1
        if len(tokens[seq]) != length:
            missing = next(p for p in range(length) if p not in tokens[seq])  # never the whole range
            raise ValueError(f"{where}: request {seq} has no token at position {missing} (a cached prefix is not "
                             f"dumped: turn the prefix cache off for a parity dump)")
        sequences.append([tokens[seq][p] for p in range(length)])
    starts, total = {}, 0
    for seq, s in zip(order, sequences):
        starts[seq], total = total, total + len(s)
    cu = torch.tensor([0] + [len(s) for s in sequences]).cumsum(0)
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    side = side or "engine"
    manifest = {"path": f"{side} dump {root.name}", "source": "framework dumper", "side": side,
                "dump": str(root), "mode": "end-to-end"}
    placed = {"value": defaultdict(dict), "grad": defaultdict(dict)}
    param_grads = {}
    for key, recs in sites.items():
        if key[0] == "param_grad":
            try:
                param_grads[key[1]] = _unshard(recs, f"{where}: grad__param__{key[1]}")
            except ValueError:  # sharded without dims: each rank's piece compared on its own
                for r in recs:
                    param_grads[f"{key[1]} (rank {r.tags['rank']})"] = r.value
            continue
        kind, (layer, site), step = key
        if len({str(r.tags["name"]) for r in recs}) > 1:
            # `layer_input` of layer L is `layer_output` of L-1 (the shipped configs dump both): one is kept
            recs = [r for r in recs if str(r.tags["name"]).removeprefix("grad__") != LAYER_INPUT] or recs
        label = f"{'grad of ' if kind == 'grad' else ''}{site} layer {layer} step {step[1]}"
        by_rank = defaultdict(list)
        for r in recs:
            by_rank[r.tags["rank"]].append(r)
        if any(len(v) > 1 for v in by_rank.values()):
            raise ValueError(f"{where}: {label} dumped {max(len(v) for v in by_rank.values())} times by one rank "
                             f"in one step; dump each site once per layer and step")
        value = _unshard(recs, f"{where}: {label}")
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            raise ValueError(f"{where}: {label} holds a {type(value).__name__ if not isinstance(value, torch.Tensor) else 'scalar'}"
                             f", not a tensor with a token dim ({recs[0].file.name})")
        if not recs[0].meta.get("dims") and side == "trainer" and value.dim() >= 3 and value.shape[1] == 1:
            value = value.squeeze(1)  # Megatron's sequence-first [s, 1, h] without dims: rows are tokens
        rows, row_starts = rows_of.get(step, (None, None))
        if rows is None or value.shape[0] != len(rows):
            raise ValueError(f"{where}: {label} has {value.shape[0]} token rows; the step's batch fields give "
                             f"{len(rows) if rows else 0}")
        if site == "indexer_topk":
            value = value.reshape(len(rows), -1).long()
            if side == "trainer":  # packed indices of the micro-batch -> positions in the row's own sequence
                offset = torch.tensor([s if s is not None else 0 for s in row_starts])[:, None]
                value = torch.where(value >= 0, value - offset, value)
        for row, v in zip(rows, value):
            if row is not None:
                placed[kind][(layer, site)][starts[row[0]] + row[1]] = v
    captures = {}
    incomplete = []
    for kind in ("value", "grad"):
        cap = Capture(ids, cu, manifest=dict(manifest, path=manifest["path"] + (" gradients" if kind == "grad" else "")))
        for key, rows in placed[kind].items():
            if len(rows) != total:
                incomplete.append(f"{'grad ' if kind == 'grad' else ''}{key[0]}/{key[1]}: {len(rows)} of {total} rows")
                continue
            values = [rows[i] for i in range(total)]
            widest = max(v.shape[-1] for v in values) if values[0].dim() else 0
            if any(v.shape != values[0].shape for v in values):
                if key[1] not in ("indexer_scores", "indexer_topk") or len({v.shape[:-1] for v in values}) > 1:
                    raise ValueError(f"{where}: {key[1]} layer {key[0]}: rows of shapes "
                                     f"{sorted({tuple(v.shape) for v in values})} across steps")
                # candidate pools grow with the sequence (a decode step, a longer micro-batch): pad to the widest
                fill = float("-inf") if key[1] == "indexer_scores" else -1
                values = [torch.nn.functional.pad(v, (0, widest - v.shape[-1]), value=fill) for v in values]
            cap.tensors[key] = torch.stack(values)
        logits = cap.tensors.get((None, "logits"))
        if kind == "value" and logits is not None and (None, "logprobs") not in cap.tensors:
            from glmkit.model.train import next_token_targets, token_logprobs
            from glmkit.model.packed import Packed

            targets = next_token_targets(ids, Packed.from_lengths(cap.lengths))
            cap.tensors[(None, "logprobs")] = token_logprobs(logits.float(), targets)
        experts = {layer: t for (layer, site), t in cap.tensors.items() if site == "router_experts"}
        for (layer, site), t in list(cap.tensors.items()):
            cap.tensors[(layer, site)] = canonical(site, t, experts.get(layer))
        captures[kind] = cap
    captures["value"].manifest.update(not_read=sorted(not_read), incomplete_sites=incomplete,
                                      gradients=len(captures["grad"].tensors), parameter_gradients=len(param_grads))
    return FrameworkDump(captures["value"], captures["grad"], param_grads, side, sorted(not_read), incomplete)
