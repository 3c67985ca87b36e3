"""glmkit ckpt verify-engine against a live `glmkit serve` (SGLang's /get_weights_by_name): a correct
engine passes, a correct update passes against the new checkpoint, a broken update is found by name."""

import sys

sys.modules.setdefault("fla", None)

import http.server
import json
import re
import threading
import time

import pytest
import requests
import torch

from glmkit.checkpoint import open_checkpoint, save_checkpoint
from glmkit.cli import main
from glmkit.serve.client import SGLangClient
from glmkit.serve.weights import engine_name, sample_names, verify_engine
from tests.test_serve import CKPT, Server

EXPERT = "model.language_model.layers.3.mlp.experts.1.gate_proj.weight"
HEAD = "lm_head.weight"


@pytest.fixture(scope="module")
def updates_root(tmp_path_factory):
    return tmp_path_factory.mktemp("updates")


@pytest.fixture(scope="module")
def server(updates_root):
    s = Server("--allow-updates-from", str(updates_root))
    yield s
    s.kill()


def test_the_endpoint_answers_in_sglang_layout(server):
    """The bare nested list (no wrapper), the first truncate_size rows, float32 values; GET with a JSON
    body as SGLang's route takes it; names in the checkpoint's, SGLang's or the model's own form."""
    head = open_checkpoint(CKPT).get(HEAD)
    answer = requests.post(server.url + "/get_weights_by_name", json={"name": HEAD, "truncate_size": 3}, timeout=30)
    assert answer.status_code == 200 and isinstance(answer.json(), list)
    assert torch.equal(torch.tensor(answer.json()), head[:3].float())
    default = requests.get(server.url + "/get_weights_by_name", json={"name": "model.norm.weight"}, timeout=30).json()
    assert torch.equal(torch.tensor(default), open_checkpoint(CKPT).get("model.language_model.norm.weight"))
    for name in (EXPERT, engine_name(EXPERT), EXPERT.removeprefix("model.language_model.")):
        got = SGLangClient(server.url).get_weights_by_name(name, truncate_size=100)
        assert torch.equal(torch.tensor(got), open_checkpoint(CKPT).get(EXPERT)), name
    missing = requests.post(server.url + "/get_weights_by_name", json={"name": "model.layers.99.nothing"}, timeout=30)
    assert missing.status_code == 400 and "Get parameter by name failed" in missing.json()["error"]["message"]
    bad = requests.post(server.url + "/get_weights_by_name", json={"name": HEAD, "truncate_size": 0}, timeout=30)
    assert bad.status_code == 400


def test_sampling_keeps_the_ends_and_is_seeded():
    names = open_checkpoint(CKPT).text_keys()
    picked = sample_names(names, 10, seed=1)
    assert len(picked) == 10 and HEAD in picked and "model.language_model.embed_tokens.weight" in picked
    assert picked == sample_names(names, 10, seed=1) != sample_names(names, 10, seed=2)
    assert sample_names(names, 0, seed=1) == names


def test_a_correct_engine_passes_for_every_tensor(server):
    report = verify_engine(CKPT, server.url, sample=0, progress=False)
    assert report.passed, report.text()
    assert report.sampled == len(open_checkpoint(CKPT).text_keys()) == len(report.matched)
    assert {row["as"] for row in report.matched} == {"float32"}


