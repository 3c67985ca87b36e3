"""Dump folders written the way SGLang's dumper writes them, from glmkit captures of a tiny checkpoint.

The conventions, each as sglang 0.5.23's `python/sglang/srt/debug_utils/dumper.py` has them (checked
against files written by that dumper itself: tests/data/sglang_dumper/):
- path `<dir>/<exp_name>/<tags>.pt`, tags `step`, `rank`, `dump_index` (per process, from 1), `name`,
  `recompute_status`, then the dump's own tags (`layer_id` from the layer hooks), joined by `___`
  (`_Dumper._dump_single`, `_format_tags`);
- `torch.save({"value": v, "meta": {**tags, world_rank, world_size, <fw>_parallel_info, dims}})`
  (`_compute_static_meta`; `dims` only when given);
- parallel info keys of `_SGLangPlugin.collect_parallel_info` / `_MegatronPlugin.collect_parallel_info`
  (Megatron adds `sp_rank`/`sp_size` under sequence parallelism);
- the batch fields of non-intrusive "core" mode under bare names, no `layer_id`: the engine's
  `input_ids`, `positions`, `seq_lens`, `req_pool_indices`, `rids` (`_SGLangPlugin.convert_value`), the
  trainer's `input_ids`, `position_ids`, `cu_seqlens_q`, `cu_seqlens_kv`, `qkv_format`
  (`_MegatronPlugin.convert_value`);
- gradients `grad__<name>` at the step of their forward, parameter gradients `grad__param__<name>`;
- the framework's folders (radixark/miles `miles/utils/dumper_utils.py`): `engines/engine_<i>` and
  `<phase>/rollout_<id>`; the engine's step = one forward (a prefill, then one per decode), the
  trainer's step = one micro-batch; the engine never forwards the last token it samples.
"""

from __future__ import annotations

from pathlib import Path

import torch

from glmkit.parity.framework_dump import DUMP_SITES

NAME_OF = {site: name for name, site in DUMP_SITES.items()}


class DumperFiles:
    """One process's dumper: a dump_index counter and its static meta."""

    def __init__(self, folder: Path, rank: int, world: int, info_key: str, info: dict):
        self.folder, self.rank, self.index = Path(folder), rank, 0
        self.static = {"world_rank": rank, "world_size": world, info_key: info}
        self.folder.mkdir(parents=True, exist_ok=True)

    def dump(self, step: int, name: str, value, dims: str | None = None, **tags):
        self.index += 1
        head = {"step": step, "rank": self.rank, "dump_index": self.index, "name": name,
                "recompute_status": tags.pop("recompute_status", "disabled"), **tags}
        meta = {**head, **self.static, **({"dims": dims} if dims else {})}
        stem = "___".join(f"{k}={v}" for k, v in head.items())
        torch.save({"value": value.clone() if isinstance(value, torch.Tensor) else value, "meta": meta},
                   self.folder / f"{stem}.pt")


def sglang_info(tp_rank: int, tp: int, dp_rank: int = 0, dp: int = 1) -> dict:
    """With DP attention (dp > 1) the tp group spans the dp groups: attention tp = tp / dp (SGLang's layout)."""
    attn_tp = tp // dp
    return {"tp_rank": tp_rank, "tp_size": tp, "pp_rank": 0, "pp_size": 1, "moe_ep_rank": tp_rank, "moe_ep_size": tp,
            "moe_tp_rank": 0, "moe_tp_size": 1, "moe_dp_rank": 0, "moe_dp_size": 1, "attn_dp_enabled": dp > 1,
            "attn_tp_rank": tp_rank % attn_tp, "attn_tp_size": attn_tp, "attn_dp_rank": dp_rank, "attn_dp_size": dp,
            "attn_cp_rank": 0, "attn_cp_size": 1}


def megatron_info(tp_rank: int, tp: int, sequence_parallel: bool) -> dict:
    info = {"tp_rank": tp_rank, "tp_size": tp, "pp_rank": 0, "pp_size": 1, "dp_rank": 0, "dp_size": 1,
            "cp_rank": 0, "cp_size": 1, "vpp_rank": None, "vpp_size": None, "ep_rank": tp_rank, "ep_size": tp,
            "etp_rank": 0, "etp_size": 1, "edp_rank": 0, "edp_size": 1, "tcp_rank": tp_rank, "tcp_size": tp,
            "etmp_rank": tp_rank, "etmp_size": tp, "tp_src_rank": 0, "mp_src_rank": 0, "dp_src_rank": tp_rank}
    if sequence_parallel:
        info.update(sp_rank=tp_rank, sp_size=tp)
    return info


