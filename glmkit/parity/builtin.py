"""The comparisons a bring-up needs, one call each."""

from __future__ import annotations

from pathlib import Path

import torch

from glmkit.kernels.backends import Backends
from glmkit.parity.capture import capture_reference, capture_rollout, capture_train
from glmkit.parity.compare import ParityResult, compare
from glmkit.parity.dump import Capture, load_capture

LIVE_PATHS = ("reference", "train", "rollout")


def make_inputs(vocab_size: int, batch: int, seq_len: int, seed: int = 0):
    """`batch` seeded sequences, lengths seq_len, 3/4 seq_len, ... (at least 2), and their prompt
    lengths (half of each: the rest is the "response" a rollout decodes)."""
    if batch < 1 or seq_len < 2:
        raise ValueError(f"need batch >= 1 and seq_len >= 2, got batch={batch}, seq_len={seq_len}")
    g = torch.Generator().manual_seed(seed)
    lengths = [max(2, seq_len - i * seq_len // (4 * batch)) for i in range(batch)]
    low = 3 if vocab_size > 3 else 0
    seqs = [torch.randint(low, vocab_size, (n,), generator=g).tolist() for n in lengths]
    return seqs, [max(1, n // 2) for n in lengths]


def capture_path(path: str, checkpoint, sequences, prompt_lengths, dtype=torch.float32, device="cpu",
                 backends=None, streaming_partner=None) -> Capture:
    """One path's capture: a live path name run on `checkpoint`, or a dump directory."""
    from glmkit.model import load_model
    from glmkit.reference import load_reference

    meta = {"checkpoint": str(checkpoint)}
    if path == "reference":
        return capture_reference(load_reference(checkpoint, dtype, device), sequences, **meta)
    if path == "train":
        return capture_train(load_model(checkpoint, dtype, device), sequences, backends, **meta)
    if path == "rollout":
        return capture_rollout(load_model(checkpoint, dtype, device), sequences, prompt_lengths, backends, **meta)
    if Path(path).is_dir():
        return load_capture(path)
    raise ValueError(f"unknown path {path!r}; allowed: {', '.join(LIVE_PATHS)} or a capture directory")


def parity(checkpoint, paths=("reference", "train"), checkpoint_b=None, seq_len: int = 64, batch: int = 2,
           dtype: str = "float32", device: str = "cpu", backends: Backends | str | None = None, streaming: bool = False,
           thresholds: dict | None = None, seed: int = 0, vocab_size: int | None = None):
    """Capture two paths on the same seeded input and compare them.
    -> (ParityResult, capture_a, capture_b). A dump directory as a path fixes the input to the dump's."""
    from glmkit.checkpoint import open_checkpoint

    a, b = paths
    dumps = [load_capture(p) for p in paths if p not in LIVE_PATHS and Path(p).is_dir()]
    if dumps:
        c = dumps[0]
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
        cap_ref, cap_train = stream_parity(checkpoint, sequences, torch_dtype, device, backends)
        caps = {"reference": cap_ref, "train": cap_train}
        cap_a, cap_b = caps[a], caps[b]
    else:
        cap_a = capture_path(a, checkpoint, sequences, prompts, torch_dtype, device, backends)
        cap_b = capture_path(b, checkpoint_b or checkpoint, sequences, prompts, torch_dtype, device, backends)
    result = compare(cap_a, cap_b, dtype, thresholds, response_starts=prompts)
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
    kda, packed = Backends.parse(backends).kda_ops(), Packed.from_lengths([len(sequence)], device=model.device)
    curves = {}
    for block in model.layers:
        if block.kind != "kda":
            continue
        x = inputs[block.layer]
        chunked, _ = block.self_attn.forward_packed(x, packed, kda)
        state = block.self_attn.empty_state(1, model.dtype, model.device)
        stepped = torch.cat([block.self_attn.forward_step(x[t:t + 1], state, kda) for t in range(len(x))])
        err = (chunked.double() - stepped.double()).norm(dim=-1) / stepped.double().norm(dim=-1).clamp_min(1e-30)
        curves[block.layer] = err.tolist()
    return curves


def index_agreement(result: ParityResult, site: str) -> dict[int, dict]:
    """Per layer {"jaccard", "identical"} of an index site: "indexer_topk" gives DSA prefill vs decode
    top-k agreement (train vs rollout), "router_experts" the MoE routing agreement routing replay fixes."""
    return {r.layer: {"jaccard": r.jaccard, "identical": r.identical} for r in result.sites if r.site == site}


def mhc_residuals(capture: Capture) -> dict[int, dict[str, float]]:
    """Per layer, max |row sum - 1| and |column sum - 1| of the comb matrices (attn and ffn)."""
    from glmkit.model.mhc import doubly_stochastic_error

    out = {}
    for (layer, site), t in capture.tensors.items():
        if site.endswith("hc.comb"):
            out.setdefault(layer, {})[site.split("_")[0]] = doubly_stochastic_error(t.double())
    return dict(sorted(out.items()))