def test_a_correct_update_passes_against_the_new_checkpoint(server, updates_root, tmp_path, capsys):
    """The engine updated from disk to a checkpoint whose every tensor moved: the new one passes, the old
    one fails on every tensor that changed."""
    old = open_checkpoint(CKPT)
    new_tensors = {name: old.get(name) * 1.25 + 0.01 for name in old.text_keys()}
    new = save_checkpoint(updates_root / "step-1", old.config, new_tensors.items())
    assert SGLangClient(server.url).update_weights_from_disk(new, weight_version="1")["success"]
    assert main(["ckpt", "verify-engine", "--hf", str(new), "--url", server.url, "--sample", "0"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("verdict: pass")
    stale = verify_engine(CKPT, server.url, sample=0, progress=False)
    assert len(stale.differing) == len(old.text_keys()) and not stale.matched
    # back to the original for the next test
    assert SGLangClient(server.url).update_weights_from_disk(
        save_checkpoint(updates_root / "step-2", old.config, ((n, old.get(n)) for n in old.text_keys())))["success"]


def test_a_broken_update_is_found_by_tensor_name(server, tmp_path, capsys):
    ckpt = open_checkpoint(CKPT)
    head = ckpt.get(HEAD)
    broken = {EXPERT.removeprefix("model.language_model."): ckpt.get(EXPERT) * 2,
              HEAD: torch.cat([head[1:], head[:1]])}  # rows shifted by one: a misaligned copy
    SGLangClient(server.url).update_weights_from_tensor(broken, weight_version="broken")
    out = tmp_path / "engine.json"
    assert main(["ckpt", "verify-engine", "--hf", str(CKPT), "--url", server.url, "--sample", "0",
                 "--json", str(out)]) == 1
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert data["verdict"] == "fail" and sorted(r["name"] for r in data["differing"]) == [HEAD, EXPERT]
    by_name = {r["name"]: r for r in data["differing"]}
    assert by_name[EXPERT]["cause"] == "scaled by 2" and by_name[EXPERT]["differing"] == by_name[EXPERT]["numel"]
    assert f"differing: {EXPERT}" in text and len(data["matched"]) == len(ckpt.text_keys()) - 2
    # a 5-tensor sample still finds the head: the embedding, final norm and head are always sampled
    few = verify_engine(CKPT, server.url, sample=5, seed=0, progress=False)
    assert few.sampled == 5 and HEAD in [r["name"] for r in few.differing]
    SGLangClient(server.url).update_weights_from_tensor({name: ckpt.get(EXPERT if name != HEAD else HEAD)
                                                        for name in broken})


def test_nan_in_the_engine_is_a_finding_answered_as_null(tmp_path):
    """An engine holding NaN (here: started from a checkpoint that has one; a weight update carrying
    NaN is refused): the server answers null as SGLang's orjson does (not a 500), and the check names
    the tensor and the cause instead of stopping."""
    import shutil

    from safetensors.torch import load_file, save_file

    ckpt = open_checkpoint(CKPT)
    norm = "model.language_model.norm.weight"
    poisoned_dir = tmp_path / "poisoned"
    shutil.copytree(CKPT, poisoned_dir)
    tensors = load_file(str(poisoned_dir / "model.safetensors"))
    tensors[norm] = tensors[norm].clone()
    tensors[norm][5] = float("nan")
    save_file(tensors, str(poisoned_dir / "model.safetensors"), metadata={"format": "pt"})
    server = Server(checkpoint=poisoned_dir)
    try:
        answer = requests.post(server.url + "/get_weights_by_name", json={"name": "model.norm.weight"},
                               timeout=30).json()
        assert answer[5] is None and answer[4] is not None
        report = verify_engine(CKPT, server.url, sample=0, progress=False)
        assert [r["name"] for r in report.differing] == [norm] and report.differing[0]["differing"] == 1
        assert report.differing[0]["cause"].startswith("non-finite")
        # hostile pass 15: against the checkpoint that holds the same NaN it passed (null matched NaN)
        same = verify_engine(poisoned_dir, server.url, sample=0, progress=False)
        assert not same.differing and same.nonfinite == [{"name": norm, "count": 1, "numel": 64}] and not same.passed
        assert f"not finite: {norm}: the engine holds 1 NaN or infinite values" in same.text()
        SGLangClient(server.url).update_weights_from_tensor({"norm.weight": ckpt.get(norm)})
        assert verify_engine(CKPT, server.url, sample=0, progress=False).passed
    finally:
        server.kill()


def test_an_engine_in_bfloat16_matches_as_bfloat16():
    server = Server("--dtype", "bfloat16")
    try:
        report = verify_engine(CKPT, server.url, sample=0, progress=False)
    finally:
        server.kill()
    assert report.passed, report.text()
    kinds = {row["as"] for row in report.matched}
    assert "bfloat16" in kinds and kinds <= {"float32", "bfloat16"}


class _JSONHandler(http.server.BaseHTTPRequestHandler):
    def _send(self, body: bytes, status: int = 200):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class _NoWeightsHandler(_JSONHandler):
    """An SGLang server whose model class has no get_weights_by_name: 400 as SGLang answers it."""

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._send(json.dumps({"error": {"message": "Get parameter by name failed"}}).encode(), 400)


def test_an_engine_that_answers_for_nothing_or_is_gone_is_exit_2(capsys):
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NoWeightsHandler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}"
    try:
        assert main(["ckpt", "verify-engine", "--hf", str(CKPT), "--url", url, "--sample", "3"]) == 2
        assert "answered /get_weights_by_name for none of the 3" in capsys.readouterr().err
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert main(["ckpt", "verify-engine", "--hf", str(CKPT), "--url", url, "--sample", "3"]) == 2
    assert "connection failed" in capsys.readouterr().err
    secret = url.replace("http://", "http://user:s3cret@")  # a password in the URL is never printed
    assert main(["ckpt", "verify-engine", "--hf", str(CKPT), "--url", secret, "--sample", "3"]) == 2
    err = capsys.readouterr().err
    assert "connection failed" in err and "s3cret" not in err and "http://***@127.0.0.1" in err
    assert main(["ckpt", "verify-engine", "--hf", str(CKPT), "--url", "localhost:1"]) == 2
    assert "must start with http://" in capsys.readouterr().err


class _HostileHandler(_JSONHandler):
    """A server that answers every request in one hostile way, chosen by the first path segment's mode
    (set on the class): what `verify-engine`, `parity sglang:` and `train --rollout-url` must survive."""

    mode = "redirect"
    caught = []   # requests the redirect's target received

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.mode == "target":
            type(self).caught.append(self.path)
            return self._send(b"[1.0]")
        if self.mode == "redirect":
            self.send_response(307)
            self.send_header("Location", f"http://127.0.0.1:{self.server.target_port}/get_weights_by_name")
            self.send_header("Content-Length", "0")
            self.end_headers()
        elif self.mode == "drip":   # one byte at a time, each well inside a per-read timeout
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b" ")
                self.wfile.flush()
                time.sleep(0.3)
        elif self.mode == "endless":
            self.send_response(200)
            self.end_headers()
            chunk = b"[" + b"1," * 50000
            while True:
                self.wfile.write(chunk)
        elif self.mode == "deep":
            self._send(b"[" * 200_000 + b"]" * 200_000)
        elif self.mode == "bigint":
            self._send(b"[" + b"9" * 4000 + b"]")
        elif self.mode == "short":   # declares more than it sends, then closes
            self.send_response(200)
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b"[1,")
            self.close_connection = True


