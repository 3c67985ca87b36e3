"""Sparse MLA in absorbed (MQA) form, the forward as a TileLang kernel for Hopper; same contract as
`sparse_triton` (and `absorbed.SparseMQA`):

    q_lat [T, H, R], latent [T, R], idx [T, W] (global packed key ids, -1 = empty)
    o_lat[t, h] = sum_j softmax_j(scale * q_lat[t, h] . latent[idx[t, j]]) latent[idx[t, j]]
    lse[t, h]  = logsumexp_j (scale * q_lat[t, h] . latent[idx[t, j]])        natural log, fp32

A row with every slot empty gives o = 0 and lse = -inf.

Shapes it takes: bf16, R = 512 (kv_lora_rank; NoPE, so no 64-dim RoPE tail as in DeepSeek-V3.2's
576), H a multiple of 64 (64 for GLM-5.3-Flash; H / 64 programs per row otherwise), an SM90 GPU.
`supported_shapes()` says why anything else is not taken (the "auto" backend then keeps Triton; the
"tilelang" backend asked for by name raises ValueError with the reason).

Selection layout: the indexer leaves empty slots in a row (early rows of a sequence are mostly empty,
in runs of whole pools). `key_blocks.plan` lists per row the key blocks that hold a key (an even
count, for the two-stage pipeline below); rows visit only those. An empty slot in a visited block is
masked (score -inf, p = 0) and its latent copy predicated off, leaving zeros in shared memory (so
p = 0 times it stays 0).

Kernel (one program per row and 64-head group, 384 threads = 3 warpgroups, warp-specialised):
- producer (warpgroup 2): for each key block, gathers its BLOCK_N latent rows from global memory into
  a two-stage shared buffer with cp.async (16 bytes per copy, 32 copies a thread), completing the
  stage's `ready` barrier;
- consumer 0 (warpgroup 0): scores = q @ k^T over all R dims (wgmma, fp32), the online softmax in
  base 2, p to shared memory with the rescale factor, then o[:, :R/2] += p @ k[:, :R/2];
- consumer 1 (warpgroup 1): waits for p, rescales and accumulates o[:, R/2:] += p @ k[:, R/2:].
  The fp32 output accumulator of a row is [64, 512]: split over two warpgroups it is 128 registers
  a thread each, which leaves consumer 0 room for the score tile.
Shared memory: q 64 KiB, two key stages of 64 x 512 (128 KiB), p 8 KiB.

FLOPs: useful work is 4 H R per (row, selected key) pair (`sparse_triton.useful_flops`); the kernel
executes it for every slot of the blocks it visits.

Backward: `sparse_triton.SparseMQATriton`'s (the Triton kernels take the forward's output and lse).
"""

from __future__ import annotations

import functools

import torch

try:
    import tilelang
    from tilelang import language as T
except ImportError as err:  # the message names the package a user installs
    raise ImportError(f"DSA backend 'tilelang' needs tilelang (pip install tilelang; CUDA SM90) ({err})") from err

from glmkit.kernels.dsa import (TILELANG_HEADS_PER_PROGRAM, TILELANG_LATENT, absorbed, key_blocks,  # noqa: E402
                                sparse_triton, tilelang_takes)
from glmkit.kernels.registry import Target  # noqa: E402

LOG2E = sparse_triton.LOG2E
LN2 = 0.6931471805599453
HEADS_PER_PROGRAM = TILELANG_HEADS_PER_PROGRAM  # wgmma's M: one warpgroup's row tile
RANK = TILELANG_LATENT
BLOCK_N = 64  # keys per block


def supported_shapes(heads: int, rank: int, device: torch.device) -> str | None:
    """None when the kernel takes `heads` x `rank` queries on `device`, else the reason it does not
    (the registry's verifier for this backend, glmkit.kernels.dsa.tilelang_takes)."""
    device = torch.device(device)
    if device.type != "cuda":
        return "CUDA tensors only"
    return tilelang_takes(Target.of(device, torch.bfloat16, heads=heads, latent=rank))


def _refusal(q_lat: torch.Tensor, latent: torch.Tensor, idx: torch.Tensor) -> str | None:
    if q_lat.dtype != torch.bfloat16 or latent.dtype != torch.bfloat16:
        return f"bf16 q_lat and latent only (got {q_lat.dtype} and {latent.dtype})"
    if q_lat.dim() != 3 or latent.dim() != 2 or idx.dim() != 2 or idx.shape[0] != q_lat.shape[0]:
        return (f"q_lat [T, H, R], latent [keys, R], idx [T, W] (got {tuple(q_lat.shape)}, "
                f"{tuple(latent.shape)}, {tuple(idx.shape)})")
    if latent.shape[-1] != q_lat.shape[-1]:
        return f"q_lat and latent of one rank (got {q_lat.shape[-1]} and {latent.shape[-1]})"
    return supported_shapes(q_lat.shape[1], q_lat.shape[-1], q_lat.device)


