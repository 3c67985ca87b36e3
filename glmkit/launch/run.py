"""Running a launch, the one place both `glmkit launch` and notebook 03 do it: the cluster (an address,
or a head glmkit starts on 127.0.0.1 and stops however the run ends), the job (submitted, or re-attached
by its run name), following it into the metrics store, stopping it, and the run's verdict.

    with open_cluster(address=None, num_cpus=2) as cluster:      # None: a local head, stopped at the end
        result = run_builtin(cluster, fields, run_name="smoke")   # glmkit's GRPO as Ray actors
        result = run_miles(cluster, launch_plan, run_name="full") # the recipe's launcher, its training job
    verdict = launch_verdict(result, launch_plan)
"""

from __future__ import annotations

import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from glmkit.launch import jobs

# Variables of the client's environment the recipe's launcher reads itself (it turns WANDB_API_KEY into
# --wandb-key and MASTER_ADDR into the training job's MASTER_ADDR and no_proxy): they go to its job.
LAUNCHER_ENV = ("WANDB_API_KEY", "MASTER_ADDR", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_DEBUG",
                "NCCL_DEBUG_FILE", "GITHUB_COMMIT_NAME")


@dataclass
class Cluster:
    address: str           # the Jobs API, http://HOST:PORT
    client: object         # ray.job_submission.JobSubmissionClient
    head: object = None    # the LocalHead glmkit started, if it did

    @classmethod
    def open(cls, address: str | None = None, num_cpus: int = 2, num_gpus: int | None = None) -> "Cluster":
        """The cluster at `address`, or (None) a head started on 127.0.0.1: `close()` stops it, and its
        guard does when this process (a notebook kernel) ends in any other way."""
        from glmkit.launch.cluster import LocalHead, connect

        head = LocalHead.start(num_cpus=num_cpus, num_gpus=num_gpus) if address is None else None
        try:
            dashboard = head.dashboard if head else address
            return cls(dashboard, connect(dashboard), head)
        except BaseException:
            if head is not None:
                head.stop()
            raise

    def close(self):
        """Stop the head glmkit started (nothing, for a cluster it was given)."""
        if self.head is not None:
            self.head.stop()

    def inventory(self) -> list[dict]:
        from glmkit.launch.cluster import inventory

        return inventory(self.address)


def try_open(address: str | None = None, num_cpus: int = 2, num_gpus: int | None = None):
    """(Cluster, None), or (None, why it could not be opened) for a report to state as a failure."""
    try:
        return Cluster.open(address, num_cpus, num_gpus), None
    except Exception as err:  # reported, not raised: the run's verdict says the start failed and why
        return None, f"the cluster could not be opened: {type(err).__name__}: {str(err).strip()[:2000]}"


@contextmanager
def open_cluster(address: str | None = None, num_cpus: int = 2, num_gpus: int | None = None):
    """`Cluster.open` for a block: a head glmkit started is stopped when the block ends (normally or by
    an exception, Ctrl-C included) and, by its guard, when this process ends in any other way."""
    cluster = Cluster.open(address, num_cpus, num_gpus)
    try:
        yield cluster
    finally:
        cluster.close()


def _owns_metrics(follow):
    """Hold the metrics file's lock while a run is started and followed: a second follower writing
    the same file is refused with the holder named."""
    import functools

    @functools.wraps(follow)
    def locked(*args, metrics_out=None, **kwargs):
        from glmkit.outputs import RunLock

        if metrics_out is None:
            return follow(*args, metrics_out=None, **kwargs)
        with RunLock(metrics_out, "--metrics-out"):
            return follow(*args, metrics_out=metrics_out, **kwargs)
    return locked


