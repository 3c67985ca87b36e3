"""Views over a `glmkit.parity.rollout_data.RolloutAttribution`: which side (engine or trainer) departs
from the reference, per sample, per token and by position. Same contract as `widgets.parity`: `.widget`
for a live notebook, `.html` or `.figure()` for the static rendering a report keeps."""

from __future__ import annotations

import html

import ipywidgets as W
import numpy as np
from matplotlib.figure import Figure

from glmkit.parity.rollout_data import severity
from widgets.parity import FAIL_COLOR, FLOOR, MAX_WIDTH_IN, MIN_FONT_PT, banner_html, show_in

SIDE_COLORS = {"engine": "#1f77b4", "trainer": "#d62728"}


def _sample_label(attribution) -> str:
    j = attribution.to_json()
    return f"sample {j['index']} ({attribution.departs})"


class RolloutVerdict:
    """PASS, or FAIL with how many samples depart on each side; the recipe's abs diff."""

    def __init__(self, result):
        self.result = result
        self.widget = W.HTML(self.html)

    @property
    def headline(self) -> str:
        r, sides = self.result, self.result.sides()
        if r.verdict == "pass":
            return f"PASS: no sample departs from the reference (threshold {r.threshold:g})"
        parts = [f"{sides[k]} on the {k} side" for k in ("engine", "trainer") if sides[k]]
        if sides["both"]:
            parts.append(f"{sides['both']} on both sides")
        return f"FAIL: {len(r.departing)} of {len(r.samples)} samples depart: " + ", ".join(parts)

    @property
    def text(self) -> str:
        r = self.result
        return (f"{self.headline}\ntrain/train_rollout_logprob_abs_diff = {r.logprob_abs_diff:.4g}; "
                f"trainer side: {r.trainer_source}")

    @property
    def html(self) -> str:
        return banner_html(self.result.verdict == "pass", self.headline, self.text.splitlines()[1:])


class SampleTable:
    """One row per sample: mean |diff| of each side against the reference and against each other, and
    which side departs (worst first)."""

    def __init__(self, result, rows: int = 30):
        self.result, self.rows = result, rows
        self.widget = W.HTML(self.html)

    @property
    def text(self) -> str:
        return f"{len(self.result.samples)} samples, {len(self.result.departing)} depart"

    @property
    def html(self) -> str:
        ordered = sorted(self.result.samples, key=severity)
        body = []
        for a in ordered[:self.rows]:
            j = a.to_json()
            style = f" style='color:{FAIL_COLOR};font-weight:bold'" if a.departs != "none" else ""
            body.append(f"<tr{style}><td>{html.escape(str(j['index']))}</td><td>{j['response_length']}</td>"
                        f"<td>{a.engine_vs_reference:.3e}</td><td>{a.trainer_vs_reference:.3e}</td>"
                        f"<td>{a.engine_vs_trainer:.3e}</td><td>{html.escape(a.departs)}</td></tr>")
        more = (f"<tr><td colspan='6'>... {len(ordered) - self.rows} more samples in the JSON</td></tr>"
                if len(ordered) > self.rows else "")
        return ("<table><tr><th>sample</th><th>response tokens</th><th>engine vs reference</th>"
                "<th>trainer vs reference</th><th>engine vs trainer</th><th>departs</th></tr>"
                + "".join(body) + more + "</table>")


class TokenTrace:
    """|side - reference| per response token of one sample (a dropdown picks it; the worst sample
    first), both sides on a log axis, the threshold dashed and masked tokens shaded."""

    def __init__(self, result):
        self.result = result
        ordered = sorted(result.samples, key=severity)
        self.choice = W.Dropdown(options=[(_sample_label(a), k) for k, a in enumerate(ordered)], value=0,
                                 description="sample")
        self.ordered = ordered
        self.output = W.Output()
        self.choice.observe(lambda _change: self.redraw(), names="value")
        self.redraw()
        self.widget = W.VBox([self.choice, self.output])

    def redraw(self):
        show_in(self.output, self.figure(self.choice.value), "per-token log-prob difference")

    @property
    def text(self) -> str:
        return f"per-token |logp - reference| of {_sample_label(self.ordered[0])}"

    def figure(self, pick: int = 0) -> Figure:
        a = self.ordered[pick]
        ref = np.asarray(a.reference, dtype=float)
        fig = Figure(figsize=(MAX_WIDTH_IN - 1.5, 3.6), layout="constrained")
        ax = fig.add_subplot()
        for side, values in (("engine", a.sample.engine), ("trainer", a.trainer)):
            diff = np.abs(np.asarray(values, dtype=float) - ref)
            ax.plot(np.maximum(np.nan_to_num(diff, nan=1e3), FLOOR), marker=".", linewidth=1,
                    color=SIDE_COLORS[side], label=f"{side} vs reference")
        for pos, kept in enumerate(a.sample.mask):
            if not kept:
                ax.axvspan(pos - 0.5, pos + 0.5, color="#cccccc", alpha=0.5, linewidth=0)
        ax.axhline(self.result.threshold, color="black", linestyle="--", linewidth=0.8,
                   label=f"threshold {self.result.threshold:g} (on the sample's mean)")
        ax.set_yscale("log")
        ax.set_xlabel("response token (grey: not in the loss mask)", fontsize=10)
        ax.set_ylabel("|logp - logp_reference|", fontsize=10)
        ax.tick_params(labelsize=MIN_FONT_PT)
        ax.set_title(f"{_sample_label(a)}: per-token log-prob difference", fontsize=11)
        fig.legend(fontsize=MIN_FONT_PT, loc="outside right upper")
        return fig


class PositionProfile:
    """Mean |side - reference| by response position over all samples: a departure that grows with
    length (a state or cache problem) tells itself from one that does not."""

    def __init__(self, result):
        self.result = result
        self.widget = W.Output()
        show_in(self.widget, self.figure(), "position profile")

    @property
    def text(self) -> str:
        return "mean |logp - reference| by response position"

    def figure(self) -> Figure:
        p = self.result.position_profile
        x = np.asarray(p["bin_start"], dtype=float) + (p["bin_width"] - 1) / 2
        fig = Figure(figsize=(MAX_WIDTH_IN - 1.5, 3.4), layout="constrained")
        ax = fig.add_subplot()
        for side in ("engine", "trainer"):
            ax.plot(x, np.maximum(np.asarray(p[side], dtype=float), FLOOR), marker="o", color=SIDE_COLORS[side],
                    label=f"{side} vs reference")
        ax.set_yscale("log")
        ax.set_xlabel(f"response position (bins of {p['bin_width']} tokens)", fontsize=10)
        ax.set_ylabel("mean |diff| over samples", fontsize=10)
        ax.tick_params(labelsize=MIN_FONT_PT)
        ax.set_title("position profile", fontsize=11)
        fig.legend(fontsize=MIN_FONT_PT, loc="outside right upper")
        return fig
