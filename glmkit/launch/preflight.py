"""Preflight: everything about a launch that can be checked before GPUs are spent.

Each check is a `Check(name, ok, detail)` with its arithmetic in `detail`; `preflight()` returns all
of them (a failing one does not stop the rest), `failed()` the ones that did not pass.

Memory model (per GPU, the heaviest pipeline stage; GiB = 2^30 bytes), stated so a user can redo it:
- parameters of a stage: dense (non-expert) ones split over TP, routed experts over EP (expert TP 1);
  the embedding sits on the first stage and the LM head on the last, both split over TP;
- trainer phase: bf16 weights 2 B + fp32 main grads 4 B per parameter, Adam's fp32 master copy and
  two moments 12 B per parameter sharded over the data-parallel ranks (distributed optimizer; for
  experts over the expert-data-parallel ranks, world / PP / EP). LoRA: the base is frozen (weights
  only), the adapters' grads and Adam states are negligible;
- activations with full uniform recompute at `max_tokens_per_gpu`: every layer of the stage keeps
  its input streams (tokens x hc_mult x hidden bf16, split over TP by sequence parallelism) plus one
  layer recomputed at a time (its working set taken as 24 x tokens x hidden x 2 B, plus the MoE's
  tokens x top_k x (hidden + 2 x moe_intermediate) x 2 B dispatch buffers);
- rollout phase (colocated, trainer offloaded): the engine's bf16 weights, dense over the engine's
  TP and experts over its EP; the rest of the GPU is the engine's KV cache.
Both phases must fit in the GPU's memory less 10% headroom.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from glmkit.inputs import not_a_file, read_marker
from glmkit.launch.shapes import Shape, pipeline_split

GIB = 2 ** 30
HEADROOM = 0.9


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str

    def line(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'}  {self.name}: {self.detail}"


def failed(checks) -> list[Check]:
    return [c for c in checks if not c.ok]


# ---- layout -----------------------------------------------------------------------------------
def layout_checks(config, shape: Shape, first: int | None = None, last: int | None = None) -> list[Check]:
    world, tp, pp, ep = shape.world, shape.tp, shape.pp, shape.ep
    checks = [Check("world divisible by TP x PP", world % (tp * pp) == 0,
                    f"{shape.nodes} x {shape.gpus_per_node} = {world} GPUs, TP {tp} x PP {pp} = {tp * pp}"
                    + (f", data parallel {world // (tp * pp)}" if world % (tp * pp) == 0 else " does not divide it"))]
    stage_ranks = world // pp if world % pp == 0 else None
    checks.append(Check("EP fits the data-parallel layout", bool(stage_ranks) and stage_ranks % ep == 0,
                        f"a pipeline stage has {world} / PP {pp} = {world / pp:g} ranks; EP {ep} (expert TP 1) "
                        + ("divides them" if stage_ranks and stage_ranks % ep == 0 else "must divide them")))
    for field, label in (("num_attention_heads", "DSA heads"), ("linear_num_heads", "KDA heads"),
                         ("index_n_heads", "indexer heads")):
        heads = getattr(config, field)
        checks.append(Check(f"{label} divisible by TP", heads % tp == 0, f"{heads} heads / TP {tp}"
                            + (f" = {heads // tp} a rank" if heads % tp == 0 else " leaves a remainder")))
    experts = config.n_routed_experts
    checks.append(Check("routed experts divisible by EP", experts % ep == 0, f"{experts} experts / EP {ep}"
                        + (f" = {experts // ep} a rank" if experts % ep == 0 else " leaves a remainder")))
    split, split_check = _pipeline(config, shape, first, last)
    checks.append(split_check)
    if split is not None:
        checks.append(_stage_topk_check(config, split))
    return checks


def _pipeline(config, shape: Shape, first: int | None, last: int | None):
    """-> (layers per stage or None, the "pipeline split" Check); `first` / `last` default to the shape's."""
    first = first if first is not None else shape.first_stage_layers
    last = last if last is not None else shape.last_stage_layers
    try:
        split = pipeline_split(config.num_hidden_layers, shape.pp, first, last)
    except ValueError as err:
        return None, Check("pipeline split", False, str(err))
    flags = "".join(f" --decoder-{end}-pipeline-num-layers {n}" for end, n in (("first", first), ("last", last)) if n)
    return split, Check("pipeline split", True, f"{config.num_hidden_layers} layers over PP {shape.pp}: "
                                                f"{' / '.join(map(str, split))}{flags}")


