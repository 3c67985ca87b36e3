"""ipywidgets views over a `glmkit.parity.compare.ParityResult`.

Every view has `.widget` (interactive, for a live notebook) and `.figure()` (a matplotlib Figure,
the static rendering). `show(view)` displays both, so a headless papermill run converted to HTML
still carries the picture even though the widget cannot render there.

Figures are built with `matplotlib.figure.Figure`, not pyplot, so the inline backend never shows
them a second time and they are freed with the view.
"""

from __future__ import annotations

import base64
import html
import io
import math

import ipywidgets as W
import numpy as np
from matplotlib import colormaps
from matplotlib.colors import Normalize, to_hex
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from glmkit.model.sites import FINAL, PER_LAYER

FLOOR = 1e-10   # log scales start here; an exact match (error 0) is drawn at the floor
KDA_CHUNK = 64  # the torch KDA kernel's chunk size: errors can step at these boundaries
PASS_COLOR, FAIL_COLOR = "#1b7f3b", "#b3261e"


# ---------------------------------------------------------------- shared helpers

def figure_png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return buf.getvalue()


def png_output(fig: Figure, caption: str) -> dict:
    """A display_data message for an Output widget's `outputs`. Set directly rather than through
    `with output:`, which only captures inside a running kernel (tests and scripts have none)."""
    return {"output_type": "display_data", "metadata": {},
            "data": {"image/png": base64.b64encode(figure_png(fig)).decode(), "text/plain": caption}}


def show_in(output: W.Output, fig: Figure, caption: str = ""):
    output.outputs = (png_output(fig, caption or "figure"),)


def show(view):
    """Display the static PNG (survives nbconvert) and then the interactive widget."""
    from IPython.display import Image, display

    alt = getattr(view, "text", None) or type(view).__name__  # the banner's alt text is its verdict
    display(Image(data=figure_png(view.figure()), alt=alt))
    display(view.widget)


def layer_label(layer) -> str:
    return "final" if layer is None else str(layer)


def site_error(site_result) -> float | None:
    """The one number a cell shows: rel RMS for value sites, the fraction of rows that differ other
    than by ties for index sites (what counts toward divergence)."""
    if site_result.kind == "indices":
        if site_result.different is not None:
            return site_result.different
        return None if site_result.identical is None else 1.0 - site_result.identical
    return site_result.rel_rms


def log_error(value: float | None) -> float:
    if value is None or not math.isfinite(value):
        return math.nan
    return math.log10(max(value, FLOOR))


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def describe_site(s) -> str:
    if s.kind == "indices":
        return (f"layer {layer_label(s.layer)} {s.site}: identical rows {_fmt(s.identical)}, tied {_fmt(s.tied)}, "
                f"different {_fmt(s.different)}, mean Jaccard {_fmt(s.jaccard)}")
    text = f"layer {layer_label(s.layer)} {s.site}: rel RMS {_fmt(s.rel_rms)}, max |diff| {_fmt(s.max_abs)}"
    if s.nan or s.inf:
        text += f", NaN {s.nan}, Inf {s.inf}"
    return text


def _message_figure(text: str) -> Figure:
    fig = Figure(figsize=(6, 1.2))
    ax = fig.add_subplot()
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center")
    return fig


# ---------------------------------------------------------------- site heatmap

