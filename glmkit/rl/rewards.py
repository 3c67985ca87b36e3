"""Rule-based rewards with the recipe framework's `--rm-type` semantics.

- `deepscaler`: graded text = what follows the last `</think>`; without one, what follows the first
  `###Response` up to the next (`split("###Response")[1]`); without either the score is 0. Its
  answer is the last `\\boxed{...}` (found from the end; a last box without braces, `\\boxed 5`, or an
  `\\fbox{...}` where there is no `\\boxed` at all is located but not unboxed: no answer), graded
  against the label (itself unboxed when it is `\\boxed{..}`) by symbolic / numeric equivalence
  (math-verify). Score 1.0 or 0.0.
- `math`: the same answer rule over the whole response. Score 1.0 or 0.0.
- `dapo`: in the final 300 characters, the last match of `(?i)Answer\\s*:\\s*([^\\n]+)`, end-of-text
  markers (`<|endoftext|>`, `<|im_end|>`, any `<|...|>` token, `</s>`) removed, normalised, and
  compared with the label as `str(int(float(label)))` (the label's normal form when it is not a
  number). Score +1.0 or -1.0.

`glmkit reward --rm-type T --label L` scores one response read from stdin (see `main`).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import threading

THINK_END = "</think>"
RESPONSE_MARK = "###Response"
DAPO_WINDOW = 300  # DAPO only looks at the tail of a response
BOX_COMMANDS = ("\\boxed", "\\fbox")
# answers longer than this are compared as strings only: no final answer is that long, and math-verify's
# sympy parse of a pathological 200 KB "answer" takes seconds and logs the whole text on a timeout
MAX_PARSED_ANSWER = 1000
LOGGED_CHARS = 300  # math-verify's warnings quote the answer; longer ones are cut to this


# ----------------------------------------------------------------------------- boxed extraction

def _braced_content(text: str, open_at: int) -> str | None:
    """The text inside the `{` at `open_at` up to its matching `}`; None when it never closes.
    Escaped braces (`\\{`, `\\}`) are content, not structure."""
    depth = 0
    i = open_at
    while i < len(text):
        ch = text[i]
        if ch == "\\":
            i += 2  # skip the escaped character, whatever it is
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1:i]
        i += 1
    return None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`, or the `\\boxed 5` form) in `text`.

    Only the last occurrence counts: if it is unterminated (a truncated response) the answer is None,
    rather than falling back to an earlier box the model had moved past."""
    start, command = max((text.rfind(c), c) for c in BOX_COMMANDS)
    if start < 0:
        return None
    rest_at = start + len(command)
    after = text[rest_at:]
    stripped = after.lstrip(" ")
    if stripped.startswith("{"):
        return _braced_content(text, rest_at + len(after) - len(stripped))
    if len(stripped) < len(after) and stripped:
        # `\boxed 5`: the argument runs to the next whitespace or math delimiter
        return re.match(r"[^\s$]*", stripped).group(0) or None
    return None  # e.g. `\boxedfoo` is another command, or nothing follows


def framework_boxed(text: str) -> str | None:
    """The framework's answer rule: the content of the last `\\boxed{...}`. The last `\\boxed` is
    found from the end (an `\\fbox` only when there is no `\\boxed`); only a braced box unboxes, so
    `\\boxed 5`, an `\\fbox{...}` and an unterminated box give None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None  # an \fbox would be located here, but the framework cannot unbox it
    after = start + len("\\boxed")
    if not text.startswith("{", after):
        return None
    return _braced_content(text, after)


# ----------------------------------------------------------------------------- equivalence

_THOUSANDS = re.compile(r"[-+]?\d{1,3}(,\d{3})+(\.\d+)?")
_THIN_SPACES = re.compile(r"(?<=\d)(\\,|\\!|\\;|\{,\}|~)(?=\d)")


def _strip_math_delimiters(answer: str) -> str:
    """Remove one pair of surrounding `$...$`, `\\(...\\)` or `\\[...\\]`, and an outer `\\boxed{}`."""
    answer = answer.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(answer) >= len(left) + len(right) and answer.startswith(left) and answer.endswith(right):
            answer = answer[len(left):len(answer) - len(right)].strip()
            break
    boxed = last_boxed(answer) if answer.startswith(BOX_COMMANDS) else None
    return answer if boxed is None else boxed.strip()


def _canonical_math(answer: str) -> str:
    """Prepare an answer for math-verify: bare content, digit-group separators removed.
    `1{,}000` and `1\\,000` would otherwise parse as 1 and 1*0; plain `1,000` math-verify handles,
    but removing it here keeps the string fallback exact too."""
    answer = _strip_math_delimiters(answer)
    answer = _THIN_SPACES.sub("", answer)
    if _THOUSANDS.fullmatch(answer):
        answer = answer.replace(",", "")
    return answer


def _timeout_seconds() -> int | None:
    # math-verify times out with signal.alarm, which raises outside the main thread
    return 5 if threading.current_thread() is threading.main_thread() else None


class _ShortRecords(logging.Filter):
    """Cuts math-verify's log messages (they quote the whole answer) to LOGGED_CHARS."""

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if len(text) > LOGGED_CHARS:
            record.msg, record.args = f"{text[:LOGGED_CHARS]}... ({len(text)} characters)", None
        return True