def _stage_topk_check(config, split) -> Check:
    """With DSA index sharing, a "shared" layer reuses the top-k of the DSA layer before it, which
    must live on the same stage: the first DSA layer of every stage must compute its own."""
    starts, bad = [], []
    start = 0
    for stage, n in enumerate(split):
        dsa = [i for i in range(start, start + n) if config.layer_types[i] == "indexed_attention"]
        if dsa:
            starts.append(dsa[0])
            if config.indexer_types[dsa[0]] == "shared":
                bad.append(f"stage {stage} (layers {start}-{start + n - 1}) begins its DSA layers on layer "
                           f"{dsa[0]}, which shares the top-k of a layer on stage {stage - 1}")
        start += n
    sharing = any(t == "shared" for t in config.indexer_types)
    if bad:
        return Check("every stage computes its own top-k", False, "; ".join(bad))
    detail = f"first DSA layer of each stage: {', '.join(map(str, starts))}, all compute their own top-k"
    return Check("every stage computes its own top-k", True, detail + ("" if sharing else " (no index sharing)"))


# ---- cluster ----------------------------------------------------------------------------------
def cluster_check(shape: Shape, inventory) -> Check:
    """inventory: nodes as glmkit.launch.cluster.inventory returns them (`alive`, `gpus`); dead
    nodes (Ray keeps listing them) do not count."""
    alive = [n for n in inventory if n.get("alive", True)]
    fits = [n for n in alive if n.get("gpus", 0) >= shape.gpus_per_node]
    total = sum(n.get("gpus", 0) for n in alive)
    ok = len(fits) >= shape.nodes
    return Check("the cluster has the GPUs", ok,
                 f"{len(alive)} live node(s) of {len(inventory)}, {total} GPUs; {len(fits)} node(s) with >= "
                 f"{shape.gpus_per_node} GPUs, {shape.nodes} needed")


# ---- memory -----------------------------------------------------------------------------------
def _dense_and_expert(shapes: dict) -> tuple[int, int]:
    """Parameter counts of {name: shape}: (everything but the routed experts, the routed experts)."""
    dense = expert = 0
    for name, dims in shapes.items():
        size = math.prod(dims)
        if ".experts." in name:
            expert += size
        else:
            dense += size
    return dense, expert


def stage_parameters(config, shape: Shape, split) -> list[dict]:
    """Per stage: dense, expert and (first/last stage) embedding / LM-head parameter counts."""
    from glmkit.checkpoint.names import layer_tensors

    stages, start = [], 0
    for stage, n in enumerate(split):
        dense = expert = 0
        for i in range(start, start + n):
            d, e = _dense_and_expert(layer_tensors(config, i))
            dense, expert = dense + d, expert + e
        vocab = config.vocab_size * config.hidden_size
        embed = vocab if stage == 0 else 0
        head = vocab if stage == len(split) - 1 and not config.tie_word_embeddings else 0
        stages.append({"stage": stage, "layers": n, "dense": dense, "expert": expert, "embed": embed, "head": head})
        start += n
    return stages