class SiteHeatmap:
    """Sites (rows) x layers (columns) coloured by log10 error; divergent cells outlined in red.
    Clicking a cell plots that site's error per token position below the grid.

    `lengths`: the sequence lengths of the capture (`capture.lengths`), to plot per-row errors
    against the position inside each sequence; without them rows are plotted in packed order."""

    def __init__(self, result, lengths=None, cmap: str = "viridis"):
        self.result, self.lengths = result, list(lengths) if lengths is not None else None
        self.cells = {(s.layer, s.site): s for s in result.sites}
        self.layers = sorted({k[0] for k in self.cells}, key=lambda l: (l is None, l or 0))
        order = list(PER_LAYER) + list(FINAL)
        self.site_names = sorted({k[1] for k in self.cells},
                                 key=lambda n: (order.index(n) if n in order else len(order), n))
        values = [log_error(site_error(s)) for s in result.sites]
        finite = [v for v in values if math.isfinite(v)]
        self.norm = Normalize(vmin=math.log10(FLOOR), vmax=max([0.0] + [math.ceil(v) for v in finite]))
        self.cmap = colormaps[cmap].with_extremes(bad="#dddddd")
        self.output = W.Output()
        self.buttons = {}
        self.widget = self._build()

    def grid(self) -> np.ndarray:
        """[site, layer] log10 errors, NaN where a layer has no such site."""
        out = np.full((len(self.site_names), len(self.layers)), np.nan)
        for (layer, site), s in self.cells.items():
            out[self.site_names.index(site), self.layers.index(layer)] = log_error(site_error(s))
        return out

    def figure(self) -> Figure:
        grid = self.grid()
        fig = Figure(figsize=(max(5.0, 1.6 + 0.45 * len(self.layers)), 1.2 + 0.32 * len(self.site_names)))
        ax = fig.add_subplot()
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=self.cmap, norm=self.norm, aspect="auto")
        ax.set_xticks(range(len(self.layers)), [layer_label(l) for l in self.layers])
        ax.set_yticks(range(len(self.site_names)), self.site_names)
        ax.set_xlabel("layer")
        for (layer, site), s in self.cells.items():
            if s.diverged:
                x, y = self.layers.index(layer), self.site_names.index(site)
                ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2.5))
        first = self.result.first_divergence
        if first is not None:
            ax.text(self.layers.index(first.layer), self.site_names.index(first.site), "1st", ha="center",
                    va="center", color="red", fontsize=8, fontweight="bold")
        ax.set_title(f"{self.result.path_a} vs {self.result.path_b}: log10 error per site "
                     f"(index sites: rows different other than by ties)", fontsize=10)
        fig.colorbar(image, ax=ax, label="log10 rel RMS (index sites: different rows)")
        return fig

    def _cell_button(self, layer, site) -> W.Widget:
        s = self.cells.get((layer, site))
        size = W.Layout(width="30px", height="22px", padding="0", margin="1px")
        if s is None:
            return W.Box(layout=size)
        value = log_error(site_error(s))
        color = to_hex(self.cmap(self.norm(value))) if math.isfinite(value) else "#dddddd"
        first = s is self.result.first_divergence
        button = W.Button(description="1st" if first else "", tooltip=describe_site(s), layout=size)
        button.style.button_color = color
        button.style.font_size = "9px"
        if s.diverged:
            button.layout.border = "2px solid red"
        button.on_click(lambda _b, s=s: self.select(s))
        self.buttons[(layer, site)] = button
        return button

    def _build(self) -> W.Widget:
        label = W.Layout(width="150px", height="22px", margin="1px")
        header = [W.Label("site \\ layer", layout=label)] + [
            W.Label(layer_label(l), layout=W.Layout(width="30px", margin="1px")) for l in self.layers]
        rows = [W.HBox(header)]
        for site in self.site_names:
            rows.append(W.HBox([W.Label(site, layout=label)] + [self._cell_button(l, site) for l in self.layers]))
        hint = W.HTML("<i>Click a cell to plot that site's error per token position; hover for its value. "
                      "Red border: over threshold; 1st: the first divergence.</i>")
        return W.VBox([hint, W.VBox(rows), self.output])

    def position_figure(self, s) -> Figure:
        """One site's per-row error against token position (one line per sequence when lengths are known)."""
        fig = Figure(figsize=(7, 3))
        ax = fig.add_subplot()
        per_row = np.asarray(s.per_row, dtype=float)
        if s.kind == "values":
            per_row = np.maximum(per_row, FLOOR)
            ax.set_yscale("log")
            ax.axhline(self.result.thresholds.get("rel_rms", np.nan), color="red", linestyle="--",
                       linewidth=1, label="threshold (whole site)")
        if self.lengths and sum(self.lengths) == len(per_row):
            start = 0
            for n, length in enumerate(self.lengths):
                ax.plot(range(length), per_row[start:start + length], label=f"sequence {n}", linewidth=1)
                start += length
            ax.set_xlabel("position in sequence")
        else:
            ax.plot(per_row, linewidth=1)
            ax.set_xlabel("token row (packed)")
        ax.set_ylabel("rel error of row" if s.kind == "values" else "1 - Jaccard of row")
        ax.set_title(describe_site(s), fontsize=9)
        ax.legend(fontsize=7)
        return fig

    def select(self, s):
        show_in(self.output, self.position_figure(s), describe_site(s))