_SHORT = _ShortRecords()


def _quiet_math_verify_logs() -> None:
    for name in ("math_verify.parser", "math_verify.grader", "math_verify.metric"):
        logger = logging.getLogger(name)
        if _SHORT not in logger.filters:
            logger.addFilter(_SHORT)


def _parse(answer: str):
    from math_verify import parse

    _quiet_math_verify_logs()
    # Bare text is parsed as free-form prose (`10^{3}` -> 10, `\frac12` -> nothing), so the answer
    # goes in as LaTeX math between dollars.
    return parse(f"${answer}$", parsing_timeout=_timeout_seconds())


def is_equivalent(pred: str | None, label) -> bool:
    """Symbolic / numeric equivalence of a predicted answer and a label (`1/2` == `0.5` == `\\frac{1}{2}`).
    Equal canonical strings count as equal even when math-verify cannot parse them (e.g. text)."""
    if pred is None:
        return False
    pred, gold = _canonical_math(pred), _canonical_math(str(label))
    if not pred or not gold:
        return False
    if pred == gold:
        return True
    if len(pred) > MAX_PARSED_ANSWER or len(gold) > MAX_PARSED_ANSWER:
        return False
    from math_verify import verify

    try:
        # math-verify's verify is not symmetric: the label goes first
        return bool(verify(_parse(gold), _parse(pred), timeout_seconds=_timeout_seconds()))
    except Exception:  # a pathological answer is wrong, never a crashed rollout
        return False


# ----------------------------------------------------------------------------- the rewards

def _label_answer(label) -> str:
    """A label that is itself `\\boxed{..}` is unboxed first."""
    label = str(label)
    return framework_boxed(label) if label.strip().startswith("\\boxed{") else label


def deepscaler(response: str, label) -> dict:
    """1.0 when the answer (`framework_boxed`) of the text after the last `</think>` (or, without one,
    of `response.split("###Response")[1]`) equals the label, else 0.0; 0.0 without either marker (a
    box inside unfinished thinking is ignored)."""
    if THINK_END in response:
        graded = response.rsplit(THINK_END, 1)[1]
    elif RESPONSE_MARK in response:
        graded = response.split(RESPONSE_MARK)[1]
    else:
        return {"score": 0.0, "pred": None}
    pred = framework_boxed(graded)
    return {"score": float(is_equivalent(pred, _label_answer(label))), "pred": pred}


def math(response: str, label) -> dict:
    """1.0 when the answer (`framework_boxed`) of the whole response equals the label, else 0.0."""
    pred = framework_boxed(response)
    return {"score": float(is_equivalent(pred, _label_answer(label))), "pred": pred}


# DAPO-style normalisation: what a model writes around an integer that does not change it.
_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|operatorname)\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|\{,\}|~")
_DEGREES_PERCENT = re.compile(r"\^\s*\{?\\circ\}?|\\%|%|\\degree|°")
_NUMBER_THEN_WORDS = re.compile(r"([-+]?\d[\d,]*(?:\.\d+)?)\s+[A-Za-z][A-Za-z\s.]*")
_INTEGER = re.compile(r"[-+]?\d+")


