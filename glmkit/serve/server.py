"""`glmkit serve`: glmkit's rollout engine behind SGLang's native HTTP API (FastAPI + uvicorn).

Continuous batching (`Batcher`): one worker thread owns the model; requests with the same sampling
setup share a `SlotBatch`, join it between decode steps while slots are free and leave it when they
finish. Generation and weight updates never overlap.

Weight updates: `/update_weights_from_tensor` takes safetensors blobs (never pickle);
`/update_weights_from_disk` reads only directories under the roots given with
`--allow-updates-from` (a full checkpoint directory, or safetensors files of named tensors).
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import socket
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from glmkit.serve import protocol
from glmkit.serve.protocol import GenerateRequest

DEFAULT_MAX_BATCH = 64
DEFAULT_MAX_CONTEXT = 65536  # prompt + new tokens of one request: bounds what one request can allocate
MAX_WEIGHT_ELEMENTS = 1 << 24  # /get_weights_by_name: one answer's floats (about 200 MB of JSON)


def input_logprobs(logits: torch.Tensor, prompts, temperature: float) -> list[list]:
    """Logits at every token of the packed prompts [T, V] -> per prompt, the log-prob of each token
    given the ones before it under softmax(logits / temperature) (None for the first token)."""
    logp = torch.log_softmax(logits.float().cpu() / (temperature or 1.0), -1)
    out, start = [], 0
    for prompt in prompts:
        ids = torch.tensor(prompt)
        out.append([None, *logp[start:start + len(prompt) - 1].gather(-1, ids[1:, None])[:, 0].tolist()])
        start += len(prompt)
    return out


class BadRequest(ValueError):
    """A request the server refuses (400), with the reason."""


@dataclass
class Pending:
    prompt: list
    params: protocol.SamplingParamsIn
    rid: str
    want_logprob: bool
    logprob_start_len: int
    want_routing: bool
    want_topk: bool
    future: asyncio.Future = None
    answer: dict = field(default_factory=dict)
    teacher: dict | None = None

    def key(self):
        """Requests that can share one batch of slots: lengths may differ (each leaves at its own)."""
        p = self.params
        return (p.temperature, p.top_p, p.max_new_tokens == 0, tuple(p.stop_token_ids), p.sampling_seed)


class EngineService:
    """The model, its engine and tokenizer, the weight version; every method runs on the worker."""

    def __init__(self, model, backends=None, tokenizer=None, model_path: str = "", tokenizer_path: str = "",
                 max_batch: int = DEFAULT_MAX_BATCH, update_roots=(), max_context: int = DEFAULT_MAX_CONTEXT,
                 prefill_chunk: int | None = None):
        from glmkit.model import RolloutEngine

        self.model, self.engine = model, RolloutEngine(model, backends)
        self.tokenizer, self.model_path, self.tokenizer_path = tokenizer, model_path, tokenizer_path
        self.max_batch, self.max_context = max_batch, max_context
        self.prefill_chunk = prefill_chunk  # SlotBatch's: prompts joining a running batch go in pieces
        self.update_roots = [Path(r).resolve() for r in update_roots]
        self.weight_version = "default"
        self.updates = 0
        self.batches_run = self.requests_run = 0
        self.update_group = None
        self.seeds = itertools.count(1)
        config = model.config
        self.moe_layers = [b.layer for b in model.layers if b.is_moe]
        self.dsa_layers = [b.layer for b in model.layers if b.kind == "dsa"]
        self.vocab_size = config.vocab_size

    # ---- requests ------------------------------------------------------------------------------
    def check_lengths(self, prompts, params):
        for i, (p, sp) in enumerate(zip(prompts, params)):
            if len(p) + sp.max_new_tokens > self.max_context:
                raise BadRequest(f"input {i}: {len(p)} prompt tokens + max_new_tokens {sp.max_new_tokens} exceed this "
                                 f"server's --max-context {self.max_context}")

    def encode(self, request: GenerateRequest) -> list[list[int]]:
        if request.text is not None:
            if self.tokenizer is None:
                raise BadRequest("this server has no tokenizer (start it with --tokenizer DIR); send input_ids")
            texts = request.text if isinstance(request.text, list) else [request.text]
            prompts = [self.tokenizer.encode(t) for t in texts]
        else:
            prompts = request.input_ids if request.batched else [request.input_ids]
        if not prompts:
            raise BadRequest("the batch is empty")
        if len(prompts) > self.max_batch:
            raise BadRequest(f"batch of {len(prompts)} inputs is larger than this server's --max-batch-size "
                             f"{self.max_batch}")
        for i, p in enumerate(prompts):
            if len(p) == 0:
                raise BadRequest(f"input {i} is empty")
            bad = [t for t in p if t >= self.vocab_size]
            if bad:
                raise BadRequest(f"input {i} has token id {bad[0]} outside the vocabulary (size {self.vocab_size})")
        return [list(map(int, p)) for p in prompts]

    def run_prompt_only(self, items: list[Pending]) -> None:
        """max_new_tokens 0: the teacher-forced pass alone; fills each item's answer."""
        from glmkit.model.rollout import Completion

        self.batches_run += 1
        self.requests_run += len(items)
        p = items[0].params
        passes = self.prompt_pass([it.prompt for it in items], p.temperature, any(it.want_routing for it in items),
                                  any(it.want_topk for it in items))
        for it, teacher in zip(items, passes):
            it.answer = self.answer(it, Completion(prompt=list(it.prompt), finish_reason="length"), teacher)

    def open_slots(self, waiting: list[Pending], cancelled):
        """A SlotBatch for requests with the sampling setup of waiting[0]: --max-batch-size slots, each
        as long as the longest of `waiting` needs (a power of two, at most --max-context)."""
        from glmkit.model.rollout import SamplingParams, SlotBatch

        p = waiting[0].params
        need = max(len(it.prompt) + it.params.max_new_tokens for it in waiting)
        capacity = min(self.max_context, max(256, 1 << (need - 1).bit_length()))
        params = SamplingParams(temperature=p.temperature, top_p=p.top_p, max_new_tokens=1,
                                stop_token_ids=tuple(p.stop_token_ids))
        seed = p.sampling_seed if p.sampling_seed is not None else next(self.seeds)
        self.batches_run += 1
        return SlotBatch(self.engine, self.max_batch, capacity, params, seed, record_routing=True, record_topk=True,
                         cancelled=lambda item: cancelled(item.rid), prefill_chunk=self.prefill_chunk)

    def admit(self, slots, items: list[Pending]) -> None:
        """Prefill `items` into free slots (and their teacher-forced pass where asked)."""
        self.requests_run += len(items)
        teacher = any(it.want_logprob and it.logprob_start_len >= 0 for it in items)
        prompts = [it.prompt for it in items]
        logits = slots.join(prompts, [it.params.max_new_tokens for it in items], items, prompt_logits=teacher)
        if teacher:  # the prefill's own logits at every prompt token: no second forward over the prompts
            for it, logprobs in zip(items, input_logprobs(logits, prompts, items[0].params.temperature)):
                if it.want_logprob and it.logprob_start_len >= 0:
                    it.teacher = {"input_logprobs": logprobs}

    def finish(self, item: Pending, completion) -> None:
        item.answer = self.answer(item, completion, item.teacher)

    @torch.no_grad()
    def prompt_pass(self, prompts, temperature, want_routing, want_topk) -> list[dict]:
        """Teacher-forced pass over whole prompts: log-prob of each token given the ones before it
        (None for the first), and the experts / DSA positions each token chose."""
        from glmkit.model.packed import Packed

        lengths = [len(p) for p in prompts]
        packed = Packed.from_lengths(lengths, device="cpu")
        seen = {}

        def record(layer, site, value):
            if (site == "router_experts" and want_routing) or (site == "indexer_topk" and want_topk):
                seen[(layer, site)] = value.cpu()

        _, logits = self.engine.prefill(prompts, max(lengths), all_logits=True, record=record)
        out = []
        for (s, e), picked in zip(packed.bounds(), input_logprobs(logits, prompts, temperature)):
            routing = {layer: v[s:e] for (layer, site), v in seen.items() if site == "router_experts"}
            topk = {layer: torch.where(v[s:e] >= 0, v[s:e] - s, v[s:e]) for (layer, site), v in seen.items()
                    if site == "indexer_topk"}
            out.append({"input_logprobs": picked, "routing": routing, "topk": topk})
        return out

    def answer(self, it: Pending, c, teacher: dict | None) -> dict:
        tokens = list(c.tokens)
        if c.finish_reason == "stop":
            reason = protocol.finish_reason("stop", matched=tokens[-1])
        elif c.finish_reason == "abort":
            reason = protocol.finish_reason("abort")
        else:
            reason = protocol.finish_reason("length", length=len(tokens))
        meta = {"id": it.rid, "finish_reason": reason, "prompt_tokens": len(it.prompt),
                "completion_tokens": len(tokens), "cached_tokens": 0, "weight_version": self.weight_version}
        if it.want_logprob:
            meta["output_token_logprobs"] = [[float(lp), int(t), None] for lp, t in zip(c.logprobs, tokens)]
            if it.logprob_start_len >= 0:
                start = min(it.logprob_start_len, len(it.prompt))
                meta["input_token_logprobs"] = [[lp, int(t), None] for lp, t in
                                                zip(teacher["input_logprobs"][start:], it.prompt[start:])]
        # fed tokens: with generation, prompt + all sampled tokens but the last; without, the prompt
        routing = c.routing if c.routing is not None else (teacher or {}).get("routing")
        topk = c.topk if c.topk is not None else (teacher or {}).get("topk")
        if it.want_routing and self.moe_layers:
            meta["routed_experts"] = protocol.encode_int32(protocol.stack_layers(
                {k: v.numpy() for k, v in routing.items()}, self.moe_layers))
            meta["routed_experts_layers"] = self.moe_layers
        if it.want_topk and self.dsa_layers:
            meta["indexer_topk"] = protocol.encode_int32(protocol.stack_layers(
                {k: v.numpy() for k, v in topk.items()}, self.dsa_layers))
            meta["indexer_topk_num_layers"] = len(self.dsa_layers)
            meta["indexer_topk_layers"] = self.dsa_layers
        text = self.tokenizer.decode(tokens) if self.tokenizer is not None else ""
        return {"text": text, "output_ids": tokens, "meta_info": meta}

    # ---- weights -------------------------------------------------------------------------------
    def load_tensors(self, tensors: dict, version: str | None) -> str:
        """Copy named tensors into the model, all checked before any is written. Names are the
        model's parameters (the routed experts stacked) or its state-dict / checkpoint names (one
        tensor per expert: views into the stacks)."""
        params = {**self.model.state_dict(keep_vars=True), **dict(self.model.named_parameters())}
        unknown = sorted(set(tensors) - set(params))
        if unknown:
            raise BadRequest(f"{len(unknown)} tensor(s) are not parameters of this model, e.g. {unknown[0]!r}")
        for name, value in tensors.items():
            if tuple(value.shape) != tuple(params[name].shape):
                raise BadRequest(f"tensor {name!r} has shape {list(value.shape)}; the model's is "
                                 f"{list(params[name].shape)}")
            if not (value.dtype.is_floating_point and params[name].dtype.is_floating_point):
                raise BadRequest(f"tensor {name!r} has dtype {value.dtype}; expected a floating-point tensor "
                                 f"(the model's is {params[name].dtype})")
        with torch.no_grad():
            for name, value in tensors.items():
                params[name].copy_(value)
        self.updates += 1
        self.weight_version = version if version is not None else str(self.updates)
        return f"updated {len(tensors)} tensor(s); weight_version {self.weight_version}"

    def weights_by_name(self, name: str, truncate_size: int) -> list:
        """SGLang's answer layout: the tensor as float32 nested lists, cut to its first `truncate_size`
        entries along dim 0. Names: the checkpoint's (`model.language_model.layers.N...`), SGLang's
        (`model.layers.N...`) or the model's own; routed experts by their per-expert checkpoint names."""
        from glmkit.checkpoint.names import LM_HEAD
        from glmkit.report import json_safe

        state = {**self.model.state_dict(keep_vars=True), **dict(self.model.named_parameters())}
        own = name if name == LM_HEAD else name.removeprefix("model.").removeprefix("language_model.")
        if own not in state:
            raise BadRequest(f"Get parameter by name failed: {name!r} is not a tensor of this model")
        tensor = state[own].detach()
        rows = tensor[:truncate_size] if tensor.dim() else tensor
        if rows.numel() > MAX_WEIGHT_ELEMENTS:
            raise BadRequest(f"Get parameter by name failed: {rows.numel()} elements asked for; at most "
                             f"{MAX_WEIGHT_ELEMENTS} per request (lower truncate_size)")
        rows = rows.float().cpu()
        if bool(rows.isfinite().all()):
            return rows.tolist()
        # NaN and inf are not JSON: answered as null, as SGLang's orjson response writes them
        return json_safe(rows.tolist())

    def join_update_group(self, body) -> str:
        """Join the trainer's weights-update process group (the trainer is rank 0)."""
        import torch.distributed as dist

        from glmkit.rl.parallel import init_group

        if self.update_group is not None or dist.is_initialized():
            raise BadRequest(f"this server already joined a weights-update group ({self.update_group})")
        if body.rank_offset >= body.world_size:
            raise BadRequest(f"rank_offset {body.rank_offset} must be below world_size {body.world_size}")
        if body.backend == "nccl" and not torch.cuda.is_available():
            raise BadRequest("backend nccl needs CUDA; this server has none (use gloo)")
        if body.backend == "nccl" and self.model.device.type != "cuda":
            raise BadRequest(f"backend nccl needs the model on a GPU; this server's is on {self.model.device} (use gloo)")
        # NVLink multicast off (every variable of it) and the model's GPU picked, as in every group the kit joins
        gpu = (self.model.device.index or 0) if self.model.device.type == "cuda" else 0
        init_group(body.backend, gpu, body.timeout_s, init_method=f"tcp://{body.master_address}:{body.master_port}",
                   world_size=body.world_size, rank=body.rank_offset)
        self.update_group = body.group_name
        return f"joined {body.group_name} as rank {body.rank_offset} of {body.world_size} ({body.backend})"

    def receive_broadcast(self, body) -> dict:
        """The tensors rank 0 broadcasts, allocated from the announced dtypes and shapes."""
        import torch.distributed as dist

        from glmkit.rl.parallel import receive_announced

        if self.update_group is None or body.group_name != self.update_group:
            raise BadRequest(f"no weights-update group {body.group_name!r} (call /init_weights_update_group first)")
        device = self.model.device if dist.get_backend() == "nccl" else "cpu"
        try:  # the order is the request's: rank 0 sends in the same order
            return receive_announced(zip(body.names, body.dtypes, body.shapes), device)
        except ValueError as err:  # an unknown dtype, before anything is received
            raise BadRequest(str(err)) from None

    def tensors_from_blobs(self, blobs: list[str]) -> dict:
        from safetensors.torch import load

        tensors = {}
        for i, blob in enumerate(blobs):
            try:
                tensors.update(load(base64.b64decode(blob, validate=True)))
            except Exception as err:  # noqa: BLE001 - any decoding failure is the client's bad input
                raise BadRequest(f"serialized_named_tensors[{i}] is not base64 of a safetensors blob: {err}") from None
        return tensors

    def tensors_from_disk(self, path: str) -> dict:
        directory = Path(path).resolve()
        if not any(directory == root or root in directory.parents for root in self.update_roots):
            raise PermissionError(f"{path} is not under a directory this server may read updates from "
                                  f"(start it with --allow-updates-from DIR)")
        if not directory.is_dir():
            raise BadRequest(f"{path} is not a directory")
        try:
            return self._read_dir(directory)
        except BadRequest:
            raise
        except Exception as err:  # noqa: BLE001 - an unreadable update is the client's bad input, said whole
            raise BadRequest(f"{path}: {err}") from None

    @staticmethod
    def _read_dir(directory: Path) -> dict:
        from safetensors import safe_open

        outside = [f.name for f in directory.iterdir() if f.is_symlink() and f.resolve().parent != directory]
        if outside:  # a checkpoint's files are read by name: none of them may lead out of the allowed root
            raise BadRequest(f"{', '.join(sorted(outside)[:3])} points outside {directory}")
        if (directory / "config.json").is_file():
            from glmkit.checkpoint import open_checkpoint

            return dict(open_checkpoint(directory).state_dict())
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise BadRequest(f"{directory} holds no *.safetensors file")
        tensors = {}
        for f in files:
            with safe_open(str(f), framework="pt") as handle:
                for name in handle.keys():
                    tensors[name] = handle.get_tensor(name)
        return tensors


