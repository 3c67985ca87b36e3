"""The notebooks run headless (papermill) into self-contained HTML reports, as CI runs them."""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest

from glmkit.checkpoint import synth_checkpoint
from glmkit.notebook import main, parse_value, run_notebook
from tests.test_report_offline import assert_offline

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"
LAYER_PARITY = NOTEBOOKS / "01_layer_parity.ipynb"
INLINE_PNG = re.compile(r'<img[^>]+src="data:image/png;base64,')
RECIPE_METRIC = "train/train_rollout_logprob_abs_diff"


def report_header(text: str) -> str:
    return text[text.index('id="glmkit-report-header"'):text.index("<h3>parameters</h3>")]


@pytest.fixture(scope="module")
def passing_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("nb-pass") / "report"
    return out, run_notebook(LAYER_PARITY, out, {})


def test_committed_notebooks_have_no_outputs():
    for path in NOTEBOOKS.glob("*.ipynb"):
        nb = nbformat.read(str(path), as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{path.name}: clear its outputs"
        first_code = next(c for c in nb.cells if c.cell_type == "code")
        assert "parameters" in first_code.metadata.get("tags", []), f"{path.name}: tag the first code cell"


def test_layer_parity_passes_on_tiny(passing_run):
    out, page = passing_run
    assert page == out.resolve() / "01_layer_parity.html"
    data = json.loads((out / "parity.json").read_text())
    assert data["verdict"] == "pass" and data["first_divergence"] is None
    assert data["paths"] == ["reference", "train"] and data["train_rollout"]["verdict"] == "pass"
    assert data["train_rollout"]["logprob_abs_diff"] < 1e-4
    assert data["parameters"]["seq_len"] == 64 and data["parameters"]["out_dir"] == str(out.resolve())
    assert set(data["kda_max_rel_error"]) == {"0", "1", "2"}
    text = page.read_text()
    assert text.index('id="glmkit-report-header"') < text.index("<main")  # header at the very top
    assert "verdict: PASS" in text
    for name, value in (("variant", "&quot;tiny&quot;"), ("paths", "&quot;reference,train&quot;"),
                        ("seq_len", "64"), ("out_dir", f"&quot;{out.resolve()}&quot;")):
        assert re.search(rf"<td>{name}</td><td><code>{re.escape(value)}", text), name
    assert re.search(r"torch 2\.\d+", text)
    # each view once: heatmap, histogram, KDA curve, two overlaps as PNG; the two banners as HTML
    assert len(INLINE_PNG.findall(text)) == 5
    assert text.count("PASS: all ") == 2
    assert_offline(text)
    # each banner's log-prob diff says what it compares; only train vs rollout is the recipe's metric
    assert text.count("mean |logp_reference - logp_train| = ") == 1
    assert re.search(r"mean \|logp_reference - logp_train\| = [0-9.e+-]+</div>", text)
    assert re.search(rf"mean \|logp_train - logp_rollout\| \(the recipe(?:'|&#x27;|&#39;)s {RECIPE_METRIC}\) = ", text)
    assert "first divergence" not in report_header(text)   # a pass: no failure listed under the banner
    # what stays next to the report: the executed notebook, the report files' ownership markers, and no
    # temporary or failure files
    assert (out / "01_layer_parity.ipynb").is_file()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".") or "failed" in p.name) == \
        [".01_layer_parity.html.glmkit-output", ".01_layer_parity.ipynb.glmkit-output"]


def test_layer_parity_fails_against_another_checkpoint(tmp_path, capsys):
    other = synth_checkpoint("tiny", 1, tmp_path / "other", progress=False)
    out = tmp_path / "report"
    assert main(["report", str(LAYER_PARITY), "--out", str(out), "-p", "checkpoint_b", str(other)]) == 1
    assert "verdict: fail" in capsys.readouterr().out
    data = json.loads((out / "parity.json").read_text())
    assert data["verdict"] == "fail" and data["parameters"]["checkpoint_b"] == str(other)
    first = data["first_divergence"]
    assert first["layer"] == 0 and first["rel_rms"] > data["thresholds"]["rel_rms"]
    text = (out / "01_layer_parity.html").read_text()
    assert "verdict: FAIL" in text and len(INLINE_PNG.findall(text)) == 5
    # the header says why, under the banner: the first divergence of the comparison, with its threshold
    header = report_header(text)
    assert re.search(r"<li>reference vs train: first divergence at layer 0, site [\w.]+ \(rel RMS [0-9.e+-]+ &gt; "
                     r"threshold 0\.0001\); \d+ of \d+ sites diverge</li>", header), header
    assert_offline(text)


