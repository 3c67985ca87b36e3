"""Build the tiny variant's tokenizer: character level over printable ASCII, plus the chat and thinking
tags as single tokens, written to glmkit/assets/tiny_tokenizer/ so that
`transformers.AutoTokenizer.from_pretrained(dir, local_files_only=True)` loads it.

    python scripts/build_tiny_tokenizer.py [--out glmkit/assets/tiny_tokenizer]

Ids are fixed (the tiny config uses pad 0, bos 1, eos 2) and the vocabulary stays far below the tiny
model's 1024 rows. Re-running writes identical files.
"""

from __future__ import annotations

import argparse
import json
import string
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models

ROOT = Path(__file__).resolve().parents[1]
VOCAB_LIMIT = 1024  # rows of the tiny model's embedding

# Special tokens first, so their ids are the ones the tiny config expects.
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL = [PAD, BOS, EOS, UNK]
# Chat and thinking tags are ordinary (non-special) added tokens: decoding with
# skip_special_tokens=True keeps them, so the rewards still see `</think>`.
TAGS = ["<|system|>", "<|user|>", "<|assistant|>", "<think>", "</think>"]
# `\boxed{` as one token keeps the ideal tiny response (`</think>\boxed{19}<eos>`) at 6 tokens.
WORDS = ["\\boxed{"]
CHARACTERS = [c for c in string.printable if c not in "\r\x0b\x0c"]  # ASCII 32-126, tab, newline

# Generation prompt ends inside the thinking block; an assistant turn in the history is rendered so
# that generation prompt + response == the rendered turn (`<|assistant|><think>...</think>...<eos>`
# when the content starts with `<think>`).
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}<|system|>{{- message['content'] -}}"
    "{%- elif message['role'] == 'user' -%}<|user|>{{- message['content'] -}}"
    "{%- elif message['role'] == 'assistant' -%}<|assistant|>{{- message['content'] -}}{{- eos_token -}}"
    "{%- else -%}{{- raise_exception('unknown chat role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|><think>{%- endif -%}"
)


def build_vocab() -> dict[str, int]:
    tokens = SPECIAL + TAGS + WORDS + CHARACTERS
    if len(set(tokens)) != len(tokens):
        raise ValueError("duplicate token in the tiny vocabulary")
    if len(tokens) > VOCAB_LIMIT:
        raise ValueError(f"tiny vocabulary has {len(tokens)} tokens, the model only {VOCAB_LIMIT}")
    return {token: i for i, token in enumerate(tokens)}


def build_tokenizer() -> Tokenizer:
    # A BPE with no merges over the whole (un-pre-tokenized) text is exactly a character tokenizer;
    # unknown characters become <unk>.
    tokenizer = Tokenizer(models.BPE(vocab=build_vocab(), merges=[], unk_token=UNK))
    tokenizer.decoder = decoders.Fuse()  # concatenate, no spaces between characters
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAGS + WORDS])
    return tokenizer


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": UNK,
        "padding_side": "left",
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def write(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    config = tokenizer_config()
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special_map = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")
    print(f"wrote {out} ({tokenizer.get_vocab_size()} tokens)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(ROOT / "glmkit" / "assets" / "tiny_tokenizer"))
    write(Path(parser.parse_args(argv).out))


if __name__ == "__main__":
    main()