# ---------------------------------------------------------------- log-prob histogram

class LogprobHistogram:
    """Per-token |logp_a - logp_b| on a log axis, the recipe's train/train_rollout_logprob_abs_diff
    (mean over samples of each sample's mean) marked, and the worst tokens listed."""

    def __init__(self, result, bins: int = 30, worst: int = 8):
        self.result, self.diff, self.worst = result, result.logprob, worst
        self.bins = W.IntSlider(value=bins, min=5, max=100, description="bins")
        self.output = W.Output()
        self.bins.observe(lambda _change: self.redraw(), names="value")
        self.redraw()
        self.widget = W.VBox([W.HTML(self.summary_html()), self.bins, self.output])

    def redraw(self):
        show_in(self.output, self.figure(self.bins.value), "log-prob |diff| histogram")

    def summary_html(self) -> str:
        if self.diff is None:
            return "<b>No log-probs in these captures.</b>"
        rows = "".join(f"<tr><td>{w['sequence']}</td><td>{w['position']}</td><td>{w['a']:.6g}</td>"
                       f"<td>{w['b']:.6g}</td><td>{w['abs_diff']:.3g}</td></tr>" for w in self.diff.worst[:self.worst])
        return (f"<b>train/train_rollout_logprob_abs_diff = {self.diff.value:.3e}</b> "
                f"({self.result.path_a} vs {self.result.path_b}, {len(self.diff.per_token)} tokens)"
                f"<table><tr><th>sequence</th><th>position</th><th>logp a</th><th>logp b</th><th>|diff|</th></tr>"
                f"{rows}</table>")

    def figure(self, bins: int | None = None) -> Figure:
        if self.diff is None or not self.diff.per_token:
            return _message_figure("no log-probs to compare")
        bins = bins or self.bins.value
        values = np.asarray(self.diff.per_token, dtype=float)
        exact = int((values == 0).sum())
        clipped = np.maximum(values, FLOOR)
        low, high = clipped.min(), clipped.max()
        if high <= low * 1.0001:  # all one value: give the bins some width
            low, high = low / 10, high * 10
        fig = Figure(figsize=(10, 3.6))
        hist, table = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
        hist.hist(clipped, bins=np.logspace(math.log10(low), math.log10(high * 1.001), bins + 1))
        hist.set_xscale("log")
        hist.axvline(max(self.diff.value, FLOOR), color="red", linestyle="--",
                     label=f"metric {self.diff.value:.2e}")
        hist.set_xlabel("|logp_a - logp_b| per token" + (f" ({exact} exactly 0, drawn at {FLOOR:g})" if exact else ""))
        hist.set_ylabel("tokens")
        hist.set_title(f"{self.result.path_a} vs {self.result.path_b}: {len(values)} response tokens", fontsize=10)
        hist.legend(fontsize=8)
        table.axis("off")
        rows = [[w["sequence"], w["position"], f"{w['a']:.5g}", f"{w['b']:.5g}", f"{w['abs_diff']:.2e}"]
                for w in self.diff.worst[:self.worst]]
        if rows:
            t = table.table(cellText=rows, colLabels=["seq", "pos", "logp a", "logp b", "|diff|"], loc="center")
            t.auto_set_font_size(False)
            t.set_fontsize(8)
        table.set_title("worst tokens", fontsize=10)
        return fig


