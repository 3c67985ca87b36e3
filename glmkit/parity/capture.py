"""Capture adapters: run a path on token sequences and collect every site, one row per token.

- `capture_train`:     glmkit's train path (packed).
- `capture_rollout`:   glmkit's rollout engine: prefill of each prompt, then the rest of the sequence
                       fed one token per decode step (teacher forcing), stitched back to per-token rows.
- `capture_reference`: transformers' glm5_next through forward hooks on its modules.
- `HookCapturer`:      any torch model (a Megatron or SGLang process) given a module-name -> site map.

Canonical forms, so paths compare row by row: index sites are sorted per row (indexer positions
sequence-local, -1 first), router weights are ordered like their sorted expert ids.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from glmkit.kernels.backends import Backends
from glmkit.model.packed import Packed, pack
from glmkit.model.train import next_token_targets, token_logprobs
from glmkit.parity.dump import Capture


def canonical(site: str, rows: torch.Tensor, extra: torch.Tensor | None = None):
    """Sort index rows; for router weights, order them like the sorted experts (`extra`)."""
    if site in ("indexer_topk", "router_experts"):
        return rows.to(torch.int64).sort(-1).values
    if site == "router_weights" and extra is not None:
        return rows.float().gather(-1, extra.to(torch.int64).argsort(-1))
    return rows


class _Collector:
    """Receives (layer, site, rows) and stores canonical rows at the given token indices."""

    def __init__(self, capture: Capture, total: int):
        self.capture, self.total, self.pending_experts = capture, total, {}

    def put(self, layer, site, rows, index=None):
        rows = rows.detach()
        if site == "router_experts":
            self.pending_experts[layer] = rows
        extra = self.pending_experts.get(layer) if site == "router_weights" else None
        rows = canonical(site, rows, extra).to("cpu")
        key = (layer, site)
        if index is None:
            self.capture.put(layer, site, rows)
            return
        store = self.capture.tensors.get(key)
        empty = {"indexer_topk": -1, "indexer_scores": float("-inf")}.get(site, 0)
        if store is None:
            store = torch.full((self.total, *rows.shape[1:]), empty, dtype=rows.dtype)
            self.capture.tensors[key] = store
        if site == "indexer_scores" and rows.shape[1] != store.shape[1]:
            # pool scores grow by one pool every kpool decode steps: pad to the widest so far
            width = max(rows.shape[1], store.shape[1])
            store = torch.nn.functional.pad(store, (0, width - store.shape[1]), value=empty)
            rows = torch.nn.functional.pad(rows, (0, width - rows.shape[1]), value=empty)
            self.capture.tensors[key] = store
        store[index] = rows


def _manifest(path: str, model_config, dtype, device, **extra) -> dict:
    from glmkit import __version__
    from glmkit.config import describe

    return {"path": path, "model": describe(model_config), "dtype": str(dtype).replace("torch.", ""),
            "device": str(device), "mode": "end-to-end", "glmkit": __version__,
            "index_kpool": model_config.index_kpool, **extra}


def _local(topk: torch.Tensor, packed: Packed) -> torch.Tensor:
    """Packed (global) token ids -> positions inside each row's own sequence."""
    return packed.to_local(topk)


@torch.no_grad()
def capture_train(model, sequences, backends: Backends | str | None = None, keep_logits: bool = False,
                  topk_replay: dict | None = None, **manifest) -> Capture:
    """`topk_replay` {DSA layer: [T, W] sequence-local positions} (e.g. another capture's
    `indexer_topk` rows) makes every DSA layer use those selections."""
    from glmkit.model import TrainPath

    input_ids, packed = pack(sequences, device=model.device)
    capture = Capture(input_ids.cpu(), packed.cu_seqlens.cpu(),
                      manifest=_manifest("train", model.config, model.dtype, model.device, **manifest))
    sink = _Collector(capture, packed.num_tokens)

    def record(layer, site, value):
        if site == "logits" and not keep_logits:
            return
        if site == "indexer_topk":
            value = _local(value, packed)
        sink.put(layer, site, value)

    TrainPath(model, backends).forward(input_ids=input_ids, packed=packed, record=record, return_logits=keep_logits,
                                       topk_replay=topk_replay, record_scores=True)
    return capture


