"""SGLang's native HTTP API as `glmkit serve` speaks it (read from sglang 0.5.23: `io_struct.py`,
`sampling/sampling_params.py`, `entrypoints/http_server.py`, `api/v1/api_types.py`).

Requests. `/generate` takes every field of SGLang's `GenerateReqInput`; unknown top-level keys are
ignored, as SGLang ignores them. `sampling_params` takes every field of SGLang's `SamplingParams`
and refuses any other key (SGLang's contract check). JSON types are strict (a string "8" is not 8; a
float is a number, an int field takes no float or bool); `null` means the default. Ranges follow
`SamplingParams.verify()`. Fields glmkit honours are listed in `HONOURED_*`; a field it cannot honour
is accepted at its default and refused by name when set (`UNSUPPORTED_*`).

Error bodies, as SGLang writes them (status 400):
    a sampling key or type the contract refuses   {"error": "unknown field `x`, expected one of ..."}
    a value out of range, or a refused feature     {"error": {"message": "..."}}
    a body that is not a JSON object               {"object": "error", "message": ..., "type": "Bad Request",
                                                    "param": null, "code": 400}

Answers of `/generate`: {"text", "output_ids", "meta_info"} (a list of them for a batch or n > 1),
meta_info as SGLang orders it: id, finish_reason ({"type": "stop", "matched": token id | stop string},
{"type": "length", "length": n}, {"type": "abort", "message", "status_code", "err_type"}),
prompt_tokens, weight_version, num_retractions, [input_token_logprobs, output_token_logprobs as
[logprob, token_id, text or null]; input/output_top_logprobs], completion_tokens, cached_tokens,
cached_tokens_details, [routed_experts, indexer_topk, indexer_topk_num_layers], dp_rank,
e2e_latency.

`routed_experts`: base64 of little-endian int32 [rows, num_hidden_layers, num_experts_per_tok], rows =
prompt + completion tokens - 1 - routed_experts_start_len (every token that went through a forward; the
last sampled token never does), dense layers' rows 0 as SGLang's capture buffer leaves them.
`indexer_topk`: base64 int32 [prompt + completion - 1, DSA layers, index_topk], positions in the
sequence, -1 where fewer are selected; `indexer_topk_num_layers` says how many layers.
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field

import numpy as np
import torch


class RequestError(ValueError):
    """A request SGLang would refuse, with the body layout it would refuse it in."""

    def __init__(self, message: str, status: int = 400, layout: str = "message"):
        super().__init__(message)
        self.status, self.layout = status, layout

    def body(self) -> dict:
        if self.layout == "contract":
            return {"error": str(self)}
        if self.layout == "bad_request":
            return {"object": "error", "message": str(self), "type": "Bad Request", "param": None,
                    "code": self.status}
        return {"error": {"message": str(self)}}


def contract_error(message: str) -> RequestError:
    return RequestError(message, layout="contract")


# ---- JSON types, as SGLang's contract decoder checks them --------------------------------------
def _shown(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v[:80]}"'
    return {list: "sequence", dict: "map"}.get(type(v), type(v).__name__)


def _wrong(v, expected: str, where: str) -> RequestError:
    return contract_error(f"{where}: invalid type: {_shown(v)}, expected {expected}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _as_int(v, where: str) -> int:
    if _is_int(v):
        return v
    raise _wrong(v, "i64", where)


def _as_float(v, where: str) -> float:
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return float(v)
    raise _wrong(v, "f64", where)


def _as_bool(v, where: str) -> bool:
    if isinstance(v, bool):
        return v
    raise _wrong(v, "a boolean", where)


def _as_str(v, where: str) -> str:
    if isinstance(v, str):
        return v
    raise _wrong(v, "a string", where)


def _as_str_list(v, where: str) -> list[str]:
    if isinstance(v, str):
        return [v]
    if isinstance(v, list):
        return [_as_str(x, where) for x in v]
    raise _wrong(v, "a string or a sequence of strings", where)


def _as_int_list(v, where: str) -> list[int]:
    if not isinstance(v, list):
        raise _wrong(v, "a sequence of integers", where)
    return [_as_int(x, where) for x in v]


# ---- sampling_params ---------------------------------------------------------------------------
# Every key SGLang's SamplingParams takes, in its order; the kinds are its contract's.
SAMPLING_KEYS = ("max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
                 "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n",
                 "json_schema", "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
                 "spaces_between_special_tokens", "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed",
                 "custom_params", "beam_width", "watermark", "choice")
# Set to anything but null / their default, these are refused by name: glmkit has no grammar engine,
# no beam search, no watermarking and no custom sampling hooks.
UNSUPPORTED_SAMPLING = ("stop_regex", "json_schema", "regex", "ebnf", "structural_tag", "custom_params", "beam_width",
                        "watermark", "choice")
TOP_K_ALL = 1 << 30
MAX_TOP_LOGPROBS = 1000  # entries per position: bounds what one answer holds
GREEDY_BELOW = 1e-6  # SGLang's _SAMPLING_EPS
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 1 << 16  # of all a request's stop strings together


@dataclass(frozen=True)
class Sampling:
    """One request's sampling, resolved as SGLang's SamplingParams resolves it (greedy = top_k 1)."""

    max_new_tokens: int | None = 128
    stop: tuple = ()
    stop_token_ids: frozenset = frozenset()
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = TOP_K_ALL
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    n: int = 1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None
    logit_bias: tuple = ()  # ((token id, bias), ...)
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.top_k == 1

    @property
    def penalised(self) -> bool:
        return self.frequency_penalty != 0 or self.presence_penalty != 0 or self.repetition_penalty != 1


def parse_sampling(raw, vocab_size: int, where: str = "sampling_params") -> Sampling:
    """A JSON sampling_params object -> Sampling (contract check, then SGLang's normalisation and verify)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise _wrong(raw, "struct SamplingParams", where)
    kw = {}
    for key, v in raw.items():
        at = f"{where}.{key}"
        if key not in SAMPLING_KEYS:
            listed = ", ".join(f"`{k}`" for k in SAMPLING_KEYS)
            raise contract_error(f"{where}: unknown field `{key}`, expected one of {listed}")
        if v is None:
            if key == "max_new_tokens":
                kw[key] = None  # SGLang: no limit (the server clamps it to the context)
            continue  # null: the default
        if key in UNSUPPORTED_SAMPLING:
            if v in ([], {}, ""):
                continue
            raise RequestError(f"{at} is not supported by glmkit serve (it has no grammar, beam search, watermark "
                               f"or custom sampling hooks); leave it unset")
        if key in ("max_new_tokens", "top_k", "min_new_tokens", "n", "stream_interval", "sampling_seed"):
            kw[key] = _as_int(v, at)
        elif key in ("temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
            kw[key] = _as_float(v, at)
        elif key in ("ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"):
            kw[key] = _as_bool(v, at)
        elif key == "stop":
            kw[key] = tuple(_as_str_list(v, at))
        elif key == "stop_token_ids":
            kw[key] = frozenset(_as_int_list(v, at))
        elif key == "logit_bias":
            if not isinstance(v, dict):
                raise _wrong(v, "a map", at)
            kw[key] = tuple((k, _as_float(b, at)) for k, b in v.items())
    return _verified(kw, vocab_size, where)


def _verified(kw: dict, vocab_size: int, where: str) -> Sampling:
    temperature = kw.get("temperature", 1.0)
    if not math.isfinite(temperature) or temperature < 0:
        raise RequestError(f"temperature must be a non-negative finite number, got {temperature}.")
    top_k = kw.get("top_k", TOP_K_ALL)
    if 0 <= temperature < GREEDY_BELOW:  # SGLang samples greedily: temperature 1, top_k 1
        kw["temperature"], top_k = 1.0, 1
    if top_k == -1:
        top_k = TOP_K_ALL
    kw["top_k"] = top_k
    checks = [
        (0 < kw.get("top_p", 1.0) <= 1, f"top_p must be in (0, 1], got {kw.get('top_p')}."),
        (0 <= kw.get("min_p", 0.0) <= 1, f"min_p must be in [0, 1], got {kw.get('min_p')}."),
        (top_k >= 1, f"top_k must be -1 (disable) or at least 1, got {top_k}."),
        (-2 <= kw.get("frequency_penalty", 0.0) <= 2,
         f"frequency_penalty must be in [-2, 2], got {kw.get('frequency_penalty')}."),
        (-2 <= kw.get("presence_penalty", 0.0) <= 2,
         f"presence_penalty must be in [-2, 2], got {kw.get('presence_penalty')}."),
        (0 < kw.get("repetition_penalty", 1.0) <= 2,
         f"repetition_penalty must be in (0, 2] (1.0 = no penalty), got {kw.get('repetition_penalty')}."),
        (kw.get("min_new_tokens", 0) >= 0, f"min_new_tokens must be in [0, max_new_tokens], got {kw.get('min_new_tokens')}."),
        (kw.get("max_new_tokens", 128) is None or kw.get("max_new_tokens", 128) >= 0,
         f"max_new_tokens must be at least 0, got {kw.get('max_new_tokens')}."),
        (kw.get("n", 1) >= 1, f"n must be at least 1, got {kw.get('n')}."),
        (kw.get("stream_interval") is None or kw["stream_interval"] >= 1,
         f"stream_interval must be at least 1, got {kw.get('stream_interval')}."),
        (len(kw.get("stop", ())) <= MAX_STOP_STRINGS,
         f"at most {MAX_STOP_STRINGS} stop strings are allowed, got {len(kw.get('stop', ()))}"),
        (sum(map(len, kw.get("stop", ()))) <= MAX_STOP_CHARS,
         f"stop strings of {sum(map(len, kw.get('stop', ())))} characters in all; at most {MAX_STOP_CHARS} (each is "
         f"decoded against the output's tail at every step)"),
    ]
    for ok, message in checks:
        if not ok:
            raise RequestError(message)
    if kw.get("max_new_tokens", 128) is not None and kw.get("min_new_tokens", 0) > kw.get("max_new_tokens", 128):
        raise RequestError(f"min_new_tokens must be in [0, max_new_tokens({kw.get('max_new_tokens', 128)})], got "
                           f"{kw['min_new_tokens']}.")
    seed = kw.get("sampling_seed")
    if seed is not None and not -(2 ** 63) <= seed <= 2 ** 63 - 1:
        raise RequestError(f"sampling_seed must be in [-2**63, 2**63 - 1], got {seed}.")
    bias = []
    for key, value in kw.get("logit_bias", ()):
        try:
            token = int(key)
        except ValueError:
            token = -1
        if not 0 <= token < vocab_size:  # SGLang's own words
            raise RequestError(f"logit_bias must has keys in [0, {vocab_size - 1}], got {key}.")
        if not math.isfinite(value):  # a NaN bias makes every logit of the row NaN
            raise RequestError(f"{where}.logit_bias[{key!r}]: {value}; a bias must be a finite number")
        bias.append((token, value))
    kw["logit_bias"] = tuple(bias)
    bad_stop = [t for t in kw.get("stop_token_ids", ()) if not 0 <= t < vocab_size]
    if bad_stop:
        raise RequestError(f"{where}.stop_token_ids: token id {bad_stop[0]} is outside the vocabulary "
                           f"[0, {vocab_size})")
    if any(s == "" for s in kw.get("stop", ())):
        raise RequestError(f"{where}.stop: an empty stop string would end every request at once")
    return Sampling(**kw)


# ---- GenerateReqInput ----------------------------------------------------------------------------
# Top-level fields glmkit cannot honour: refused by name when set (SGLang's own messages where it
# refuses them on a server without the feature).
UNSUPPORTED_TOP = {
    "input_embeds": "input embeddings", "image_data": "multimodal input", "video_data": "multimodal input",
    "audio_data": "multimodal input", "session_params": "sessions", "session_id": "sessions",
    "token_ids_logprob": "log-probs of chosen token ids", "return_hidden_states": "hidden states",
    "bootstrap_host": "prefill/decode disaggregation", "bootstrap_port": "prefill/decode disaggregation",
    "bootstrap_room": "prefill/decode disaggregation", "bootstrap_pair_key": "prefill/decode disaggregation",
    "max_thinking_tokens": "strict thinking budgets", "return_sampling_mask": "sampling masks",
    "return_flat_raw_top_logprobs": "flat raw log-probs", "return_flat_raw_output_top_logprobs": "flat raw log-probs",
    "return_flat_raw_top_logprobs_b64": "flat raw log-probs", "return_entropy": "entropies",
    "positional_embed_overrides": "positional embedding overrides", "multi_item_delimiter_indices": "scoring",
    "token_indices_to_pool": "scoring", "encoder_urls": "encoder disaggregation",
}
# Accepted and without effect here, said in the README: glmkit keeps no prefix cache (extra_key,
# cache_salt), schedules first come first served (priority), logs no metrics (log_metrics, no_logs).
IGNORED_TOP = ("log_metrics", "no_logs", "priority", "extra_key", "cache_salt", "custom_labels", "routing_key",
               "conversation_id", "external_trace_header", "received_time", "return_bytes", "background",
               "modalities", "require_reasoning", "kv_hints", "decode_tp_size", "disagg_prefill_dp_rank")


@dataclass
class Input:
    """One sequence to generate for, after SGLang's batch / n expansion."""

    index: int
    rid: str
    prompt: list
    sampling: Sampling
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    return_indexer_topk: bool = False
    return_prompt_token_ids: bool = False


@dataclass
class Generate:
    inputs: list = field(default_factory=list)
    batched: bool = False
    stream: bool = False


def _per_input(raw, name: str, count: int, n: int, parse, default):
    """A field given once (applies to all) or as a list of one value per prompt."""
    value = raw.get(name)
    if value is None:
        return [default] * count
    if isinstance(value, list):
        if n > 1:
            raise RequestError(f"Cannot use list {name} with parallel_sample_num > 1")
        if len(value) != count:
            raise RequestError(f"{name} has {len(value)} entries for {count} inputs")
        return [default if v is None else parse(v, name) for v in value]
    return [parse(value, name)] * count


def parse_generate(raw, vocab_size: int, encode, new_rid, max_inputs: int | None = None) -> Generate:
    """A /generate body -> Generate. `encode(texts) -> token lists` tokenizes text inputs (as SGLang,
    with the tokenizer's special tokens); `new_rid()` makes a request id."""
    if not isinstance(raw, dict):
        raise RequestError(f"the body must be a JSON object (GenerateReqInput), got {_shown(raw)}",
                           layout="bad_request")
    for name, what in UNSUPPORTED_TOP.items():
        if raw.get(name) not in (None, False, [], {}, ""):
            raise RequestError(f"{name} is not supported by glmkit serve ({what}); leave it unset")
    if raw.get("lora_path") not in (None, [], ""):
        paths = raw["lora_path"] if isinstance(raw["lora_path"], list) else [raw["lora_path"]]
        if any(p is not None for p in paths):
            first = next(p for p in paths if p is not None)
            raise RequestError(f"LoRA adapter {first!r} was requested, but LoRA is not enabled (glmkit serve has "
                               f"no LoRA; push merged weights instead)")
    if raw.get("custom_logit_processor") not in (None, [], ""):
        raise RequestError("The server is not configured to enable custom logit processor (glmkit serve has none).")
    dp_rank = raw.get("routed_dp_rank", raw.get("data_parallel_rank"))
    if dp_rank not in (None, 0):
        raise RequestError(f"routed_dp_rank={dp_rank} out of range [0, 1)")

    text, ids = raw.get("text"), raw.get("input_ids")
    if text is None and ids is None:
        raise RequestError("Either text, input_ids or input_embeds should be provided.")
    if text is not None:  # SGLang: text wins when both are given
        if isinstance(text, str):
            prompts, batched = encode([text]), False
        elif isinstance(text, list) and all(isinstance(t, str) for t in text):
            prompts, batched = encode(text), True
        else:
            raise _wrong(text, "a string or a sequence of strings", "text")
    else:
        if not isinstance(ids, list):
            raise _wrong(ids, "a sequence of token ids", "input_ids")
        if not ids:
            raise RequestError("input_ids cannot be empty.")
        batched = not _is_int(ids[0])
        prompts = [_as_int_list(p, "input_ids") for p in ids] if batched else [_as_int_list(ids, "input_ids")]
    if batched and not prompts:
        raise RequestError("the batch is empty")
    for i, p in enumerate(prompts):
        if not p:
            raise RequestError(f"input {i} is empty" if batched else "input_ids cannot be empty.")
        bad = [t for t in p if not 0 <= t < vocab_size]
        if bad:
            raise RequestError(f"input {i} has token id {bad[0]} outside the vocabulary [0, {vocab_size})")
    count = len(prompts)

    raw_params = raw.get("sampling_params")
    if isinstance(raw_params, list):
        if len(raw_params) != count:
            raise RequestError(f"sampling_params has {len(raw_params)} entries for {count} inputs")
        params = [parse_sampling(p, vocab_size, f"sampling_params[{i}]") for i, p in enumerate(raw_params)]
    else:
        params = [parse_sampling(raw_params, vocab_size)] * count
    n = params[0].n
    if any(p.n != n for p in params):
        raise RequestError("The parallel_sample_num should be the same for all samples in sample params.")

    if max_inputs is not None and count * n > max_inputs:  # before anything is expanded
        raise RequestError(f"batch of {count * n} inputs (n included) is larger than this server's --max-batch-size "
                           f"{max_inputs}")
    flags = {name: _per_input(raw, name, count, n, parse, default) for name, parse, default in (
        ("return_logprob", _as_bool, False), ("logprob_start_len", _as_int, -1), ("top_logprobs_num", _as_int, 0))}
    return_text = _as_bool(raw.get("return_text_in_logprobs") or False, "return_text_in_logprobs")
    stream = _as_bool(raw.get("stream") or False, "stream")
    routed = _as_bool(raw.get("return_routed_experts") or False, "return_routed_experts")
    routed_start = _as_int(raw.get("routed_experts_start_len") or 0, "routed_experts_start_len")
    topk = _as_bool(raw.get("return_indexer_topk") or False, "return_indexer_topk")
    prompt_ids = _as_bool(raw.get("return_prompt_token_ids") or False, "return_prompt_token_ids")
    for i, (p, start, top) in enumerate(zip(prompts, flags["logprob_start_len"], flags["top_logprobs_num"])):
        if flags["return_logprob"][i] and start > len(p):
            raise RequestError(f"req.logprob_start_len={start} is higher than the number of input tokens "
                               f"len(req.origin_input_ids)={len(p)}. Please use a smaller logprob_start_len.")
        if start < -1:
            raise RequestError(f"logprob_start_len must be -1 or at least 0, got {start}")
        if not 0 <= top <= MAX_TOP_LOGPROBS:
            raise RequestError(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
        if routed and not 0 <= routed_start <= len(p):
            raise RequestError(f"routed_experts_start_len={routed_start} must be in [0, {len(p)}] (the prompt's length)")

    rids = _rids(raw.get("rid"), count, n, batched, new_rid)
    out = Generate(batched=batched or n > 1, stream=stream)
    for copy in range(n):  # SGLang's expansion: [p0, p1, ...] * n, then answers ordered prompt-major
        for i in range(count):
            out.inputs.append(Input(
                index=i * n + copy, rid=rids[copy * count + i], prompt=list(prompts[i]), sampling=params[i],
                return_logprob=flags["return_logprob"][i], logprob_start_len=flags["logprob_start_len"][i],
                top_logprobs_num=flags["top_logprobs_num"][i], return_text_in_logprobs=return_text,
                return_routed_experts=routed, routed_experts_start_len=routed_start, return_indexer_topk=topk,
                return_prompt_token_ids=prompt_ids))
    out.inputs.sort(key=lambda it: it.index)
    if len({it.rid for it in out.inputs}) != len(out.inputs):
        raise RequestError(f"Duplicate request IDs detected within the request: {[it.rid for it in out.inputs]}")
    return out


def _rids(rid, count: int, n: int, batched: bool, new_rid) -> list[str]:
    total = count * n
    if n > 1:  # SGLang gives every parallel sample a fresh id
        return [new_rid() for _ in range(total)]
    if rid is None:
        return [new_rid() for _ in range(total)]
    if isinstance(rid, str):
        return [rid] if not batched else [f"{rid}_{i}" for i in range(total)]
    if isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if len(rid) != count:
            raise RequestError("The specified rids length mismatch with the batch_size for batch processing.")
        return list(rid)
    raise RequestError("The rid should be a string or a list of strings.")


# ---- control bodies --------------------------------------------------------------------------------
def parse_body(raw, spec: dict, name: str) -> dict:
    """A control endpoint's body -> its fields with defaults. spec: field -> (kind, default), kind one of
    int, float, bool, str, 'str?', 'list[str]', 'list[str]?', 'list[list[int]]'; a default of ... is
    required. Unknown keys are ignored (SGLang's msgspec structs ignore them)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise RequestError(f"{name}: the body must be a JSON object, got {_shown(raw)}", layout="bad_request")
    out = {}
    for key, (kind, default) in spec.items():
        v = raw.get(key)
        if v is None:
            if default is ...:
                raise RequestError(f"{name}: missing required field `{key}`", layout="bad_request")
            out[key] = default
            continue
        at = f"{name}.{key}"
        if kind is int:
            out[key] = _as_int(v, at)
        elif kind is float:
            out[key] = _as_float(v, at)
        elif kind is bool:
            out[key] = _as_bool(v, at)
        elif kind in (str, "str?"):
            out[key] = _as_str(v, at)
        elif kind in ("list[str]", "list[str]?"):
            if not isinstance(v, list):
                raise _wrong(v, "a sequence of strings", at)
            out[key] = [_as_str(x, at) for x in v]
        elif kind == "list[list[int]]":
            if not isinstance(v, list):
                raise _wrong(v, "a sequence of shapes", at)
            out[key] = [_as_int_list(x, at) for x in v]
        else:
            raise AssertionError(kind)
    return out


def encode_int32(array) -> str:
    """SGLang's wire encoding of routed experts / indexer top-k: base64 of little-endian int32 bytes."""
    return base64.b64encode(np.ascontiguousarray(np.asarray(array, dtype="<i4")).tobytes()).decode("ascii")


def decode_int32(text: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(text), dtype="<i4")


def finish_reason(kind: str, matched=None, length: int | None = None, message: str | None = None) -> dict:
    if kind == "stop":
        return {"type": "stop", "matched": matched}
    if kind == "length":
        return {"type": "length", "length": length}
    return {"type": "abort", "message": message or "Aborted", "status_code": None, "err_type": None}


def bad_tensors(tensors: dict) -> list[str]:
    """Names of floating-point tensors holding NaN or Inf (a weight update carrying them is refused)."""
    return [name for name, t in tensors.items() if t.is_floating_point() and not bool(torch.isfinite(t).all())]