@_owns_metrics
def run_builtin(cluster: Cluster, fields: dict, run_name: str, *, rollout_actors: int = 1, trainers: int = 0,
                gpus: bool = False, bundle_gpu: float = 1.0, reattach: bool = True, metrics_out=None,
                on_rows=None, on_log=None, on_job=None, poll: float = 1.0) -> jobs.JobResult:
    """glmkit's GRPO (TrainConfig `fields`) as a Ray job: re-attached when a job of `run_name` is still
    running (and `reattach`), else submitted, with a fresh metrics store; followed to its end."""
    from glmkit.rl.loop import TrainConfig

    TrainConfig(**fields).resolved()  # a bad config fails here, before any cluster work
    nodes = cluster.inventory()
    free = sum(n["gpus"] / bundle_gpu if gpus else n["cpus"] for n in nodes if n["alive"])
    bundles = rollout_actors + trainers
    if free < bundles:
        raise ValueError(f"{rollout_actors} rollout actors and {trainers} separate trainers need {bundles} "
                         f"{'GPU' if gpus else 'CPU'} bundles; the cluster has {free:g}")
    job = jobs.find_run(cluster.client, run_name) if reattach else None
    if job is None:
        _fresh(metrics_out)
        python = jobs.local_python() if cluster.head else "python3"
        job = jobs.submit(cluster.client, jobs.builtin_entrypoint(fields, rollout_actors, gpus, python,
                                                                  trainers=trainers, bundle_gpu=bundle_gpu), run_name)
    if on_job is not None:
        on_job(job)
    return jobs.follow(cluster.client, job, metrics_out=metrics_out, on_rows=on_rows, on_log=on_log, poll=poll)


@_owns_metrics
def run_miles(cluster: Cluster, plan, run_name: str, *, reattach: bool = True, metrics_out=None, on_rows=None,
              on_log=None, on_job=None, env: dict | None = None, poll: float = 1.0,
              timeout: float | None = None, on_training_job=None) -> jobs.JobResult:
    """The recipe's launcher as a Ray job (its LoRA `prepare` first), with the training job it submits
    followed as the run: that is the job whose log carries the metrics, whose status is the run's, and
    which `stop_run` stops. The launcher's job gets MILES_SCRIPT_EXTERNAL_RAY=1, the launcher's own
    variables from this environment (LAUNCHER_ENV), the user's --extra-env-vars, MASTER_ADDR (else the
    Ray head's address, which the launcher hands on with no_proxy), PYTHONPATH of the checkout and `env`
    (Ray itself points the launcher's `ray job submit` at this cluster: it sets RAY_ADDRESS in a job's
    driver); the training job gets, through --extra-env-vars, the user's variables, NVLink multicast
    off and the marker glmkit finds it by."""
    from glmkit.launch import commands
    from glmkit.launch.launcher import parse_extra_env_vars

    if not plan.ok:
        raise ValueError("preflight failed; nothing submitted: "
                         + "; ".join(f"{c.name}: {c.detail}" for c in plan.checks if not c.ok))
    outer_env = {k: os.environ[k] for k in LAUNCHER_ENV if os.environ.get(k)}
    outer_env.update(parse_extra_env_vars(plan.given.get("extra_env_vars") or ""))
    outer_env.update(env or {})
    outer_env["MILES_SCRIPT_EXTERNAL_RAY"] = "1"
    if "MASTER_ADDR" not in outer_env:  # the launcher's MASTER_ADDR (and no_proxy) for the training job
        head_ip = next((n["ip"] for n in cluster.inventory() if n["head"] and n["ip"]), None)
        if head_ip:
            outer_env["MASTER_ADDR"] = head_ip
    # the launcher (and a LoRA launcher importing the full one's module) from the checkout it runs in
    outer_env["PYTHONPATH"] = f"{plan.miles_dir}:{plan.values.get('megatron_path') or commands.MEGATRON_DIR}"
    job = jobs.find_run(cluster.client, run_name) if reattach else None
    if job is None:
        _fresh(metrics_out)
        if plan.launcher.name == "lora":
            prepare = next(c for c in plan.commands if c.name == "lora-prepare")
            result = jobs.follow(cluster.client, jobs.submit(cluster.client, prepare.entrypoint(),
                                                             f"{run_name}-prepare", outer_env), on_log=on_log,
                                 poll=poll)
            if not result.ok:
                return result
        job = jobs.new_submission_id(run_name)
        train = commands.train(plan.launcher, plan.given, {jobs.PARENT_ENV: job}, plan.miles_dir)
        jobs.submit(cluster.client, train.entrypoint(), run_name, outer_env, submission_id=job)
    if on_job is not None:
        on_job(job)
    return jobs.follow_launch(cluster.client, job, metrics_out=metrics_out, on_rows=on_rows, on_log=on_log,
                              poll=poll, timeout=timeout, on_training_job=on_training_job)


