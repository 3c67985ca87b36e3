"""The transformers reference (`glm5_next`) as a path: load it from a checkpoint and run it the way
glmkit's paths are compared (left-padded batches, cached decode)."""

from __future__ import annotations

import sys

import torch


def _block_fla_on_cpu():
    """On a machine without CUDA, transformers would route KDA to fla's Triton kernels whenever fla
    is importable and then fail ("0 active drivers"); its own torch fallback is the reference we want."""
    if not torch.cuda.is_available() and "transformers.models.glm5_next.modeling_glm5_next" not in sys.modules:
        sys.modules.setdefault("fla", None)


def load_reference(path, dtype: torch.dtype = torch.float32, device="cpu"):
    """Glm5NextForConditionalGeneration from an HF checkpoint directory, in eval mode. The folder is
    checked by glmkit's reader first (safetensors only, every shard inside it, names and shapes), and
    transformers reads it local-only, safetensors only: never a pickle, never the hub."""
    _block_fla_on_cpu()
    import transformers
    from transformers import Glm5NextForConditionalGeneration

    from glmkit.checkpoint import open_checkpoint
    from glmkit.config import layer_kinds

    config = open_checkpoint(path).config
    if "dsa" not in layer_kinds(config):  # its cache reads the sequence length from an attention layer
        raise ValueError(f"{path}: the transformers reference needs at least one DSA layer (its cache takes the "
                         f"sequence length from one); this checkpoint's {config.num_hidden_layers} layers are all "
                         f"KDA (a slice of fewer layers than the first DSA layer's index?); compare it with "
                         f"glmkit parity --paths train,rollout")
    if config.n_routed_experts < 2:  # its router scores expert groups by their best two experts
        raise ValueError(f"the transformers reference needs n_routed_experts >= 2 (its router takes the top-2 "
                         f"experts of each group); this checkpoint has {config.n_routed_experts}")

    transformers.logging.set_verbosity_error()  # its vision tower is absent from text checkpoints
    transformers.logging.disable_progress_bar()
    try:
        model = Glm5NextForConditionalGeneration.from_pretrained(path, dtype=dtype, local_files_only=True,
                                                                 use_safetensors=True)
    except (KeyError, TypeError, AttributeError, IndexError, ValueError) as err:
        # glmkit's reader took the folder; transformers' stricter one (an index without "metadata", say) did not
        raise ValueError(f"{path}: the transformers reference cannot load this checkpoint ({type(err).__name__}: "
                         f"{str(err)[:300]})") from None
    return model.to(device).eval()


def left_pad(sequences, pad_id: int, device="cpu"):
    """-> input_ids [B, L], attention_mask [B, L] with every sequence right-aligned."""
    L = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), L), pad_id, dtype=torch.long, device=device)
    mask = torch.zeros(len(sequences), L, dtype=torch.long, device=device)
    for i, s in enumerate(sequences):
        ids[i, L - len(s):] = torch.as_tensor(list(s), device=device)
        mask[i, L - len(s):] = 1
    return ids, mask


@torch.no_grad()
def reference_logits(model, sequences) -> list[torch.Tensor]:
    """Full-sequence logits of each sequence (left-padded batch), [L_i, V] fp32 each."""
    device = model.device
    ids, mask = left_pad(sequences, model.config.text_config.pad_token_id, device)
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    L = ids.shape[1]
    return [logits[i, L - len(s):] for i, s in enumerate(sequences)]


@torch.no_grad()
def reference_decode_logits(model, prompts, feed: torch.Tensor):
    """Prefill the prompts with a cache, then feed `feed` [B, S] one column per step.
    -> (prefill logits at each prompt's last token [B, V], step logits [B, S, V])."""
    device = model.device
    ids, mask = left_pad(prompts, model.config.text_config.pad_token_id, device)
    out = model(input_ids=ids, attention_mask=mask, use_cache=True)
    cache, first = out.cache, out.logits[:, -1].float()
    steps = []
    for s in range(feed.shape[1]):
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        out = model(input_ids=feed[:, s:s + 1].to(device), attention_mask=mask, cache=cache, use_cache=True)
        cache = out.cache
        steps.append(out.logits[:, -1].float())
    return first, torch.stack(steps, 1)
