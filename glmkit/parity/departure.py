"""Which side departs first? Two captures of the live stack (framework dumps, or any two paths) lined up
token by token, each compared with a third path (the reference, or glmkit's train path), and the same for
gradients.

- `align(a, b)`: the sequences both hold, matched by their tokens (one may be a prefix of the other: an
  engine never forwards the last token it samples, the trainer does), cut to their common length.
- `rescore(capture, model)`: the candidate scores a tie judgement needs, recomputed from the checkpoint on
  the capture's own inputs to the indexer (`attn_in`) and router (`mlp_in`) where the dump lacks them.
- `departure(a_vs_ref, b_vs_ref, a_vs_b)`: the side whose first divergence from the third path comes
  first in the block order (for gradients: in the backward order), where, and whether index differences
  there were ties.
- `capture_gradients(path, checkpoint, sequences)`: gradients of glmkit's train path or the reference at
  every site and parameter, for the loss stated in the capture's manifest.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from glmkit.comparison import GRADIENT_THRESHOLDS  # noqa: F401 - re-exported for callers
from glmkit.model.sites import AUX_SITES, INDEX_SITES
from glmkit.parity.compare import ParityResult, site_order
from glmkit.parity.dump import Capture

GRADIENT_LOSS = "mean over predicted tokens of -log p(next token), temperature 1 (next-token cross-entropy)"


def sequences_of(capture: Capture) -> list[list[int]]:
    ids, cu = capture.input_ids.tolist(), capture.cu_seqlens.tolist()
    return [ids[s:e] for s, e in zip(cu[:-1], cu[1:])]


def _common_prefix(x: list, y: list) -> int:
    n = 0
    for p, q in zip(x, y):
        if p != q:
            break
        n += 1
    return n


def _gather(capture: Capture, rows: torch.Tensor, sequences: list, manifest: dict) -> Capture:
    ids = torch.tensor([t for s in sequences for t in s], dtype=torch.long)
    cu = torch.tensor([0] + [len(s) for s in sequences]).cumsum(0)
    out = Capture(ids, cu, manifest=manifest)
    for key, t in capture.tensors.items():
        out.tensors[key] = t[rows] if t.shape[0] == capture.input_ids.shape[0] else t
    return out


def align(a: Capture, b: Capture) -> tuple[Capture, Capture, list[str]]:
    """Both captures on the sequences they share, in A's order: each of A's sequences paired with the
    unused sequence of B that agrees with it longest from position 0 (one a prefix of the other), both cut
    to that length. Row shapes that differ only in layout ([n*C] vs [n, C]) take A's. -> (a, b, notes)."""
    seqs_a, seqs_b = sequences_of(a), sequences_of(b)
    starts_a, starts_b = a.cu_seqlens.tolist(), b.cu_seqlens.tolist()
    used, pairs, notes = set(), [], []
    for i, sa in enumerate(seqs_a):
        best, best_len = None, 0
        for j, sb in enumerate(seqs_b):
            n = _common_prefix(sa, sb)
            if j not in used and n == min(len(sa), len(sb)) and n > best_len:
                best, best_len = j, n
        if best is None or best_len < 2:
            notes.append(f"{a.manifest.get('path', 'a')}: sequence {i} ({len(sa)} tokens) has no counterpart in "
                         f"{b.manifest.get('path', 'b')}: left out")
            continue
        used.add(best)
        pairs.append((i, best, best_len))
        if len(sa) != len(seqs_b[best]):
            notes.append(f"sequence {i}: {len(sa)} tokens vs {len(seqs_b[best])}; compared on the first {best_len}")
    left = [j for j in range(len(seqs_b)) if j not in used]
    if left:
        notes.append(f"{b.manifest.get('path', 'b')}: {len(left)} sequence(s) with no counterpart left out")
    if not pairs:
        raise ValueError(f"{a.manifest.get('path', 'a')} and {b.manifest.get('path', 'b')} share no sequence (they ran on different inputs): "
                         f"token lengths {[len(s) for s in seqs_a]} vs {[len(s) for s in seqs_b]}, no pair agrees "
                         f"from position 0 (were they dumped on the same rollout?)")
    rows_a = torch.cat([torch.arange(starts_a[i], starts_a[i] + n) for i, _, n in pairs])
    rows_b = torch.cat([torch.arange(starts_b[j], starts_b[j] + n) for _, j, n in pairs])
    sequences = [seqs_a[i][:n] for i, _, n in pairs]
    out_a = _gather(a, rows_a, sequences, dict(a.manifest, aligned_sequences=[i for i, _, _ in pairs]))
    out_b = _gather(b, rows_b, sequences, dict(b.manifest, aligned_sequences=[j for _, j, _ in pairs]))
    conform(out_b, out_a)
    return out_a, out_b, notes