@torch.no_grad()
def capture_rollout(model, sequences, prompt_lengths, backends: Backends | str | None = None,
                    topk_replay: dict | None = None, keep_logits: bool = False, **manifest) -> Capture:
    """Prefill sequence[:p] for each prompt length p, then decode the remaining tokens one per step.
    `topk_replay` as in capture_train (rows of every token, prompt and decoded). `keep_logits`: the
    (None, "logits") site too, the prefill's rows and each decode step's."""
    from glmkit.model import RolloutEngine

    seqs = [list(map(int, s)) for s in sequences]
    if len(prompt_lengths) != len(seqs) or any(not 0 < p <= len(s) for p, s in zip(prompt_lengths, seqs)):
        raise ValueError(f"prompt lengths {list(prompt_lengths)} must be in 1..len(sequence) for each of "
                         f"the {len(seqs)} sequences (lengths {[len(s) for s in seqs]})")
    input_ids, packed = pack(seqs)
    targets = next_token_targets(input_ids, packed)
    capture = Capture(input_ids, packed.cu_seqlens,
                      manifest=_manifest("rollout", model.config, model.dtype, model.device,
                                         prompt_lengths=list(prompt_lengths), **manifest))
    sink = _Collector(capture, packed.num_tokens)
    engine = RolloutEngine(model, backends)
    starts = packed.cu_seqlens[:-1]
    prompt_rows = torch.cat([torch.arange(s, s + p) for s, p in zip(starts.tolist(), prompt_lengths)])
    prompt_packed = Packed.from_lengths(prompt_lengths, device=model.device)

    def record_prefill(layer, site, value):
        if site == "indexer_topk":
            value = _local(value, prompt_packed)
        if site != "logits":
            sink.put(layer, site, value, prompt_rows)

    remaining = max(len(s) - p for s, p in zip(seqs, prompt_lengths))
    replay = {layer: torch.as_tensor(rows) for layer, rows in (topk_replay or {}).items()}
    batch, logits = engine.prefill([s[:p] for s, p in zip(seqs, prompt_lengths)], max(map(len, seqs)),
                                   all_logits=True, record=record_prefill, record_scores=True,
                                   topk_replay={layer: rows[prompt_rows] for layer, rows in replay.items()})
    sink.put(None, "logprobs", token_logprobs(logits.cpu(), targets[prompt_rows]), prompt_rows)
    if keep_logits:
        sink.put(None, "logits", logits, prompt_rows)
    for j in range(remaining):
        active = [n for n, (s, p) in enumerate(zip(seqs, prompt_lengths)) if p + j < len(s)]
        rows = torch.tensor([int(starts[n]) + prompt_lengths[n] + j for n in active])
        feed = torch.tensor([s[p + j] if p + j < len(s) else 0 for s, p in zip(seqs, prompt_lengths)],
                            device=model.device)

        def record_step(layer, site, value, active=active, rows=rows):
            if site != "logits":
                sink.put(layer, site, value[active], rows)

        step_replay = {}
        for layer, all_rows in replay.items():
            step_replay[layer] = torch.full((len(seqs), all_rows.shape[1]), -1, dtype=torch.long)
            step_replay[layer][active] = all_rows[rows].long()
        step_logits = engine.step(batch, feed, record=record_step, topk_replay=step_replay, record_scores=True)
        sink.put(None, "logprobs", token_logprobs(step_logits[active].cpu(), targets[rows]), rows)
        if keep_logits:
            sink.put(None, "logits", step_logits[active], rows)
    return capture


