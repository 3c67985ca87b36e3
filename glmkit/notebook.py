"""Run a notebook headless (papermill) and turn it into one self-contained HTML report.

    run_notebook("notebooks/01_layer_parity.ipynb", "reports/01", {"variant": "tiny"})
        -> reports/01/01_layer_parity.html   (header: notebook, verdict and its reasons, parameters,
                                              versions, time)
           reports/01/01_layer_parity.ipynb  (the executed notebook)

The HTML loads nothing: no require.js, MathJax, Mermaid or widget manager from a CDN, no widget
state, no scripts (`notebook_html`); widget views are dropped and the static PNG / HTML that
`widgets.show` puts in the same output stays. A page that would still load or run code is refused
(`external_resources`). Markdown math shows as its TeX source.

The kernel runs with the repository root as its working directory (so `glmkit` and `widgets` import
and relative paths in parameters resolve from there) and gets `out_dir` as a parameter. The verdict
is read from `{out_dir}/verdict.json` or `{out_dir}/parity.json` (the first of the two this run wrote),
"unknown" otherwise; its reasons are the file's "reasons" or, for a parity result, the first
divergence of each comparison that failed, then its warnings. Files are written under temporary
names and renamed when complete; a notebook that fails leaves `{name}.failed.ipynb` (with the error
in it) and no new HTML.

`add_report_command(subparsers)` adds `glmkit report NOTEBOOK [--out DIR] [-p NAME VALUE]...`.
"""

from __future__ import annotations

import argparse
import copy
import html
import json
import os
import re
import sys
import time
from datetime import datetime
from pathlib import Path

from glmkit.inputs import not_a_file
from glmkit.report import divergence_text, resolve_out_dir, versions
from glmkit.rl.health import UNDECIDED

KERNEL = "python3"   # ipykernel's spec; jupyter_client runs it with this interpreter
MAX_VERDICT_BYTES = 64 << 20
# a markdown image whose source is one of the cell's attachments (nbconvert fails on a missing one)
_ATTACHMENT = re.compile(r"!\[[^\]]*\]\(\s*(?:<attachment:([^>]+)>|attachment:([^\s)]+))")
VERDICT_FILES = ("verdict.json", "parity.json")  # looked for in this order; any notebook may write either
VERDICT_FILE = "parity.json"   # notebook 01's file (kept for callers of the old name)
VERDICT_COLORS = {"pass": "#1b7f3b", "fail": "#b3261e", UNDECIDED: "#9a6700"}   # others: grey
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
# output types the report never carries: they are code (or state for code) a browser would run
CODE_MIMETYPES = (WIDGET_VIEW, "application/javascript", "text/javascript",
                  "application/vnd.jupyter.widget-state+json")
# the output types a report shows, each of which the template escapes or the sanitiser cleans (text/html,
# and markdown through the sealed exporter); any other (SVG, Mermaid, PDF, JSON views, ...) is written
# into the page by the template as it is, or is code, and is left out
REPORT_MIMETYPES = ("text/plain", "text/html", "text/markdown", "text/latex", "image/png", "image/jpeg")
_BASE64 = re.compile(r"[A-Za-z0-9+/=\s]*")
# JupyterLab's template with every block that loads code left empty: require.js, the widget manager
# (from unpkg, at an unpinned version), MathJax and Mermaid (from cdnjs), and the outputs that run JS
OFFLINE_TEMPLATE = "glmkit_offline.html.j2"
OFFLINE_TEMPLATE_TEXT = """{%- extends 'index.html.j2' -%}
{%- block html_head_js -%}{%- endblock html_head_js -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block data_javascript -%}{%- endblock data_javascript -%}
{%- block data_widget_view -%}{%- endblock data_widget_view -%}
"""


def project_root(notebook: Path) -> Path:
    """The nearest folder above the notebook holding pyproject.toml, else the notebook's folder."""
    notebook = Path(notebook).resolve()
    for folder in notebook.parents:
        if (folder / "pyproject.toml").is_file():
            return folder
    return notebook.parent


def notebook_defaults(notebook: Path) -> dict[str, str]:
    """The parameters cell's names and default values, as source text."""
    import papermill

    try:
        found = papermill.inspect_notebook(str(notebook))
    except ValueError as err:  # papermill reads the language from the notebook's kernelspec
        if "kernel" not in str(err).lower() and "language" not in str(err).lower():
            raise
        found = _inspect_as_python(notebook)
    return {name: info["default"] for name, info in found.items()}