def conform(capture: Capture, like: Capture) -> Capture:
    """Value rows laid out as `like`'s where only the layout differs ([n*C] vs [n, C], a squeezed 1), so
    the two compare element by element. In place; -> capture."""
    for key in set(capture.tensors) & set(like.tensors):
        t, ref = capture.tensors[key], like.tensors[key]
        if key[1] in AUX_SITES and t.dim() == ref.dim() == 2 and t.shape[1] != ref.shape[1]:
            # candidate scores of the pools seen so far: each side padded to the longest sequence it holds
            width = max(t.shape[1], ref.shape[1])
            for c, v in ((capture, t), (like, ref)):
                c.tensors[key] = torch.nn.functional.pad(v, (0, width - v.shape[1]), value=float("-inf"))
            continue
        if t.shape != ref.shape and t.shape[0] == ref.shape[0] and t[0].numel() == ref[0].numel() \
                and key[1] not in INDEX_SITES:
            capture.tensors[key] = t.reshape(ref.shape)
    return capture


@torch.no_grad()
def rescore(capture: Capture, model) -> list[str]:
    """Fill the candidate scores a capture lacks from glmkit's model of the checkpoint, on the capture's
    own inputs: indexer scores of each DSA layer from its `attn_in` (a shared indexer's from the layer it
    shares), router scores of each MoE layer from its `mlp_in`. -> notes naming what was recomputed."""
    from glmkit.model.packed import Packed

    notes, last_scores = [], None
    packed = Packed.from_lengths(capture.lengths, device=model.device)
    for block in model.layers:
        L = block.layer
        x = capture.tensors.get((L, "attn_in"))
        if block.kind == "dsa" and (L, "indexer_topk") in capture.tensors:
            if block.self_attn.indexer is not None:
                last_scores = None
                if x is not None and x.shape[-1] == block.input_layernorm.weight.shape[0]:
                    x = x.to(model.device, model.dtype)
                    q_resid = block.self_attn.q_a_layernorm(block.self_attn.q_a_proj(x))
                    found = []
                    block.self_attn.indexer.select_packed(x, q_resid, packed, on_scores=found.append)
                    last_scores = found[0].float().cpu()
            if (L, "indexer_scores") not in capture.tensors and last_scores is not None:
                capture.tensors[(L, "indexer_scores")] = last_scores
                notes.append(f"layer {L} indexer_scores recomputed from the checkpoint on this side's attn_in")
        y = capture.tensors.get((L, "mlp_in"))
        if block.is_moe and (L, "router_experts") in capture.tensors and (L, "router_scores") not in capture.tensors \
                and y is not None and y.shape[-1] == block.mlp.gate.weight.shape[1]:
            gate = block.mlp.gate
            scores = torch.nn.functional.linear(y.float().to(model.device), gate.weight.float()).sigmoid()
            capture.tensors[(L, "router_scores")] = (scores + gate.e_score_correction_bias).cpu()
            notes.append(f"layer {L} router_scores recomputed from the checkpoint on this side's mlp_in")
    capture.manifest.setdefault("rescored", []).extend(notes)
    return notes