# ---------------------------------------------------------------- KDA error vs position

class KdaErrorCurve:
    """`curves` from `kda_error_vs_position`: {layer: [rel error per position]} of the chunked KDA
    form against the token-by-token recurrence; one line per layer, log y, chunk boundaries dotted."""

    def __init__(self, curves: dict, chunk: int = KDA_CHUNK):
        self.curves, self.chunk = dict(sorted(curves.items())), chunk
        self.toggles = {layer: W.Checkbox(value=True, description=f"layer {layer}", indent=False,
                                          layout=W.Layout(width="100px")) for layer in self.curves}
        self.output = W.Output()
        for box in self.toggles.values():
            box.observe(lambda _change: self.redraw(), names="value")
        self.redraw()
        self.widget = W.VBox([W.HBox(list(self.toggles.values())), self.output])

    def shown_layers(self) -> list:
        return [layer for layer, box in self.toggles.items() if box.value]

    def redraw(self):
        show_in(self.output, self.figure(self.shown_layers()), "KDA error vs position")

    def figure(self, layers=None) -> Figure:
        if not self.curves:
            return _message_figure("no KDA layers")
        layers = list(self.curves) if layers is None else layers
        fig = Figure(figsize=(8, 3.4))
        ax = fig.add_subplot()
        length = max(len(v) for v in self.curves.values())
        for boundary in range(self.chunk, length, self.chunk):
            ax.axvline(boundary, color="grey", linestyle=":", linewidth=0.8)
        for layer in layers:
            ax.plot(np.maximum(np.asarray(self.curves[layer], dtype=float), FLOOR), linewidth=1,
                    label=f"layer {layer}")
        ax.set_yscale("log")
        ax.set_xlabel(f"position (dotted: chunk boundaries every {self.chunk})")
        ax.set_ylabel("rel error, chunked vs recurrent")
        ax.set_title("KDA: chunked (train / prefill) vs recurrent (decode) per position", fontsize=10)
        if layers:
            ax.legend(fontsize=8)
        return fig


# ---------------------------------------------------------------- top-k / routing overlap

class TopkOverlap:
    """`agreement` from `index_agreement(result, site)`: {layer: {"jaccard", "identical", "tied",
    "different"}}. Bars per layer: the mean Jaccard overlap, and the rows whose sets are identical,
    differ only by ties at the top-k boundary, or differ (only these count toward divergence)."""

    METRICS = ("jaccard", "identical", "tied", "different")
    LABELS = {"jaccard": "mean Jaccard", "identical": "identical rows", "tied": "tied rows",
              "different": "different rows"}

    def __init__(self, agreement: dict, site: str = "indexer_topk", identical_needed: float | None = None):
        self.agreement, self.site, self.identical_needed = dict(sorted(agreement.items())), site, identical_needed
        self.choice = W.ToggleButtons(options=["all", *self.METRICS], value="all", description="show")
        self.output = W.Output()
        self.choice.observe(lambda _change: self.redraw(), names="value")
        self.redraw()
        self.widget = W.VBox([self.choice, self.output])

    def redraw(self):
        metrics = self.METRICS if self.choice.value == "all" else (self.choice.value,)
        show_in(self.output, self.figure(metrics), f"{self.site} overlap")

    def figure(self, metrics=METRICS) -> Figure:
        if not self.agreement:
            return _message_figure(f"no layers with {self.site}")
        layers = list(self.agreement)
        fig = Figure(figsize=(max(4.0, 1.5 + 0.6 * len(layers)), 3.2))
        ax = fig.add_subplot()
        width = 0.8 / len(metrics)
        x = np.arange(len(layers))
        for i, metric in enumerate(metrics):
            heights = [self.agreement[l].get(metric) or 0.0 for l in layers]
            ax.bar(x + (i - (len(metrics) - 1) / 2) * width, heights, width, label=self.LABELS[metric])
        if self.identical_needed is not None and "different" in metrics:
            ax.axhline(1 - self.identical_needed, color="red", linestyle="--", linewidth=1, label="different allowed")
        ax.set_xticks(x, [str(l) for l in layers])
        ax.set_xlim(-1, len(layers))  # keeps a single layer's bars from filling the plot
        ax.set_xlabel("layer")
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{self.site}: set overlap per layer", fontsize=10)
        ax.legend(fontsize=8, loc="lower right")
        return fig