@functools.lru_cache(maxsize=None)
def _kernel(heads: int, rank: int, scale_log2: float):
    """The compiled forward for one (heads, rank, scale); rows, keys and width stay dynamic."""
    return _sparse_mqa_fwd(heads, rank, scale_log2)


def _sparse_mqa_fwd(heads: int, rank: int, scale_log2: float):
    half = rank // 2
    groups = heads // HEADS_PER_PROGRAM
    HB, BN = HEADS_PER_PROGRAM, BLOCK_N
    bf16, f32 = T.bfloat16, T.float32

    @tilelang.jit(pass_configs={tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True})
    def fwd(Q, KV, Idx, Order, Blocks):
        rows, keys, width, nblocks = T.dynamic("rows, keys, width, nblocks")
        Q: T.Tensor([rows, heads, rank], bf16)  # noqa: F821 (tilelang reads the annotations)
        KV: T.Tensor([keys, rank], bf16)
        Idx: T.Tensor([rows, width], T.int32)
        Order: T.Tensor([rows, nblocks], T.int32)
        Blocks: T.Tensor([rows], T.int32)
        Out = T.empty([rows, heads, rank], bf16)
        Lse = T.empty([rows, heads], f32)

        with T.Kernel(rows * groups, threads=384) as bx:
            q_s = T.alloc_shared([HB, rank], bf16)
            kv_s = T.alloc_shared([2, BN, rank], bf16)
            p_s = T.alloc_shared([HB, BN], bf16)
            alpha_s = T.alloc_shared([HB], f32)
            sum_s = T.alloc_shared([HB], f32)

            acc_l = T.alloc_fragment([HB, half], f32)
            acc_r = T.alloc_fragment([HB, half], f32)
            scores = T.alloc_fragment([HB, BN], f32)
            valid = T.alloc_fragment([BN], "bool")
            m_i = T.alloc_fragment([HB], f32)
            m_prev = T.alloc_fragment([HB], f32)
            l_i = T.alloc_fragment([HB], f32)
            l_blk = T.alloc_fragment([HB], f32)
            alpha = T.alloc_fragment([HB], f32)
            key = T.alloc_var(T.int32)
            blk = T.alloc_var(T.int32)

            bar_q = T.alloc_barrier(arrive_count=384)
            bar_ready = T.alloc_barrier(arrive_count=[128, 128])
            bar_free = T.alloc_barrier(arrive_count=[256, 256])
            bar_p_ready = T.alloc_barrier(arrive_count=256)
            bar_p_free = T.alloc_barrier(arrive_count=256)
            bar_sum = T.alloc_barrier(arrive_count=128)

            t = bx // groups
            h0 = (bx % groups) * HB
            pairs = Blocks[t] // 2
            tx = T.get_thread_binding()

            T.tma_copy(Q[t, h0:h0 + HB, :], q_s, barrier=bar_q)
            T.barrier_arrive(bar_q)

            if tx < 128:  # consumer 0: scores, softmax, left half of the output
                T.set_max_nreg(240, 1)
                T.fill(l_i, 0)
                T.fill(m_i, -(2 ** 30))  # finite: a block with no key leaves p = 0, not NaN
                T.fill(acc_l, 0)
                T.barrier_wait(bar_q, 0)
                for i in T.serial(pairs):
                    for stage in T.unroll(2):
                        n = i * 2 + stage
                        T.barrier_wait(bar_ready[stage], i & 1)
                        blk = Order[t, n]
                        for j in T.Parallel(BN):
                            valid[j] = Idx[t, blk * BN + j] >= 0
                        for h, j in T.Parallel(HB, BN):
                            scores[h, j] = T.if_then_else(valid[j], 0, -T.infinity(f32))
                        T.wgmma_gemm(q_s[:, :half], kv_s[stage, :, :half], scores, transpose_B=True)
                        T.wgmma_gemm(q_s[:, half:], kv_s[stage, :, half:], scores, transpose_B=True)
                        T.wait_wgmma(0)
                        if n > 0:  # consumer 1 is done with the previous p and alpha
                            T.barrier_arrive(bar_p_free)
                            T.barrier_wait(bar_p_free, (n & 1) ^ 1)
                        T.copy(m_i, m_prev)
                        T.reduce_max(scores, m_i, dim=1, clear=False)
                        for h in T.Parallel(HB):
                            m_i[h] = T.max(m_i[h], m_prev[h])
                        for h in T.Parallel(HB):
                            alpha[h] = T.exp2((m_prev[h] - m_i[h]) * scale_log2)
                        for h, j in T.Parallel(HB, BN):
                            scores[h, j] = T.exp2(scores[h, j] * scale_log2 - m_i[h] * scale_log2)
                        T.reduce_sum(scores, l_blk, dim=1)
                        for h in T.Parallel(HB):
                            l_i[h] = l_i[h] * alpha[h] + l_blk[h]
                        for h, d in T.Parallel(HB, half):
                            acc_l[h, d] *= alpha[h]
                        T.copy(alpha, alpha_s)
                        T.copy(scores, p_s)
                        T.gemm(p_s, kv_s[stage, :, :half], acc_l)
                        T.barrier_arrive(bar_p_ready)
                        T.barrier_arrive(bar_free[stage])
                T.copy(l_i, sum_s)
                T.barrier_arrive(bar_sum)
                for h, d in T.Parallel(HB, half):
                    acc_l[h, d] = T.if_then_else(l_i[h] > 0, acc_l[h, d] / l_i[h], 0)
                for h in T.Parallel(HB):
                    l_i[h] = T.if_then_else(l_i[h] > 0, (T.log2(l_i[h]) + m_i[h] * scale_log2) * LN2,
                                            -T.infinity(f32))
                T.copy(l_i, Lse[t, h0:h0 + HB])
                T.copy(acc_l, Out[t, h0:h0 + HB, :half])
            elif tx < 256:  # consumer 1: right half of the output
                T.set_max_nreg(168, 1)
                T.fill(acc_r, 0)
                for i in T.serial(pairs):
                    for stage in T.unroll(2):
                        n = i * 2 + stage
                        T.barrier_arrive(bar_p_ready)
                        T.barrier_wait(bar_p_ready, n & 1)
                        for h, d in T.Parallel(HB, half):
                            acc_r[h, d] *= alpha_s[h]
                        T.gemm(p_s, kv_s[stage, :, half:], acc_r)
                        T.barrier_arrive(bar_free[stage])
                        if n + 1 < pairs * 2:
                            T.barrier_arrive(bar_p_free)
                T.barrier_wait(bar_sum, 0)
                for h, d in T.Parallel(HB, half):
                    acc_r[h, d] = T.if_then_else(sum_s[h] > 0, acc_r[h, d] / sum_s[h], 0)
                T.copy(acc_r, Out[t, h0:h0 + HB, half:])
            else:  # producer: gather the block's latent rows
                T.set_max_nreg(80, 0)
                p = tx - 256
                for i in T.serial(pairs):
                    for stage in T.unroll(2):
                        n = i * 2 + stage
                        T.barrier_wait(bar_free[stage], (i & 1) ^ 1)
                        blk = Order[t, n]
                        for r in T.serial(BN // 16):
                            row = r * 16 + p // 8
                            key = Idx[t, blk * BN + row]
                            for u in T.serial(rank // 64):
                                col = u * 64 + (p % 8) * 8
                                # an empty slot (-1) copies nothing and leaves zeros: p = 0 times 0
                                T.ptx_cp_async(T.access_ptr(kv_s[stage, row, col], "w", 8),
                                               T.access_ptr(KV[T.max(key, 0), col], "r", 8), 8,
                                               predicate=key >= 0)
                        T.cp_async_barrier_noinc(bar_ready[stage])

        return Out, Lse

    return fwd


def forward(q_lat, latent, idx, scale):
    """-> (o_lat [T, H, R] bf16, lse [T, H] fp32); ValueError with the reason for inputs it does not take."""
    why = _refusal(q_lat, latent, idx)
    if why:
        raise ValueError(f"DSA backend 'tilelang' does not take these inputs: {why}")
    q_lat, latent = q_lat.contiguous(), latent.contiguous()
    T_, H, R = q_lat.shape
    if T_ == 0:
        return torch.empty_like(q_lat), torch.empty(0, H, dtype=torch.float32, device=q_lat.device)
    ids, order, blocks = key_blocks.plan(idx, BLOCK_N)
    out, lse = _kernel(H, R, float(scale) * LOG2E)(q_lat, latent, ids, order, blocks)
    return out, lse


class SparseMQATileLang(sparse_triton.SparseMQATriton):
    """q_lat [T, H, R], latent [T, R], idx [T, W] -> o_lat [T, H, R]; the TileLang forward, and
    SparseMQATriton's backward (the Triton kernels, or the torch form where they are switched off),
    which takes the output and lse saved here in the same layout."""

    @staticmethod
    def forward(ctx, q_lat, latent, idx, bounds, scale):
        return SparseMQATileLang.saved(ctx, forward, q_lat, latent, idx, bounds, scale)


def attend(q, latent, kv_b_weight, idx, bounds, scale):
    """Same contract and weight folding as absorbed.attend; the core's forward is the TileLang kernel."""
    return absorbed.through_latent(q, kv_b_weight, lambda q_lat: SparseMQATileLang.apply(
        q_lat, latent.contiguous(), idx, [tuple(b) for b in bounds], scale))


def attend_cache(q, cache, kv_b_weight, idx, slots, scale):
    """Decode rows over a cache: the Triton kernel (its slotted form), as the "triton" backend."""
    return sparse_triton.attend_cache(q, cache, kv_b_weight, idx, slots, scale)