@dataclass
class Departure:
    """Which side departs first from the third path, and where."""

    side: str                # "a", "b", "both" (same site), "neither", or "each other" (both within the
    #                          third path's thresholds, yet apart from each other)
    path: str | None         # the departing path's name
    layer: int | None
    site: str | None
    tied_before: list        # index sites up to there whose differences from the third path were all ties
    third: str
    text: str

    def to_json(self) -> dict:
        return {"side": self.side, "path": self.path, "layer": self.layer, "site": self.site,
                "tied_before": self.tied_before, "third_path": self.third, "text": self.text}


def departure(a_vs_ref: ParityResult, b_vs_ref: ParityResult, a_vs_b: ParityResult | None = None,
              backward: bool = False) -> Departure:
    """Name the side whose first divergence from the third path comes first (block order, or backward
    order for gradients)."""
    third = a_vs_ref.path_b
    fa, fb = a_vs_ref.first_divergence, b_vs_ref.first_divergence
    key = lambda r: site_order((r.layer, r.site), backward)  # noqa: E731
    ties = sorted({f"layer {s.layer} {s.site}" for r in (a_vs_ref, b_vs_ref) for s in r.sites
                   if s.kind == "indices" and s.tied and not s.diverged})
    if fa is None and fb is None:
        if a_vs_b is not None and a_vs_b.first_divergence is not None:
            f = a_vs_b.first_divergence
            return Departure("each other", None, f.layer, f.site, ties, third,
                             f"neither departs from {third}, but they differ from each other first at layer "
                             f"{f.layer} {f.site} (each within the thresholds of {third}, not of each other)")
        return Departure("neither", None, None, None, ties, third, f"neither side departs from {third}")
    if fb is None or (fa is not None and key(fa) < key(fb)):
        side, path, f = "a", a_vs_ref.path_a, fa
    elif fa is None or key(fb) < key(fa):
        side, path, f = "b", b_vs_ref.path_a, fb
    else:
        side, path, f = "both", f"{a_vs_ref.path_a} and {b_vs_ref.path_a}", fa
    other = {"a": fb, "b": fa}.get(side)
    later = "" if side == "both" else (
        f"; the other side ({b_vs_ref.path_a if side == 'a' else a_vs_ref.path_a}) " +
        ("stays within the thresholds" if other is None else f"departs later, at layer {other.layer} {other.site}"))
    what = "departs" if side != "both" else "depart together"
    tie_note = f" (before it, index differences that are ties only: {', '.join(ties)})" if ties else ""
    return Departure(side, path, f.layer, f.site, ties, third,
                     f"{path} {what} from {third} first, at layer {f.layer} {f.site}{later}{tie_note}")


# --- gradients ------------------------------------------------------------------------------------------------

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_PREFIXES = ("module.", "model.language_model.", "language_model.", "model.")


def parameter_key(name: str) -> tuple[int | None, str]:
    """A parameter name of any framework -> (layer, family): wrapper prefixes dropped, the layer taken out
    (`decoder.layers.3.mlp.router.weight` -> (3, "decoder.mlp.router.weight"))."""
    while True:
        for p in _PREFIXES:
            if name.startswith(p):
                name = name[len(p):]
                break
        else:
            break
    name = re.sub(r"\b(attn|ffn)_hc\.(fn|base|scale)$", r"hc_\1_\2", name)  # transformers' mHC module -> checkpoint name
    m = _LAYER.search(name)
    if not m:
        return None, name
    return int(m.group(1)), name[:m.start()] + ("." if m.start() else "") + name[m.end():]


def parameter_capture(param_grads: dict, manifest: dict) -> Capture:
    """Parameter gradients as a capture keyed (layer, "param:<family>") so compare() orders and reports them."""
    cap = Capture(torch.zeros(0, dtype=torch.long), torch.zeros(1, dtype=torch.long), manifest=dict(manifest))
    for name, g in param_grads.items():
        layer, family = parameter_key(name)
        cap.tensors[(layer, f"param:{family}")] = g.detach().float().reshape(1, -1) if g.dim() == 0 else \
            g.detach().float().reshape(g.shape[0], -1)
    return cap


