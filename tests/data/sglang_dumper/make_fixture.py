"""Writes the dump folders beside this file with SGLang's own dumper (sglang 0.5.23 from PyPI,
`python/sglang/srt/debug_utils/dumper.py`), so the reader is tested on bytes that dumper wrote.

Run once by hand, not by the tests (sglang's serving stack does not install on the CI machine):
    pip download sglang==0.5.23 --no-deps && unzip the wheel's sglang/ into SITE; pip install pyzmq
    python make_fixture.py SITE OUT
Only the dumper's three imports from SGLang's serving code are stubbed (sockets, runtime context,
device); its file naming, meta, step and dump_index logic run as shipped. Ranks are separate dumper
instances with the rank and parallel info a TP=2 engine / trainer would report.

Every logical value is known: row (request r, position p), column c holds value(r, p, c) below, so the
test checks the reader's unsharding and row placement exactly.
"""

import importlib.util
import sys
import types

import torch

HIDDEN, TP = 4, 2


def value(r: int, p: int, c: int) -> float:
    return 100.0 * r + p + c / 10.0


def load_dumper(site: str):
    for name, attrs in {"sglang.srt.managers.io_struct": ["sock_recv", "sock_send", "wrap_as_pickle"],
                        "sglang.srt.runtime_context": ["get_parallel", "get_server_args", "get_serving"],
                        "sglang.srt.utils": ["get_device"]}.items():
        module = types.ModuleType(name)
        for attr in attrs:
            setattr(module, attr, lambda *a, **k: None)
        sys.modules[name] = module
    spec = importlib.util.spec_from_file_location("sglang_dumper", f"{site}/sglang/srt/debug_utils/dumper.py")
    dumper = importlib.util.module_from_spec(spec)
    sys.modules["sglang_dumper"] = dumper
    spec.loader.exec_module(dumper)
    return dumper


def instance(D, rank, key, info, **config):
    D._get_rank = lambda: rank
    D._get_world_size = lambda: TP
    D._compute_static_meta = lambda: {"world_rank": rank, "world_size": TP, key: info}
    return D._Dumper(config=D.DumperConfig(enable=True, enable_output_console=False, **config))


def rows(requests):
    """requests [(r, [positions])] -> logical [T, HIDDEN]."""
    return torch.tensor([[value(r, p, c) for c in range(HIDDEN)] for r, ps in requests for p in ps])


def engine(D, out):
    # two requests: prompts of 3 and 2 tokens; then decode steps of one token each (request 1 ends first)
    tokens = {0: [11, 12, 13, 14, 15], 1: [21, 22, 23]}
    steps = [[(0, [0, 1, 2]), (1, [0, 1])], [(0, [3]), (1, [2])], [(0, [4])]]
    for rank in range(TP):
        info = {"tp_rank": rank, "tp_size": TP, "pp_rank": 0, "pp_size": 1, "attn_tp_rank": rank, "attn_tp_size": TP,
                "attn_dp_rank": 0, "attn_dp_size": 1, "attn_dp_enabled": False, "moe_ep_rank": rank, "moe_ep_size": TP}
        d = instance(D, rank, "sglang_parallel_info", info, dir=out, exp_name="engines/engine_0")
        for batch in steps:
            d.dump("input_ids", torch.tensor([tokens[r][p] for r, ps in batch for p in ps]))
            d.dump("positions", torch.tensor([p for _, ps in batch for p in ps]))
            d.dump("seq_lens", torch.tensor([ps[-1] + 1 for _, ps in batch]))
            d.dump("req_pool_indices", torch.tensor([r + 5 for r, _ in batch]))
            d.dump("rids", [f"rid-{r}" for r, _ in batch])
            full = rows(batch)
            d.set_ctx(layer_id=0)
            d.dump("positions", torch.tensor([p for _, ps in batch for p in ps]))  # a layer's copy, not the root's
            d.dump("attn_output", full * (0.25 if rank == 0 else 0.75), dims="t h[tp:partial]")
            d.dump("pre_mlp_layernorm_output", full.chunk(TP, dim=-1)[rank], dims="t h[tp]")
            d.dump("moe_topk_ids", full[:, :2].long(), dims="t k # tp:replicated")
            d.set_ctx(layer_id=None)
            d.step()


