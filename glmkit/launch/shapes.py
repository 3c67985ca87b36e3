"""The recipe's parallel layouts, chosen as its launchers choose them, and the shapes its tables name.

The launchers (radixark/miles #2786 as merged, `scripts/run_glm5_3_flash.py`; the LoRA launcher
`scripts/run_glm5_3_flash_lora.py`) do not look a shape up in a table; they compute it:
- full launcher, GLM-5.3-Flash: only on 32 or 64 GPUs; TP 8, PP 4 split 11 / 11 / 11 / 12
  (`--decoder-first-pipeline-num-layers 11 --decoder-last-pipeline-num-layers 12`), EP = GPUs / 4,
  one SGLang engine per 8 GPUs (TP 8 / EP 8); activations at `--max-tokens-per-gpu 8192`, the trainer
  offloaded to disk;
- full launcher, GLM-5.3-Flash-4layer: only on 8 GPUs; TP 2, PP 2, EP 2, engines of 4 GPUs;
- LoRA launcher, either model: TP = `--tensor-model-parallel-size` (0: min(8, GPUs a node)), which must
  divide the GPUs; PP 1; EP = every GPU, which must divide the 288 experts; engines of
  `--rollout-num-gpus-per-engine` GPUs (0: a node's); `--max-tokens-per-gpu 16384`, offload to CPU.
Every launcher colocates (`--colocate`): the rollout uses all the trainer's GPUs, so there are
GPUs / engine-GPUs engines. Expert TP is 1 and CP 1 everywhere.

    recipe row                       nodes x GPUs  TP  PP  EP  engine GPUs  engines
    full-16x4       GLM-5.3-Flash     16 x 4        8   4  16   8            8
    full-8x4        GLM-5.3-Flash      8 x 4        8   4   8   8            4
    slice-2x4       ...-4layer         2 x 4        2   2   2   4            2
    slice-1x8       ...-4layer         1 x 8        2   2   2   4            2
    lora-full-3x8   GLM-5.3-Flash      3 x 8        8   1  24   8            3
    lora-slice-1x8  ...-4layer         1 x 8        8   1   8   8            1
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

FULL, SLICE = "GLM-5.3-Flash", "GLM-5.3-Flash-4layer"
MODELS = (FULL, SLICE)
ROUTED_EXPERTS = 288   # the LoRA launcher's own check uses this number for both models


@dataclass(frozen=True)
class Shape:
    name: str
    model: str
    nodes: int
    gpus_per_node: int
    tp: int
    pp: int
    ep: int
    engine_gpus: int                       # --rollout-num-gpus-per-engine (= SGLang TP = SGLang EP)
    lora: bool = False
    first_stage_layers: int | None = None  # --decoder-first-pipeline-num-layers, when the launcher sets it
    last_stage_layers: int | None = None   # --decoder-last-pipeline-num-layers
    max_tokens_per_gpu: int = 8192
    offload: str = "disk"                  # --offload-train-target

    @property
    def world(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def rollout_gpus(self) -> int:
        """Colocated: the rollout runs on every trainer GPU (the framework sets rollout_num_gpus so)."""
        return self.world

    @property
    def engines(self) -> int:
        return self.rollout_gpus // self.engine_gpus

    @property
    def engine_tp(self) -> int:
        return self.engine_gpus

    @property
    def engine_ep(self) -> int:
        return self.engine_gpus

    def as_dict(self) -> dict:
        return {**asdict(self), "world": self.world, "dp": self.dp, "rollout_gpus": self.rollout_gpus,
                "engines": self.engines, "engine_tp": self.engine_tp, "engine_ep": self.engine_ep}


class NoShape(ValueError):
    """The launcher would refuse the request; the message says why (in the launcher's terms)."""


def _positive(value, flag):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise NoShape(f"{flag} must be a positive integer, got {value!r}")


def full_layout(model: str, nodes: int, gpus_per_node: int) -> Shape:
    """The full launcher's layout (`scripts/run_glm5_3_flash.py`), or NoShape with its refusal."""
    if model not in MODELS:
        raise NoShape(f"--model-name {model!r}; allowed: {', '.join(MODELS)}")
    _positive(nodes, "--num-nodes")
    _positive(gpus_per_node, "--num-gpus-per-node")
    world = nodes * gpus_per_node
    name = f"{'full' if model == FULL else 'slice'}-{nodes}x{gpus_per_node}"
    if model == FULL:
        if world not in (32, 64):
            raise NoShape(f"the launcher validates the full-model layout on 32 or 64 GPUs; {nodes} x {gpus_per_node} "
                          f"= {world} (the recipe runs 16 x 4 and 8 x 4)")
        return Shape(name, model, nodes, gpus_per_node, tp=8, pp=4, ep=world // 4, engine_gpus=8,
                     first_stage_layers=11, last_stage_layers=12)
    if world != 8:
        raise NoShape(f"the launcher validates the 4-layer layout on 8 GPUs; {nodes} x {gpus_per_node} = {world} "
                      f"(the recipe runs 2 x 4 and 1 x 8)")
    return Shape(name, model, nodes, gpus_per_node, tp=2, pp=2, ep=2, engine_gpus=4)


def lora_layout(model: str, nodes: int, gpus_per_node: int, tensor_parallel: int = 0,
                engine_gpus: int = 0) -> Shape:
    """The LoRA launcher's layout (`scripts/run_glm5_3_flash_lora.py`; 0 = its own default for TP and
    the engine size), or NoShape with its refusal."""
    if model not in MODELS:
        raise NoShape(f"--model-name {model!r}; allowed: {', '.join(MODELS)}")
    _positive(nodes, "--num-nodes")
    _positive(gpus_per_node, "--num-gpus-per-node")
    for value, flag in ((tensor_parallel, "--tensor-model-parallel-size"), (engine_gpus, "--rollout-num-gpus-per-engine")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise NoShape(f"{flag} must be 0 (the launcher's default) or a positive integer, got {value!r}")
    world = nodes * gpus_per_node
    tp = tensor_parallel or min(8, gpus_per_node)
    if world % tp:
        raise NoShape(f"--tensor-model-parallel-size {tp} does not divide {nodes} x {gpus_per_node} = {world} GPUs")
    if ROUTED_EXPERTS % world:
        raise NoShape(f"the LoRA launcher sets EP to every GPU: expert parallel size {world} must divide "
                      f"{ROUTED_EXPERTS} experts")
    engine = engine_gpus or gpus_per_node
    if world % engine:
        raise NoShape(f"--rollout-num-gpus-per-engine {engine} does not divide the {world} rollout GPUs")
    name = f"lora-{'full' if model == FULL else 'slice'}-{nodes}x{gpus_per_node}"
    return Shape(name, model, nodes, gpus_per_node, tp=tp, pp=1, ep=world, engine_gpus=engine, lora=True,
                 max_tokens_per_gpu=16384, offload="cpu")


def pick_shape(model: str, nodes: int, gpus_per_node: int, lora: bool = False, **lora_options) -> Shape:
    """The layout the launcher (`lora`: the LoRA one) chooses for `model` on nodes x gpus_per_node."""
    if lora:
        return lora_layout(model, nodes, gpus_per_node, **lora_options)
    return full_layout(model, nodes, gpus_per_node)


# The shapes the recipe's tables name, each as its launcher lays it out.
SHAPES = (full_layout(FULL, 16, 4), full_layout(FULL, 8, 4), full_layout(SLICE, 2, 4), full_layout(SLICE, 1, 8),
          lora_layout(FULL, 3, 8), lora_layout(SLICE, 1, 8))


def table() -> list[dict]:
    return [s.as_dict() for s in SHAPES]


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
