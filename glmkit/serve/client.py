"""A client of SGLang's native HTTP API (an SGLang server, or `glmkit serve`), and the rollout backend
and parity path built on it.

Connection errors are retried with exponential backoff (`retries`, `backoff_s`); a timeout, an HTTP
error or a connection that stays down raises `SGLangError` naming the server, the endpoint and the
reason.
"""

from __future__ import annotations

import base64
import os
import time
from pathlib import Path

import numpy as np
import requests
import torch


class SGLangError(ConnectionError):
    pass


class SGLangClient:
    def __init__(self, url: str, timeout_s: float = 600.0, retries: int = 3, backoff_s: float = 0.5):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"server URL must start with http:// or https://, got {url!r}")
        if retries < 0 or backoff_s < 0 or timeout_s <= 0:
            raise ValueError(f"need retries >= 0, backoff_s >= 0 and timeout_s > 0; got {retries}, {backoff_s}, "
                             f"{timeout_s}")
        self.url, self.timeout_s, self.retries, self.backoff_s = url.rstrip("/"), timeout_s, retries, backoff_s
        self.session = requests.Session()
        self.session.trust_env = False  # a proxy from the environment must not see loopback traffic

    def _call(self, method: str, path: str, body: dict | None = None):
        where = f"{self.url}{path}"
        for attempt in range(self.retries + 1):
            try:
                answer = self.session.request(method, where, json=body, timeout=self.timeout_s)
            except requests.Timeout:
                raise SGLangError(f"{where}: no answer within {self.timeout_s:g} s") from None
            except requests.ConnectionError as err:
                if attempt < self.retries:
                    time.sleep(self.backoff_s * 2 ** attempt)
                    continue
                raise SGLangError(f"{where}: connection failed or was lost after {attempt + 1} attempt(s) "
                                  f"({type(err).__name__}); is the server running?") from None
            if answer.status_code >= 400:
                try:
                    detail = answer.json().get("error", {}).get("message") or answer.text
                except ValueError:
                    detail = answer.text
                raise SGLangError(f"{where}: HTTP {answer.status_code}: {str(detail)[:500]}")
            try:
                return answer.json()
            except ValueError:
                raise SGLangError(f"{where}: the answer is not JSON: {answer.text[:200]!r}") from None
        raise AssertionError("unreachable")

    # ---- endpoints -----------------------------------------------------------------------------
    def health(self) -> bool:
        self._call("GET", "/health")
        return True

    def health_generate(self) -> bool:
        self._call("GET", "/health_generate")
        return True

    def model_info(self) -> dict:
        return self._call("GET", "/get_model_info")

    def generate(self, input_ids=None, text=None, sampling_params: dict | list | None = None, **options):
        """One input (a token list or a string) or a batch (a list of them) -> one answer or a list.
        options: return_logprob, logprob_start_len, return_routed_experts, return_indexer_topk, rid."""
        body = {k: v for k, v in dict(input_ids=input_ids, text=text, sampling_params=sampling_params,
                                      **options).items() if v is not None}
        return self._call("POST", "/generate", body)

    def flush_cache(self) -> dict:
        return self._call("POST", "/flush_cache")

    def abort(self, rid: str | None = None, abort_all: bool = False) -> dict:
        return self._call("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """SGLang's `/get_weights_by_name`: the tensor's first `truncate_size` rows as float32 nested lists."""
        return self._call("POST", "/get_weights_by_name", {"name": name, "truncate_size": truncate_size})

    def update_weights_from_tensor(self, tensors: dict, weight_version: str | None = None) -> dict:
        """Send named tensors (CPU copies, safetensors-encoded) in one request."""
        from safetensors.torch import save

        blob = save({name: t.detach().to("cpu").contiguous() for name, t in tensors.items()})
        return self._call("POST", "/update_weights_from_tensor", {
            "serialized_named_tensors": [base64.b64encode(blob).decode("ascii")], "load_format": "safetensors",
            "weight_version": weight_version})

    def init_weights_update_group(self, master_address: str, master_port: int, world_size: int = 2,
                                  rank_offset: int = 1, backend: str = "gloo",
                                  group_name: str = "weight_update_group", timeout_s: float = 300.0) -> dict:
        """Make this process rank 0 of a new process group that the server joins (as the framework's
        trainer does with SGLang), for `update_weights_from_distributed`. Both sides rendezvous at
        master_address:master_port; this process's default torch.distributed group becomes that group."""
        import datetime
        import threading

        import torch.distributed as dist

        if dist.is_initialized():
            raise ValueError("this process already has a torch.distributed group; one weights-update group each")
        answer, error = {}, []

        def ask():
            try:
                answer.update(self._call("POST", "/init_weights_update_group", {
                    "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                    "world_size": world_size, "group_name": group_name, "backend": backend,
                    "timeout_s": timeout_s}))
            except Exception as err:  # noqa: BLE001 - re-raised below, in the caller's thread
                error.append(err)

        asking = threading.Thread(target=ask)
        asking.start()
        dist.init_process_group(backend, init_method=f"tcp://{master_address}:{master_port}", world_size=world_size,
                                rank=0, timeout=datetime.timedelta(seconds=timeout_s))
        asking.join()
        if error:
            dist.destroy_process_group()
            raise error[0]
        self.update_group = group_name
        return answer

    def update_weights_from_distributed(self, tensors: dict, weight_version: str | None = None) -> dict:
        """Announce names, dtypes and shapes over HTTP and broadcast the tensors from rank 0 meanwhile."""
        import threading

        group = getattr(self, "update_group", None)
        if group is None:
            raise ValueError("call init_weights_update_group first")
        from glmkit.rl.parallel import announce, collective_device, send_announced

        ordered, announced = announce(tensors, collective_device())
        names, dtypes, shapes = (list(column) for column in zip(*announced)) if announced else ([], [], [])
        answer, error = {}, []

        def ask():
            try:
                answer.update(self._call("POST", "/update_weights_from_distributed", {
                    "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group,
                    "weight_version": weight_version}))
            except Exception as err:  # noqa: BLE001 - re-raised below
                error.append(err)

        asking = threading.Thread(target=ask)
        asking.start()
        send_announced(ordered)
        asking.join()
        if error:
            raise error[0]
        return answer

    def update_weights_from_disk(self, path: str | os.PathLike, weight_version: str | None = None) -> dict:
        return self._call("POST", "/update_weights_from_disk", {"model_path": str(path),
                                                               "weight_version": weight_version})


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


def decode_layers(meta: dict, key: str, tokens: int) -> dict:
    """meta_info's routed_experts / indexer_topk -> {layer: int64 tensor [tokens, width]}."""
    layers = meta.get(f"{key}_layers")
    if layers is None:
        raise SGLangError(f"the answer's meta_info has {key} but not {key}_layers: glmkit needs the layer list "
                          f"(glmkit serve sends it)")
    flat = np.frombuffer(base64.b64decode(meta[key]), dtype=np.int32)
    width = flat.size // max(1, tokens * len(layers))
    if flat.size != tokens * len(layers) * width:
        raise SGLangError(f"meta_info {key} holds {flat.size} values: not {tokens} tokens x {len(layers)} layers x k")
    array = flat.reshape(tokens, len(layers), width)
    return {int(layer): torch.from_numpy(array[:, i].astype("int64")) for i, layer in enumerate(layers)}


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
        from glmkit.model.rollout import Completion

        sampling = {"temperature": params.temperature, "top_p": params.top_p, "max_new_tokens": params.max_new_tokens,
                    "stop_token_ids": list(params.stop_token_ids), "sampling_seed": seed}
        if self.max_batch is None:  # glmkit serve states its limit; an SGLang server has none
            self.max_batch = int(self.client.model_info().get("max_batch_size") or len(prompt_ids) or 1)
        answers = []
        for start in range(0, len(prompt_ids), self.max_batch):
            chunk = [list(map(int, p)) for p in prompt_ids[start:start + self.max_batch]]
            answers += self.client.generate(input_ids=chunk, sampling_params=sampling, return_logprob=True,
                                            return_routed_experts=True, return_indexer_topk=True)
        completions = []
        for prompt, answer in zip(prompt_ids, answers):
            meta = answer["meta_info"]
            tokens = list(answer["output_ids"])
            fed = len(prompt) + len(tokens) - 1
            routing = decode_layers(meta, "routed_experts", fed) if "routed_experts" in meta else {}
            topk = ({k: v.to(torch.int32) for k, v in decode_layers(meta, "indexer_topk", fed).items()}
                    if "indexer_topk" in meta else {})
            completions.append(Completion(prompt=list(map(int, prompt)), tokens=tokens,
                                          logprobs=[lp for lp, _, _ in meta["output_token_logprobs"]],
                                          finish_reason=meta["finish_reason"]["type"], routing=routing, topk=topk))
        return completions

    def bind(self, policy):
        """The trainer's model, whose base weights the LoRA adapters merge into (GRPOTrainer calls this).
        Syncs send the trainable tensors only: the server must hold the trainer's starting checkpoint."""
        self.policy = policy
        version = self.client.model_info().get("weight_version", "default")
        if version != "default":
            import warnings

            warnings.warn(f"{self.client.url} was updated before this run (weight_version {version!r}): syncs "
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