def _trailing(value: torch.Tensor) -> str:
    return " ".join(["h", "n", "m"][:value.dim() - 1])


def _trim(site, v):
    """indexer_scores as a step holds them: as many pools as its longest sequence has so far."""
    if site != "indexer_scores" or v.numel() == 0:
        return v
    live = torch.isfinite(v).any(0).nonzero()
    return v[:, :int(live.max()) + 1 if len(live) else 1]


def _sites(capture):
    """(name, layer_id, site, rows) in dump order. As the shipped patcher configs do, the streams entering
    layer L are dumped as `layer_input` at L besides `layer_output` at L-1: the same tensor twice."""
    last = max((layer for layer, _ in capture.tensors if layer is not None), default=-1)
    for (layer, site), rows in sorted(capture.tensors.items(), key=lambda kv: (kv[0][0] is None, kv[0][0] or 0,
                                                                              kv[0][1])):
        if site in NAME_OF and site not in ("logprobs",):
            yield NAME_OF[site], layer, site, rows
            if site == "streams_after_ffn" and layer is not None and layer < last:
                yield "layer_input", layer + 1, site, rows


def _shards(site: str, value: torch.Tensor, tp: int, side: str, sharded: set):
    """(dims, [piece of each tp rank]) as the framework's patch would dump this site."""
    extra = _trailing(value)
    if site in sharded and site == "attn_out" and side == "engine":  # row-parallel o_proj before its all-reduce
        parts = [value * (0.25 if r == 0 else 0.75 / (tp - 1)) for r in range(tp)]
        parts[-1] = value - sum(parts[:-1])
        return f"t {extra[:-1]}h[attn_tp:partial] # dp:=attn_dp".replace("  ", " "), parts
    if site in sharded and site == "mlp_in" and value.dim() == 2:  # hidden split across tp
        return "t h[attn_tp] # dp:=attn_dp", list(value.chunk(tp, dim=-1))
    if side == "engine" and site.startswith("streams_"):  # SGLang's residual: the n streams flat, [T, n*C]
        return "t h # attn_tp:replicated dp:=attn_dp", [value.flatten(1)] * tp
    rest = f" {extra}" if extra else ""
    if side == "trainer":
        return f"t 1{rest} # tp:replicated", [value.unsqueeze(1)] * tp
    return f"t{rest} # attn_tp:replicated dp:=attn_dp", [value] * tp


def write_engine_dump(capture, prompt_lengths, folder, tp: int = 2, grads=None, sharded=("attn_out", "mlp_in"),
                      engine: int = 0, rids=None, dp: int = 1):
    """The engine side: `engines/engine_<i>` under `folder`, one prefill step for every prompt then one
    decode step per token (requests finishing at their own lengths), the last token of each sequence
    never forwarded. With `dp` > 1 (DP attention) request n runs on data-parallel group n % dp, each
    group its own tp // dp ranks and steps."""
    out = Path(folder) / "engines" / f"engine_{engine}"
    cu = capture.cu_seqlens.tolist()
    seqs = [capture.input_ids[s:e].tolist() for s, e in zip(cu[:-1], cu[1:])]
    rids = rids or [f"{engine}-req{n:02d}-{7 * n + 3:x}" for n in range(len(seqs))]
    for group in range(dp):
        attn_tp = tp // dp
        ranks = [DumperFiles(out, group * attn_tp + r, tp, "sglang_parallel_info",
                             sglang_info(group * attn_tp + r, tp, group, dp)) for r in range(attn_tp)]
        mine = [n for n in range(len(seqs)) if n % dp == group]
        _engine_steps(capture, prompt_lengths, seqs, rids, cu, mine, ranks, attn_tp, grads, sharded)
    return out


