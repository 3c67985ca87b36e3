"""The GRPO views (widgets.training) and the run verdict (glmkit.rl.health) on synthetic metric dicts:
no training needed."""

from __future__ import annotations

import base64
import io
import json
import math

import ipywidgets as W
import pytest
from matplotlib.text import Text
from PIL import Image

from glmkit.rl.health import HEALTHY_FULL, RISE_FIRST, RISE_LAST, UNDECIDED, run_verdict, verdicts
from widgets import HealthTable, LiveMetrics, figure_png, show
from widgets.parity import MAX_WIDTH_PX, MIN_FONT_PT, WIDGET_VIEW
from widgets.training import (DEFAULT_METRICS, HEALTHY_GID, HEALTHY_LABEL, SERIES_GID, VERDICT_BACKGROUNDS,
                              VERDICT_COLORS, healthy_band)


def synthetic(step: int, **overrides) -> dict:
    """One rollout's metrics in the shape GRPOTrainer.step returns."""
    metrics = {
        "step": step,
        "rollout/raw_reward": 0.3 + 0.05 * step,
        "eval/raw_reward": 0.1 + 0.02 * step,
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


def test_the_status_line_counts_rollouts_by_their_rows_and_shows_only_measured_values():
    """A browser check of notebook 02: the line read "step 5 (rollout 5/20)" then "step 5 (rollout 6/20)"
    (eval rows number their step by count, rollout rows by index), and "rollout/raw_reward = None" before
    the first rollout. The step is now the latest rollout row's, and unmeasured metrics are left out."""
    view = LiveMetrics(total_rollouts=20)
    view.update({"eval/step": 0, "step": 0, "eval/raw_reward": 0.4})
    assert view.text.startswith("step 0 (rollout 0/20)") and "None" not in view.text
    for rollout in range(6):
        view.update({"train/step": rollout, "step": rollout, "train/grad_norm": 0.3})
        view.update({"rollout/step": rollout, "step": rollout, "rollout/raw_reward": 0.5})
        assert view.text.startswith(f"step {rollout} (rollout {rollout + 1}/20)"), view.text
        if rollout == 4:
            view.update({"eval/step": 5, "step": 5, "eval/raw_reward": 0.6})  # after the 5th rollout
            assert view.text.startswith("step 4 (rollout 5/20)"), view.text
    assert "rollout/raw_reward = 0.5" in view.text


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


def test_live_redraws_stay_within_their_share_of_the_run_and_update_lines_in_place(monkeypatch):
    """Issue 36 (1): redrawing after every row cost ~40% of a run. The figure now redraws on rollout rows
    only, at most once a second, and only while the seconds spent redrawing stay within 5% of the
    seconds since the first row (the clock is simulated: each redraw "costs" 0.5 s, a rollout 3 s);
    the status line follows every row with the progress; finish() draws what is pending; lines are
    updated in place while each axis keeps its kind."""
    from widgets import training

    clock = [100.0]
    monkeypatch.setattr(training.time, "perf_counter", lambda: clock[0])
    real_savefig = training.Figure.savefig

    def costly_savefig(self, *args, **kwargs):
        clock[0] += 0.5
        return real_savefig(self, *args, **kwargs)

    monkeypatch.setattr(training.Figure, "savefig", costly_savefig)
    view = LiveMetrics(total_rollouts=40)
    assert view.draws == 0 and view.draw_seconds == 0  # the empty figure is not the run's time
    for step in range(40):
        clock[0] += 1.5
        view.update({"train/step": step, "step": step, "train/grad_norm": 0.4})  # a train row: no redraw
        clock[0] += 1.5
        view.update(synthetic(step, **{"perf/tokens_per_s": 250.0}))
        assert view.draw_seconds <= 0.05 * (clock[0] - 101.5) + 0.5  # within budget, give or take one draw
    # 120 s of run: 5% is 6 s, twelve 0.5 s redraws (the rule lets the last one cross by one draw)
    assert 11 <= view.draws <= 13 and view.draw_seconds <= 0.05 * 120 + 0.5, (view.draws, view.draw_seconds)
    assert "(rollout 40/40), optimizer step 39, ETA 0:00, 250 tokens/s" in view.status.value
    assert view.progress() == "rollout 40/40 · optimizer step 39 · ETA 0:00 · 250 tokens/s"
    figure = view._live[0]
    view.finish()
    assert view._live[0] is figure  # updated in place: the axes kept their kind
    x, _ = series_line(figure.axes[DEFAULT_METRICS.index("rollout/raw_reward")]).get_data()
    assert list(x) == list(range(40))
    view.update(synthetic(40, **{"train/grad_norm": float("nan")}))  # a new kind of axis: rebuilt
    view.finish()
    assert view._live[0] is not figure


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
    assert len(fig.axes) == len(DEFAULT_METRICS) == 11
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


def test_show_displays_each_view_once_widget_and_static_together(monkeypatch):
    """The metrics: one output with the widget view and the figure as PNG; refresh() redraws that same
    output after a live run. The health table: the widget view and the table as HTML, no image."""
    shown = []
    monkeypatch.setattr("IPython.display.display", lambda *objs, **kw: shown.append((objs, kw)))
    view = LiveMetrics()
    handle = show(view)
    view.extend(history(2))
    handle.refresh()
    table = HealthTable(verdicts(history(2), "tiny"))
    show(table)
    assert [len(objs) for objs, _ in shown] == [1, 1, 1]
    (first,), kw = shown[0]
    (final,), update = shown[1]
    assert not kw.get("update") and update["update"] and update["display_id"] == kw["display_id"]
    for bundle in (first, final):
        assert set(bundle) == {WIDGET_VIEW, "image/png", "text/plain"}
        assert bundle[WIDGET_VIEW]["model_id"] == view.widget.model_id
    assert "no rollouts yet" in first["text/plain"] and "2 rollouts" in final["text/plain"]
    assert base64.b64decode(final["image/png"]) != base64.b64decode(first["image/png"])
    (bundle,), _ = shown[2]
    assert set(bundle) == {WIDGET_VIEW, "text/html", "text/plain"} and bundle["text/html"] == table.html
    assert bundle[WIDGET_VIEW]["model_id"] == table.widget.model_id


def test_metrics_figure_is_readable_at_its_rendered_size():
    """10 small multiples: the PNG at most MAX_WIDTH_PX wide (shown unscaled) and every label at least
    MIN_FONT_PT (12.5 px at FIGURE_DPI), also with non-finite marks and n/a titles."""
    view = LiveMetrics(variant="tiny")
    view.extend(history(12) + [synthetic(12, **{"train/grad_norm": math.nan})])
    for fig in (view.figure(), LiveMetrics().figure()):
        width, _ = Image.open(io.BytesIO(figure_png(fig))).size
        assert width <= MAX_WIDTH_PX
        texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
        assert len(texts) > 40
        assert [(t.get_text(), t.get_fontsize()) for t in texts if t.get_fontsize() < MIN_FONT_PT] == []
    view.redraw()  # the live widget's own PNG, as the output area shows it
    live_png = base64.b64decode(view.output.outputs[0]["data"]["image/png"])
    assert Image.open(io.BytesIO(live_png)).size[0] <= MAX_WIDTH_PX


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


def test_health_table_on_tiny_marks_the_recipe_numbers_not_applicable():
    rows = verdicts(history(12), "tiny")
    table = HealthTable(rows)
    assert {r["metric"]: r["verdict"] for r in rows}["train/grad_norm"] == "not applicable"
    assert table.html.count(f"background:{VERDICT_BACKGROUNDS['not applicable']}") == 3


# ---------------------------------------------------------------- run verdict

def run_rows(rewards, grad_norm=0.4, logprob_diff=1e-6, skipped_at=None) -> list[dict]:
    """Metric rows as GRPOTrainer.run writes them: per rollout two optimizer-step rows, then the rollout row."""
    rows = []
    for r, reward in enumerate(rewards):
        for k in range(2):
            step = 2 * r + k
            skipped = step == skipped_at
            rows.append({"train/step": step, "train/grad_norm": None if skipped else grad_norm,
                         "train/step_skipped": skipped, "train/train_rollout_logprob_abs_diff": logprob_diff,
                         **({"nonfinite": ["train/grad_norm"]} if skipped else {})})
        rows.append({"rollout/step": r, "rollout/raw_reward": reward})
    return rows


def test_run_verdict_too_few_rollouts_is_not_enough_to_judge():
    result = run_verdict(run_rows([0.1, 0.2, 0.3]), "tiny")
    assert result["verdict"] == UNDECIDED == "not enough rollouts to judge"
    (reason,) = result["reasons"]
    assert reason.startswith("not enough rollouts to judge: 3 rollouts") and f"run {RISE_FIRST + RISE_LAST}" in reason
    assert run_verdict(run_rows([0.1] * 7), "tiny")["verdict"] == UNDECIDED


def test_run_verdict_short_runs_still_fail_on_what_they_can_judge():
    nan = run_verdict(run_rows([0.1, 0.2, 0.3], skipped_at=1), "tiny")
    assert nan["verdict"] == "fail" and "1 optimizer step(s) had a NaN / Inf" in nan["reasons"][0]
    assert any(r.startswith("not enough rollouts to judge") for r in nan["reasons"])   # said too
    far = run_verdict(run_rows([0.1, 0.2, 0.3], logprob_diff=0.5), "tiny")   # applies on tiny
    assert far["verdict"] == "fail"
    assert any("train/train_rollout_logprob_abs_diff outside the recipe's range" in r for r in far["reasons"])
    assert run_verdict([], "tiny")["verdict"] == "fail"   # no optimizer step


def test_run_verdict_judges_the_rise_from_eight_rollouts():
    rising = run_verdict(run_rows([0.1] * 3 + [0.5] * 5), "tiny")
    assert rising["verdict"] == "pass" and rising["reasons"] == []
    flat = run_verdict(run_rows([0.5] * 3 + [0.1] * 5), "tiny")
    assert flat["verdict"] == "fail" and flat["reasons"][0].startswith("raw reward did not rise")


def test_rows_polled_in_batches_get_an_eta(monkeypatch):
    """Browser check (notebook 03): a job's rows arrive in batches through `extend`, which never started
    the ETA's clock, so the line showed no ETA. The ETA now counts from the first batch, over the
    rollouts done since it (none yet: no ETA rather than a guess)."""
    from widgets import training

    clock = [50.0]
    monkeypatch.setattr(training.time, "perf_counter", lambda: clock[0])
    view = LiveMetrics(total_rollouts=6)
    view.extend([synthetic(0)])
    assert "ETA" not in view.progress()  # one batch: no pace measured yet
    clock[0] += 20.0
    view.extend([synthetic(1), synthetic(2)])
    assert view.progress() == "rollout 3/6 · ETA 0:30"  # 2 rollouts in 20 s, 3 left
    clock[0] += 10.0
    view.extend([synthetic(k) for k in (3, 4, 5)])
    assert view.progress() == "rollout 6/6 · ETA 0:00"
