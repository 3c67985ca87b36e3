"""The GRPO views (widgets.training) on synthetic metric dicts: no training needed."""

from __future__ import annotations

import base64
import json
import math

import ipywidgets as W
import pytest
from matplotlib.colors import to_hex

from glmkit.rl.health import HEALTHY_FULL, verdicts
from widgets import HealthTable, LiveMetrics, figure_png, show
from widgets.training import (DEFAULT_METRICS, HEALTHY_GID, HEALTHY_LABEL, SERIES_GID, VERDICT_BACKGROUNDS, VERDICT_COLORS,
                              healthy_band)


def synthetic(step: int, **overrides) -> dict:
    """One rollout's metrics in the shape GRPOTrainer.step returns."""
    metrics = {
        "step": step,
        "rollout/raw_reward": 0.3 + 0.05 * step,
        "train/train_rollout_logprob_abs_diff": 0.008 + 1e-4 * step,
        "train/train_rollout_kl": 1e-5 * (step + 1),
        "train/routing_mismatch_frac": None,
        "train/ppo_kl": 2e-4,
        "train/grad_norm": 0.4,
        "train/pg_loss": 0.01 * (-1) ** step,
        "train/pg_clipfrac": 0.02,
        "train/entropy_loss": 1.2 - 0.01 * step,
        "rollout/response_lengths": 10.0 + step,
        "rollout/truncated": 0.1,
        "perf/step_time": 1.0,
    }
    metrics.update(overrides)
    return metrics


def history(n: int = 12) -> list[dict]:
    return [synthetic(s) for s in range(n)]


def healthy_patches(ax) -> list:
    return [p for p in ax.patches if p.get_gid() == HEALTHY_GID]


def series_line(ax):
    (line,) = [l for l in ax.lines if l.get_gid() == SERIES_GID]
    return line


def shown_png(output: W.Output) -> bytes:
    assert len(output.outputs) == 1
    return base64.b64decode(output.outputs[0]["data"]["image/png"])


def test_update_adds_points_and_redraws_the_widget_in_place():
    view = LiveMetrics()
    assert isinstance(view.widget, W.VBox) and view.output in view.widget.children
    assert view.history == [] and "no rollouts yet" in view.text
    empty = shown_png(view.output)
    widget = view.widget
    for step in range(3):
        view.update(synthetic(step))
        assert len(view.history) == step + 1
        assert view.widget is widget and len(view.output.outputs) == 1   # replaced, not appended
    assert shown_png(view.output) != empty
    assert "step 2 (3 rollouts)" in view.text and "step 2" in view.status.value
    assert list(view.steps()) == [0, 1, 2]
    assert list(view.series("rollout/raw_reward")) == pytest.approx([0.3, 0.35, 0.4])
    fig = view.figure()
    reward_ax = fig.axes[DEFAULT_METRICS.index("rollout/raw_reward")]
    x, y = series_line(reward_ax).get_data()
    assert list(x) == [0, 1, 2] and list(y) == pytest.approx([0.3, 0.35, 0.4])


def test_update_keeps_a_copy_of_each_dict():
    view = LiveMetrics()
    metrics = synthetic(0)
    view.update(metrics)
    metrics["rollout/raw_reward"] = 99.0
    assert view.history[0]["rollout/raw_reward"] == 0.3


def test_figure_has_one_axis_per_metric():
    view = LiveMetrics()
    view.extend(history(5))
    fig = view.figure()
    assert len(fig.axes) == len(DEFAULT_METRICS) == 10
    assert [ax.get_title().splitlines()[0] for ax in fig.axes] == list(DEFAULT_METRICS)
    for ax in fig.axes:
        assert len(series_line(ax).get_xdata()) == 5
    chosen = LiveMetrics(["rollout/raw_reward", "train/grad_norm", "perf/step_time"])
    chosen.update(synthetic(0))
    assert len(chosen.figure().axes) == 3
    figure_png(view.figure())   # renders


