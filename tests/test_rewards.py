"""Rule-based rewards: known answers, the recipe's edge cases, and the `reward` command."""

from __future__ import annotations

import argparse
import io
import json

import pytest

from glmkit.rl import rewards
from glmkit.rl.rewards import REWARDS, dapo, deepscaler, is_equivalent, last_boxed, lenient_dapo, math, score


# ----------------------------------------------------------------------------- \boxed extraction

@pytest.mark.parametrize("text, expected", [
    (r"so \boxed{19}.", "19"),
    (r"\boxed{\frac{1}{2}}", r"\frac{1}{2}"),
    (r"\boxed{\sqrt{\frac{a}{b^{2}}}} done", r"\sqrt{\frac{a}{b^{2}}}"),
    (r"\boxed{\{1,2\}}", r"\{1,2\}"),            # escaped braces are content
    (r"\boxed{1} then \boxed{2}", "2"),            # the last one
    (r"\boxed 5$", "5"),                           # the argument-without-braces form
    (r"\fbox{7}", "7"),
    (r"\boxed{1} and a cut-off \boxed{2", None),   # the last box never closes
    (r"\boxedfoo", None),
    ("no box here", None),
    (r"\boxed{}", ""),
])
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


# ----------------------------------------------------------------------------- equivalence

@pytest.mark.parametrize("pred, label", [
    ("1/2", "0.5"), ("0.5", r"\frac{1}{2}"), (r"\frac{1}{2}", "1/2"), (r"\dfrac12", "0.5"),
    ("1,000", "1000"), ("1000", "1,000"), (r"1{,}000", "1000"), (r"1\,000", "1000"),
    ("19", "19"), ("3.0", "3"), ("x=5", "5"), ("10^{3}", "1000"), (r"\frac{\sqrt{2}}{2}", r"\sqrt{2}/2"),
    ("$7$", "7"), ("7", r"\boxed{7}"), ("-3", "-3"),
])
def test_equivalent(pred, label):
    assert is_equivalent(pred, label)


@pytest.mark.parametrize("pred, label", [
    ("-3", "3"), ("1/3", "0.3"), ("20", "19"), ("1,2", "12"), ("", "0"), (None, "0"), ("x", "5"),
])
def test_not_equivalent(pred, label):
    assert not is_equivalent(pred, label)


# ----------------------------------------------------------------------------- deepscaler

def test_deepscaler_right_answer_after_think():
    assert deepscaler("<think>7+12 is 19</think>The answer is \\boxed{19}.", "19") == {"score": 1.0, "pred": "19"}


def test_deepscaler_tiny_model_format():
    from glmkit.rl.data import format_response

    assert deepscaler(format_response("19"), "19")["score"] == 1.0
    assert deepscaler(format_response("-4"), "-4")["score"] == 1.0
    assert deepscaler(format_response("18"), "19")["score"] == 0.0


def test_deepscaler_needs_think_end():
    assert deepscaler("The answer is \\boxed{19}", "19") == {"score": 0.0, "pred": None}


def test_deepscaler_ignores_box_inside_thinking():
    out = deepscaler("<think>maybe \\boxed{19}</think>no box after", "19")
    assert out == {"score": 0.0, "pred": None}
    out = deepscaler("<think>maybe \\boxed{19}</think>\\boxed{20}", "19")
    assert out == {"score": 0.0, "pred": "20"}


def test_deepscaler_fractions_and_separators():
    assert deepscaler("</think>\\boxed{\\frac{1}{2}}", "0.5")["score"] == 1.0
    assert deepscaler("</think>\\boxed{0.5}", "1/2")["score"] == 1.0
    assert deepscaler("</think>\\boxed{1,000}", "1000")["score"] == 1.0
    assert deepscaler("</think>\\boxed{1/3}", "0.3")["score"] == 0.0


def test_deepscaler_truncated_box():
    assert deepscaler("</think>\\boxed{19", "19") == {"score": 0.0, "pred": None}


# ----------------------------------------------------------------------------- math

def test_math_last_box_anywhere():
    assert math("\\boxed{19}", "19") == {"score": 1.0, "pred": "19"}
    assert math("<think>\\boxed{19}</think>", "19")["score"] == 1.0  # no </think> rule here
    assert math("\\boxed{19} no wait \\boxed{20}", "19") == {"score": 0.0, "pred": "20"}
    assert math("19", "19") == {"score": 0.0, "pred": None}
    assert math("\\boxed{\\frac{1}{2}}", "1/2")["score"] == 1.0


