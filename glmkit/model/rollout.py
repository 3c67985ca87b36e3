"""Rollout path: a serving-style engine over the same weights.

Prefill runs the prompts packed (KDA chunked, DSA through the run's kernel backend) and leaves
per-request caches: KDA conv and recurrent states, the DSA latent (R dims per token, never expanded per head), and the indexer's
keys, gates and completed pool keys. Decode then advances every request one token per step (KDA
recurrent update, DSA over the selected latents of the cache through the run's DSA backend, the
indexer compressing a pool the moment it completes). `extend` prefills further pieces of prompts
into existing caches (chunked prefill). Sampling returns each sampled token's log-prob under
softmax(logits / temperature).
"""

from __future__ import annotations

import itertools
import warnings
from collections import deque
from dataclasses import dataclass, field, fields, is_dataclass, replace
from typing import Protocol, runtime_checkable

import torch

from glmkit.kernels.backends import Backends
from glmkit.model.plan import ModelKernels
from glmkit.model.block import Run
from glmkit.model.model import Glm5Model
from glmkit.model.packed import pack, to_device


GREEDY_BELOW = 1e-6  # SGLang's _SAMPLING_EPS: temperatures below it sample greedily


@dataclass
class SamplingParams:
    """temperature 0 = greedy (and any below GREEDY_BELOW, as SGLang samples: 1 / T would overflow).
    top_p in (0, 1]. Stop tokens end a request and are kept in its output."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_token_ids: tuple = ()

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)


@dataclass
class Completion:
    """tokens and their log-probs; routing (when recorded) {layer: experts [len(prompt) + len(tokens) - 1, k]}
    = the experts each fed token was routed to (the last sampled token is never fed); topk (when
    recorded) {DSA layer: [same rows, W]} = the positions each fed token's DSA layer selected
    (sequence-local, -1 empty), for top-k replay in the trainer."""

    prompt: list
    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    finish_reason: str = "length"
    routing: dict | None = None
    topk: dict | None = None
    # decode steps' recorded rows until the completion closes: {site: [(layers, [L, B, k] host, row)]}
    _step_rows: dict = field(default_factory=dict, init=False, repr=False, compare=False)


@dataclass
class DecodeBatch:
    """Caches of B requests: states per layer, lengths [B] = tokens already cached."""

    states: list
    lengths: torch.Tensor


@runtime_checkable
class RolloutSide(Protocol):
    """What a GRPO trainer asks of the side that generates its samples, wherever it runs: in this
    process (glmkit.rl.loop.LocalRollout), behind an SGLang-protocol server
    (glmkit.serve.client.SGLangRollout) or on Ray actors (glmkit.launch.builtin.RayRollout).

    bind(policy)                    once, before the first rollout: the trainer's model (a server that
                                    merges LoRA adapters reads the base from it; the others keep nothing)
    generate(prompt_ids, params, seed) -> [Completion]   each with its log-probs, routing and selections
    load(tensors)                   after every optimizer step: the trainable tensors by name"""

    def bind(self, policy) -> None: ...

    def generate(self, prompt_ids: list, params: SamplingParams, seed: int) -> list: ...

    def load(self, tensors: dict) -> None: ...


class RolloutEngine:
    def __init__(self, model: Glm5Model, backends: Backends | str | None = None):
        self.model = model
        self.kernels = ModelKernels(model, backends)  # every operator's backend, chosen here (see .plan)
        self.backends = self.kernels.backends

    def can_graph(self) -> bool:
        """Whether decode steps can run as CUDA graphs (GraphedStep): caches on CUDA and every MoE layer
        on the grouped GEMMs (the per-expert loop reads expert counts back to the host)."""
        plan = self.kernels.plan
        return plan.target.device == "cuda" and plan["moe"].name == "grouped"

    def _empty_states(self, batch: int, capacity: int):
        dtype, device = self.model.dtype, self.model.device
        return [layer.self_attn.empty_state(batch, dtype, device) if layer.kind == "kda"
                else layer.self_attn.empty_state(batch, capacity, dtype, device) for layer in self.model.layers]

    def cache_bytes(self, batch: int, capacity: int) -> int:
        """Bytes the decode caches of `batch` requests of `capacity` tokens take (measured on the meta
        device, so nothing is allocated): what a SlotBatch of that size asks for before it runs."""
        dtype, meta = self.model.dtype, torch.device("meta")
        states = [layer.self_attn.empty_state(1, dtype, meta) if layer.kind == "kda"
                  else layer.self_attn.empty_state(1, capacity, dtype, meta) for layer in self.model.layers]
        return batch * sum(t.numel() * t.element_size() for state in states for t in _cache_tensors(state))

    @torch.no_grad()
    def prefill(self, prompts, capacity: int, all_logits: bool = False, record=None, topk_replay=None,
                record_scores=False, rows=None):
        """prompts: list of token lists -> (DecodeBatch, logits). Logits are [B, V] at each prompt's last
        token, or [T, V] over all packed prompt tokens with all_logits. `topk_replay` {DSA layer:
        [T, W] positions inside each prompt, -1 empty} replays selections (as TrainPath.forward).
        `rows`, when given, is called with the final hidden states at every packed prompt token [T, D]
        before the head: a caller that needs per-token results reduces them in pieces instead of
        holding [T, V] logits."""
        input_ids, packed = pack(prompts, device=self.model.device)
        if max(packed.lengths()) > capacity:
            raise ValueError(f"capacity {capacity} is shorter than the longest prompt ({max(packed.lengths())})")
        states = self._empty_states(packed.num_sequences, capacity)
        replay = {layer: packed.to_global(rows) for layer, rows in (topk_replay or {}).items()}
        run = Run(self.kernels.plan, packed=packed, states=states, record=record, topk_replay=replay,
                  record_scores=record_scores)
        hidden = self.model.hidden(input_ids, run)
        if rows is not None:
            rows(hidden)
        picked = hidden if all_logits else hidden[packed.last_indices()]
        lengths = packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]
        return DecodeBatch(run.states, lengths), self.model.lm_head(picked).float()

    @torch.no_grad()
    def extend(self, batch: DecodeBatch, chunks, slots=None, record=None, all_logits: bool = False):
        """Prefill in chunks: chunks[n] (token list) continues the cache of request slots[n] of
        `batch` (default: request n) after the tokens it already holds -> logits [N, V] at each
        chunk's last token, or [T, V] over all packed chunk tokens with all_logits; the lengths of
        those requests advance. Prefilling a prompt in pieces gives the caches and logits of one
        prefill of the whole prompt (the same math, other summation orders). DSA selections, as the
        `record` observer sees them, are positions in the request (as in decode steps)."""
        if not chunks or any(len(c) == 0 for c in chunks):
            raise ValueError("extend needs at least one chunk and every chunk needs at least one token")
        slot_list = list(range(len(chunks))) if slots is None else [int(s) for s in slots]
        size = len(batch.lengths)
        if len(slot_list) != len(chunks) or len(set(slot_list)) != len(slot_list) or \
                any(not 0 <= s < size for s in slot_list):
            raise ValueError(f"extend needs one distinct slot in [0, {size}) per chunk ({len(chunks)} chunks), "
                             f"got {slot_list}")
        device = self.model.device
        input_ids, packed = pack(chunks, device=device)
        slot_ids = to_device(torch.tensor(slot_list, dtype=torch.long), device)
        added = packed.cu_seqlens[1:] - packed.cu_seqlens[:-1]
        offsets = batch.lengths[slot_ids]
        capacity = _capacity(batch)
        needed = int((offsets + added).max())
        if needed > capacity:
            raise ValueError(f"a chunk takes its request to {needed} tokens; the cache holds {capacity}")
        run = Run(self.kernels.plan, packed=packed, lengths=offsets, slots=slot_ids, states=batch.states, record=record)
        hidden = self.model.hidden(input_ids, run)
        rows = hidden if all_logits else hidden[packed.last_indices()]
        batch.lengths = batch.lengths.index_add(0, slot_ids, added)
        return self.model.lm_head(rows).float()

    @torch.no_grad()
    def step(self, batch: DecodeBatch, tokens: torch.Tensor, record=None, topk_replay=None,
             record_scores=False) -> torch.Tensor:
        """tokens [B] (one per request) -> logits [B, V]; the caches advance by one. `topk_replay`
        {DSA layer: [B, W] cache positions} replays this step's selections."""
        replay = {layer: rows.to(self.model.device) for layer, rows in (topk_replay or {}).items()}
        logits = self._decode(batch, tokens, record, replay, record_scores)
        batch.lengths = batch.lengths + 1
        return logits

    def _decode(self, batch: DecodeBatch, tokens, record=None, topk_replay=None, record_scores=False):
        """One token per request through the model into the caches -> logits [B, V] (fp32); the
        caller advances the lengths."""
        run = Run(self.kernels.plan, lengths=batch.lengths, states=batch.states, record=record,
                  topk_replay=topk_replay or {}, record_scores=record_scores)
        return self.model.lm_head(self.model.hidden(tokens, run)).float()

    @torch.no_grad()
    def generate(self, prompts, params: SamplingParams, seed: int = 0, record_routing: bool = False,
                 record_topk: bool = False, graphs: bool | None = None) -> list[Completion]:
        """Sample a completion for every prompt (batched, different lengths). With record_routing,
        each completion carries the experts its tokens were routed to (for routing replay); with
        record_topk, the DSA positions they selected (for top-k replay). `graphs`: decode steps as
        one CUDA graph (None: where `can_graph()` and more than GRAPH_MIN_STEPS steps may run, so
        the capture pays for itself)."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt and every prompt needs at least one token")
        generator = torch.Generator(device=self.model.device).manual_seed(seed)
        capacity = max(len(p) for p in prompts) + params.max_new_tokens
        wanted = _recorded_sites(record_routing, record_topk)
        done = _new_completions(prompts, wanted)
        batch, logits = self.prefill(prompts, capacity, record=_pieces_recorder(done, prompts, wanted, packed_ids=True))
        if graphs is None:
            graphs = self.can_graph() and params.max_new_tokens > GRAPH_MIN_STEPS
        graph = None
        active, stop = [True] * len(prompts), set(params.stop_token_ids)
        for step in range(params.max_new_tokens):
            tokens, logprobs = sample(logits, params, generator)
            host_tokens, host_logprobs = _host_tokens(tokens, logprobs)
            for i in (i for i in range(len(prompts)) if active[i]):
                done[i].tokens.append(host_tokens[i])
                done[i].logprobs.append(host_logprobs[i])
                if done[i].tokens[-1] in stop:
                    done[i].finish_reason, active[i] = "stop", False
            if not any(active) or step == params.max_new_tokens - 1:
                break
            record = _step_recorder([(i, done[i]) for i in range(len(prompts)) if active[i]], wanted)
            if graphs and graph is None:
                graph = _graphed_or_eager(self, batch, wanted)
                graphs = graph is not None
            if graphs:
                logits = graph(tokens)
                graph.replay_records(record)
            else:
                logits = self.step(batch, tokens, record=record)
            if record is not None:
                record.close()
        for c in done:
            _close_records(c, wanted)
        return done

    @torch.no_grad()
    def generate_continuous(self, prompts, params: SamplingParams, max_batch: int, seed: int = 0,
                            max_new_tokens: list | None = None, record_routing: bool = False,
                            record_topk: bool = False, graphs: bool | None = None,
                            prefill_chunk: int | None = None) -> list[Completion]:
        """Continuous batching over `max_batch` cache slots (a SlotBatch): requests join when a slot
        frees (those joining together are prefilled together, between decode steps, or with
        `prefill_chunk` in pieces of at most that many tokens a step) and leave when they finish
        (stop token or their length limit: `max_new_tokens[i]`, else params'). Completions as
        `generate`, in the order of `prompts`; `graphs` as SlotBatch's."""
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("generate needs at least one prompt and every prompt needs at least one token")
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        limits = list(max_new_tokens) if max_new_tokens is not None else [params.max_new_tokens] * len(prompts)
        if len(limits) != len(prompts) or any(int(n) < 1 for n in limits):
            raise ValueError(f"max_new_tokens needs one limit >= 1 per prompt ({len(prompts)} prompts), got {limits}")
        capacity = max(len(p) + n for p, n in zip(prompts, limits))
        slots = SlotBatch(self, min(max_batch, len(prompts)), capacity, params, seed, record_routing, record_topk,
                          graphs=graphs, prefill_chunk=prefill_chunk)
        waiting, done = deque(range(len(prompts))), [None] * len(prompts)
        while waiting or slots.busy:
            joining = [waiting.popleft() for _ in range(min(slots.free, len(waiting)))]
            if joining:
                slots.join([prompts[i] for i in joining], [limits[i] for i in joining], joining)
            slots.step()
            for i, completion in slots.finished():
                done[i] = completion
        return done


class SlotBatch:
    """`slots` decode caches allocated once at `capacity` tokens each, shared by requests that come
    and go: `join` prefills new requests into free slots (zeroed first) and samples their first token;
    `step` advances every occupied slot by one token (the slots of the step's bucket run, static
    shapes per bucket; a free slot among them computes on a dummy token at position 0); `finished`
    hands back the completions that ended (stop token, their own length limit, or `cancelled(tag)`).
    One sampling setup for all requests (`params`), or, with `sampler`, each request its own: the
    sampler's `choose(logits, tags, outputs) -> (tokens, log-probs)` draws the rows' tokens and its
    `finish(tag, output) -> bool` says whether a request stops on its last token (glmkit serve's
    per-request SGLang sampling). The host reads the sampled tokens once per step.

    Steps run over the first `bucket` slots only, the smallest of 1, 2, 4, ... (and `slots`) that
    holds every request: when requests leave and the occupied count fits a smaller bucket, the
    requests above it move down into free slots (their caches copied), so a draining batch (the
    long tail of mixed response lengths) steps at the cost of its size, not of all slots.
    `graphs` (None: `engine.can_graph()`): every step is one replay of a CUDA graph, captured per
    bucket at its first use over views of the caches (their first `bucket` slots), which are the
    graphs' static buffers: joins, leaves and moves write them in place.

    `prefill_chunk` (None: whole prompts at `join`): prompts are prefilled in pieces between decode
    steps, at most that many prompt tokens per `step` (first come, first served), so a long prompt
    joining does not stall the requests decoding. A joining request waits in `prefill_rows` staging
    caches (at most that many at once; a staging row is a slot's worth of cache) until its prompt is
    in, then moves into a free slot and samples its first token; its slot is counted as taken from
    the join on (`free`)."""

    def __init__(self, engine: RolloutEngine, slots: int, capacity: int, params: SamplingParams, seed: int = 0,
                 record_routing: bool = False, record_topk: bool = False, cancelled=None,
                 graphs: bool | None = None, prefill_chunk: int | None = None, prefill_rows: int = 8,
                 sampler=None):
        if prefill_chunk is not None and prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1 token (None: whole prompts), got {prefill_chunk}")
        if prefill_rows < 1:
            raise ValueError(f"prefill_rows must be >= 1, got {prefill_rows}")
        device = engine.model.device
        self.engine, self.capacity, self.params, self.cancelled = engine, capacity, params, cancelled
        self.states = engine._empty_states(slots, capacity)
        self.lengths = torch.zeros(slots, dtype=torch.long, device=device)
        self.occupied = torch.zeros(slots, dtype=torch.bool, device=device)
        self.feed = torch.zeros(slots, dtype=torch.long, device=device)
        self.graphs = engine.can_graph() if graphs is None else graphs
        self.buckets = sorted({min(1 << i, slots) for i in range(slots.bit_length() + 1)})
        self.graph_of = {}  # bucket -> GraphedStep
        self.owner = [None] * slots  # (tag, Completion, limit) per slot, None when free
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.stop = set(params.stop_token_ids)
        self.sampler = sampler
        self.wanted = _recorded_sites(record_routing, record_topk)
        self.ended = []
        self.prefill_chunk = prefill_chunk
        self.joining = deque()  # _Joining requests whose prompts are being prefilled, in arrival order
        if prefill_chunk is not None:
            rows = min(slots, prefill_rows)
            self.staging = DecodeBatch(engine._empty_states(rows, capacity),
                                       torch.zeros(rows, dtype=torch.long, device=device))
            self.staged = [None] * rows  # the _Joining that holds each staging row

    @property
    def free(self) -> int:
        return sum(o is None for o in self.owner) - len(self.joining)

    @property
    def busy(self) -> bool:
        return bool(self.joining) or any(o is not None for o in self.owner)

    def join(self, prompts, limits, tags, prompt_rows=None):
        """Prefill `prompts` into free slots; each leaves after `limits[i]` tokens at the latest.
        `prompt_rows`, when given, is called with the prefill's final hidden states at every prompt
        token ([T, D], the prompts packed in order): a teacher-forced pass over the prompts at no extra
        forward. With `prefill_chunk` (and no `prompt_rows`), the prompts only queue here: `step`
        prefills them."""
        if self.free < len(prompts):
            raise ValueError(f"{len(prompts)} requests join but only {max(0, self.free)} slots are free")
        too_long = [len(p) + n for p, n in zip(prompts, limits) if len(p) + n > self.capacity]
        if too_long:
            raise ValueError(f"a request needs {too_long[0]} tokens of cache; the slots hold {self.capacity}")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        completions = _new_completions(prompts, self.wanted)
        if self.prefill_chunk is not None and prompt_rows is None:
            self.joining.extend(_Joining(tag, list(map(int, p)), int(n), c)
                                for tag, p, n, c in zip(tags, prompts, limits, completions))
            return None
        into = [s for s, o in enumerate(self.owner) if o is None][:len(prompts)]
        batch, logits = self.engine.prefill(prompts, self.capacity, rows=prompt_rows,
                                            record=_pieces_recorder(completions, prompts, self.wanted, packed_ids=True))
        for j, s in enumerate(into):
            for slot_state, new_state in zip(self.states, batch.states):
                _copy_into_slot(slot_state, new_state, s, j)
            self.lengths[s] = len(prompts[j])
            self.occupied[s] = True
            self.owner[s] = (tags[j], completions[j], int(limits[j]))
        self._take(logits, into)

    @torch.no_grad()
    def _prefill_chunks(self):
        """One round of chunked prefill: up to `prefill_chunk` prompt tokens of the joining requests
        (the oldest first) into their staging rows; a request whose prompt is complete moves into a
        free slot and samples its first token."""
        for j in [j for j in self.joining if self.cancelled is not None and self.cancelled(j.tag)]:
            j.completion.finish_reason = "abort"
            self._unstage(j)
            _close_records(j.completion, self.wanted)
            self.ended.append((j.tag, j.completion))
        for j in self.joining:
            if j.row is None and None in self.staged:
                j.row = self.staged.index(None)
                self.staged[j.row] = j
                for t in _cache_tensors_of(self.staging, j.row):
                    t.zero_()
                self.staging.lengths[j.row] = 0
        budget, chunks, going = self.prefill_chunk, [], []
        for j in (j for j in self.joining if j.row is not None):
            if budget == 0:
                break
            n = min(budget, len(j.prompt) - j.fed)
            chunks.append(j.prompt[j.fed:j.fed + n])
            going.append(j)
            budget -= n
        if not chunks:
            return
        record = _pieces_recorder([j.completion for j in going], chunks, self.wanted, packed_ids=False)
        logits = self.engine.extend(self.staging, chunks, slots=[j.row for j in going], record=record)
        ready = []
        for i, (j, chunk) in enumerate(zip(going, chunks)):
            j.fed += len(chunk)
            if j.fed == len(j.prompt):
                ready.append(i)
        into = [s for s, o in enumerate(self.owner) if o is None][:len(ready)]
        for i, s in zip(ready, into):
            j = going[i]
            for slot_state, staged_state in zip(self.states, self.staging.states):
                _copy_into_slot(slot_state, staged_state, s, j.row)
            self.lengths[s] = len(j.prompt)
            self.occupied[s] = True
            self.owner[s] = (j.tag, j.completion, j.limit)
            self._unstage(j)
        if ready:
            self._take(logits[ready], into)

    def _unstage(self, j):
        self.joining.remove(j)
        if j.row is not None:
            self.staged[j.row] = None

    @torch.no_grad()
    def step(self):
        if self.joining:
            self._prefill_chunks()
        fed = [s for s, o in enumerate(self.owner) if o is not None]
        if not fed:
            return
        size = self._bucket(len(fed))
        if fed[-1] >= size:  # requests sit above the bucket their count fits: move them down
            fed = self._compact(size)
        record = _step_recorder([(s, self.owner[s][1]) for s in fed], self.wanted)
        batch = DecodeBatch([_first_slots(state, size) for state in self.states], self.lengths[:size])
        if self.graphs and size not in self.graph_of:
            self.graph_of[size] = _graphed_or_eager(self.engine, batch, self.wanted)
            self.graphs = self.graph_of[size] is not None
        if self.graphs:
            logits = self.graph_of[size](self.feed[:size])  # lengths advance in place
            self.graph_of[size].replay_records(record)
        else:
            logits = self.engine.step(batch, self.feed[:size], record=record)
            self.lengths[:size].copy_(batch.lengths)
        if record is not None:
            record.close()
        self.lengths.masked_fill_(~self.occupied, 0)  # a free slot stays at position 0
        self._take(logits[fed], fed)

    def _bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def _compact(self, size: int) -> list:
        """Move the requests in slots >= size into the free slots below it -> the occupied slots."""
        holes = [s for s in range(size) if self.owner[s] is None]
        movers = [s for s in range(size, len(self.owner)) if self.owner[s] is not None]
        for hole, mover in zip(holes, movers):
            for state in self.states:
                for dst in _cache_tensors(state):
                    dst[hole].copy_(dst[mover])
            for flags in (self.lengths, self.feed, self.occupied):
                flags[hole] = flags[mover]
            self.occupied[mover], self.lengths[mover] = False, 0
            self.owner[hole], self.owner[mover] = self.owner[mover], None
        return [s for s, o in enumerate(self.owner) if o is not None]

    def evict_all(self) -> list:
        """Take every request out of the batch as it stands -> [(tag, Completion)] (records closed, slots
        freed), requests still prefilling included with no tokens: SGLang's retraction, after which a
        request is prefilled again (prompt + its tokens so far) to go on."""
        out = []
        for j in list(self.joining):
            self._unstage(j)
            _close_records(j.completion, self.wanted)
            out.append((j.tag, j.completion))
        for s, o in enumerate(self.owner):
            if o is not None:
                _close_records(o[1], self.wanted)
                out.append((o[0], o[1]))
                self.owner[s] = None
                self.occupied[s], self.lengths[s] = False, 0
        return out

    def live(self) -> list:
        """(tag, Completion) of every request holding a slot now."""
        return [(o[0], o[1]) for o in self.owner if o is not None]

    def finished(self) -> list:
        """(tag, Completion) of every request that ended since the last call."""
        out, self.ended = self.ended, []
        return out

    def _take(self, logits, where):
        if self.sampler is None:
            tokens, logprobs = _host_tokens(*sample(logits, self.params, self.generator))
        else:
            tokens, logprobs = self.sampler.choose(logits, [self.owner[s][0] for s in where],
                                                   [self.owner[s][1].tokens for s in where])
        for s, token, logprob in zip(where, tokens, logprobs):
            tag, c, limit = self.owner[s]
            c.tokens.append(token)
            c.logprobs.append(logprob)
            if token in self.stop if self.sampler is None else self.sampler.finish(tag, c.tokens):
                c.finish_reason = "stop"
            elif self.cancelled is not None and self.cancelled(tag):
                c.finish_reason = "abort"
            elif len(c.tokens) < limit:
                self.feed[s] = token
                continue
            _close_records(c, self.wanted)
            self.ended.append((tag, c))
            self.owner[s] = None
            self.occupied[s], self.lengths[s] = False, 0


@dataclass(eq=False)  # compared by identity: SlotBatch removes this very request from its queue
class _Joining:
    """A request of a SlotBatch whose prompt is being prefilled in chunks: `fed` prompt tokens are in
    staging row `row` (None until it gets one)."""

    tag: object
    prompt: list
    limit: int
    completion: Completion
    fed: int = 0
    row: int | None = None


# generate() captures its decode step as a CUDA graph only when more steps than this may run.
GRAPH_MIN_STEPS = 8


def _recorded_sites(routing: bool, topk: bool) -> dict:
    """{site recorded: the Completion field that keeps it} for routing and / or top-k replay."""
    return {**({"router_experts": "routing"} if routing else {}), **({"indexer_topk": "topk"} if topk else {})}


def _new_completions(prompts, wanted: dict) -> list:
    return [Completion(prompt=list(map(int, p)), routing={} if "routing" in wanted.values() else None,
                       topk={} if "topk" in wanted.values() else None) for p in prompts]


def _pieces_recorder(completions, pieces, wanted: dict, packed_ids: bool):
    """`record` for one forward over `pieces` packed in order (whole prompts in a prefill, or one
    round's chunks of them): each completion appends its piece's rows of the recorded sites, DSA
    selections as positions in the request (`packed_ids`: a prefill records packed ids; a chunk
    already records positions). None when nothing is recorded."""
    if not wanted:
        return None
    starts = [0, *itertools.accumulate(len(p) for p in pieces)]

    def record(layer, site, value):
        if site in wanted:
            host = value.cpu()  # one device-to-host copy per layer, not one per request
            for j, c in enumerate(completions):
                rows = host[starts[j]:starts[j + 1]]
                if site == "indexer_topk":
                    rows = (torch.where(rows >= 0, rows - starts[j], rows) if packed_ids else rows).to(torch.int32)
                getattr(c, wanted[site]).setdefault(layer, []).append(rows)
    return record


class _StepRecords:
    """The `record` observer of one decode step: it collects every layer's rows of the recorded
    sites, and `close()` hands each fed request [(batch row, Completion)] a reference to them, one
    [layers, B, k] host tensor per site (one device-to-host copy per site and step; a request's rows
    are picked out once, when it finishes: per layer and request they would cost more than the step)."""

    def __init__(self, fed, wanted: dict):
        self.fed, self.wanted, self.seen = fed, wanted, {}

    def __call__(self, layer, site, value):
        if site in self.wanted:
            self.seen.setdefault(site, []).append((layer, value))

    def close(self):
        for site, items in self.seen.items():
            layers = tuple(layer for layer, _ in items)
            stacked = torch.stack([value for _, value in items]).cpu()
            if site == "indexer_topk":
                stacked = stacked.to(torch.int32)
            for row, c in self.fed:
                c._step_rows.setdefault(site, []).append((layers, stacked, row))
        self.seen = {}


def _step_recorder(fed, wanted: dict):
    """A _StepRecords for a decode step, or None when nothing is recorded."""
    return _StepRecords(fed, wanted) if wanted else None


def _close_records(c, wanted: dict):
    """A finished completion's recorded rows, per layer, as one tensor each: its prefill rows, then
    one row per decode step."""
    for site, name in wanted.items():
        steps = c._step_rows.pop(site, [])
        if steps:
            layers = steps[0][0]
            if any(s[0] != layers for s in steps):
                raise RuntimeError(f"decode steps recorded {site} at different layers")
            picked = torch.stack([stacked[:, row] for _, stacked, row in steps])  # [steps, layers, k]
            for j, layer in enumerate(layers):
                getattr(c, name).setdefault(layer, []).append(picked[:, j])
        setattr(c, name, {layer: torch.cat(rows) for layer, rows in getattr(c, name).items()})


class GraphedStep:
    """`RolloutEngine.step` for one DecodeBatch, captured once as a CUDA graph and replayed: a decode
    step then costs the GPU's time, not Python's launches. The batch's caches and `lengths` are the
    graph's static buffers (updated in place by every replay: lengths advance by one); the tokens
    are copied in and the logits [B, V] (fp32) are one static tensor, overwritten by the next call.

    The step is graph-safe by construction: shapes depend only on the cache sizes, nothing is read
    back to the host, states are updated in place. `record_sites` (e.g. router_experts and
    indexer_topk for R3 and top-k replay) are kept as the graph's own tensors, which every replay
    rewrites: `replay_records` hands them to a `record` observer after each replay. Not in
    a graph: top-k replay into a step, indexer or router scores, the CPU. Needs the grouped MoE (bf16
    on CUDA): the per-expert loop reads expert counts back to the host."""

    def __init__(self, engine: RolloutEngine, batch: DecodeBatch, warmup: int = 2, record_sites=()):
        if batch.lengths.device.type != "cuda":
            raise ValueError(f"CUDA graphs need the caches on a CUDA device, got {batch.lengths.device}")
        self.engine, self.batch, self.sites = engine, batch, frozenset(record_sites)
        self.tokens = torch.zeros_like(batch.lengths)
        self.held = []  # (layer, site, tensor) the captured step recorded
        saved = [t.clone() for t in _decode_buffers(batch)]
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # compiles, autotune and the allocator's first sizes stay out of the graph
                for _ in range(warmup):
                    self._step()
            torch.cuda.current_stream().wait_stream(side)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.logits = self._step()
        finally:  # the warm-up steps (and a failed capture) wrote into the caches
            for t, s in zip(_decode_buffers(batch), saved):
                t.copy_(s)

    @torch.no_grad()
    def _step(self):
        self.held = []
        logits = self.engine._decode(self.batch, self.tokens, self._hold if self.sites else None)
        self.batch.lengths.add_(1)  # in place: the graph's lengths buffer
        return logits

    def _hold(self, layer, site, value):
        if site in self.sites:
            self.held.append((layer, site, value))  # the reference also keeps the graph from reusing it

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [B] -> logits [B, V], as RolloutEngine.step(batch, tokens)."""
        self.tokens.copy_(tokens)
        self.graph.replay()
        return self.logits

    def replay_records(self, record):
        """Call `record(layer, site, tensor)` for every recorded site of the last replay (the graph's
        own tensors: the observer copies what it keeps before the next replay)."""
        if record is not None:
            for layer, site, value in self.held:
                record(layer, site, value)


def _graphed_or_eager(engine: RolloutEngine, batch: DecodeBatch, record_sites):
    """A GraphedStep for `batch`, or None (with a one-line warning: the caller steps eagerly) when the
    step cannot be captured, e.g. a module that reads a value back to the host mid-step."""
    try:
        return GraphedStep(engine, batch, record_sites=record_sites)
    except RuntimeError as err:
        warnings.warn(f"decode step not captured as a CUDA graph, running it eagerly: {str(err).splitlines()[0]}",
                      stacklevel=3)
        return None


def _capacity(batch: DecodeBatch) -> int:
    """Tokens each request's cache holds: the length axis of the first DSA latent cache (a model of
    KDA layers only has no such limit)."""
    for state in batch.states:
        if hasattr(state, "latent"):
            return state.latent.shape[1]
    return 1 << 62


def _cache_tensors(state):
    """Every tensor of one layer's cache, nested caches (a DSA layer's indexer) included, in field order."""
    for f in fields(state):
        value = getattr(state, f.name)
        if is_dataclass(value):
            yield from _cache_tensors(value)
        elif value is not None:
            yield value


def _cache_tensors_of(batch: DecodeBatch, row: int):
    """Row `row` (views) of every cache tensor of a DecodeBatch."""
    for state in batch.states:
        for t in _cache_tensors(state):
            yield t[row]


def _first_slots(state, n: int):
    """A layer's cache restricted to its first n slots: views, so that steps write the full cache."""
    return replace(state, **{f.name: (_first_slots(v, n) if is_dataclass(v) else v[:n] if v is not None else None)
                             for f in fields(state) for v in (getattr(state, f.name),)})


