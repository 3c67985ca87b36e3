"""`glmkit report` writes a page that loads nothing: no require.js / MathJax / widget manager from a
CDN, no widget state, no scripts; each view shown once (its widget in a live notebook, its static
figure or table in the report). Run as a user runs it: `python -m glmkit report` in a subprocess, on
small notebooks that use the real views (no model needed)."""

from __future__ import annotations

import http.server
import os
import re
import shutil
import subprocess
import sys
import threading
from html.parser import HTMLParser
from pathlib import Path

import nbformat
import pytest

from glmkit.notebook import external_resources, parity_reasons, verdict_reasons
from glmkit.rl.health import UNDECIDED

ROOT = Path(__file__).resolve().parents[1]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
INLINE_PNG = re.compile(r'<img[^>]+src="data:image/png;base64,([^"]+)"')
# what a page must not contain to open offline (the list)
EXTERNAL_SCRIPT = re.compile(r"<script\b[^>]*\bsrc\s*=\s*[\"']?(?:https?:)?//", re.IGNORECASE)
EXTERNAL_LINK = re.compile(r"<link\b[^>]*\bhref\s*=\s*[\"']?(?:https?:)?//", re.IGNORECASE)
CDN_WORDS = ("require.js", "require.min.js", "requirejs", "mathjax", "cdnjs", "unpkg", "jsdelivr",
             "@jupyter-widgets/html-manager", "embed-amd")

VIEWS = """\
import ipywidgets as W
from IPython.display import display
from glmkit.rl.health import run_verdict
from widgets import HealthTable, LiveMetrics, show

rows = []
for r in range(rollouts):
    rows += [{"train/step": 2 * r + k, "train/grad_norm": 0.4, "train/step_skipped": False,
              "train/train_rollout_logprob_abs_diff": 1e-6} for k in range(2)]
    rows.append({"rollout/step": r, "rollout/raw_reward": 0.1 * r})
view = LiveMetrics(variant="tiny")
shown = show(view)          # the live view, as notebooks 02 and 03 do
view.extend(rows)
shown.refresh()             # final
show(HealthTable(run_verdict(rows, "tiny")["health"]))
display(W.IntSlider(description="bare"))   # a widget with no static form
"""


def views_cell(executed):
    return next(c for c in executed.cells if c.cell_type == "code" and "shown = show(view)" in c.source)


def view_outputs(executed) -> list:
    """The views cell's display outputs. A fresh machine may add a stderr stream beside them (a library
    warming a cache, a deprecation warning); that is allowed, an error output is not."""
    outputs = views_cell(executed).outputs
    others = [o for o in outputs if o["output_type"] != "display_data"]
    assert all(o["output_type"] == "stream" for o in others), others
    return [o for o in outputs if o["output_type"] == "display_data"]


def notebook(path: Path, *cells: str, markdown: str = "# Views\n\nMath stays TeX: $x^2$.") -> Path:
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("out_dir = None\nrollouts = 4", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_markdown_cell(markdown),
        *(nbformat.v4.new_code_cell(c) for c in cells)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))
    return path


def glmkit_report(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "glmkit", "report", *map(str, args)], capture_output=True,
                          text=True, timeout=600, cwd=ROOT)


def assert_offline(text: str):
    """The issue's checks on a written report."""
    assert EXTERNAL_SCRIPT.findall(text) == [] and EXTERNAL_LINK.findall(text) == []
    lowered = text.lower()
    assert [w for w in CDN_WORDS if w in lowered] == []
    assert "<script" not in lowered                           # no code at all, inline or loaded
    assert WIDGET_VIEW not in text and WIDGET_STATE not in text
    assert external_resources(text) == []


@pytest.fixture(scope="module")
def views_report(tmp_path_factory):
    root = tmp_path_factory.mktemp("offline")
    out = root / "report"
    done = glmkit_report(notebook(root / "views.ipynb", VIEWS), "--out", out)
    assert done.returncode == 0, done.stderr
    return out, done


