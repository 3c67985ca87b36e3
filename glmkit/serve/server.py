"""`glmkit serve`: glmkit's rollout engine behind SGLang's native HTTP API (FastAPI + uvicorn).

The framework's rollout, startup probe, weight sync and offload calls (see protocol.py and the README's
endpoint table) are answered as SGLang answers them.

Scheduling (`Batcher`): one worker thread owns the model. Every generating request, whatever its
sampling settings, joins one `SlotBatch` between decode steps while slots are free and leaves it when
it finishes (continuous batching; each request samples with its own settings and random stream).
Requests with max_new_tokens 0 run as teacher-forced passes. Weight loads run on the worker between
batches, or between steps while generation is paused; process-group rendezvous and the transfers of
a distributed update run on threads of their own, so the engine keeps serving while they wait.

Weight updates: tensors are checked (names, shapes, dtypes, finite values) before any is written, so
a refused update leaves the weights as they were. `/update_weights_from_tensor` takes safetensors
blobs (never pickle); `/update_weights_from_disk` reads only directories under `--allow-updates-from`.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import itertools
import json
import logging
import os
import re
import resource
import signal
import socket
import sys
import threading
import time
import uuid
import warnings
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
from starlette.requests import Request as HttpRequest  # module level: FastAPI reads the annotations by name

from glmkit.inputs import not_a_file
from glmkit.report import json_safe
from glmkit.serve import protocol
from glmkit.serve.protocol import Input, RequestError
from glmkit.serve.sampling import RequestSampler, RequestState

DEFAULT_MAX_BATCH = 64
DEFAULT_MAX_CONTEXT = 65536  # prompt + new tokens of one request: bounds what one request can allocate
DEFAULT_MAX_PREFILL_TOKENS = 16384  # prompt tokens prefilled together (SGLang's --max-prefill-tokens default)
# Bytes of one request body. A /generate body of N token ids is about 7N bytes and parses into ~8x its size
# in Python objects, so the general bound is modest; weights sent as tensors get their own, larger one.
DEFAULT_MAX_BODY = 64 << 20
DEFAULT_MAX_WEIGHTS_BODY = 1 << 30
# A body that stops arriving holds a connection for ever (uvicorn has no body read timeout): after this
# many seconds without a byte the request is answered 408 and the connection closed.
DEFAULT_BODY_TIMEOUT_S = 60.0
# Headers that never end hold a connection for ever too (uvicorn has no header timeout either), and enough
# such connections exhaust the descriptors: each request's headers must arrive within this many seconds,
# and connections beyond the cap are answered 503 (see glmkit/serve/connections.py).
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 2048
# JSON may escape a UTF-16 surrogate (the body is read as strict UTF-8, so a surrogate's own bytes never
# get this far): a lone one decodes to a str no tokenizer or encoder accepts
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def answer_json(value) -> str:
    """An answer as JSON the way SGLang writes it (orjson): a non-finite float (a log-prob of weights
    that overflow) is null, never a 500 and never the NaN token strict JSON readers refuse."""
    compact = {"ensure_ascii": False, "separators": (",", ":"), "allow_nan": False}  # as orjson (and starlette)
    try:
        return json.dumps(value, **compact)
    except ValueError:
        return json.dumps(json_safe(value), **compact)


def _lone_surrogate(value, where: str = "the body"):
    """Where in a parsed body a string holds a lone surrogate (None if nowhere): keys and values."""
    stack = [(value, where)]
    while stack:
        item, at = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return at
        elif isinstance(item, dict):
            stack += [(k, f"{at} (a key)") for k in item] + [(v, f"{at}.{k}") for k, v in item.items()]
        elif isinstance(item, list):
            stack += [(v, f"{at}[{i}]") for i, v in enumerate(item)]
    return None
MAX_TOP_ENTRIES = 1 << 21  # top_logprobs_num x positions of one request (about 60 MB of JSON)
MAX_WEIGHT_ELEMENTS = 1 << 24  # /get_weights_by_name: one answer's floats (about 200 MB of JSON)
HEALTH_TIMEOUT_S = 20.0  # SGLang's default; its environment variable SGLANG_HEALTH_CHECK_TIMEOUT sets it
GROUP_TIMEOUT_S = 600.0  # rendezvous and transfers of a weights-update group, unless the body says timeout_s
MAX_WORLD_SIZE = (1 << 31) - 1
MAX_GROUP_OPERATIONS = 8  # weights-update group joins, transfers and teardowns waiting at once
MIN_SLOT_TOKENS = 256  # the shortest slot a batch opens (longer ones are powers of two up to --max-context)
PREFILL_ROWS = 8  # staging rows of a chunked prefill
CACHE_SHARE = 0.9  # of the memory free when a batch opens, what its decode caches may take (the rest: activations)
SHUTDOWN_GRACE_S = 5.0  # on SIGTERM, requests still running after this are cancelled
SHUTTING_DOWN = "the server is shutting down (SIGTERM or Ctrl-C): the request was ended; send it to a running server"
PARSE_INLINE_BYTES = 1 << 20  # bodies at least this large are parsed on a worker thread
MAX_CHARS_PER_TOKEN = 64  # a text input longer than --max-context x this cannot fit the context
PAUSE_MODES = ("abort", "retract", "in_place")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def cache_room(device: torch.device) -> float:
    """Bytes a batch's decode caches may take now: a share of the free memory (on a GPU, with what
    torch's allocator holds unused counted as free)."""
    from glmkit.bounds import free_bytes

    free = free_bytes(str(device))
    if device.type == "cuda":
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return CACHE_SHARE * free


class GroupThreads:
    """Runs weights-update group work (rendezvous, broadcasts, teardown) on daemon threads of its own.

    A join whose trainer never comes waits up to its timeout_s (a day at most) and cannot be
    interrupted: on asyncio's default executor a few of them would hold every worker the rest of the
    server needs, and the process would wait for them at shutdown. Here each runs on a daemon thread,
    at most `limit` at once; one more is refused by name."""

    def __init__(self, limit: int = MAX_GROUP_OPERATIONS):
        self.limit, self.running = limit, 0
        self.lock = threading.Lock()

    async def run(self, fn, *args):
        with self.lock:
            if self.running >= self.limit:
                raise RequestError(f"{self.running} weights-update group operations are waiting (at most "
                                   f"{self.limit} at once); retry when one has ended")
            self.running += 1
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(ok: bool, value):
            if not future.done():  # the request may have been cancelled meanwhile
                (future.set_result if ok else future.set_exception)(value)

        def work():
            try:
                ok, value = True, fn(*args)
            except BaseException as err:  # noqa: BLE001 - handed to the waiting request as its answer
                ok, value = False, err
            finally:
                with self.lock:
                    self.running -= 1
            try:
                loop.call_soon_threadsafe(settle, ok, value)
            except RuntimeError:  # the server's loop has closed: nobody is waiting
                pass

        threading.Thread(target=work, name="glmkit-update-group", daemon=True).start()
        return await future


class Request(RequestState):
    """One input of a /generate call on its way through the engine."""

    def __init__(self, inp: Input, seed: int, eos_ids, stop_window: int):
        super().__init__(inp.sampling, seed, eos_ids, stop_window, inp.top_logprobs_num if inp.return_logprob else 0)
        self.input, self.rid, self.prompt = inp, inp.rid, inp.prompt
        self.future = None
        self.chunks = None  # an asyncio.Queue of stream chunks (None: not streaming)
        self.sent = 0  # output tokens already streamed
        self.teacher = None  # {"input_logprobs": [...], "input_top": [...]} from the prefill
        self.prior_logprobs = []  # of self.prior, the tokens before a retraction
        self.retractions = 0
        self.answer = None
        self.started = time.time()

    @property
    def limit(self) -> int | None:
        return self.sampling.max_new_tokens

    @property
    def fed_prompt(self) -> list:
        """What a prefill takes: the prompt, and after a retraction the tokens generated so far."""
        return self.prompt + self.prior if self.prior else self.prompt

    @property
    def remaining(self) -> int:
        return self.limit - len(self.prior)

    def whole(self, c):
        """The completion as the client sees it: tokens from before a retraction, then the rest."""
        if not self.prior:
            return c
        from glmkit.model.rollout import Completion

        return Completion(prompt=list(self.prompt), tokens=self.prior + list(c.tokens),
                          logprobs=self.prior_logprobs + list(c.logprobs), finish_reason=c.finish_reason,
                          routing=c.routing, topk=c.topk)

    def key(self):
        """Requests that can share one batch: every generating request, or every teacher-forced one."""
        return self.limit == 0


PROMPT_LOGITS_BYTES = 1 << 28  # fp32 logits of one piece of a teacher-forced pass (~430 rows at vocab 154880)


