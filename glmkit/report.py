"""Shareable reports: one self-contained HTML file (figures inlined as PNG) plus the JSON it shows,
written atomically so a half-written report never looks complete."""

from __future__ import annotations

import base64
import html
import io
import json
import math
import os
import platform
import secrets
from importlib import metadata
from pathlib import Path


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for pkg in ("glmkit", "torch", "transformers", "safetensors", "flash-linear-attention", "tilelang"):
        try:
            found[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return found


def json_safe(value):
    """`value` with every non-finite float as None, so the JSON written is strict JSON (NaN and inf
    are not JSON; readers in other languages refuse them)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def checkout_root(start: Path) -> Path | None:
    """The glmkit checkout holding `start` (the nearest folder above it whose pyproject.toml names the
    project glmkit), or None outside one."""
    for folder in (start, *start.parents):
        project = folder / "pyproject.toml"
        try:
            if project.is_file() and 'name = "glmkit"' in project.read_text(errors="replace")[:4096]:
                return folder
        except OSError:
            continue
    return None


def resolve_out_dir(out_dir) -> Path:
    """Where a relative output folder goes, the same from the CLI, papermill and JupyterLab (whose kernel
    starts in notebooks/): against the checkout's root when the working directory is inside a glmkit
    checkout, else against the working directory. Absolute paths are kept; the result is absolute."""
    path = Path(out_dir).expanduser()
    if path.is_absolute():
        return Path(os.path.abspath(path))
    cwd = Path.cwd()
    return Path(os.path.abspath((checkout_root(cwd) or cwd) / path))


def write_atomic(path: Path, data: bytes | str, encoding: str = "utf-8", errors: str = "strict") -> Path:
    """Write to a new temporary sibling, then rename over `path` (a reader never sees half a file).

    The temporary has a random name and is created exclusively (O_EXCL, never through a link: a name
    planted in advance cannot redirect the write), with the umask's usual permissions."""
    return write_together([(path, data)], encoding, errors)[0]


def write_together(files, encoding: str = "utf-8", errors: str = "strict") -> list[Path]:
    """Write several files that belong together (a report's .json and .html): each is staged whole
    under a temporary name first, and only when all are staged are they renamed into place, so a
    failure (a full disk) replaces none of them instead of leaving a new one beside a stale one."""
    staged = []
    try:
        for path, data in files:
            path = Path(path)
            payload = data.encode(encoding, errors) if isinstance(data, str) else data
            staged.append((stage_file(path, payload), path))
        for tmp, path in staged:
            os.replace(tmp, path)
    finally:
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
    return [path for _, path in staged]


def stage_file(path: Path, payload: bytes) -> Path:
    """`payload` written whole to a fresh temporary sibling of `path` -> its name."""
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    for _ in range(100):
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            fd = os.open(tmp, flags, 0o666)
            break
        except FileExistsError:  # a name taken (or planted): draw another
            continue
    else:
        raise FileExistsError(f"{path.parent}: no free temporary name for {path.name}")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
    except OSError as err:  # a full disk, a file-size limit: named by the file it was for
        tmp.unlink(missing_ok=True)
        if err.filename is None and err.errno is not None:
            raise OSError(err.errno, err.strerror, str(path)) from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def figure_png(fig) -> str:
    """A matplotlib figure as a base64 PNG string (the figure is closed)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def table(rows: list[dict], columns: list[str]) -> str:
    head = "".join(f"<th>{html.escape(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(r.get(c)))}</td>" for c in columns) + "</tr>"
                   for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return "" if value is None else str(value)


def short_number(value) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def divergence_text(first: dict, thresholds: dict) -> str:
    """Where and why two paths part ways, from the first divergent site (`SiteResult.public()`, as
    parity.json stores it) and the comparison's thresholds:
    "layer 0, site attn_out (rel RMS 0.52 > threshold 0.0001)"."""
    layer = "final" if first.get("layer") is None else first["layer"]
    if first.get("kind") == "indices":
        allowed = 1 - thresholds.get("identical", 1.0)
        detail = (f"different rows {short_number(first.get('different'))} > {allowed:.3g} allowed "
                  f"(ties {short_number(first.get('tied'))})")
    elif first.get("nan") or first.get("inf"):
        detail = f"NaN {first.get('nan', 0)}, Inf {first.get('inf', 0)}"
    else:
        detail = f"rel RMS {short_number(first.get('rel_rms'))} > threshold {thresholds.get('rel_rms')}"
    return f"layer {layer}, site {first.get('site')} ({detail})"


def html_report(title: str, verdict: str, header: dict, sections: list[tuple[str, str]]) -> str:
    """verdict "pass"/"fail" banner, a header table (parameters, versions), then (heading, html) sections."""
    color = "#1b7f3b" if verdict == "pass" else "#b3261e"
    head_rows = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_fmt(v))}</td></tr>"
                        for k, v in header.items())
    body = "".join(f"<h2>{html.escape(h)}</h2>{content}" for h, content in sections)
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:sans-serif;max-width:1100px;margin:2em auto}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:left}}.verdict{{color:#fff;background:{color};
padding:.6em 1em;font-size:1.3em}}img{{max-width:100%}}</style></head><body>
<h1>{html.escape(title)}</h1><div class="verdict">verdict: {html.escape(verdict.upper())}</div>
<table>{head_rows}</table>{body}</body></html>"""


def image(png_b64: str, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{png_b64}">'


def write_report(out_dir: Path, name: str, html_text: str, data: dict) -> tuple[Path, Path]:
    """`name`.json (strict JSON: a NaN or Inf figure is null) and `name`.html, written together."""
    out_dir = Path(out_dir)
    text = json.dumps(json_safe(data), indent=2, allow_nan=False)
    json_path, html_path = write_together([(out_dir / f"{name}.json", text),
                                           (out_dir / f"{name}.html", html_text)])
    return html_path, json_path