def _inspect_as_python(notebook: Path) -> dict:
    """papermill's parameters of a notebook whose metadata names no kernel nor language: a Python one
    (the report refuses others), read from a copy that names the Python 3 kernel."""
    import tempfile

    import nbformat
    import papermill

    nb = nbformat.read(str(notebook), as_version=4)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    with tempfile.TemporaryDirectory(prefix="glmkit-inspect-") as folder:
        copy = Path(folder) / "notebook.ipynb"
        nbformat.write(nb, str(copy))
        return papermill.inspect_notebook(str(copy))


# What reading a verdict file of another layout raises (a number where a list was expected, a text where
# a number was): the report is still written, its header saying the file could not be read.
UNEXPECTED_LAYOUT = (AttributeError, TypeError, KeyError, ValueError, IndexError)


def read_verdict(out_dir: Path, since: float, with_reasons: bool = False):
    """The verdict in out_dir/verdict.json or out_dir/parity.json (the first that this run, started at
    `since`, wrote), "unknown" when neither was. With `with_reasons`: (verdict, `verdict_reasons`)."""
    data = read_verdict_data(out_dir, since)
    verdict = str(data.get("verdict", "unknown")) if data else "unknown"
    if not with_reasons:
        return verdict
    try:
        return verdict, verdict_reasons(data) if data else []
    except UNEXPECTED_LAYOUT as err:  # a hand-edited file, or a notebook's own layout: said, not crashed on
        return verdict, [f"the verdict file's layout is not one glmkit reads ({type(err).__name__}: "
                         f"{str(err)[:120]}); see the notebook's own output"]


def read_verdict_data(out_dir: Path, since: float) -> dict:
    """The verdict file this run wrote (see read_verdict), parsed; {} when there is none."""
    for name in VERDICT_FILES:
        path = Path(out_dir) / name
        try:
            if path.stat().st_mtime < since:
                continue
        except OSError:
            continue
        why = not_a_file(path)  # a pipe in its place would block the report for ever
        if why is None and path.stat().st_size > MAX_VERDICT_BYTES:
            why = f"holds {path.stat().st_size} bytes (at most {MAX_VERDICT_BYTES} are read)"
        if why is not None:
            return {"verdict": "unknown", "reasons": [f"{name} {why}; not read"]}
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError, RecursionError):
            continue
        if isinstance(data, dict):
            return data
    return {}


def _number(value, digits: int = 3) -> str:
    return f"{value:.{digits}g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else "—"


def key_numbers(data: dict) -> list[tuple[str, str]]:
    """The numbers a reader compares across runs, from a notebook's verdict file: notebook 01's parity
    (first divergence, worst site, train-vs-rollout log-prob abs diff, DSA ties replayed), notebook 02's
    GRPO run (raw reward start -> end on training and held-out prompts, abs diff, KL, grad norm) and
    notebook 03's launch (shape, job, state, last metrics). [] for a file of none of these."""
    found = []
    if "sites" in data or "first_divergence" in data:  # notebook 01
        first = data.get("first_divergence")
        found.append(("first diverging site", "none" if not first else
                      f"layer {first.get('layer')} {first.get('site')}" if isinstance(first, dict) else str(first)))
        sites = [s for s in data.get("sites") or [] if isinstance(s, dict) and isinstance(s.get("rel_rms"), (int, float))]
        if sites:
            worst = max(sites, key=lambda s: s["rel_rms"])
            found.append(("worst site", f"layer {worst.get('layer')} {worst.get('site')}: rel RMS {_number(worst['rel_rms'])}"))
        diff = (data.get("train_rollout") or {}).get("logprob_abs_diff", data.get("logprob_abs_diff"))
        found.append(("train-vs-rollout log-prob abs diff", _number(diff)))
        replay = data.get("topk_replay")
        found.append(("DSA ties replayed", "no" if not replay else
                      f"yes ({', '.join(f'{k}: {v}' for k, v in replay.items())})" if isinstance(replay, dict) else "yes"))
    if "raw_reward_start" in data:  # notebook 02 (a GRPO run's verdict)
        found.append(("raw reward (training prompts)", f"{_number(data.get('raw_reward_start'))} -> "
                                                        f"{_number(data.get('raw_reward_end'))} (mean of the first 3 "
                                                        f"rollouts -> of the last 5)"))
        held = next((o for o in data.get("observations") or [] if o.get("metric") == "eval/raw_reward"), None)
        found.append(("raw reward (held-out prompts)", f"{_number(held['first'])} -> {_number(held['last'])} (first "
                                                       f"evaluation -> last)" if held else "not evaluated"))
        for row in data.get("health") or []:
            if row.get("metric") in ("train/train_rollout_logprob_abs_diff", "train/ppo_kl", "train/grad_norm"):
                found.append((row["metric"], str(row.get("observed") or "—")))
    if "shape" in data and ("job" in data or "backend" in data):  # notebook 03
        if data.get("ran"):  # what actually ran, and where: a plan's shape beside a pass is not a launch of it
            found.append(("ran", str(data["ran"])))
        shape = data.get("shape") or {}
        if isinstance(shape, dict):  # the parallel layout a reader compares; the plan holds the rest
            shown = {k: shape[k] for k in ("name", "nodes", "gpus_per_node", "tp", "pp", "ep") if k in shape} or shape
            found.append(("shape", ", ".join(f"{k} {v}" for k, v in shown.items())))
        else:
            found.append(("shape", str(shape)))
        found.append(("job", f"{data.get('job') or 'none'} ({data.get('job_status') or 'not submitted'})"))
        found.append(("metric rows", str(data.get("metric_rows", 0))))
        health = data.get("grpo_health")
        if isinstance(health, dict):
            found.append(("GRPO health", str(health.get("verdict"))))
    return found


