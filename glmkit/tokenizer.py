"""Tokenizers from local files only: a checkpoint's own, or the tiny variant's shipped one.

The tiny tokenizer (glmkit/assets/tiny_tokenizer, built by scripts/build_tiny_tokenizer.py) is
character level over printable ASCII with pad 0, bos 1, eos 2 and the chat/thinking tags as single
tokens; its chat template renders `<bos><|user|>{content}<|assistant|><think>`.
"""

from __future__ import annotations

import os
from pathlib import Path

TINY_TOKENIZER = Path(__file__).resolve().parent / "assets" / "tiny_tokenizer"
# A directory holds a usable tokenizer if it has one of these (fast file, or a slow tokenizer's vocab).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tiktoken.model")
# Every file transformers' tokenizer reader may open in the folder
READ_FILES = (*TOKENIZER_FILES, "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
              "merges.txt", "chat_template.json", "chat_template.jinja", "config.json")
MAX_TOKENIZER_FILE_BYTES = 1 << 30  # GLM-5's tokenizer.json is about 20 MB
MAX_TEMPLATE_BYTES = 1 << 20
MAX_JSON_DEPTH = 64


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
    _check_files(directory)
    try:  # never the code a tokenizer folder may name (auto_map): it is data here
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    except (PermissionError, MemoryError):
        raise  # the environment's
    except Exception as err:  # noqa: BLE001 - a corrupt file (the Rust reader raises plain Exception): say which folder
        first = (str(err).splitlines() or [type(err).__name__])[0][:300]
        raise ValueError(f"tokenizer in {directory} cannot be read: {first}") from err


def _check_files(directory: Path) -> None:
    """The files the tokenizer reader will open, checked first: regular files (a pipe would block the
    reader, or be skipped as if absent), of bounded size, and JSON nested no deeper than a tokenizer's
    (Rust's reader aborts the process on some inputs where Python's raises)."""
    import json

    from glmkit.inputs import not_a_file

    for name in READ_FILES:
        path = directory / name
        if not os.path.lexists(path):
            continue
        if (why := not_a_file(path)) is not None:
            raise ValueError(f"tokenizer in {directory} cannot be read: {name} {why}; expected a regular file")
        size = path.stat().st_size
        if size > MAX_TOKENIZER_FILE_BYTES:
            raise ValueError(f"tokenizer in {directory} cannot be read: {name} holds {size} bytes (at most "
                             f"{MAX_TOKENIZER_FILE_BYTES})")
        if name.endswith(".json"):
            try:
                depth = _json_depth(json.loads(path.read_bytes()))
            except RecursionError:
                depth = MAX_JSON_DEPTH + 1
            except ValueError as err:
                raise ValueError(f"tokenizer in {directory} cannot be read: {name} is not JSON ({str(err)[:120]})") from None
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"tokenizer in {directory} cannot be read: {name} nests past {MAX_JSON_DEPTH} levels (a "
                                 f"tokenizer's files nest a few)")
        elif name.endswith(".jinja") and size > MAX_TEMPLATE_BYTES:
            raise ValueError(f"tokenizer in {directory} cannot be read: {name} holds {size} bytes (a chat template at most "
                             f"{MAX_TEMPLATE_BYTES})")


def _json_depth(value) -> int:
    """How deep lists and objects nest in a parsed JSON value (iteratively: no recursion limit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack += [(v, depth + 1) for v in (item.values() if isinstance(item, dict) else item)]
    return deepest
