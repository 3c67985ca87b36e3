"""The recipe's parallel layouts as data, defined once, and how a run picks one.

    Shape            model                 nodes x GPUs  TP  PP  EP  rollout GPUs  engine TP / EP
    full-16x4        GLM-5.3-Flash          16 x 4        8   4  16   8             8 / 8
    full-8x4         GLM-5.3-Flash           8 x 4        8   4   8   8             8 / 8
    slice-2x4        GLM-5.3-Flash-4layer    2 x 4        2   2   2   4             4 / 4
    slice-1x8        GLM-5.3-Flash-4layer    1 x 8        2   2   2   4             4 / 4
    lora-full-3x8    GLM-5.3-Flash (LoRA)    3 x 8        8   1  24   24 (one 8-GPU engine a node)  8 / 8
    lora-slice-1x8   GLM-5.3-Flash-4layer (LoRA) 1 x 8    2   2   2   4             4 / 4

The PP-4 shapes run 11 / 11 / 11 / 12 layers per stage (`--decoder-last-pipeline-num-layers 12`).
Rollout is colocated with the trainer (the recipe's `--colocate`); expert tensor parallelism is 1,
so EP spans the data-parallel ranks of a pipeline stage. (The LoRA 4-layer launch names no layout
in the recipe; it reuses the slice's.)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Shape:
    name: str
    model: str
    nodes: int
    gpus_per_node: int
    tp: int
    pp: int
    ep: int
    rollout_gpus: int
    engine_tp: int
    engine_ep: int
    lora: bool = False
    last_stage_layers: int | None = None   # --decoder-last-pipeline-num-layers, when the split is uneven

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def engines(self) -> int:
        return self.rollout_gpus // self.engine_tp

    def as_dict(self) -> dict:
        return {**asdict(self), "world": self.world, "dp": self.dp, "engines": self.engines}


FULL, SLICE = "GLM-5.3-Flash", "GLM-5.3-Flash-4layer"
SHAPES = (
    Shape("full-16x4", FULL, 16, 4, tp=8, pp=4, ep=16, rollout_gpus=8, engine_tp=8, engine_ep=8, last_stage_layers=12),
    Shape("full-8x4", FULL, 8, 4, tp=8, pp=4, ep=8, rollout_gpus=8, engine_tp=8, engine_ep=8, last_stage_layers=12),
    Shape("slice-2x4", SLICE, 2, 4, tp=2, pp=2, ep=2, rollout_gpus=4, engine_tp=4, engine_ep=4),
    Shape("slice-1x8", SLICE, 1, 8, tp=2, pp=2, ep=2, rollout_gpus=4, engine_tp=4, engine_ep=4),
    Shape("lora-full-3x8", FULL, 3, 8, tp=8, pp=1, ep=24, rollout_gpus=24, engine_tp=8, engine_ep=8, lora=True),
    Shape("lora-slice-1x8", SLICE, 1, 8, tp=2, pp=2, ep=2, rollout_gpus=4, engine_tp=4, engine_ep=4, lora=True),
)
MODELS = (FULL, SLICE)


class NoShape(ValueError):
    """No row of the shape table fits the request; the message says why and lists the rows."""


def table() -> list[dict]:
    return [s.as_dict() for s in SHAPES]


def pick_shape(model: str, nodes: int, gpus_per_node: int, lora: bool = False) -> Shape:
    """The recipe's layout for `model` on nodes x gpus_per_node, or NoShape explaining why none fits."""
    if model not in MODELS:
        raise NoShape(f"unknown model {model!r}; allowed: {', '.join(MODELS)}")
    for value, flag in ((nodes, "--nodes"), (gpus_per_node, "--gpus-per-node")):
        if not isinstance(value, int) or value < 1:
            raise NoShape(f"{flag} must be a positive integer, got {value!r}")
    rows = [s for s in SHAPES if s.model == model and s.lora == lora]
    for s in rows:
        if (s.nodes, s.gpus_per_node) == (nodes, gpus_per_node):
            return s
    kind = "LoRA " if lora else ""
    have = ", ".join(f"{s.nodes} x {s.gpus_per_node} ({s.name})" for s in rows)
    world = nodes * gpus_per_node
    hint = ""
    if rows and world < min(s.world for s in rows):
        hint = f"; {world} GPUs are fewer than the smallest layout needs ({min(s.world for s in rows)})"
    raise NoShape(f"no {kind}layout of the recipe for {model} on {nodes} x {gpus_per_node} GPUs{hint}; "
                  f"the recipe has: {have}")


def pipeline_split(layers: int, pp: int, first: int | None = None, last: int | None = None) -> list[int]:
    """Layers per pipeline stage as Megatron derives them from `--decoder-first-pipeline-num-layers`
    / `--decoder-last-pipeline-num-layers`: the given end stages take their counts, the middle
    stages split the rest evenly (ValueError when it does not divide, or nothing is left)."""
    if pp < 1:
        raise ValueError(f"pipeline size must be >= 1, got {pp}")
    if pp == 1:
        if first not in (None, layers) or last not in (None, layers):
            raise ValueError(f"one pipeline stage holds all {layers} layers; first/last {first}/{last} disagree")
        return [layers]
    ends = [first, last]
    middle = pp - sum(e is not None for e in ends)
    rest = layers - sum(e or 0 for e in ends)
    if any(e is not None and e < 1 for e in ends) or rest < middle or (middle and rest % middle):
        raise ValueError(f"{layers} layers do not split over {pp} stages with first={first}, last={last}: "
                         f"{rest} layers left for {middle} middle stage(s)")
    if not middle and rest:
        raise ValueError(f"first={first} + last={last} over {pp} stages leaves {rest} layers unplaced")
    even = [rest // middle] * middle if middle else []
    return ([first] if first is not None else []) + even + ([last] if last is not None else [])
