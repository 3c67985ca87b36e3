"""The notebook views (widgets/) on real parity results: a passing train vs rollout comparison on a
synthesised tiny checkpoint, and a failing one against a checkpoint synthesised with another seed."""

from __future__ import annotations

import re
from pathlib import Path

import ipywidgets as W
import pytest
import torch
from matplotlib.patches import Rectangle

from glmkit.checkpoint import synth_checkpoint
from glmkit.model import load_model
from glmkit.parity.builtin import index_agreement, kda_error_vs_position, parity
from widgets import KdaErrorCurve, LogprobHistogram, SiteHeatmap, TopkOverlap, VerdictBanner, show

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
    assert len(bad.figure().axes) == 1


def test_show_displays_picture_then_widget(passing, monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj: shown.append(obj))
    view = VerdictBanner(passing[0])
    show(view)
    assert isinstance(shown[0], IPython.display.Image) and shown[0].data[:8] == b"\x89PNG\r\n\x1a\n"
    assert shown[1] is view.widget


def test_glmkit_never_imports_widgets():
    root = Path(__file__).resolve().parents[1] / "glmkit"
    offenders = [str(p) for p in root.rglob("*.py")
                 if re.search(r"^\s*(from|import)\s+widgets\b", p.read_text(), re.MULTILINE)]
    assert offenders == []
