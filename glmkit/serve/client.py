"""A client of SGLang's native HTTP API (an SGLang server, or `glmkit serve`), and the rollout backend
and parity path built on it.

Connection errors are retried with exponential backoff (`retries`, `backoff_s`); a timeout, an HTTP
error or a connection that stays down raises `SGLangError` naming the server, the endpoint and the
reason.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import http.client
import json
import os
import re
import time
from pathlib import Path

import numpy as np
import requests
import torch
import urllib3

from glmkit.inputs import breaks_a_line


class SGLangError(ConnectionError):
    pass


# The largest answer read: a generate batch's JSON with per-token log-probs and recorded routing of
# long responses stays well under it; a server streaming without end is stopped here.
MAX_ANSWER_BYTES = 2 * 2 ** 30
MAX_INT_DIGITS = 20   # an int64 in decimal, with its sign: token ids, counts, shapes


def _read_answer(answer, where: str, deadline: float, timeout_s: float, limit: int) -> bytes:
    """The answer's body, read as it arrives under one deadline for the whole answer (a server that
    drips bytes never trips a per-read timeout) and at most `limit` bytes."""
    declared = answer.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > limit:
        raise SGLangError(f"{where}: the answer declares {int(declared)} bytes, over the client's {limit} byte limit")
    read = getattr(answer.raw, "read1", None) or (lambda n: answer.raw.read(n))  # read1: urllib3 >= 2.3
    parts, size = [], 0
    try:
        while True:
            chunk = read(1 << 20)
            if not chunk:
                break
            parts.append(chunk)
            size += len(chunk)
            if size > limit:
                raise SGLangError(f"{where}: the answer passed the client's {limit} byte limit")
            if time.monotonic() > deadline:
                raise SGLangError(f"{where}: the answer did not complete within {timeout_s:g} s")
    except (urllib3.exceptions.HTTPError, http.client.HTTPException) as err:  # a body shorter than declared, ...
        raise SGLangError(f"{where}: the answer was cut short or malformed ({type(err).__name__})") from None
    return b"".join(parts)


def _bounded_int(digits: str) -> int:
    if len(digits) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(digits)} digits")
    return int(digits)


def _parse_json(text: str, where: str):
    try:
        return json.loads(text, parse_int=_bounded_int)
    except RecursionError:
        raise SGLangError(f"{where}: the answer is JSON nested too deeply to read") from None
    except ValueError as err:
        raise SGLangError(f"{where}: the answer is not JSON a client can read ({str(err)[:100]}): {text[:200]!r}") from None


def check_server_url(url: str) -> None:
    """An http(s) URL with a host and, if given, a port in 1..65535; anything else is refused by name."""
    from urllib.parse import urlsplit

    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"server URL must start with http:// or https://, got {url!r}")
    if any(c == " " or breaks_a_line(c) for c in url):  # a line break would split the one-line error
        raise ValueError(f"server URL {url!r} holds a space or a control character; expected http://HOST:PORT")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as err:
        raise ValueError(f"server URL {url!r} is malformed ({err}); expected http://HOST:PORT") from None
    if not parts.hostname:
        raise ValueError(f"server URL {url!r} names no host; expected http://HOST:PORT")
    if not re.fullmatch(r"[A-Za-z0-9.\-:]+", parts.hostname):  # a name, an IPv4 or a bracketed IPv6 address
        raise ValueError(f"server URL {url!r}: host {parts.hostname!r} is not a host name or an IP address")
    if port is not None and not 1 <= port <= 65535:
        raise ValueError(f"server URL {url!r}: port {port} outside 1..65535")


def shown_url(url: str) -> str:
    """`url` as messages and reports show it: a password in it (http://user:secret@host) as ***."""
    return re.sub(r"^(https?://)[^/@]*@", lambda m: m.group(1) + "***@", url)


class SGLangClient:
    def __init__(self, url: str, timeout_s: float = 600.0, retries: int = 3, backoff_s: float = 0.5):
        check_server_url(url)
        if retries < 0 or backoff_s < 0 or timeout_s <= 0:
            raise ValueError(f"need retries >= 0, backoff_s >= 0 and timeout_s > 0; got {retries}, {backoff_s}, "
                             f"{timeout_s}")
        self.url, self.timeout_s, self.retries, self.backoff_s = url.rstrip("/"), timeout_s, retries, backoff_s
        self.shown = shown_url(self.url)  # what errors name: never a password the URL carries
        self.max_answer_bytes = MAX_ANSWER_BYTES
        self.session = requests.Session()
        self.session.trust_env = False  # a proxy from the environment must not see loopback traffic

    def _call(self, method: str, path: str, body: dict | None = None, json_answer: bool = True):
        where = f"{self.shown}{path}"
        for attempt in range(self.retries + 1):
            deadline = time.monotonic() + self.timeout_s
            try:
                # redirects are not followed: a server must not send the body (weights, prompts) elsewhere
                answer = self.session.request(method, where, json=body, timeout=self.timeout_s, stream=True,
                                              allow_redirects=False)
                with answer:
                    if answer.is_redirect or 300 <= answer.status_code < 400:
                        raise SGLangError(f"{where}: HTTP {answer.status_code} redirect to "
                                          f"{answer.headers.get('Location', '(no Location)')[:200]!r}; "
                                          f"redirects are not followed: give the server's own URL")
                    content = _read_answer(answer, where, deadline, self.timeout_s, self.max_answer_bytes)
            except requests.Timeout:
                raise SGLangError(f"{where}: no answer within {self.timeout_s:g} s") from None
            except requests.ConnectionError as err:
                if attempt < self.retries:
                    time.sleep(self.backoff_s * 2 ** attempt)
                    continue
                raise SGLangError(f"{where}: connection failed or was lost after {attempt + 1} attempt(s) "
                                  f"({type(err).__name__}); is the server running?") from None
            except requests.RequestException as err:  # a body cut short, a bad chunk: the answer is damaged
                raise SGLangError(f"{where}: the answer was cut short or malformed ({type(err).__name__})") from None
            text = content.decode(answer.encoding or "utf-8", errors="replace")
            if answer.status_code >= 400:
                raise SGLangError(f"{where}: HTTP {answer.status_code}: {error_text(text)[:500]}")
            if not json_answer:
                return text
            return _parse_json(text, where)
        raise AssertionError("unreachable")

    def _update(self, path: str, body: dict) -> dict:
        """A weight-update call: SGLang answers {"success", "message"}; success false is an error, and
        an answer without `success` true is not taken for one."""
        answer = self._object(self._call("POST", path, body), path)
        if answer.get("success") is not True:
            raise SGLangError(f"{self.shown}{path}: " + (str(answer.get("message"))[:500] if answer.get("success") is False
                                                       else f"no success true in the answer ({str(answer)[:200]})"))
        return answer

    def _object(self, answer, path: str) -> dict:
        if not isinstance(answer, dict):
            raise SGLangError(f"{self.shown}{path}: expected a JSON object, got {type(answer).__name__} "
                              f"({str(answer)[:100]})")
        return answer

    # ---- endpoints -----------------------------------------------------------------------------
    def health(self) -> bool:
        self._call("GET", "/health", json_answer=False)
        return True

    def health_generate(self) -> bool:
        self._call("GET", "/health_generate", json_answer=False)
        return True

    def model_info(self) -> dict:
        return self._object(self._call("GET", "/get_model_info"), "/get_model_info")

    def server_info(self) -> dict:
        return self._object(self._call("GET", "/get_server_info"), "/get_server_info")

    def generate(self, input_ids=None, text=None, sampling_params: dict | list | None = None, **options):
        """One input (a token list or a string) or a batch (a list of them) -> one answer or a list.
        options: return_logprob, logprob_start_len, return_routed_experts, return_indexer_topk, rid."""
        body = {k: v for k, v in dict(input_ids=input_ids, text=text, sampling_params=sampling_params,
                                      **options).items() if v is not None}
        answer = self._call("POST", "/generate", body)
        given = input_ids if input_ids is not None else text
        batched = isinstance(given, list) and (not given or not isinstance(given[0], int))
        answers = answer if batched and isinstance(answer, list) else [answer]
        if batched and (not isinstance(answer, list) or len(answer) != len(given)):
            raise SGLangError(f"{self.shown}/generate: {len(answer) if isinstance(answer, list) else 'no list of'} "
                              f"answers for a batch of {len(given)} inputs")
        for i, one in enumerate(answers):
            if not isinstance(one, dict) or not isinstance(one.get("meta_info"), dict):
                raise SGLangError(f"{self.shown}/generate: answer {i} is not an object with meta_info "
                                  f"({str(one)[:100]})")
        return answer

    def flush_cache(self) -> str:
        return self._call("POST", "/flush_cache", json_answer=False)

    def abort(self, rid: str | None = None, abort_all: bool = False) -> dict:
        return self._call("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all}, json_answer=False)

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """SGLang's `/get_weights_by_name`: the tensor's first `truncate_size` rows as float32 nested lists."""
        return self._call("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    def update_weights_from_tensor(self, tensors: dict, weight_version: str | None = None) -> dict:
        """Send named tensors (CPU copies, safetensors-encoded) in one request."""
        from safetensors.torch import save

        blob = save({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()})
        return self._update("/update_weights_from_tensor", {
            "serialized_named_tensors": [base64.b64encode(blob).decode("ascii")], "load_format": "safetensors",
            "weight_version": weight_version})

    def init_weights_update_group(self, master_address: str, master_port: int, world_size: int = 2,
                                  rank_offset: int = 1, backend: str = "gloo",
                                  group_name: str = "weight_update_group", timeout_s: float = 300.0):
        """Host a weights-update group as the framework's trainer does (rank 0: its rendezvous store
        at master_address:master_port, `PrefixStore(group_name)`, a named group outside this process's
        default one) while the server joins it as `rank_offset`. -> the server's answer; the group is
        kept for `update_weights_from_distributed`."""
        import threading

        from glmkit.serve.update_group import new_named_group

        if getattr(self, "update_group", None) is not None:
            raise ValueError(f"this client already holds the weights-update group {self.group_name!r}")
        answer, error = {}, []

        def ask():
            try:
                answer.update(self._update("/init_weights_update_group", {
                    "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                    "world_size": world_size, "group_name": group_name, "backend": backend,
                    "timeout_s": timeout_s}))
            except Exception as err:  # noqa: BLE001 - re-raised below, in the caller's thread
                error.append(err)

        asking = threading.Thread(target=ask)
        asking.start()
        try:
            group = new_named_group(backend, master_address, master_port, world_size, 0, group_name, timeout_s)
        except Exception:
            asking.join()
            if error:
                raise error[0] from None
            raise
        asking.join()
        if error:
            import torch.distributed as dist

            dist.destroy_process_group(group)
            raise error[0]
        self.update_group, self.group_name, self.group_backend = group, group_name, backend
        return answer

    def update_weights_from_distributed(self, tensors: dict, weight_version: str | None = None) -> dict:
        """Announce names, dtypes and shapes over HTTP and broadcast the tensors from rank 0 meanwhile,
        one per name, in the announced order (the framework's way)."""
        import threading

        group = getattr(self, "update_group", None)
        if group is None:
            raise ValueError("call init_weights_update_group first")
        from glmkit.collectives import announce, send_announced

        device = torch.device("cuda", torch.cuda.current_device()) if self.group_backend == "nccl" else "cpu"
        ordered, announced = announce(tensors, device)
        names, dtypes, shapes = (list(column) for column in zip(*announced)) if announced else ([], [], [])
        answer, error = {}, []

        def ask():
            try:
                answer.update(self._update("/update_weights_from_distributed", {
                    "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": self.group_name,
                    "flush_cache": False, "weight_version": weight_version}))
            except Exception as err:  # noqa: BLE001 - re-raised below
                error.append(err)

        asking = threading.Thread(target=ask)
        asking.start()
        send_announced(ordered, group)
        asking.join()
        if error:
            raise error[0]
        return answer

    def destroy_weights_update_group(self) -> dict:
        import torch.distributed as dist

        answer = self._update("/destroy_weights_update_group", {"group_name": self.group_name})
        dist.destroy_process_group(self.update_group)
        self.update_group = None
        return answer

    def update_weights_from_disk(self, path: str | os.PathLike, weight_version: str | None = None) -> dict:
        return self._update("/update_weights_from_disk", {"model_path": str(path), "weight_version": weight_version})

    def pause_generation(self, mode: str = "retract") -> dict:
        return self._call("POST", "/pause_generation", {"mode": mode})

    def continue_generation(self) -> dict:
        return self._call("POST", "/continue_generation", {})


@contextlib.contextmanager
def answer_read(url: str, index: int, path: str = "/generate"):
    """Reading one answer of a batch: a field missing or of the wrong kind is the server's answer at
    fault, named with the server and the answer's index (exit 2), not an internal error."""
    try:
        yield
    except SGLangError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError, binascii.Error, OverflowError) as err:
        raise SGLangError(f"{url}{path}: answer {index} cannot be read ({type(err).__name__}: {str(err)[:200]})") from None


def error_text(text: str) -> str:
    """The reason in any of SGLang's error bodies: {"error": "..."}, {"error": {"message"}},
    {"object": "error", "message"}, {"success": false, "message"}, or plain text."""
    try:
        body = json.loads(text, parse_int=_bounded_int)
    except (ValueError, RecursionError):
        return text
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return str(err.get("message") or err)
        if err is not None:
            return str(err)
        if body.get("message") is not None:
            return str(body["message"])
    return text


def write_weights_dir(tensors: dict, root: str | os.PathLike, name: str) -> Path:
    """Write named tensors to root/name/weights.safetensors atomically: a marked staging directory
    renamed into place, so a server never reads half a directory. An existing root/name that glmkit
    wrote is replaced; anything else there is refused."""
    from safetensors.torch import save_file

    from glmkit.outputs import check_dir_out, move_into_place, staging_dir

    final = check_dir_out(Path(root) / name, "--weight-update-dir", overwrite=True)
    staging = staging_dir(final, "weight update")
    save_file({k: t.detach().to("cpu").contiguous() for k, t in tensors.items()}, str(staging / "weights.safetensors"))
    move_into_place(staging, final)
    return final


def _rows_of(meta: dict, key: str, rows: int, layers_axis: int) -> np.ndarray:
    flat = np.frombuffer(base64.b64decode(meta[key]), dtype="<i4")
    per_row = rows * layers_axis
    if per_row == 0 or flat.size % per_row:
        raise SGLangError(f"meta_info {key} holds {flat.size} values: not {rows} tokens x {layers_axis} layers x k")
    return flat.reshape(rows, layers_axis, flat.size // per_row)


def decode_routed_experts(meta: dict, rows: int, num_layers: int, moe_layers) -> dict:
    """SGLang's routed_experts (base64 int32 [rows, num_hidden_layers, k], dense layers' rows 0) ->
    {MoE layer: int64 tensor [rows, k]}. rows = prompt + completion tokens - 1."""
    array = _rows_of(meta, "routed_experts", rows, num_layers)
    return {int(layer): torch.from_numpy(array[:, layer].astype("int64")) for layer in moe_layers}


def decode_indexer_topk(meta: dict, rows: int, dsa_layers) -> dict:
    """indexer_topk (base64 int32 [rows, indexer_topk_num_layers, width], sequence positions, -1 empty)
    -> {DSA layer: int64 tensor [rows, width]}, the layers in model order."""
    count = int(meta.get("indexer_topk_num_layers", len(dsa_layers)))
    if count != len(dsa_layers):
        raise SGLangError(f"meta_info indexer_topk_num_layers is {count}; the model has {len(dsa_layers)} DSA layers")
    array = _rows_of(meta, "indexer_topk", rows, count)
    return {int(layer): torch.from_numpy(array[:, i].astype("int64")) for i, layer in enumerate(dsa_layers)}


def _logprob(value) -> float:
    """One answered log-prob: null (what SGLang writes for a NaN or Inf, JSON having neither) reads as NaN,
    so the trainer sees a non-finite rollout rather than a TypeError."""
    return float("nan") if value is None else float(value)


def model_layers(config) -> tuple[int, list, list]:
    """(num_hidden_layers, MoE layers, DSA layers) of a glm5_next text config."""
    from glmkit.config import layer_kinds

    moe = [i for i, t in enumerate(config.mlp_layer_types) if t == "sparse"]
    dsa = [i for i, kind in enumerate(layer_kinds(config)) if kind == "dsa"]
    return config.num_hidden_layers, moe, dsa


class SGLangRollout:
    """The GRPO rollout side on a server speaking SGLang's API (`glmkit train --rollout-url`): the
    same generate(prompt_ids, params, seed) / load(tensors) calls as LocalRollout and the Ray backend.

    `load` pushes every trainable tensor after an optimizer step; with LoRA the adapters are merged
    into their base projections first (W + B A * alpha / r, from `policy`), so the server needs no
    LoRA support. mode "tensor" sends them in the request body; "disk" writes an atomically renamed
    directory under `update_dir` (the server must allow it with --allow-updates-from); "distributed"
    broadcasts them over a weights-update process group (`master` HOST:PORT, this process rank 0;
    gloo on the CPU, nccl on GPUs), as the framework does."""

    MODES = ("tensor", "disk", "distributed")

    def __init__(self, url: str, policy=None, mode: str = "tensor", update_dir: str | None = None,
                 master: str | None = None, **client_options):
        if mode not in self.MODES:
            raise ValueError(f"weight update mode {mode!r}; allowed: {', '.join(self.MODES)}")
        if mode == "disk" and not update_dir:
            raise ValueError("weight update mode 'disk' needs an update directory (--weight-update-dir)")
        if mode == "distributed":
            host, _, port = (master or "").rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"weight update mode 'distributed' needs --weight-update-master HOST:PORT, "
                                 f"got {master!r}")
        self.master = master
        self.client = SGLangClient(url, **client_options)
        self.policy, self.mode, self.update_dir, self.version = policy, mode, update_dir, 0
        self.max_batch = None

    def generate(self, prompt_ids, params, seed: int):
        # the framework's sampling dict; each sequence its own seed (the framework: rollout seed + index)
        sampling = [{"temperature": params.temperature, "top_p": params.top_p, "top_k": -1,
                     "max_new_tokens": params.max_new_tokens, "stop": None,
                     "stop_token_ids": list(params.stop_token_ids) or None, "skip_special_tokens": False,
                     "no_stop_trim": True, "spaces_between_special_tokens": False,
                     "sampling_seed": (seed * 1_000_003 + i) % (1 << 63)} for i in range(len(prompt_ids))]
        if self.max_batch is None:  # SGLang's /server_info states max_running_requests (may be null)
            given = self.client.server_info().get("max_running_requests")
            if given is not None and (not isinstance(given, int) or isinstance(given, bool) or given < 1):
                raise SGLangError(f"{self.client.shown}/get_server_info: max_running_requests {str(given)[:40]!r}; "
                                  f"expected a positive integer or null")
            self.max_batch = given or len(prompt_ids) or 1
        answers = []
        for start in range(0, len(prompt_ids), self.max_batch):
            chunk = [list(map(int, p)) for p in prompt_ids[start:start + self.max_batch]]
            answers += self.client.generate(input_ids=chunk, sampling_params=sampling[start:start + self.max_batch],
                                            return_logprob=True, return_routed_experts=True, return_indexer_topk=True)
        if self.policy is None:
            raise ValueError("SGLangRollout needs the policy model (bind) to read the layers of routed experts")
        num_layers, moe, dsa = model_layers(self.policy.config)
        completions = []
        for i, (prompt, answer) in enumerate(zip(prompt_ids, answers)):
            with answer_read(self.client.shown, i):
                completions.append(self._completion(prompt, answer["meta_info"], num_layers, moe, dsa))
        return completions

    @staticmethod
    def _completion(prompt, meta: dict, num_layers: int, moe, dsa):
        """One answer's meta_info as the Completion the trainer reads."""
        from glmkit.model.rollout import Completion

        pairs = meta.get("output_token_logprobs") or []  # tokens as the framework reads them
        tokens = [int(t) for _, t, *_ in pairs]
        rows = len(prompt) + len(tokens) - 1
        routing = decode_routed_experts(meta, rows, num_layers, moe) if "routed_experts" in meta else {}
        topk = ({k: v.to(torch.int32) for k, v in decode_indexer_topk(meta, rows, dsa).items()}
                if "indexer_topk" in meta else {})
        return Completion(prompt=list(map(int, prompt)), tokens=tokens, logprobs=[_logprob(lp) for lp, *_ in pairs],
                          finish_reason=meta["finish_reason"]["type"], routing=routing, topk=topk)

    def bind(self, policy):
        """The trainer's model, whose base weights the LoRA adapters merge into (GRPOTrainer calls this).
        Syncs send the trainable tensors only: the server must hold the trainer's starting checkpoint."""
        self.policy = policy
        version = self.client.model_info().get("weight_version", "default")  # SGLang's live version
        if version != "default":
            import warnings

            warnings.warn(f"{self.client.shown} was updated before this run (weight_version {version!r}): syncs "
                          f"send only the trainable tensors, so its other weights must equal this run's checkpoint "
                          f"(restart the server from it to be sure)", stacklevel=2)

    def merged(self, tensors: dict) -> dict:
        """Adapter tensors -> the merged weights of their projections; other tensors unchanged."""
        adapters = {n.rsplit(".", 1)[0] for n in tensors if n.endswith((".lora_A", ".lora_B"))}
        if not adapters:
            return dict(tensors)
        if self.policy is None:
            raise ValueError("LoRA adapters can only be pushed merged: SGLangRollout needs the policy model")
        modules = dict(self.policy.named_modules())
        out = {n: t for n, t in tensors.items() if n.rsplit(".", 1)[0] not in adapters}
        with torch.no_grad():
            for name in sorted(adapters):
                m = modules[name]
                delta = (m.lora_B.float() @ m.lora_A.float()) * m.scaling
                out[f"{name}.weight"] = (m.weight.float() + delta).to(m.weight.dtype)
        return out

    def load(self, tensors: dict):
        self.version += 1
        tensors = self.merged(tensors)
        if self.mode == "tensor":
            self.client.update_weights_from_tensor(tensors, weight_version=str(self.version))
        elif self.mode == "distributed":
            if getattr(self.client, "update_group", None) is None:
                host, _, port = self.master.rpartition(":")
                backend = "nccl" if any(t.is_cuda for t in tensors.values()) else "gloo"
                self.client.init_weights_update_group(host, int(port), backend=backend)
            self.client.update_weights_from_distributed(tensors, weight_version=str(self.version))
        else:
            path = write_weights_dir(tensors, self.update_dir, "glmkit-update")
            self.client.update_weights_from_disk(path, weight_version=str(self.version))
