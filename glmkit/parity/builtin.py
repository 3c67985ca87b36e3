"""The comparisons a bring-up needs, one call each."""

from __future__ import annotations

from pathlib import Path

import torch

from glmkit.comparison import row_rel_rms
from glmkit.kernels.backends import Backends
from glmkit.parity.capture import capture_reference, capture_rollout, capture_train
from glmkit.parity.compare import ParityResult, compare
from glmkit.parity.dump import Capture, load_capture

LIVE_PATHS = ("reference", "train", "rollout")
SGLANG_PREFIX = "sglang:"  # sglang:http://HOST:PORT, a server speaking SGLang's native API


def make_inputs(vocab_size: int, batch: int, seq_len: int, seed: int = 0):
    """`batch` seeded sequences, lengths seq_len, 3/4 seq_len, ... (at least 2), and their prompt
    lengths (half of each: the rest is the "response" a rollout decodes)."""
    if batch < 1 or seq_len < 2:
        raise ValueError(f"--batch must be >= 1 and --seq-len >= 2, got --batch {batch}, --seq-len {seq_len}")
    g = torch.Generator().manual_seed(seed)
    lengths = [max(2, seq_len - i * seq_len // (4 * batch)) for i in range(batch)]
    low = 3 if vocab_size > 3 else 0
    seqs = [torch.randint(low, vocab_size, (n,), generator=g).tolist() for n in lengths]
    return seqs, [max(1, n // 2) for n in lengths]


REPLAY_MODES = ("auto", "on", "off")


def capture_path(path: str, checkpoint, sequences, prompt_lengths, dtype=torch.float32, device="cpu",
                 backends=None, topk_replay: dict | None = None) -> Capture:
    """One path's capture: a live path name run on `checkpoint`, or a dump directory. `topk_replay`
    {DSA layer: [T, W] sequence-local selections} makes a live path use those selections."""
    from glmkit.model import load_model
    from glmkit.reference import load_reference

    meta = {"checkpoint": str(checkpoint)}
    if topk_replay:
        meta["topk_replayed"] = True
    if path == "reference":
        return capture_reference(load_reference(checkpoint, dtype, device), sequences, topk_replay, **meta)
    if path == "train":
        return capture_train(load_model(checkpoint, dtype, device), sequences, backends,
                             topk_replay=topk_replay, **meta)
    if path == "rollout":
        return capture_rollout(load_model(checkpoint, dtype, device), sequences, prompt_lengths, backends,
                               topk_replay=topk_replay, **meta)
    if path.startswith(SGLANG_PREFIX):
        from glmkit.serve.client import check_server_url

        check_server_url(path[len(SGLANG_PREFIX):])
        from glmkit.checkpoint import open_checkpoint
        from glmkit.parity.capture import capture_sglang

        if topk_replay:
            raise ValueError(f"{path}: a server cannot replay DSA selections; use --replay-topk off")
        return capture_sglang(path[len(SGLANG_PREFIX):], sequences, open_checkpoint(checkpoint).config, **meta)
    check_path_name(path)
    return load_dir(path).capture


def check_path_name(path: str) -> None:
    """A path parity can run: a live one, a server, or a folder (read later); anything else refused by
    name, before any model loads."""
    if path in LIVE_PATHS or path.startswith(SGLANG_PREFIX) or Path(path).is_dir():
        return
    raise ValueError(f"unknown path {path!r}; allowed: {', '.join(LIVE_PATHS)}, sglang:http://HOST:PORT or a "
                     f"capture directory")


def load_dir(path):
    """A directory path: a framework dump (SGLang's dumper, engine or trainer) -> FrameworkDump; a glmkit
    capture -> the same shape (no gradients)."""
    from glmkit.parity.framework_dump import FrameworkDump, is_framework_dump, read_framework_dump

    if is_framework_dump(path):
        return read_framework_dump(path)
    capture = load_capture(path)
    empty = Capture(capture.input_ids, capture.cu_seqlens, manifest=dict(capture.manifest))
    return FrameworkDump(capture, empty, {}, capture.manifest.get("path", "capture"), [], [])


THIRD_PATHS = ("reference", "train", "none")


def _gradient_departure(result, full, aligned, third, checkpoint, dtype, device, backends, thresholds) -> None:
    """The third path's gradients for each side's own loss, given by that side's gradient at the logits
    (`grad__logits`), and which side departs first in the backward order. Gradients at a position depend
    on the later tokens, so this needs both dumps on whole, identical sequences; otherwise it says why not."""
    from glmkit.parity.departure import GRADIENT_THRESHOLDS, capture_gradients, conform, departure, sequences_of

    missing = [g.manifest.get("path", "?") for g in aligned if (None, "logits") not in g.tensors]
    if missing:
        result.warnings.append(f"no third path for gradients: {', '.join(missing)} dumped no grad__logits (dump "
                               f"logits with enable_grad=1): A and B are compared with each other only")
        return
    if any(sequences_of(g) != sequences_of(f) for g, f in zip(aligned, full)):
        result.warnings.append("no third path for gradients: the two dumps do not hold the same whole sequences "
                               "(a position's gradient depends on the tokens after it)")
        return
    limits = {**GRADIENT_THRESHOLDS[dtype], **(thresholds or {})}
    versus = {}
    for side, grads in zip("ab", aligned):
        ref, _ = capture_gradients(third, checkpoint, sequences_of(grads), getattr(torch, dtype), device, backends,
                                   logits_grad=grads.tensors[(None, "logits")])
        ref.manifest["path"] = third
        versus[side] = compare(conform(grads, ref), ref, dtype, limits, backward=True, skip_mismatched=True)
    result.versus_third = versus
    result.departure = departure(versus["a"], versus["b"], result, backward=True)
    result.warnings.append(f"third path: the {third}'s backward from each side's own grad__logits (the same loss as "
                           f"that side's)")


def dump_parity(checkpoint, path_a: str, path_b: str, third: str = "reference", dtype: str = "float32",
                device: str = "cpu", backends=None, thresholds: dict | None = None):
    """Two dump directories (framework dumps or captures) lined up token by token and compared, and, with
    a checkpoint, each compared with a third path run on the same tokens: which side departs first, where,
    and whether index differences are ties (candidate scores recomputed from the checkpoint on each
    side's own inputs where a dump lacks them). Gradients (a forward-backward phase) are compared the
    same way, in the backward order. -> (ParityResult with .departure / .gradients, capture_a, capture_b)."""
    from glmkit.parity.departure import (GRADIENT_THRESHOLDS, align, conform, departure, parameter_capture, rescore,
                                         sequences_of)

    if third not in THIRD_PATHS:
        raise ValueError(f"third path {third!r}; allowed: {', '.join(THIRD_PATHS)}")
    da, db = load_dir(path_a), load_dir(path_b)
    for d, given in ((da, path_a), (db, path_b)):
        d.capture.manifest["path"] = f"{d.side} {Path(given).name}" if d.capture.manifest.get("source") else             d.capture.manifest.get("path", given)
    if da.capture.manifest["path"] == db.capture.manifest["path"]:
        da.capture.manifest["path"], db.capture.manifest["path"] = f"A {path_a}", f"B {path_b}"
    cap_a, cap_b, notes = align(da.capture, db.capture)
    sequences = sequences_of(cap_a)
    model = None
    if checkpoint is not None and third != "none":
        from glmkit.model import load_model

        model = load_model(checkpoint, getattr(torch, dtype), device)
        for cap in (cap_a, cap_b):
            cap.manifest.setdefault("index_kpool", model.config.index_kpool)  # pools: how ties are judged
            notes += [f"{cap.manifest['path']}: {n}" for n in rescore(cap, model)]
    result = compare(cap_a, cap_b, dtype, thresholds, skip_mismatched=True)
    result.warnings = notes + result.warnings
    for d in (da, db):
        if d.not_read:
            from glmkit.parity.framework_dump import NOT_ALIGNABLE

            result.warnings.append(f"{d.capture.manifest['path']}: names not compared (no glmkit site): " + ", ".join(
                f"{n} ({NOT_ALIGNABLE[n]})" if n in NOT_ALIGNABLE else n for n in d.not_read))
        if d.incomplete:
            result.warnings.append(f"{d.capture.manifest['path']}: sites not dumped for every token, skipped: "
                                   f"{', '.join(d.incomplete)}")
    if model is not None:
        ref = capture_path(third, checkpoint, sequences, [max(1, len(s) // 2) for s in sequences],
                           getattr(torch, dtype), device, backends)
        if third == "train":
            ref.manifest["path"] = "train"
        rescore(ref, model)
        a_ref, b_ref = (compare(conform(cap, ref), ref, dtype, thresholds, skip_mismatched=True)
                        for cap in (cap_a, cap_b))
        result.departure = departure(a_ref, b_ref, result)
        result.versus_third = {"a": a_ref, "b": b_ref}
    # gradients sit on the same rows as the values: the same alignment
    ga, gb = align(da.grads, db.grads)[:2] if da.grads.tensors and db.grads.tensors else (None, None)
    if ga is not None:
        ga.manifest["path"], gb.manifest["path"] = (f"{c.manifest['path']} gradients" for c in (cap_a, cap_b))
        result.gradients = compare(ga, gb, dtype, {**GRADIENT_THRESHOLDS[dtype], **(thresholds or {})},
                                   backward=True, skip_mismatched=True)
        result.gradients.warnings.insert(0, "loss: the framework's own training loss of the dumped step (a "
                                            "forward-backward phase); both dumps must come from the same loss")
        if model is not None:
            model = None  # the third path's gradients load their own copy
            _gradient_departure(result.gradients, (da.grads, db.grads), (ga, gb), third, checkpoint, dtype, device,
                                backends, thresholds)
    if da.param_grads and db.param_grads:
        pa = parameter_capture(da.param_grads, {"path": cap_a.manifest["path"] + " parameter gradients"})
        pb = parameter_capture(db.param_grads, {"path": cap_b.manifest["path"] + " parameter gradients"})
        result.parameter_gradients = compare(pa, pb, dtype, {**GRADIENT_THRESHOLDS[dtype], **(thresholds or {})},
                                             backward=True, skip_mismatched=True)
    return result, cap_a, cap_b


def gradient_parity(checkpoint, paths=("reference", "train"), seq_len: int = 64, batch: int = 2,
                    dtype: str = "float32", device: str = "cpu", backends=None, thresholds: dict | None = None,
                    seed: int = 0):
    """Gradients of two live paths (reference, train) for glmkit.parity.departure.GRADIENT_LOSS on the same
    seeded input, per site and per parameter, first divergence in the backward order.
    -> (activation ParityResult, parameter ParityResult)."""
    from glmkit.checkpoint import open_checkpoint
    from glmkit.parity.departure import GRADIENT_THRESHOLDS, capture_gradients, parameter_capture

    if dtype not in GRADIENT_THRESHOLDS:
        raise ValueError(f"dtype {dtype!r}; allowed: {', '.join(GRADIENT_THRESHOLDS)}")
    thresholds = {**GRADIENT_THRESHOLDS[dtype], **(thresholds or {})}
    if sorted(paths) != ["reference", "train"]:
        raise ValueError(f"gradients compare the paths reference and train; got {','.join(paths)}")
    sequences, _ = make_inputs(open_checkpoint(checkpoint).config.vocab_size, batch, seq_len, seed)
    grads = {p: capture_gradients(p, checkpoint, sequences, getattr(torch, dtype), device, backends) for p in paths}
    (ga, pa), (gb, pb) = grads[paths[0]], grads[paths[1]]
    acts = compare(ga, gb, dtype, thresholds, backward=True, skip_mismatched=True)
    params = compare(parameter_capture(pa, {"path": f"{paths[0]} parameter gradients"}),
                     parameter_capture(pb, {"path": f"{paths[1]} parameter gradients"}), dtype, thresholds,
                     backward=True, skip_mismatched=True)
    for r in (acts, params):
        r.warnings.insert(0, f"loss: {ga.manifest['loss']}")
    return acts, params


def selections_of(capture: Capture) -> dict:
    """A capture's DSA selections as a replay: {layer: [T, W] sequence-local, -1 empty}."""
    return {layer: t for (layer, site), t in capture.tensors.items() if site == "indexer_topk"}


def parity(checkpoint, paths=("reference", "train"), checkpoint_b=None, seq_len: int = 64, batch: int = 2,
           dtype: str = "float32", device: str = "cpu", backends: Backends | str | None = None, streaming: bool = False,
           thresholds: dict | None = None, seed: int = 0, vocab_size: int | None = None, replay_topk: str = "auto",
           replay_from: dict | None = None, replay_from_name: str = "a file", third: str = "reference"):
    """Capture two paths on the same seeded input and compare them.
    -> (ParityResult, capture_a, capture_b). A dump directory as a path fixes the input to the dump's.

    Top-k replay (`replay_topk`): "on" makes path B use path A's DSA selections at every DSA layer,
    so sites downstream of a selection difference compare like for like; "auto" does so only when
    path A is the reference or a capture and the first comparison found rows that differ by ties;
    "off" never. `replay_from` {layer: [T, W]} (e.g. a framework's per-token indexer_topk) is
    replayed into both live paths instead. Two dump directories go to `dump_parity` (`third`: the path
    each is compared with, run on the checkpoint)."""
    if replay_topk not in REPLAY_MODES:
        raise ValueError(f"replay_topk={replay_topk!r}; allowed: {', '.join(REPLAY_MODES)}")
    from glmkit.checkpoint import open_checkpoint

    a, b = paths
    if all(p not in LIVE_PATHS and not p.startswith(SGLANG_PREFIX) and Path(p).is_dir() for p in paths):
        if streaming or replay_topk == "on" or replay_from is not None or checkpoint_b is not None:
            raise ValueError("two dump directories are compared as they were dumped: --streaming, --replay-topk on, "
                             "--replay-topk-from and --checkpoint-b need a live path")
        return dump_parity(checkpoint, a, b, third, dtype, device, backends, thresholds)
    if checkpoint_b is not None:  # checked (safetensors, names, shapes, files inside it) before path A runs
        open_checkpoint(checkpoint_b)
    dumps = [load_dir(p).capture for p in paths if p not in LIVE_PATHS and not p.startswith(SGLANG_PREFIX)
             and Path(p).is_dir()]
    if dumps:
        c = dumps[0]
        vocab = open_checkpoint(checkpoint).config.vocab_size
        ids = c.input_ids
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            bad = int(ids.max()) if int(ids.max()) >= vocab else int(ids.min())
            raise ValueError(f"{next(p for p in paths if p not in LIVE_PATHS and not p.startswith(SGLANG_PREFIX))}: "
                             f"input/ids holds token {bad}, outside the checkpoint's vocabulary of {vocab}")
        sequences = [c.input_ids[s:e].tolist() for s, e in zip(c.cu_seqlens[:-1].tolist(), c.cu_seqlens[1:].tolist())]
        prompts = c.manifest.get("prompt_lengths") or [max(1, len(s) // 2) for s in sequences]
    else:
        vocab = vocab_size or open_checkpoint(checkpoint).config.vocab_size
        sequences, prompts = make_inputs(vocab, batch, seq_len, seed)
    torch_dtype = getattr(torch, dtype)
    if streaming:
        from glmkit.parity.streaming import stream_parity

        if sorted(paths) != ["reference", "train"] or checkpoint_b is not None:
            raise ValueError("--streaming compares paths reference,train on one checkpoint (layer by layer, "
                             "each glmkit layer fed the reference's input)")
        if replay_topk == "on" or replay_from is not None:
            raise ValueError("top-k replay is not available with --streaming (each layer is fed the reference's "
                             "input; compare end to end to replay selections)")
        cap_ref, cap_train = stream_parity(checkpoint, sequences, torch_dtype, device, backends)
        caps = {"reference": cap_ref, "train": cap_train}
        cap_a, cap_b = caps[a], caps[b]
        return compare(cap_a, cap_b, dtype, thresholds, response_starts=prompts), cap_a, cap_b

    def run_b(replay):
        return capture_path(b, checkpoint_b or checkpoint, sequences, prompts, torch_dtype, device, backends, replay)

    if replay_from is not None:
        total = sum(len(s) for s in sequences)
        for layer, rows in replay_from.items():
            if rows.shape[0] != total:
                raise ValueError(f"replayed selections for layer {layer} have {rows.shape[0]} token rows; the "
                                 f"input has {total} tokens (lengths {[len(s) for s in sequences]})")
    cap_a = capture_path(a, checkpoint, sequences, prompts, torch_dtype, device, backends, replay_from)
    if replay_from is not None:
        cap_b = run_b(replay_from)
        result = compare(cap_a, cap_b, dtype, thresholds, response_starts=prompts)
        result.topk_replay = f"both paths replay the DSA selections from {replay_from_name}"
        return result, cap_a, cap_b
    if replay_topk == "on":
        cap_b = run_b(selections_of(cap_a))
        result = compare(cap_a, cap_b, dtype, thresholds, response_starts=prompts)
        result.topk_replay = f"path B ({b}) replays path A's ({a}) DSA selections (--replay-topk on)"
        return result, cap_a, cap_b
    cap_b = run_b(None)
    result = compare(cap_a, cap_b, dtype, thresholds, response_starts=prompts)
    tied = [s for s in result.sites if s.site == "indexer_topk" and s.tied]
    source_is_fixed = a == "reference" or a not in LIVE_PATHS
    if replay_topk == "auto" and tied and source_is_fixed:
        cap_b = run_b(selections_of(cap_a))
        replayed = compare(cap_a, cap_b, dtype, thresholds, response_starts=prompts)
        layers = ", ".join(str(s.layer) for s in tied)
        replayed.topk_replay = (f"path B ({b}) replays path A's ({a}) DSA selections: ties were seen at layer(s) "
                                f"{layers} without replay (auto)")
        # what the run without replay found stays on record: the tie counts and its own verdict
        replayed.warnings = result.warnings + [
            f"without replay: verdict {result.verdict}" + (
                "" if result.first_divergence is None else
                f", first divergence layer {result.first_divergence.layer} {result.first_divergence.site}")]
        return replayed, cap_a, cap_b
    return result, cap_a, cap_b


def fp32_vs_bf16(checkpoint, seq_len=64, batch=2, device="cpu", backends=None, seed=0) -> ParityResult:
    """The train path in fp32 against itself in bf16 (bf16 thresholds)."""
    from glmkit.checkpoint import open_checkpoint
    from glmkit.model import load_model

    sequences, prompts = make_inputs(open_checkpoint(checkpoint).config.vocab_size, batch, seq_len, seed)
    full = capture_train(load_model(checkpoint, torch.float32, device), sequences, backends)
    half = capture_train(load_model(checkpoint, torch.bfloat16, device), sequences, backends)
    full.manifest["path"], half.manifest["path"] = "train fp32", "train bf16"
    return compare(full, half, "bfloat16", response_starts=prompts)


@torch.no_grad()
def kda_error_vs_position(model, sequence, backends: Backends | str | None = None) -> dict[int, list[float]]:
    """Per KDA layer, fed the train path's own input to that layer: relative error per position of the
    chunked form (train / prefill) against the token-by-token recurrent form (decode)."""
    from glmkit.model.packed import Packed

    inputs = {}
    capture_train_inputs = lambda layer, site, v: inputs.__setitem__(layer, v) if site == "attn_in" else None  # noqa: E731
    from glmkit.model import TrainPath

    TrainPath(model, backends).forward([sequence], record=capture_train_inputs)
    from glmkit.model.plan import plan_kernels

    kda, packed = plan_kernels(model, backends)["kda"].ops, Packed.from_lengths([len(sequence)], device=model.device)
    curves = {}
    for block in model.layers:
        if block.kind != "kda":
            continue
        x = inputs[block.layer]
        chunked, _ = block.self_attn.forward_packed(x, packed, kda)
        state = block.self_attn.empty_state(1, model.dtype, model.device)
        stepped = torch.cat([block.self_attn.forward_step(x[t:t + 1], state, kda) for t in range(len(x))])
        err = row_rel_rms(stepped, chunked)
        curves[block.layer] = err.tolist()
    return curves


def index_agreement(result: ParityResult, site: str) -> dict[int, dict]:
    """Per layer {"jaccard", "identical", "tied", "different"} of an index site: "indexer_topk" gives
    DSA prefill vs decode top-k agreement (train vs rollout), "router_experts" the MoE routing
    agreement routing replay fixes; "tied" rows differ only at an equal-score top-k boundary."""
    return {r.layer: {"jaccard": r.jaccard, "identical": r.identical, "tied": r.tied, "different": r.different}
            for r in result.sites if r.site == site}


def mhc_residuals(capture: Capture) -> dict[int, dict[str, float]]:
    """Per layer, max |row sum - 1| and |column sum - 1| of the comb matrices (attn and ffn)."""
    from glmkit.model.mhc import doubly_stochastic_error

    out = {}
    for (layer, site), t in capture.tensors.items():
        if site.endswith("hc.comb"):
            out.setdefault(layer, {})[site.split("_")[0]] = doubly_stochastic_error(t.double())
    return dict(sorted(out.items()))