def verdict_reasons(data: dict) -> list[str]:
    """Why a verdict file says what it says: its "reasons" (notebooks 02 and 03: failed rules, failed
    health checks, too few rollouts), or for a parity result that lists none (notebook 01's
    parity.json) the first divergence of each comparison that failed; then its warnings."""
    if "reasons" in data:
        given = data.get("reasons") or []
        reasons = [str(r) for r in ([given] if isinstance(given, str) else given)]  # one text is one reason
    else:
        reasons = parity_reasons(data)
    warned = data.get("warnings") or []
    return reasons + [f"warning: {w}" for w in ([warned] if isinstance(warned, str) else warned)]


def parity_reasons(data: dict) -> list[str]:
    """"reference vs train: first divergence at layer 0, site attn_out (rel RMS 0.5 > threshold
    0.0001); 52 of 52 sites diverge" for the comparison of a parity.json and for its train-vs-rollout
    comparison ("train_rollout", notebook 01), each when it failed."""
    reasons = []
    extra = data.get("train_rollout") or {}
    parts = [data] + ([extra] if extra.get("paths") != data.get("paths") else [])
    for part in parts:
        first = part.get("first_divergence")
        if not isinstance(first, dict):
            continue
        text = (f"{' vs '.join(map(str, part.get('paths') or []))}: first divergence at "
                f"{divergence_text(first, part.get('thresholds') or data.get('thresholds') or {})}")
        sites = part.get("sites")
        if sites:
            text += f"; {sum(bool(s.get('diverged')) for s in sites)} of {len(sites)} sites diverge"
        reasons.append(text)
    departure = data.get("departure")
    if isinstance(departure, dict) and departure.get("text"):
        reasons.append(f"which side departs: {departure['text']}")
    for key in ("gradients", "parameter_gradients"):
        part = data.get(key)
        first = part.get("first_divergence") if isinstance(part, dict) else None
        if isinstance(first, dict):
            reasons.append(f"{key.replace('_', ' ')}: first divergence in the backward order at layer "
                           f"{first.get('layer')} {first.get('site')}")
    return reasons


def verdict_label(verdict: str) -> str:
    """PASS / FAIL / UNKNOWN; a verdict that is a phrase ("not enough rollouts to judge") as written."""
    return verdict if " " in verdict else verdict.upper()