def capture_sglang(url: str, sequences, model_config, **manifest) -> Capture:
    """A server speaking SGLang's native API, teacher-forced: each whole sequence sent with
    max_new_tokens 0, logprob_start_len 0, routed experts and DSA selections. Its sites: `logprobs`
    (row t: log-prob of token t+1; 0 on each sequence's last row), `router_experts` per MoE layer and
    `indexer_topk` per DSA layer (what the server reports; no hidden states)."""
    from glmkit.serve.client import (SGLangClient, answer_read, decode_indexer_topk, decode_routed_experts,
                                     model_layers)

    seqs = [list(map(int, s)) for s in sequences]
    input_ids, packed = pack(seqs)
    client = SGLangClient(url)
    info = {**client.server_info(), **client.model_info()}
    capture = Capture(input_ids, packed.cu_seqlens,
                      manifest=_manifest("sglang", model_config, info.get("dtype", "?"), info.get("device", "?"),
                                         server=url, weight_version=info.get("weight_version"), **manifest))
    sink = _Collector(capture, packed.num_tokens)
    # SGLang reports routing for every token but the last it was sent: one token (0) more is sent, so
    # that every token of the sequence has its row (causal: the extra one changes none of them)
    answers = client.generate(input_ids=[s + [0] for s in seqs], sampling_params={"max_new_tokens": 0, "temperature": 1.0},
                              return_logprob=True, logprob_start_len=0, return_routed_experts=True,
                              return_indexer_topk=True)
    num_layers, moe, dsa = model_layers(model_config)
    logprobs = torch.zeros(packed.num_tokens)
    for i, (seq, (s, e), answer) in enumerate(zip(seqs, packed.bounds(), answers)):
        with answer_read(url, i):
            meta = answer["meta_info"]
            given = [lp for lp, *_ in meta["input_token_logprobs"]][:len(seq)]  # the first is null (no context)
            if len(given) != len(seq):
                raise ValueError(f"{len(given)} input log-probs for a sequence of {len(seq)} tokens")
            logprobs[s:e - 1] = torch.tensor([float(lp) for lp in given[1:]], dtype=torch.float32)
            rows = torch.arange(s, e)
            if "routed_experts" in meta:
                for layer, values in decode_routed_experts(meta, len(seq), num_layers, moe).items():
                    sink.put(layer, "router_experts", values, rows)
            if "indexer_topk" in meta and dsa:
                for layer, values in decode_indexer_topk(meta, len(seq), dsa).items():
                    sink.put(layer, "indexer_topk", values, rows)
    sink.put(None, "logprobs", logprobs)
    return capture


@torch.no_grad()
def capture_reference(ref, sequences, topk_replay: dict | None = None, keep_logits: bool = False,
                      **manifest) -> Capture:
    """transformers' Glm5NextForConditionalGeneration, one unpadded sequence at a time, through hooks.
    `topk_replay` as in capture_train: a hook replaces each full indexer's output with those rows.
    `keep_logits`: the (None, "logits") site too, fp32."""
    text = ref.model.language_model
    config = ref.config.get_text_config()
    input_ids, packed = pack(sequences)
    capture = Capture(input_ids, packed.cu_seqlens,
                      manifest=_manifest("reference", config, ref.dtype, ref.device, **manifest))
    sink = _Collector(capture, packed.num_tokens)
    targets = next_token_targets(input_ids, packed)
    rows_now = {}

    def put(layer, site, value):
        sink.put(layer, site, value.flatten(0, 1), rows_now["rows"])

    last_topk = {}
    replay = None
    if topk_replay:
        replay = lambda i: topk_replay[i][rows_now["rows"]] if i in topk_replay else None  # noqa: E731
    hooks = [h for i, layer in enumerate(text.layers) for h in hook_reference_layer(layer, i, put, last_topk, replay)]
    hooks.append(text.norm.register_forward_hook(lambda m, a, out: put(None, "final_hidden", out)))
    try:
        for n, (start, end) in enumerate(packed.bounds()):
            rows_now["rows"] = torch.arange(start, end)
            ids = input_ids[start:end][None].to(ref.device)
            logits = ref(input_ids=ids).logits[0].float().cpu()
            sink.put(None, "logprobs", token_logprobs(logits, targets[start:end]), rows_now["rows"])
            if keep_logits:
                sink.put(None, "logits", logits, rows_now["rows"])
    finally:
        for h in hooks:
            h.remove()
    return capture


def reference_index_scores(indexer, hidden_states, q_resid, attention_mask) -> torch.Tensor:
    """The pool scores transformers' indexer ranks, [B, S, pools] fp32 with -inf where a pool is not a
    candidate, recomputed from its own submodules and pooling on the inputs it received (its forward
    keeps them local). The comparison checks that its selection is a top-k of these scores before it
    calls a difference a tie, so a recomputation that drifted would be reported, not trusted."""
    m = indexer
    B, S = hidden_states.shape[:2]
    q = m.wq_b(q_resid).view(B, S, -1, m.head_dim)
    k = m.k_norm(m.wk(hidden_states)).view(B, S, -1, m.head_dim).squeeze(2)
    gate = torch.nn.functional.linear(hidden_states, m.index_kpool_compress_gate)
    packed_states = torch.cat([k, gate, attention_mask.to(k.dtype)[..., None]], dim=-1)
    visible = m.get_visible_tokens(valid_keys=packed_states[..., -1].bool(), q_length=S, current_length=S)
    pool_keys, pool_indices, pool_valid = m.get_pooled_states(packed_states=packed_states)
    scores = torch.relu(torch.matmul(q.float(), pool_keys.transpose(-1, -2).float().unsqueeze(1)) * m.softmax_scale)
    weights = m.weights_proj(hidden_states.to(m.weights_proj.weight.dtype)).float() * m.n_heads ** -0.5
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    pool_end = pool_indices[..., -1].clamp(0, S - 1)
    candidate = visible.gather(-1, pool_end[:, None, :].expand(B, S, -1)) & pool_valid[:, None]
    return index_scores.masked_fill(~candidate, float("-inf"))


