"""The notebook views (widgets/) on real parity results: a passing train vs rollout comparison on a
synthesised tiny checkpoint, and a failing one against a checkpoint synthesised with another seed."""

from __future__ import annotations

import base64
import io
import math
import re
from pathlib import Path

import ipywidgets as W
import pytest
import torch
from matplotlib.patches import Rectangle
from matplotlib.text import Text
from PIL import Image

from glmkit.checkpoint import synth_checkpoint
from glmkit.model import load_model
from glmkit.parity.builtin import index_agreement, kda_error_vs_position, parity
from widgets import KdaErrorCurve, LogprobHistogram, SiteHeatmap, TopkOverlap, VerdictBanner, show
from widgets.parity import (FIGURE_DPI, MAX_WIDTH_PX, MIN_FONT_PT, NOT_COMPARED_COLOR, THRESHOLD_GID, WIDGET_VIEW,
                            figure_png, static_bundle)

PATHS = ("train", "rollout")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("widgets")
    return (synth_checkpoint("tiny", 0, root / "ck", progress=False),
            synth_checkpoint("tiny", 1, root / "ck-other", progress=False))


@pytest.fixture(scope="module")
def passing(checkpoints):
    result, cap_a, _ = parity(checkpoints[0], PATHS, seq_len=40, batch=2)
    assert result.verdict == "pass"
    return result, cap_a


@pytest.fixture(scope="module")
def reference_vs_train(checkpoints):
    result, _, _ = parity(checkpoints[0], ("reference", "train"), seq_len=40, batch=2)
    assert result.verdict == "pass" and result.logprob is not None
    return result


@pytest.fixture(scope="module")
def failing(checkpoints):
    result, cap_a, _ = parity(checkpoints[0], PATHS, checkpoint_b=checkpoints[1], seq_len=40, batch=2)
    assert result.verdict == "fail"
    return result, cap_a


def shown_png(output: W.Output) -> str:
    """The caption of the one PNG an Output widget holds."""
    assert len(output.outputs) == 1
    data = output.outputs[0]["data"]
    assert data["image/png"]
    return data["text/plain"]


@pytest.mark.parametrize("which", ["passing", "failing"])
def test_heatmap_grid_figure_and_outlines(which, request):
    result, cap = request.getfixturevalue(which)
    view = SiteHeatmap(result, cap.lengths)
    layers = {s.layer for s in result.sites}
    sites = {s.site for s in result.sites}
    assert view.grid().shape == (len(sites), len(layers))  # 4 layers + the "final" column
    fig = view.figure()
    heat, colorbar = fig.axes
    assert heat.images[0].get_array().shape == (len(sites), len(layers))
    outlined = [p for p in heat.patches if isinstance(p, Rectangle)]
    assert len(outlined) == sum(s.diverged for s in result.sites)
    assert [t.get_text() for t in heat.get_yticklabels()] == view.site_names
    assert [t.get_text() for t in heat.get_xticklabels()] == ["0", "1", "2", "3", "final"]
    assert len(view.buttons) == len(result.sites)


def test_heatmap_click_plots_error_per_position(failing):
    result, cap = failing
    view = SiteHeatmap(result, cap.lengths)
    assert view.output.outputs == ()
    button = view.buttons[(3, "attn_out")]
    assert "layer 3 attn_out: rel RMS" in button.tooltip
    assert button.layout.border == "2px solid red"
    button.click()
    assert shown_png(view.output).startswith("layer 3 attn_out")
    first = result.first_divergence
    assert view.buttons[(first.layer, first.site)].description == "1st"
    # index sites plot 1 - Jaccard per row, one line per sequence
    fig = view.position_figure(next(s for s in result.sites if s.site == "indexer_topk"))
    assert len(fig.axes[0].lines) == len(cap.lengths)
    view.buttons[(3, "indexer_topk")].click()
    assert "indexer_topk" in shown_png(view.output)


def test_a_site_not_compared_is_grey_in_the_widget_as_in_the_png(failing):
    """A browser check of notebook 01: the hint says "grey: not compared" but the widget left those cells
    blank (only the PNG drew them grey). Every (layer, site) of the grid without a comparison is a grey cell."""
    from widgets.parity import NOT_COMPARED_COLOR

    view = SiteHeatmap(failing[0])
    grid = view.widget.children[1].children[1:]  # the rows below the header
    empty = [cell for row in grid for cell in row.children[1:] if not isinstance(cell, W.Button)]
    assert len(empty) == len(view.site_names) * len(view.layers) - len(view.buttons) > 0
    assert all(isinstance(cell, W.HTML) and NOT_COMPARED_COLOR in cell.value for cell in empty)


def test_heatmap_colours_follow_the_error(passing, failing):
    quiet = SiteHeatmap(passing[0]).buttons[(0, "attn_out")].style.button_color
    loud = SiteHeatmap(failing[0]).buttons[(0, "attn_out")].style.button_color
    assert re.fullmatch(r"#[0-9a-f]{6}", quiet) and quiet != loud