# ----------------------------------------------------------------------------- dapo

def test_dapo_answer_on_last_line():
    assert dapo("Let me compute.\n7+12=19\nAnswer: 19", "19") == {"score": 1.0, "acc": True, "pred": "19"}


def test_dapo_wrong_and_missing():
    assert dapo("Answer: 18", "19") == {"score": -1.0, "acc": False, "pred": "18"}
    # the framework's pred without an `Answer:` is its placeholder "[INVALID]"; math-verify's is ""
    assert dapo("the answer is 19", "19") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    assert lenient_dapo("the answer is 19", "19") == {"score": -1.0, "acc": False, "pred": ""}
    assert dapo("Answer:", "19")["score"] == -1.0


def test_dapo_last_answer_wins():
    assert dapo("Answer: 18\nsorry, Answer: 19", "19")["acc"]
    assert not dapo("Answer: 19\nsorry, Answer: 18", "19")["acc"]


@pytest.mark.parametrize("written", [
    "19", " 19 ", "$19$", "\\boxed{19}", "$\\boxed{19}$", "x = 19", "\\text{19}", "19^\\circ",
])
def test_dapo_normalisation(written):
    assert dapo(f"work...\nAnswer: {written}", "19")["acc"], written


@pytest.mark.parametrize("written", ["19.", "19 apples", "+19"])
def test_dapo_normalisation_math_verify_only(written):
    """The framework keeps a trailing dot, trailing words and a plus sign (-1.0); math-verify drops them."""
    assert lenient_dapo(f"work...\nAnswer: {written}", "19")["acc"], written
    assert score("dapo", f"work...\nAnswer: {written}", "19", grader="math-verify")["acc"], written
    assert not dapo(f"work...\nAnswer: {written}", "19")["acc"], written


def test_dapo_thousands_separator():
    assert dapo("Answer: 1,000", "1000")["acc"]
    assert dapo("Answer: 1000", "1,000")["acc"]
    assert not lenient_dapo("Answer: 1,2", "12")["acc"]  # math-verify: a list, not a grouped number
    assert dapo("Answer: 1,2", "12")["acc"]  # the framework drops the commas of any all-digit answer


def test_dapo_only_reads_last_300_characters():
    early = "Answer: 19\n" + "x" * 300
    assert dapo(early, "19") == {"score": -1.0, "acc": False, "pred": "[INVALID]"}
    tail = "Answer: 19\n" + "y" * (300 - len("Answer: 19\n"))  # exactly 300 characters
    assert dapo("x" * 500 + "\n" + tail, "19")["acc"]
    assert dapo("x" * 500 + "\n" + tail + "z", "19")["pred"] == "[INVALID]"  # its "A" is now 301 from the end


# ----------------------------------------------------------------------------- registry and CLI

def test_registry_and_score():
    assert set(REWARDS) == {"deepscaler", "math", "dapo"}
    assert score("math", "\\boxed{2}", "2")["score"] == 1.0
    with pytest.raises(ValueError, match="deepscaler.*math"):
        score("f1", "x", "y")


def run_main(monkeypatch, capsys, argv, stdin):
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    assert rewards.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    return json.loads(lines[0])


def test_main_prints_one_json_line(monkeypatch, capsys):
    out = run_main(monkeypatch, capsys, ["--rm-type", "deepscaler", "--label", "19"], "<think></think>\\boxed{19}\n")
    assert out == {"score": 1.0, "pred": "19"}
    out = run_main(monkeypatch, capsys, ["--rm-type", "dapo", "--label", "7"], "Answer: 8\n")
    assert out == {"score": -1.0, "acc": False, "pred": "8"}
    out = run_main(monkeypatch, capsys, ["--rm-type", "math", "--label", "7"], "nothing")
    assert out == {"score": 0.0, "pred": None}


def test_main_rejects_unknown_rm_type(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("x"))
    with pytest.raises(SystemExit):
        rewards.main(["--rm-type", "nope", "--label", "1"])
    assert "invalid choice" in capsys.readouterr().err


