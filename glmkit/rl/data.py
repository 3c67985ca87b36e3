"""Prompt data in the DAPO-Math-17k jsonl format, and the tiny model's ideal response.

One row per line: `{"prompt": [chat messages] or "text", "label": "<answer>", ...}`, UTF-8. Malformed rows
(a line that is not UTF-8 text among them) are never dropped silently: each becomes a `Problem` naming its
line (1-based), reported in one warning with the count, or raised at once with `on_error="raise"`. Blank
lines are not rows.
"""

from __future__ import annotations

import json
import os
import random
import warnings
from dataclasses import dataclass, field

DEFAULT_DAPO_PATH = "/root/datasets/dapo-math-17k/dapo-math-17k.jsonl"
ON_ERROR = ("skip", "raise")

# The response the tiny model is trained to give. The chat template's generation prompt already ends
# in `<think>`, so the response closes an (empty) thinking block, then boxes the answer, then stops:
#     prompt   <bos><|user|>12+7=<|assistant|><think>
#     response </think>\boxed{19}<eos>
# The `deepscaler` reward finds `</think>` and grades the `\boxed{}` after it.
RESPONSE_TEMPLATE = "</think>\\boxed{{{answer}}}{eos}"
CHAT_TEMPLATE_SECONDS = 5.0  # one row's rendering (the tiny template takes microseconds, real ones milliseconds)
MAX_PROMPT_CHARS = 4 << 20  # what a chat template may make of one row (a row is at most MAX_ROW_BYTES)


@dataclass
class Sample:
    prompt_ids: list[int]   # empty when no tokenizer was given
    prompt_text: str        # what was tokenized (chat template applied when asked)
    label: str
    index: int              # 1-based line number in the file
    metadata: dict = field(default_factory=dict)  # the row's other keys (e.g. "source")


@dataclass
class Problem:
    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


class RowError(ValueError):
    """A row that cannot become a Sample; the message says why."""


def format_response(answer, eos_token: str = "<eos>") -> str:
    """The ideal response for `answer`, continuing the tiny chat template's generation prompt."""
    return RESPONSE_TEMPLATE.format(answer=answer, eos=eos_token)


def _type_name(value) -> str:
    return type(value).__name__


def _check_messages(prompt: list) -> list[dict]:
    if not prompt:
        raise RowError("prompt is an empty list")
    for i, message in enumerate(prompt):
        if not isinstance(message, dict):
            raise RowError(f"prompt[{i}] is a {_type_name(message)}, not a chat message object")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise RowError(f"prompt[{i}] needs a string {key!r}")
    return prompt