def header_html(name: str, verdict: str, parameters: dict, defaults: dict, started: float, seconds: float,
                reasons=(), numbers=()) -> str:
    color = VERDICT_COLORS.get(verdict, "#666666")
    rows = []
    for key in dict.fromkeys([*defaults, *parameters]):
        if key in parameters:
            value, source = json.dumps(parameters[key], default=str), "set"
        else:
            value, source = defaults[key], "default"
        rows.append(f"<tr><td>{html.escape(key)}</td><td><code>{html.escape(value)}</code></td>"
                    f"<td>{source}</td></tr>")
    found = versions()
    if "glmkit" not in found:  # running from a checkout that is not pip-installed
        from glmkit import __version__

        found["glmkit"] = f"{__version__} (source)"
    version_text = ", ".join(f"{pkg} {v}" for pkg, v in found.items())
    when = datetime.fromtimestamp(started).astimezone().isoformat(timespec="seconds")
    reason_list = ("<ul class=\"glmkit-verdict-reasons\">" + "".join(f"<li>{html.escape(r)}</li>" for r in reasons)
                   + "</ul>") if reasons else ""
    cell = "border:1px solid #ccc;padding:2px 8px;text-align:left"
    number_rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                          for k, v in [*numbers, ("wall time", f"{seconds:.1f} s")])
    return f"""<div id="glmkit-report-header" style="font-family:sans-serif;margin:1em 2em 2em 2em">
<h1 style="margin:0 0 .4em 0">{html.escape(name)}</h1>
<div style="background:{color};color:#fff;padding:.5em 1em;font-size:1.3em">\
verdict: {html.escape(verdict_label(verdict))}</div>
{reason_list}
<table class="glmkit-key-numbers" style="border-collapse:collapse;margin-top:.6em">{number_rows}</table>
<style>#glmkit-report-header td, #glmkit-report-header th {{{cell}}}</style>
<h3>parameters</h3>
<table style="border-collapse:collapse"><tr><th>name</th><th>value</th><th></th></tr>{''.join(rows)}</table>
<p>versions: {html.escape(version_text)}</p>
<p>run at {html.escape(when)}, took {seconds:.1f} s</p>
</div>"""


def offline_notebook(nb, in_place: bool = False):
    """A copy of an executed notebook for the report (`in_place`: the notebook itself, for one read
    only for this): no widget state, and each output with only the types in `REPORT_MIMETYPES`
    (images only when their data is base64); its HTML through the sanitiser (`glmkit.seal`); what
    `widgets.show` displayed keeps its static PNG or HTML, and a bare widget (or script: nothing but
    its text repr left) is dropped. A text longer than MAX_OUTPUT_CHARS is cut, saying so (the
    executed notebook keeps all of it)."""
    from glmkit.seal import sanitize_html

    nb = nb if in_place else copy.deepcopy(nb)
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        if cell.get("cell_type") != "code":
            continue
        kept = []
        for output in cell.get("outputs", []):
            if "metadata" in output:
                output["metadata"] = _image_metadata(output["metadata"])
            data = output.get("data")
            if data is not None:
                dropped = [m for m in data if m not in REPORT_MIMETYPES or (
                    m.startswith("image/") and not (isinstance(data[m], str) and _BASE64.fullmatch(data[m])))]
                for mime in dropped:
                    del data[mime]
                if set(dropped) & set(CODE_MIMETYPES) and set(data) <= {"text/plain"}:
                    continue
                for mime in ("text/plain", "text/html", "text/markdown", "text/latex"):
                    if mime in data:
                        data[mime] = _cut("".join(data[mime]) if isinstance(data[mime], list) else data[mime])
                if "text/html" in data:
                    data["text/html"] = sanitize_html(data["text/html"])
            if output.get("output_type") == "stream":
                output["text"] = _cut("".join(output.get("text") or []) if isinstance(output.get("text"), list)
                                      else output.get("text") or "")
            kept.append(output)
        cell.outputs = kept
    return nb


MAX_OUTPUT_CHARS = 1 << 20  # of one text output in the report: a 300 MB print would make a page no one reads


def _cut(text) -> str:
    if not isinstance(text, str) or len(text) <= MAX_OUTPUT_CHARS:
        return text
    return (text[:MAX_OUTPUT_CHARS] + f"\n[... {len(text) - MAX_OUTPUT_CHARS} more characters of this output are in "
            f"the executed notebook (.ipynb) beside this report]")


_IMAGE_SIZES = ("width", "height")