def memory_check(config, shape: Shape, split, gpu_mem_gib: float, max_tokens_per_gpu: int = 8192) -> Check:
    tp, pp, ep, dp = shape.tp, shape.pp, shape.ep, max(1, shape.dp)
    expert_dp = max(1, shape.world // pp // ep)
    worst = None
    for s in stage_parameters(config, shape, split):
        dense = (s["dense"] + s["embed"] + s["head"]) / tp
        expert = s["expert"] / ep
        weights = 2 * (dense + expert)
        if shape.lora:
            grads = optim = 0.0
        else:
            grads = 4 * (dense + expert)
            optim = 12 * (dense / dp + expert / expert_dp)
        tokens = max_tokens_per_gpu
        D = config.hidden_size
        kept = s["layers"] * tokens * config.hc_mult * D * 2 / tp
        moe = tokens * config.num_experts_per_tok * (D + 2 * config.moe_intermediate_size) * 2 if s["expert"] else 0
        working = 24 * tokens * D * 2 + moe
        total = weights + grads + optim + kept + working
        if worst is None or total > worst[0]:
            worst = (total, s, weights, grads, optim, kept, working)
    total, s, weights, grads, optim, kept, working = worst
    trainer = (f"trainer, stage {s['stage']} ({s['layers']} layers): weights {weights / GIB:.1f} + grads "
               f"{grads / GIB:.1f} + Adam {optim / GIB:.1f} + kept inputs {kept / GIB:.1f} + recomputed layer "
               f"{working / GIB:.1f} = {total / GIB:.1f} GiB")
    engine = _engine_weights(config, shape)
    rollout = f"engine weights {engine / GIB:.1f} GiB (TP {shape.engine_tp} / EP {shape.engine_ep}), the rest KV cache"
    budget = HEADROOM * gpu_mem_gib * GIB
    ok = total <= budget and engine <= budget
    return Check("memory per GPU", ok, f"{trainer}; {rollout}; limit {HEADROOM:.0%} of {gpu_mem_gib:.0f} GiB "
                 f"= {budget / GIB:.1f} GiB")


def _engine_weights(config, shape: Shape) -> float:
    from glmkit.checkpoint.names import expected_tensors

    dense, expert = _dense_and_expert(expected_tensors(config))
    return 2 * (dense / shape.engine_tp + expert / shape.engine_ep)


def preflight(config, shape: Shape, inventory=None, gpu_mem_gib: float | None = None,
              max_tokens_per_gpu: int = 8192, first: int | None = None, last: int | None = None) -> list[Check]:
    checks = layout_checks(config, shape, first, last)
    if inventory is not None:
        checks.append(cluster_check(shape, inventory))
        if gpu_mem_gib is None:
            mems = [n["gpu_memory_gib"] for n in inventory if n.get("gpu_memory_gib") and n.get("alive", True)]
            gpu_mem_gib = min(mems) if mems else None
    split, _ = _pipeline(config, shape, first, last)
    if gpu_mem_gib and split is not None:
        checks.append(memory_check(config, shape, split, gpu_mem_gib, max_tokens_per_gpu))
    elif not gpu_mem_gib:
        checks.append(Check("memory per GPU", False, "GPU memory unknown: give gpu_mem_gib or a cluster inventory"))
    return checks


# ---- paths ------------------------------------------------------------------------------------
MODEL_LAYERS = {"GLM-5.3-Flash": 45, "GLM-5.3-Flash-4layer": 4}


def hf_checkpoint_check(model: str, path) -> Check:
    """config.json: model_type glm5_next, the model's layer count; the indexer's index_kpool and
    index_topk are read from it and reported (never assumed: community ports differ)."""
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        return Check("HF checkpoint", False, f"{config_file} not found")
    try:
        config = json.loads(config_file.read_text())
    except (ValueError, RecursionError) as err:  # RecursionError: nested deeper than Python's parser goes
        return Check("HF checkpoint", False, f"{config_file} is not JSON: {str(err)[:80]}")
    if not isinstance(config, dict):
        return Check("HF checkpoint", False, f"{config_file} is not a JSON object")
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    problems, found = [], {}
    model_type = config.get("model_type")
    if model_type != "glm5_next":
        problems.append(f"model_type {model_type!r} (expected 'glm5_next')")
    for key in ("num_hidden_layers", "index_kpool", "index_topk"):
        if not isinstance(text.get(key), int):
            problems.append(f"{key} missing or not an integer")
        else:
            found[key] = text[key]
    want = MODEL_LAYERS.get(model)
    if want is not None and found.get("num_hidden_layers") not in (None, want):
        problems.append(f"num_hidden_layers {found['num_hidden_layers']} (a {model} checkpoint has {want})")
    if not any(path.glob("*.safetensors")):
        problems.append("no *.safetensors weights")
    detail = ", ".join(f"{k} {v}" for k, v in found.items())
    if problems:
        return Check("HF checkpoint", False, f"{path}: " + "; ".join(problems) + (f" (read: {detail})" if detail else ""))
    return Check("HF checkpoint", True, f"{path}: glm5_next, {detail}")


def torch_dist_check(model: str, ckpt_dir, layers: int | None = None) -> Check:
    """--ref-load = <ckpt-dir>/<megatron_model_type>_torch_dist: the tracker file names `release`
    or an iteration, that folder has `.metadata`, and the metadata names every decoder layer plus the
    embedding and the output layer. `.metadata` is a pickle: it is never unpickled here, only its
    bytes searched for the tensor-name prefixes (`decoder.layers.<i>.` with global layer numbers,
    `embedding.`, `output_layer.`)."""
    from glmkit.launch.commands import torch_dist_dir

    root = Path(torch_dist_dir(str(ckpt_dir), model))
    name = "reference checkpoint (--ref-load)"
    if not root.is_dir():
        return Check(name, False, f"{root} not found: run the conversion command first")
    tracker = root / "latest_checkpointed_iteration.txt"
    if not (tracker.exists() or tracker.is_symlink()):
        return Check(name, False, f"{tracker} not found (an interrupted conversion?)")
    try:
        mark = read_marker(tracker)
    except ValueError as err:
        return Check(name, False, str(err))
    if mark == "release":
        folder = root / "release"
    elif mark.isdigit():
        folder = root / f"iter_{int(mark):07d}"
    else:
        return Check(name, False, f"{tracker} says {mark[:40]!r}; expected 'release' or an iteration number")
    meta = folder / ".metadata"
    if not meta.is_file():
        return Check(name, False, f"{meta} not found: incomplete torch_dist directory")
    blob = meta.read_bytes()
    layers = layers if layers is not None else MODEL_LAYERS.get(model, 0)
    missing = [f"decoder.layers.{i}." for i in range(layers) if f"decoder.layers.{i}.".encode() not in blob]
    missing += [p for p in ("embedding.", "output_layer.") if p.encode() not in blob]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        return Check(name, False, f"{meta} names no tensors under {shown}")
    return Check(name, True, f"{folder}: tracker {mark!r}, .metadata covers {layers} layers, embedding and output")


def dataset_check(path, input_key: str = "prompt", label_key: str = "label", rows: int = 3) -> Check:
    """The dataset exists and its first rows are JSON objects with the input and label keys."""
    path = Path(path)
    if (why := not_a_file(path)) is not None:
        return Check("dataset", False, f"{path} " + ("not found" if why == "no such file" else why))
    seen = 0
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw)
            except (ValueError, RecursionError) as err:
                return Check("dataset", False, f"{path} line {number}: not JSON ({str(err)[:80]})")
            if not isinstance(row, dict) or input_key not in row or label_key not in row:
                keys = sorted(row)[:6] if isinstance(row, dict) else type(row).__name__
                return Check("dataset", False, f"{path} line {number}: needs keys {input_key!r} and {label_key!r} "
                                               f"(has {keys})")
            seen += 1
            if seen == rows:
                break
    if not seen:
        return Check("dataset", False, f"{path} has no rows")
    return Check("dataset", True, f"{path}: first {seen} rows parse with {input_key!r} and {label_key!r}")
