"""Ray jobs: submit, follow (status, log, metrics), re-attach and stop.

A job's log is data: lines are matched against fixed patterns and parsed with `json.loads` or as
numbers, never executed. Metric rows found in it go to the same JSONL metrics store the training
widgets read (`glmkit.rl.loop.read_metrics`):
- glmkit's builtin backend prints `GLMKIT_METRICS {json}` lines;
- other lines that carry the framework's metric keys (`train/...`, `rollout/...`, `perf/...`) with
  numeric values, as `'key': value` or `key=value` pairs, give one row per line; a step is taken
  from `rollout/step` / `train/step` / `step` on the same line when there is one.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from glmkit.launch.builtin import DONE_PREFIX, METRICS_PREFIX
from glmkit.launch.commands import runtime_env

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
_PAIR = re.compile(r"""(?<![\w/])['"]?((?:train|rollout|perf)/[A-Za-z0-9_/.-]+|step)['"]?\s*[:=]\s*"""
                   r"""(-?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?|nan|-?inf)\b""")


def parse_metric_line(line: str) -> dict | None:
    """One metric row from one log line, or None."""
    line = line.strip()
    at = line.find(METRICS_PREFIX)  # Ray prefixes an actor's lines with "(ActorName pid=N) "
    if at >= 0:
        try:
            row = json.loads(line[at + len(METRICS_PREFIX):])
        except ValueError:
            return None
        return row if isinstance(row, dict) else None
    row = {}
    for key, value in _PAIR.findall(line):
        number = float(value)
        row[key] = int(number) if key.endswith("step") and math.isfinite(number) else number
    if not any(k != "step" for k in row):
        return None
    return row


@dataclass
class JobResult:
    job_id: str
    status: str
    rows: list = field(default_factory=list)
    log_tail: str = ""
    message: str = ""
    done: dict | None = None

    @property
    def ok(self) -> bool:
        return self.status == "SUCCEEDED"

    def summary(self) -> str:
        if self.ok:
            return f"job {self.job_id} succeeded: {len(self.rows)} metric rows"
        return f"job {self.job_id} {self.status.lower()}: {self.message}\n--- last lines of its log ---\n{self.log_tail}"


def builtin_entrypoint(fields: dict, rollout_actors: int = 1, gpus: bool = False, python: str = "python3",
                       trainers: int = 0, bundle_gpu: float = 1.0) -> str:
    """The Ray job entrypoint of the builtin backend for TrainConfig `fields` (trainers: 0 = one trainer
    colocated with the first rollout actor; N = N data-parallel trainer ranks on their own bundles;
    bundle_gpu: the GPU a bundle holds, below 1 to share GPUs)."""
    argv = [python, "-m", "glmkit.launch.builtin", "--config-json", json.dumps(fields, sort_keys=True),
            "--rollout-actors", str(rollout_actors)] + (["--trainers", str(trainers)] if trainers else []) + \
        (["--gpus"] if gpus else []) + (["--bundle-gpu", repr(bundle_gpu)] if bundle_gpu != 1 else [])
    return " ".join(shlex.quote(a) for a in argv)


def submit(client, entrypoint: str, run_name: str, env: dict | None = None, working_dir: str | None = None) -> str:
    """Submit `entrypoint` as a Ray job tagged with `run_name` (what `find_job` re-attaches by);
    the runtime env is the framework's, NVLink multicast off."""
    renv = runtime_env(env)
    if working_dir:
        renv["working_dir"] = working_dir
    return client.submit_job(entrypoint=entrypoint, runtime_env=renv, metadata={"glmkit_run": run_name})


def find_job(client, run_name: str, running_only: bool = True) -> str | None:
    """The newest job tagged `run_name` (still running, unless running_only=False): re-attach target."""
    jobs = [j for j in client.list_jobs() if (j.metadata or {}).get("glmkit_run") == run_name
            and (not running_only or str(j.status) not in TERMINAL and getattr(j.status, "value", "") not in TERMINAL)]
    jobs.sort(key=lambda j: j.start_time or 0)
    return jobs[-1].submission_id if jobs else None


def _status(client, job_id) -> str:
    status = client.get_job_status(job_id)
    return getattr(status, "value", str(status))


def follow(client, job_id: str, metrics_out: str | Path | None = None, on_row=None, on_log=None,
           poll: float = 1.0, timeout: float | None = None) -> JobResult:
    """Follow a job until it ends (or `timeout` seconds): new log text to `on_log`, each metric row
    to `on_row` and appended to `metrics_out` (rows already there are not written again, so a
    re-attached follow continues the same file)."""
    seen_text, rows, done = 0, [], None
    known = set()
    out = Path(metrics_out) if metrics_out else None
    if out is not None and out.exists():
        for line in out.read_text().splitlines():
            if line.strip():
                known.add(line.strip())
    start = time.monotonic()
    partial = ""
    while True:
        status = _status(client, job_id)
        logs = client.get_job_logs(job_id)
        new, seen_text = logs[seen_text:], len(logs)
        if new and on_log is not None:
            on_log(new)
        lines = (partial + new).split("\n")
        partial = lines.pop()  # an unfinished last line waits for the rest
        if status in TERMINAL and partial:  # nothing more will come: the last line is whole
            lines.append(partial)
            partial = ""
        for line in lines:
            if DONE_PREFIX in line:
                try:
                    done = json.loads(line[line.find(DONE_PREFIX) + len(DONE_PREFIX):])
                except ValueError:
                    pass
                continue
            row = parse_metric_line(line)
            if row is None:
                continue
            rows.append(row)
            text = json.dumps(row, sort_keys=True, allow_nan=False) if _finite(row) else None
            if out is not None and text is not None and text not in known:
                known.add(text)
                out.parent.mkdir(parents=True, exist_ok=True)
                with out.open("a") as f:
                    f.write(text + "\n")
            if on_row is not None:
                on_row(row)
        if status in TERMINAL:
            info = client.get_job_info(job_id)
            tail = "\n".join(logs.rstrip("\n").split("\n")[-20:])
            return JobResult(job_id, status, rows, tail, info.message or "", done)
        if timeout is not None and time.monotonic() - start > timeout:
            return JobResult(job_id, status, rows, "\n".join(logs.rstrip("\n").split("\n")[-20:]),
                             f"still {status.lower()} after {timeout:.0f} s of following", done)
        time.sleep(poll)


def _finite(row: dict) -> bool:
    return all(not isinstance(v, float) or math.isfinite(v) for v in row.values())


def stop(client, job_id: str, wait: float = 60.0) -> str:
    """Ask the job to stop; returns its status once terminal (or after `wait` seconds)."""
    client.stop_job(job_id)
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        status = _status(client, job_id)
        if status in TERMINAL:
            return status
        time.sleep(0.5)
    return _status(client, job_id)


def local_python() -> str:
    """This interpreter, for jobs on a head this process started (same machine, same environment)."""
    return sys.executable