def hook_reference_layer(layer, i: int, put, last_topk: dict, replay=None) -> list:
    """Forward hooks on one transformers decoder layer reporting its sites to put(layer, site, tensor).
    `last_topk` carries a full indexer's selection to the "shared" DSA layer after it. `replay(i)`,
    when given, returns rows [S, W] (sequence-local, -1 empty) that replace this layer's full
    indexer output (all-empty rows keep its own choice)."""
    hooks = []

    def add(module, fn, pre=False):
        # hooks must return None, or torch would replace the module's output with their result
        def call(m, args, out=None):
            fn(args, out)

        hooks.append(module.register_forward_pre_hook(lambda m, a: call(m, a)) if pre
                     else module.register_forward_hook(call))

    def first(out):
        return out[0] if isinstance(out, tuple) else out

    for prefix in ("attn_hc", "ffn_hc"):
        add(getattr(layer, prefix), lambda a, out, p=prefix: [put(i, f"{p}.post", out[0]), put(i, f"{p}.comb", out[1])])
    add(layer.input_layernorm, lambda a, out: put(i, "attn_in", out))
    add(layer.self_attn, lambda a, out: put(i, "attn_out", first(out)))
    if getattr(layer.self_attn, "indexer", None) is not None:
        def indexer_hook(m, args, kwargs, out):
            inputs = dict(zip(("hidden_states", "q_resid", "attention_mask"), args)) | kwargs
            last_topk["scores"] = reference_index_scores(m, inputs["hidden_states"], inputs["q_resid"],
                                                         inputs["attention_mask"])
            put(i, "indexer_scores", last_topk["scores"])
            put(i, "indexer_topk", out)  # its own choice, replayed or not (as glmkit's paths report)
            last_topk["own"] = out
            rows = replay(i) if replay is not None else None
            if rows is not None:
                from glmkit.model.dsa import replayed

                out = replayed(out[0], rows.to(out.device))[None].to(out.dtype)
            return out

        hooks.append(layer.self_attn.indexer.register_forward_hook(indexer_hook, with_kwargs=True))
    elif layer.block_type != "linear_attention":
        add(layer.self_attn, lambda a, out: [put(i, "indexer_scores", last_topk["scores"]),
                                             put(i, "indexer_topk", last_topk["own"])], pre=True)
    add(layer.ffn_hc, lambda a, out: put(i, "streams_after_attn", a[0]), pre=True)
    add(layer.post_attention_layernorm, lambda a, out: put(i, "mlp_in", out))
    if hasattr(layer.mlp, "gate") and hasattr(layer.mlp, "experts"):
        add(layer.mlp.gate, lambda a, out: [
            put(i, "router_scores", (out[0].float().sigmoid() + layer.mlp.gate.e_score_correction_bias)[None]),
            put(i, "router_experts", out[2][None]), put(i, "router_weights", out[1][None])])
    add(layer.mlp, lambda a, out: put(i, "mlp_out", out))
    add(layer, lambda a, out: put(i, "streams_after_ffn", first(out)))
    return hooks


@dataclass(frozen=True)
class Tap:
    """One place a HookCapturer listens, for site maps that need more than "this module's output is
    that site". `handler(capturer, layer, name, module, args, kwargs, output)` reports rows with
    `capturer.put(layer, site, rows)`. `on`: "forward" (a forward hook), "pre" (a forward pre-hook;
    output is None) or "method:NAME" (the module's method NAME, wrapped on the instance for the
    capture and restored on exit; modules without that method are left alone)."""

    handler: Callable
    on: str = "forward"


