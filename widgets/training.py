"""ipywidgets views over a GRPO run (`glmkit.rl.loop.GRPOTrainer`) and its health check.

- `LiveMetrics`: small multiples, one axis per metric, with the recipe's healthy range shaded where
  its table has one: `train/*` against the optimizer step (`train/step`, one row per step as the
  recipe's framework logs them), `rollout/*` and `perf/*` against the rollout. `view.update(metrics)` adds a point and redraws the
  widget in place, so `trainer.run(on_metrics=view.update)` animates it in a live notebook;
  `LiveMetrics.from_jsonl(path)` replays a metrics file.
- `HealthTable`: the rows of `glmkit.rl.health.verdicts`, coloured per verdict, as an HTML table.

As in `widgets.parity`, each view has `.widget` (for a live notebook) and a static rendering
(`LiveMetrics.figure()`, `HealthTable.html`) that `show(view)` puts in the same output as the
widget: a live frontend draws the widget, a headless run and its HTML report the static one.
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
import time

import ipywidgets as W
import numpy as np
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from glmkit.rl.health import HEALTHY_FULL, NOT_APPLICABLE, observed_over
from widgets.parity import FIGURE_DPI, MAX_WIDTH_IN, MIN_FONT_PT, _message_figure

# The recipe's metrics, in the order the small multiples show them.
DEFAULT_METRICS = (
    "rollout/raw_reward",
    "eval/raw_reward",
    "train/train_rollout_logprob_abs_diff",
    "train/ppo_kl",
    "train/grad_norm",
    "train/pg_loss",
    "train/pg_clipfrac",
    "train/entropy_loss",
    "rollout/response_lengths",
    "rollout/truncated",
    "train/train_rollout_kl",
)
# Non-negative by construction and spread over decades: a log axis when every point is > 0.
LOG_METRICS = {"train/train_rollout_logprob_abs_diff", "train/train_rollout_kl"}
HEALTHY_LABEL = "recipe's healthy range (full model)"
HEALTHY_GID, SERIES_GID = "healthy-range", "metric-series"
HEALTHY_COLOR, NOT_APPLICABLE_ALPHA, APPLICABLE_ALPHA = "#2e9d4f", 0.08, 0.18
LINE_COLOR, BAD_COLOR = "#1f5fa8", "#b3261e"
LIVE_DPI = FIGURE_DPI   # the live widget's PNG, redrawn after every rollout: the report's size, unscaled
# A live view may spend at most this share of a run's wall time redrawing its figure, and redraws at most
# once a rollout and once a second; the status line (progress, latest values) follows every row.
REDRAW_SHARE, MIN_REDRAW_INTERVAL_S = 0.05, 1.0

VERDICT_COLORS = {"within range": "#1b7f3b", "outside": "#b3261e", "not applicable": "#8a8a8a"}
VERDICT_BACKGROUNDS = {"within range": "#d8efdf", "outside": "#f6d6d3", "not applicable": "#ececec"}


def healthy_band(spec: dict) -> tuple[float, float] | None:
    """The (low, high) band to shade for one entry of the recipe's table: its range; the values its
    reward rose through; within 10x of an `about` value (what `glmkit.rl.health` accepts)."""
    if "range" in spec:
        return tuple(spec["range"])
    if "rise" in spec:
        return tuple(spec["rise"])
    if "about" in spec:
        return spec["about"] / 10, spec["about"] * 10
    return None


def _value(metrics: dict, name: str) -> float:
    value = metrics.get(name)
    if value is None:
        return math.nan   # not measured at this step (missing, or None in the JSONL)
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _measured_non_finite(metrics: dict, name: str) -> bool:
    """NaN or Inf reported for this metric (a diverging run), as opposed to not measured (None / absent)."""
    return metrics.get(name) is not None and not math.isfinite(_value(metrics, name))


def read_jsonl(path) -> list[dict]:
    """The metric dicts of a JSONL file; a half-written last line (a run still writing) is dropped."""
    rows = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


# ---------------------------------------------------------------- live metrics

class LiveMetrics:
    """Small multiples of a GRPO run's metrics against the rollout step.

    metric_names: the metrics to plot (default: the recipe's, `DEFAULT_METRICS`).
    healthy: {metric: spec} as `glmkit.rl.health.HEALTHY_FULL`; its band is shaded on that metric's
        axis and labelled "recipe's healthy range (full model)". None or {} shades nothing.
    variant: the model variant; where `NOT_APPLICABLE[variant]` says the full model's number does not
        carry over, the band is drawn fainter and the axis title says "n/a on {variant}".
    total_rollouts: the run's length, for the progress line (rollout k/N, optimizer step, ETA, tokens/s).

    Cost: `update` redraws the figure at most once a rollout, once a second (`min_interval_s`), and only
    while the time spent redrawing stays within `redraw_share` of the time since the first row; the
    figure's lines are updated in place (rebuilt only when an axis changes kind). `finish()` draws the
    final state.
    """

    def __init__(self, metric_names=None, healthy=HEALTHY_FULL, variant: str = "tiny", columns: int = 3,
                 total_rollouts: int | None = None, redraw_share: float = REDRAW_SHARE,
                 min_interval_s: float = MIN_REDRAW_INTERVAL_S):
        self.metric_names = list(DEFAULT_METRICS if metric_names is None else metric_names)
        self.healthy = dict(healthy or {})
        self.variant = variant
        self.columns = max(1, min(columns, len(self.metric_names) or 1))
        self.total_rollouts, self.redraw_share, self.min_interval_s = total_rollouts, redraw_share, min_interval_s
        self.history: list[dict] = []
        self.status = W.HTML()
        self.output = W.Output()
        self.widget = W.VBox([self.status, self.output])
        self._first_row_at = self._drawn_at = None
        self._done_at_first = 0
        self.draw_seconds, self.draws, self._pending = 0.0, 0, False
        self._live = None   # (figure, each axis's kind, whether it had rows) reused between redraws
        self.redraw()
        self.draw_seconds, self.draws, self._drawn_at = 0.0, 0, None  # the empty figure precedes the run

    @classmethod
    def from_jsonl(cls, path, **kwargs) -> "LiveMetrics":
        """A view holding every rollout of a metrics file (`metrics_out` of a run)."""
        view = cls(**kwargs)
        view.extend(read_jsonl(path))
        return view

    # -- data

    def update(self, metrics: dict):
        """Append one metric row (a `GRPOTrainer.run(on_metrics=...)` callback): the status line now, the
        figure when a redraw is due (see the class's cost rule)."""
        now = time.perf_counter()
        self.history.append(dict(metrics))
        self._start_clock(now)
        if self._redraw_due(now):
            self.redraw()
        else:
            self._pending = True
            self._set_status()

    def extend(self, rows):
        """Append many rollouts and redraw once (a job's rows polled in batches: the ETA counts from
        the first batch)."""
        rows = [dict(r) for r in rows]
        self.history.extend(rows)
        if rows:
            self._start_clock(time.perf_counter())
        self.redraw()

    def _start_clock(self, now: float):
        """The ETA's origin: when the first rows arrived, and the rollouts they brought (the pace counts
        the rollouts after them)."""
        if self._first_row_at is None:
            self._first_row_at, self._done_at_first = now, self.rollouts

    def finish(self):
        """Draw what is not drawn yet (the end of a run)."""
        if self._pending:
            self.redraw()

    def _redraw_due(self, now: float) -> bool:
        if "rollout/raw_reward" not in self.history[-1]:   # at most once a rollout: on its rollout row
            return False
        if self._drawn_at is not None and now - self._drawn_at < self.min_interval_s:
            return False
        return self.draw_seconds <= self.redraw_share * (now - self._first_row_at)

    def steps(self) -> np.ndarray:
        """The x of each point: the metrics' own "step" (a resumed run starts past 0), else its index."""
        return np.array([float(i if h.get("step") is None else h["step"]) for i, h in enumerate(self.history)])

    def series(self, name: str) -> np.ndarray:
        return np.array([_value(h, name) for h in self.history], dtype=float)

    def points(self, name: str):
        """(x, y, x of non-finite values) of one metric over the rows that report it: `train/*` at
        its row's `train/step` when the row has one, everything else at the rollout."""
        xs, ys, bad = [], [], []
        for i, h in enumerate(self.history):
            flagged = name in (h.get("nonfinite") or [])
            if name not in h and not flagged:
                continue
            by_step = name.startswith("train/") and h.get("train/step") is not None
            x = float(h["train/step"] if by_step else h.get("rollout/step", h.get("step", i)))
            if flagged or _measured_non_finite(h, name):
                bad.append(x)
            elif h.get(name) is not None:
                xs.append(x)
                ys.append(_value(h, name))
        return np.array(xs, dtype=float), np.array(ys, dtype=float), np.array(bad, dtype=float)

    @property
    def rollouts(self) -> int:
        """Rollouts so far: their rows (train rows are per optimizer step, eval rows per evaluation)."""
        return sum("rollout/raw_reward" in h for h in self.history)

    def not_applicable(self, name: str) -> str | None:
        return NOT_APPLICABLE.get(self.variant, {}).get(name) or None

    # -- rendering

    def _count(self) -> str:
        done = self.rollouts
        return f"rollout {done}/{self.total_rollouts}" if self.total_rollouts else f"{done} rollouts"

    def progress(self) -> str:
        """rollout k/N (or k rollouts), then optimizer step, ETA and tokens/s, from the rows so far."""
        return " · ".join([self._count(), *self._pace()])

    def _pace(self) -> list[str]:
        """Optimizer step, ETA and tokens/s (what is known of them)."""
        done, parts = self.rollouts, []
        step = next((h["train/step"] for h in reversed(self.history) if h.get("train/step") is not None), None)
        if step is not None:
            parts.append(f"optimizer step {step}")
        progressed = done - self._done_at_first
        if self.total_rollouts and self._first_row_at is not None and (progressed > 0 or done >= self.total_rollouts):
            elapsed = time.perf_counter() - self._first_row_at
            left = max(0, self.total_rollouts - done) * elapsed / max(progressed, 1)
            parts.append(f"ETA {int(left // 60)}:{int(left % 60):02d}")
        rate = next((h["perf/tokens_per_s"] for h in reversed(self.history) if h.get("perf/tokens_per_s")), None)
        if rate is not None:
            parts.append(f"{rate:.4g} tokens/s")
        return parts

    @property
    def text(self) -> str:
        if not self.history:
            return "no rollouts yet"
        # the step of the latest rollout row (0-based, as the framework numbers rollouts): train and eval
        # rows number their own steps and would make the count jump back and forth
        rollout_rows = [h for h in self.history if "rollout/raw_reward" in h]
        last = rollout_rows[-1] if rollout_rows else self.history[-1]
        step = last.get("rollout/step", last.get("step", len(rollout_rows) - 1 if rollout_rows else 0))
        parts = [f"step {step} ({self._count()})", *self._pace()]
        for name in self.metric_names[:4]:
            holder = next((h for h in reversed(self.history) if h.get(name) is not None
                           or name in (h.get("nonfinite") or [])), None)  # its latest measured value
            if holder is None:
                continue  # not measured yet (before the first rollout): nothing to show, not "None"
            value = _value(holder, name)
            shown = f"{value:.4g}" if math.isfinite(value) else holder.get(name) or "NaN/Inf"
            parts.append(f"{name} = {shown}")
        return ", ".join(parts)

    def _set_status(self):
        self.status.value = f"<div style='font-family:monospace;font-size:0.85em'>{html.escape(self.text)}</div>"

    def redraw(self):
        started = time.perf_counter()
        self._set_status()
        # set as the Output's outputs (no `with output:`), so it also works outside a kernel; no tight
        # bounding box (the layout is fixed), which halves the time of a redraw
        buf = io.BytesIO()
        self._live_figure().savefig(buf, format="png", dpi=LIVE_DPI)
        self.output.outputs = ({"output_type": "display_data", "metadata": {},
                                "data": {"image/png": base64.b64encode(buf.getvalue()).decode(),
                                         "text/plain": f"GRPO metrics: {self.text}"}},)
        self._drawn_at = time.perf_counter()
        self.draw_seconds += self._drawn_at - started
        self.draws += 1
        self._pending = False

    def _axis_kind(self, name: str):
        """What decides how an axis is built: whether it has points, its non-finite marks, its scale."""
        _, values, bad_x = self.points(name)
        finite = values[np.isfinite(values)]
        return bool(len(finite)), len(bad_x), name in LOG_METRICS and bool(len(finite)) and bool((finite > 0).all())

    def _live_figure(self) -> Figure:
        """The figure with the current rows: the last one's lines updated in place while every axis keeps
        its kind, else built anew."""
        kinds = [self._axis_kind(n) for n in self.metric_names]
        if self._live is None or not self._live[2] or self._live[1] != kinds:
            figure = self.figure()
            self._live = (figure, kinds, bool(self.history))
            return figure
        figure = self._live[0]
        for ax, name in zip(figure.axes, self.metric_names):
            steps, values, bad_x = self.points(name)
            series = [line for line in ax.lines if line.get_gid() == SERIES_GID]
            if series:
                series[0].set_data(steps, values)
                ax.relim()
                ax.autoscale_view(scalex=False)
            xs = np.concatenate([steps, bad_x])
            if len(xs):
                ax.set_xlim(float(xs.min()) - 0.5, float(xs.max()) + 0.5)
        figure.suptitle(f"GRPO run ({self.variant}): {self.rollouts} rollouts", fontsize=12)
        return figure

    def figure(self) -> Figure:
        """The small multiples, `MAX_WIDTH_IN` wide (an output area shows them unscaled), every label
        at least `MIN_FONT_PT`."""
        if not self.metric_names:
            return _message_figure("no metrics chosen")
        rows = math.ceil(len(self.metric_names) / self.columns)
        top, bottom = 0.75, 0.85   # inches: the title above, the legend below
        height = 2.5 * rows + top + bottom
        fig = Figure(figsize=(MAX_WIDTH_IN, height))
        # a fixed layout: constrained layout would triple the time of every live redraw
        fig.subplots_adjust(left=0.075, right=0.985, top=1 - top / height, bottom=bottom / height,
                            wspace=0.38, hspace=0.75)
        drawn = set()   # "applicable" / "not applicable": which kinds of band were shaded
        for i, name in enumerate(self.metric_names):
            ax = fig.add_subplot(rows, self.columns, i + 1)
            steps, values, bad_x = self.points(name)
            drawn.add(self._draw_band(ax, name))
            finite = np.isfinite(values)
            if finite.any():
                ax.plot(steps, values, color=LINE_COLOR, linewidth=1.4, marker="o", markersize=3.5, gid=SERIES_GID)
                if name in LOG_METRICS and (values[finite] > 0).all():
                    ax.set_yscale("log")
            notes = []
            if len(bad_x):  # NaN / Inf measured (not merely missing): red marks along the bottom
                ax.plot(bad_x, np.zeros(len(bad_x)), linestyle="none", marker="x", color=BAD_COLOR,
                        transform=ax.get_xaxis_transform(), clip_on=False)
                notes.append(f"{len(bad_x)} non-finite")
            if self.not_applicable(name) and name in self.healthy:
                notes.append(f"range n/a on {self.variant}")
            if not len(self.history):
                ax.text(0.5, 0.5, "no rollouts yet", ha="center", va="center", transform=ax.transAxes,
                        color="grey", fontsize=MIN_FONT_PT)
            elif not finite.any() and not len(bad_x):
                ax.text(0.5, 0.5, "not measured", ha="center", va="center", transform=ax.transAxes,
                        color="grey", fontsize=MIN_FONT_PT)
            ax.set_title(name + (f"\n({', '.join(notes)})" if notes else ""), fontsize=MIN_FONT_PT + 0.5)
            ax.tick_params(which="both", labelsize=MIN_FONT_PT)
            ax.yaxis.get_offset_text().set_fontsize(MIN_FONT_PT)
            ax.xaxis.get_offset_text().set_fontsize(MIN_FONT_PT)
            per_step = any(h.get("train/step") is not None and name in h for h in self.history)
            ax.set_xlabel("optimizer step" if per_step else "rollout", fontsize=MIN_FONT_PT)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=5))
            if ax.get_yscale() == "linear":
                ax.yaxis.set_major_locator(MaxNLocator(nbins=4))
            xs = np.concatenate([steps, bad_x])
            if len(xs):
                ax.set_xlim(float(xs.min()) - 0.5, float(xs.max()) + 0.5)
        handles = [Patch(color=HEALTHY_COLOR, alpha=APPLICABLE_ALPHA, linewidth=0, label=HEALTHY_LABEL)]
        if "not applicable" in drawn:
            handles.append(Patch(color=HEALTHY_COLOR, alpha=NOT_APPLICABLE_ALPHA, linewidth=0,
                                 label=f"{HEALTHY_LABEL}, not applicable on {self.variant}"))
        if drawn - {None}:
            fig.legend(handles=handles, loc="lower center", ncols=len(handles), fontsize=MIN_FONT_PT + 1,
                       frameon=False)
        fig.suptitle(f"GRPO run ({self.variant}): {self.rollouts} rollouts", fontsize=12)
        return fig

    def _draw_band(self, ax, name) -> str | None:
        """Shade the recipe's band on this metric's axis; which kind was drawn (None: the table has none)."""
        spec = self.healthy.get(name)
        band = healthy_band(spec) if spec else None
        if band is None:
            return None
        faint = self.not_applicable(name) is not None
        patch = ax.axhspan(*band, color=HEALTHY_COLOR, alpha=NOT_APPLICABLE_ALPHA if faint else APPLICABLE_ALPHA,
                           linewidth=0, label=HEALTHY_LABEL, zorder=0)
        patch.set_gid(HEALTHY_GID)
        if "rise" in spec and self.history:  # the rollout by which the recipe's reward reached its target
            ax.axvline(spec.get("within", 0), color=HEALTHY_COLOR, linestyle=":", linewidth=0.8,
                       alpha=0.6 if faint else 1.0)
        return "not applicable" if faint else "applicable"