def capture_gradients(path: str, checkpoint, sequences, dtype=torch.float32, device="cpu", backends=None,
                      logits_grad: torch.Tensor | None = None):
    """glmkit's train path or the reference, run with gradients on `sequences` for GRADIENT_LOSS, or, with
    `logits_grad` [T, V] (the rows of `sequences` end to end), for whatever loss has that gradient at the
    logits: a framework dump's `grad__logits` stands for its own training loss that way.
    -> (activation-gradient Capture at every site that carries one, {parameter name: gradient})."""
    from glmkit.model.packed import pack
    from glmkit.model.train import next_token_targets, token_logprobs
    from glmkit.parity.capture import _manifest

    input_ids, packed = pack(sequences)
    targets = next_token_targets(input_ids, packed)
    predicted = int((targets >= 0).sum())
    pieces: dict = {}

    def keeper(rows: torch.Tensor, flatten: bool):
        def keep(layer, site, value):
            if site in INDEX_SITES or not isinstance(value, torch.Tensor) or not value.requires_grad:
                return

            def hook(g, key=(layer, site)):
                g = g.detach().float().cpu()
                pieces.setdefault(key, []).append((rows, g.flatten(0, 1) if flatten else g))

            value.register_hook(hook)
        return keep

    if path == "train":
        from glmkit.model import TrainPath, load_model

        model = load_model(checkpoint, dtype, device)
        ids, on_device = pack(sequences, device=model.device)
        out = TrainPath(model, backends).forward(input_ids=ids, packed=on_device, return_logits=logits_grad is not None,
                                                 record=keeper(torch.arange(len(input_ids)), False))
        if logits_grad is not None:
            out.logits.backward(logits_grad.to(out.logits.device, out.logits.dtype))
        else:
            mask = out.targets >= 0
            (-(out.logprobs[mask]).sum() / max(1, predicted)).backward()
        config, params = model.config, model
    elif path == "reference":
        from glmkit.parity.capture import hook_reference_layer
        from glmkit.reference import load_reference

        ref = load_reference(checkpoint, dtype, device)
        text, config, params = ref.model.language_model, ref.config.get_text_config(), ref
        for s, e in packed.bounds():  # one unpadded sequence at a time, each its share of the one loss
            keep = keeper(torch.arange(s, e), True)
            hooks = [h for i, layer in enumerate(text.layers) for h in hook_reference_layer(layer, i, keep, {})]
            hooks.append(text.norm.register_forward_hook(lambda m, a, o: keep(None, "final_hidden", o)))
            try:
                logits = ref(input_ids=input_ids[s:e][None].to(ref.device)).logits[0].float()
                if logits_grad is not None:
                    logits.backward(logits_grad[s:e].to(logits.device, logits.dtype))
                else:
                    lp = token_logprobs(logits, targets[s:e].to(logits.device))
                    mask = (targets[s:e] >= 0).to(lp.device)
                    (-(lp[mask]).sum() / max(1, predicted)).backward()
            finally:
                for h in hooks:
                    h.remove()
    else:
        raise ValueError(f"gradients are captured on the train path or the reference; got {path!r}")
    loss = GRADIENT_LOSS if logits_grad is None else "the dump's own loss, through its gradient at the logits"
    capture = Capture(input_ids, packed.cu_seqlens.cpu(),
                      manifest=_manifest(f"{path} gradients", config, dtype, device, loss=loss,
                                         checkpoint=str(checkpoint)))
    for key, parts in pieces.items():
        rows = torch.cat([r for r, _ in parts])
        if len(rows) != len(input_ids):
            continue  # a site whose gradient reached only some sequences is not a per-token site
        values = torch.cat([g for _, g in parts])
        full = torch.empty_like(values)
        full[rows] = values
        capture.put(key[0], key[1], full)
    if logits_grad is not None:  # the gradient at the logits is the one given
        capture.put(None, "logits", logits_grad.float())
    param_grads = {n: p.grad.detach().float().cpu() for n, p in params.named_parameters() if p.grad is not None}
    return capture, param_grads