# ---------------------------------------------------------------- verdict banner

def mode_text(mode: str) -> str:
    if mode == "streaming":
        return "streaming (per layer, teacher-forced: each layer fed the reference's input)"
    return "end-to-end (errors accumulate through the layers)"


class VerdictBanner:
    """PASS, or FAIL naming the first divergence against its threshold; the paths and the mode."""

    def __init__(self, result):
        self.result = result
        self.widget = W.HTML(self.html)

    @property
    def passed(self) -> bool:
        return self.result.first_divergence is None

    @property
    def headline(self) -> str:
        r = self.result
        first = r.first_divergence
        if first is None:
            return f"PASS: all {len(r.sites)} sites within thresholds"
        if first.kind == "indices":
            allowed = 1 - r.thresholds.get("identical", 1.0)
            detail = f"different rows {_fmt(first.different)} > {allowed:.3g} allowed (ties {_fmt(first.tied)})"
        elif first.nan or first.inf:
            detail = f"NaN {first.nan}, Inf {first.inf}"
        else:
            detail = f"rel RMS {_fmt(first.rel_rms)} > threshold {r.thresholds.get('rel_rms')}"
        count = sum(s.diverged for s in r.sites)
        return (f"FAIL: first divergence at layer {layer_label(first.layer)}, site {first.site} ({detail}); "
                f"{count} of {len(r.sites)} sites diverge")

    @property
    def details(self) -> list[str]:
        r = self.result
        lines = [f"{r.path_a} vs {r.path_b}, {r.dtype}, {mode_text(r.mode)}"]
        if r.logprob is not None:
            lines.append(f"train/train_rollout_logprob_abs_diff = {r.logprob.value:.3e}")
        if getattr(r, "topk_replay", None):
            lines.append(f"top-k replay: {r.topk_replay}")
        lines.extend(f"warning: {w}" for w in getattr(r, "warnings", []))
        return lines

    @property
    def text(self) -> str:
        return "\n".join([self.headline, *self.details])

    @property
    def html(self) -> str:
        color = PASS_COLOR if self.passed else FAIL_COLOR
        details = "".join(f"<div style='font-size:0.8em'>{html.escape(line)}</div>" for line in self.details)
        return (f"<div style='background:{color};color:white;padding:0.6em 1em;border-radius:4px'>"
                f"<div style='font-size:1.2em;font-weight:bold'>{html.escape(self.headline)}</div>{details}</div>")

    def _repr_html_(self) -> str:
        return self.html

    def figure(self) -> Figure:
        fig = Figure(figsize=(10, 0.5 + 0.3 * len(self.details)))
        fig.patch.set_facecolor(PASS_COLOR if self.passed else FAIL_COLOR)
        ax = fig.add_subplot()
        ax.axis("off")
        ax.text(0.0, 1.0, self.headline, color="white", fontsize=12, fontweight="bold", va="top",
                transform=ax.transAxes)
        ax.text(0.0, 0.45, "\n".join(self.details), color="white", fontsize=9, va="top", transform=ax.transAxes)
        return fig