@dataclass
class _Call:
    fn: object
    args: tuple
    future: asyncio.Future


class Batcher:
    """One worker thread owns the model. It runs, in arrival order, weight updates and batches of
    generation: a batch opens slots for the first waiting request's sampling setup and, between decode
    steps, admits every waiting request with the same setup while slots are free (continuous
    batching); each request's answer is sent the moment it finishes. A waiting weight update stops
    admissions, and runs when the batch has drained."""

    def __init__(self, service: EngineService, window_s: float = 0.005):
        self.service, self.window_s = service, window_s
        self.pending: deque = deque()
        self.cond = threading.Condition()
        self.cancelled: set = set()
        self.running: set = set()
        self.loop = None
        self.stopped = False
        self.thread = threading.Thread(target=self._work, name="glmkit-engine", daemon=True)

    def start(self):
        self.loop = asyncio.get_running_loop()
        self.thread.start()

    def stop(self):
        with self.cond:
            self.stopped = True
            self.cond.notify()

    async def submit(self, items: list[Pending]) -> list[dict]:
        for it in items:
            it.future = self.loop.create_future()
        with self.cond:
            self.pending.extend(items)
            self.cond.notify()
        return [await it.future for it in items]

    async def call(self, fn, *args):
        """Run fn on the worker thread, between batches."""
        future = self.loop.create_future()
        with self.cond:
            self.pending.append(_Call(fn, args, future))
            self.cond.notify()
        return await future

    def is_cancelled(self, rid: str) -> bool:
        return rid in self.cancelled

    def abort(self, rid: str | None, abort_all: bool) -> int:
        with self.cond:
            waiting = {it.rid for it in self.pending if isinstance(it, Pending)}
            known = self.running | waiting
            targets = known if abort_all else ({rid} & known)
            self.cancelled |= targets
        return len(targets)

    @property
    def busy(self) -> bool:
        with self.cond:
            return bool(self.running) or any(isinstance(it, Pending) for it in self.pending)

    # ---- the worker thread -------------------------------------------------------------------------
    def _settle(self, future, value=None, error=None):
        def done():
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(value)
        self.loop.call_soon_threadsafe(done)

    def _take_same(self, key, limit: int) -> list[Pending]:
        """Up to `limit` waiting requests with `key`, in order, not past a waiting weight update."""
        taken = []
        with self.cond:
            for it in list(self.pending):
                if isinstance(it, _Call) or len(taken) == limit:
                    break
                if it.key() == key:
                    self.pending.remove(it)
                    taken.append(it)
            self.running |= {it.rid for it in taken}
        return taken

    def _work(self):
        import time as clock

        while True:
            with self.cond:
                while not self.pending and not self.stopped:
                    self.cond.wait()
                if self.stopped:
                    return
                first = self.pending[0]
            if isinstance(first, _Call):
                with self.cond:
                    self.pending.popleft()
                try:
                    self._settle(first.future, first.fn(*first.args))
                except Exception as err:  # noqa: BLE001 - the caller's request gets the error
                    self._settle(first.future, error=err)
                continue
            clock.sleep(self.window_s)  # let requests sent together arrive together
            self._run_batch(first.key())

    def _run_batch(self, key):
        service, batch, slots = self.service, [], None
        try:
            if key[2]:  # max_new_tokens 0: a teacher-forced pass, no slots
                batch = self._take_same(key, service.max_batch)
                service.run_prompt_only(batch)
                for it in batch:
                    self._settle(it.future, it.answer)
                return
            with self.cond:
                waiting = [it for it in self.pending if isinstance(it, Pending) and it.key() == key]
            try:
                slots = service.open_slots(waiting, self.is_cancelled)
            except Exception:  # answered below with the error, not left queued to be retried forever
                batch = self._take_same(key, len(waiting))
                raise
            closed = False  # once a request does not fit these slots, it waits first in line for the next batch
            while True:
                fits = []
                for it in ([] if closed else self._take_same(key, slots.free)):
                    if not closed and len(it.prompt) + it.params.max_new_tokens <= slots.capacity:
                        fits.append(it)
                        continue
                    closed = True
                    with self.cond:
                        self.pending.appendleft(it)
                        self.running.discard(it.rid)
                if fits:
                    batch += fits
                    service.admit(slots, fits)  # samples each one's first token: some may end here
                self._answer_finished(slots)
                if not slots.busy:
                    return
                slots.step()
                self._answer_finished(slots)
        except Exception as err:  # noqa: BLE001 - every request of the batch learns why
            for it in batch:
                self._settle(it.future, error=err)
        finally:
            self._release(batch)

    def _answer_finished(self, slots):
        for item, completion in slots.finished():
            self.service.finish(item, completion)
            self._settle(item.future, item.answer)
            self._release([item])

    def _release(self, items):
        with self.cond:
            self.running -= {it.rid for it in items}
            self.cancelled -= {it.rid for it in items}