def _messages(prompt) -> list[dict]:
    """A row's prompt as chat messages: a plain string becomes one user message."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise RowError("prompt is an empty string")
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list):
        return _check_messages(prompt)
    raise RowError(f"prompt must be a string or a list of chat messages, not {_type_name(prompt)}")


def _label(value) -> str:
    # Integers are accepted and written as strings (DAPO labels are integer strings); bool is not an int here.
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise RowError(f"label must be a string, not {_type_name(value)}")
    label = str(value)
    if not label.strip():
        raise RowError("label is empty")
    return label


def _prompt_text(messages: list[dict], tokenizer, apply_chat_template: bool) -> str:
    from glmkit.inputs import time_limit

    if apply_chat_template and tokenizer is not None:
        try:  # a template is code from the tokenizer's folder: its loops may not end, its text may not fit
            with time_limit(CHAT_TEMPLATE_SECONDS, "the chat template"):
                text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as err:  # e.g. the template rejects a role
            raise RowError(f"chat template failed: {str(err)[:300]}") from err
        if not isinstance(text, str):
            raise RowError(f"chat template gave a {_type_name(text)}, not text")
        if len(text) > MAX_PROMPT_CHARS:
            raise RowError(f"the chat template made {len(text)} characters of this row (at most {MAX_PROMPT_CHARS})")
        return text
    return "\n".join(m["content"] for m in messages)


def _prompt_ids(text: str, tokenizer, apply_chat_template: bool) -> list[int]:
    if tokenizer is None:
        return []
    # A chat template already writes the special prefix (e.g. <bos>); plain text gets the tokenizer's own.
    return list(tokenizer.encode(text, add_special_tokens=not apply_chat_template))


def _decode(raw: bytes, first: bool = False) -> str:
    try:
        text = raw.decode("utf-8")
        return text.removeprefix("\ufeff") if first else text  # a byte-order mark starts some files
    except UnicodeDecodeError as err:
        raise RowError(f"not UTF-8 text (invalid byte 0x{raw[err.start]:02x} at position {err.start + 1})") from None


def parse_row(line: str, number: int, input_key: str, label_key: str, tokenizer, apply_chat_template: bool) -> Sample:
    """One jsonl line as a Sample; raises RowError saying what is wrong with it."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise RowError(f"not valid JSON ({err.msg} at column {err.colno})") from err
    except (ValueError, RecursionError) as err:  # an integer of over 4300 digits, nesting past the parser's depth
        raise RowError(f"not readable JSON ({str(err)[:80]})") from err
    if not isinstance(row, dict):
        raise RowError(f"a row must be a JSON object, not {_type_name(row)}")
    try:  # JSON may escape half of a UTF-16 pair (\ud800): not text any tokenizer takes
        json.dumps(row, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise RowError("holds a lone UTF-16 surrogate (an escape such as \\ud800 without its pair): not Unicode "
                       "text") from None
    for key in (input_key, label_key):
        if key not in row:
            raise RowError(f"missing key {key!r} (keys: {', '.join(sorted(row)) or 'none'})")
    messages = _messages(row[input_key])
    label = _label(row[label_key])
    text = _prompt_text(messages, tokenizer, apply_chat_template)
    metadata = {k: v for k, v in row.items() if k not in (input_key, label_key)}
    return Sample(_prompt_ids(text, tokenizer, apply_chat_template), text, label, number, metadata)


def drop_longer(samples: list[Sample], limit: int, why: str, path, on_error: str = "skip"):
    """Samples whose prompts hold at most `limit` tokens, and a Problem for each longer one (`why`
    says what the limit is); with on_error="raise", ValueError at the first."""
    kept, problems = [], []
    for s in samples:
        if len(s.prompt_ids) <= limit:
            kept.append(s)
            continue
        problems.append(Problem(s.index, f"prompt of {len(s.prompt_ids)} tokens; at most {limit} ({why})"))
    if problems and on_error == "raise":
        raise ValueError(f"{path}: {min(problems, key=lambda p: p.line)}")
    if problems:
        _report(path, sorted(problems, key=lambda p: p.line), "too long")
    return kept, problems


def _report(path, problems: list[Problem], what: str = "malformed") -> None:
    shown = ", ".join(str(p.line) for p in problems[:10]) + (", ..." if len(problems) > 10 else "")
    warnings.warn(f"{path}: skipped {len(problems)} {what} row(s) at line(s) {shown}; first: {problems[0]}",
                  stacklevel=4)  # the caller of load_prompts


MAX_ROW_BYTES = 1 << 20  # one prompt row: a chat of about a million characters is not a prompt
MAX_FILE_BYTES = 4 << 30
# A file whose malformed rows outnumber its prompts past this many is not a prompt file (a binary file, a
# /proc file that reads on and on): refused, instead of collecting a problem per line until memory ends.
MAX_MALFORMED_ROWS = 1000


def _bounded_lines(f, path):
    """The file's lines, each read at most MAX_ROW_BYTES at a time: a longer line is skipped unread
    (yielded as None) instead of being held in memory whole. Bytes are counted as they are read, since
    a file's size on disk does not bound what it reads (/proc files say 0)."""
    total = 0

    def read(limit):
        nonlocal total
        raw = f.readline(limit)
        total += len(raw)
        if total > MAX_FILE_BYTES:
            raise ValueError(f"{path}: read past {MAX_FILE_BYTES} bytes, the most a prompt file may hold (split it)")
        return raw

    while True:
        raw = read(MAX_ROW_BYTES + 1)
        if not raw:
            return
        if len(raw) > MAX_ROW_BYTES and not raw.endswith(b"\n"):
            while raw and not raw.endswith(b"\n"):  # the rest of the long line, dropped in pieces
                raw = read(MAX_ROW_BYTES)
            yield None
            continue
        yield raw


def load_prompts(path=DEFAULT_DAPO_PATH, input_key: str = "prompt", label_key: str = "label", tokenizer=None,
                 apply_chat_template: bool = True, shuffle_seed: int | None = 0,
                 on_error: str = "skip") -> tuple[list[Sample], list[Problem]]:
    """Read a DAPO-format jsonl file into (samples, problems).

    With a tokenizer, each prompt is rendered by its chat template (`add_generation_prompt=True`) and
    tokenized; without one, `prompt_ids` stay empty and `prompt_text` is the messages' contents.
    Samples are shuffled by a seeded RNG (the DAPO file is ordered by difficulty); `shuffle_seed=None`
    keeps file order. on_error="skip" collects malformed rows as problems and warns once;
    on_error="raise" raises ValueError naming the first bad line."""
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {', '.join(ON_ERROR)}, got {on_error!r}")
    if apply_chat_template and tokenizer is not None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("apply_chat_template is set but the tokenizer has no chat template")
    size = os.path.getsize(path)
    if size > MAX_FILE_BYTES:
        raise ValueError(f"{path}: {size} bytes; prompt files are read whole into memory and may hold at most "
                         f"{MAX_FILE_BYTES} bytes (split it, or pass a --prompt-pool of a smaller file)")
    try:
        return _read_prompts(path, input_key, label_key, tokenizer, apply_chat_template, shuffle_seed, on_error)
    except OSError as err:
        if err.filename is None:  # a read that fails midway (/proc/self/mem: EIO) says which file it was
            raise type(err)(err.errno, err.strerror, str(path)) from None
        raise


def _read_prompts(path, input_key, label_key, tokenizer, apply_chat_template, shuffle_seed, on_error):
    samples, problems = [], []
    with open(path, "rb") as f:  # decoded line by line, so a binary file names its first bad line
        for number, raw in enumerate(_bounded_lines(f, path), start=1):
            try:
                if raw is None:
                    raise RowError(f"longer than {MAX_ROW_BYTES} bytes, the most a prompt row may hold (not read)")
                line = _decode(raw, first=number == 1)
                if not line.strip():
                    continue
                samples.append(parse_row(line, number, input_key, label_key, tokenizer, apply_chat_template))
            except RowError as err:
                if on_error == "raise":
                    raise ValueError(f"{path}: line {number}: {err}") from err
                problems.append(Problem(number, str(err)))
                if len(problems) > max(MAX_MALFORMED_ROWS, len(samples)):
                    raise ValueError(f"{path}: {len(problems)} malformed rows and {len(samples)} prompts by line "
                                     f"{number} (first: {problems[0]}); not a JSONL prompt file") from None
    if problems:
        _report(path, problems)
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(samples)
    return samples, problems