def normalize_dapo_answer(answer: str) -> str:
    """Normalise a DAPO `Answer:` string (or a label) for string comparison.

    Steps, in order: strip; take the content of a `\\boxed{}`; unwrap `\\text{}`-like wrappers;
    drop `$`, `\\(`, `\\)`, `\\[`, `\\]`, LaTeX spacing, degree and percent signs; keep what follows the
    last `=` (`x = 5` -> `5`); drop trailing words after a number (units: `5 cm`, `12 apples`); drop
    trailing periods; remove thousands separators (`1,000` -> `1000`, only in a valid 3-digit grouping,
    so a list `1,2` stays); write integers canonically (`+07` -> `7`)."""
    answer = answer.strip()
    boxed = last_boxed(answer)
    if boxed is not None:
        answer = boxed
    answer = _TEXT_WRAPPERS.sub(r"\1", answer)
    for token in ("$", "\\(", "\\)", "\\[", "\\]"):
        answer = answer.replace(token, "")
    answer = _DEGREES_PERCENT.sub("", _SPACING.sub("", answer))
    answer = answer.split("=")[-1].strip()
    words = _NUMBER_THEN_WORDS.fullmatch(answer)
    if words:
        answer = words.group(1)
    answer = answer.rstrip(". ").strip()
    if _THOUSANDS.fullmatch(answer):
        answer = answer.replace(",", "")
    if _INTEGER.fullmatch(answer):
        answer = str(int(answer))
    return answer


_DAPO_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
_END_MARKERS = re.compile(r"<\|[^|<>\s]*\|>|</s>")  # <|endoftext|>, <|im_end|>, <|eot_id|>, </s>


def dapo_label(label) -> str:
    """The label as the framework compares it: `str(int(float(label)))`, or its normal form when it
    is not a number."""
    try:
        return str(int(float(str(label))))
    except (ValueError, OverflowError):
        return normalize_dapo_answer(str(label))


def dapo(response: str, label) -> dict:
    """+1.0 when the last `Answer:` (any case, spaces before the colon allowed) in the final 300
    characters matches the label after removing end-of-text markers and normalising, else -1.0.
    `pred` is "" when there is no `Answer:` in the window."""
    matches = _DAPO_ANSWER.findall(response[-DAPO_WINDOW:])
    pred = normalize_dapo_answer(_END_MARKERS.sub("", matches[-1])) if matches else ""
    acc = bool(pred) and pred == dapo_label(label)
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


REWARDS = {"deepscaler": deepscaler, "math": math, "dapo": dapo}


def score(rm_type: str, response: str, label) -> dict:
    """The reward `rm_type` of one response: a dict with at least "score"."""
    if rm_type not in REWARDS:
        raise ValueError(f"unknown rm_type {rm_type!r}; allowed: {', '.join(sorted(REWARDS))}")
    return REWARDS[rm_type](response, label)


# ----------------------------------------------------------------------------- command line

def _add_reward_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rm-type", required=True, choices=sorted(REWARDS), help="reward function")
    parser.add_argument("--label", required=True, help="the reference answer")


MAX_RESPONSE_BYTES = 1 << 20  # one response on stdin (a generation is far shorter)


def cmd_reward(args) -> int:
    """Score one response read from stdin (at most MAX_RESPONSE_BYTES); print one JSON line."""
    stream = getattr(sys.stdin, "buffer", None)  # a text stream without one (a test's StringIO) reads as text
    data = stream.read(MAX_RESPONSE_BYTES + 1) if stream is not None else sys.stdin.read(MAX_RESPONSE_BYTES + 1)
    if len(data) > MAX_RESPONSE_BYTES:
        raise ValueError(f"stdin: the response is longer than {MAX_RESPONSE_BYTES} bytes; give one response")
    text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
    if not (dapo_label(args.label) if args.rm_type == "dapo" else args.label.strip()):
        # a label is any text the grader compares (as the framework's are), but an empty one matches nothing
        raise ValueError(f"--label {args.label!r}: empty{' once normalised' if args.label.strip() else ''}; "
                         f"no response can match it")
    print(json.dumps(score(args.rm_type, text, args.label)))
    return 0


def add_reward_command(subparsers) -> argparse.ArgumentParser:
    """Register `reward` on a `glmkit` subparsers object (its handler is `args.func`)."""
    parser = subparsers.add_parser("reward", help="score one response from stdin with a recipe reward",
                                   description="Read one response from stdin and print its reward as one JSON line.")
    _add_reward_arguments(parser)
    parser.set_defaults(func=cmd_reward)
    return parser


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="glmkit reward",
                                     description="Read one response from stdin and print its reward as one JSON line.")
    _add_reward_arguments(parser)
    return cmd_reward(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