def build_app(service: EngineService, window_s: float = 0.005):
    from contextlib import asynccontextmanager

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    batcher = Batcher(service, window_s)
    rids = itertools.count()

    @asynccontextmanager
    async def lifespan(app):
        batcher.start()
        yield
        batcher.stop()

    app = FastAPI(title="glmkit serve (SGLang native API subset)", lifespan=lifespan)
    app.state.batcher = batcher

    def error(status: int, message: str):
        return JSONResponse({"error": {"message": message, "code": status}}, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError):
        parts = []
        for e in exc.errors()[:5]:
            where = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
            parts.append(f"{where or 'body'}: {e.get('msg')}")
        return error(400, "; ".join(parts) or "invalid request")

    @app.exception_handler(BadRequest)
    async def bad(request: Request, exc: BadRequest):
        return error(400, str(exc))

    @app.exception_handler(PermissionError)
    async def forbidden(request: Request, exc: PermissionError):
        return error(403, str(exc))

    @app.get("/health")
    async def health():
        return {}

    @app.get("/health_generate")
    async def health_generate():
        item = Pending([1], protocol.SamplingParamsIn(max_new_tokens=1, temperature=0.0), f"health-{next(rids)}",
                       False, -1, False, False)
        await batcher.submit([item])
        return {}

    @app.get("/get_model_info")
    async def model_info():
        return {"model_path": service.model_path, "tokenizer_path": service.tokenizer_path, "is_generation": True,
                "weight_version": service.weight_version, "max_batch_size": service.max_batch,
                "vocab_size": service.vocab_size, "max_context": service.max_context, "moe_layers": service.moe_layers, "dsa_layers": service.dsa_layers,
                "dtype": str(service.model.dtype).replace("torch.", ""), "device": str(service.model.device),
                "engine_batches": service.batches_run, "engine_requests": service.requests_run}

    @app.post("/generate")
    async def generate(request: GenerateRequest):
        prompts = service.encode(request)
        n = len(prompts)
        try:
            params = request.per_input(n, "sampling_params")
            given = request.per_input(n, "rid")
        except ValueError as err:
            raise BadRequest(str(err)) from None
        service.check_lengths(prompts, params)
        rid_list = [r if r is not None else f"req-{next(rids)}" for r in given]
        items = [Pending(p, sp, rid, request.return_logprob, request.logprob_start_len, request.return_routed_experts,
                         request.return_indexer_topk) for p, sp, rid in zip(prompts, params, rid_list)]
        answers = await batcher.submit(items)
        return answers if request.batched else answers[0]

    @app.post("/flush_cache")
    async def flush_cache():
        if batcher.busy:
            return error(400, "cannot flush the cache while requests are running")
        return {"success": True, "message": "glmkit keeps no prefix cache; nothing to flush"}

    @app.post("/abort_request")
    async def abort_request(body: protocol.AbortRequest):
        if body.rid is None and not body.abort_all:
            raise BadRequest("give rid or abort_all: true")
        return {"aborted": batcher.abort(body.rid, body.abort_all)}

    @app.post("/update_weights_from_tensor")
    async def update_from_tensor(body: protocol.UpdateFromTensor):
        if body.abort_all_requests:
            batcher.abort(None, True)
        tensors = service.tensors_from_blobs(body.serialized_named_tensors)
        message = await batcher.call(service.load_tensors, tensors, body.weight_version)
        return {"success": True, "message": message, "weight_version": service.weight_version}

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(body: protocol.GetWeightsByName):
        # SGLang answers the bare nested list (no wrapper object); GET carries the same JSON body
        return await batcher.call(service.weights_by_name, body.name, body.truncate_size)

    @app.post("/init_weights_update_group")
    async def init_update_group(body: protocol.InitWeightsUpdateGroup):
        message = await batcher.call(service.join_update_group, body)
        return {"success": True, "message": message}

    @app.post("/update_weights_from_distributed")
    async def update_from_distributed(body: protocol.UpdateFromDistributed):
        if body.abort_all_requests:
            batcher.abort(None, True)
        tensors = await batcher.call(service.receive_broadcast, body)
        message = await batcher.call(service.load_tensors, tensors, body.weight_version)
        return {"success": True, "message": message, "weight_version": service.weight_version}

    @app.post("/update_weights_from_disk")
    async def update_from_disk(body: protocol.UpdateFromDisk):
        if body.abort_all_requests:
            batcher.abort(None, True)
        tensors = await batcher.call(service.tensors_from_disk, body.model_path)
        message = await batcher.call(service.load_tensors, tensors, body.weight_version)
        return {"success": True, "message": message, "weight_version": service.weight_version}

    return app


