"""ipywidgets views over a `glmkit.parity.compare.ParityResult`.

Every view has `.widget` (interactive, for a live notebook) and a static rendering: `.figure()` (a
matplotlib Figure) for the plots, `.html` for the banner and the tables. `show(view)` displays the two
as ONE output whose mimebundle holds the widget view and the static rendering beside it: a live
frontend (JupyterLab, Notebook 7, VS Code) draws the widget (its renderer outranks every static
type), and a headless run keeps the PNG / HTML, which is what `glmkit report` exports (it drops the
widget views and the notebook's widget state, so the report loads no code).

Figures are built with `matplotlib.figure.Figure`, not pyplot, so the inline backend never shows
them a second time and they are freed with the view. They are drawn at most `MAX_WIDTH_PX` wide
with text of at least `MIN_FONT_PT`, so a report column or an output area shows them unscaled and
readable.
"""

from __future__ import annotations

import base64
import html
import io
import math
import uuid

import ipywidgets as W
import numpy as np
from matplotlib import colormaps
from matplotlib.colors import Normalize, to_hex
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from glmkit.model.sites import FINAL, PER_LAYER
from glmkit.report import divergence_text, short_number

FLOOR = 1e-10   # log scales start here; an exact match (error 0) is drawn at the floor
KDA_CHUNK = 64  # the torch KDA kernel's chunk size: errors can step at these boundaries
PASS_COLOR, FAIL_COLOR = "#1b7f3b", "#b3261e"
NOT_COMPARED_COLOR = "#dddddd"
THRESHOLD_GID = "threshold"


# ---------------------------------------------------------------- shared helpers

FIGURE_DPI = 100
MAX_WIDTH_PX = 1000   # an output area / report column shows a PNG this wide at its own size
MAX_WIDTH_IN = MAX_WIDTH_PX / FIGURE_DPI
MIN_FONT_PT = 9       # at FIGURE_DPI and unscaled: 12.5 px, about 9.4 pt on a 96 dpi screen
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def figure_png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=FIGURE_DPI, bbox_inches="tight")
    return buf.getvalue()


def png_output(fig: Figure, caption: str) -> dict:
    """A display_data message for an Output widget's `outputs`. Set directly rather than through
    `with output:`, which only captures inside a running kernel (tests and scripts have none)."""
    return {"output_type": "display_data", "metadata": {},
            "data": {"image/png": base64.b64encode(figure_png(fig)).decode(), "text/plain": caption}}


def show_in(output: W.Output, fig: Figure, caption: str = ""):
    output.outputs = (png_output(fig, caption or "figure"),)


def static_bundle(view) -> dict:
    """The view's static rendering as a mimebundle: its HTML when it is a banner or a table (`.html`),
    else its figure as a PNG; text/plain holds its one-line summary."""
    text = getattr(view, "text", None) or type(view).__name__
    if isinstance(getattr(view, "html", None), str):
        return {"text/html": view.html, "text/plain": text}
    return {"image/png": base64.b64encode(figure_png(view.figure())).decode(), "text/plain": text}


def mimebundle(view) -> dict:
    """One output for a view: the widget view (what a live frontend draws) and the static rendering
    (what a frontend without the widget, nbconvert and the report show)."""
    bundle = static_bundle(view)
    bundle[WIDGET_VIEW] = view.widget._repr_mimebundle_()[WIDGET_VIEW]
    return bundle


class Shown:
    """What `show` displayed: `refresh()` replaces that same output with the view's current state,
    e.g. after a live run, so the static rendering a report keeps is the final one."""

    def __init__(self, view):
        self.view = view
        self.display_id = uuid.uuid4().hex
        self._display(update=False)

    def _display(self, update: bool):
        from IPython.display import display

        kwargs = {"update": True} if update else {}
        display(mimebundle(self.view), raw=True, display_id=self.display_id, **kwargs)

    def refresh(self):
        self._display(update=True)

    def _ipython_display_(self):
        """Shown already: a cell ending in `show(view)` adds no `<Shown ...>` text to the notebook or report."""


def show(view) -> Shown:
    """Display a view once: the widget in a live notebook, its static figure (or HTML table) in a
    headless run and its report. -> a handle whose `refresh()` redraws the output in place."""
    return Shown(view)


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