def _image_settings(meta) -> dict:
    """What the HTML template reads from an image's metadata, as values that cannot carry markup: its
    size as a positive integer, `unconfined` as a bool, `needs_background` as light or dark."""
    if not isinstance(meta, dict):
        return {}
    kept = {k: int(v) for k in _IMAGE_SIZES if isinstance(v := meta.get(k), (int, float, str))
            and str(v).isascii() and str(v).isdigit() and 0 < int(v) < 100_000}
    if isinstance(meta.get("unconfined"), bool):
        kept["unconfined"] = meta["unconfined"]
    if meta.get("needs_background") in ("light", "dark"):
        kept["needs_background"] = meta["needs_background"]
    return kept


def _image_metadata(metadata) -> dict:
    """An output's metadata for the report: image settings only (`_image_settings`), for the output and
    per image type. Anything else (`filenames`, which would make the page load a file; text that the
    template writes into the <img> tag as it is) is dropped."""
    kept = _image_settings(metadata)
    for mime in ("image/png", "image/jpeg"):
        if isinstance(metadata, dict) and (settings := _image_settings(metadata.get(mime))):
            kept[mime] = settings
    return kept


def _sealed_exporter():
    """JupyterLab's HTML exporter with markdown (cells and outputs) rendered, then sanitised, and no
    file read for an image a markdown cell names (only the notebook's own attachments are inlined)."""
    import jinja2
    from nbconvert import HTMLExporter

    from glmkit.seal import sanitize_html

    class SealedExporter(HTMLExporter):
        def markdown2html(self, context, source):
            return sanitize_html(super().markdown2html(context, source))

    SealedExporter.markdown2html = jinja2.pass_context(SealedExporter.markdown2html)
    return SealedExporter(template_name="lab", template_file=OFFLINE_TEMPLATE, embed_images=False,
                          extra_loaders=[jinja2.DictLoader({OFFLINE_TEMPLATE: OFFLINE_TEMPLATE_TEXT})])


# What a page must not hold to be self-contained: any <script> (inline or loaded), any tag that
# loads a file (<link href>, <iframe/embed/frame src>, <object data>) other than from a data: URI,
# a <base href>, a <noscript> (raw text where scripts run, markup to a parser where they do not), and
# in its CSS (<style> blocks, style attributes) @import or a url() not data:. Read with html5lib, which
# tokenises as the HTML standard says, as browsers do: comments ending at `--!>`, `<!-->`, CDATA,
# raw-text elements. (Python's HTMLParser differs on each, and a page it misreads could hide a tag.)
_CSS_FETCH = re.compile(r"@import\b[^;]*;?|url\(\s*[\"']?(?!data:)[^)]*\)", re.IGNORECASE)
# attributes whose value a browser fetches by itself (any element), and hrefs that fetch on these elements
_FETCHED = {"src", "srcset", "poster", "background", "data", "lowsrc", "dynsrc", "xlink:href", "srcdoc", "ping"}
_FETCHED_HREF = {"link", "base", "use", "image", "feimage", "script"}
_XLINK = "{http://www.w3.org/1999/xlink}"


def _local(name: str) -> str:
    """An element's or attribute's name without its namespace (xlink's attributes keep `xlink:`)."""
    if name.startswith(_XLINK):
        return "xlink:" + name[len(_XLINK):]
    return name.rsplit("}", 1)[-1].lower()


def _element_resources(tag: str, attrs: dict, text: str) -> list[str]:
    shown = (f"<{tag} " + " ".join(f'{k}="{v}"' for k, v in attrs.items()))[:200]
    found = []
    if tag in ("script", "base", "noscript") or (tag == "meta" and any(
            k == "http-equiv" and v.lower() != "content-security-policy" for k, v in attrs.items())):
        found.append(shown)
    for name, value in attrs.items():
        value = value.strip()
        if name.startswith("on"):
            found.append(shown)
        elif name in _FETCHED or (name == "href" and tag in _FETCHED_HREF):
            if value and not (value.lower().startswith("data:") and name != "srcset") and \
                    not (name == "xlink:href" and value.startswith("#")):
                found.append(shown)
        elif name == "style":
            found += [m.group(0)[:200] for m in _CSS_FETCH.finditer(value)]
    if tag == "style":
        found += [m.group(0)[:200] for m in _CSS_FETCH.finditer(text)]
    return found