def test_logprob_histogram(passing, failing):
    for result, _ in (passing, failing):
        view = LogprobHistogram(result, bins=20)
        hist, table = view.figure().axes
        assert len(hist.patches) == 20 and hist.get_xscale() == "log"
        assert sum(p.get_height() for p in hist.patches) == len(result.logprob.per_token)
        assert table.tables, "the worst tokens are listed"
        assert f"{result.logprob.value:.3e}" in view.widget.children[0].value
        view.bins.value = 10  # the slider redraws
        assert shown_png(view.output)
    assert failing[0].logprob.value > 0.1 > 1e-4 > passing[0].logprob.value


def test_kda_error_curve(checkpoints):
    model = load_model(checkpoints[0], torch.float32)
    curves = kda_error_vs_position(model, list(range(3, 3 + 80)))
    assert sorted(curves) == [0, 1, 2] and all(len(c) == 80 for c in curves.values())
    view = KdaErrorCurve(curves)
    ax, = view.figure().axes
    assert len(ax.lines) == 3 + 1 and ax.get_yscale() == "log"  # + the chunk boundary at 64
    assert len(view.figure(layers=[1]).axes[0].lines) == 2
    view.toggles[0].value = False
    assert view.shown_layers() == [1, 2] and shown_png(view.output)


def test_topk_overlap(passing, failing):
    for site in ("indexer_topk", "router_experts"):
        agreement = index_agreement(failing[0], site)
        view = TopkOverlap(agreement, site, identical_needed=0.99)
        ax, = view.figure().axes
        # one DSA / MoE layer in tiny: Jaccard, identical, tied and different rows
        assert len(ax.patches) == 4 * len(agreement) == 4
        assert [p.get_height() for p in ax.patches] == pytest.approx(
            [agreement[3][m] for m in ("jaccard", "identical", "tied", "different")])
        assert agreement[3]["identical"] + agreement[3]["tied"] + agreement[3]["different"] == pytest.approx(1.0)
        view.choice.value = "jaccard"
        assert len(view.figure(("jaccard",)).axes[0].patches) == 1 and shown_png(view.output)
    heights = [p.get_height() for p in TopkOverlap(index_agreement(passing[0], "indexer_topk")).figure().axes[0].patches]
    assert heights == [1.0, 1.0, 0.0, 0.0]


def test_verdict_banner(passing, failing):
    ok = VerdictBanner(passing[0])
    assert ok.text.startswith("PASS") and "train vs rollout" in ok.text and "end-to-end" in ok.text
    assert "#1b7f3b" in ok.widget.value
    bad = VerdictBanner(failing[0])
    first = failing[0].first_divergence
    assert bad.text.startswith(f"FAIL: first divergence at layer {first.layer}, site {first.site}")
    assert f"threshold {failing[0].thresholds['rel_rms']}" in bad.text
    assert "#b3261e" in bad.widget.value and first.site in bad.widget.value


def test_logprob_diffs_are_labelled_with_what_they_compare(passing, reference_vs_train):
    """Only train vs rollout is the recipe's train/train_rollout_logprob_abs_diff; a reference-vs-train
    number says reference and train, in the banner, the histogram's summary and its figure."""
    recipe = "train/train_rollout_logprob_abs_diff"
    ref = VerdictBanner(reference_vs_train)
    line = next(l for l in ref.details if "logp" in l)
    assert line.startswith("mean |logp_reference - logp_train| = ") and recipe not in ref.text + ref.html
    assert f"{reference_vs_train.logprob.value:.3e}" in line
    hist = LogprobHistogram(reference_vs_train)
    assert recipe not in hist.summary_html() and "logp_reference - logp_train" in hist.summary_html()
    legend = hist.figure().axes[0].get_legend().get_texts()[0].get_text()
    assert "logp_reference - logp_train" in legend and recipe not in legend
    ok = VerdictBanner(passing[0])
    line = next(l for l in ok.details if "logp" in l)
    assert line.startswith(f"mean |logp_train - logp_rollout| (the recipe's {recipe}) = ")
    assert recipe in LogprobHistogram(passing[0]).summary_html()


def test_show_displays_one_output_with_the_widget_and_its_static_rendering(passing, monkeypatch):
    """One display per view: a mimebundle whose widget view a live frontend draws (its renderer outranks
    image/png and text/html) and whose PNG / HTML a headless run and its report keep."""
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda *objs, **kw: shown.append((objs, kw)))
    banner = VerdictBanner(passing[0])
    handle = show(banner)
    (bundle,), kw = shown[0]
    assert len(shown) == 1 and kw["raw"] and kw["display_id"] == handle.display_id
    assert bundle[WIDGET_VIEW]["model_id"] == banner.widget.model_id
    assert bundle["text/html"] == banner.html and "image/png" not in bundle   # a banner is text: HTML
    assert bundle["text/plain"].startswith("PASS")
    heatmap = SiteHeatmap(passing[0])
    show(heatmap)
    (bundle,), _ = shown[1]
    assert base64.b64decode(bundle["image/png"])[:8] == b"\x89PNG\r\n\x1a\n" and "text/html" not in bundle
    assert bundle[WIDGET_VIEW]["model_id"] == heatmap.widget.model_id
    handle.refresh()   # replaces the same output
    (bundle,), kw = shown[2]
    assert kw["update"] and kw["display_id"] == handle.display_id and bundle["text/html"] == banner.html