def small_notebook(path: Path, body: str) -> Path:
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell("out_dir = None\nmessage = 'hi'", metadata={"tags": ["parameters"]}),
        nbformat.v4.new_code_cell(body)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(path))
    return path


def test_notebook_without_verdict_reports_unknown_and_exits_0(tmp_path, capsys):
    notebook = small_notebook(tmp_path / "hello.ipynb", "print(message * 2)")
    out = tmp_path / "report"
    assert main(["report", str(notebook), "--out", str(out), "-p", "message", "yo"]) == 0
    assert "verdict: unknown" in capsys.readouterr().out
    text = (out / "hello.html").read_text()
    assert "verdict: UNKNOWN" in text and "yoyo" in text and "&quot;yo&quot;" in text


def test_a_notebook_whose_metadata_names_no_kernel_runs_as_python(tmp_path, capsys):
    """Hostile pass 12: metadata {} (no kernelspec, no language_info) ended in exit 3 (papermill's
    ValueError); -p on it was refused. A notebook that names no language is a Python one here."""
    notebook = small_notebook(tmp_path / "bare.ipynb", "print(message * 2)")
    nb = nbformat.read(str(notebook), as_version=4)
    nb.metadata = {}
    nbformat.write(nb, str(notebook))
    assert main(["report", str(notebook), "--out", str(tmp_path / "report"), "-p", "message", "yo"]) == 0
    assert "verdict: unknown" in capsys.readouterr().out
    assert "yoyo" in (tmp_path / "report" / "bare.html").read_text()


