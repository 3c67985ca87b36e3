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
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from glmkit.launch.builtin import DONE_PREFIX, METRICS_PREFIX
from glmkit.launch.commands import runtime_env

TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
PARENT_ENV = "GLMKIT_PARENT_JOB"   # in a launcher-submitted job's env: the glmkit job that ran the launcher
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


def submit(client, entrypoint: str, run_name: str, env: dict | None = None, working_dir: str | None = None,
           submission_id: str | None = None) -> str:
    """Submit `entrypoint` as a Ray job tagged with `run_name` (what `find_run` re-attaches by);
    the runtime env is the framework's, NVLink multicast off."""
    renv = runtime_env(env)
    if working_dir:
        renv["working_dir"] = working_dir
    return client.submit_job(entrypoint=entrypoint, runtime_env=renv, metadata={"glmkit_run": run_name},
                             submission_id=submission_id)


def new_submission_id(run_name: str) -> str:
    """A job id glmkit chooses before submitting (so the job's own children can be told to carry it)."""
    safe = re.sub(r"[^A-Za-z0-9_-]+", "-", run_name).strip("-")[:40] or "run"
    return f"glmkit-{safe}-{uuid.uuid4().hex[:12]}"


def training_job(client, launcher_job: str) -> str | None:
    """The job the recipe's launcher submitted from inside `launcher_job` (its own `ray job submit`):
    found by PARENT_ENV in its runtime env, which glmkit passes through the launcher's --extra-env-vars."""
    found = [j for j in client.list_jobs()
             if ((j.runtime_env or {}).get("env_vars") or {}).get(PARENT_ENV) == launcher_job]
    found.sort(key=lambda j: j.start_time or 0)
    return found[-1].submission_id if found else None


def follow_launch(client, launcher_job: str, metrics_out: str | Path | None = None, on_row=None, on_log=None,
                  poll: float = 1.0, timeout: float | None = None, on_rows=None, on_training_job=None) -> JobResult:
    """Follow a run of the recipe's launcher: its own output until the training job it submits appears,
    then that job (its log, metric rows, status: the run's result). `on_training_job(id)` is told once.
    A launcher that ends without a training job is a failed run, with its log's last lines."""
    outer, tail, store, rows = _Tail(), _Tail(), _Store(metrics_out), []
    inner = None
    start = time.monotonic()
    while True:
        if inner is None:
            status = _status(client, launcher_job)
            inner = training_job(client, launcher_job)
            if inner is not None and on_training_job is not None:
                on_training_job(inner)
        if inner is None:
            logs = client.get_job_logs(launcher_job)
            new, _ = outer.step(logs, status in TERMINAL)  # its echo of the training job's rows is not read
            if new and on_log is not None:
                on_log(new)
            if status in TERMINAL:
                info = client.get_job_info(launcher_job)
                why = f"the launcher ended ({status.lower()}) without submitting a training job"
                return JobResult(launcher_job, "FAILED", rows, _last_lines(logs),
                                 why + (f": {info.message}" if info.message else ""))
        else:
            status, logs = _poll(client, inner, tail, store, rows, on_log, on_row, on_rows)
            if status in TERMINAL:
                info = client.get_job_info(inner)
                return JobResult(inner, status, rows, _last_lines(logs), info.message or "", tail.done)
        if timeout is not None and time.monotonic() - start > timeout:
            return JobResult(inner or launcher_job, status, rows, "",
                             f"still {status.lower()} after {timeout:.0f} s of following", tail.done)
        time.sleep(poll)


def stop_launch(client, launcher_job: str, wait: float = 60.0) -> str:
    """Stop a launcher run: the launcher's own job first (so it submits nothing more), then every training
    job it submitted that still runs (the processes that train). Returns the last training job's final
    status (the launcher's when it had none)."""
    outer = stop(client, launcher_job, wait)
    status = None
    for job in client.list_jobs():
        if ((job.runtime_env or {}).get("env_vars") or {}).get(PARENT_ENV) == launcher_job:
            status = stop(client, job.submission_id, wait)
    return status or outer


def find_run(client, run_name: str, finished: bool = False) -> str | None:
    """The job a run of `run_name` is followed by: its newest job tagged with the name (a launcher's job
    or a builtin run) that still runs, or whose training job still runs (a launcher job can end before
    the training job it submitted); with `finished`, the newest one whatever its state."""
    listed = sorted(client.list_jobs(), key=lambda j: j.start_time or 0)
    tagged = [j for j in listed if (j.metadata or {}).get("glmkit_run") == run_name]
    if finished:
        return tagged[-1].submission_id if tagged else None
    parents_running = {((j.runtime_env or {}).get("env_vars") or {}).get(PARENT_ENV) for j in listed
                       if _value(j.status) not in TERMINAL}
    alive = [j for j in tagged if _value(j.status) not in TERMINAL or j.submission_id in parents_running]
    return alive[-1].submission_id if alive else None