def external_resources(page: str) -> list[str]:
    """The places in an HTML page that would run a script or fetch a file (an empty list: the page
    is self-contained): scripts, event handlers, a refresh or other http-equiv, <base>, frames' and
    media's sources, srcsets, CSS url()/@import. Images from data: URIs, links (<a href>) and text
    are fine."""
    import html5lib

    found = []
    for element in html5lib.parse(page, namespaceHTMLElements=False).iter():
        if not isinstance(element.tag, str):  # a comment
            continue
        attrs = {_local(k): v or "" for k, v in element.attrib.items()}
        found += _element_resources(_local(element.tag), attrs, "".join(element.itertext()))
    return found


def notebook_html(executed: Path, header: str, title: str | None = None) -> str:
    """The executed notebook as one sealed HTML page (`offline_notebook` exported with JupyterLab's
    template less its script blocks, markdown sanitised; images inline as data URIs), header first,
    the Content-Security-Policy first in <head>. Raises ValueError naming what would still load or
    run code (the last guard: the sanitiser leaves nothing for it to find)."""
    import nbformat

    from glmkit.seal import with_csp

    exporter = _sealed_exporter()
    title = title or Path(executed).stem
    body, _ = exporter.from_notebook_node(offline_notebook(nbformat.read(str(executed), as_version=4), in_place=True),
                                          resources={"metadata": {"name": title}})
    start = body.find("<body")
    if start < 0:
        page = header + body
    else:
        end = body.index(">", start) + 1
        page = body[:end] + header + body[end:]
    found = external_resources(page)
    if found:
        raise ValueError(f"{executed}: the report would load or run code, so it is not written: "
                         + "; ".join(found[:3]) + " (display a static image or HTML instead)")
    return with_csp(page)


def run_notebook(notebook, out_dir, parameters: dict, name: str | None = None) -> Path:
    """Execute `notebook` with `parameters` (plus out_dir) and write {out_dir}/{name}.html; returns its path.
    On an execution error the executed notebook is kept as {name}.failed.ipynb and the error re-raised.
    The report's name in `out_dir` is locked while it runs (a second run of it there is refused)."""
    from glmkit.outputs import RunLock, check_dir_out, removed_if_left_empty

    notebook, out_dir = Path(notebook).resolve(), Path(out_dir)
    if (why := not_a_file(notebook)) is not None:
        if why == "no such file":
            raise FileNotFoundError(f"{notebook}: no such notebook")
        raise ValueError(f"{notebook}: {why}, not a notebook")
    _check_notebook(notebook)
    _check_parameter_names(notebook, parameters)
    given = parameters.get("out_dir")
    if given is not None and resolve_out_dir(str(given)) != resolve_out_dir(out_dir):  # it would be replaced
        raise ValueError(f"-p out_dir {str(given)[:80]}: the notebook's out_dir is the report directory, "
                         f"{resolve_out_dir(out_dir)}; set it with --out")
    if name is not None and not name.strip():
        raise ValueError(f"--name {name!r}: empty; give a file name (or leave --name out for the notebook's stem)")
    name = name or notebook.stem
    if name.startswith(".") or "/" in name or "\\" in name or not name.isprintable():
        raise ValueError(f"--name {name!r}: a report's name is a plain file name (no folder, not hidden, no "
                         f"line breaks or control characters)")
    if out_dir / f"{name}.ipynb" == notebook:
        raise ValueError(f"{notebook}: the executed copy would overwrite the notebook; choose another out_dir or name")
    out_dir = check_dir_out(out_dir, "--out", whole=False)
    with removed_if_left_empty(out_dir), RunLock(out_dir / name, "--out", shown=out_dir):  # one run of this report there at a time
        for suffix in REPORT_FILES:  # replaced only when an earlier report run wrote them
            _claim(out_dir / f"{name}{suffix}", notebook)
        return _run_locked(notebook, out_dir, parameters, name)


REPORT_FILES = (".html", ".ipynb", ".failed.ipynb")


def _check_parameter_names(notebook: Path, parameters: dict) -> None:
    """Only parameters the notebook's parameters cell declares: papermill would inject any other name
    as a line of code, where a name that is not an identifier is a syntax error deep in the run."""
    declared = notebook_defaults(notebook)
    unknown = [name for name in parameters if name not in declared]
    if unknown:
        shown = ", ".join(repr(n)[:60] if not str(n).isidentifier() else str(n)[:60] for n in unknown[:5])
        names = list(declared)
        listed = ", ".join(names[:40]) + (f", ... ({len(names)} in all)" if len(names) > 40 else "")
        raise ValueError(f"-p {shown}: not a parameter of {notebook.name}; its parameters: {listed}")
    for name, value in parameters.items():
        _check_parameter_type(notebook, name, value, declared[name])