def describe_site(s) -> str:
    if s.kind == "indices":
        return (f"layer {layer_label(s.layer)} {s.site}: identical rows {short_number(s.identical)}, "
                f"tied {short_number(s.tied)}, different {short_number(s.different)}, "
                f"mean Jaccard {short_number(s.jaccard)}")
    text = (f"layer {layer_label(s.layer)} {s.site}: rel RMS {short_number(s.rel_rms)}, "
            f"max |diff| {short_number(s.max_abs)}")
    if s.nan or s.inf:
        text += f", NaN {s.nan}, Inf {s.inf}"
    return text


def logprob_label(result) -> str:
    """What a result's log-prob diff compares: "mean |logp_train - logp_rollout| (the recipe's
    train/train_rollout_logprob_abs_diff)" for train vs rollout; for any other pair only the pair, so a
    reference-vs-train number is never taken for the recipe's metric."""
    a, b = result.path_a, result.path_b
    label = f"mean |logp_{a} - logp_{b}|"
    if {a, b} == {"train", "rollout"}:
        label += " (the recipe's train/train_rollout_logprob_abs_diff)"
    return label


def _message_figure(text: str) -> Figure:
    fig = Figure(figsize=(6, 1.2))
    ax = fig.add_subplot()
    ax.axis("off")
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=11)
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
        self.cmap = colormaps[cmap].with_extremes(bad=NOT_COMPARED_COLOR)
        self.output = W.Output()
        self.buttons = {}
        self.widget = self._build()

    def grid(self) -> np.ndarray:
        """[site, layer] log10 errors, NaN where a layer has no such site."""
        out = np.full((len(self.site_names), len(self.layers)), np.nan)
        for (layer, site), s in self.cells.items():
            out[self.site_names.index(site), self.layers.index(layer)] = log_error(site_error(s))
        return out

    def thresholds(self) -> list[tuple[float, str, str]]:
        """(log10 value, label, line style) of each threshold on the colour scale: the value sites'
        rel RMS, and the index sites' fraction of different rows allowed (when the grid has index sites)."""
        marks = []
        limits = self.result.thresholds
        if limits.get("rel_rms"):
            marks.append((log_error(limits["rel_rms"]), f"value sites: rel RMS threshold {limits['rel_rms']:g}", "-"))
        if "identical" in limits and any(s.kind == "indices" for s in self.result.sites):
            allowed = 1 - limits["identical"]
            marks.append((log_error(allowed), f"index sites: {allowed:.3g} of rows different allowed", "--"))
        return marks

    def figure(self) -> Figure:
        grid = self.grid()
        many = len(self.layers) > 24
        width = min(MAX_WIDTH_IN, max(6.5, 3.2 + 0.45 * len(self.layers)))
        fig = Figure(figsize=(width, 2.6 + 0.34 * len(self.site_names)), layout="constrained")
        ax = fig.add_subplot()
        image = ax.imshow(np.ma.masked_invalid(grid), cmap=self.cmap, norm=self.norm, aspect="auto")
        ax.set_xticks(range(len(self.layers)), [layer_label(l) for l in self.layers], rotation=90 if many else 0)
        ax.set_yticks(range(len(self.site_names)), self.site_names)
        ax.tick_params(labelsize=MIN_FONT_PT)
        ax.set_xlabel("layer", fontsize=10)
        for (layer, site), s in self.cells.items():
            if s.diverged:
                x, y = self.layers.index(layer), self.site_names.index(site)
                ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, edgecolor="red", linewidth=2.5))
        first = self.result.first_divergence
        if first is not None:
            ax.text(self.layers.index(first.layer), self.site_names.index(first.site), "1st", ha="center",
                    va="center", color="red", fontsize=MIN_FONT_PT, fontweight="bold")
        ax.set_title(f"{self.result.path_a} vs {self.result.path_b}: log10 error per site\n"
                     f"(index sites: fraction of rows different other than by ties)", fontsize=11)
        colorbar = fig.colorbar(image, ax=ax)
        colorbar.set_label("log10 error", fontsize=10)
        colorbar.ax.tick_params(labelsize=MIN_FONT_PT)
        handles = [Patch(facecolor=NOT_COMPARED_COLOR, edgecolor="#999999",
                         label="not compared (no such site at this layer)"),
                   Patch(fill=False, edgecolor="red", linewidth=2.5, label="over its threshold"),
                   Line2D([], [], linestyle="none", marker="$1st$", markersize=16, color="red",
                          label="first divergence")]
        for value, label, style in self.thresholds():
            colorbar.ax.axhline(value, color="red", linestyle=style, linewidth=2, gid=THRESHOLD_GID)
            handles.append(Line2D([], [], color="red", linestyle=style, linewidth=2, label=f"{label} (colour bar)"))
        fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=MIN_FONT_PT, frameon=False)
        return fig

    def _cell_button(self, layer, site) -> W.Widget:
        s = self.cells.get((layer, site))
        size = W.Layout(width="30px", height="22px", padding="0", margin="1px")
        if s is None:  # grey, as in the PNG and as the hint says
            return W.HTML(f"<div class='glmkit-not-compared' title='not compared (no such site at this layer)' "
                          f"style='width:26px;height:18px;background:{NOT_COMPARED_COLOR};border:1px solid #999999'>"
                          f"</div>", layout=size)
        value = log_error(site_error(s))
        color = to_hex(self.cmap(self.norm(value))) if math.isfinite(value) else NOT_COMPARED_COLOR
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
                      "Red border: over threshold; 1st: the first divergence; grey: not compared (no such site at "
                      "this layer).</i>")
        return W.VBox([hint, W.VBox(rows), W.HTML(self.colour_key_html()), self.output])

    def colour_key_html(self, steps: int = 24) -> str:
        """The widget grid's colour key: the colour scale from the floor to the top of the grid's errors
        (log10), its ends and integer decades labelled, the thresholds marked (the PNG's colour bar)."""
        lo, hi = self.norm.vmin, self.norm.vmax
        stops = ", ".join(f"{to_hex(self.cmap(i / (steps - 1)))} {100 * i / (steps - 1):.1f}%" for i in range(steps))
        marks = "".join(
            f"<div title='{html.escape(label)}' style='position:absolute;left:{100 * (v - lo) / (hi - lo):.1f}%;"
            f"top:-3px;height:20px;border-left:2px {'solid' if style == '-' else 'dashed'} red'></div>"
            for v, label, style in self.thresholds() if math.isfinite(v) and lo <= v <= hi)
        ticks = "".join(f"<span style='position:absolute;left:{100 * (d - lo) / (hi - lo):.1f}%;"
                        f"transform:translateX(-50%)'>{d}</span>" for d in range(math.ceil(lo), math.floor(hi) + 1))
        return (f"<div class='glmkit-colour-key' style='font-size:11px;margin:6px 0 18px 150px;width:300px'>"
                f"log10 error (red: thresholds)<div style='position:relative;height:14px;margin-top:2px;"
                f"background:linear-gradient(to right, {stops})'>{marks}</div>"
                f"<div style='position:relative;height:12px'>{ticks}</div></div>")

    def position_figure(self, s) -> Figure:
        """One site's per-row error against token position (one line per sequence when lengths are known)."""
        fig = Figure(figsize=(8, 3.4), layout="constrained")
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
            ax.set_xlabel("position in sequence", fontsize=10)
        else:
            ax.plot(per_row, linewidth=1)
            ax.set_xlabel("token row (packed)", fontsize=10)
        ax.set_ylabel("rel error of row" if s.kind == "values" else "1 - Jaccard of row", fontsize=10)
        ax.tick_params(labelsize=MIN_FONT_PT)
        ax.set_title(describe_site(s), fontsize=10, wrap=True)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=MIN_FONT_PT)
        return fig

    def select(self, s):
        show_in(self.output, self.position_figure(s), describe_site(s))