def test_add_reward_command(monkeypatch, capsys):
    parser = argparse.ArgumentParser(prog="glmkit")
    add = parser.add_subparsers(dest="command", required=True)
    rewards.add_reward_command(add)
    args = parser.parse_args(["reward", "--rm-type", "math", "--label", "3"])
    monkeypatch.setattr("sys.stdin", io.StringIO("\\boxed{3}"))
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out) == {"score": 1.0, "pred": "3"}


def test_equivalence_off_the_main_thread():
    """math-verify's signal-based timeout raises outside the main thread; rewards must still work there."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(deepscaler, "</think>\\boxed{0.5}", "1/2").result()["score"] == 1.0


# ---- the framework's rules (rm_hub), one test each -------------------------------------------

def test_deepscaler_grades_after_the_last_think_end():
    assert deepscaler(r"<think>a</think> draft \boxed{4} <think>b</think> final \boxed{5}", "5")["score"] == 1.0
    assert deepscaler(r"<think>a</think> final \boxed{5} <think>b</think> no box", "5")["score"] == 0.0


def test_deepscaler_response_marker_without_think_end():
    assert deepscaler(r"plan ###Response the answer is \boxed{7}", "7")["score"] == 1.0
    # split("###Response")[1]: only the text up to a second marker is graded
    assert deepscaler(r"x ###Response \boxed{3} ###Response \boxed{7}", "7")["score"] == 0.0
    assert deepscaler(r"no markers at all \boxed{7}", "7") == {"score": 0.0, "pred": None}


def test_deepscaler_answer_is_the_last_box_from_the_end():
    assert deepscaler(r"</think> \boxed{3} then \boxed{7}", "7")["score"] == 1.0
    assert deepscaler(r"</think> \boxed{7} then \boxed{3}", "7")["score"] == 0.0


def test_fbox_and_unbraced_boxes_are_located_but_not_unboxed():
    assert deepscaler(r"</think> \fbox{7}", "7") == {"score": 0.0, "pred": None}
    assert deepscaler(r"</think> \boxed 7", "7") == {"score": 0.0, "pred": None}
    assert deepscaler(r"</think> \boxed{7} and finally \boxed 8", "7")["score"] == 0.0  # the last one counts
    assert math(r"\fbox{7}", "7")["score"] == 0.0 and math(r"\boxed{7}", "7")["score"] == 1.0


def test_a_boxed_label_is_unboxed_first():
    assert deepscaler(r"</think> \boxed{\frac{1}{2}}", r"\boxed{0.5}")["score"] == 1.0


def test_dapo_answer_regex_is_case_insensitive_and_allows_space_before_colon():
    assert dapo("ANSWER : 12", "12")["acc"] and dapo("the answer: 12", "12")["acc"]


def test_dapo_removes_end_of_text_markers():
    for marker in ("<|endoftext|>", "<|im_end|>"):
        assert dapo(f"Answer: 5{marker}", "5") == {"score": 1.0, "acc": True, "pred": "5"}, marker
    for marker in ("<|eot_id|>", "</s>"):  # the framework removes only the two above; math-verify all four
        assert dapo(f"Answer: 5{marker}", "5") == {"score": -1.0, "acc": False, "pred": f"5{marker}"}, marker
        assert lenient_dapo(f"Answer: 5{marker}", "5") == {"score": 1.0, "acc": True, "pred": "5"}, marker


def test_dapo_compares_with_the_label_as_an_integer_string():
    assert dapo("Answer: 5", "5.0")["acc"] and dapo("Answer: 5", 5)["acc"]
    assert not dapo("Answer: 5.5", "5.5")["acc"]  # str(int(float("5.5"))) is "5"
    assert dapo("Answer: 5", "5.5")["acc"]


def test_the_reward_command_reads_one_bounded_response_from_stdin():
    """`glmkit reward` scores what stdin holds; a stream past 1 MiB (`< /dev/zero`) is refused by name
    (exit 2) instead of read until memory runs out."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "glmkit", "reward", "--rm-type", "math", "--label", "2"]
    scored = subprocess.run(command, input=b"so the answer is \\boxed{2}", capture_output=True, timeout=120)
    assert scored.returncode == 0 and b'"score": 1.0' in scored.stdout
    endless = subprocess.run(command, stdin=open("/dev/zero", "rb"), capture_output=True, timeout=120)
    assert endless.returncode == 2 and b"longer than 1048576 bytes" in endless.stderr