# ---------------------------------------------------------------- health table

class HealthTable:
    """The recipe's healthy-run table against a run: rows of `glmkit.rl.health.verdicts(history, variant)`
    ({"metric", "expected", "observed", "verdict", "why"}), each row coloured by its verdict; below it,
    when given, the framework's other metrics the run logged (`glmkit.rl.health.observations`: first ->
    last per rollout, min - max), reported without a verdict since the recipe gives them no range."""

    COLUMNS = ("metric", "expected", "observed", "verdict", "why")

    def __init__(self, rows: list[dict], observations: list[dict] = ()):
        self.rows = [dict(r) for r in rows]
        self.observations = [dict(r) for r in observations]
        self.widget = W.HTML(self.html)

    @staticmethod
    def color(verdict: str) -> str:
        return VERDICT_COLORS.get(verdict, VERDICT_COLORS["not applicable"])

    @staticmethod
    def background(verdict: str) -> str:
        return VERDICT_BACKGROUNDS.get(verdict, VERDICT_BACKGROUNDS["not applicable"])

    @staticmethod
    def cell(row: dict, column: str) -> str:
        value = row.get(column)
        return "—" if value is None else str(value)

    @property
    def counts(self) -> dict[str, int]:
        found = {}
        for r in self.rows:
            found[r.get("verdict")] = found.get(r.get("verdict"), 0) + 1
        return found

    @property
    def text(self) -> str:
        summary = ", ".join(f"{n} {v}" for v, n in self.counts.items()) or "no rows"
        return f"recipe health table: {summary}"

    @property
    def html(self) -> str:
        style = "border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top"
        head = "".join(f"<th style='{style};background:#f4f4f4'>{c}</th>" for c in self.COLUMNS)
        body = []
        for r in self.rows:
            verdict = str(r.get("verdict"))
            cells = []
            for c in self.COLUMNS:
                text = html.escape(self.cell(r, c))
                if c == "verdict":
                    text = f"<b style='color:{self.color(verdict)}'>{text}</b>"
                elif c == "metric":
                    text = f"<code>{text}</code>"
                cells.append(f"<td style='{style}'>{text}</td>")
            body.append(f"<tr class='verdict-{verdict.replace(' ', '-')}' "
                        f"style='background:{self.background(verdict)}'>{''.join(cells)}</tr>")
        return (f"<div style='font-size:0.85em'><div style='margin-bottom:4px'>{html.escape(self.text)}</div>"
                f"<table style='border-collapse:collapse'><tr>{head}</tr>{''.join(body)}</table>"
                f"{self._observations_html(style)}</div>")

    def _observations_html(self, style: str) -> str:
        if not self.observations:
            return ""
        head = "".join(f"<th style='{style};background:#f4f4f4'>{c}</th>"
                       for c in ("metric (reported, no recipe range)", "first → last", "min – max", "over"))
        body = "".join(
            f"<tr><td style='{style}'><code>{html.escape(str(r['metric']))}</code></td>"
            f"<td style='{style}'>{r['first']:.4g} → {r['last']:.4g}</td>"
            f"<td style='{style}'>{r['min']:.4g} – {r['max']:.4g}</td><td style='{style}'>{observed_over(r)}</td></tr>"
            for r in self.observations)
        return f"<table style='border-collapse:collapse;margin-top:8px'><tr>{head}</tr>{body}</table>"

    def _repr_html_(self) -> str:
        return self.html