def test_report_loads_no_code(views_report):
    out, done = views_report
    assert "verdict: unknown" in done.stdout
    text = (out / "views.html").read_text()
    assert_offline(text)
    assert "$x^2$" in text                                     # markdown math left as its source
    assert 'id="glmkit-report-header"' in text


def test_each_view_is_in_the_report_once_as_its_static_rendering(views_report):
    out, _ = views_report
    text = (out / "views.html").read_text()
    pngs = INLINE_PNG.findall(text)
    assert len(pngs) == 1                                      # the metrics figure, once
    executed = nbformat.read(str(out / "views.ipynb"), as_version=4)
    metrics, table, bare = view_outputs(executed)
    assert pngs[0] == metrics["data"]["image/png"]             # the refreshed (final) figure
    assert "(4 rollouts)" in metrics["data"]["text/plain"]
    assert text.count("recipe health table:") == 1             # the health table, once, as a table
    assert len(re.findall(r"<tr class=[\"']verdict-", text)) == 4 and "<code>train/grad_norm</code>" in text
    assert "IntSlider(value=0" not in text                    # a bare widget leaves nothing behind


def test_executed_notebook_keeps_one_output_per_view_for_a_live_frontend(views_report):
    """What JupyterLab draws: each view is ONE output holding the widget view (whose renderer outranks
    image/png and text/html) with its model in the notebook's widget state, the static form beside it."""
    out, _ = views_report
    executed = nbformat.read(str(out / "views.ipynb"), as_version=4)
    state = executed.metadata["widgets"][WIDGET_STATE]["state"]
    metrics, table, bare = view_outputs(executed)
    assert set(metrics["data"]) == {WIDGET_VIEW, "image/png", "text/plain"}
    assert set(table["data"]) == {WIDGET_VIEW, "text/html", "text/plain"}
    for output in (metrics, table, bare):
        assert output["data"][WIDGET_VIEW]["model_id"] in state


# Known ways an HTML output makes a page fetch, navigate or run something (issue 33's list)
BYPASSES = [
    '<script src="https://cdn.example.org/chart.js"></script>',
    '<img src="http://evil.example/x.png">',
    '<img src=x onerror="fetch(\'https://evil.example\')">',
    '<meta http-equiv="refresh" content="0; url=https://evil.example/">',
    '<img srcset="https://evil.example/a.png 1x" src="data:image/png;base64,iVBORw0KGgo=">',
    '<video src="https://evil.example/v.mp4" poster="https://evil.example/p.png"></video>',
    '<audio><source src="https://evil.example/a.mp3"></audio>',
    '<iframe src="https://evil.example"></iframe>',
    '<object data="https://evil.example/o.swf"></object>',
    '<embed src="https://evil.example/e.swf">',
    '<base href="https://evil.example/">',
    '<link rel="stylesheet" href="https://evil.example/s.css">',
    '<style>body { background: url(https://evil.example/bg.png) }</style>',
    '<div style="background-image: url(https://evil.example/bg.png)">styled</div>',
    '<svg><use href="https://evil.example/sprite.svg#a"></use></svg>',
    '<svg><image xlink:href="https://evil.example/i.png"></image></svg>',
    '<a href="javascript:alert(1)">js link</a>',
    '<form action="https://evil.example/post"><input name="q"><button formaction="https://evil.example">go</button></form>',
    '<table background="https://evil.example/t.png"><tr><td>cell</td></tr></table>',
    '<body onload="fetch(\'https://evil.example\')">',
    '<math><a xlink:href="https://evil.example">m</a></math>',
    '<img src="//evil.example/protocol-relative.png">',
    '<a href="https://example.org/docs" target="_blank">a docs link</a>',
    # hostile pass 12: an allowed property holding a url() (escaped too) made the last guard refuse the page
    '<div style="background-color: url(https://evil.example/c.png); color: red">coloured</div>',
    '<span style="color: u\\72l(https://evil.example/e.png)">escaped</span>',
]
URL_ATTRIBUTES = {"src", "srcset", "href", "xlink:href", "action", "formaction", "poster", "background", "data",
                  "ping"}