def test_a_huge_answer_is_wrong_fast_and_is_not_logged_whole(caplog):
    """A 200 KB boxed "answer" (found by the hostile pass) is compared as a string only; math-verify's
    own warnings, which quote the answer they choked on, are cut to LOGGED_CHARS."""
    import logging
    import time

    huge = "1+" * 100_000 + "1"
    start = time.perf_counter()
    assert math(rf"\boxed{{{huge}}}", "3")["score"] == 0.0
    assert math(rf"\boxed{{{huge}}}", huge)["score"] == 1.0  # equal strings still agree
    assert time.perf_counter() - start < 2.0  # generous: it never reaches sympy (a parse takes seconds)
    rewards._quiet_math_verify_logs()
    with caplog.at_level(logging.WARNING, logger="math_verify.parser"):
        logging.getLogger("math_verify.parser").warning("Timeout during parsing: %s", huge)
    (record,) = [r for r in caplog.records if r.name == "math_verify.parser"]
    assert len(record.getMessage()) < rewards.LOGGED_CHARS + 40
    assert record.getMessage().endswith(f"... ({len('Timeout during parsing: ' + huge)} characters)")


# ---- the framework grader against the framework's own results ------------------------------------

CASES_PATH = __import__("pathlib").Path(__file__).parent / "data" / "reward_cases.json"
CASES = json.loads(CASES_PATH.read_text())["cases"]


def _pylatexenc_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("pylatexenc") is not None


def _check_case(case, got):
    expected = case["framework"]
    if "error" in expected:  # the framework raises: glmkit reports that error instead of a score
        assert got["score"] is None and got["raised_by"] == "framework", got
        assert got["error"].split(":")[0] == expected["error"].split(":")[0]
        assert got["error"] == expected["error"]
    else:
        assert got["score"] == expected["score"] and "error" not in got, got
        for key in ("acc", "pred"):  # dapo's other fields
            if key in expected:
                assert got[key] == expected[key], key


@pytest.mark.parametrize("case", CASES, ids=[f"{c['id']}-{c['rm_type']}-{c['category']}" for c in CASES])
def test_framework_grader_table(case):
    """glmkit's default grader == the framework's reward on every case of tests/data/reward_cases.json.

    The expectations were made by running the framework's own code: radixark/miles
    miles/rollout/rm_hub/ at commit 31f1ca961 (2026-08-21) — get_deepscaler_rule_based_reward,
    grade_answer_verl (rm-type math) and math_dapo_utils.compute_score, dispatched as async_rm does — with
    sympy 1.14.0 and pylatexenc 2.11, by the glmkit engineer on 2026-12-06 (outside this repository; no
    framework code is in it). "rule" names the framework rule each case exercises. Without pylatexenc
    installed, the few cases marked needs_pylatexenc must give glmkit's error naming pylatexenc."""
    got = score(case["rm_type"], case["response"], case["label"])
    if case["needs_pylatexenc"] and not _pylatexenc_installed():
        assert got["score"] is None and got["raised_by"] == "glmkit" and "pylatexenc" in got["error"], got
        return
    _check_case(case, got)


def test_the_table_covers_every_category_and_rm_type():
    from collections import Counter

    categories = Counter(c["category"] for c in CASES)
    assert len(CASES) >= 200
    for name in ("boxed", "plain", "units", "signs", "leading zeros", "percent", "trailing dot", "separators",
                 "fractions", "scientific", "eos", "words", "latex", "label types", "issue"):
        assert categories[name] >= 5, name
    assert set(Counter(c["rm_type"] for c in CASES)) == {"deepscaler", "math", "dapo"}
    labels = {type(c["label"]).__name__ for c in CASES}
    assert {"int", "float", "str", "NoneType"} <= labels
    assert sum("error" in c["framework"] for c in CASES) >= 10


def test_glmkit_own_latex_converter_gives_the_same_results(monkeypatch):
    """Without pylatexenc, glmkit's converter grades every case not marked needs_pylatexenc as the framework."""
    monkeypatch.setattr(rewards, "_LATEX_BACKEND", "subset")
    for case in CASES:
        got = score(case["rm_type"], case["response"], case["label"])
        if case["needs_pylatexenc"]:
            assert got["raised_by"] == "glmkit" and "pip install pylatexenc" in got["error"]
        else:
            _check_case(case, got)


