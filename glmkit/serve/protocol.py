"""The subset of SGLang's native HTTP API that the recipe's framework uses, as schemas and encodings.

Requests are validated by these pydantic models (unknown fields refused, so a misspelt option is an
error rather than silently ignored). Answers follow SGLang's shapes:

    POST /generate -> {"text", "output_ids", "meta_info": {"id", "finish_reason": {"type": "stop" |
        "length" | "abort", ...}, "prompt_tokens", "completion_tokens", "cached_tokens", "weight_version",
        "output_token_logprobs": [[logprob, token_id, text], ...], "input_token_logprobs": [...],
        "routed_experts": base64(int32 [tokens, moe_layers, top_k]), "routed_experts_layers": [...],
        "indexer_topk": base64(int32 [tokens, dsa_layers, width]), "indexer_topk_num_layers",
        "indexer_topk_layers": [...]}}  (a list of these for a batched request)

`tokens` in routed_experts / indexer_topk are the fed tokens: the prompt and every sampled token but
the last (which is never fed). Log-probs are of softmax(logits / temperature) (temperature 0: of the
plain softmax), the distribution the rollout sampled from and the trainer recomputes. `*_layers` are
glmkit's additions: which model layers the middle axis holds.
"""

from __future__ import annotations

import base64
from typing import Annotated, Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

TokenIds = list[Annotated[int, Field(ge=0)]]


class SamplingParamsIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    temperature: float = Field(1.0, ge=0.0, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    max_new_tokens: int = Field(128, ge=0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list)
    sampling_seed: int | None = Field(None, ge=-(2 ** 63), le=2 ** 64 - 1)  # what torch.Generator takes


class GenerateRequest(BaseModel):
    """`text` or `input_ids`, each a single input or a batch (list)."""

    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = None
    input_ids: TokenIds | list[TokenIds] | None = None
    sampling_params: SamplingParamsIn | list[SamplingParamsIn] = Field(default_factory=SamplingParamsIn)
    return_logprob: bool = False
    logprob_start_len: int = Field(-1, ge=-1)
    return_routed_experts: bool = False
    return_indexer_topk: bool = False
    rid: str | list[str] | None = None
    stream: Literal[False] = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text and input_ids")
        return self

    @property
    def batched(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return len(self.input_ids) > 0 and isinstance(self.input_ids[0], list)

    def per_input(self, n: int, field_name: str):
        """A per-input field (sampling_params, rid) as a list of n values."""
        value = getattr(self, field_name)
        if isinstance(value, list):
            if len(value) != n:
                raise ValueError(f"{field_name} has {len(value)} entries for {n} inputs")
            return value
        return [value] * n


class GetWeightsByName(BaseModel):
    """SGLang's `/get_weights_by_name` request: a tensor name and how many leading rows to return."""

    name: str = Field(min_length=1, max_length=512)
    truncate_size: int = Field(100, ge=1)


class UpdateFromDisk(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_path: str
    load_format: str | None = None
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class UpdateFromTensor(BaseModel):
    """`serialized_named_tensors`: base64 of safetensors blobs (names = the model's parameter names).
    SGLang's own encoding is pickled CUDA IPC handles; pickle is never loaded here, so
    `load_format` must say "safetensors"."""

    model_config = ConfigDict(extra="forbid")

    serialized_named_tensors: list[str] = Field(min_length=1)
    load_format: Literal["safetensors"]
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False


class InitWeightsUpdateGroup(BaseModel):
    """The trainer is rank 0 of a new process group; this server joins as rank `rank_offset`."""

    model_config = ConfigDict(extra="forbid")

    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = "weight_update_group"
    backend: Literal["nccl", "gloo"] = "nccl"
    timeout_s: float = Field(300.0, gt=0, allow_inf_nan=False)


class UpdateFromDistributed(BaseModel):
    """Tensors broadcast from rank 0 of the weights-update group, in this order."""

    model_config = ConfigDict(extra="forbid")

    names: list[str] = Field(min_length=1)
    dtypes: list[str]
    shapes: list[list[Annotated[int, Field(ge=0)]]]
    group_name: str = "weight_update_group"
    weight_version: str | None = None
    flush_cache: bool = True
    abort_all_requests: bool = False

    @model_validator(mode="after")
    def _aligned(self):
        if not len(self.names) == len(self.dtypes) == len(self.shapes):
            raise ValueError(f"names, dtypes and shapes differ in length ({len(self.names)}, {len(self.dtypes)}, "
                             f"{len(self.shapes)})")
        return self


class AbortRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rid: str | None = None
    abort_all: bool = False


def encode_int32(array: torch.Tensor | np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(np.asarray(array, dtype=np.int32)).tobytes()).decode("ascii")


def stack_layers(per_layer: dict, layers: list, fill: int = -1) -> np.ndarray:
    """{layer: [tokens, w]} -> int32 [tokens, len(layers), max w] (narrower rows padded with `fill`)."""
    width = max(per_layer[layer].shape[1] for layer in layers)
    tokens = per_layer[layers[0]].shape[0]
    out = np.full((tokens, len(layers), width), fill, dtype=np.int32)
    for i, layer in enumerate(layers):
        rows = per_layer[layer]
        out[:, i, :rows.shape[1]] = np.asarray(rows, dtype=np.int32)
    return out


def finish_reason(kind: str, matched: int | None = None, length: int | None = None) -> dict:
    if kind == "stop":
        return {"type": "stop", "matched": matched}
    if kind == "length":
        return {"type": "length", "length": length}
    return {"type": "abort", "message": "aborted by request"}