def trainer(D, out):
    # one micro-batch of the same two sequences, packed (THD), padded to 10 tokens, sequence parallel
    tokens = [11, 12, 13, 14, 15, 21, 22, 23, 0, 0]
    requests = [(0, list(range(5))), (1, list(range(3)))]
    full = torch.cat([rows(requests), torch.zeros(2, HIDDEN)])
    for rank in range(TP):
        info = {"tp_rank": rank, "tp_size": TP, "pp_rank": 0, "pp_size": 1, "dp_rank": 0, "dp_size": 1, "cp_rank": 0,
                "cp_size": 1, "ep_rank": rank, "ep_size": TP, "sp_rank": rank, "sp_size": TP}
        d = instance(D, rank, "megatron_parallel_info", info, dir=out, exp_name="fwd_bwd/rollout_0")
        d.dump("input_ids", torch.tensor([tokens]))
        d.dump("position_ids", torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 0]]))
        d.dump("cu_seqlens_q", torch.tensor([0, 5, 8], dtype=torch.int32))
        d.dump("cu_seqlens_kv", torch.tensor([0, 5, 8], dtype=torch.int32))
        d.dump("qkv_format", "thd")
        d.set_ctx(layer_id=0)
        d.dump("attn_output", full.unsqueeze(1).chunk(TP, dim=0)[rank], dims="t[sp] 1 h")
        d.dump("grad__attn_output", (full / 1000).unsqueeze(1).chunk(TP, dim=0)[rank], dims="t[sp] 1 h")
        d.set_ctx(layer_id=None)


HOOK_LAYERS, HOOK_SCALE = 3, (2.0, 3.0, 5.0)


def trainer_grad_hooks(D, out):
    """A forward-backward step whose gradients the dumper's own backward hooks write (enable_grad=True):
    they carry no layer_id (sglang `_register_dump_grad_hook`). Each rank runs its sequence-parallel rows
    through a chain of layers, layer L multiplying by HOOK_SCALE[L] and dumping its output as attn_output;
    the loss is the sum of the last output times value(r, p, c). So the gradient at layer L's output is
    value(r, p, c) times the scales of the layers after it, and the hooks fire from the last layer to the
    first, as in a real model's backward."""
    tokens = [11, 12, 13, 14, 15, 21, 22, 23]
    target = rows([(0, list(range(5))), (1, list(range(3)))])
    for rank in range(TP):
        info = {"tp_rank": rank, "tp_size": TP, "pp_rank": 0, "pp_size": 1, "dp_rank": 0, "dp_size": 1, "cp_rank": 0,
                "cp_size": 1, "ep_rank": rank, "ep_size": TP, "sp_rank": rank, "sp_size": TP}
        d = instance(D, rank, "megatron_parallel_info", info, dir=out, exp_name="fwd_bwd_hooks/rollout_0",
                     enable_grad=True)
        d.dump("input_ids", torch.tensor([tokens]))
        d.dump("position_ids", torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]]))
        d.dump("cu_seqlens_q", torch.tensor([0, 5, 8], dtype=torch.int32))
        d.dump("cu_seqlens_kv", torch.tensor([0, 5, 8], dtype=torch.int32))
        d.dump("qkv_format", "thd")
        h = torch.ones(8, HIDDEN).unsqueeze(1).chunk(TP, dim=0)[rank].clone().requires_grad_()
        for layer in range(HOOK_LAYERS):
            d.set_ctx(layer_id=layer)
            h = h * HOOK_SCALE[layer]
            d.dump("attn_output", h, dims="t[sp] 1 h")
            d.set_ctx(layer_id=None)
        (h * target.unsqueeze(1).chunk(TP, dim=0)[rank]).sum().backward()
        d.step()


if __name__ == "__main__":
    D = load_dumper(sys.argv[1])
    engine(D, sys.argv[2])
    trainer(D, sys.argv[2])
    trainer_grad_hooks(D, sys.argv[2])