# ---------------------------------------------------------------- log-prob histogram

class LogprobHistogram:
    """Per-token |logp_a - logp_b| on a log axis, their mean over samples of each sample's mean marked
    (for train vs rollout, the recipe's train/train_rollout_logprob_abs_diff: `logprob_label`), and
    the worst tokens listed."""

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
        # the worst tokens are listed once, in the figure beside the histogram
        return (f"<b>{html.escape(logprob_label(self.result))} = {self.diff.value:.3e}</b> "
                f"({html.escape(self.result.path_a)} vs {html.escape(self.result.path_b)}, "
                f"{len(self.diff.per_token)} tokens; the worst {min(self.worst, len(self.diff.worst))} "
                f"are listed beside the histogram)")

    @property
    def text(self) -> str:
        if self.diff is None:
            return "no log-probs in these captures"
        return f"{logprob_label(self.result)} = {self.diff.value:.3e} over {len(self.diff.per_token)} tokens"

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
        a, b = self.result.path_a, self.result.path_b
        fig = Figure(figsize=(MAX_WIDTH_IN - 0.6, 4.2), layout="constrained")   # the table overhangs a little
        hist, table = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})
        hist.hist(clipped, bins=np.logspace(math.log10(low), math.log10(high * 1.001), bins + 1))
        hist.set_xscale("log")
        hist.axvline(max(self.diff.value, FLOOR), color="red", linestyle="--",
                     label=f"{logprob_label(self.result)}\n= {self.diff.value:.2e}")
        zeros = f"\n({exact} exactly 0, drawn at {FLOOR:g})" if exact else ""
        hist.set_xlabel(f"|logp_{a} - logp_{b}| per token{zeros}", fontsize=10)
        hist.set_ylabel("tokens", fontsize=10)
        hist.tick_params(which="both", labelsize=MIN_FONT_PT)
        hist.tick_params(axis="x", which="both", labelrotation=40)   # 3x10^-1 labels would overlap
        hist.set_title(f"{a} vs {b}: {len(values)} response tokens", fontsize=11)
        hist.legend(fontsize=MIN_FONT_PT, loc="upper center", bbox_to_anchor=(0.5, -0.3), frameon=False)
        table.axis("off")
        rows = [[w["sequence"], w["position"], f"{w['a']:.5g}", f"{w['b']:.5g}", f"{w['abs_diff']:.2e}"]
                for w in self.diff.worst[:self.worst]]
        if rows:
            t = table.table(cellText=rows, colLabels=["seq", "pos", f"logp {a}", f"logp {b}", "|diff|"], loc="center")
            t.auto_set_font_size(False)
            t.set_fontsize(MIN_FONT_PT)
            t.auto_set_column_width(range(5))
            t.scale(1, 1.3)
        table.set_title("worst tokens", fontsize=11)
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

    @property
    def text(self) -> str:
        worst = ", ".join(f"layer {layer} {max(curve):.2e}" for layer, curve in self.curves.items() if len(curve))
        return f"KDA chunked vs recurrent, max rel error: {worst or 'no KDA layers'}"

    def figure(self, layers=None) -> Figure:
        if not self.curves:
            return _message_figure("no KDA layers")
        layers = list(self.curves) if layers is None else layers
        fig = Figure(figsize=(8.5, 3.8), layout="constrained")
        ax = fig.add_subplot()
        length = max(len(v) for v in self.curves.values())
        for boundary in range(self.chunk, length, self.chunk):
            ax.axvline(boundary, color="grey", linestyle=":", linewidth=0.8)
        for layer in layers:
            ax.plot(np.maximum(np.asarray(self.curves[layer], dtype=float), FLOOR), linewidth=1,
                    label=f"layer {layer}")
        ax.set_yscale("log")
        ax.set_xlabel(f"position (dotted: chunk boundaries every {self.chunk})", fontsize=10)
        ax.set_ylabel("rel error, chunked vs recurrent", fontsize=10)
        ax.tick_params(labelsize=MIN_FONT_PT)
        ax.set_title("KDA: chunked (train / prefill) vs recurrent (decode) per position", fontsize=11)
        if layers:
            fig.legend(fontsize=MIN_FONT_PT, loc="outside right upper")
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

    @property
    def text(self) -> str:
        return f"{self.site}: set overlap per layer, " + ", ".join(
            f"layer {layer} different {short_number(v.get('different'))}" for layer, v in self.agreement.items())

    def figure(self, metrics=METRICS) -> Figure:
        if not self.agreement:
            return _message_figure(f"no layers with {self.site}")
        layers = list(self.agreement)
        fig = Figure(figsize=(min(MAX_WIDTH_IN, max(6.5, 4.0 + 0.6 * len(layers))), 3.4), layout="constrained")
        ax = fig.add_subplot()
        width = 0.8 / len(metrics)
        x = np.arange(len(layers))
        for i, metric in enumerate(metrics):
            heights = [self.agreement[l].get(metric) or 0.0 for l in layers]
            ax.bar(x + (i - (len(metrics) - 1) / 2) * width, heights, width, label=self.LABELS[metric])
        if self.identical_needed is not None and "different" in metrics:
            ax.axhline(1 - self.identical_needed, color="red", linestyle="--", linewidth=1, label="different allowed")
        ax.set_xticks(x, [str(l) for l in layers], rotation=90 if len(layers) > 24 else 0)
        ax.set_xlim(-1, len(layers))  # keeps a single layer's bars from filling the plot
        ax.set_xlabel("layer", fontsize=10)
        ax.set_ylabel("fraction of rows", fontsize=10)
        ax.tick_params(labelsize=MIN_FONT_PT)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{self.site}: set overlap per layer", fontsize=11)
        fig.legend(fontsize=MIN_FONT_PT, loc="outside right upper")
        return fig


