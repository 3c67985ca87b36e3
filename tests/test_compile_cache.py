"""glmkit's persistent compile cache (glmkit.kernels.compile_cache): one folder per set of versions,
set before anything compiles, shared by every process; a user's own settings win."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from glmkit.kernels import compile_cache
from glmkit.kernels.backends import Backends
from glmkit.kernels.registry import Target

VARIABLES = (*compile_cache.TOOL_DIRS, "TRITON_CACHE_AUTOTUNING", "GLMKIT_COMPILE_CACHE", "GLMKIT_CACHE_DIR",
             "XDG_CACHE_HOME")


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    for variable in VARIABLES:  # set, then removed: the test's end restores each as it was
        monkeypatch.setenv(variable, "")
        monkeypatch.delenv(variable)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    return monkeypatch


def test_the_plan_points_every_tool_at_one_versioned_folder(clean_env, tmp_path):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    clean_env.setenv("GLMKIT_CACHE_DIR", str(tmp_path / "cache"))
    clean_env.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what importing torch._dynamo writes
    plan = Backends().plan(Target.of("cpu"))
    folder = tmp_path / "cache" / "compile" / compile_cache.versions_key()
    assert plan.compile_cache == str(folder)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder / "inductor")
    assert os.environ["TRITON_CACHE_DIR"] == str(folder / "triton")
    assert os.environ["TILELANG_CACHE_DIR"] == str(folder / "tilelang")
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "1"
    key = compile_cache.versions_key()
    assert f"torch-{torch.__version__}".replace("/", "_") in key and "triton-" in key and "cuda-" in key
    assert "/" not in key and " " not in key


def test_the_cache_root_follows_xdg_then_home(clean_env, tmp_path):
    assert compile_cache.cache_root() == tmp_path / "home" / ".cache" / "glmkit"
    clean_env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache.cache_root() == tmp_path / "xdg" / "glmkit"
    clean_env.setenv("GLMKIT_CACHE_DIR", str(tmp_path / "own"))
    assert compile_cache.cache_root() == tmp_path / "own"


def test_a_users_own_setting_wins_and_off_changes_nothing(clean_env, tmp_path):
    clean_env.setenv("GLMKIT_CACHE_DIR", str(tmp_path / "cache"))
    clean_env.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    clean_env.setenv("TRITON_CACHE_AUTOTUNING", "0")
    compile_cache.use_compile_cache()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")
    assert os.environ["TRITON_CACHE_AUTOTUNING"] == "0"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path / "cache"))

    clean_env.delenv("TORCHINDUCTOR_CACHE_DIR")
    clean_env.setenv("GLMKIT_COMPILE_CACHE", "off")
    assert Backends().plan(Target.of("cpu")).compile_cache is None
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


PROBE = textwrap.dedent("""
    import json, torch
    from torch._dynamo.utils import counters
    from glmkit.kernels.backends import Backends
    from glmkit.kernels.fuse import fusable, fusing
    from glmkit.kernels.registry import Target

    Backends.parse("fuse=on").plan(Target.of("cpu"))

    @fusable
    def gate(x):
        return torch.sigmoid(x) * x + 1.0

    with fusing("on"):
        gate(torch.randn(16, 8))
    print(json.dumps(dict(counters["inductor"])))
""")


def test_a_second_process_takes_the_first_ones_compiled_graph(tmp_path):
    """The point of the cache: a new process (a notebook kernel, a CLI run, the server) finds the graph
    the first one compiled instead of compiling it again (inductor's own hit/miss counters)."""
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES}
    env["GLMKIT_CACHE_DIR"] = str(tmp_path / "cache")
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    runs = [subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    import json

    first, second = (json.loads(run.stdout.strip().splitlines()[-1]) for run in runs)
    assert first.get("fxgraph_cache_miss", 0) >= 1 and not first.get("fxgraph_cache_hit")
    assert second.get("fxgraph_cache_hit", 0) >= 1 and not second.get("fxgraph_cache_miss")
    assert any((tmp_path / "cache" / "compile").glob("*/inductor/fxgraph"))


@pytest.mark.parametrize("value, needle", [
    ("~nosuchuser-glmkit/x", "GLMKIT_CACHE_DIR='~nosuchuser-glmkit/x': "),
    ("a\nb", "GLMKIT_CACHE_DIR='a\\nb': holds a line break or control character"),
    ("FILE", "GLMKIT_CACHE_DIR: cannot make "),
])
def test_a_cache_dir_that_names_no_folder_is_refused_by_its_variable(clean_env, tmp_path, value, needle):
    """Hostile pass 11: '~nosuchuser/x' was an internal error (exit 3) on every command that plans
    kernels, a newline reached the C++ compiler, a file in the way was an errno without the variable."""
    if value == "FILE":
        (tmp_path / "afile").write_text("")
        value = str(tmp_path / "afile")
    clean_env.setenv("GLMKIT_CACHE_DIR", value)
    with pytest.raises(ValueError, match=re.escape(needle)):
        Backends().plan(Target.of("cpu"))


def test_an_unwritable_default_place_warns_and_leaves_the_tools_defaults(clean_env, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / ".cache").write_text("")  # a file where the cache folder would go
    with pytest.warns(UserWarning, match="compiled kernels are cached where each tool defaults to"):
        assert Backends().plan(Target.of("cpu")).compile_cache is None
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_a_relative_cache_dir_is_made_absolute(clean_env, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    clean_env.setenv("GLMKIT_CACHE_DIR", "rel")
    assert compile_cache.cache_root() == tmp_path / "rel"