@pytest.mark.parametrize("latex, text", [
    (r"\frac{1}{2}", "1/2"), (r"\frac12", "1/2"), (r"\frac{1+x}{2}", "1+x/2"), (r"\sqrt{2}", "√(2)"),
    (r"\sqrt 2", "√(2)"), (r"2\pi r", "2πr"), (r"a \cdot b", "a ·b"), (r"\left( 1 \right)", "( 1 )"),
    (r"\{1,2\}", "{1,2}"), (r"1\,000", "1 000"), (r"\text{a b}", "a b"), (r"3\\", "3\n"), (r"(-\infty, 0]", "(-∞, 0]"),
])
def test_latex_subset_converts_as_pylatexenc(latex, text):
    """What pylatexenc 2.11's LatexNodes2Text gives for these (checked against it on 29,000 random strings)."""
    assert rewards._LatexSubset(latex).convert() == text


@pytest.mark.parametrize("latex", [r"\ne", r"\frac", r"\sqrt[3]{2}", "1--2", r"\\[2pt]", r"\mathbf{x}", "{1", "~"])
def test_latex_subset_refuses_what_it_does_not_know(latex):
    with pytest.raises(rewards._CannotFollow):
        rewards._LatexSubset(latex).convert()


def test_framework_errors_are_rows_not_exceptions():
    row = score("dapo", "Answer: 5", "five")
    assert row == {"score": None, "acc": None, "pred": "5", "raised_by": "framework",
                   "error": "ValueError: could not convert string to float: 'five'"}
    assert score("dapo", "Answer: 5", "inf")["error"] == "OverflowError: cannot convert float infinity to integer"
    assert score("deepscaler", r"</think>\boxed{5}", None) == {"score": None, "pred": "5", "raised_by": "framework",
                                                               "error": "AssertionError"}
    assert score("deepscaler", "</think> no box", None) == {"score": 0.0, "pred": None}  # no answer: no assert
    assert score("math", r"\boxed{5}", None)["score"] == 0.0  # math: a falsy label scores 0, never raises
    assert score("math", r"\boxed{0}", 0)["score"] == 0.0 and score("deepscaler", r"</think>\boxed{0}", 0)["score"] == 1.0


def test_sympy_runs_bounded(monkeypatch):
    """A comparison sympy cannot finish in time counts as unequal and says so; the helper then restarts."""
    monkeypatch.setattr(rewards, "SYMPY_TIMEOUT_S", 0.5)
    row = score("math", r"\boxed{x*9**9**9}", "x")
    assert row["score"] == 0.0 and "did not finish" in row["warning"]
    assert score("math", r"\boxed{x^2+2x+1}", "(x+1)^2") == {"score": 1.0, "pred": "x^2+2x+1"}


def test_math_verify_grader_is_the_lenient_one():
    assert rewards.GRADERS == ("framework", "math-verify")
    assert score("math", r"\boxed{10^{3}}", "1000")["score"] == 0.0
    assert score("math", r"\boxed{10^{3}}", "1000", grader="math-verify")["score"] == 1.0
    assert score("dapo", "Answer: 5</s>", "5")["score"] == -1.0
    assert score("dapo", "Answer: 5</s>", "5", grader="math-verify")["score"] == 1.0
    assert score("dapo", "Answer: 5", "five", grader="math-verify")["score"] == -1.0  # scores, never raises
    with pytest.raises(ValueError, match="framework, math-verify"):
        score("math", "x", "1", grader="sympy")


def test_main_grader_flag_and_error_exit(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO(r"\boxed{10^{3}}"))
    assert rewards.main(["--rm-type", "math", "--label", "1000"]) == 0
    assert json.loads(capsys.readouterr().out)["score"] == 0.0
    monkeypatch.setattr("sys.stdin", io.StringIO(r"\boxed{10^{3}}"))
    assert rewards.main(["--rm-type", "math", "--label", "1000", "--grader", "math-verify"]) == 0
    assert json.loads(capsys.readouterr().out)["score"] == 1.0
    monkeypatch.setattr("sys.stdin", io.StringIO("Answer: 5"))
    assert rewards.main(["--rm-type", "dapo", "--label", "five"]) == 1  # the framework raises: no reward
    out = json.loads(capsys.readouterr().out)
    assert out["score"] is None and out["error"].startswith("ValueError: could not convert")