def _decode_buffers(batch: DecodeBatch):
    """Every tensor a decode step reads or writes in place: the lengths and each layer's cache."""
    yield batch.lengths
    for state in batch.states:
        yield from _cache_tensors(state)


def _copy_into_slot(slot_state, new_state, slot: int, row: int):
    """Request `row` of a freshly prefilled layer state -> slot `slot` of the engine's slot state.
    Both are caches of the same layer (same fields); capacity axes may be shorter in the new state:
    the slot is zeroed first, so nothing of its previous request survives."""
    for dst, src in zip(_cache_tensors(slot_state), _cache_tensors(new_state)):
        dst[slot].zero_()
        dst[slot][tuple(slice(0, n) for n in src.shape[1:])] = src[row]


def _host_tokens(tokens: torch.Tensor, logprobs: torch.Tensor) -> tuple[list, list]:
    """Sampled tokens [B] and their log-probs [B] as host lists, from one device-to-host copy (fp64
    holds every token id and every fp32 log-prob exactly)."""
    host = torch.stack([tokens.double(), logprobs.double()]).cpu()
    return [int(t) for t in host[0].tolist()], host[1].tolist()


def sample(logits: torch.Tensor, params: SamplingParams, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (tokens [B], log-prob of each under softmax(logits / T), untruncated). A row
    holding a NaN or an infinity (weights that overflow; judged as the server's sampler judges it) gets
    an arbitrary token and a NaN log-prob, for the caller to see; the other rows are untouched."""
    broken = ~logits.isfinite().all(-1)
    if params.temperature < GREEDY_BELOW:
        logp = torch.log_softmax(logits.float(), -1)
        tokens = logp.argmax(-1)
    else:
        logp = torch.log_softmax(logits.float() / params.temperature, -1)
        probs = logp.exp()
        if params.top_p < 1:
            sorted_p, order = probs.sort(-1, descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p >= params.top_p  # keeps the first token always
            probs = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        # a broken row draws from uniform weights, where multinomial would raise for the whole batch
        # (no sync here)
        tokens = torch.multinomial(torch.where(broken[:, None], 1.0, probs), 1, generator=generator)[:, 0]
    return tokens, logp.gather(-1, tokens[:, None])[:, 0].masked_fill(broken, float("nan"))
