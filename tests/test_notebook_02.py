"""Notebook 02 (smoke GRPO) headless on the tiny preset's shipped start, tokenizer and prompts: a
3-rollout run (`glmkit report`, as a user runs it) into a self-contained HTML report, its metrics
JSONL and verdict.json: too few rollouts for the reward rule, so "not enough rollouts to judge"."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from glmkit.notebook import read_verdict
from glmkit.rl.health import HEALTHY_FULL, UNDECIDED
from tests.test_report_offline import assert_offline
from widgets.training import DEFAULT_METRICS

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "02_smoke_grpo.ipynb"
INLINE_PNG = re.compile(r'<img[^>]+src="data:image/png;base64,')
ROLLOUTS = 3


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("nb02") / "report"
    done = subprocess.run([sys.executable, "-m", "glmkit", "report", str(NOTEBOOK), "--out", str(out),
                           "-p", "num_rollout", str(ROLLOUTS)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr   # "not enough rollouts to judge" is not a failure
    assert f"verdict: {UNDECIDED}\n  - {UNDECIDED}: {ROLLOUTS} rollouts" in done.stdout
    return out.resolve(), out.resolve() / "02_smoke_grpo.html"


def test_smoke_grpo_report(smoke_run):
    out, page = smoke_run
    assert page == out.resolve() / "02_smoke_grpo.html"
    text = page.read_text()
    assert text.index('id="glmkit-report-header"') < text.index("<main")   # header at the very top
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["verdict"] == UNDECIDED
    header = text[text.index('id="glmkit-report-header"'):text.index("<h3>parameters</h3>")]
    assert f"verdict: {UNDECIDED}</div>" in header   # the runner read verdict.json
    assert f"<li>{UNDECIDED}: {ROLLOUTS} rollouts, too few to judge a rise" in header   # and says why
    assert read_verdict(out, 0) == verdict["verdict"]
    assert re.search(r"<td>num_rollout</td><td><code>3</code></td><td>set</td>", text)
    assert re.search(r"<td>model_name</td><td><code>&quot;tiny&quot;</code></td><td>default</td>", text)
    # each view once: the final metrics figure as a PNG, the health table as an HTML table
    assert len(INLINE_PNG.findall(text)) == 1 and text.count("recipe health table:") == 1
    assert len(re.findall(r"<tr class=[\"']verdict-", text)) == len(HEALTHY_FULL)
    assert_offline(text)
    assert (out / "02_smoke_grpo.ipynb").is_file()
    leftovers = [p.name for p in out.iterdir() if (p.name.startswith(".") or "failed" in p.name)
                 and not p.name.endswith(".glmkit-output")]  # a marker says which files glmkit wrote
    assert leftovers == []


def test_smoke_grpo_metrics_and_verdict_json(smoke_run):
    out, page = smoke_run
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rollouts = [m for m in lines if "rollout/raw_reward" in m]
    steps = [m for m in lines if "train/step" in m]
    assert [m["rollout/step"] for m in rollouts] == list(range(ROLLOUTS))
    assert [m["train/step"] for m in steps] == list(range(4 * ROLLOUTS))  # tiny: 4 optimizer steps a rollout
    for m in rollouts:
        assert {n for n in set(DEFAULT_METRICS) | set(HEALTHY_FULL) if not n.startswith(("train/", "eval/"))} <= set(m)
    evals = [m for m in lines if "eval/step" in m]  # the held-out evaluation: before training and at the end
    assert [m["eval/step"] for m in evals] == [0, ROLLOUTS] and all("eval/raw_reward" in m for m in evals)
    for m in steps:
        assert {n for n in set(DEFAULT_METRICS) | set(HEALTHY_FULL) if n.startswith("train/")} <= set(m)
    verdict = json.loads((out / "verdict.json").read_text())
    rewards = [m["rollout/raw_reward"] for m in rollouts]
    assert verdict["raw_reward"] == rewards
    assert verdict["raw_reward_start"] == pytest.approx(sum(rewards) / ROLLOUTS)
    assert verdict["raw_reward_end"] == pytest.approx(sum(rewards) / ROLLOUTS)   # 3 rollouts: the same window
    # so the reward cannot be judged to rise, and nothing else failed: neither pass nor fail, saying why
    assert verdict["verdict"] == UNDECIDED and verdict["reasons"] == [
        f"{UNDECIDED}: {ROLLOUTS} rollouts, too few to judge a rise (the first 3 and the last 5 must not "
        "overlap; run 8 or more)"]
    assert "too few to judge a rise" in page.read_text()   # the report's header shows the reasons
    assert all(math.isfinite(m["train/grad_norm"]) for m in steps) == verdict["grad_norms_finite"]
    assert [r["metric"] for r in verdict["health"]] == list(HEALTHY_FULL)
    assert {r["verdict"] for r in verdict["health"]} <= {"within range", "outside", "not applicable"}
    params = verdict["parameters"]
    assert params["num_rollout"] == ROLLOUTS and params["model_name"] == "tiny" and params["checkpoint"] is None
    assert params["out_dir"] == str(out.resolve())
    assert verdict["resolved_config"]["metrics_out"] == f"{out.resolve()}/metrics.jsonl"
