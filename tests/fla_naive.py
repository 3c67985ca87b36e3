"""fla's pure-torch KDA reference (`fla/ops/kda/naive.py`), loaded from the fla-core wheel without
importing fla itself: on a CPU machine fla must not be importable (transformers would route KDA to
its Triton kernels), and naive.py only needs torch and einops."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import zipfile
from pathlib import Path

FLA_CORE = "fla-core==0.6.0"
WHEEL_DIR = Path(__file__).resolve().parents[1] / ".cache" / "wheels"


def _wheel() -> Path:
    found = sorted(WHEEL_DIR.glob("fla_core-0.6.0-*.whl"))
    if not found:
        WHEEL_DIR.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", FLA_CORE, "-d", str(WHEEL_DIR)],
                       check=True)
        found = sorted(WHEEL_DIR.glob("fla_core-0.6.0-*.whl"))
    return found[0]


def load():
    target = WHEEL_DIR / "fla_kda_naive.py"
    if not target.exists():
        with zipfile.ZipFile(_wheel()) as wheel:
            target.write_bytes(wheel.read("fla/ops/kda/naive.py"))
    spec = importlib.util.spec_from_file_location("fla_kda_naive", target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