class HookCapturer:
    """Capture any torch model in glmkit's format from a map of module-name patterns to sites.

        site_map = {r"decoder\\.layers\\.(\\d+)\\.mlp$": "mlp_out", r"final_norm$": "final_hidden"}
        with HookCapturer(model, site_map) as cap:
            model(tokens)                       # however that framework runs
        capture = cap.to_capture(input_ids, cu_seqlens, path="megatron")

    A pattern's first group (if any) is the layer number (`layer(name, module, match)` overrides that,
    e.g. for a pipeline stage's offset). `rows(module_name, output)` turns a module output into
    [tokens, ...] rows in the input's token order (default: first tensor of the output, leading dims
    flattened); give one that undoes the framework's layout ([S, B, D], padding, ...). A site_map value
    may also be a `Tap` (or a list of them) for outputs that need converting or methods that produce
    a site without being a module (glmkit.parity.site_maps builds those for Megatron and SGLang).
    `model` may be a list of modules (virtual pipeline chunks).
    """

    def __init__(self, model, site_map: dict, rows=None, layer=None):
        self.model, self.rows = model, rows or self._default_rows
        self.patterns = [(re.compile(p), taps) for p, taps in site_map.items()]
        self.layer_of = layer or (lambda name, module, m: int(m.group(1)) if m.groups() else None)
        self.outputs, self.hooks, self.patched, self.modules = {}, [], [], {}

    @staticmethod
    def _default_rows(name, output):
        t = output[0] if isinstance(output, (tuple, list)) else output
        return t.flatten(0, 1) if t.dim() > 2 else t

    def chunks(self) -> list:
        return list(self.model) if isinstance(self.model, (list, tuple)) else [self.model]

    def put(self, layer, site, rows: torch.Tensor):
        """Add rows (the next tokens in order) to (layer, site)."""
        self.outputs.setdefault((layer, site), []).append(rows.detach().cpu())

    def __enter__(self):
        try:
            for chunk in self.chunks():
                self.modules = dict(chunk.named_modules())  # names repeat across chunks: look up in this one
                for name, module in self.modules.items():
                    for pattern, taps in self.patterns:
                        m = pattern.search(name)
                        if m:
                            layer = self.layer_of(name, module, m)
                            for tap in taps if isinstance(taps, (list, tuple)) else [taps]:
                                self._attach(tap, layer, name, module)
        except BaseException:
            self.__exit__()
            raise
        return self

    def _attach(self, tap, layer, name, module):
        if isinstance(tap, str):
            self.hooks.append(module.register_forward_hook(
                lambda mod, a, out, key=(layer, tap), name=name: self.put(*key, self.rows(name, out))))
            return

        def call(args, kwargs, out):
            tap.handler(self, layer, name, module, args, kwargs, out)

        if tap.on == "forward":  # hooks return None: torch would otherwise replace the module's output
            self.hooks.append(module.register_forward_hook(
                lambda mod, a, kw, out: call(a, kw, out), with_kwargs=True))
        elif tap.on == "pre":
            self.hooks.append(module.register_forward_pre_hook(
                lambda mod, a, kw: call(a, kw, None), with_kwargs=True))
        elif tap.on.startswith("method:"):
            method = tap.on.split(":", 1)[1]
            original = getattr(module, method, None)
            if not callable(original):
                return
            own = method in module.__dict__

            def wrapped(*args, **kwargs):
                out = original(*args, **kwargs)
                call(args, kwargs, out)
                return out

            self.patched.append((module, method, module.__dict__[method] if own else None, own))
            object.__setattr__(module, method, wrapped)
        else:
            raise ValueError(f"Tap.on={tap.on!r}: expected 'forward', 'pre' or 'method:NAME'")

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        for module, method, previous, own in reversed(self.patched):
            if own:
                object.__setattr__(module, method, previous)
            else:
                delattr(module, method)
        self.hooks, self.patched = [], []

    def to_capture(self, input_ids, cu_seqlens, **manifest) -> Capture:
        capture = Capture(torch.as_tensor(input_ids), torch.as_tensor(cu_seqlens),
                          manifest={"mode": "end-to-end", **manifest})
        tokens = capture.input_ids.numel()
        for (layer, site), chunks in self.outputs.items():
            rows = torch.cat(chunks)
            if rows.shape[0] != tokens:
                where = "final" if layer is None else f"layer {layer}"
                raise ValueError(f"{where} {site}: {rows.shape[0]} rows captured for {tokens} input tokens "
                                 f"(a module that ran a different number of times or on other tokens)")
            experts = self.outputs.get((layer, "router_experts")) if site == "router_weights" else None
            capture.put(layer, site, canonical(site, rows, torch.cat(experts) if experts else None))
        return capture
