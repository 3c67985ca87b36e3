"""Run a notebook headless (papermill) and turn it into one self-contained HTML report.

    run_notebook("notebooks/01_layer_parity.ipynb", "reports/01", {"variant": "tiny"})
        -> reports/01/01_layer_parity.html   (header: notebook, verdict, parameters, versions, time)
           reports/01/01_layer_parity.ipynb  (the executed notebook)

The kernel runs with the repository root as its working directory (so `glmkit` and `widgets` import
and relative paths in parameters resolve from there) and gets `out_dir` as a parameter. The verdict
is read from `{out_dir}/verdict.json` or `{out_dir}/parity.json` (the first of the two this run wrote),
"unknown" otherwise. Files are written under temporary names and renamed when complete; a notebook
that fails leaves `{name}.failed.ipynb` (with the error in it) and no new HTML.

`add_report_command(subparsers)` adds `glmkit report NOTEBOOK [--out DIR] [-p NAME VALUE]...`.
"""

from __future__ import annotations

import argparse
import html
import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path

from glmkit.report import versions, write_atomic

KERNEL = "python3"   # ipykernel's spec; jupyter_client runs it with this interpreter
VERDICT_FILES = ("verdict.json", "parity.json")  # looked for in this order; any notebook may write either
VERDICT_FILE = "parity.json"   # notebook 01's file (kept for callers of the old name)
VERDICT_COLORS = {"pass": "#1b7f3b", "fail": "#b3261e"}


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

    return {name: info["default"] for name, info in papermill.inspect_notebook(str(notebook)).items()}


def read_verdict(out_dir: Path, since: float, with_reasons: bool = False):
    """The verdict in out_dir/verdict.json or out_dir/parity.json (the first that this run, started at
    `since`, wrote), "unknown" when neither was. With `with_reasons`: (verdict, its reasons and
    warnings as written there)."""
    for name in VERDICT_FILES:
        path = Path(out_dir) / name
        try:
            if path.stat().st_mtime < since:
                continue   # left over from an earlier run
            data = json.loads(path.read_text())
            verdict = str(data.get("verdict", "unknown"))
            reasons = [str(r) for r in (data.get("reasons") or []) + (data.get("warnings") or [])]
            return (verdict, reasons) if with_reasons else verdict
        except (OSError, json.JSONDecodeError, AttributeError, TypeError):
            continue
    return ("unknown", []) if with_reasons else "unknown"


def header_html(name: str, verdict: str, parameters: dict, defaults: dict, started: float, seconds: float,
                reasons=()) -> str:
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
    return f"""<div id="glmkit-report-header" style="font-family:sans-serif;margin:1em 2em 2em 2em">
<h1 style="margin:0 0 .4em 0">{html.escape(name)}</h1>
<div style="background:{color};color:#fff;padding:.5em 1em;font-size:1.3em">verdict: {html.escape(verdict.upper())}</div>
{reason_list}
<style>#glmkit-report-header td, #glmkit-report-header th {{{cell}}}</style>
<h3>parameters</h3>
<table style="border-collapse:collapse"><tr><th>name</th><th>value</th><th></th></tr>{''.join(rows)}</table>
<p>versions: {html.escape(version_text)}</p>
<p>run at {html.escape(when)}, took {seconds:.1f} s</p>
</div>"""


def notebook_html(executed: Path, header: str) -> str:
    """The executed notebook as one HTML page (outputs' images are inline data URIs), header first."""
    import nbformat
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="lab", embed_images=True)
    body, _ = exporter.from_notebook_node(nbformat.read(str(executed), as_version=4))
    start = body.find("<body")
    if start < 0:
        return header + body
    end = body.index(">", start) + 1
    return body[:end] + header + body[end:]


def run_notebook(notebook, out_dir, parameters: dict, name: str | None = None) -> Path:
    """Execute `notebook` with `parameters` (plus out_dir) and write {out_dir}/{name}.html; returns its path.
    On an execution error the executed notebook is kept as {name}.failed.ipynb and the error re-raised."""
    import papermill

    notebook, out_dir = Path(notebook).resolve(), Path(out_dir).resolve()
    if not notebook.is_file():
        raise FileNotFoundError(f"{notebook}: no such notebook")
    name = name or notebook.stem
    if out_dir / f"{name}.ipynb" == notebook:
        raise ValueError(f"{notebook}: the executed copy would overwrite the notebook; choose another out_dir or name")
    out_dir.mkdir(parents=True, exist_ok=True)
    parameters = dict(parameters, out_dir=str(out_dir))
    running = out_dir / f".{name}.running.ipynb"
    started = time.time()
    try:
        papermill.execute_notebook(str(notebook), str(running), parameters=parameters, kernel_name=KERNEL,
                                   cwd=str(project_root(notebook)), progress_bar=True, log_output=False)
    except BaseException as err:
        if running.exists():
            failed = out_dir / f"{name}.failed.ipynb"
            os.replace(running, failed)
            err.add_note(f"executed notebook saved to {failed}")
        raise
    seconds = time.time() - started
    executed = out_dir / f"{name}.ipynb"
    os.replace(running, executed)
    (out_dir / f"{name}.failed.ipynb").unlink(missing_ok=True)  # stale: this run succeeded
    verdict, reasons = read_verdict(out_dir, started, with_reasons=True)
    header = header_html(name, verdict, parameters, notebook_defaults(notebook), started, seconds, reasons)
    return write_atomic(out_dir / f"{name}.html", notebook_html(executed, header))


# ---------------------------------------------------------------- command line

def parse_value(text: str):
    """JSON when it parses (numbers, null, true, lists, dicts, quoted strings), else the text itself."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def cmd_report(args) -> int:
    from nbclient.exceptions import CellTimeoutError, DeadKernelError
    from papermill.exceptions import PapermillExecutionError

    parameters = {name: parse_value(value) for name, value in args.parameter or []}
    out = Path(args.out or Path("reports") / Path(args.notebook).stem)
    started = time.time()
    try:
        page = run_notebook(args.notebook, out, parameters, args.name)
    except (PapermillExecutionError, DeadKernelError, CellTimeoutError) as err:
        reason = f"{type(err).__name__}: {err}".strip().splitlines()
        print(f"glmkit report: notebook failed: {reason[-1] if reason else ''}", file=sys.stderr)
        for note in getattr(err, "__notes__", []):
            print(f"glmkit report: {note}", file=sys.stderr)
        return 1
    verdict = read_verdict(out, started)
    print(f"verdict: {verdict}\nreport: {page}")
    return 1 if verdict == "fail" else 0


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
