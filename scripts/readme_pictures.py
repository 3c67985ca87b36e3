"""The README's picture of each notebook, from its last report run:

    make report report-grpo report-launch && .venv/bin/python scripts/readme_pictures.py

01: the layer x site heatmap, the first figure of the executed report. 02 and 03: the GRPO metrics'
small multiples (`widgets.LiveMetrics`) drawn from the run's metrics.jsonl. Written as PNG into
docs/img/; a report that is missing is named and skipped (exit 1)."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
HEATMAP = ("01_layer_parity.png", "reports/01_layer_parity/01_layer_parity.ipynb", "SiteHeatmap")
METRICS = {"02_smoke_grpo.png": "reports/02_smoke_grpo/metrics.jsonl",
           "03_multinode_launch.png": "reports/03_multinode_launch/metrics.jsonl"}


def first_figure(notebook: Path, text: str) -> bytes | None:
    for cell in json.loads(notebook.read_text()).get("cells", []):
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            if "image/png" in data and text in "".join(data.get("text/plain", "")):
                return base64.b64decode("".join(data["image/png"]))
    return None


def metrics_figure(path: Path) -> bytes:
    from glmkit.report import figure_png
    from widgets.training import LiveMetrics

    return base64.b64decode(figure_png(LiveMetrics.from_jsonl(path, variant="tiny").figure()))


def main() -> int:
    out = ROOT / "docs" / "img"
    out.mkdir(parents=True, exist_ok=True)
    pictures = {}
    name, notebook, text = HEATMAP
    if (ROOT / notebook).is_file():
        pictures[name] = first_figure(ROOT / notebook, text)
    for name, metrics in METRICS.items():
        if (ROOT / metrics).is_file():
            pictures[name] = metrics_figure(ROOT / metrics)
    missing = [n for n in [HEATMAP[0], *METRICS] if not pictures.get(n)]
    for name, png in pictures.items():
        if png:
            (out / name).write_bytes(png)
            print(f"{out / name}: {len(png)} bytes")
    for name in missing:
        print(f"{name}: its report has not been run (see the module docstring)", file=sys.stderr)
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