def prompt_logprobs(head: torch.nn.Linear, hidden: torch.Tensor, prompts, temperatures, top_nums=None) -> list[dict]:
    """Final hidden states at every token of the packed prompts [T, D] -> per prompt, the log-prob of
    each token given the ones before it under softmax(logits / temperature) (None for the first
    token), and the top entries at each position where asked. The head runs over pieces of rows, so
    no more than PROMPT_LOGITS_BYTES of logits exist at once, whatever the prompts' length."""
    out, start = [], 0
    piece = max(1, PROMPT_LOGITS_BYTES // (4 * head.out_features))
    for i, (prompt, temperature) in enumerate(zip(prompts, temperatures)):
        k = min((top_nums or [0] * len(prompts))[i], head.out_features)
        ids = torch.tensor(prompt, device=hidden.device)
        picked, tops = [None], [None]
        for s in range(0, len(prompt) - 1, piece):  # rows s..e-1 predict tokens s+1..e
            e = min(len(prompt) - 1, s + piece)
            logp = torch.log_softmax(head(hidden[start + s:start + e]).float() / (temperature or 1.0), -1)
            picked += logp.gather(-1, ids[s + 1:e + 1, None])[:, 0].tolist()
            if k:
                values, idx = logp.topk(k)
                tops += [[[float(v), int(t)] for v, t in zip(vs, ts)] for vs, ts in zip(values.tolist(), idx.tolist())]
        entry = {"input_logprobs": picked}
        if k:
            entry["input_top"] = tops
        out.append(entry)
        start += len(prompt)
    return out


OUT_OF_MEMORY_HINT = (" (the batch did not fit the device's memory: the server keeps serving; send fewer or "
                      "shorter prompts together, or start it with a lower --max-prefill-tokens or "
                      "--max-batch-size, or --kda-backend fla on a GPU)")


def _failure_status(err: BaseException) -> int:
    """An engine failure's HTTP status: 503 when the batch ran out of memory (a capacity limit the
    client can retry under, not a bug), else 500."""
    return 503 if isinstance(err, (torch.OutOfMemoryError, MemoryError)) else 500


class EngineService:
    """The model, its engine, tokenizer and weight version; the methods that touch the model run on
    the worker thread."""

    def __init__(self, model, backends=None, tokenizer=None, model_path: str = "", tokenizer_path: str = "",
                 max_batch: int = DEFAULT_MAX_BATCH, update_roots=(), max_context: int = DEFAULT_MAX_CONTEXT,
                 prefill_chunk: int | None = None, eos_ids=(), server_args: dict | None = None, seed: int = 0,
                 max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS):
        from glmkit.model import RolloutEngine

        self.model, self.engine = model, RolloutEngine(model, backends)
        self.tokenizer, self.model_path, self.tokenizer_path = tokenizer, model_path, tokenizer_path
        self.max_batch, self.max_context = max_batch, max_context
        self.prefill_chunk, self.max_prefill_tokens = prefill_chunk, max_prefill_tokens
        self.update_roots = [Path(r).resolve() for r in update_roots]
        self.weight_version = "default"
        self.updates = 0
        self.batches_run = self.requests_run = 0
        self.groups = {}  # group name -> (ProcessGroup, backend)
        self.seeds = itertools.count(seed * 1_000_003 + 1)
        config = model.config
        self.num_layers = len(model.layers)
        self.moe_layers = [b.layer for b in model.layers if b.is_moe]
        self.dsa_layers = [b.layer for b in model.layers if b.kind == "dsa"]
        self.top_k, self.index_topk = config.num_experts_per_tok, config.index_topk
        self.vocab_size = config.vocab_size
        self.eos_ids = sorted(set(eos_ids))
        self.sampler = RequestSampler(tokenizer)
        self.server_args = server_args or {}
        self.session_open = False
        self.released = set()

    # ---- requests ------------------------------------------------------------------------------
    def encode(self, texts: list[str]) -> list[list[int]]:
        if self.tokenizer is None:
            raise RequestError("this server has no tokenizer (start it with --tokenizer DIR); send input_ids")
        limit = MAX_CHARS_PER_TOKEN * self.max_context
        for t in texts:  # refused before the tokenizer spends seconds and gigabytes on it
            if len(t) > limit:
                raise RequestError(f"text of {len(t)} characters: longer than any input of --max-context "
                                   f"{self.max_context} tokens ({limit} characters at {MAX_CHARS_PER_TOKEN} a token)")
        return [self.tokenizer.encode(t) for t in texts]

    def requests(self, raw) -> tuple[protocol.Generate, list[Request]]:
        gen = protocol.parse_generate(raw, self.vocab_size, self.encode, lambda: uuid.uuid4().hex, self.max_batch)
        if len(gen.inputs) > self.max_batch:
            raise RequestError(f"batch of {len(gen.inputs)} inputs (n included) is larger than this server's "
                               f"--max-batch-size {self.max_batch}")
        out = []
        for inp in gen.inputs:
            s = inp.sampling
            if s.stop and self.tokenizer is None:
                raise RequestError("stop strings are unavailable without a tokenizer (start the server with "
                                   "--tokenizer DIR), or use stop_token_ids")
            if len(inp.prompt) >= self.max_context:
                raise RequestError(f"The input ({len(inp.prompt)} tokens) is longer than the model's context length "
                                   f"({self.max_context} tokens).")
            if s.max_new_tokens is None:  # SGLang: unlimited, clamped to the context
                import dataclasses

                inp.sampling = s = dataclasses.replace(s, max_new_tokens=self.max_context - len(inp.prompt))
            if len(inp.prompt) + s.max_new_tokens > self.max_context:
                raise RequestError(
                    f"Requested token count exceeds the model's maximum context length of {self.max_context} tokens. "
                    f"You requested a total of {len(inp.prompt) + s.max_new_tokens} tokens: {len(inp.prompt)} tokens "
                    f"from the input messages and {s.max_new_tokens} tokens for the completion.")
            if inp.return_logprob and inp.top_logprobs_num:
                positions = s.max_new_tokens + (len(inp.prompt) - inp.logprob_start_len
                                                if 0 <= inp.logprob_start_len < len(inp.prompt) else 0)
                if positions * inp.top_logprobs_num > MAX_TOP_ENTRIES:
                    raise RequestError(f"top_logprobs_num {inp.top_logprobs_num} over {positions} positions asks for "
                                       f"{positions * inp.top_logprobs_num} entries; this server answers at most "
                                       f"{MAX_TOP_ENTRIES} per request (lower top_logprobs_num or max_new_tokens, "
                                       f"or raise logprob_start_len)")
            seed = s.sampling_seed if s.sampling_seed is not None else next(self.seeds)
            out.append(Request(inp, seed, self.eos_ids, self.sampler.stop_window(s)))
        return gen, out

    def run_prompt_only(self, items: list[Request]) -> None:
        """max_new_tokens 0: the teacher-forced pass alone; fills each item's answer."""
        from glmkit.model.rollout import Completion

        self.batches_run += 1
        self.requests_run += len(items)
        passes = self.prompt_pass(items)
        for it, teacher in zip(items, passes):
            it.teacher = teacher
            self.finish(it, Completion(prompt=list(it.prompt), finish_reason="length",
                                       routing=teacher["routing"], topk=teacher["topk"]))

    def check_cache_fits(self) -> None:
        """At start: one request at --max-context, and --max-batch-size requests at the smallest slot
        length, must each fit their decode caches in the memory free now; refused with the numbers."""
        device, room = self.model.device, cache_room(self.model.device)
        one = self.engine.cache_bytes(1, self.max_context)
        if one > room:
            raise ValueError(f"--max-context {self.max_context}: one request's decode cache at that length needs "
                             f"{one / 2**30:.3g} GiB and {device} has {room / 2**30:.3g} GiB for caches; lower "
                             f"--max-context")
        shortest = min(self.max_context, MIN_SLOT_TOKENS)
        every = self.engine.cache_bytes(self.max_batch, shortest)
        if every > room:
            raise ValueError(f"--max-batch-size {self.max_batch}: that many requests of {shortest} tokens need "
                             f"{every / 2**30:.3g} GiB of decode cache and {device} has {room / 2**30:.3g} GiB for "
                             f"caches; lower --max-batch-size")

    def open_slots(self, waiting: list[Request], cancelled):
        """A SlotBatch of --max-batch-size slots (fewer when the memory free now holds fewer), each as
        long as the longest of `waiting` needs (a power of two, at most --max-context); every request
        samples with its own settings."""
        from glmkit.model.rollout import SamplingParams, SlotBatch

        need = max(len(it.fed_prompt) + it.remaining for it in waiting)
        capacity = min(self.max_context, max(MIN_SLOT_TOKENS, 1 << (need - 1).bit_length()))
        per_slot = self.engine.cache_bytes(1, capacity)
        staging = min(self.max_batch, PREFILL_ROWS) if self.prefill_chunk else 0
        room = cache_room(self.model.device)
        slots = min(self.max_batch, int(room // per_slot) - staging)
        if slots < 1:
            raise RequestError(f"a request of {need} tokens needs {(1 + staging) * per_slot / 2**30:.3g} GiB of decode "
                               f"cache and {self.model.device} has {room / 2**30:.3g} GiB for caches now; lower "
                               f"max_new_tokens or shorten the prompt, or retry later", status=503)
        self.batches_run += 1
        return SlotBatch(self.engine, slots, capacity, SamplingParams(), record_routing=True,
                         record_topk=True, cancelled=cancelled, prefill_chunk=self.prefill_chunk,
                         prefill_rows=PREFILL_ROWS, sampler=self.sampler)

    def admit(self, slots, items: list[Request]) -> None:
        """Prefill `items` into free slots (their teacher-forced log-probs from the same prefill)."""
        self.requests_run += len(items)
        wants = [it.input.return_logprob and it.input.logprob_start_len >= 0 and it.teacher is None for it in items]
        prompts = [it.fed_prompt for it in items]

        def teacher_forced(hidden):
            passes = prompt_logprobs(self.model.lm_head, hidden, prompts, [it.sampling.temperature for it in items],
                                     [it.input.top_logprobs_num if want else 0 for it, want in zip(items, wants)])
            for it, want, teacher in zip(items, wants, passes):
                if want:  # a retracted request's prefill covers its tokens too: the prompt's part
                    it.teacher = {k: v[:len(it.prompt)] for k, v in teacher.items()}

        slots.join(prompts, [it.remaining for it in items], items, prompt_rows=teacher_forced if any(wants) else None)

    @torch.no_grad()
    def prompt_pass(self, items: list[Request]) -> list[dict]:
        """Teacher-forced pass over whole prompts: log-prob of each token given the ones before it
        (None for the first), and the experts / DSA positions each token chose."""
        from glmkit.model.packed import Packed

        prompts = [it.prompt for it in items]
        lengths = [len(p) for p in prompts]
        packed = Packed.from_lengths(lengths, device="cpu")
        seen = {}

        def record(layer, site, value):
            if site in ("router_experts", "indexer_topk"):
                seen[(layer, site)] = value.cpu()

        passes = []

        def teacher_forced(hidden):
            passes.extend(prompt_logprobs(self.model.lm_head, hidden, prompts, [it.sampling.temperature for it in items],
                                          [it.input.top_logprobs_num for it in items]))

        self.engine.prefill(prompts, max(lengths), rows=teacher_forced, record=record)
        out = []
        for (s, e), teacher in zip(packed.bounds(), passes):
            teacher["routing"] = {layer: v[s:e] for (layer, site), v in seen.items() if site == "router_experts"}
            teacher["topk"] = {layer: torch.where(v[s:e] >= 0, v[s:e] - s, v[s:e]) for (layer, site), v in seen.items()
                               if site == "indexer_topk"}
            out.append(teacher)
        return out

    # ---- answers -------------------------------------------------------------------------------
    def decode(self, tokens: list, it: Request) -> str:
        if self.tokenizer is None or not tokens:
            return ""
        return self.tokenizer.decode(tokens, skip_special_tokens=it.sampling.skip_special_tokens)

    def final_text(self, it: Request, tokens: list) -> str:
        """The answer's text as SGLang's detokenizer trims it: up to the matched stop string, or without
        the matched stop token, unless no_stop_trim."""
        matched, keep = it.matched, it.sampling.no_stop_trim
        if isinstance(matched, int) and not keep:
            tokens = tokens[:-1]
        text = self.decode(tokens, it)
        if isinstance(matched, str):
            at = text.find(matched)
            if at >= 0:
                text = text[:at + len(matched)] if keep else text[:at]
        return text

    def triple(self, it: Request, logprob, token: int) -> list:
        text = self.tokenizer.decode([token]) if it.input.return_text_in_logprobs and self.tokenizer else None
        return [logprob, int(token), text]

    def meta(self, it: Request, c, finished: bool) -> dict:
        """meta_info in SGLang's key order."""
        tokens = list(c.tokens)
        inp = it.input
        if not finished:
            reason = None
        elif c.finish_reason == "abort":
            reason = protocol.finish_reason("abort")
        elif c.finish_reason == "stop":
            reason = protocol.finish_reason("stop", matched=it.matched)
        else:
            reason = protocol.finish_reason("length", length=len(tokens))
        meta = {"id": it.rid, "finish_reason": reason, "prompt_tokens": len(it.prompt),
                "weight_version": self.weight_version, "num_retractions": it.retractions}
        if inp.return_logprob:
            teacher = it.teacher or {}
            if inp.logprob_start_len >= 0 and "input_logprobs" in teacher:
                start = inp.logprob_start_len
                picked = [None, *teacher["input_logprobs"][start + 1:]] if start < len(it.prompt) else []
                meta["input_token_logprobs"] = [self.triple(it, lp, t) for lp, t in zip(picked, it.prompt[start:])]
            else:
                meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = [self.triple(it, float(lp), t) for lp, t in zip(c.logprobs, tokens)]
            if inp.top_logprobs_num > 0:
                tops = teacher.get("input_top")
                start = max(inp.logprob_start_len, 0)
                meta["input_top_logprobs"] = ([None] + [[self.triple(it, lp, t) for lp, t in row]
                                                        for row in tops[start + 1:]]
                                              if tops and inp.logprob_start_len >= 0 and start < len(it.prompt) else [])
                meta["output_top_logprobs"] = [[self.triple(it, lp, t) for lp, t in row] for row in it.top]
        meta.update(completion_tokens=len(tokens), cached_tokens=0, cached_tokens_details=None)
        if finished and inp.return_routed_experts:
            meta["routed_experts"] = self.routed_experts(c, it, len(tokens))
        if finished and inp.return_indexer_topk and self.dsa_layers:
            meta["indexer_topk"] = self.indexer_topk(c, it, len(tokens))
            meta["indexer_topk_num_layers"] = len(self.dsa_layers)
        meta["dp_rank"] = 0
        if finished:
            meta["e2e_latency"] = time.time() - it.started
        return meta

    def rows(self, it: Request, completion_tokens: int) -> int:
        """Tokens that went through a forward: the prompt and the sampled tokens but the last."""
        return max(0, len(it.prompt) + completion_tokens - 1)

    def routed_experts(self, c, it: Request, completion_tokens: int) -> str:
        """[rows - start, num_hidden_layers, top_k] int32, dense layers' rows 0 (SGLang's zero-filled buffer)."""
        import numpy as np

        rows = self.rows(it, completion_tokens)
        out = np.zeros((rows, self.num_layers, self.top_k), dtype=np.int32)
        for layer, ids in (c.routing or {}).items():
            got = ids[:rows].numpy()
            out[:len(got), layer, :got.shape[1]] = got
        return protocol.encode_int32(out[it.input.routed_experts_start_len:])

    def indexer_topk(self, c, it: Request, completion_tokens: int) -> str:
        """[rows, DSA layers, index_topk] int32 sequence positions, -1 where fewer are selected."""
        import numpy as np

        rows = self.rows(it, completion_tokens)
        width = max([self.index_topk] + [v.shape[1] for v in (c.topk or {}).values()])
        out = np.full((rows, len(self.dsa_layers), width), -1, dtype=np.int32)
        for i, layer in enumerate(self.dsa_layers):
            got = (c.topk or {}).get(layer)
            if got is not None:
                got = got[:rows].numpy()
                out[:len(got), i, :got.shape[1]] = got
        return protocol.encode_int32(out)

    def answer(self, it: Request, c, finished: bool = True) -> dict:
        c = it.whole(c)
        tokens = list(c.tokens)
        text = self.final_text(it, tokens) if finished else _whole_chars(self.decode(tokens, it))
        out = {"text": text, "output_ids": tokens, "meta_info": self.meta(it, c, finished)}
        if it.input.return_prompt_token_ids:
            out["prompt_token_ids"] = list(it.prompt)
        return out

    def finish(self, it: Request, completion) -> None:
        it.answer = self.answer(it, completion)

    # ---- weights -------------------------------------------------------------------------------
    def own_name(self, name: str) -> str:
        """A tensor name as the checkpoint (`model.language_model.layers.N...`), SGLang and the framework
        (`model.layers.N...`) or glmkit's model (`layers.N...`) spell it -> the model's state-dict name."""
        from glmkit.checkpoint.names import LM_HEAD

        return name if name == LM_HEAD else name.removeprefix("model.").removeprefix("language_model.")

    def check_tensors(self, tensors: dict) -> dict:
        """Named tensors -> {state-dict name: tensor}, every one checked against the model (name, shape,
        floating dtype, finite values) before any is written: a refused update changes nothing."""
        params = {**self.model.state_dict(keep_vars=True), **dict(self.model.named_parameters())}
        mapped = {}
        for name, value in tensors.items():
            own = self.own_name(name)
            if own not in params:
                raise RequestError(f"tensor {name!r} is not a parameter of this model")
            if tuple(value.shape) != tuple(params[own].shape):
                raise RequestError(f"tensor {name!r} has shape {list(value.shape)}; the model's is "
                                   f"{list(params[own].shape)}")
            if not (value.dtype.is_floating_point and params[own].dtype.is_floating_point):
                raise RequestError(f"tensor {name!r} has dtype {value.dtype}; expected a floating-point tensor "
                                   f"(the model's is {params[own].dtype})")
            # checked as the model will hold it: a float64 1e300 is finite, and Inf once cast to float32
            mapped[own] = value.to(params[own].dtype)
        bad = protocol.bad_tensors(mapped)
        if bad:
            given = {self.own_name(name): name for name in tensors}
            raise RequestError(f"{len(bad)} tensor(s) hold NaN or Inf in the model's dtype (a value past its range "
                               f"becomes Inf), e.g. {given.get(bad[0], bad[0])!r}: update refused, the weights are "
                               f"unchanged")
        return mapped

    def load_tensors(self, tensors: dict, version: str | None) -> str:
        mapped = self.check_tensors(tensors)
        params = {**self.model.state_dict(keep_vars=True), **dict(self.model.named_parameters())}
        with torch.no_grad():
            for name, value in mapped.items():
                params[name].copy_(value)
        self.updates += 1
        if version is not None:
            self.weight_version = version
        return f"updated {len(mapped)} tensor(s)"

    def weights_by_name(self, name: str, truncate_size: int) -> list:
        """SGLang's answer layout: the tensor as float32 nested lists, cut to its first `truncate_size`
        entries along dim 0."""

        state = {**self.model.state_dict(keep_vars=True), **dict(self.model.named_parameters())}
        own = self.own_name(name)
        if own not in state:
            raise RequestError(f"Get parameter by name failed: {name!r} is not a tensor of this model")
        tensor = state[own].detach()
        rows = tensor[:truncate_size] if tensor.dim() else tensor
        if rows.numel() > MAX_WEIGHT_ELEMENTS:
            raise RequestError(f"Get parameter by name failed: {rows.numel()} elements asked for; at most "
                               f"{MAX_WEIGHT_ELEMENTS} per request (lower truncate_size)")
        rows = rows.float().cpu()
        if bool(rows.isfinite().all()):
            return rows.tolist()
        return json_safe(rows.tolist())  # NaN and inf are not JSON: null, as SGLang's orjson writes them

    def join_group(self, body: dict) -> str:
        """Join the trainer's weights-update group (the trainer is rank 0 and hosts the rendezvous);
        runs on a thread of its own, not the engine's."""
        from glmkit.serve.update_group import new_named_group

        name = body["group_name"]
        if name in self.groups:
            raise RequestError(f"Failed to initialize custom process group: group {name!r} exists (destroy it first).")
        if body["backend"] not in ("nccl", "gloo"):
            raise RequestError(f"Failed to initialize custom process group: backend {body['backend']!r}; allowed: "
                               f"nccl, gloo.")
        if not 1 <= body["rank_offset"] < body["world_size"]:
            raise RequestError(f"Failed to initialize custom process group: rank_offset {body['rank_offset']} must "
                               f"be in [1, world_size {body['world_size']}).")
        if body["backend"] == "nccl" and self.model.device.type != "cuda":
            raise RequestError(f"Failed to initialize custom process group: backend nccl needs the model on a GPU; "
                               f"this server's is on {self.model.device} (use gloo).")
        if body["backend"] == "nccl":
            torch.cuda.set_device(self.model.device.index or 0)
        try:  # this server has one rank (TP 1): it joins as rank_offset
            group = new_named_group(body["backend"], body["master_address"], body["master_port"],
                                    body["world_size"], body["rank_offset"], name, body["timeout_s"])
        except Exception as err:  # noqa: BLE001 - any rendezvous failure is the caller's answer
            raise RequestError(f"Failed to initialize custom process group: {err}.") from None
        self.groups[name] = (group, body["backend"])
        return "Succeeded to initialize custom process group."

    def destroy_group(self, name: str) -> str:
        from glmkit.serve.update_group import destroy_named_group

        if name not in self.groups:
            raise RequestError("The group to be destroyed does not exist.")
        group, _ = self.groups.pop(name)
        destroy_named_group(group)
        return "Succeeded to destroy custom process group."

    def receive(self, body: dict) -> dict:
        """The tensors rank 0 broadcasts, in the announced order; on a thread of its own."""
        import torch.distributed as dist

        name = body["group_name"]
        if name not in self.groups:
            raise RequestError(f"no weights-update group {name!r} (call /init_weights_update_group first)")
        group, backend = self.groups[name]
        device = self.model.device if backend == "nccl" else torch.device("cpu")
        tensors = {}
        for tensor_name, dtype, shape in zip(body["names"], body["dtypes"], body["shapes"]):
            kind = getattr(torch, dtype.removeprefix("torch."), None)
            if not isinstance(kind, torch.dtype):
                raise RequestError(f"tensor {tensor_name!r}: unknown dtype {dtype!r}")
            tensors[tensor_name] = torch.empty(shape, dtype=kind, device=device)
        handles = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors.values()]
        for h in handles:
            h.wait()
        return tensors

    def tensors_from_blobs(self, blobs: list[str]) -> dict:
        from safetensors.torch import load

        tensors = {}
        for i, blob in enumerate(blobs):
            try:
                tensors.update(load(base64.b64decode(blob, validate=True)))
            except Exception as err:  # noqa: BLE001 - any decoding failure is the client's bad input
                raise RequestError(f"serialized_named_tensors[{i}] is not base64 of a safetensors blob: {err}") from None
        return tensors

    def tensors_from_disk(self, path: str) -> dict:
        try:
            directory = Path(path).resolve()
        except (ValueError, OSError) as err:  # a NUL byte, a loop of links
            raise RequestError(f"{path!r}: not a usable path ({err})") from None
        if not any(directory == root or root in directory.parents for root in self.update_roots):
            raise RequestError(f"{path} is not under a directory this server may read updates from "
                               f"(start it with --allow-updates-from DIR)")
        if not directory.is_dir():
            raise RequestError(f"{path} is not a directory")
        try:
            return self._read_dir(directory)
        except RequestError:
            raise
        except Exception as err:  # noqa: BLE001 - an unreadable update is the client's bad input, said whole
            raise RequestError(f"{path}: {err}") from None

    @staticmethod
    def _read_dir(directory: Path) -> dict:
        from safetensors import safe_open

        outside = [f.name for f in directory.iterdir() if f.is_symlink() and f.resolve().parent != directory]
        if outside:  # a checkpoint's files are read by name: none of them may lead out of the allowed root
            raise RequestError(f"{', '.join(sorted(outside)[:3])} points outside {directory}")
        if (directory / "config.json").is_file():
            from glmkit.checkpoint import open_checkpoint

            return dict(open_checkpoint(directory).state_dict())
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise RequestError(f"{directory} holds no *.safetensors file")
        for f in files:  # a FIFO's open blocks in safetensors holding the GIL: the whole server would stop
            if (why := not_a_file(f)) is not None:
                raise RequestError(f"{f.name}: {why}; a weights file must be a regular file")
        tensors = {}
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    tensors[name] = handle.get_tensor(name)
        return tensors


def _whole_chars(text: str) -> str:
    """Streamed text grows by whole characters: a trailing incomplete byte sequence is held back."""
    return text.rstrip("\ufffd")


@dataclass
class _Call:
    fn: object
    args: tuple
    future: asyncio.Future


class Batcher:
    """The worker thread: runs, in arrival order, calls on the model (weight loads) and batches of
    generation. A batch opens slots for the waiting requests and, between decode steps, admits every
    waiting request while slots are free (continuous batching); each answer is sent the moment its
    request finishes, and streamed requests get a chunk every `stream_interval` tokens. A waiting
    call stops admissions and runs when the batch has drained, or at once while generation is
    paused (SGLang's pause_generation: the requests hold their slots and go on after continue)."""

    def __init__(self, service: EngineService, window_s: float = 0.005):
        self.service, self.window_s = service, window_s
        self.pending: deque = deque()
        self.cond = threading.Condition()
        self.cancelled: set = set()
        self.running: dict = {}  # rid -> Request, admitted and not yet answered
        self.paused, self.pause_mode = False, None
        self.held = threading.Event()  # set once the worker has paused (and retracted or aborted)
        self.in_batch = False
        self.loop = None
        self.stopped = False
        self.closing = False  # SIGTERM: running requests are ended and answered 503, new ones refused
        self.exit_signal = None  # the signal that began the shutdown
        self.thread = threading.Thread(target=self._work, name="glmkit-engine", daemon=True)

    def start(self):
        self.loop = asyncio.get_running_loop()
        self.thread.start()

    def stop(self):
        with self.cond:
            self.stopped = True
            self.cond.notify_all()

    def shutdown(self):
        """The server is going down: every request ends at its next step (answered 503 by its handler),
        and the worker leaves once the batch has drained, so no thread is inside the model at exit."""
        self.closing = True
        self.abort(None, True)
        with self.cond:
            calls = [it for it in self.pending if isinstance(it, _Call)]
            for call in calls:
                self.pending.remove(call)
        for call in calls:  # a weight update still waiting for the batch to drain
            self._settle(call.future, error=RequestError(SHUTTING_DOWN, status=503))
        self.stop()

    def join(self, timeout_s: float) -> bool:
        if self.thread.is_alive():
            self.thread.join(timeout_s)
        return not self.thread.is_alive()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and not self.stopped

    def submit(self, items: list[Request], stream: bool = False) -> list:
        if self.closing:
            raise RequestError(SHUTTING_DOWN, status=503)
        with self.cond:
            busy = set(self.running) | {it.rid for it in self.pending if isinstance(it, Request)}
        taken = [it.rid for it in items if it.rid in busy]
        if taken:  # SGLang refuses an id already in flight
            raise RequestError(f"Duplicate request ID detected: {taken[0]}")
        for it in items:
            it.future = self.loop.create_future()
            if stream:
                it.chunks = asyncio.Queue()
        with self.cond:
            self.pending.extend(items)
            self.cond.notify_all()
        return [it.future for it in items]

    async def call(self, fn, *args):
        """Run fn on the worker thread, between batches (or between steps while paused)."""
        if self.closing:
            raise RequestError(SHUTTING_DOWN, status=503)
        future = self.loop.create_future()
        with self.cond:
            self.pending.append(_Call(fn, args, future))
            self.cond.notify_all()
        return await future

    def abort(self, rid: str | None, abort_all: bool, exact: bool = False) -> int:
        """Cancel requests whose id starts with `rid` (SGLang matches by prefix), or all. Waiting ones are
        answered at once; running ones at their next step, with what they have."""
        with self.cond:
            waiting = [it for it in self.pending if isinstance(it, Request)]
            hit = lambda r: abort_all or (rid is not None and rid != "" and (r == rid if exact  # noqa: E731
                                                                                else r.startswith(rid)))
            dropped = [it for it in waiting if hit(it.rid)]
            for it in dropped:
                self.pending.remove(it)
            targets = {r for r in self.running if hit(r)}
            self.cancelled |= targets
            self.cond.notify_all()
        for it in dropped:
            self._answer_unstarted(it)
        return len(dropped) + len(targets)

    def pause(self, mode: str) -> threading.Event:
        """SGLang's pause_generation: "abort" ends every request (answered with what it has), "retract"
        takes the running ones out of their slots (they are prefilled again on continue, with the
        weights of then), "in_place" keeps them in their slots. New requests wait. -> an event set
        when the worker has paused."""
        if mode == "abort":
            self.abort(None, True)
        with self.cond:
            self.paused, self.pause_mode = True, mode
            self.held.clear()
            if not self.in_batch:
                self.held.set()
            self.cond.notify_all()
        return self.held

    def resume(self) -> None:
        with self.cond:
            self.paused = False
            self.cond.notify_all()

    @property
    def busy(self) -> bool:
        """Requests hold slots, or wait while generation runs (SGLang's flush_cache refuses then; while
        paused, waiting and retracted requests do not count)."""
        with self.cond:
            return bool(self.running) or (not self.paused and any(isinstance(it, Request) for it in self.pending))

    # ---- the worker thread -------------------------------------------------------------------------
    def _settle(self, future, value=None, error=None):
        def done():
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(value)
        self.loop.call_soon_threadsafe(done)

    def _push(self, it: Request, chunk):
        if it.chunks is not None:
            self.loop.call_soon_threadsafe(it.chunks.put_nowait, chunk)

    def _answer_unstarted(self, it: Request):
        """A request aborted before it ran: SGLang's "Abort in waiting queue" answer."""
        from glmkit.model.rollout import Completion

        answer = self.service.answer(it, Completion(prompt=list(it.prompt), finish_reason="abort"))
        answer["meta_info"]["finish_reason"]["message"] = "Abort in waiting queue"
        self._deliver(it, answer)

    def _deliver(self, it: Request, answer: dict):
        it.answer = answer
        self._push(it, answer)
        self._push(it, None)
        self._settle(it.future, answer)

    def _take_same(self, key, limit: int) -> list[Request]:
        """Up to `limit` waiting requests with `key`, in order, not past a waiting call nor a waiting
        request of the other kind (a teacher-forced one waits for the batch to drain, never longer),
        and no more prompt tokens than --max-prefill-tokens (the first request is always taken: one
        prompt is bounded by --max-context)."""
        taken, tokens = [], 0
        with self.cond:
            for it in list(self.pending):
                if isinstance(it, _Call) or len(taken) == limit or it.key() != key:
                    break
                tokens += len(it.fed_prompt)
                if taken and tokens > self.service.max_prefill_tokens:
                    break
                self.pending.remove(it)
                taken.append(it)
            self.running.update({it.rid: it for it in taken})
        return taken

    def _run_calls(self) -> None:
        """Every waiting call, in order (they may pass waiting requests: generation is paused)."""
        while True:
            with self.cond:
                call = next((it for it in self.pending if isinstance(it, _Call)), None)
                if call is None:
                    return
                self.pending.remove(call)
            self._run_call(call)

    def _run_call(self, call: _Call) -> None:
        try:
            self._settle(call.future, call.fn(*call.args))
        except Exception as err:  # noqa: BLE001 - the caller's request gets the error
            self._settle(call.future, error=err)

    def _hold_while_paused(self, slots=None) -> None:
        """While generation is paused: retract or abort what holds slots (by the pause's mode, read again
        each round, so a second pause with another mode takes effect), then run the calls that come
        (weight loads) until continue. Not paused: nothing (a waiting call runs when the batch has
        drained, as SGLang's weight updates wait for the requests in flight)."""
        while True:
            with self.cond:
                if not self.paused or self.stopped:
                    return
                mode = self.pause_mode
            if slots is not None and mode in ("abort", "retract"):
                self._evict(slots, mode)
            self.held.set()
            self._run_calls()
            with self.cond:
                if self.paused and not self.stopped and not any(isinstance(it, _Call) for it in self.pending):
                    self.cond.wait(0.5)

    def _evict(self, slots, mode: str) -> None:
        evicted = slots.evict_all()
        for it, c in evicted:
            if mode == "abort":
                c.finish_reason = "abort"
                self.service.finish(it, c)
                self._deliver(it, it.answer)
                continue
            it.prior += c.tokens
            it.prior_logprobs += c.logprobs
            it.retractions += 1
        with self.cond:
            for it, _ in evicted:
                self.running.pop(it.rid, None)
            if mode == "retract":  # first in line again, in their order
                self.pending.extendleft(reversed([it for it, _ in evicted]))

    def _work(self):
        while True:
            with self.cond:
                while not self.pending and not self.stopped:
                    self.cond.wait()
                if self.stopped:
                    return
                paused, first = self.paused, self.pending[0]
                # a batch starting now counts as running for pause(): it acknowledges at its first step
                self.in_batch = not paused and not isinstance(first, _Call)
            if paused:
                self._hold_while_paused()
                continue
            if isinstance(first, _Call):
                with self.cond:
                    self.pending.popleft()
                self._run_call(first)
                continue
            time.sleep(self.window_s)  # let requests sent together arrive together
            self._run_batch(first.key())

    def _run_batch(self, key):
        service, batch, slots = self.service, [], None
        self.in_batch = True
        try:
            if key:  # max_new_tokens 0: a teacher-forced pass, no slots
                batch = self._take_same(key, service.max_batch)
                service.run_prompt_only(batch)
                for it in batch:
                    self._deliver(it, it.answer)
                return
            with self.cond:
                waiting = [it for it in self.pending if isinstance(it, Request) and it.key() == key]
            try:
                slots = service.open_slots(waiting, lambda it: it.rid in self.cancelled)
            except Exception:  # answered below with the error, not left queued to be retried forever
                batch = self._take_same(key, len(waiting))
                raise
            closed = False  # once a request does not fit these slots, it waits first in line for the next batch
            while True:
                fits = []
                for it in ([] if closed or self.paused else self._take_same(key, slots.free)):
                    if not closed and len(it.fed_prompt) + it.remaining <= slots.capacity:
                        fits.append(it)
                        continue
                    closed = True
                    with self.cond:
                        self.pending.appendleft(it)
                        self.running.pop(it.rid, None)
                if fits:
                    batch += fits
                    service.admit(slots, fits)  # samples each one's first token: some may end here
                self._after_step(slots)
                if not slots.busy:
                    return
                self._hold_while_paused(slots)
                slots.step()
                self._after_step(slots)
        except Exception as err:  # noqa: BLE001 - every request of the batch learns why
            for it in batch:
                status = _failure_status(err)
                self._push(it, {"error": {"message": f"generation failed: {type(err).__name__}: {err}"
                                          + (OUT_OF_MEMORY_HINT if status == 503 else ""),
                                          "type": "internal_error", "code": status, "retryable": status == 503}})
                self._push(it, None)
                self._settle(it.future, error=err)
        finally:
            self.in_batch = False
            self._release(batch)

    def _after_step(self, slots):
        for item, completion in slots.finished():
            self.service.finish(item, completion)
            self._deliver(item, item.answer)
            self._release([item])
        for item, completion in slots.live():
            total = len(item.prior) + len(completion.tokens)
            if item.chunks is None or total <= item.sent:
                continue
            interval = item.sampling.stream_interval or 1
            if item.sent == 0 or total - item.sent >= interval:
                item.sent = total
                self._push(item, self.service.answer(item, completion, finished=False))

    def _release(self, items):
        with self.cond:
            for it in items:
                self.running.pop(it.rid, None)
                self.cancelled.discard(it.rid)


def build_app(service: EngineService, window_s: float = 0.005, max_body: int = DEFAULT_MAX_BODY,
              max_weights_body: int = DEFAULT_MAX_WEIGHTS_BODY, body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S):
    from contextlib import asynccontextmanager

    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

    batcher = Batcher(service, window_s)
    group_threads = GroupThreads()
    health_timeout_s = _env_seconds("SGLANG_HEALTH_CHECK_TIMEOUT", HEALTH_TIMEOUT_S)

    @asynccontextmanager
    async def lifespan(app):
        batcher.start()
        yield
        batcher.shutdown()
        if not await asyncio.to_thread(batcher.join, SHUTDOWN_GRACE_S):
            # a step longer than the grace (a long prompt's prefill) still runs on the worker: the
            # interpreter's exit under it would abort the process (SIGABRT); leave without waiting
            sig = batcher.exit_signal or signal.SIGTERM
            how = "terminated" if sig == signal.SIGTERM else "interrupted"
            print(f"glmkit serve: {how} (the engine was inside a step longer than the {SHUTDOWN_GRACE_S:g} s "
                  f"grace; its request was answered 503)", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(128 + sig)

    # no /docs or /redoc: FastAPI's pages load their scripts from a CDN (the schema stays at /openapi.json)
    app = FastAPI(title="glmkit serve (SGLang native API)", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.batcher = batcher

    @app.exception_handler(RequestError)
    async def refused(request: HttpRequest, exc: RequestError):
        return JSONResponse(exc.body(), status_code=exc.status)

    async def body_of(request: HttpRequest, weights: bool = False):
        """The JSON body, at most --max-body-bytes (--max-weights-body-bytes for tensors; 413 naming the
        limit), each piece within --body-timeout-s of the last (408); {} when empty."""
        limit, flag = (max_weights_body, "--max-weights-body-bytes") if weights else (max_body, "--max-body-bytes")
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise RequestError(f"request body of {int(declared)} bytes exceeds this server's limit of {limit} bytes "
                               f"({flag})", status=413)
        from starlette.requests import ClientDisconnect

        data = bytearray()
        loop = asyncio.get_running_loop()
        try:
            # one deadline moved on by each piece (not a task per piece: a body sent a byte at a time
            # would otherwise keep the event loop, and /health with it, busy)
            async with asyncio.timeout(body_timeout_s) as deadline:
                async for piece in request.stream():
                    deadline.reschedule(loop.time() + body_timeout_s)
                    data += piece
                    if len(data) > limit:
                        raise RequestError(f"request body exceeds this server's limit of {limit} bytes ({flag})",
                                           status=413)
        except TimeoutError:
            raise RequestError(f"no part of the request body arrived for {body_timeout_s:g} s "
                               f"(--body-timeout-s); {len(data)} bytes had arrived", status=408) from None
        except ClientDisconnect:  # the client left mid-body: nothing to answer, nothing to log as a fault
            raise RequestError("the client disconnected before sending the whole body", status=400) from None
        if not data.strip():
            return {}
        try:  # read as UTF-8 only (as SGLang's orjson): json.loads would take UTF-16 / 32 and surrogates' bytes
            text = data.decode("utf-8")
        except UnicodeDecodeError as err:
            raise RequestError(f"the body is not UTF-8 text (byte {err.start}: {err.reason}); JSON bodies are "
                               f"sent as UTF-8", layout="bad_request") from None
        try:  # a large body is parsed off the event loop, which keeps answering meanwhile
            body = json.loads(text) if len(text) < PARSE_INLINE_BYTES else await asyncio.to_thread(json.loads, text)
        except (ValueError, RecursionError) as err:
            raise RequestError(f"the body is not valid JSON: {err}", layout="bad_request") from None
        if _SURROGATE_ESCAPE.search(text) and (where := _lone_surrogate(body)) is not None:
            raise RequestError(f"the body holds a lone UTF-16 surrogate (an escape such as \\ud800 without its pair) "
                               f"at {where}: not a Unicode string", layout="bad_request")
        return body

    def outcome(success: bool, message: str, status: int | None = None, **extra):
        return JSONResponse({"success": success, "message": message, **extra},
                            status_code=status or (200 if success else 400))

    async def weight_step(work, *args, **extra):
        """A weight-update endpoint's answer: {"success", "message"} with 200, or 400 and the reason."""
        try:
            return outcome(True, await work(*args), **extra)
        except RequestError as err:
            return outcome(False, str(err), err.status, **extra)
        except asyncio.CancelledError:  # the server shut down while the step waited (a group's rendezvous)
            return outcome(False, SHUTTING_DOWN, 503, **extra)
        except Exception as err:  # noqa: BLE001 - a failed transfer or allocation: the weights are unchanged
            return outcome(False, f"{type(err).__name__}: {err}", **extra)

    # ---- health and information ---------------------------------------------------------------
    @app.get("/health")
    async def health():
        return Response(status_code=200 if batcher.alive else 503)

    @app.get("/health_generate")
    async def health_generate():
        """200 only when a token was generated within 20 s (SGLang's health check), else 503."""
        if not batcher.alive:
            return Response(status_code=503)
        gen, items = service.requests({"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                                       "rid": f"HEALTH_CHECK_{uuid.uuid4().hex}"})
        futures = batcher.submit(items)
        try:
            await asyncio.wait_for(asyncio.shield(futures[0]), health_timeout_s)
        except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - any failure to generate is unhealthy
            batcher.abort(items[0].rid, False, exact=True)
            return Response(status_code=503)
        return Response(status_code=200)

    def model_info():
        return {"model_path": service.model_path, "served_model_name": service.server_args.get("served_model_name"),
                "tokenizer_path": service.tokenizer_path, "is_generation": True, "preferred_sampling_params": None,
                "weight_version": service.weight_version, "load_format": "auto", "reasoning_parser": None,
                "tool_call_parser": None, "disaggregation_mode": "null", "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": "glm5_next",
                "architectures": [type(service.model).__name__]}

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info():
        return model_info()

    @app.get("/get_weight_version")
    async def get_weight_version():  # older SGLang; the framework falls back to it
        return {"weight_version": service.weight_version}

    def server_info():
        args = dict(service.server_args)
        args.update(model_path=service.model_path, tokenizer_path=service.tokenizer_path,
                    max_running_requests=service.max_batch, context_length=service.max_context,
                    max_prefill_tokens=service.max_prefill_tokens)
        return {**args, "status": "ready", "max_total_num_tokens": service.max_batch * service.max_context,
                "max_req_input_len": service.max_context - 1,
                "internal_states": [{**args, "engine_batches": service.batches_run,
                                     "engine_requests": service.requests_run}],
                "version": f"glmkit-serve {_version()}", "frontend": "glmkit"}

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info():
        return server_info()

    @app.get("/v1/models")
    async def models():
        name = service.server_args.get("served_model_name") or service.model_path
        return {"object": "list", "data": [{"id": name, "object": "model", "created": int(service.server_args.get(
            "started", 0)), "owned_by": "sglang", "root": name, "parent": None, "max_model_len": service.max_context}]}

    # ---- generation ------------------------------------------------------------------------------
    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: HttpRequest):
        raw = await body_of(request)
        try:  # tokenizing texts and stop strings: off the event loop, which keeps answering /health
            gen, items = await asyncio.to_thread(service.requests, raw)
        except RequestError as err:
            if err.layout == "message" and isinstance(raw, dict) and raw.get("stream") is True:
                return StreamingResponse(_stream_error(err), media_type="text/event-stream")
            raise
        if gen.stream:
            batcher.submit(items, stream=True)
            return StreamingResponse(_stream(request, items, gen.batched), media_type="text/event-stream")
        futures = batcher.submit(items)
        gathered = asyncio.gather(*futures)
        while True:  # a client that goes away has its requests cancelled
            try:
                done, _ = await asyncio.wait({gathered}, timeout=0.25)
            except asyncio.CancelledError:  # the shutdown's grace ran out inside one long step
                return JSONResponse({"error": {"message": SHUTTING_DOWN}}, status_code=503)
            if done:
                break
            if await request.is_disconnected():
                for it in items:
                    batcher.abort(it.rid, False, exact=True)
                return Response(status_code=499)
        if batcher.closing:
            return JSONResponse({"error": {"message": SHUTTING_DOWN}}, status_code=503)
        try:
            answers = gathered.result()
        except RequestError:
            raise
        except Exception as err:  # noqa: BLE001 - an engine failure is answered, and the server goes on
            status = _failure_status(err)
            return JSONResponse({"error": {"message": f"generation failed: {type(err).__name__}: {err}"
                                           + (OUT_OF_MEMORY_HINT if status == 503 else "")}}, status_code=status)
        return Response(answer_json(answers if gen.batched else answers[0]), media_type="application/json")

    async def _stream_error(err: RequestError):
        payload = {"error": {"message": str(err), "type": "invalid_request_error", "code": err.status,
                             "retryable": False}}
        yield f"data: {json.dumps(payload)}\n\n"
        yield "data: [DONE]\n\n"

    async def _stream(request: HttpRequest, items: list[Request], batched: bool):
        """Server-sent events: cumulative text, output_ids and meta_info per chunk ("index" per input of a
        batch), then `data: [DONE]`."""
        open_items = {i: it for i, it in enumerate(items)}
        queues = {i: asyncio.ensure_future(it.chunks.get()) for i, it in open_items.items()}
        try:
            while queues:
                done, _ = await asyncio.wait(set(queues.values()), timeout=0.25, return_when=asyncio.FIRST_COMPLETED)
                if not done and await request.is_disconnected():
                    return
                for i in [i for i, q in queues.items() if q in done]:
                    chunk = queues.pop(i).result()
                    if chunk is None:
                        open_items.pop(i)
                        continue
                    queues[i] = asyncio.ensure_future(items[i].chunks.get())
                    if batched:
                        chunk = {**chunk, "index": i}
                    yield f"data: {answer_json(chunk)}\n\n"
            if batcher.closing:  # the last chunks say "abort": say why, as a stream's error chunk does
                yield f"data: {json.dumps({'error': {'message': SHUTTING_DOWN, 'type': 'service_unavailable', 'code': 503, 'retryable': True}})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            for q in queues.values():
                q.cancel()
            for it in open_items.values():
                if it.answer is None:
                    batcher.abort(it.rid, False, exact=True)

    @app.post("/abort_request")
    async def abort_request(request: HttpRequest):
        body = protocol.parse_body(await body_of(request), {"rid": (str, ""), "abort_all": (bool, False)},
                                   "abort_request")
        batcher.abort(body["rid"] or None, body["abort_all"])
        return Response(status_code=200)

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        if batcher.busy:
            return PlainTextResponse("Flush cache failed.\n", status_code=400)
        return PlainTextResponse("Cache flushed.\nPlease check backend logs for more details. (When there are running "
                                 "or waiting requests, the operation will not be performed.)\n")

    @app.post("/pause_generation")
    async def pause_generation(request: HttpRequest):
        body = protocol.parse_body(await body_of(request), {"mode": (str, "abort")}, "pause_generation")
        if body["mode"] not in PAUSE_MODES:
            raise RequestError(f"pause_generation: mode {body['mode']!r}; allowed: {', '.join(PAUSE_MODES)}")
        held = batcher.pause(body["mode"])
        if not await asyncio.to_thread(held.wait, 60.0):  # until the step running now has ended
            return JSONResponse({"error": {"message": "generation did not pause within 60 s"}}, status_code=503)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(request: HttpRequest):
        await body_of(request)
        batcher.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    async def memory(request: HttpRequest, release: bool):
        body = protocol.parse_body(await body_of(request), {"tags": ("list[str]?", None)}, "memory_occupation")
        tags = body["tags"] if body["tags"] is not None else list(MEMORY_TAGS)
        unknown = [t for t in tags if t not in MEMORY_TAGS]
        if unknown:
            raise RequestError(f"unknown memory tag {unknown[0]!r}; allowed: {', '.join(MEMORY_TAGS)}")
        # glmkit keeps its memory (no memory saver): the calls are accepted so a colocated schedule runs
        (service.released.update if release else service.released.difference_update)(tags)
        return JSONResponse(None)

    @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
    async def release_memory(request: HttpRequest):
        return await memory(request, True)

    @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def resume_memory(request: HttpRequest):
        return await memory(request, False)

    # ---- weights ---------------------------------------------------------------------------------------
    @app.post("/begin_weight_update")
    async def begin_weight_update(request: HttpRequest):
        protocol.parse_body(await body_of(request), {"selector": (str, "all")}, "begin_weight_update")
        if service.session_open:
            return outcome(False, "a weight-update session is already open; call end_weight_update() first")
        service.session_open = True
        return outcome(True, "weight-update session opened")

    @app.post("/end_weight_update")
    async def end_weight_update(request: HttpRequest):
        protocol.parse_body(await body_of(request), {"selector": (str, "all")}, "end_weight_update")
        if not service.session_open:
            return outcome(False, "no weight-update session is open; call begin_weight_update() first")
        service.session_open = False
        return outcome(True, "weight-update session closed")

    @app.post("/update_weight_version")
    async def update_weight_version(request: HttpRequest):
        body = protocol.parse_body(await body_of(request), {"new_version": (str, ...),
                                                            "abort_all_requests": (bool, True)}, "update_weight_version")
        version = checked_version(body["new_version"], "new_version")
        if body["abort_all_requests"]:
            batcher.abort(None, True)
        service.weight_version = version
        return {"success": True, "message": f"Weight version updated to {body['new_version']}",
                "new_version": body["new_version"]}

    def checked_version(version, field: str = "weight_version"):
        """A weight version is echoed in every answer's meta_info: a label (the framework sends a step
        number), never a payload."""
        if version is not None and (len(version) > MAX_WEIGHT_VERSION or not version.isprintable()):
            raise RequestError(f"{field}: at most {MAX_WEIGHT_VERSION} printable characters, got {len(version)} "
                               f"characters{'' if version.isprintable() else ' with control characters'}")
        return version

    def updated(message: str, version) -> str:
        return f"{message}." + (f" Weight version updated to {version}." if version is not None else "")

    @app.post("/update_weights_from_tensor")
    async def update_from_tensor(request: HttpRequest):
        body = protocol.parse_body(await body_of(request, weights=True), {
            "serialized_named_tensors": ("list[str]", ...), "load_format": ("str?", None), "flush_cache": (bool, True),
            "abort_all_requests": (bool, False), "weight_version": ("str?", None), "selector": (str, "all"),
            "torch_empty_cache": (bool, False)}, "update_weights_from_tensor")
        if body["load_format"] != "safetensors":
            return outcome(False, f"load_format {body['load_format']!r}: glmkit serve reads only safetensors blobs "
                                  f"(load_format \"safetensors\"); SGLang's own formats carry pickled CUDA IPC handles, "
                                  f"which it never unpickles. Use /update_weights_from_distributed or _from_disk.")
        if body["abort_all_requests"]:
            batcher.abort(None, True)

        async def work():
            tensors = service.tensors_from_blobs(body["serialized_named_tensors"])
            await batcher.call(service.load_tensors, tensors, checked_version(body["weight_version"]))
            return updated("Succeeded to update model weights", body["weight_version"])
        return await weight_step(work)

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(request: HttpRequest):
        body = protocol.parse_body(await body_of(request), {"name": (str, ...), "truncate_size": (int, 100)},
                                   "get_weights_by_name")
        if body["truncate_size"] < 1:
            raise RequestError(f"truncate_size must be at least 1, got {body['truncate_size']}")
        return await batcher.call(service.weights_by_name, body["name"], body["truncate_size"])

    @app.post("/init_weights_update_group")
    async def init_update_group(request: HttpRequest):
        body = protocol.parse_body(await body_of(request), {
            "master_address": (str, ...), "master_port": (int, ...), "rank_offset": (int, ...),
            "world_size": (int, ...), "group_name": (str, "weight_update_group"), "backend": (str, "nccl"),
            "timeout_s": (float, GROUP_TIMEOUT_S)}, "init_weights_update_group")
        if not 0 < body["master_port"] < 65536 or not 0 < body["timeout_s"] <= 86400:
            return outcome(False, f"master_port {body['master_port']} must be in 1..65535 and timeout_s "
                                  f"{body['timeout_s']} in (0, 86400]")
        if not 2 <= body["world_size"] <= MAX_WORLD_SIZE:  # torch's process groups count ranks in 32 bits
            return outcome(False, f"world_size {body['world_size']} must be in 2..{MAX_WORLD_SIZE} (the trainer and "
                                  f"at least this engine)")
        return await weight_step(group_threads.run, service.join_group, body)  # not the engine's thread

    @app.post("/destroy_weights_update_group")
    async def destroy_update_group(request: HttpRequest):
        body = protocol.parse_body(await body_of(request), {"group_name": (str, "weight_update_group")},
                                   "destroy_weights_update_group")
        return await weight_step(group_threads.run, service.destroy_group, body["group_name"])

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(request: HttpRequest):
        body = protocol.parse_body(await body_of(request), {
            "names": ("list[str]", ...), "dtypes": ("list[str]", ...), "shapes": ("list[list[int]]", ...),
            "group_name": (str, "weight_update_group"), "flush_cache": (bool, True), "abort_all_requests": (bool, False),
            "weight_version": ("str?", None), "load_format": ("str?", None), "selector": (str, "all"),
            "torch_empty_cache": (bool, False)}, "update_weights_from_distributed")
        if not len(body["names"]) == len(body["dtypes"]) == len(body["shapes"]):
            return outcome(False, f"names, dtypes and shapes differ in length ({len(body['names'])}, "
                                  f"{len(body['dtypes'])}, {len(body['shapes'])})")
        if body["load_format"] not in (None, "auto"):
            return outcome(False, f"load_format {body['load_format']!r} is not supported by glmkit serve: the trainer "
                                  f"must broadcast one tensor per name (load_format unset)")
        if any(d < 0 for shape in body["shapes"] for d in shape):
            return outcome(False, "shapes hold a negative dimension")
        if body["abort_all_requests"]:
            batcher.abort(None, True)

        async def work():
            tensors = await group_threads.run(service.receive, body)  # the transfers: off the engine's thread
            await batcher.call(service.load_tensors, tensors, checked_version(body["weight_version"]))
            return updated("Succeeded to update parameter online", body["weight_version"])
        return await weight_step(work)

    @app.post("/update_weights_from_disk")
    async def update_from_disk(request: HttpRequest):
        body = protocol.parse_body(await body_of(request), {
            "model_path": (str, ...), "load_format": ("str?", None), "abort_all_requests": (bool, False),
            "weight_version": ("str?", None), "flush_cache": (bool, True), "is_async": (bool, False),
            "torch_empty_cache": (bool, False), "keep_pause": (bool, False), "recapture_cuda_graph": (bool, False),
            "token_step": (int, 0)}, "update_weights_from_disk")
        if body["load_format"] not in (None, "auto", "safetensors"):
            return outcome(False, f"load_format {body['load_format']!r} is not supported by glmkit serve (safetensors "
                                  f"files or an HF checkpoint directory only)", num_paused_requests=0)
        if body["abort_all_requests"]:
            batcher.abort(None, True)

        async def work():
            tensors = await asyncio.to_thread(service.tensors_from_disk, body["model_path"])
            await batcher.call(service.load_tensors, tensors, checked_version(body["weight_version"]))
            service.model_path = body["model_path"]
            return updated("Succeeded to update model weights", body["weight_version"])
        return await weight_step(work, num_paused_requests=0)

    return app


def _env_seconds(name: str, default: float) -> float:
    import math
    import os

    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        return default
    return value if math.isfinite(value) and value > 0 else default


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("glmkit")
    except PackageNotFoundError:
        return "unknown"


def checkpoint_eos_ids(checkpoint, model, tokenizer) -> list[int]:
    """The ids SGLang stops on: config.json's eos_token_id, generation_config.json's, the tokenizer's."""
    ids = set()

    def add(value):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))

    add(getattr(model.config, "eos_token_id", None))
    generation = Path(checkpoint) / "generation_config.json"
    if generation.is_file():
        try:
            add(json.loads(generation.read_text()).get("eos_token_id"))
        except (ValueError, AttributeError):
            pass
    if tokenizer is not None:
        add(getattr(tokenizer, "eos_token_id", None))
    return sorted(ids)


MAX_WEIGHT_VERSION = 256
EVERY_INTERFACE = ("0.0.0.0", "::")  # the spellings that say "every interface" on purpose


def http_url(host: str, port: int) -> str:
    """The URL of host:port, an IPv6 address in brackets as URLs write it."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _check_host(host: str) -> None:
    """Listening on every interface is asked for in words (0.0.0.0 or ::), never by a shorthand that
    means the same to the resolver: '', '0', '0x0', '0.0'."""
    import ipaddress

    if not host.strip():
        raise ValueError("--host '': empty (it would listen on every interface); give an address such as 127.0.0.1, "
                         "or 0.0.0.0 to mean every interface")
    if host in EVERY_INTERFACE:
        return
    try:
        found = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except (socket.gaierror, UnicodeError) as err:
        raise ValueError(f"--host {host!r}: {getattr(err, 'strerror', None) or err}; give an address of this "
                         f"machine such as 127.0.0.1") from None
    def unspecified(address: str) -> bool:
        ip = ipaddress.ip_address(address.split("%")[0])
        return ip.is_unspecified or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_unspecified)

    if any(unspecified(a) for a in found):
        raise ValueError(f"--host {host!r} means every interface ({', '.join(sorted(found))}); give 127.0.0.1, or "
                         f"write 0.0.0.0 (or ::) if every interface is meant")


def serve(checkpoint, host: str = "127.0.0.1", port: int = 30000, device: str = "cpu", dtype: str | None = None,
          backends=None, tokenizer: str | None = None, max_batch: int = DEFAULT_MAX_BATCH, update_roots=(),
          window_s: float = 0.005, on_ready=print, max_context: int = DEFAULT_MAX_CONTEXT,
          prefill_chunk: int | None = None, max_body: int = DEFAULT_MAX_BODY, served_model_name: str | None = None,
          enable_memory_saver: bool = False, seed: int = 0, base_gpu_id: int = 0,
          max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS, max_weights_body: int = DEFAULT_MAX_WEIGHTS_BODY,
          body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
          max_connections: int = DEFAULT_MAX_CONNECTIONS):
    """Load the checkpoint and serve until interrupted. Port 0 picks a free port; `on_ready` gets
    the line naming the address."""
    import uvicorn

    from glmkit.serve.connections import MAX_HEADER_BYTES, bounded_protocol, connection_cap

    from glmkit.model import load_model
    from glmkit.tokenizer import has_tokenizer_files, load_tokenizer

    _check_host(host)
    # an engine loads what it is given, as SGLang does (NaN weights are answered as null, and are what
    # `glmkit ckpt verify-engine` is there to find)
    model = load_model(checkpoint, getattr(torch, dtype) if dtype else None, device, finite=False).eval()
    tok_dir = tokenizer or (str(checkpoint) if has_tokenizer_files(checkpoint) else None)
    tok = load_tokenizer(tok_dir) if tok_dir else None
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except (socket.gaierror, UnicodeError) as err:  # a host name that does not resolve: the user's input
        sock.close()
        raise ValueError(f"--host {host!r}: {getattr(err, 'strerror', None) or err}; give an address of this "
                         f"machine such as 127.0.0.1") from None
    except OSError as err:  # in use, not this machine's, a link-local address without its interface
        sock.close()
        if err.errno == errno.EADDRINUSE:
            raise ValueError(f"--port {port}: already in use on {host}; choose another port (0 picks a free one)") from None
        raise ValueError(f"--host {host!r} --port {port}: cannot listen there ({err.strerror or err}); give an "
                         f"address of this machine such as 127.0.0.1") from None
    sock.listen(2048)  # connections made from now on wait in the backlog until uvicorn accepts them
    bound = sock.getsockname()[1]
    # SGLang's server arguments as its /server_info echoes them (the framework compares some of them)
    server_args = {"host": host, "port": bound, "nnodes": 1, "node_rank": 0, "gpu_id_step": 1, "base_gpu_id": base_gpu_id,
                   "tp_size": 1, "dp_size": 1, "pp_size": 1, "ep_size": 1, "enable_memory_saver": enable_memory_saver,
                   "enable_return_routed_experts": True, "enable_return_indexer_topk": True,
                   "dtype": str(model.dtype).removeprefix("torch."), "load_format": "auto",
                   "served_model_name": served_model_name or str(checkpoint), "weight_version": "default",
                   "skip_tokenizer_init": tok is None, "stream_interval": 1, "incremental_streaming_output": False,
                   "random_seed": seed, "device": str(model.device), "started": time.time()}
    service = EngineService(model, backends, tok, str(checkpoint), tok_dir or "", max_batch, update_roots,
                            max_context, prefill_chunk, checkpoint_eos_ids(checkpoint, model, tok), server_args, seed,
                            max_prefill_tokens)
    service.check_cache_fits()
    app = build_app(service, window_s, max_body, max_weights_body, body_timeout_s)
    cap = connection_cap(max_connections)
    if cap < 1:
        raise OSError(errno.EMFILE, f"the descriptor limit (ulimit -n {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}) leaves no room "
                      f"for a connection beside the model's open files; raise it (ulimit -n 4096)")
    if cap < max_connections:
        warnings.warn(f"--max-connections {max_connections}: the descriptor limit (ulimit -n) leaves room for {cap}; "
                      f"serving at most {cap} connections at once")
    config = uvicorn.Config(app, log_level="warning", access_log=False, http=bounded_protocol(header_timeout_s, cap),
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S, h11_max_incomplete_event_size=MAX_HEADER_BYTES)
    batcher = app.state.batcher

    sigint_ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # a background job of a script: nohup-like

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if sig == signal.SIGINT and sigint_ignored:
                return  # uvicorn would stop on a signal the process was started to ignore
            batcher.exit_signal = batcher.exit_signal or sig
            logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)  # the shutdown's own line says it all
            # end the running requests now: the graceful wait then ends at their next step, with answers
            if batcher.loop is not None:
                batcher.loop.call_soon_threadsafe(batcher.shutdown)
            super().handle_exit(sig, frame)

    server = Server(config)
    on_ready(f"glmkit serve: {checkpoint} on {http_url(host, bound)} (SGLang native API; device {device}, "
             f"max batch {max_batch})")
    server.run(sockets=[sock])