def _check_parameter_type(notebook: Path, name: str, value, default_source: str) -> None:
    """A value of the kind the parameters cell's default has (a number where a number goes, finite;
    true/false where a flag goes), so a wrong one is refused by name before a kernel starts, not a
    TypeError deep in the notebook. A default of None (or one that is not a literal) takes anything."""
    import ast
    import math

    try:
        default = ast.literal_eval(default_source)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return
    if default is None:
        return
    kinds = {bool: (bool,), int: (int,), float: (int, float), str: (str,), list: (list,), dict: (dict,)}
    wanted = kinds.get(type(default))
    if wanted is None:
        return
    shown = json.dumps(value)[:60] if not isinstance(value, float) else repr(value)
    if not isinstance(value, wanted) or (type(default) is not bool and isinstance(value, bool)):
        kind = {bool: "true or false", int: "an integer", float: "a number", str: "a text", list: "a JSON list",
                dict: "a JSON object"}[type(default)]
        raise ValueError(f"-p {name} {shown}: {notebook.name} expects {kind} (its default is {default_source[:60]})")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"-p {name} {shown}: must be a finite number")


def _claim(path: Path, notebook: Path) -> None:
    from glmkit.outputs import claim_file

    claim_file(path, "--out", "report file", {"notebook": str(notebook)})


def _check_notebook(notebook: Path) -> None:
    """A notebook papermill can run: JSON in nbformat 4's schema (refused by name before a kernel starts)."""
    import nbformat

    try:
        nb = nbformat.read(str(notebook), as_version=4)
        nbformat.validate(nb)
    except PermissionError:
        raise  # the environment's (exit 4), not a damaged notebook
    except Exception as err:  # noqa: BLE001 - any reader or schema failure is the input's
        first = (str(err).splitlines() or [type(err).__name__])[0][:200]
        raise ValueError(f"{notebook}: not a readable Jupyter notebook ({type(err).__name__}: {first})") from None
    language = (nb.metadata.get("language_info") or {}).get("name") or "python"
    if str(language).lower() != "python":  # papermill writes parameters in the notebook's language
        raise ValueError(f"{notebook}: its language_info.name is {str(language)[:60]!r}; glmkit report runs Python "
                         f"notebooks (language python)")
    for number, cell in enumerate(nb.cells, 1):
        if cell.cell_type != "markdown":
            continue
        held = cell.get("attachments") or {}
        for name in (bracketed or bare for bracketed, bare in _ATTACHMENT.findall(str(cell.source))):
            if name not in held:  # the HTML export would fail after the whole run
                raise ValueError(f"{notebook}: markdown cell {number} shows attachment:{name[:80]}, which the cell "
                                 f"does not hold; remove the reference or attach the file")


def _run_locked(notebook: Path, out_dir: Path, parameters: dict, name: str) -> Path:
    import papermill

    from glmkit.outputs import file_marker, mark_file
    from glmkit.report import stage_file

    parameters = dict(parameters, out_dir=str(out_dir))
    running = out_dir / f".{name}.running.ipynb"
    if running.is_symlink() or running.is_file():  # a leftover, or a link planted there: papermill would write through it
        running.unlink()
    started = time.time()
    try:
        # language: _check_notebook took only Python notebooks; one whose metadata names none is run as one
        papermill.execute_notebook(str(notebook), str(running), parameters=parameters, kernel_name=KERNEL,
                                   language="python", cwd=str(project_root(notebook)), progress_bar=True,
                                   log_output=False)
    except BaseException as err:
        if running.exists():
            failed = out_dir / f"{name}.failed.ipynb"
            os.replace(running, failed)
            mark_file(failed, "report file")
            err.add_note(f"executed notebook saved to {failed}")
        raise
    seconds = time.time() - started
    try:  # the report is rendered from the executed notebook before either replaces last run's pair
        verdict, reasons = read_verdict(out_dir, started, with_reasons=True)
        try:
            numbers = key_numbers(read_verdict_data(out_dir, started))
        except UNEXPECTED_LAYOUT:  # read_verdict's reasons say so
            numbers = []
        title = notebook_title(running, name)
        header = header_html(title, verdict, parameters, notebook_defaults(notebook), started, seconds, reasons, numbers)
        page = notebook_html(running, header, title)
    except BaseException as err:
        failed = out_dir / f"{name}.failed.ipynb"
        os.replace(running, failed)
        mark_file(failed, "report file")
        err.add_note(f"the notebook ran; its report could not be made. Executed notebook saved to {failed}")
        raise
    executed, html_path = out_dir / f"{name}.ipynb", out_dir / f"{name}.html"
    staged = stage_file(html_path, page.encode())  # whole before anything is replaced: a full disk stops here
    try:
        os.replace(running, executed)
        os.replace(staged, html_path)
    finally:
        staged.unlink(missing_ok=True)
    for path in (executed, html_path):
        mark_file(path, "report file")
    stale = out_dir / f"{name}.failed.ipynb"  # this run succeeded
    stale.unlink(missing_ok=True)
    file_marker(stale).unlink(missing_ok=True)
    return html_path


