"""The launch path on a real Ray cluster: one local head on 127.0.0.1 for the whole module (started
by glmkit.launch.cluster.LocalHead, stopped at the end), real jobs through the Jobs API."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
import ray

from glmkit.launch import jobs
from glmkit.launch.builtin import RayRollout
from glmkit.launch.cluster import ClusterUnreachable, LocalHead, connect, inventory
from glmkit.rl.loop import GRPOTrainer, TrainConfig, read_metrics

PY = sys.executable


@pytest.fixture(scope="module")
def head():
    head = LocalHead.start(num_cpus=4)  # logical CPUs: 2 trainer ranks + 2 rollout actors get bundles of one
    yield head
    pgid = head.process.pid
    head.stop()
    import os

    with pytest.raises(ProcessLookupError):  # the whole process group it started is gone
        os.killpg(pgid, 0)


@pytest.fixture(scope="module")
def client(head):
    return connect(head.dashboard)


def tiny_fields(ckpt, out, **changes):
    fields = dict(model_name="tiny", checkpoint=str(ckpt), num_rollout=2, rollout_batch_size=2,
                  n_samples_per_prompt=2, global_batch_size=4, rollout_max_response_len=8,
                  metrics_out=str(out), overwrite=True, progress=False)
    return {**fields, **changes}


def test_connect_and_inventory(head, client):
    nodes = inventory(head.dashboard)
    assert len(nodes) == 1 and nodes[0]["alive"] and nodes[0]["head"]
    assert nodes[0]["cpus"] == 4 and nodes[0]["gpus"] == 0 and nodes[0]["gpu_type"] is None
    assert head.dashboard.startswith("http://127.0.0.1:")
    with pytest.raises(ClusterUnreachable, match="nothing listens on 127.0.0.1:1"):
        connect("http://127.0.0.1:1", retries=1, delay=0.05)
    with pytest.raises(ClusterUnreachable, match="is not a Ray address"):
        connect("ftp://127.0.0.1:8265")


def test_an_address_that_answers_but_is_not_rays_dashboard_is_named_so():
    """Hostile pass 13: `launch --address` at another HTTP server (glmkit serve) said only `'result'`."""
    import http.server
    import threading

    from tests.test_engine_weights import _JSONHandler

    class Other(_JSONHandler):
        def do_GET(self):
            self._send(b'{"status": "ok"}')

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Other)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ClusterUnreachable, match=r"it answered, but not as Ray's dashboard does .* give the Ray "
                                                     r"head's dashboard address"):
            inventory(f"http://127.0.0.1:{other.server_address[1]}")
    finally:
        other.shutdown()


def test_builtin_backend_on_ray_equals_the_in_process_run(client, tiny_ckpt, tmp_path):
    """One rollout actor and a trainer actor, colocated on one bundle: the same rows as GRPOTrainer
    in this process on the same config (the Ray path changes where things run, not what). Equal to
    rel 1e-4 / abs 1e-6: the actors run torch on 1 thread and this process on 2, so fp32 sums round
    differently (the train-vs-rollout log-prob diff, itself ~1.6e-6 here, moved by 1.5e-8)."""
    fields = tiny_fields(tiny_ckpt, tmp_path / "ray" / "metrics.jsonl")
    job = jobs.submit(client, jobs.builtin_entrypoint(fields, 1, python=PY), "builtin-equal")
    logs = []
    result = jobs.follow(client, job, metrics_out=tmp_path / "followed.jsonl", on_log=logs.append, poll=0.5,
                         timeout=600)
    assert result.ok, result.summary()
    assert result.done == {"rows": 6}  # 2 rollouts x (a train and a rollout row), and 2 held-out evaluations
    local = GRPOTrainer(TrainConfig(**tiny_fields(tiny_ckpt, tmp_path / "local.jsonl"))).run()
    assert len(result.rows) == len(local) == 6
    for ours, theirs in zip(result.rows, local):
        keys = {k for k in theirs if not k.startswith("perf/")}
        assert keys == {k for k in ours if not k.startswith("perf/")}
        for k in keys:
            assert ours[k] == pytest.approx(theirs[k], rel=1e-4, abs=1e-6), k
    # the follower's store and the trainer's own file hold the same rows
    assert [r["step"] for r in read_metrics(tmp_path / "followed.jsonl")] == [r["step"] for r in local]
    assert len(read_metrics(tmp_path / "ray" / "metrics.jsonl")) == 6
    # following again (a notebook restarted) adds nothing twice
    again = jobs.follow(client, job, metrics_out=tmp_path / "followed.jsonl", poll=0.1, timeout=30)
    assert again.ok and len(read_metrics(tmp_path / "followed.jsonl")) == 6


def test_separate_data_parallel_trainers_and_a_weights_update_group(client, tiny_ckpt, tmp_path):
    """Two trainer ranks and a rollout actor, each on a bundle of its own, in one gloo world: the
    trainers are data-parallel (gradients all-reduced) and trainer 0 broadcasts the weights to the
    rollout actors over the weights-update group after every update. The rows equal the in-process
    run's to fp32 summation order (bounds as in test_parallel.py: rel 1e-4 / abs 1e-6); the rollout
    after the first update is sampled from the broadcast weights, so its rows matching proves they
    arrived."""
    fields = tiny_fields(tiny_ckpt, tmp_path / "ray" / "metrics.jsonl")
    result = jobs.follow(client, jobs.submit(client, jobs.builtin_entrypoint(fields, 1, python=PY, trainers=2),
                                             "separate"), poll=0.5, timeout=600)
    assert result.ok, result.summary()
    local = GRPOTrainer(TrainConfig(**tiny_fields(tiny_ckpt, tmp_path / "local.jsonl"))).run()
    assert len(result.rows) == len(local) == 6  # rank 0 alone prints rows (evaluations included)
    for ours, theirs in zip(result.rows, local):
        keys = {k for k in theirs if not k.startswith("perf/")}
        assert keys == {k for k in ours if not k.startswith("perf/")}
        for k in keys:
            assert ours[k] == pytest.approx(theirs[k], rel=1e-4, abs=1e-6), k


def test_two_rollout_actors_split_the_prompts(client, tiny_ckpt, tmp_path):
    fields = tiny_fields(tiny_ckpt, tmp_path / "m.jsonl", num_rollout=1)
    result = jobs.follow(client, jobs.submit(client, jobs.builtin_entrypoint(fields, 2, python=PY), "two"),
                         poll=0.5, timeout=600)
    assert result.ok, result.summary()
    rollout = [r for r in result.rows if "rollout/raw_reward" in r]
    assert len(rollout) == 1 and 0 <= rollout[0]["rollout/raw_reward"] <= 1


def test_a_failing_job_reports_its_status_and_log_tail(client):
    code = "import sys; print('loading'); print('boom: bad config', file=sys.stderr); sys.exit(3)"
    job = jobs.submit(client, f"{PY} -c {json.dumps(code)}", "fails")
    result = jobs.follow(client, job, poll=0.2, timeout=120)
    assert result.status == "FAILED" and not result.ok
    assert "boom: bad config" in result.log_tail and "3" in result.message
    assert "job " in result.summary() and "last lines of its log" in result.summary()


def test_reattach_follow_and_stop_a_running_job(client, tmp_path):
    row = {"rollout/step": 0, "step": 0, "rollout/raw_reward": 0.5}
    code = f"import time; print('{jobs.METRICS_PREFIX}' + {json.dumps(json.dumps(row))}, flush=True); time.sleep(600)"
    job = jobs.submit(client, f"{PY} -c {json.dumps(code)}", "long-run")
    first = jobs.follow(client, job, metrics_out=tmp_path / "m.jsonl", poll=0.2, timeout=8)
    assert first.status == "RUNNING" and first.rows == [row]
    assert jobs.find_run(client, "long-run") == job  # what a restarted notebook re-attaches to
    assert jobs.find_run(client, "no-such-run") is None
    assert jobs.stop(client, job) == "STOPPED"
    assert jobs.find_run(client, "long-run") is None
    assert read_metrics(tmp_path / "m.jsonl") == [row]


def test_a_dead_rollout_actor_is_reported_by_name(head):
    ray.init(address=head.gcs, logging_level="ERROR")
    try:
        @ray.remote(num_cpus=0)
        class Sleeper:
            def generate(self, prompts, params, seed):
                return []

            def load(self, tensors):
                return 0

        alive, doomed = Sleeper.remote(), Sleeper.remote()
        ray.get([alive.load.remote({}), doomed.load.remote({})])
        ray.kill(doomed)
        # ray.kill is asynchronous: a call made right after it may still be served; wait for the death
        deadline = time.time() + 60
        while True:
            try:
                ray.get(doomed.load.remote({}), timeout=60)
            except ray.exceptions.RayActorError:
                break
            assert time.time() < deadline, "the killed actor still answers 60 s after ray.kill"
            time.sleep(0.2)
        with pytest.raises(RuntimeError, match="rollout actor\\(s\\) died: glmkit-rollout-1"):
            RayRollout([alive, doomed], ["glmkit-rollout-0", "glmkit-rollout-1"]).generate([[1], [2]], None, 0)
    finally:
        ray.shutdown()


def test_ray_client_address_connects_the_driver(head):
    driver = connect(head.client)
    try:
        assert driver.is_initialized()
        assert driver.get(driver.remote(lambda: 6 * 7).remote()) == 42
    finally:
        driver.shutdown()


@pytest.mark.parametrize("line, row", [
    (jobs.METRICS_PREFIX + '{"step": 2, "train/ppo_kl": 0.001}', {"step": 2, "train/ppo_kl": 0.001}),
    ("step 3: {'train/grad_norm': 0.42, 'train/pg_loss': -1.5e-3, 'rollout/step': 3}",
     {"train/grad_norm": 0.42, "train/pg_loss": -1.5e-3, "rollout/step": 3}),
    ("rollout/raw_reward=0.75 perf/step_time=12.5", {"rollout/raw_reward": 0.75, "perf/step_time": 12.5}),
    ("(TrainerWorker pid=4242) " + jobs.METRICS_PREFIX + '{"train/step": 1, "train/step_skipped": true, '
     '"train/pg_loss": null, "nonfinite": ["train/pg_loss"]}',
     {"train/step": 1, "train/step_skipped": True, "train/pg_loss": None, "nonfinite": ["train/pg_loss"]}),
    ("global_step: 7 loss_scale=1", None),
    ("loading weights ... 45 layers", None),
    (jobs.METRICS_PREFIX + "__import__('os').system('id')", None),
    ("train/ppo_kl: __import__('os')", None),
])
def test_metric_lines_are_parsed_as_data(line, row):
    assert jobs.parse_metric_line(line) == row


def test_a_local_head_comes_up_where_ray_left_an_auth_token(tmp_path, monkeypatch):
    """Ray 2.60 turns token auth on for a new head when ~/.ray/auth_token exists (any earlier local
    ray.init writes one), and clients that were not told send no token: the head used to refuse the
    readiness probe until the start timed out. LocalHead pins the mode: it comes up, lists its node
    and takes Jobs API calls from this process."""
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("0123456789abcdef" * 4)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    head = LocalHead.start(num_cpus=1, timeout=120)
    try:
        assert [n["alive"] for n in inventory(head.dashboard)] == [True]
        assert connect(head.dashboard).list_jobs() == []
    finally:
        head.stop()


STAND_IN = Path(__file__).parent / "launcher_stand_in"


def _stand_in_plan(tmp_path, lora=False, sleep=0.0):
    from glmkit.launch import plan

    extra = f"--sleep {sleep} --pid-file {tmp_path / 'train.pid'} --num-rollout 3"
    return plan("GLM-5.3-Flash-4layer", 1, 8, lora=lora, gpu_mem_gib=288, miles_dir=str(STAND_IN),
                options={"extra_env_vars": '{"USER_VAR": "from-the-user"}', "extra_args": extra})


def _venv_path():
    return {"PATH": f"{Path(PY).parent}{os.pathsep}{os.environ.get('PATH', '')}"}


@pytest.mark.parametrize("lora", [False, True])
def test_the_launchers_training_job_is_the_one_followed_and_gets_the_users_environment(head, tmp_path, lora,
                                                                                       monkeypatch):
    """The launcher runs as a Ray job and submits the training job itself (the stand-in does as the
    recipe's launchers do); glmkit follows that training job: its metric rows, its status, and the
    variables given through --extra-env-vars, NVLink multicast off among them, read inside it; the
    W&B key and MASTER_ADDR (the head's, as nothing else names it) reach the launcher, which hands
    them on."""
    from glmkit.launch.run import Cluster, run_miles

    monkeypatch.setenv("WANDB_API_KEY", "key-from-the-client")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    cluster = Cluster(head.dashboard, connect(head.dashboard), head)
    logs = []
    result = run_miles(cluster, _stand_in_plan(tmp_path, lora), f"stand-in-{lora}", metrics_out=tmp_path / "m.jsonl",
                       env=_venv_path(), on_log=logs.append, poll=0.2, timeout=180)
    text = "".join(logs)
    assert result.ok, (result.status, result.message, text[-3000:])
    assert [r["rollout/step"] for r in result.rows] == [0, 1, 2]
    assert read_metrics(tmp_path / "m.jsonl") == result.rows
    env = json.loads(next(line for line in text.splitlines() if line.startswith("TRAIN_ENV "))[len("TRAIN_ENV "):])
    assert env["USER_VAR"] == "from-the-user"
    assert env["NCCL_NVLS_ENABLE"] == "0" and env["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"  # the launcher's 1 lost
    args = json.loads(next(line for line in text.splitlines() if line.startswith("TRAIN_ARGS "))[len("TRAIN_ARGS "):])
    assert "--use-rollout-routing-replay" in args if lora else "--use-rollout-routing-replay" not in args
    assert args[args.index("--wandb-key") + 1] == "key-from-the-client"
    head_ip = inventory(head.dashboard)[0]["ip"]
    assert env["MASTER_ADDR"] == head_ip and head_ip in env["no_proxy"].split(",")
    launcher_job = jobs.find_run(cluster.client, f"stand-in-{lora}", finished=True)
    assert result.job_id == jobs.training_job(cluster.client, launcher_job) != launcher_job


def test_stop_stops_the_training_processes_and_reattach_finds_them(head, tmp_path):
    from glmkit.launch.run import Cluster, run_miles, stop_run

    cluster = Cluster(head.dashboard, connect(head.dashboard), head)
    plan = _stand_in_plan(tmp_path, sleep=600)
    first = run_miles(cluster, plan, "stand-in-stop", env=_venv_path(), poll=0.2, timeout=60,
                      metrics_out=tmp_path / "m.jsonl")
    deadline = time.monotonic() + 120
    while first.status == "PENDING" or not (tmp_path / "train.pid").exists():  # the job is still starting
        assert first.status not in jobs.TERMINAL and time.monotonic() < deadline, (first.status, first.message)
        first = run_miles(cluster, plan, "stand-in-stop", env=_venv_path(), poll=0.2, timeout=10,
                          metrics_out=tmp_path / "m.jsonl")
    assert first.status == "RUNNING", first.message
    pid = int((tmp_path / "train.pid").read_text())
    os.kill(pid, 0)  # the training process runs
    # a client closed and reopened: re-attach follows the same training job, its rows already there
    again = run_miles(Cluster(head.dashboard, connect(head.dashboard), head), plan, "stand-in-stop", env=_venv_path(),
                      poll=0.2, timeout=3, metrics_out=tmp_path / "m.jsonl")
    assert again.job_id == first.job_id and len(again.rows) == 3
    assert len(read_metrics(tmp_path / "m.jsonl")) == 3  # not written twice
    assert stop_run(cluster, "stand-in-stop") == "STOPPED"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"the training process {pid} still runs after stop")
    assert jobs.find_run(cluster.client, "stand-in-stop") is None  # the launcher's job stopped too


def test_attach_to_a_finished_10000_row_run_replays_in_seconds(head, client, tmp_path):
    """Attaching to a finished run reads its log once and hands every row over in one batch (the live
    view draws once), not row by row."""
    from glmkit.launch.run import Cluster, attach

    code = ("import json\nfor i in range(10000):\n    print('step ' + str(i) + ': ' + json.dumps("
            "{'rollout/step': i, 'rollout/raw_reward': i / 10000}))")
    script = tmp_path / "rows.py"
    script.write_text(code)
    job = jobs.submit(client, f"{PY} {script}", "ten-thousand")
    deadline = time.monotonic() + 120
    while jobs._status(client, job) not in jobs.TERMINAL and time.monotonic() < deadline:
        time.sleep(0.5)
    batches = []
    start = time.monotonic()
    result = attach(Cluster(head.dashboard, connect(head.dashboard), head), "ten-thousand",
                    metrics_out=tmp_path / "m.jsonl", on_rows=batches.append, poll=0.2)
    seconds = time.monotonic() - start
    assert result.job_id == job and result.ok and len(result.rows) == 10000 and len(batches) == 1
    assert seconds < 10, seconds
    assert len(read_metrics(tmp_path / "m.jsonl")) == 10000
    assert attach(Cluster(head.dashboard, client, head), "no-such-run") is None


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "exit"])
def test_a_head_is_gone_when_the_process_that_started_it_ends(tmp_path, how):
    """However the starter ends (killed, terminated, or a normal exit without stop()), the head's
    guard stops every process of the head and removes its temp dir."""
    import signal
    import subprocess

    code = ("import sys, time\nfrom glmkit.launch.cluster import LocalHead\nhead = LocalHead.start(num_cpus=1)\n"
            "print(head.temp_dir, flush=True)\n" + ("time.sleep(600)\n" if how != "exit" else "sys.exit(0)\n"))
    proc = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, text=True)
    temp_dir = proc.stdout.readline().strip()
    assert temp_dir.startswith("/tmp/glmray-")
    assert _processes_mentioning(temp_dir)  # the head runs
    if how != "exit":
        proc.send_signal(getattr(signal, how))
    proc.wait(60)
    deadline = time.monotonic() + 30
    while _processes_mentioning(temp_dir) and time.monotonic() < deadline:
        time.sleep(0.25)
    assert not _processes_mentioning(temp_dir), _processes_mentioning(temp_dir)
    assert not Path(temp_dir).exists()


def _processes_mentioning(text: str) -> list[int]:
    """Live (not zombie) processes whose command line names `text`."""
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and any(text in part for part in p.info["cmdline"] or ()):
                found.append(p.pid)
        except psutil.Error:
            pass
    return found
