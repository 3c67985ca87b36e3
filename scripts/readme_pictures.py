"""The README's picture of each notebook, taken from its last executed report:

    make report report-grpo report-launch && .venv/bin/python scripts/readme_pictures.py

Each picture is the first figure of the report whose text names the view (the layer x site heatmap,
the GRPO metrics), copied as PNG into docs/img/. A report that is missing is named and skipped."""

from __future__ import annotations

import base64
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PICTURES = {  # picture: (executed notebook, text the figure's output carries)
    "01_layer_parity.png": ("reports/01_layer_parity/01_layer_parity.ipynb", "SiteHeatmap"),
    "02_smoke_grpo.png": ("reports/02_smoke_grpo/02_smoke_grpo.ipynb", "GRPO metrics"),
    "03_multinode_launch.png": ("reports/03_multinode_launch/03_multinode_launch.ipynb", "GRPO metrics"),
}


def first_figure(notebook: Path, text: str) -> bytes | None:
    for cell in json.loads(notebook.read_text()).get("cells", []):
        for output in cell.get("outputs", []):
            data = output.get("data", {})
            caption = "".join(data.get("text/plain", ""))
            if "image/png" in data and text in caption:
                return base64.b64decode("".join(data["image/png"]))
    return None


def main() -> int:
    out = ROOT / "docs" / "img"
    out.mkdir(parents=True, exist_ok=True)
    missing = 0
    for name, (notebook, text) in PICTURES.items():
        path = ROOT / notebook
        png = first_figure(path, text) if path.is_file() else None
        if png is None:
            print(f"{name}: no figure with {text!r} in {notebook} (run its report first)", file=sys.stderr)
            missing += 1
            continue
        (out / name).write_bytes(png)
        print(f"{out / name}: {len(png)} bytes")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main())
