"""Views of a launch: the cluster inventory and the preflight checks, each an HTML table (the widget,
and the static rendering that `show` puts beside it for a headless run and its report)."""

from __future__ import annotations

import html

import ipywidgets as W

PASS, FAIL = "#e6f4ea", "#fce8e6"


class _Table:
    title = ""
    columns: tuple = ()

    def __init__(self, rows: list[dict]):
        self.rows = [dict(r) for r in rows]
        self.widget = W.HTML(self.html)

    def background(self, row: dict) -> str:
        return "#ffffff"

    def cell(self, row: dict, column: str) -> str:
        value = row.get(column)
        return "—" if value is None else (f"{value:.1f}" if isinstance(value, float) else str(value))

    @property
    def text(self) -> str:
        return self.title

    @property
    def html(self) -> str:
        style = "border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top"
        head = "".join(f"<th style='{style};background:#f4f4f4'>{html.escape(c)}</th>" for c in self.columns)
        body = "".join(f"<tr style='background:{self.background(r)}'>"
                       + "".join(f"<td style='{style}'>{html.escape(self.cell(r, c))}</td>" for c in self.columns)
                       + "</tr>" for r in self.rows)
        return (f"<div style='font-size:0.85em'><div style='margin-bottom:4px'>{html.escape(self.text)}</div>"
                f"<table style='border-collapse:collapse'><tr>{head}</tr>{body}</table></div>")

    def _repr_html_(self) -> str:
        return self.html


class InventoryTable(_Table):
    """Nodes as glmkit.launch.cluster.inventory returns them."""

    columns = ("node", "ip", "alive", "gpus", "gpu_type", "gpu_memory_gib", "cpus", "memory_gib")

    @property
    def text(self) -> str:
        alive = [r for r in self.rows if r.get("alive")]
        return (f"cluster: {len(alive)} of {len(self.rows)} node(s) alive, "
                f"{sum(r.get('gpus', 0) for r in alive)} GPUs, {sum(r.get('cpus', 0) for r in alive)} CPUs")

    def background(self, row):
        return PASS if row.get("alive") else FAIL


class PreflightTable(_Table):
    """glmkit.launch.preflight Checks (name, ok, detail), green pass / red fail."""

    columns = ("check", "result", "detail")

    def __init__(self, checks):
        super().__init__([{"check": c.name, "result": "PASS" if c.ok else "FAIL", "detail": c.detail} for c in checks])

    @property
    def text(self) -> str:
        failed = sum(r["result"] == "FAIL" for r in self.rows)
        return f"preflight: {len(self.rows) - failed} passed, {failed} failed"

    def background(self, row):
        return PASS if row.get("result") == "PASS" else FAIL
