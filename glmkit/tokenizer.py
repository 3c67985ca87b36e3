"""Tokenizers from local files only: a checkpoint's own, or the tiny variant's shipped one.

The tiny tokenizer (glmkit/assets/tiny_tokenizer, built by scripts/build_tiny_tokenizer.py) is
character level over printable ASCII with pad 0, bos 1, eos 2 and the chat/thinking tags as single
tokens; its chat template renders `<bos><|user|>{content}<|assistant|><think>`.
"""

from __future__ import annotations

from pathlib import Path

TINY_TOKENIZER = Path(__file__).resolve().parent / "assets" / "tiny_tokenizer"
# A directory holds a usable tokenizer if it has one of these (fast file, or a slow tokenizer's vocab).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def has_tokenizer_files(directory: str | Path) -> bool:
    return any((Path(directory) / name).is_file() for name in TOKENIZER_FILES)


def load_tokenizer(checkpoint_dir: str | Path | None = None):
    """The tokenizer in `checkpoint_dir` (local files only, never the hub), or the shipped tiny one
    for None / "tiny"."""
    from transformers import AutoTokenizer

    directory = TINY_TOKENIZER if checkpoint_dir in (None, "tiny") else Path(checkpoint_dir)
    if not directory.is_dir():
        raise FileNotFoundError(f"tokenizer directory {directory} does not exist")
    if not has_tokenizer_files(directory):
        raise FileNotFoundError(f"no tokenizer in {directory}: expected one of {', '.join(TOKENIZER_FILES)} "
                                f"(pass a tokenizer directory, or copy the model's tokenizer files there)")
    try:  # never the code a tokenizer folder may name (auto_map): it is data here
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    except (ValueError, OSError, TypeError, KeyError) as err:  # a corrupt file: say which folder
        raise ValueError(f"tokenizer in {directory} cannot be read: {str(err).splitlines()[0]}") from err