def notebook_title(notebook: Path, fallback: str) -> str:
    """The notebook's own title: the first level-1 heading of its first markdown cell, else `fallback`."""
    import nbformat

    try:
        nb = nbformat.read(str(notebook), as_version=4)
    except Exception:  # the title is cosmetic: an unreadable notebook is reported elsewhere
        return fallback
    for cell in nb.cells:
        if cell.get("cell_type") == "markdown":
            for line in str(cell.get("source", "")).splitlines():
                if line.startswith("# "):
                    return line[2:].strip() or fallback
            break
    return fallback


# ---------------------------------------------------------------- command line

def parse_value(text: str):
    """JSON when it parses (numbers, null, true, lists, dicts, quoted strings), else the text itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text
    except RecursionError:
        raise ValueError(f"a parameter value nested past {sys.getrecursionlimit()} levels: {text[:40]}...") from None
    except ValueError:  # an integer past Python's 4300-digit conversion limit
        raise ValueError(f"a parameter value holds an integer of more than {sys.get_int_max_str_digits()} digits "
                         f"({text[:20]}..., {len(text)} characters); pass it quoted as a JSON string if text is "
                         f"meant") from None


def cmd_report(args) -> int:
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    from nbformat import ValidationError
    from papermill.exceptions import PapermillExecutionError

    parameters = {name: parse_value(value) for name, value in args.parameter or []}
    from glmkit.report import resolve_out_dir

    # relative: from the checkout's root when run inside one (as the notebooks resolve theirs), else from here
    out = resolve_out_dir(args.out or Path("reports") / Path(args.notebook).stem)
    started = time.time()
    try:
        page = run_notebook(args.notebook, out, parameters, args.name)
    except (PapermillExecutionError, DeadKernelError, CellTimeoutError, ValidationError) as err:  # the notebook failed
        reason = f"{type(err).__name__}: {err}".strip().splitlines()
        print(f"glmkit report: notebook failed: {reason[-1] if reason else ''}", file=sys.stderr)
        for note in getattr(err, "__notes__", []):
            print(f"glmkit report: {note}", file=sys.stderr)
        return 1
    verdict, reasons = read_verdict(out, started, with_reasons=True)
    print(f"verdict: {verdict}" + "".join(f"\n  - {r}" for r in reasons) + f"\nreport: {page}")
    return 1 if verdict == "fail" else 0   # pass, unknown and "not enough rollouts to judge": 0


def add_report_command(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("report", help="run a notebook headless and write a self-contained HTML report")
    p.add_argument("notebook", help="the .ipynb to run (its first cell tagged `parameters`)")
    p.add_argument("--out", help="report directory (default: reports/NOTEBOOK_STEM)")
    p.add_argument("--name", help="report file name without extension (default: the notebook's stem)")
    p.add_argument("-p", "--parameter", nargs=2, action="append", metavar=("NAME", "VALUE"),
                   help="set a notebook parameter; VALUE is parsed as JSON when it parses, else taken as text")
    p.set_defaults(func=cmd_report)
    return p


def main(argv=None) -> int:
    """`report` on its own, for tests and until glmkit.cli registers it."""
    parser = argparse.ArgumentParser(prog="glmkit")
    add_report_command(parser.add_subparsers(dest="command", required=True, metavar="COMMAND"))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"glmkit {args.command}: error: {err}".splitlines()[0], file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