@_owns_metrics
def attach(cluster: Cluster, run_name: str, *, metrics_out=None, on_rows=None, on_log=None, poll: float = 1.0,
           timeout: float | None = None, on_training_job=None) -> jobs.JobResult | None:
    """Follow the newest job of `run_name`, running or finished, submitting nothing (None when there is
    none): what was written so far arrives in one batch, then the rest live. A launcher run is followed
    through the training job it submitted."""
    job = jobs.find_run(cluster.client, run_name, finished=True)
    if job is None:
        return None
    if _is_launcher(cluster.client, job):
        return jobs.follow_launch(cluster.client, job, metrics_out=metrics_out, on_rows=on_rows, on_log=on_log,
                                  poll=poll, timeout=timeout, on_training_job=on_training_job)
    return jobs.follow(cluster.client, job, metrics_out=metrics_out, on_rows=on_rows, on_log=on_log, poll=poll,
                       timeout=timeout)


def _is_launcher(client, job: str) -> bool:
    """A job run_miles submitted runs the recipe's launcher (it always gets MILES_SCRIPT_EXTERNAL_RAY=1)."""
    env = (client.get_job_info(job).runtime_env or {}).get("env_vars") or {}
    return env.get("MILES_SCRIPT_EXTERNAL_RAY") == "1"


def stop_run(cluster: Cluster, run_name: str, wait: float = 60.0) -> str | None:
    """Stop the running job of `run_name` (a launcher run: the launcher, then the training jobs it
    submitted; a LoRA run's prepare step too); None if none runs."""
    prepare = jobs.find_run(cluster.client, f"{run_name}-prepare")
    if prepare is not None:
        jobs.stop(cluster.client, prepare, wait)
    job = jobs.find_run(cluster.client, run_name)
    if job is None:
        return None if prepare is None else "STOPPED"
    return jobs.stop_launch(cluster.client, job, wait)


def launch_verdict(result, plan=None, dry_run: bool = False, errors=()) -> dict:
    """pass only for a job that ran, succeeded and reported finite metric rows (after a passing
    preflight, where there is a plan); a dry run is said to be one, never a pass; `errors` (a start
    that failed, ...) are failures with their reasons."""
    reasons = [e for e in errors if e]
    if plan is not None and not plan.ok:
        reasons += [f"preflight: {c.name}: {c.detail}" for c in plan.checks if not c.ok]
    if result is None:
        if dry_run and not reasons:
            return {"verdict": "dry run: nothing launched", "reasons": ["dry run: the plan and preflight only"]}
        reasons.append("no job ran")
    else:
        if not result.ok:
            reasons.append(f"job {result.job_id} {result.status.lower()}: {result.message}".rstrip(": "))
        if not result.rows:
            reasons.append("no metric rows arrived")
        bad = [r for r in result.rows if any(isinstance(v, float) and not math.isfinite(v) for v in r.values())]
        if bad:
            reasons.append(f"{len(bad)} metric rows with NaN / Inf")
    return {"verdict": "fail" if reasons else "pass", "reasons": reasons}


def _fresh(metrics_out):
    """A new run starts its metrics store empty (a re-attached one continues it). Only a metrics file
    glmkit marked is removed; anything else at that path (a dataset, a link) is refused, never deleted."""
    from glmkit.outputs import refuse_replacing

    path = Path(metrics_out) if metrics_out is not None else None
    if path is None or not (path.exists() or path.is_symlink()):
        return
    refuse_replacing(path, "--metrics-out", "metrics file", action="a new run replaces")
    path.unlink()