def heatmap_legend(fig) -> list[str]:
    return [t.get_text() for legend in fig.legends for t in legend.get_texts()]


def test_heatmap_colour_bar_marks_the_thresholds_and_grey_has_a_legend(failing):
    result, cap = failing
    view = SiteHeatmap(result, cap.lengths)
    fig = view.figure()
    heat, colorbar = fig.axes
    marks = sorted(line.get_ydata()[0] for line in colorbar.lines if line.get_gid() == THRESHOLD_GID)
    allowed = 1 - result.thresholds["identical"]
    assert marks == pytest.approx(sorted([math.log10(result.thresholds["rel_rms"]), math.log10(allowed)]))
    labels = heatmap_legend(fig)
    assert any(l.startswith("not compared") for l in labels)
    assert f"value sites: rel RMS threshold {result.thresholds['rel_rms']:g} (colour bar)" in labels
    assert f"index sites: {allowed:.3g} of rows different allowed (colour bar)" in labels
    grey = next(h for h in fig.legends[0].legend_handles if h.get_label().startswith("not compared"))
    assert grey.get_facecolor()[:3] == pytest.approx(heat.images[0].get_cmap().get_bad()[:3])
    assert heat.images[0].get_cmap().get_bad()[:3] == pytest.approx(tuple(int(NOT_COMPARED_COLOR[i:i + 2], 16) / 255
                                                                         for i in (1, 3, 5)))
    assert math.isnan(view.grid()[view.site_names.index("indexer_topk"), view.layers.index(0)])  # a grey cell


def readable(fig):
    """Every text of a figure at least MIN_FONT_PT and its PNG at most MAX_WIDTH_PX wide, so shown
    unscaled in an output area or a report column its letters are >= 12 px (about 9 pt)."""
    png = figure_png(fig)
    width, _ = Image.open(io.BytesIO(png)).size
    assert width <= MAX_WIDTH_PX, width
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    assert len(texts) > 5
    small = [(t.get_text(), t.get_fontsize()) for t in texts if t.get_fontsize() < MIN_FONT_PT]
    assert small == []
    assert MIN_FONT_PT * FIGURE_DPI / 72 >= 12


def test_figures_are_readable_at_their_rendered_size(passing, failing, checkpoints):
    result, cap = failing
    heatmap = SiteHeatmap(result, cap.lengths)
    readable(heatmap.figure())
    readable(heatmap.position_figure(result.sites[3]))
    readable(LogprobHistogram(result).figure())
    readable(TopkOverlap(index_agreement(result, "indexer_topk"), "indexer_topk", 0.99).figure())
    model = load_model(checkpoints[0], torch.float32)
    readable(KdaErrorCurve(kda_error_vs_position(model, list(range(3, 3 + 80)))).figure())
    assert set(static_bundle(VerdictBanner(passing[0]))) == {"text/html", "text/plain"}


def test_glmkit_never_imports_widgets():
    root = Path(__file__).resolve().parents[1] / "glmkit"
    offenders = [str(p) for p in root.rglob("*.py")
                 if re.search(r"^\s*(from|import)\s+widgets\b", p.read_text(), re.MULTILINE)]
    assert offenders == []


def test_the_widget_heatmap_has_a_colour_key_and_the_worst_tokens_are_listed_once(failing):
    """Issue 36 (2): the clickable grid had no colour key (the PNG has its colour bar); the worst-token
    table showed twice in a live notebook (HTML summary and figure); `show(view)` as a cell's last line
    added a `<Shown ...>` text output."""
    from IPython.core.interactiveshell import InteractiveShell

    from widgets.parity import Shown

    result, cap = failing
    view = SiteHeatmap(result, cap.lengths)
    key = view.colour_key_html()
    assert "linear-gradient(to right," in key and "log10 error" in key
    assert key.count("border-left:2px solid red") == 1  # the rel RMS threshold marked on the scale
    assert any(isinstance(w, W.HTML) and "glmkit-colour-key" in w.value for w in view.widget.children)
    hist = LogprobHistogram(result)
    assert "<table" not in hist.summary_html() and "listed beside the histogram" in hist.summary_html()
    assert hist.figure().axes[1].tables  # the one table: in the figure
    shell = InteractiveShell.instance()
    formatted, _ = shell.display_formatter.format(object.__new__(Shown))
    assert hasattr(Shown, "_ipython_display_") and "text/plain" not in (formatted or {})