# ---------------------------------------------------------------- verdict banner

def mode_text(mode: str) -> str:
    if mode == "streaming":
        return "streaming (per layer, teacher-forced: each layer fed the reference's input)"
    return "end-to-end (errors accumulate through the layers)"


def banner_html(passed: bool, headline: str, details) -> str:
    """A PASS / FAIL banner: the headline large, each detail line under it (all text escaped)."""
    color = PASS_COLOR if passed else FAIL_COLOR
    lines = "".join(f"<div style='font-size:0.9em'>{html.escape(line)}</div>" for line in details)
    return (f"<div style='background:{color};color:white;padding:0.6em 1em;border-radius:4px'>"
            f"<div style='font-size:1.2em;font-weight:bold'>{html.escape(headline)}</div>{lines}</div>")


class VerdictBanner:
    """PASS, or FAIL naming the first divergence against its threshold; the paths and the mode."""

    def __init__(self, result):
        self.result = result
        self.widget = W.HTML(self.html)

    @property
    def passed(self) -> bool:
        gradients = [getattr(self.result, k, None) for k in ("gradients", "parameter_gradients")]
        return self.result.first_divergence is None and all(g.first_divergence is None for g in gradients if g)

    @property
    def headline(self) -> str:
        r = self.result
        first = r.first_divergence
        if first is None:
            return f"PASS: all {len(r.sites)} sites within thresholds"
        count = sum(s.diverged for s in r.sites)
        return (f"FAIL: first divergence at {divergence_text(first.public(), r.thresholds)}; "
                f"{count} of {len(r.sites)} sites diverge")

    @property
    def details(self) -> list[str]:
        r = self.result
        lines = [f"{r.path_a} vs {r.path_b}, {r.dtype}, {mode_text(r.mode)}"]
        if r.logprob is not None:
            lines.append(f"{logprob_label(r)} = {r.logprob.value:.3e}")
        if getattr(r, "topk_replay", None):
            lines.append(f"top-k replay: {r.topk_replay}")
        if getattr(r, "departure", None) is not None:
            lines.append(f"which side departs: {r.departure.text}")
        for label, g in (("activation gradients", getattr(r, "gradients", None)),
                         ("parameter gradients", getattr(r, "parameter_gradients", None))):
            if g is not None:
                f = g.first_divergence
                lines.append(f"{label}: " + ("pass" if f is None else
                                             f"FAIL, first divergence in the backward order at layer {f.layer} "
                                             f"{f.site}") + f" ({len(g.sites)} compared)")
        lines.extend(f"warning: {w}" for w in getattr(r, "warnings", []))
        return lines

    @property
    def text(self) -> str:
        return "\n".join([self.headline, *self.details])

    @property
    def html(self) -> str:
        return banner_html(self.passed, self.headline, self.details)

    def _repr_html_(self) -> str:
        return self.html
