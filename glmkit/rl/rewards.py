"""Rule-based rewards with the recipe framework's `--rm-type` semantics.

Two graders. `framework` (the default) gives exactly what radixark/miles's rule-based rewards give
(`miles/rollout/rm_hub/`, followed at commit 31f1ca961 of 2026-08-21), by glmkit's own code; `math-verify`
is glmkit's earlier, more lenient grader (symbolic equivalence by math-verify), kept for users who want it.

The framework grader, per `--rm-type`:

- `deepscaler`: graded text = what follows the last `</think>`; without one, `response.split("###Response")[1]`
  (the text between the first and second marker); without either, score 0. The answer is the content of the
  last `\\boxed` (the box must open `\\boxed{` right away; braces are counted plainly, so `\\{` counts too; an
  unclosed last box, `\\boxed 5` or an `\\fbox` alone give no answer: score 0). No answer: 0. Then the label:
  "" scores 0; a label that is not a str, int or float (None, a list) is an AssertionError in the framework,
  an error row here. A label holding `\\boxed` is unboxed the same way (no box found: 0). Correct (1) when
  the answer and the label are equal after the MATH normalisation (`_mathd_normal`: `\\text{..}` unwrapped,
  `\\left`/`\\right`, degrees, `\\$`, `\\%` and spaces dropped, `tfrac`/`dfrac` as `frac`, `\\frac12` and `a/b`
  written as `\\frac{a}{b}`, `0.5` as `\\frac{1}{2}`, a short `k=` prefix dropped, a unit after `\\text{ `
  dropped), or equal under the sympy rules (`_grade_sympy`): both normalised by `_sympy_normal` (units,
  `$`, `%`, words `million`/`billion`/`trillion`, LaTeX turned into text by pylatexenc, spaces and braces
  dropped, lower case, integral numbers written as integers, `1,000` as `1000`, `7 3/4` as `7+3/4`); equal
  strings are correct; else both split into tuple elements (`(a,b)`, `[a,b)`), whose brackets must agree,
  and each pair of elements is compared: two fractions `a/b` only as strings (unreduced is wrong), an
  integer and a non-integer never, anything else by `sympy.simplify(label - answer) == 0`, attempted only
  when the difference has at most two distinct letters and no `^{`, `^(`, `^12` or `^2^`.
- `math`: a falsy label (None, 0, 0.0, "", False) scores 0; else the label is `str(label)`, unboxed when
  it holds `\\boxed`; the answer is the last box of the whole response; graded as deepscaler. Never raises.
- `dapo`: only the last 300 characters are read; the answer is the last match of `(?i)Answer\\s*:\\s*([^\\n]+)`
  there (none: the text "[INVALID]"), normalised (`normalize_dapo_answer`: text after the last `=`; "an ",
  "a ", spaces and some phrases removed; a list of unit words and the markers `<|im_end|>` and
  `<|endoftext|>` removed, but not `</s>` or `<|eot_id|>`; the text between a line's first two `$`;
  `\\text{}`, `\\textbf{}`, `\\overline{}`, `\\boxed{}` unwrapped; `\\fracab` as `\\frac{a}{b}`; `$` removed;
  commas of an all-digit answer removed). The label is normalised the same way and then written as
  `str(int(float(label)))`: a label that is not a number raises there (ValueError, or OverflowError for
  "inf"), whatever the response, and a fractional label is truncated (`5.5` -> "5"). Score 1.0 when the
  two strings are equal, else -1.0.

`score(rm_type, response, label, grader="framework")` returns a dict: "score" (a float: the framework's 1 /
0 for deepscaler and math, its 1.0 / -1.0 for dapo) and "pred" (the extracted answer: None when there is
none; dapo's normalised answer), plus dapo's "acc". Where the framework raises, `score` does not: it
returns "score": None, "error": "<ExceptionType>: <message as the framework raises it>" (just the type
when the framework's message is empty, as for its bare `assert`), "raised_by": "framework", and "pred".
A row glmkit cannot grade as the framework does has "raised_by": "glmkit" (see pylatexenc below).

Where glmkit differs from the framework (bounds, so no input hangs or exhausts memory; each is flagged
in the row as "warning", which a graded row otherwise lacks):
- `sympy.simplify` runs in a helper process for at most SYMPY_TIMEOUT_S seconds per comparison; a
  comparison that takes longer counts as unequal (the framework waits however long it takes, e.g. for
  `9**9**9`); the framework counts a comparison that fails (raises) as unequal, which this follows.
- A tuple element longer than MAX_PARSED_ANSWER characters is not given to sympy: unequal (the framework
  parses it, taking seconds to minutes on a 200 KB sum; equal strings still compare equal before this).
- LaTeX is turned into text by pylatexenc, as in the framework, when it is installed. Without it glmkit's
  own converter handles a common subset exactly as pylatexenc 2.11 does (`\\frac`, `\\sqrt`, `\\text`,
  `\\pi`, `\\infty`, `\\cdot`, spacing, ... see `_LatexSubset`); an answer or label outside the subset then
  gives an error row ("raised_by": "glmkit") saying pylatexenc is needed, rather than a guess.
- `glmkit reward` reads at most MAX_RESPONSE_BYTES of stdin (the framework has no command line).

`glmkit reward --rm-type T --label L [--grader G]` scores one response read from stdin (see `cmd_reward`):
it prints the row as one JSON line and exits 0 when the row has a score, 1 when it has an error instead
(the JSON line, with "score": null and the error, is printed all the same), 2 on bad input (an empty
label, a response over MAX_RESPONSE_BYTES).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import select
import subprocess
import sys
import threading

GRADERS = ("framework", "math-verify")
FRAMEWORK_COMMIT = "31f1ca961"  # radixark/miles, the commit whose rm_hub the framework grader follows

THINK_END = "</think>"
RESPONSE_MARK = "###Response"
DAPO_WINDOW = 300  # DAPO only looks at the tail of a response
BOX_COMMANDS = ("\\boxed", "\\fbox")
# answers longer than this are not parsed: no final answer is that long, and a parse of a pathological
# 200 KB "answer" takes seconds (math-verify also logs the whole text on a timeout)
MAX_PARSED_ANSWER = 1000
LOGGED_CHARS = 300  # math-verify's warnings quote the answer; longer ones are cut to this
SYMPY_TIMEOUT_S = 5.0  # one sympy comparison of the framework grader (see the module docstring)
SYMPY_START_S = 120.0  # the sympy helper process's start (imports) on a loaded machine

# ============================================================================= the framework grader

class _Raised(Exception):
    """What the framework raises on a row: carried to `score`, which reports it instead of a score."""

    def __init__(self, error: BaseException, pred=None):
        super().__init__(str(error))
        self.error, self.pred = error, pred


class _CannotFollow(Exception):
    """glmkit cannot grade this row as the framework would (it needs pylatexenc for this LaTeX)."""


def _error_text(error: BaseException) -> str:
    message = str(error)
    return f"{type(error).__name__}: {message}" if message else type(error).__name__


# ----------------------------------------------------------------------------- boxed answers

def framework_boxed(text: str) -> str | None:
    """The framework's answer rule: the content of the last `\\boxed{...}`, or None.

    Only text holding `\\boxed` has an answer. From the last `\\boxed`, braces are counted as they come
    (escaped ones too) until the count first returns to zero; that span must start `\\boxed{`. So an
    unclosed last box, `\\boxed 5`, `\\boxedx{5}` and an `\\fbox{..}` alone give None."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    depth = 0
    for at in range(start, len(text)):
        ch = text[at]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                span = text[start:at + 1]
                return span[len("\\boxed{"):-1] if span.startswith("\\boxed{") else None
    return None


