"""The Ray cluster a launch runs on: start a local head (loopback only), connect, take inventory.

    head = LocalHead.start()            # ray start --head --block on 127.0.0.1, every port free, guarded
    client = connect(head.dashboard)    # Jobs API (http://HOST:8265); ray://HOST:10001 for Ray Client
    nodes = inventory(head.dashboard)   # [{node, ip, alive, head, gpus, gpu_type, gpu_memory_gib, cpus, memory_gib}]
    head.stop()                         # stops what start() started, nothing else on the machine
                                        # (and so does this process's end, however it ends)

A fresh head often refuses the first connection for a few seconds (its dashboard and job agent
start after the GCS): `connect` retries those, and reports an address where nothing listens in one
line after its retries.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

LOOPBACK = "127.0.0.1"


class ClusterUnreachable(ConnectionError):
    """Nothing answered at the address (after retries), or it is not a Ray address."""


def free_port(host: str = LOOPBACK) -> int:
    """A port nothing listens on at `host` now (the OS picks it; another process may take it later)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


# Every port a head binds, each picked free (Ray's defaults are fixed numbers, e.g. the dashboard
# agent's 52365: a second head on a shared machine would fail with "No available agent").
HEAD_PORTS = ("--port", "--dashboard-port", "--ray-client-server-port", "--dashboard-agent-listen-port",
              "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port",
              "--object-manager-port", "--node-manager-port")