class _QuietServer(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # a client hanging up on an endless answer is the point, not a fault to print


def _hostile_server(mode: str, base=None, **attrs):
    handler = type(f"_{mode}", (base or _HostileHandler,), {"mode": mode, **attrs})
    httpd = _QuietServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd


@pytest.mark.parametrize("mode, message", [
    ("redirect", "HTTP 307 redirect to 'http://127.0.0.1:"),
    ("drip", "did not complete within 2 s"),
    ("endless", "passed the client's 4000000 byte limit"),
    ("deep", "nested too deeply"),
    ("bigint", "an integer of 4000 digits"),
    ("short", "cut short or malformed"),
])
def test_a_hostile_server_is_one_line_and_nothing_leaves_for_another_host(mode, message, monkeypatch, capsys):
    """No redirect is followed (the body would go to the host it names), one deadline bounds the whole
    answer, a size cap bounds what is read, and a damaged or unreadable answer is named: exit 2."""
    from glmkit.serve import client as client_module

    target = _hostile_server("target", caught=[])
    server = _hostile_server(mode)
    server.target_port = target.server_address[1]
    monkeypatch.setattr(client_module, "MAX_ANSWER_BYTES", 4_000_000)
    real_init = client_module.SGLangClient.__init__
    monkeypatch.setattr(client_module.SGLangClient, "__init__",
                        lambda self, url, **kw: real_init(self, url, **{**kw, "timeout_s": 2.0, "retries": 0}))
    url = f"http://127.0.0.1:{server.server_address[1]}"
    start = time.monotonic()
    try:
        code = main(["ckpt", "verify-engine", "--hf", str(CKPT), "--url", url, "--sample", "2"])
    finally:
        for httpd in (server, target):
            httpd.shutdown()
            httpd.server_close()
    err = capsys.readouterr().err
    assert code == 2, err
    errors = [line for line in err.splitlines() if "error" in line]  # the rest is the progress bar
    assert len(errors) == 1 and message in errors[0], err
    assert target.RequestHandlerClass.caught == []
    assert time.monotonic() - start < 30


class _WrongShapeHandler(_JSONHandler):
    """Valid JSON of the wrong shape, per endpoint (hostile pass 11): `answers` maps a path to a body."""

    answers: dict = {}

    def do_GET(self):
        self._send(json.dumps(self.answers.get(self.path, {})).encode())

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.do_GET()


@pytest.mark.parametrize("answers, call, needle", [
    ({"/get_model_info": [1, 2, 3]}, "model_info", "/get_model_info: expected a JSON object, got list"),
    ({"/get_server_info": None}, "server_info", "/get_server_info: expected a JSON object, got NoneType"),
    ({"/update_weights_from_tensor": [1, 2, 3]}, "update", "expected a JSON object, got list"),
    ({"/update_weights_from_tensor": {"message": "?"}}, "update", "no success true in the answer"),
    ({"/generate": {"meta_info": {}}}, "batch", "no list of answers for a batch of 2"),
    ({"/generate": [{"meta_info": {}}]}, "batch", "1 answers for a batch of 2 inputs"),
    ({"/generate": [7, 8]}, "batch", "answer 0 is not an object with meta_info"),
    ({"/get_server_info": {"max_running_requests": -1}}, "rollout", "max_running_requests '-1'; expected a positive integer or null"),
    ({"/generate": [{"meta_info": {"output_token_logprobs": [[-0.1, 5]], "finish_reason": None}}] * 2}, "rollout",
     "/generate: answer 0 cannot be read (TypeError"),
    ({"/generate": [{"meta_info": {"output_token_logprobs": [[-0.1, 5]], "finish_reason": {"type": "length"},
                                   "routed_experts": "%%%not base64"}}] * 2}, "rollout", "/generate: answer 0 cannot be read"),
])
def test_valid_json_of_the_wrong_shape_is_named_by_server_and_endpoint(answers, call, needle):
    """An answer that parses but is not what SGLang sends (a list where an object goes, one answer for
    a batch of two, a null finish_reason, routing that is not base64) was an internal error (exit 3),
    a wrong verdict, or, for a weight update, taken as success. Each is an SGLangError (exit 2)."""
    from glmkit.model import load_model
    from glmkit.model.rollout import SamplingParams
    from glmkit.serve.client import SGLangError, SGLangRollout

    server = _hostile_server("wrong", _WrongShapeHandler, answers=answers)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    client = SGLangClient(url, retries=0, timeout_s=10)
    try:
        with pytest.raises(SGLangError, match=re.escape(needle)):
            if call == "model_info":
                client.model_info()
            elif call == "server_info":
                client.server_info()
            elif call == "update":
                client.update_weights_from_tensor({"w": torch.zeros(2)})
            elif call == "batch":
                client.generate(input_ids=[[1, 2], [3, 4]])
            else:
                rollout = SGLangRollout(url, policy=load_model(CKPT), retries=0, timeout_s=10)
                rollout.generate([[1, 2], [3, 4]], SamplingParams(max_new_tokens=1), seed=0)
    finally:
        server.shutdown()
        server.server_close()


def test_a_null_log_prob_reads_as_nan_for_the_trainer_to_name():
    """SGLang writes a NaN or Inf log-prob (weights that overflow) as null, JSON having neither: it was
    an unreadable answer (TypeError); it is a NaN in the Completion, which the trainer names with the
    policy's largest weight (tests/test_train.py)."""
    import math

    from glmkit.model import load_model
    from glmkit.model.rollout import SamplingParams
    from glmkit.serve.client import SGLangRollout

    answer = {"meta_info": {"output_token_logprobs": [[None, 5, None], [-0.25, 6, None]], "finish_reason": {"type": "length"}}}
    server = _hostile_server("nulls", _WrongShapeHandler, answers={"/generate": [answer] * 2})
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        rollout = SGLangRollout(url, policy=load_model(CKPT), retries=0, timeout_s=10)
        done = rollout.generate([[1, 2], [3, 4]], SamplingParams(max_new_tokens=2), seed=0)
    finally:
        server.shutdown()
        server.server_close()
    assert [c.tokens for c in done] == [[5, 6]] * 2
    assert all(math.isnan(c.logprobs[0]) and c.logprobs[1] == -0.25 for c in done)