# ----------------------------------------------------------------------------- the MATH normalisation

_TEXT_WHOLE = re.compile(r"\\text\{([^\n]+)\}")


def _frac_shorthand(s: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{2}` -> `\\frac{1}{2}`; IndexError on a `\\frac` at the very end,
    and the input unchanged when a `\\frac` is followed by a single character."""
    pieces = s.split("\\frac")
    out = [pieces[0]]
    for piece in pieces[1:]:
        out.append("\\frac")
        if piece[0] == "{":  # IndexError on an empty piece: the caller keeps the un-normalised answer
            out.append(piece)
            continue
        if len(piece) < 2:
            return s
        first, second, rest = piece[0], piece[1], piece[2:]
        out.append("{" + first + "}" + (second if second == "{" else "{" + second + "}") + rest)
    return "".join(out)


def _sqrt_shorthand(s: str) -> str:
    """`\\sqrt3` -> `\\sqrt{3}` (one character); IndexError on a `\\sqrt` at the very end."""
    if "\\sqrt" not in s:
        return s
    pieces = s.split("\\sqrt")
    out = [pieces[0]]
    for piece in pieces[1:]:
        out.append("\\sqrt" + piece if piece[0] == "{" else "\\sqrt{" + piece[0] + "}" + piece[1:])
    return "".join(out)


def _slash_as_frac(s: str) -> str:
    """`a/b` with integers written plainly -> `\\frac{a}{b}`."""
    parts = s.split("/")
    if len(parts) != 2:
        return s
    try:
        top, bottom = int(parts[0]), int(parts[1])
    except ValueError:
        return s
    return "\\frac{" + str(top) + "}{" + str(bottom) + "}" if s == f"{top}/{bottom}" else s


def _mathd_rules(s: str) -> str:
    for old, new in (("\n", ""), ("\\!", ""), ("\\\\", "\\"), ("tfrac", "frac"), ("dfrac", "frac"),
                     ("\\left", ""), ("\\right", ""), ("^{\\circ}", ""), ("^\\circ", ""), ("\\$", "")):
        s = s.replace(old, new)
    if "\\text{ " in s:  # a unit after "\text{ ": dropped; two of them is an error (the answer is kept)
        before, *after = s.split("\\text{ ")
        if len(after) != 1:
            raise AssertionError("two units")
        s = before
    s = s.replace("\\%", "").replace(" .", " 0.").replace("{.", "{0.")
    if not s:
        return s
    if s[0] == ".":
        s = "0" + s
    sides = s.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:
        s = sides[1]
    s = _frac_shorthand(_sqrt_shorthand(s).replace(" ", ""))
    if s == "0.5":
        s = "\\frac{1}{2}"
    return _slash_as_frac(s)


def _mathd_normal(answer: str | None) -> str | None:
    """The MATH-dataset normalisation the framework's first check compares with (strings equal after it)."""
    if answer is None:
        return None
    answer = answer.strip()
    whole = _TEXT_WHOLE.fullmatch(answer)
    if whole:
        answer = whole.group(1).strip()
    try:
        return _mathd_rules(answer)
    except (AssertionError, IndexError):
        return answer


def _grade_mathd(given: str, truth: str | None) -> bool:
    return _mathd_normal(truth) == _mathd_normal(given)


# ----------------------------------------------------------------------------- LaTeX as text

class _LatexSubset:
    """LaTeX -> text exactly as pylatexenc 2.11's LatexNodes2Text does it, for a subset: plain ASCII text,
    `{..}` groups, the control symbols `\\{ \\} \\, \\; \\! \\ ` and `\\\\` (a line break), symbol macros (`SYMBOLS`, which swallow the
    spaces after them), `\\text`-like wrappers, `\\frac{a}{b}` -> `a/b` and `\\sqrt{a}` -> `√(a)` (arguments
    braced or one letter or digit). Anything else raises _CannotFollow."""

    PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 +-*/=()[].,:;<>|!?^_")
    SYMBOLS = {"pi": "π", "infty": "∞", "cdot": "·", "times": "×", "pm": "±", "mp": "∓", "div": "÷",
               "le": "≤", "leq": "≤", "ge": "≥", "geq": "≥", "neq": "≠", "approx": "≈", "cup": "∪",
               "cap": "∩", "in": "∈", "circ": "∘", "emptyset": "∅", "varnothing": "∅", "ldots": "…",
               "dots": "…", "cdots": "⋯", "left": "", "right": "", "quad": "  ",
               "log": "log", "ln": "ln", "sin": "sin", "cos": "cos", "tan": "tan", "exp": "exp",
               "alpha": "α", "beta": "β", "gamma": "γ", "delta": "δ", "theta": "θ", "lambda": "λ", "mu": "μ",
               "sigma": "σ", "omega": "ω"}
    WRAPPERS = frozenset({"text", "mathrm", "textbf", "operatorname", "overline"})
    CONTROL = {"{": "{", "}": "}", ",": " ", ";": " ", "!": "", " ": " ", "\\": "\n"}

    def __init__(self, text: str):
        self.text = text

    def convert(self) -> str:
        return self._nodes(0, closing=False)[0]

    def _fail(self, why: str):
        raise _CannotFollow(why)

    def _nodes(self, at: int, closing: bool) -> tuple[str, int]:
        text, out = self.text, []
        while at < len(text):
            ch = text[at]
            if ch == "}":
                if not closing:
                    self._fail("an unmatched }")
                return "".join(out), at + 1
            if ch == "{":
                inner, at = self._nodes(at + 1, closing=True)
                out.append(inner)
            elif ch == "\\":
                inner, at = self._macro(at)
                out.append(inner)
            elif ch in self.PLAIN and not text.startswith("--", at):
                out.append(ch)
                at += 1
            else:
                self._fail(f"the character {ch!r}")
        if closing:
            self._fail("an unclosed {")
        return "".join(out), at

    def _skip_spaces(self, at: int) -> int:
        while at < len(self.text) and self.text[at] == " ":
            at += 1
        return at

    def _argument(self, at: int) -> tuple[str, int]:
        at = self._skip_spaces(at)
        if at < len(self.text) and self.text[at] == "{":
            return self._nodes(at + 1, closing=True)
        if at < len(self.text) and self.text[at].isascii() and self.text[at].isalnum():
            return self.text[at], at + 1
        return self._fail("a macro argument that is not {..}, a letter or a digit")

    def _macro(self, at: int) -> tuple[str, int]:
        text = self.text
        name_end = at + 1
        while name_end < len(text) and text[name_end].isascii() and text[name_end].isalpha():
            name_end += 1
        name = text[at + 1:name_end]
        if not name:
            if at + 1 < len(text) and text[at + 1] in self.CONTROL:
                if text[at + 1] == "\\" and text[self._skip_spaces(at + 2):][:1] in ("[", "*"):
                    return self._fail("a line break with an option")
                return self.CONTROL[text[at + 1]], at + 2
            return self._fail("a control symbol")
        after = self._skip_spaces(name_end)
        if name in self.SYMBOLS:
            return self.SYMBOLS[name], after
        if name in self.WRAPPERS:
            return self._argument(after)
        if name == "frac":
            top, at = self._argument(after)
            bottom, at = self._argument(at)
            return f"{top}/{bottom}", at
        if name == "sqrt" and not text.startswith("[", after):
            inner, at = self._argument(after)
            return f"√({inner})", at
        return self._fail(f"the macro \\{name}")


_LATEX_BACKEND = None  # "pylatexenc" or "subset", decided on first use (tests may set it)
_PYLATEXENC = None


def _latex_to_text(expr: str) -> str:
    """pylatexenc's LatexNodes2Text().latex_to_text when pylatexenc is installed, else `_LatexSubset`."""
    global _LATEX_BACKEND, _PYLATEXENC
    if _LATEX_BACKEND is None:
        try:
            import pylatexenc  # noqa: F401

            _LATEX_BACKEND = "pylatexenc"
        except ImportError:
            _LATEX_BACKEND = "subset"
    if _LATEX_BACKEND == "subset":
        try:
            return _LatexSubset(expr).convert()
        except RecursionError:
            raise _CannotFollow("LaTeX nested too deeply") from None
        except _CannotFollow as why:
            raise _CannotFollow(f"this answer's LaTeX ({why}) is outside what glmkit converts itself; the "
                                f"framework converts it with pylatexenc: pip install pylatexenc") from None
    if _PYLATEXENC is None:
        from pylatexenc.latex2text import LatexNodes2Text

        logging.getLogger("pylatexenc").setLevel(logging.ERROR)  # its configuration warnings are noise here
        _PYLATEXENC = LatexNodes2Text()
    return _PYLATEXENC.latex_to_text(expr)


def _latex_step(expr: str) -> str:
    """The framework's LaTeX step: fractions spaced (mixed numbers), the text form, then the symbols that
    sympy reads spelled out. A conversion that fails leaves the expression as it was."""
    expr = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    try:
        text = _latex_to_text(expr)
    except _CannotFollow:
        raise
    except Exception:  # the framework ignores a failed conversion: the expression stays as it was
        return None
    for symbol, word in (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*")):
        text = text.replace(symbol, word)
    return text.strip()


# ----------------------------------------------------------------------------- the sympy normalisation

_TEXT_WHOLE_LINE = re.compile(r"\\text\{([^\n]+)\}\n?")
_UNITS = ("degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month",
          "year", "foot", "feet", "inch", "yard")
_UNIT_PATTERNS = tuple(re.compile(unit + r"(es)?(s)? *(\^[0-9]+)?") for unit in _UNITS)
_GROUPED_COMMA = re.compile(r"(\d),(\d\d\d)($|\D)")
_FRACTION = re.compile(r"-?[0-9]+[^\n]?/0*[1-9][0-9]*[^\n]?\n?")
_BRACKETS = "()[]"


def _near_integer(x: float) -> bool:
    try:
        return abs(x - int(round(x))) <= 1e-7
    except (OverflowError, ValueError):  # inf, nan
        return False


def _strip_grouping_commas(s: str) -> str:
    """Remove commas that group digits by three (`1,000,000`), not those of a tuple (`1,2`)."""
    while True:
        stripped = _GROUPED_COMMA.sub(r"\1\2\3", s)
        if stripped == s:
            return s
        s = stripped


def _is_integer_text(s: str) -> bool:
    try:
        return _near_integer(float(_strip_grouping_commas(s)))
    except ValueError:
        return False


def _sympy_normal(expr: str | None) -> str | None:
    """The normal form the framework's sympy check compares (see the module docstring)."""
    if expr is None:
        return None
    whole = _TEXT_WHOLE_LINE.fullmatch(expr)
    if whole:
        expr = whole.group(1)
    for old, new in (("\\%", "%"), ("\\$", "$"), ("$", ""), ("%", ""), (" or ", " , "), (" and ", " , "),
                     ("million", "*10^6"), ("billion", "*10^9"), ("trillion", "*10^12")):
        expr = expr.replace(old, new)
    for unit in _UNIT_PATTERNS:
        expr = unit.sub("", expr)
    expr = re.sub(r"\^ *\\circ", "", expr)
    if expr[:1] == "{" and expr[-1:] == "}":
        expr = expr[1:-1]
    expr = re.sub(r",\\! *", "", expr)
    try:
        number = float(expr)
    except ValueError:
        number = None
    if number is not None and _near_integer(number):
        expr = str(int(round(number)))
    if "\\" in expr:
        converted = _latex_step(expr)
        if converted is not None:
            expr = converted
    expr = re.sub(r"- *", "-", expr)
    expr = re.sub(r"([0-9]) +([0-9])", r"\1+\2", expr)  # a mixed number 7 3/4 is 7+3/4
    expr = expr.replace(" ", "").replace("{", "").replace("}", "").lower()
    if _is_integer_text(expr):
        expr = str(int(float(expr.replace(",", ""))))
    return expr


def _tuple_elements(expr: str) -> list[str]:
    expr = _strip_grouping_commas(expr)
    if not expr:
        return []
    if len(expr) > 2 and expr[0] in _BRACKETS and expr[-1] in _BRACKETS and \
            not any(ch in expr[1:-1] for ch in _BRACKETS):
        return [element.strip() for element in expr[1:-1].split(",")]
    return [expr]


def _sympy_may_try(expr: str) -> bool:
    """The framework tries sympy only on at most two distinct letters (`sqrt`, `frac` not counted) and
    without `^{`, `^(`, a two-digit exponent or a chained power."""
    letters = {ch for ch in expr.replace("sqrt", "").replace("frac", "") if ch.isalpha()}
    if len(letters) > 2 or "^{" in expr or "^(" in expr:
        return False
    return not (re.search(r"\^[0-9]+\^", expr) or re.search(r"\^[0-9][0-9]+", expr))


# ----------------------------------------------------------------------------- sympy, in a helper process

_SYMPY_WORKER = r"""
import json, sys
out, sys.stdout = sys.stdout, sys.stderr
from sympy import simplify
from sympy.parsing.sympy_parser import parse_expr, standard_transformations, implicit_multiplication_application
rules = standard_transformations + (implicit_multiplication_application,)
out.write("ready\n")
out.flush()
for line in sys.stdin:
    try:
        zero = bool(simplify(parse_expr(json.loads(line).replace("^", "**"), transformations=rules)) == 0)
    except Exception:
        zero = False
    out.write("1\n" if zero else "0\n")
    out.flush()
"""


class _SympyProcess:
    """`simplify(parse(expr)) == 0` in a helper process, so a comparison that runs away can be stopped
    (a signal cannot stop one big integer power). Started on first use; restarted after a timeout."""

    def __init__(self):
        self._lock = threading.Lock()
        self._proc = None

    def _start(self):
        self._proc = subprocess.Popen([sys.executable, "-c", _SYMPY_WORKER], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, bufsize=0)
        if self._line(SYMPY_START_S) != b"ready\n":  # its imports do not count against a comparison's time
            self._stop()
            raise RuntimeError(f"the sympy helper process ({sys.executable}) did not start in {SYMPY_START_S:g} s")

    def _line(self, timeout: float) -> bytes | None:
        """One line from the helper, or None when none came within `timeout` seconds (or it died)."""
        fd, reply = self._proc.stdout.fileno(), b""
        while not reply.endswith(b"\n"):
            ready, _, _ = select.select([fd], [], [], timeout)
            chunk = os.read(fd, 64) if ready else b""
            if not chunk:
                return None
            reply += chunk
        return reply

    def _stop(self):
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def is_zero(self, expr: str, timeout: float) -> bool | None:
        """True / False, or None when it did not finish within `timeout` seconds."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start()
            try:
                self._proc.stdin.write((json.dumps(expr) + "\n").encode())
            except BrokenPipeError:
                self._stop()
                return False
            reply = self._line(timeout)
            if reply is None:  # timed out, or the helper died (out of memory): not equal
                self._stop()
                return None
            return reply == b"1\n"


_SYMPY = _SympyProcess()


class _Comparison:
    """One framework-grader comparison; records bounds glmkit applied (see the module docstring)."""

    def __init__(self):
        self.warnings = []

    def sympy_equal(self, truth: str, given: str) -> bool:
        expr = f"({truth})-({given})"
        if not _sympy_may_try(expr):
            return False
        if len(truth) > MAX_PARSED_ANSWER or len(given) > MAX_PARSED_ANSWER:
            self.warnings.append(f"an element longer than {MAX_PARSED_ANSWER} characters was not given to sympy "
                                 f"(counted unequal; the framework would try)")
            return False
        zero = _SYMPY.is_zero(expr, SYMPY_TIMEOUT_S)
        if zero is None:
            self.warnings.append(f"sympy did not finish in {SYMPY_TIMEOUT_S:g} s (counted unequal; the framework "
                                 f"has no time limit)")
            return False
        return zero

    def grade_sympy(self, given: str, truth: str | None) -> bool:
        truth_n = _sympy_normal(truth)
        if truth_n is None:
            return False
        given_n = _sympy_normal(given)
        if truth_n == given_n:
            return True
        if not given_n:
            return False
        truths, givens = _tuple_elements(truth_n), _tuple_elements(given_n)
        if len(truths) > 1 and (truth_n[0] != given_n[0] or truth_n[-1] != given_n[-1]):
            return False
        if len(truths) != len(givens):
            return False
        for t, g in zip(truths, givens):
            if _FRACTION.fullmatch(t) and _FRACTION.fullmatch(g):
                ok = t == g  # unreduced fractions are wrong: no simplification
            elif _is_integer_text(t) != _is_integer_text(g):
                ok = False  # an integer label wants an integer answer
            else:
                ok = self.sympy_equal(t, g)
            if not ok:
                return False
        return True

    def correct(self, given: str, truth: str | None) -> bool:
        return _grade_mathd(given, truth) or self.grade_sympy(given, truth)


def _graded(score, pred, comparison: _Comparison, **extra) -> dict:
    row = {"score": float(score), **extra, "pred": pred}
    if comparison.warnings:
        row["warning"] = "; ".join(comparison.warnings)
    return row


# ----------------------------------------------------------------------------- the framework's rewards

def _boxed_solution(solution: str, label) -> dict:
    """deepscaler's grading of one solution text against the label."""
    pred = framework_boxed(solution) if "\\boxed" in solution else None
    comparison = _Comparison()
    if pred is None or (isinstance(label, str) and label == ""):
        return _graded(0, pred, comparison)
    if not isinstance(label, (str, float, int)):
        raise _Raised(AssertionError(), pred)  # the framework asserts the label's type, without a message
    truth = str(label)
    if "\\boxed" in truth:
        truth = framework_boxed(truth)
        if truth is None:
            return _graded(0, pred, comparison)
    return _graded(1 if comparison.correct(pred, truth) else 0, pred, comparison)


def deepscaler(response: str, label) -> dict:
    """The framework's `deepscaler` reward (see the module docstring); raises _Raised where it raises."""
    if THINK_END in response:
        solution = response.split(THINK_END)[-1]
    elif RESPONSE_MARK in response:
        solution = response.split(RESPONSE_MARK)[1]
    else:
        return {"score": 0.0, "pred": None}
    return _boxed_solution(solution, label)


def math(response: str, label) -> dict:
    """The framework's `math` reward (see the module docstring)."""
    comparison = _Comparison()
    if not label:
        return _graded(0, framework_boxed(response) if "\\boxed" in response else None, comparison)
    truth = str(label)
    if "\\boxed" in truth:
        truth = framework_boxed(truth)
    pred = framework_boxed(response) if "\\boxed" in response else None
    if pred is None:
        return _graded(0, pred, comparison)
    return _graded(1 if comparison.correct(pred, truth) else 0, pred, comparison)


_DAPO_REPLACED = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
                  (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_DAPO_REMOVED = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
                 "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
                 "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
                 "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
                 ",\\!", "{,}", '"', "\\dots", "<|im_end|>", "<|endoftext|>")
_DAPO_UNWRAPPED = tuple(re.compile(command + r"\{([^\n]*?)\}") for command in (r"\\text", r"\\textbf", r"\\overline"))
_DAPO_BOXED = re.compile(r"\\boxed\{([^\n]*)\}")
_DAPO_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")


def _between_first_dollars(line: str) -> str:
    first = line.find("$")
    second = line.find("$", first + 1) if first >= 0 else -1
    return "$" + line[first + 1:second] + "$" if second >= 0 else line


def normalize_dapo_answer(answer) -> str:
    """The framework's DAPO normalisation of an answer or a label (see the module docstring)."""
    s = str(answer).split("=")[-1]
    for old, new in _DAPO_REPLACED:
        s = s.replace(old, new)
    for removed in _DAPO_REMOVED:
        s = s.replace(removed, "")
    s = "\n".join(_between_first_dollars(line) for line in s.split("\n"))
    for wrapper in _DAPO_UNWRAPPED:
        s = wrapper.sub(r"\1", s)
    s = _DAPO_BOXED.sub(r"\1", s)
    s = re.sub(r"frac([^{])([^\n])", r"frac{\1}{\2}", s)
    s = re.sub(r"sqrt([^{])", r"sqrt{\1}", s).replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def dapo_label(label) -> str:
    """The label as the framework's dapo compares it: `str(int(float(normalised label)))`; raises the
    framework's ValueError (not a number) or OverflowError (infinite) otherwise."""
    return str(int(float(normalize_dapo_answer(label))))


def dapo(response: str, label) -> dict:
    """The framework's `dapo` reward (see the module docstring); raises _Raised where it raises."""
    found = _DAPO_ANSWER_LINE.findall(response[-DAPO_WINDOW:])
    pred = normalize_dapo_answer(found[-1] if found else "[INVALID]")
    try:
        truth = dapo_label(label)
    except (ValueError, OverflowError) as error:
        raise _Raised(error, pred) from None
    acc = pred == truth
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


# ============================================================================= the math-verify grader
# The lenient grader glmkit had before it followed the framework: `grader="math-verify"`.

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


def lenient_boxed(text: str) -> str | None:
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


# ----------------------------------------------------------------------------- the lenient rewards

def _label_answer(label) -> str:
    """A label that is itself `\\boxed{..}` is unboxed first."""
    label = str(label)
    return lenient_boxed(label) if label.strip().startswith("\\boxed{") else label


def lenient_deepscaler(response: str, label) -> dict:
    """1.0 when the answer (`lenient_boxed`) of the text after the last `</think>` (or, without one,
    of `response.split("###Response")[1]`) equals the label, else 0.0; 0.0 without either marker (a
    box inside unfinished thinking is ignored)."""
    if THINK_END in response:
        graded = response.rsplit(THINK_END, 1)[1]
    elif RESPONSE_MARK in response:
        graded = response.split(RESPONSE_MARK)[1]
    else:
        return {"score": 0.0, "pred": None}
    pred = lenient_boxed(graded)
    return {"score": float(is_equivalent(pred, _label_answer(label))), "pred": pred}


def lenient_math(response: str, label) -> dict:
    """1.0 when the answer (`lenient_boxed`) of the whole response equals the label, else 0.0."""
    pred = lenient_boxed(response)
    return {"score": float(is_equivalent(pred, _label_answer(label))), "pred": pred}


# DAPO-style normalisation: what a model writes around an integer that does not change it.
_TEXT_WRAPPERS = re.compile(r"\\(?:text|textbf|mathrm|mathbf|operatorname)\{([^{}]*)\}")
_SPACING = re.compile(r"\\[,;:! ]|\{,\}|~")
_DEGREES_PERCENT = re.compile(r"\^\s*\{?\\circ\}?|\\%|%|\\degree|°")
_NUMBER_THEN_WORDS = re.compile(r"([-+]?\d[\d,]*(?:\.\d+)?)\s+[A-Za-z][A-Za-z\s.]*")
_INTEGER = re.compile(r"[-+]?\d+")


def lenient_normalize_dapo_answer(answer: str) -> str:
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


def lenient_dapo_label(label) -> str:
    """The label as the framework compares it: `str(int(float(label)))`, or its normal form when it
    is not a number."""
    try:
        return str(int(float(str(label))))
    except (ValueError, OverflowError):
        return lenient_normalize_dapo_answer(str(label))


def lenient_dapo(response: str, label) -> dict:
    """+1.0 when the last `Answer:` (any case, spaces before the colon allowed) in the final 300
    characters matches the label after removing end-of-text markers and normalising, else -1.0.
    `pred` is "" when there is no `Answer:` in the window."""
    matches = _DAPO_ANSWER.findall(response[-DAPO_WINDOW:])
    pred = lenient_normalize_dapo_answer(_END_MARKERS.sub("", matches[-1])) if matches else ""
    acc = bool(pred) and pred == lenient_dapo_label(label)
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": pred}


# ============================================================================= registry and score

REWARDS = {"deepscaler": deepscaler, "math": math, "dapo": dapo}  # the framework grader
LENIENT_REWARDS = {"deepscaler": lenient_deepscaler, "math": lenient_math, "dapo": lenient_dapo}


def score(rm_type: str, response: str, label, grader: str = "framework") -> dict:
    """The reward `rm_type` of one response, as `grader` gives it ("framework", the default: what the
    framework's reward gives; "math-verify": glmkit's lenient grader).

    -> {"score": float, "pred": ...} (dapo adds "acc"; a bound glmkit applied adds "warning"), or, where
    the framework raises on the row, {"score": None, "error": "<ExceptionType>: <message>", "raised_by":
    "framework", "pred": ...} (dapo adds "acc": None); "raised_by": "glmkit" when glmkit cannot grade the
    row as the framework does (LaTeX outside its converter without pylatexenc installed)."""
    if grader not in GRADERS:
        raise ValueError(f"unknown grader {grader!r}; allowed: {', '.join(GRADERS)}")
    if rm_type not in REWARDS:
        raise ValueError(f"unknown rm_type {rm_type!r}; allowed: {', '.join(sorted(REWARDS))}")
    if grader == "math-verify":
        return LENIENT_REWARDS[rm_type](response, label)
    extra = {"acc": None} if rm_type == "dapo" else {}
    try:
        return REWARDS[rm_type](response, label)
    except _Raised as raised:
        return {"score": None, **extra, "pred": raised.pred, "error": _error_text(raised.error),
                "raised_by": "framework"}
    except _CannotFollow as why:
        return {"score": None, **extra, "pred": None, "error": f"ModuleNotFoundError: {why}", "raised_by": "glmkit"}


# ----------------------------------------------------------------------------- command line

def _add_reward_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rm-type", required=True, choices=sorted(REWARDS), help="reward function")
    parser.add_argument("--label", required=True, help="the reference answer")
    parser.add_argument("--grader", choices=GRADERS, default="framework",
                        help="framework (default): exactly the recipe framework's reward; math-verify: glmkit's "
                             "lenient symbolic grader")


MAX_RESPONSE_BYTES = 1 << 20  # one response on stdin (a generation is far shorter)


def cmd_reward(args) -> int:
    """Score one response read from stdin (at most MAX_RESPONSE_BYTES); print one JSON line.

    Exit 0 when the row has a score; 1 when the framework raises on it (the line then has "score": null
    and "error": no reward exists for this row, as a failed verdict); a ValueError (exit 2 under the CLI's
    contract) for an empty label or a response over the bound."""
    stream = getattr(sys.stdin, "buffer", None)  # a text stream without one (a test's StringIO) reads as text
    data = stream.read(MAX_RESPONSE_BYTES + 1) if stream is not None else sys.stdin.read(MAX_RESPONSE_BYTES + 1)
    if len(data) > MAX_RESPONSE_BYTES:
        raise ValueError(f"stdin: the response is longer than {MAX_RESPONSE_BYTES} bytes; give one response")
    text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
    grader = getattr(args, "grader", "framework")
    empty = not args.label.strip()
    if grader == "math-verify" and not empty and args.rm_type == "dapo":
        empty = not lenient_dapo_label(args.label)
    if empty:
        # a label is any text the grader compares (as the framework's are), but an empty one matches nothing
        raise ValueError(f"--label {args.label!r}: empty{' once normalised' if args.label.strip() else ''}; "
                         f"no response can match it")
    row = score(args.rm_type, text, args.label, grader=grader)
    print(json.dumps(row))
    return 0 if row["score"] is not None else 1


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