FORBIDDEN_TAGS = {"meta", "iframe", "object", "embed", "video", "audio", "source", "form", "svg", "base", "script",
                  "link", "frame", "use", "image"}


class _Fetching(HTMLParser):
    """Elements and attributes as a browser reads them (escaped code is text, not markup)."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.found, self.in_style = [], False

    def handle_starttag(self, tag, attrs):
        if tag == "meta":  # the template's charset and viewport, and the CSP; never a refresh
            equiv = dict(attrs).get("http-equiv")
            if equiv is not None and equiv != "Content-Security-Policy":
                self.found.append(f"<meta http-equiv={equiv}>")
            return
        if tag in FORBIDDEN_TAGS:
            self.found.append(f"<{tag}>")
        for name, value in attrs:
            value = (value or "").strip()
            if name.startswith("on"):
                self.found.append(f"{tag} {name}")
            elif name in URL_ATTRIBUTES:
                if name == "src" and tag == "img" and value.startswith("data:image/"):
                    continue
                if name == "href" and tag == "a" and value.startswith(("https://", "http://", "#")):
                    continue
                if name == "href" and tag == "link" and value.startswith("data:"):
                    continue
                self.found.append(f"{tag} {name}={value[:60]}")
            elif name == "style" and re.search(r"url\(\s*[\"']?(?!data:)", value, re.IGNORECASE):
                self.found.append(f"{tag} style={value[:60]}")
        self.in_style = tag == "style"

    def handle_endtag(self, tag):
        self.in_style = False if tag == "style" else self.in_style

    def handle_data(self, data):
        if self.in_style and re.search(r"url\(\s*[\"']?(?!data:)|@import", data, re.IGNORECASE):
            self.found.append("css fetch in <style>")


def fetching(page: str) -> list[str]:
    """What in a sealed page could fetch or navigate by itself: any URL attribute other than an inline
    image or a link a reader clicks, event handlers, a refresh, CSS urls, frames, forms and media."""
    reader = _Fetching()
    reader.feed(page)
    reader.close()
    return reader.found


@pytest.fixture(scope="module")
def hostile_report(tmp_path_factory) -> Path:
    """A report of a notebook that displays every bypass as an HTML output (and writes some into its
    markdown cells)."""
    root = tmp_path_factory.mktemp("hostile")
    cells = ["from IPython.display import HTML, Markdown, display"]
    cells += [f"display(HTML({b!r} + '<p>after {i}</p>'))" for i, b in enumerate(BYPASSES)]
    cells.append("display(Markdown('![tracker](https://evil.example/m.png) and <img src=x onerror=alert(1)> md'))")
    # an image whose metadata the template writes into the <img> tag (hostile pass 3: the page was refused)
    cells.append("display({'image/png': 'iVBORw0KGgo='}, raw=True, metadata={'image/png': {'width': "
                 "'1\" onerror=\"fetch(1)', 'height': 7}, 'filenames': {'image/png': 'https://evil.example/f.png'}})")
    # an output type the template writes raw (hostile pass 4: a refresh reached the browser this way)
    cells.append("display({'text/vnd.mermaid': '<![CDATA[><meta http-equiv=\"refresh\" content=\"0;url=https://"
                 "evil.example/m\">]]>', 'text/plain': 'mermaid shown as its text'}, raw=True)")
    page = notebook(root / "hostile.ipynb", *cells,
                    markdown="# Notes\n\n![pixel](https://evil.example/pixel.png)\n\n<iframe src='https://evil.example'>"
                             "</iframe>\n\n[ok link](https://example.org) and $x^2$")
    out = root / "report"
    done = glmkit_report(page, "--out", out)
    assert done.returncode == 0, done.stderr
    return out / "hostile.html"


def test_a_report_is_sealed_against_known_bypasses(hostile_report):
    """Every bypass leaves nothing in the page that fetches, navigates or runs; the text around it
    stays; the CSP comes first in <head>. The page as text (the browser test below renders it)."""
    text = hostile_report.read_text()
    assert_offline(text)
    assert fetching(text) == [], fetching(text)[:5]
    for i in range(len(BYPASSES)):
        assert f"after {i}" in text                               # the harmless text around each survives
    assert 'href="https://example.org/docs"' in text and 'href="https://example.org"' in text and "$x^2$" in text
    assert "mermaid shown as its text" in text and 'class="mermaid"' not in text
    image = re.search(r'<img [^>]*height="7"[^>]*>', text)  # its settings kept as numbers, nothing else
    assert image and "onerror" not in image.group(0) and "width" not in image.group(0), image
    assert 'src="data:image/png;base64,iVBORw0KGgo="' in image.group(0)
    head = text[text.lower().index("<head"):]
    assert head[head.index(">") + 1:].lstrip().startswith('<meta http-equiv="Content-Security-Policy"')
    assert "default-src 'none'" in text and "script-src 'none'" in text


BROWSER = shutil.which("chromium-headless-shell") or shutil.which("chromium")


class _Recorder(http.server.BaseHTTPRequestHandler):
    """Serves the page under test at /page.html and records every request, for any host (the browser
    sends all its traffic here as its proxy)."""

    page: bytes = b""
    seen: list = []

    def _answer(self):
        self.seen.append(f"{self.command} {self.path}")
        if self.command == "GET" and self.path.endswith("/page.html"):
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.end_headers()
            self.wfile.write(self.page)
            return
        self.send_response(204)
        self.end_headers()

    do_GET = do_POST = do_HEAD = do_CONNECT = do_PUT = do_OPTIONS = _answer

    def log_message(self, *args):
        pass


def requests_made_rendering(page: bytes) -> list[str]:
    """Render `page` in headless Chromium (5 s of virtual time: timers, refreshes and lazy loads run)
    with every request, to any host and loopback included, sent to a recorder on 127.0.0.1 -> the
    requests other than the page itself."""
    handler = type("Recorder", (_Recorder,), {"page": page, "seen": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    proxy = f"http://127.0.0.1:{server.server_port}"
    try:
        done = subprocess.run([BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                               "--disable-background-networking", "--disable-component-update", "--disable-sync",
                               f"--proxy-server={proxy}", "--proxy-bypass-list=<-loopback>",
                               "--virtual-time-budget=5000", "--dump-dom", f"{proxy}/page.html"],
                              capture_output=True, text=True, timeout=120)
    finally:
        server.shutdown()
        server.server_close()
    assert done.returncode == 0 and "<body" in done.stdout, done.stderr[-2000:]
    return [r for r in handler.seen if not r.endswith("/page.html")]


def test_a_browser_rendering_the_sealed_report_makes_no_request(hostile_report):
    """Headless Chromium renders the hostile report served from loopback, with a proxy that records
    every request: none but the page's own. The same browser rendering the bypasses unsealed makes
    requests (the check can see them). CI installs Chromium (.ci/run); elsewhere the test runs where
    one is found."""
    if BROWSER is None:
        assert not os.environ.get("CI"), "CI must have Chromium (.ci/run installs chromium-headless-shell)"
        pytest.skip("no Chromium here (apt-get install chromium-headless-shell)")
    unsealed = "<html><head></head><body>" + "".join(BYPASSES) + "</body></html>"
    leaked = requests_made_rendering(unsealed.encode())
    assert len(leaked) >= 5, leaked                                   # the recorder sees what a page fetches
    assert requests_made_rendering(hostile_report.read_bytes()) == []


@pytest.mark.parametrize("page,head", [
    ('<!DOCTYPE html>\n<html>\n<!-- a <head> in a comment -->\n<head lang="x>y">\n<title>t</title></head><body></body>',
     '<head lang="x>y">'),
    ('<html>\r\n\x0c<HEAD>\u2028</HEAD><body><p>&lt;head&gt;</p></body></html>', "<HEAD>"),
    ('<html><body>no head</body></html>', None),
])
def test_the_csp_goes_first_into_the_real_head(page, head):
    """The policy lands right after the first real <head> start tag (not one in a comment or an
    attribute; line breaks of any kind before it), or in a <head> of its own before a page without one."""
    from glmkit.seal import CSP_META, with_csp

    sealed = with_csp(page)
    if head is None:
        assert sealed == f"<head>{CSP_META}</head>" + page
        return
    at = sealed.index(CSP_META)
    assert sealed.count(CSP_META) == 1 and sealed[:at] + sealed[at + len(CSP_META):] == page
    assert sealed[:at].endswith(head) and sealed[:at].count(head) == 1


def test_the_sanitiser_keeps_what_views_draw():
    from glmkit.seal import sanitize_html

    table = ('<table style="border-collapse:collapse"><tr class="verdict-pass"><th>name</th><td style="color:#1b7f3b;'
             'background-image:url(https://evil.example/x)">ok</td></tr></table><img src="data:image/png;base64,iVBO'
             'Rw0KGgo=" alt="figure"><pre><code>train/grad_norm</code></pre>')
    clean = sanitize_html(table)
    assert '<tr class="verdict-pass">' in clean and "color:#1b7f3b" in clean and "url(" not in clean
    assert 'src="data:image/png;base64,iVBORw0KGgo="' in clean and "<code>train/grad_norm</code>" in clean
    # (the review of pass 12's fix: its regex over the serialised page also cut text that reads like a style)
    prose = '<pre>to colour a cell write style="color: url(x)" in its tag</pre>'
    assert sanitize_html(prose) == prose


def test_html_nested_past_the_limit_is_shown_as_text_at_once():
    """Hostile pass 8: a markdown cell of 200,000 nested <div> kept the sanitiser busy for minutes (its
    time grows with the square of the depth) and deaf to SIGTERM. Past MAX_HTML_DEPTH the fragment is
    its escaped text, found in one linear pass; below it, markup is sanitised as before."""
    import time

    from glmkit.seal import MAX_HTML_DEPTH, html_depth, sanitize_html

    assert html_depth("<p>a<br>b<img src=x><div/><span><b>x</b></span></p>") == 3
    started = time.perf_counter()
    deep = sanitize_html("<div>" * 200_000 + "<img src=x onerror=alert(1)>" + "</div>" * 200_000)
    assert time.perf_counter() - started < 20  # minutes before; a generous bound for a loaded 2-core machine
    assert deep.startswith(f"<p><i>HTML nested 200000 elements deep (over {MAX_HTML_DEPTH})")
    assert "<img" not in deep and "<div" not in deep and "&lt;img src=x onerror=alert(1)&gt;" in deep
    deepest = MAX_HTML_DEPTH - 1  # and the <b> inside: at the limit, markup still
    shallow = sanitize_html("<div>" * deepest + "<b>x</b>" + "</div>" * deepest)
    assert shallow.count("<div>") == deepest and "<b>x</b>" in shallow


def test_a_javascript_output_is_dropped_not_run(tmp_path):
    page = notebook(tmp_path / "js.ipynb", "from IPython.display import Javascript, display\n"
                    "display(Javascript('document.body.innerHTML = \"gone\"'))\nprint('kept')")
    out = tmp_path / "report"
    done = glmkit_report(page, "--out", out)
    assert done.returncode == 0, done.stderr
    text = (out / "js.html").read_text()
    assert_offline(text)
    assert "kept" in text and 'data-mime-type="application/javascript"' not in text


@pytest.mark.parametrize("snippet", [
    '<script src="https://cdnjs.cloudflare.com/ajax/libs/require.js/2.1.10/require.min.js"></script>',
    "<script src='//unpkg.com/@jupyter-widgets/html-manager@*/dist/embed-amd.js'></script>",
    '<script type="text/javascript">var a = 1;</script>',
    '<script type="module">import("https://example.org/m.js")</script>',
    '<link rel="stylesheet" href="https://example.org/a.css">',
    '<link rel="preload" href="./local.woff2">',
    '<style>@import url("theme.css");</style>',
    '<style>body { background: url(https://example.org/bg.png) }</style>',
    '<div style="background-image: url(\'//example.org/bg.png\')">x</div>',
    '<iframe src="https://example.org"></iframe>',
    '<base href="https://example.org/">',
    '<img src="https://example.org/x.png">',
    '<img src="pixel.png">',
    '<img srcset="https://example.org/a.png 1x" src="data:image/png;base64,iVBORw0KGgo=">',
    '<img src="data:image/png;base64,iVBORw0KGgo=" onerror="alert(1)">',
    '<meta http-equiv="refresh" content="0; url=https://example.org/">',
    '<video poster="https://example.org/p.png"></video>',
    '<audio><source src="https://example.org/a.mp3"></audio>',
    '<svg><use href="https://example.org/s.svg#a"></use></svg>',
    '<svg><image xlink:href="https://example.org/i.png"></image></svg>',
    '<table background="https://example.org/t.png"></table>',
    '<iframe srcdoc="&lt;script&gt;alert(1)&lt;/script&gt;"></iframe>',
    '<a href="https://example.org" ping="https://example.org/track">a</a>',
    # where Python's HTMLParser tokenises differently from a browser (the rule reads pages with html5lib)
    '<!-- --!><meta http-equiv="refresh" content="0;url=https://example.org/"><!-- -->',
    '<!--><img src="https://example.org/x.png"><!-- -->',
    '<!---><img src="https://example.org/x.png"><!-- -->',
    '<![CDATA[ x><img src="https://example.org/x.png"> ]]>',
    '<textarea><!--</textarea><img src="https://example.org/x.png">--></textarea>',
    '<noscript><p title="</noscript><img src=https://example.org/x.png>"></noscript>',
])
def test_external_resource_rule_flags_what_would_load_or_run(snippet):
    assert external_resources(f"<html><head></head><body>{snippet}</body></html>")


def test_external_resource_rule_leaves_inline_content_alone():
    page = ('<html><head><style>/* see https://github.com/x/y */ .a { background: url(data:image/png;base64,AAAA) }'
            '</style></head><body><img src="data:image/png;base64,iVBORw0KGgo="><a href="https://example.org">a '
            'link</a><link rel="icon" href="data:image/png;base64,AAAA"><pre>url(https://in.text) is text</pre>'
            '<div style="background:#1b7f3b">banner</div></body></html>')
    assert external_resources(page) == []
    assert external_resources(page.replace("#1b7f3b", "url(bg.png)")) == ["url(bg.png)"]


def test_header_shows_the_reasons_and_a_third_verdict(tmp_path):
    body = ("import json, os\n"
            f"json.dump({{'verdict': {UNDECIDED!r}, 'reasons': ['3 rollouts, the rule needs 8'],\n"
            "           'warnings': ['tiny preset']}, open(os.path.join(out_dir, 'verdict.json'), 'w'))")
    out = tmp_path / "report"
    done = glmkit_report(notebook(tmp_path / "judge.ipynb", body), "--out", out)
    assert done.returncode == 0, done.stderr   # neither pass nor fail: not a failure
    assert f"verdict: {UNDECIDED}\n  - 3 rollouts, the rule needs 8\n  - warning: tiny preset" in done.stdout
    text = (out / "judge.html").read_text()
    header = text[text.index('id="glmkit-report-header"'):text.index("<h3>parameters</h3>")]
    assert f"verdict: {UNDECIDED}</div>" in header and "#9a6700" in header
    assert re.search(r'class="glmkit-verdict-reasons"><li>3 rollouts, the rule needs 8</li>'
                     r"<li>warning: tiny preset</li></ul>", header)


def test_parity_verdicts_give_the_first_divergence_of_each_failed_comparison():
    first = {"layer": 0, "site": "attn_out", "kind": "values", "rel_rms": 0.52, "nan": 0, "inf": 0}
    topk = {"layer": 3, "site": "indexer_topk", "kind": "indices", "different": 0.25, "tied": 0.05}
    data = {"verdict": "fail", "paths": ["reference", "train"], "thresholds": {"rel_rms": 1e-4, "identical": 0.99},
            "first_divergence": first, "sites": [{"diverged": True}, {"diverged": False}],
            "train_rollout": {"verdict": "fail", "paths": ["train", "rollout"], "first_divergence": topk,
                              "thresholds": {"rel_rms": 1e-4, "identical": 0.99}},
            "warnings": ["ties seen"]}
    assert verdict_reasons(data) == [
        "reference vs train: first divergence at layer 0, site attn_out (rel RMS 0.52 > threshold 0.0001); "
        "1 of 2 sites diverge",
        "train vs rollout: first divergence at layer 3, site indexer_topk (different rows 0.25 > 0.01 allowed "
        "(ties 0.05))",
        "warning: ties seen"]
    same = dict(data, paths=["train", "rollout"], train_rollout=dict(data["train_rollout"], first_divergence=first))
    assert len(parity_reasons(same)) == 1            # train vs rollout was the comparison itself
    assert parity_reasons({"verdict": "pass", "first_divergence": None, "train_rollout": {}}) == []
    assert verdict_reasons({"verdict": "fail", "reasons": ["x"]}) == ["x"]


def test_a_report_replaces_only_its_own_files_and_refuses_bad_notebooks_and_names(tmp_path):
    """Someone's file where the report would go is refused before the notebook runs (exit 2, kept);
    a notebook that is not one, or a --name with a folder in it, is refused by name (exit 2) and
    leaves no empty folder; a report's own files are replaced by the next run."""
    page = notebook(tmp_path / "mini.ipynb", "print('hello')")
    out = tmp_path / "report"
    out.mkdir()
    (out / "mini.html").write_text("<p>my notes</p>")
    refused = glmkit_report(page, "--out", out)
    assert refused.returncode == 2 and "not a report file glmkit wrote" in refused.stderr
    assert (out / "mini.html").read_text() == "<p>my notes</p>" and not (out / "mini.ipynb").exists()
    (out / "mini.html").unlink()
    assert glmkit_report(page, "--out", out).returncode == 0
    again = glmkit_report(page, "--out", out)                  # marked by the first run: replaced
    assert again.returncode == 0 and "hello" in (out / "mini.html").read_text()
    broken = tmp_path / "broken.ipynb"
    broken.write_text('{"cells": [')
    bad = glmkit_report(broken, "--out", tmp_path / "new")
    assert bad.returncode == 2 and "not a readable Jupyter notebook" in bad.stderr and not (tmp_path / "new").exists()
    named = glmkit_report(page, "--out", tmp_path / "new", "--name", "../escape")
    assert named.returncode == 2 and "a plain file name" in named.stderr and not (tmp_path / "escape.html").exists()
    # hostile pass 10: a line break was written into the file name, '' quietly became the default
    broken_line = glmkit_report(page, "--out", tmp_path / "new", "--name", "new\nline")
    assert broken_line.returncode == 2 and "'new\\nline': a report's name is a plain file name" in broken_line.stderr
    assert len(broken_line.stderr.strip().splitlines()) == 1
    empty = glmkit_report(page, "--out", tmp_path / "new", "--name", "")
    assert empty.returncode == 2 and "--name '': empty" in empty.stderr
    assert not (tmp_path / "new").exists()