@dataclass
class LocalHead:
    """A Ray head glmkit started on this machine, bound to 127.0.0.1, every port chosen free. It runs
    under `glmkit.launch.headguard`, which stops it (and everything it started) when `stop()` is called
    or when this process ends in any way, SIGKILL included."""

    process: subprocess.Popen   # the guard
    ports: dict                 # ray start option -> port
    temp_dir: str
    log_path: str

    @property
    def gcs_port(self) -> int:
        return self.ports["--port"]

    @property
    def dashboard_port(self) -> int:
        return self.ports["--dashboard-port"]

    @property
    def client_port(self) -> int:
        return self.ports["--ray-client-server-port"]

    @property
    def dashboard(self) -> str:
        return f"http://{LOOPBACK}:{self.dashboard_port}"

    @property
    def client(self) -> str:
        return f"ray://{LOOPBACK}:{self.client_port}"

    @property
    def gcs(self) -> str:
        return f"{LOOPBACK}:{self.gcs_port}"

    @classmethod
    def start(cls, num_cpus: int = 2, num_gpus: int | None = None, timeout: float = 120.0,
              attempts: int = 3) -> "LocalHead":
        """Start a head; a start that fails before it is up (a port taken between picking and binding,
        on a busy machine) is retried with new ports, `attempts` times in all."""
        ray = shutil.which("ray", path=str(Path(sys.executable).parent)) or shutil.which("ray")
        if ray is None:
            raise FileNotFoundError("the `ray` command is not installed (pip install 'ray[default]')")
        deadline = time.monotonic() + timeout
        for attempt in range(1, attempts + 1):
            head, why = cls._try_start(ray, num_cpus, num_gpus, deadline)
            if head is not None:
                return head
            if why is None:
                raise TimeoutError(f"the local Ray head did not come up within {timeout:.0f} s")
            if attempt == attempts or time.monotonic() >= deadline:
                raise RuntimeError(f"ray start --head failed {attempt} time(s); the last output:\n{why}")

    @classmethod
    def _try_start(cls, ray: str, num_cpus: int, num_gpus: int | None, deadline: float):
        """(head, None) once up; (None, its output) when it exited; (None, None) at the deadline."""
        ports = _free_ports(len(HEAD_PORTS))
        ports = dict(zip(HEAD_PORTS, ports))
        # short: Ray's unix socket paths must fit in 107 bytes
        temp_dir = tempfile.mkdtemp(prefix="glmray-", dir="/tmp")
        log_path = temp_dir + ".log"
        argv = [ray, "start", "--head", "--block", "--node-ip-address", LOOPBACK, "--dashboard-host", LOOPBACK,
                *[str(w) for flag, port in ports.items() for w in (flag, port)],
                "--num-cpus", str(num_cpus), "--temp-dir", temp_dir, "--disable-usage-stats",
                "--include-dashboard", "true"]
        if num_gpus is not None:
            argv += ["--num-gpus", str(num_gpus)]
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        # Ray 2.60 turns token auth on for a new head when ~/.ray/auth_token exists (an earlier local
        # ray.init writes one) while clients without RAY_AUTH_MODE=token send no token: every call to
        # the head would be refused. Pin the mode so that the head and this process agree; a mode the
        # user set explicitly is kept (both sides read it).
        env.setdefault("RAY_AUTH_MODE", "disabled")
        guard = [sys.executable, "-m", "glmkit.launch.headguard", "--parent", str(os.getpid()),
                 "--temp-dir", temp_dir, "--log", log_path, "--", *argv]
        # its own session: a Ctrl-C meant for this process does not reach the head; stop() decides
        with open(log_path, "ab") as log:  # the guard's own errors, if any, beside the head's output
            process = subprocess.Popen(guard, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                                       start_new_session=True)
        head = cls(process, ports, temp_dir, log_path)
        atexit.register(head.stop)
        while time.monotonic() < deadline:
            if process.poll() is not None:
                why = _read_tail(log_path)
                head.stop()
                return None, why or f"(the guard exited with {process.returncode} and left no output)"
            # ready = the Jobs API answers and the head node is registered (lists as ALIVE)
            if _listening(LOOPBACK, head.dashboard_port) and _jobs_api_ready(head.dashboard) \
                    and _head_alive(head.dashboard):
                return head, None
            time.sleep(0.5)
        head.stop()
        return None, None

    def stop(self, timeout: float = 45.0):
        """Stop this head and everything it started, and nothing else: the guard is asked (it signals
        every process it noted under the head, SIGTERM then SIGKILL); if it does not finish within
        `timeout` seconds, its process group is killed. A second call does nothing (the guard's pid,
        reaped, may belong to someone else by then)."""
        atexit.unregister(self.stop)
        if self.process.poll() is not None:  # finished and reaped before: nothing of ours is left to signal
            self._clean_files()
            return
        group = self.process.pid  # unreaped until the wait below: the number still names our group
        try:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(group, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            self.process.wait()
        deadline = time.monotonic() + 10  # killed processes linger as zombies until init reaps them
        while _group_alive(group) and time.monotonic() < deadline:
            time.sleep(0.1)
        self._clean_files()

    def _clean_files(self):
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        try:
            os.unlink(self.log_path)
        except OSError:
            pass


def _free_ports(n: int) -> list[int]:
    """n distinct ports nothing listens on now (all held open together while the OS picks them)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((LOOPBACK, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _read_tail(path: str, limit: int = 4000) -> str:
    try:
        return Path(path).read_text(errors="replace")[-limit:]
    except OSError:
        return ""


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _jobs_api_ready(dashboard: str) -> bool:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(f"{dashboard}/api/version", timeout=2) as r:
            return r.status == 200
    except urllib.error.HTTPError as err:
        return err.code == 401  # up, and asks for the token Ray's own clients send (RAY_AUTH_MODE=token)
    except OSError:
        return False


def _head_alive(dashboard: str) -> bool:
    from ray.util.state import list_nodes

    try:
        return any(getattr(n, "state", None) == "ALIVE" for n in list_nodes(address=dashboard, raise_on_missing_output=False))
    except Exception:  # the state API is not up yet
        return False


def _check_address(address: str) -> tuple[str, str, int]:
    usage = "use http://HOST:8265 (Jobs API) or ray://HOST:10001 (Ray Client)"
    try:  # urllib refuses a broken IPv6 bracket or a port past 65535 with its own ValueError
        parsed = urlparse(address)
        port = parsed.port
    except ValueError as err:
        raise ClusterUnreachable(f"{address!r} is not a Ray address ({err}); {usage}") from None
    if parsed.scheme not in ("http", "https", "ray") or not parsed.hostname:
        raise ClusterUnreachable(f"{address!r} is not a Ray address; {usage}")
    return parsed.scheme, parsed.hostname, port or (10001 if parsed.scheme == "ray" else 8265)


def connect(address: str, retries: int = 5, delay: float = 2.0):
    """A JobSubmissionClient for http(s):// addresses (the Ray Client's ray:// connects the driver:
    `ray.init(address)`, returned as the ray module). Connection errors are retried `retries` times."""
    scheme, host, port = _check_address(address)
    last = None
    for attempt in range(retries + 1):
        if not _listening(host, port):
            last = f"nothing listens on {host}:{port}"
        else:
            try:
                if scheme == "ray":
                    import ray

                    ray.init(address=address, logging_level="ERROR")
                    return ray
                from ray.job_submission import JobSubmissionClient

                return JobSubmissionClient(address)
            except (ConnectionError, RuntimeError, OSError) as err:  # a head still starting its services
                last = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        if attempt < retries:
            time.sleep(delay)
    raise ClusterUnreachable(f"cannot reach the Ray cluster at {address} after {retries + 1} tries: {last}")


def inventory(dashboard: str) -> list[dict]:
    """One dict per node: name, ip, alive, head, gpus (total), gpu_type (Ray's accelerator_type
    resource, None if not reported), cpus, memory_gib; sorted by ip. GPU memory is not a Ray resource:
    `gpu_memory_gib` is filled where the node advertises a `gpu_memory_gib:<n>` custom resource
    (glmkit's worker start-up sets it), else None."""
    from ray.util.state import list_nodes

    _check_address(dashboard)
    try:
        nodes = list_nodes(address=dashboard, detail=True, raise_on_missing_output=False)
    except (KeyError, TypeError, AttributeError, ValueError) as err:  # something answered, not Ray's state API
        what = (f"no field {err}" if isinstance(err, KeyError) else
                f"{type(err).__name__}: {str(err).splitlines()[0][:80] if str(err) else 'an answer of another shape'}")
        raise ClusterUnreachable(f"cannot list the nodes of {dashboard}: it answered, but not as Ray's dashboard "
                                 f"does ({what}); give the Ray head's dashboard address (http://HEAD:8265)") from err
    except Exception as err:  # the state API raises its own types for an unreachable dashboard
        raise ClusterUnreachable(f"cannot list the nodes of {dashboard}: {str(err).splitlines()[0]}") from err
    rows = []
    for n in nodes:
        n = n if isinstance(n, dict) else n.__dict__
        total = n.get("resources_total") or {}
        accel = next((k.split(":", 1)[1] for k in total if k.startswith("accelerator_type:")), None)
        mem = next((float(k.split(":", 1)[1]) for k in total if k.startswith("gpu_memory_gib:")), None)
        rows.append({"node": n.get("node_name") or n.get("node_id"), "node_id": n.get("node_id"),
                     "ip": n.get("node_ip"), "alive": n.get("state") == "ALIVE", "head": bool(n.get("is_head_node")),
                     "gpus": int(total.get("GPU", 0)), "gpu_type": accel, "gpu_memory_gib": mem,
                     "cpus": int(total.get("CPU", 0)), "memory_gib": total.get("memory", 0) / 2 ** 30})
    return sorted(rows, key=lambda r: (r["ip"] or "", r["node"] or ""))