def _value(status) -> str:
    return getattr(status, "value", str(status))


def _status(client, job_id) -> str:
    status = client.get_job_status(job_id)
    return getattr(status, "value", str(status))


class _Tail:
    """Reads a job's growing log: the new text of each poll, whole lines only, metric rows parsed."""

    def __init__(self):
        self.seen, self.partial, self.done = 0, "", None

    def step(self, logs: str, terminal: bool) -> tuple[str, list]:
        """(the new text, the metric rows of its whole lines); at the end the last line counts whole."""
        new, self.seen = logs[self.seen:], len(logs)
        lines = (self.partial + new).split("\n")
        self.partial = lines.pop()  # an unfinished last line waits for the rest
        if terminal and self.partial:  # nothing more will come: the last line is whole
            lines.append(self.partial)
            self.partial = ""
        rows = []
        for line in lines:
            if DONE_PREFIX in line:
                try:
                    self.done = json.loads(line[line.find(DONE_PREFIX) + len(DONE_PREFIX):])
                except ValueError:
                    pass
                continue
            row = parse_metric_line(line)
            if row is not None:
                rows.append(row)
        return new, rows


class _Store:
    """The metrics file a follow appends to: rows already there are not written again (a re-attached
    follow continues the same file); each poll's rows are written in one append."""

    def __init__(self, path):
        from glmkit.outputs import refuse_replacing

        self.path = Path(path) if path else None
        self.known = set()
        if self.path is not None and (self.path.exists() or self.path.is_symlink()):
            refuse_replacing(self.path, "--metrics-out", "metrics file", action="a follow appends to")
            self.known = {line.strip() for line in self.path.read_text().splitlines() if line.strip()}

    def add(self, rows: list):
        if self.path is None:
            return
        texts = []
        for row in rows:
            text = json.dumps(row, sort_keys=True, allow_nan=False) if _finite(row) else None
            if text is not None and text not in self.known:
                self.known.add(text)
                texts.append(text)
        if texts:
            from glmkit.outputs import is_glmkit_file, mark_file

            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as f:
                f.write("\n".join(texts) + "\n")
            if not is_glmkit_file(self.path):
                mark_file(self.path, "metrics file")


def _poll(client, job_id: str, tail: _Tail, store: _Store, rows: list, on_log, on_row, on_rows) -> tuple[str, str]:
    """One poll of a job: its status and log; the new text to `on_log`, its rows kept, stored and
    delivered. -> (status, the whole log)."""
    status = _status(client, job_id)
    logs = client.get_job_logs(job_id)
    new, batch = tail.step(logs, status in TERMINAL)
    if new and on_log is not None:
        on_log(new)
    rows += batch
    store.add(batch)
    _deliver(batch, on_row, on_rows)
    return status, logs


def _deliver(rows, on_row, on_rows):
    if rows and on_rows is not None:
        on_rows(rows)
    if on_row is not None:
        for row in rows:
            on_row(row)


def follow(client, job_id: str, metrics_out: str | Path | None = None, on_row=None, on_log=None,
           poll: float = 1.0, timeout: float | None = None, on_rows=None) -> JobResult:
    """Follow a job until it ends (or `timeout` seconds): new log text to `on_log`, the metric rows of
    each poll to `on_rows` (one call a poll: a re-attach replays everything so far in one call) and
    each row to `on_row`, all appended to `metrics_out`."""
    tail, store, rows = _Tail(), _Store(metrics_out), []
    start = time.monotonic()
    while True:
        status, logs = _poll(client, job_id, tail, store, rows, on_log, on_row, on_rows)
        if status in TERMINAL:
            info = client.get_job_info(job_id)
            return JobResult(job_id, status, rows, _last_lines(logs), info.message or "", tail.done)
        if timeout is not None and time.monotonic() - start > timeout:
            return JobResult(job_id, status, rows, _last_lines(logs),
                             f"still {status.lower()} after {timeout:.0f} s of following", tail.done)
        time.sleep(poll)


def _last_lines(logs: str, n: int = 20) -> str:
    return "\n".join(logs.rstrip("\n").split("\n")[-n:])


def _finite(row: dict) -> bool:
    return all(not isinstance(v, float) or math.isfinite(v) for v in row.values())


def stop(client, job_id: str, wait: float = 60.0) -> str:
    """Ask the job to stop; returns its status once terminal (or after `wait` seconds)."""
    if _status(client, job_id) in TERMINAL:
        return _status(client, job_id)
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