def _engine_steps(capture, prompt_lengths, seqs, rids, cu, mine, ranks, tp, grads, sharded):
    plan = [[(n, list(range(prompt_lengths[n]))) for n in mine]]
    for j in range(max(len(seqs[n]) - 1 - prompt_lengths[n] for n in mine)):
        plan.append([(n, [prompt_lengths[n] + j]) for n in mine if prompt_lengths[n] + j < len(seqs[n]) - 1])
    for step, batch in enumerate(plan):
        rows = torch.tensor([cu[n] + q for n, positions in batch for q in positions])
        fields = {"input_ids": capture.input_ids[rows],
                  "positions": torch.tensor([q for _, positions in batch for q in positions]),
                  "seq_lens": torch.tensor([positions[-1] + 1 for _, positions in batch]),
                  "req_pool_indices": torch.tensor([n + 1 for n, _ in batch]),
                  "rids": [rids[n] for n, _ in batch]}
        for r in ranks:
            for name, value in fields.items():
                r.dump(step, name, value)
            # attention modules receive `positions` too: a copy with a layer_id (not the root's)
            r.dump(step, "positions", fields["positions"], layer_id=0)
        for kind, source in (("", capture), ("grad__", grads)):
            if source is None:
                continue
            for name, layer, site, values in _sites(source):
                dims, parts = _shards(site, _trim(site, values[rows]), tp, "engine", set(sharded))
                for r, part in zip(ranks, parts):
                    tags = {} if layer is None else {"layer_id": layer}
                    r.dump(step, kind + name, part, dims=dims, **tags)


def write_trainer_dump(capture, folder, tp: int = 2, micro_batches: int = 2, sequence_parallel: bool = True,
                       grads=None, param_grads=None, phase: str = "fwd_only", pad_to: int = 8,
                       recompute: bool = False):
    """The trainer side: `<phase>/rollout_0`, one step per micro-batch of packed sequences (THD, padded to
    a multiple of `pad_to` as miles' get_batch does, the padding one more cu_seqlens segment), sequence-first `t 1 h` values, the sequence
    split across tp ranks (`t[sp]`) under sequence parallelism, indexer_topk as absolute packed indices."""
    out = Path(folder) / phase / "rollout_0"
    ranks = [DumperFiles(out, r, tp, "megatron_parallel_info", megatron_info(r, tp, sequence_parallel))
             for r in range(tp)]
    cu = capture.cu_seqlens.tolist()
    n = len(cu) - 1
    groups = [list(range(n))[k::micro_batches] for k in range(micro_batches)]
    for step, group in enumerate(g for g in groups if g):
        rows = torch.cat([torch.arange(cu[i], cu[i + 1]) for i in group])
        lengths = [cu[i + 1] - cu[i] for i in group]
        pad = (-len(rows)) % pad_to
        # as miles' get_batch: the padding is one more cu_seqlens segment (of pad tokens)
        local_cu = torch.tensor([0] + lengths + ([pad] if pad else [])).cumsum(0).int()
        starts = torch.repeat_interleave(local_cu[:len(lengths)].long(), torch.tensor(lengths))
        fields = {"input_ids": torch.cat([capture.input_ids[rows], torch.zeros(pad, dtype=torch.long)])[None],
                  "position_ids": torch.cat([torch.cat([torch.arange(x) for x in lengths]),
                                             torch.zeros(pad, dtype=torch.long)])[None],
                  "cu_seqlens_q": local_cu, "cu_seqlens_kv": local_cu, "qkv_format": "thd"}
        for r in ranks:
            for name, value in fields.items():
                r.dump(step, name, value)
        for kind, source in (("", capture), ("grad__", grads)):
            if source is None:
                continue
            for name, layer, site, values in _sites(source):
                v = _trim(site, values[rows])
                if site == "indexer_topk":  # _kpool_select's own layout: packed indices of the micro-batch
                    v = torch.where(v >= 0, v + starts[:, None], v).int()
                v = torch.cat([v, torch.zeros(pad, *v.shape[1:], dtype=v.dtype)])
                if sequence_parallel and site not in ("indexer_topk", "indexer_scores"):
                    # each tp rank holds its sequence-parallel shard (the router too, on its own tokens)
                    rest = _trailing(v)
                    dims = f"t[sp] 1{' ' + rest if rest else ''} # tp:replicated"
                    parts = list(v.unsqueeze(1).chunk(tp, dim=0))
                else:
                    dims, parts = _shards(site, v, tp, "trainer", set())
                for r, part in zip(ranks, parts):
                    tags = {} if layer is None else {"layer_id": layer}
                    r.dump(step, kind + name, part, dims=dims, **tags)
                    if recompute and kind == "" and layer is not None:  # activation recompute dumps again
                        r.dump(step, name, part * 0 + 1e6, dims=dims, recompute_status="recompute", **tags)
    for name, g in (param_grads or {}).items():
        ranks[0].dump(0, f"grad__param__module.module.{name}", g)
        for r in ranks[1:]:
            r.dump(0, f"grad__param__module.module.{name}", g)
    return out