def serve(checkpoint, host: str = "127.0.0.1", port: int = 30000, device: str = "cpu", dtype: str | None = None,
          backends=None, tokenizer: str | None = None, max_batch: int = DEFAULT_MAX_BATCH, update_roots=(),
          window_s: float = 0.005, on_ready=print, max_context: int = DEFAULT_MAX_CONTEXT,
          prefill_chunk: int | None = None):
    """Load the checkpoint and serve until interrupted. Port 0 picks a free port; `on_ready` gets
    the line naming the address."""
    import uvicorn

    from glmkit.model import load_model
    from glmkit.rl.tokenizer import has_tokenizer_files, load_tokenizer

    model = load_model(checkpoint, getattr(torch, dtype) if dtype else None, device).eval()
    tok_dir = tokenizer or (str(checkpoint) if has_tokenizer_files(checkpoint) else None)
    tok = load_tokenizer(tok_dir) if tok_dir else None
    service = EngineService(model, backends, tok, str(checkpoint), tok_dir or "", max_batch, update_roots,
                            max_context, prefill_chunk)
    app = build_app(service, window_s)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)  # connections made from now on wait in the backlog until uvicorn accepts them
    config = uvicorn.Config(app, log_level="warning", access_log=False)
    server = uvicorn.Server(config)
    bound = sock.getsockname()[1]
    on_ready(f"glmkit serve: {checkpoint} on http://{host}:{bound} (SGLang native API; device {device}, "
             f"max batch {max_batch})")
    server.run(sockets=[sock])