def test_failing_notebook_keeps_the_executed_copy_and_no_html(tmp_path, capsys):
    notebook = small_notebook(tmp_path / "broken.ipynb", "raise RuntimeError('boom: ' + message)")
    out = tmp_path / "report"
    assert main(["report", str(notebook), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "boom: hi" in err and "broken.failed.ipynb" in err
    failed = nbformat.read(str(out / "broken.failed.ipynb"), as_version=4)
    assert any(o.get("ename") == "RuntimeError" for c in failed.cells for o in c.get("outputs", []))
    assert sorted(p.name for p in out.iterdir()) == [".broken.failed.ipynb.glmkit-output", "broken.failed.ipynb"]
    from papermill.exceptions import PapermillExecutionError

    with pytest.raises(PapermillExecutionError):
        run_notebook(notebook, out, {})


def test_bad_input_exits_2(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing.ipynb"), "--out", str(tmp_path / "r")]) == 2
    assert "no such notebook" in capsys.readouterr().err
    notebook = small_notebook(tmp_path / "self.ipynb", "pass")
    assert main(["report", str(notebook), "--out", str(tmp_path)]) == 2
    assert "would overwrite the notebook" in capsys.readouterr().err


def test_parameter_values_parse_as_json_else_text():
    assert parse_value("64") == 64 and parse_value("1e-4") == 1e-4 and parse_value("null") is None
    assert parse_value('{"rel_rms": 1e-4}') == {"rel_rms": 1e-4} and parse_value("true") is True
    assert parse_value("tiny") == "tiny" and parse_value("reference,train") == "reference,train"
    assert parse_value("/tmp/ck") == "/tmp/ck"


def test_notebook_may_write_its_verdict_to_verdict_json(tmp_path, capsys):
    body = ("import json, os\n"
            "open(os.path.join(out_dir, 'verdict.json'), 'w').write(json.dumps({'verdict': message}))")
    notebook = small_notebook(tmp_path / "judge.ipynb", body)
    out = tmp_path / "report"
    assert main(["report", str(notebook), "--out", str(out), "-p", "message", "fail"]) == 1
    assert "verdict: fail" in capsys.readouterr().out
    assert "verdict: FAIL" in (out / "judge.html").read_text()
    assert main(["report", str(notebook), "--out", str(out), "-p", "message", "pass"]) == 0
    assert "verdict: pass" in capsys.readouterr().out


def test_read_verdict_takes_the_files_this_run_wrote(tmp_path):
    import os

    from glmkit.notebook import read_verdict

    assert read_verdict(tmp_path, 0) == "unknown"
    (tmp_path / "parity.json").write_text(json.dumps({"verdict": "pass"}))
    assert read_verdict(tmp_path, 0) == "pass"                      # parity.json alone, as before
    (tmp_path / "verdict.json").write_text(json.dumps({"verdict": "fail"}))
    assert read_verdict(tmp_path, 0) == "fail"                      # verdict.json first
    os.utime(tmp_path / "verdict.json", (1000, 1000))               # left over from an earlier run
    assert read_verdict(tmp_path, 2000) == "pass"
    os.utime(tmp_path / "parity.json", (1000, 1000))
    assert read_verdict(tmp_path, 2000) == "unknown"
    (tmp_path / "verdict.json").write_text("{half")                 # unreadable: falls through
    assert read_verdict(tmp_path, 2000) == "unknown"



def test_an_unreadable_notebook_is_the_environments_error(tmp_path):
    """Permission denied is exit 4 by the CLI's contract (it was reported as a damaged notebook, exit 2).
    As root (CI), the run drops to user nobody with setpriv, so the mode really refuses the read."""
    import os
    import shutil
    import subprocess
    import sys

    nb = tmp_path / "x.ipynb"
    nb.write_text("{}")
    nb.chmod(0)
    tmp_path.chmod(0o755)
    code = "import sys; from glmkit.cli import main; sys.exit(main(['report', sys.argv[1], '--out', sys.argv[2]]))"
    argv = [sys.executable, "-c", code, str(nb), str(tmp_path / "out")]
    if os.geteuid() == 0:
        if shutil.which("setpriv") is None:
            pytest.skip("root without setpriv: no user to drop to")
        drop = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
        if subprocess.run([*drop, sys.executable, "-c", "import glmkit.cli"], capture_output=True,
                          cwd=tmp_path, timeout=300).returncode != 0:
            pytest.skip("user nobody cannot read this checkout or its environment")
        argv = [*drop, *argv]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 4, out.stderr[-2000:]
    assert "environment error: Permission denied" in out.stderr


def test_every_parameter_line_is_read_by_papermill():
    """papermill skips (with a warning) a parameters line holding more than one '=': notebook 01's
    `backends = "kda=torch,..."` could not be set headless. Each notebook's parameters cell, as Python
    reads it, names exactly what papermill's own inspector finds."""
    import ast

    import papermill

    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(str(path), as_version=4)
        cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
        assigned = [t.id for node in ast.parse(cell.source).body if isinstance(node, ast.Assign) for t in node.targets]
        assert list(papermill.inspect_notebook(str(path))) == assigned, path.name


def test_a_parameter_the_notebook_does_not_declare_is_refused_by_name(tmp_path, capsys):
    """Hostile pass 6: `report -p 'a-b' 1` was injected as code, a SyntaxError in the run, exit 1."""
    notebook = small_notebook(tmp_path / "hello.ipynb", "print(message)")
    for name in ("a-b", "mesage"):
        assert main(["report", str(notebook), "--out", str(tmp_path / "r"), "-p", name, "1"]) == 2
        err = capsys.readouterr().err
        assert f"not a parameter of hello.ipynb; its parameters: out_dir, message" in err, err
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_the_report_header_holds_the_numbers_a_reader_compares_and_the_notebooks_title(passing_run):
    """Issue 36 (3): a report's header held the verdict alone, and its page title read "Notebook"."""
    out, page = passing_run
    text = page.read_text()
    header = report_header(text)
    for label in ("first diverging site</th><td>none", "worst site</th><td>layer ",
                  "train-vs-rollout log-prob abs diff</th><td>", "DSA ties replayed</th><td>", "wall time</th><td>"):
        assert label in header, label
    title = json.loads(LAYER_PARITY.read_text())["cells"][0]["source"][0].removeprefix("# ").strip()
    assert f"<title>{title}</title>" in text.replace("&#183;", "·") and f">{title}</h1>" in header


def test_a_verdict_file_of_another_layout_is_said_in_the_header_not_crashed_on(tmp_path):
    """Hostile pass 8: a verdict.json with a number where a list was expected (sites: 5, observations: [1],
    health: ["x"], a text rel_rms) was exit 3 when the report's header read it. The report is written and
    its header says the file's layout is not one glmkit reads."""
    import json
    import time

    from glmkit.notebook import read_verdict

    started = time.time() - 1
    for data in ({"verdict": "pass", "sites": 5}, {"verdict": "pass", "train_rollout": [1], "first_divergence": None},
                 {"verdict": "fail", "first_divergence": {"layer": 0, "site": "x", "rel_rms": "big"}, "thresholds": [1]}):
        (tmp_path / "verdict.json").write_text(json.dumps(data))
        verdict, reasons = read_verdict(tmp_path, started, with_reasons=True)
        assert verdict == data["verdict"]
        if "sites" in data:  # nothing to say of a pass whose sites are not a list: no reasons, no crash
            assert reasons == []
        else:
            assert len(reasons) == 1 and reasons[0].startswith("the verdict file's layout is not one glmkit reads (")


def test_key_numbers_of_a_grpo_run_and_a_launch():
    from glmkit.notebook import key_numbers

    grpo = {"raw_reward_start": 0.41, "raw_reward_end": 0.88,
            "observations": [{"metric": "eval/raw_reward", "first": 0.07, "last": 0.12}],
            "health": [{"metric": "train/ppo_kl", "observed": "1e-4 - 3e-4"},
                       {"metric": "rollout/raw_reward", "observed": "x"}]}
    assert key_numbers(grpo) == [("raw reward (training prompts)", "0.41 -> 0.88 (mean of the first 3 rollouts -> "
                                                                    "of the last 5)"),
                                 ("raw reward (held-out prompts)", "0.07 -> 0.12 (first evaluation -> last)"),
                                 ("train/ppo_kl", "1e-4 - 3e-4")]
    launch = {"backend": "miles", "shape": {"nodes": 16, "gpus_per_node": 4}, "job": None, "metric_rows": 0}
    assert key_numbers(launch) == [("shape", "nodes 16, gpus_per_node 4"), ("job", "none (not submitted)"),
                                   ("metric rows", "0")]
    # what ran comes first: a pass beside a 16 x 4 shape must not read as a launch of that shape
    ran = "builtin: glmkit's GRPO, preset tiny, 6 rollouts, on a Ray head this notebook started on 127.0.0.1"
    assert key_numbers({**launch, "backend": "builtin", "ran": ran})[0] == ("ran", ran)
    assert key_numbers({"verdict": "pass"}) == [] and key_numbers({}) == []


def test_a_relative_out_dir_resolves_the_same_from_the_root_from_notebooks_and_outside(tmp_path, monkeypatch):
    """Issue 36 (4): started from JupyterLab (kernel in notebooks/) a notebook's relative out_dir landed
    in notebooks/reports/, not where the CLI and the README put it. Inside the checkout a relative path
    is taken from its root; outside one, from the working directory; absolute paths are kept."""
    from glmkit.report import resolve_out_dir

    root = NOTEBOOKS.parent
    for where in (root, NOTEBOOKS, root / "glmkit" / "model"):
        monkeypatch.chdir(where)
        assert resolve_out_dir("reports/01_layer_parity") == root / "reports" / "01_layer_parity"
    monkeypatch.chdir(tmp_path)
    assert resolve_out_dir("reports/x") == tmp_path / "reports" / "x"
    assert resolve_out_dir(tmp_path / "abs") == tmp_path / "abs"
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\n')  # another project: not glmkit's
    assert resolve_out_dir("r") == tmp_path / "r"


def test_a_verdict_file_that_is_a_pipe_or_a_text_is_read_without_blocking(tmp_path):
    """Hostile pass 8: a FIFO named verdict.json blocked the report for ever; reasons given as one text
    were split into characters. The pipe is named in the header's reason, unread; one text is one reason."""
    import json
    import os
    import time

    from glmkit.notebook import read_verdict

    started = time.time() - 1
    os.mkfifo(tmp_path / "verdict.json")
    assert read_verdict(tmp_path, started, with_reasons=True) == (
        "unknown", ["verdict.json is a named pipe (FIFO); not read"])
    os.unlink(tmp_path / "verdict.json")
    (tmp_path / "verdict.json").write_text(json.dumps({"verdict": "fail", "reasons": "reward fell",
                                                       "warnings": "slow"}))
    assert read_verdict(tmp_path, started, with_reasons=True) == ("fail", ["reward fell", "warning: slow"])


def test_a_report_that_cannot_be_made_leaves_last_runs_pair_as_it_was(tmp_path, capsys, monkeypatch):
    """Hostile pass 8: the executed .ipynb replaced last run's before the .html was made, so a failure
    there (a full disk, a rendering error) left a new notebook beside an old report. Now the page is
    made and staged whole first: on failure both of last run's files are unchanged, and the executed
    notebook is kept as NAME.failed.ipynb."""
    from glmkit import notebook as nb_module
    from glmkit.cli import main as cli_main

    notebook = small_notebook(tmp_path / "pair.ipynb", "print(message * 3)")
    out = tmp_path / "report"
    assert main(["report", str(notebook), "--out", str(out), "-p", "message", "first"]) == 0
    before = {name: (out / name).read_bytes() for name in ("pair.ipynb", "pair.html")}

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    for failing in ("notebook_html", "stage_file"):
        target = nb_module if failing == "notebook_html" else __import__("glmkit.report", fromlist=["x"])
        with monkeypatch.context() as m:
            m.setattr(target, failing, full_disk)
            assert cli_main(["report", str(notebook), "--out", str(out), "-p", "message", "second"]) == 4
        assert "No space left on device" in capsys.readouterr().err
        assert {name: (out / name).read_bytes() for name in before} == before, failing
        assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    assert (out / "pair.failed.ipynb").is_file()  # the rendering failure kept what ran


def test_check_reports_json_and_html_are_replaced_together(tmp_path, monkeypatch):
    """write_together stages every file whole before renaming any: a failure staging the .html leaves
    last run's .json too (they were a half-new pair)."""
    from glmkit import report

    report.write_report(tmp_path, "check", "<p>old</p>", {"verdict": "pass"})
    real = report.stage_file

    def stage_then_fail(path, payload):
        if path.suffix == ".html":
            raise OSError(28, "No space left on device")
        return real(path, payload)

    monkeypatch.setattr(report, "stage_file", stage_then_fail)
    with pytest.raises(OSError, match="No space"):
        report.write_report(tmp_path, "check", "<p>new</p>", {"verdict": "fail"})
    assert json.loads((tmp_path / "check.json").read_text()) == {"verdict": "pass"}
    assert (tmp_path / "check.html").read_text() == "<p>old</p>"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["check.html", "check.json"]


def test_notebooks_papermill_or_nbconvert_cannot_take_are_refused_before_running(tmp_path, capsys):
    """Hostile pass 8, each exit 3 before: a markdown image of an attachment the cell does not hold (the
    HTML export failed after the whole run), a notebook in another language (papermill has no parameter
    writer for it), and an integer parameter past Python's 4300-digit limit. Now exit 2, one line each."""
    from glmkit.cli import main as cli_main

    attach = small_notebook(tmp_path / "attach.ipynb", "print(message)")
    nb = nbformat.read(str(attach), as_version=4)
    nb.cells.append(nbformat.v4.new_markdown_cell("![plot](attachment:missing.png) and attachment:text-only"))
    nbformat.write(nb, str(attach))
    lang = small_notebook(tmp_path / "lang.ipynb", "print(message)")
    nb = nbformat.read(str(lang), as_version=4)
    nb.metadata["language_info"] = {"name": "cobol-9000"}
    nbformat.write(nb, str(lang))
    plain = small_notebook(tmp_path / "plain.ipynb", "print(message)")
    for notebook, extra, needle in (
            (attach, [], "markdown cell 3 shows attachment:missing.png, which the cell does not hold"),
            (lang, [], "its language_info.name is 'cobol-9000'; glmkit report runs Python notebooks"),
            (plain, ["-p", "message", "7" * 5000], "a parameter value holds an integer of more than 4300 digits"),
            # hostile pass 11: a value of another kind than the default's failed deep in the notebook (exit 1)
            (plain, ["-p", "message", "[1]"], "-p message [1]: plain.ipynb expects a text (its default is 'hi')"),
            (plain, ["-p", "message", "1e400"], "-p message inf: plain.ipynb expects a text")):
        assert cli_main(["report", str(notebook), "--out", str(tmp_path / "out"), *extra]) == 2
        err = capsys.readouterr().err
        assert needle in err and "internal error" not in err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.html"))


def test_a_huge_output_is_cut_in_the_report_and_kept_whole_in_the_notebook(tmp_path, capsys):
    """Hostile pass 8: a 300 MB print took 4.4 GB to render (100 MB: 1.7 GB, now 0.6 GB). Each text
    output in the page is cut at MAX_OUTPUT_CHARS, saying where the rest is; the .ipynb keeps it all."""
    from glmkit.notebook import MAX_OUTPUT_CHARS

    notebook = small_notebook(tmp_path / "loud.ipynb", "print('x' * 3_000_000)")
    out = tmp_path / "report"
    assert main(["report", str(notebook), "--out", str(out)]) == 0
    page = (out / "loud.html").read_text()
    assert f"[... {3_000_001 - MAX_OUTPUT_CHARS} more characters of this output are in the executed notebook" in page
    assert len(page) < MAX_OUTPUT_CHARS + 2_000_000 and "x" * MAX_OUTPUT_CHARS in page
    executed = nbformat.read(str(out / "loud.ipynb"), as_version=4)
    printed = next(c for c in executed.cells if c.get("outputs"))
    assert "".join(printed.outputs[0]["text"]).count("x") == 3_000_000