def test_healthy_ranges_shaded_for_the_metrics_in_the_recipe_table():
    view = LiveMetrics(variant="GLM-5.3-Flash")   # the full model: every band applies
    view.extend(history(4))
    fig = view.figure()
    for name, ax in zip(DEFAULT_METRICS, fig.axes):
        patches = healthy_patches(ax)
        if name not in HEALTHY_FULL:
            assert patches == [], name
            continue
        assert len(patches) == 1, name
        assert patches[0].get_label() == HEALTHY_LABEL
        low, high = healthy_band(HEALTHY_FULL[name])
        band = patches[0]   # spans exactly the recipe's numbers (data coordinates on y)
        assert band.get_y() == pytest.approx(low) and band.get_y() + band.get_height() == pytest.approx(high)
    assert healthy_band(HEALTHY_FULL["train/grad_norm"]) == (0.31, 0.49)
    assert healthy_band(HEALTHY_FULL["rollout/raw_reward"]) == (0.5, 0.94)
    assert healthy_band(HEALTHY_FULL["train/ppo_kl"]) == pytest.approx((2.6e-5, 2.6e-3))
    legend_texts = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert legend_texts == [HEALTHY_LABEL]


def test_bands_not_applicable_on_tiny_are_marked():
    view = LiveMetrics(variant="tiny")
    view.extend(history(3))
    fig = view.figure()
    titles = dict(zip(DEFAULT_METRICS, (ax.get_title() for ax in fig.axes)))
    assert "n/a on tiny" in titles["train/grad_norm"] and "n/a on tiny" in titles["rollout/raw_reward"]
    assert "n/a" not in titles["train/train_rollout_logprob_abs_diff"]   # compared as is on tiny
    faint = healthy_patches(fig.axes[DEFAULT_METRICS.index("train/grad_norm")])[0].get_alpha()
    full = healthy_patches(fig.axes[DEFAULT_METRICS.index("train/train_rollout_logprob_abs_diff")])[0].get_alpha()
    assert faint < full
    legend_texts = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert legend_texts[0] == HEALTHY_LABEL and "not applicable on tiny" in legend_texts[1]


def test_no_table_no_shading():
    view = LiveMetrics(healthy=None)
    view.extend(history(3))
    fig = view.figure()
    assert all(healthy_patches(ax) == [] for ax in fig.axes) and not fig.legends


def test_missing_and_non_finite_values():
    view = LiveMetrics(["train/grad_norm", "train/routing_mismatch_frac", "train/kl_loss"])
    view.extend([synthetic(0), synthetic(1, **{"train/grad_norm": math.inf}), synthetic(2)])
    assert math.isnan(view.series("train/routing_mismatch_frac")[0])   # None: not measured
    fig = view.figure()
    grad, mismatch, absent = fig.axes
    assert "1 non-finite" in grad.get_title()
    assert "non-finite" not in mismatch.get_title() and "non-finite" not in absent.get_title()
    assert any(t.get_text() == "not measured" for t in absent.texts)


def test_steps_follow_the_metrics_own_step():
    view = LiveMetrics()
    view.extend([synthetic(5), synthetic(6)])   # a resumed run
    assert list(view.steps()) == [5, 6]
    view.update({k: v for k, v in synthetic(7).items() if k != "step"})
    assert list(view.steps()) == [5, 6, 2]


def test_from_jsonl_round_trip(tmp_path):
    rows = history(6)
    rows[3]["train/grad_norm"] = math.nan
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 6, "rollout/raw')  # still writing
    view = LiveMetrics.from_jsonl(path, variant="GLM-5.3-Flash")
    assert view.variant == "GLM-5.3-Flash" and len(view.history) == 6
    for got, want in zip(view.history, rows):
        assert got.keys() == want.keys()
        for key in want:
            if isinstance(want[key], float) and math.isnan(want[key]):
                assert math.isnan(got[key])
            else:
                assert got[key] == want[key]
    live = LiveMetrics(variant="GLM-5.3-Flash")
    for r in rows:
        live.update(r)
    for name in DEFAULT_METRICS:
        assert view.series(name).tolist() == pytest.approx(live.series(name).tolist(), nan_ok=True)
    assert len(view.figure().axes) == len(DEFAULT_METRICS)


def test_show_displays_png_then_widget(monkeypatch):
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda obj: shown.append(obj))
    view = LiveMetrics()
    view.extend(history(2))
    show(view)
    table = HealthTable(verdicts(history(2), "tiny"))
    show(table)
    assert [type(o).__name__ for o in shown] == ["Image", "VBox", "Image", "HTML"]
    assert shown[0].data[:8] == b"\x89PNG\r\n\x1a\n"


# ---------------------------------------------------------------- health table

def rows_of_every_kind() -> list[dict]:
    """A full-model run with each verdict: log-prob diff inside, grad norm outside, ppo_kl not measured."""
    runs = [synthetic(s, **{"train/grad_norm": 3.0, "train/ppo_kl": None}) for s in range(12)]
    rows = verdicts(runs, "GLM-5.3-Flash")
    by_metric = {r["metric"]: r["verdict"] for r in rows}
    assert by_metric["train/train_rollout_logprob_abs_diff"] == "within range"
    assert by_metric["train/grad_norm"] == "outside"
    assert by_metric["train/ppo_kl"] == "not applicable"
    return rows


def test_health_table_html_colours_and_verdict_text():
    rows = rows_of_every_kind()
    table = HealthTable(rows)
    assert isinstance(table.widget, W.HTML) and table.widget.value == table.html == table._repr_html_()
    text = table.html
    assert text.count("<tr class='verdict-") == len(rows) == len(HEALTHY_FULL)
    for r in rows:
        verdict = r["verdict"]
        row_html = text.split(f"<code>{r['metric']}</code>")[0].rsplit("<tr ", 1)[1]
        assert f"background:{VERDICT_BACKGROUNDS[verdict]}" in row_html, r["metric"]
        after = text.split(f"<code>{r['metric']}</code>")[1].split("</tr>")[0]
        assert f"<b style='color:{VERDICT_COLORS[verdict]}'>{verdict}</b>" in after
        assert r["why"] in after.replace("&#x27;", "'")
    assert len({VERDICT_COLORS[v] for v in ("within range", "outside", "not applicable")}) == 3
    for verdict in ("within range", "outside", "not applicable"):
        assert f"{sum(r['verdict'] == verdict for r in rows)} {verdict}" in table.text


def test_health_table_escapes_and_handles_unobserved():
    rows = [dict(metric="<m>", expected="a & b", observed=None, verdict="not applicable", why="not measured")]
    text = HealthTable(rows).html
    assert "&lt;m&gt;" in text and "a &amp; b" in text and "—" in text


def test_health_table_figure_colours_each_row_by_verdict():
    rows = rows_of_every_kind()
    fig = HealthTable(rows).figure()
    (ax,) = fig.axes
    (table,) = ax.tables
    cells = table.get_celld()
    columns = HealthTable.COLUMNS
    assert [cells[0, c].get_text().get_text() for c in range(len(columns))] == list(columns)
    for i, r in enumerate(rows, start=1):
        verdict_cell = cells[i, columns.index("verdict")]
        assert verdict_cell.get_text().get_text() == r["verdict"]
        assert to_hex(verdict_cell.get_text().get_color()) == VERDICT_COLORS[r["verdict"]]
        for c in range(len(columns)):
            assert to_hex(cells[i, c].get_facecolor()) == VERDICT_BACKGROUNDS[r["verdict"]]
        assert cells[i, 0].get_text().get_text().replace("\n", "") == r["metric"]
    figure_png(fig)
    assert HealthTable([]).figure().axes[0].texts[0].get_text() == "no health rows"


def test_health_table_on_tiny_marks_the_recipe_numbers_not_applicable():
    rows = verdicts(history(12), "tiny")
    table = HealthTable(rows)
    assert {r["metric"]: r["verdict"] for r in rows}["train/grad_norm"] == "not applicable"
    assert table.html.count(f"background:{VERDICT_BACKGROUNDS['not applicable']}") == 3
