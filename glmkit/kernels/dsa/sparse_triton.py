"""Sparse MLA in absorbed (MQA) form as a Triton kernel: the core of `absorbed.attend`, fused.

    q_lat [T, H, R], latent [T, R], idx [T, W] (global packed key ids, -1 = empty)
    s[t, h, j] = scale * q_lat[t, h] . latent[idx[t, j]]           over the non-empty slots j
    o_lat[t, h] = sum_j softmax_j(s[t, h, :]) latent[idx[t, j]]      [T, H, R], the input dtype
    lse[t, h]  = logsumexp_j s[t, h, j]                              [T, H] fp32, natural log

Same contract as `absorbed.SparseMQA` (and `attend` as `absorbed.attend`): a row with every slot
empty gives o = 0 and lse = -inf; the order of a row's ids and where its empty slots lie do not
matter (every slot is looked at; ids are assumed distinct within a row, as the indexer makes them).

Forward kernel: grid (T, R_PAD // BLOCK_RO), one program per query row (and output slice, below).
All H heads of the row are the M dimension of both dots (H = 64 for GLM-5.3-Flash, padded to a
power of two >= 16, tl.dot's minimum), because every head attends over the same selected latents:
- the row's query tile q [BLOCK_H, R_PAD] is loaded once and stays on chip;
- the loop walks the row's W slots in blocks of BLOCK_N: the block's ids are loaded, the latent rows
  gathered with one 2D-pointer load k [BLOCK_N, R_PAD] (slots with id -1, and the tail past W, are
  masked: zeros loaded, no memory traffic, score -inf), scores = q @ k^T in fp32 (tl.dot on the
  inputs' dtype), an online softmax in base 2 (log2(e) folded into the scale; the running max starts
  at a finite -1e30 so blocks with no key give p = 0 and no NaN), acc = acc * alpha + p @ k with p
  in the inputs' dtype (as flash attention does) and acc fp32;
- a block whose slots are all empty is skipped (one branch per block, uniform over the program):
  the indexer leaves whole runs of empty slots in rows that see fewer pools than it may pick (every
  row of a 512-token prompt: 2063 slots, at most 512 used), and those cost only the id load;
- W need not be a multiple of BLOCK_N (the last block is masked), so idx is never padded or copied.
  W is a compile-time constant (it is index_topk + kpool - 1, fixed per model: one compile); this
  also keeps the loop bound a Python int under the CPU interpreter, whose runtime ints are 1-element
  arrays that `range` cannot take with NumPy >= 2.4.
The latent tile is both key and value (MQA over the latent): one gather feeds both dots.
Decode (`attend_cache`): the same kernel with SLOTTED on reads row t's latents from its request's
slot of a cache [S, cap, R] (ids are positions there): one program per decode row.

Output split (BLOCK_RO): the fp32 accumulator of a whole row is [64, 512] = 128 KiB, i.e. 128
registers a thread at num_warps=8 (FlashMLA holds the same in two warpgroups), tight next to the
score tile and q's operand fragments, or 256 at 4 warps, more than fits. BLOCK_RO < R_PAD splits the *output* dims over a second grid axis: each program
keeps acc [BLOCK_H, BLOCK_RO] and gathers its slice of the latent rows for p @ v, but has to
recompute the full-R scores (the softmax needs the whole dot product), so the split costs
(R_PAD / BLOCK_RO - 1) extra score GEMMs. Default: no split, num_warps=8 (see `FWD_CONFIG`);
BLOCK_RO = R / 2 is the fallback to try if the unsplit kernel spills on a given GPU.

Tile sizes: BLOCK_N = 32 keeps q (64 x 512 bf16 = 64 KiB) plus num_stages=2 gathered key tiles
(2 x 32 KiB) inside Hopper's shared memory with room for the layout conversion of p; BLOCK_N = 64
halves the loop trip count and the per-block softmax overhead at twice the key tile.

FLOPs: useful work is 4 * H * R * nnz (two GEMMs of 2 H R flops per selected key), with nnz the
number of (row, non-empty slot) pairs (`useful_flops`). The kernel executes
(2 * splits + 2) * H * R flops per slot, splits = R_PAD / BLOCK_RO (each split redoes the scores),
over all T * ceil(W / BLOCK_N) * BLOCK_N slots: empty slots still go through the dots.

Backward: `SparseMQATriton` runs two Triton kernels, each with grid (rows,) (`TRITON_BACKWARD =
False` reuses `absorbed.SparseMQA._backward` instead: torch, recomputing from lse). One kernel
holding everything (q, dO, the key tile in shared memory, dq [H, R] and dK [BLOCK_N, R] accumulating
in registers) does not fit an H200's shared memory at R = 512 (303 KiB asked at BLOCK_N = 32), so:
- `_bwd_dq_kernel` is the forward's loop with dO beside q: per key block p = exp2(s * log2e - lse *
  log2e), dP = dO @ k^T, dS = p * (dP - delta) * scale (delta = rowsum(dO * O), computed in the
  kernel), dq += dS @ k; it also writes p and dS (the inputs' dtype, as the GEMMs take them) into a
  scratch [rows, H, W];
- `_bwd_dlat_kernel` reads them back per key block and forms dK = dS^T @ q + p^T @ dO [BLOCK_N, R],
  added with tl.atomic_add into an fp32 [T, R] buffer (rows of a sequence share keys, so the latent
  gradient is a scatter-add).
Rows go in chunks so the scratch stays bounded (`BWD_SCRATCH_ELEMENTS`). FLOPs: 6 H R per pair in the
first kernel, 4 H R in the second, the 10 H R of the backward with nothing recomputed.
"""

from __future__ import annotations

import torch

from glmkit.kernels.dsa import absorbed
from glmkit.kernels.fuse import current_mode, fusing

try:
    import triton
    import triton.language as tl
except ImportError as err:  # the message names the package a user installs
    raise ImportError(f"DSA backend 'triton' needs triton (pip install triton; CUDA, or "
                      f"TRITON_INTERPRET=1 on the CPU) ({err})") from err

LOG2E = 1.4426950408889634  # the kernels spell constants out: jit code reads only constexpr globals

# Launch parameters of the forward kernel, read at every call (tests and benchmarks override them).
# BLOCK_RO None = the whole (padded) R: no output split.
FWD_CONFIG = dict(BLOCK_N=64, BLOCK_RO=None, num_warps=8, num_stages=1)  # fastest on an H200 (bench_sparse_mla_gpu.py)
BWD_CONFIG = dict(BLOCK_N=32, num_warps=8, num_stages=1)
# Elements of each of the backward's two scratch tensors (P and dS of a chunk of rows, [rows, H, W]):
# 2^28 is 512 MiB each in bf16, ~2000 rows of 64 heads x 2063 slots.
BWD_SCRATCH_ELEMENTS = 1 << 28
# The backward of SparseMQATriton: True = the two Triton kernels (17.0 ms at T = 4096, W = 2063 on an
# H200), False = absorbed.SparseMQA's torch backward (20.2 ms); bench_sparse_mla_gpu.py measures both.
TRITON_BACKWARD = True

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@triton.jit
def _fwd_kernel(q_ptr, lat_ptr, idx_ptr, out_ptr, lse_ptr, slot_ptr,
                H, R,
                stride_qt, stride_qh, stride_ls, stride_lt, stride_it, stride_ot, stride_oh,
                qk_scale,
                W: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, R_PAD: tl.constexpr, BLOCK_RO: tl.constexpr,
                IEEE: tl.constexpr, SLOTTED: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)  # t * H * R passes 2^31 at T = 64k: 64-bit row offsets
    r0 = tl.program_id(1) * BLOCK_RO
    if SLOTTED:  # a decode cache [S, cap, R]: the row's ids are positions in its own slot
        lat_ptr += tl.load(slot_ptr + t).to(tl.int64) * stride_ls
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, R_PAD)
    hmask = heads < H
    cmask = cols < R
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + cols[None, :],
                mask=hmask[:, None] & cmask[None, :], other=0.0)
    if BLOCK_RO != R_PAD:
        ocols = r0 + tl.arange(0, BLOCK_RO)
        ocmask = ocols < R

    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)  # running max of the base-2 scores
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_H, BLOCK_RO], dtype=tl.float32)
    slots = tl.arange(0, BLOCK_N)
    for n0 in range(0, W, BLOCK_N):
        ids = tl.load(idx_ptr + t * stride_it + n0 + slots, mask=n0 + slots < W, other=-1).to(tl.int64)
        valid = ids >= 0
        if tl.max(valid.to(tl.int32), 0) > 0:  # an all-empty block changes nothing: skip its dots
            k = tl.load(lat_ptr + ids[:, None] * stride_lt + cols[None, :],
                        mask=valid[:, None] & cmask[None, :], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            if BLOCK_RO == R_PAD:
                v = k
            else:
                v = tl.load(lat_ptr + ids[:, None] * stride_lt + ocols[None, :],
                            mask=valid[:, None] & ocmask[None, :], other=0.0)
            acc = acc * alpha[:, None]
            if IEEE:
                acc = tl.dot(p.to(v.dtype), v, acc, input_precision="ieee")
            else:
                acc = tl.dot(p.to(v.dtype), v, acc)

    has_key = l_i > 0.0
    out = acc / tl.where(has_key, l_i, 1.0)[:, None]  # no key: acc is 0, the output 0
    if BLOCK_RO == R_PAD:
        ocols_st = cols
        ocmask_st = cmask
    else:
        ocols_st = ocols
        ocmask_st = ocmask
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + ocols_st[None, :],
             out.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & ocmask_st[None, :])
    lse = tl.where(has_key, (m_i + tl.log2(tl.where(has_key, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(lse_ptr + t * H + heads, lse, mask=hmask & (r0 == 0))


@triton.jit
def _row_tile(t, H, R, stride_qt, stride_qh, BLOCK_H: tl.constexpr, R_PAD: tl.constexpr):
    """Row t of a [T, H, R] tensor (strides stride_qt, stride_qh, 1) as a [BLOCK_H, R_PAD] tile:
    (t, heads, head mask, columns, column mask, offsets, mask)."""
    heads = tl.arange(0, BLOCK_H)
    cols = tl.arange(0, R_PAD)
    hmask = heads < H
    cmask = cols < R
    return (t, heads, hmask, cols, cmask, t * stride_qt + heads[:, None] * stride_qh + cols[None, :],
            hmask[:, None] & cmask[None, :])


@triton.jit
def _bwd_dq_kernel(q_ptr, lat_ptr, idx_ptr, out_ptr, do_ptr, lse_ptr, dq_ptr, p_ptr, ds_ptr,
                   H, R, row0,
                   stride_qt, stride_qh, stride_lt, stride_it, stride_st, stride_sh,
                   qk_scale, scale,
                   W: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, R_PAD: tl.constexpr,
                   IEEE: tl.constexpr):
    """Row row0 + c: dq, and P and dS into the chunk's scratch row c ([rows, H, W], the inputs' dtype).
    q, out, do and dq share one [T, H, R] contiguous layout (strides stride_qt, stride_qh, 1)."""
    c = tl.program_id(0).to(tl.int64)
    t, heads, hmask, cols, cmask, row, rmask = _row_tile(row0 + c, H, R, stride_qt, stride_qh, BLOCK_H, R_PAD)
    do = tl.load(do_ptr + row, mask=rmask, other=0.0)
    o = tl.load(out_ptr + row, mask=rmask, other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)  # rowsum(dO * O) [BLOCK_H]
    q = tl.load(q_ptr + row, mask=rmask, other=0.0)
    lse = tl.load(lse_ptr + t * H + heads, mask=hmask, other=0.0)
    lse2 = tl.where(lse == float("-inf"), 0.0, lse * 1.4426950408889634)  # an empty row has no valid slot
    dq = tl.zeros([BLOCK_H, R_PAD], dtype=tl.float32)
    slots = tl.arange(0, BLOCK_N)
    for n0 in range(0, W, BLOCK_N):
        ids = tl.load(idx_ptr + t * stride_it + n0 + slots, mask=n0 + slots < W, other=-1).to(tl.int64)
        valid = ids >= 0
        if tl.max(valid.to(tl.int32), 0) > 0:  # the same skip as the forward's (and _bwd_dlat_kernel's)
            k = tl.load(lat_ptr + ids[:, None] * stride_lt + cols[None, :],
                        mask=valid[:, None] & cmask[None, :], other=0.0)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
                dp = tl.dot(do, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
                dp = tl.dot(do, tl.trans(k))
            p = tl.where(hmask[:, None] & valid[None, :], tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
            ds = (p * (dp - delta[:, None]) * scale).to(k.dtype)
            if IEEE:
                dq = tl.dot(ds, k, dq, input_precision="ieee")
            else:
                dq = tl.dot(ds, k, dq)
            at = c * stride_st + heads[:, None] * stride_sh + (n0 + slots)[None, :]
            smask = hmask[:, None] & (n0 + slots < W)[None, :]
            tl.store(p_ptr + at, p.to(k.dtype), mask=smask)
            tl.store(ds_ptr + at, ds, mask=smask)
    tl.store(dq_ptr + row, dq.to(dq_ptr.dtype.element_ty), mask=rmask)


@triton.jit
def _bwd_dlat_kernel(q_ptr, do_ptr, idx_ptr, p_ptr, ds_ptr, dlat_ptr,
                     H, R, row0,
                     stride_qt, stride_qh, stride_it, stride_st, stride_sh, stride_dlt,
                     W: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, R_PAD: tl.constexpr,
                     IEEE: tl.constexpr):
    """Row row0 + c: dK = dS^T q + P^T dO per key block, scatter-added into dlat [T, R] fp32."""
    c = tl.program_id(0).to(tl.int64)
    t, heads, hmask, cols, cmask, row, rmask = _row_tile(row0 + c, H, R, stride_qt, stride_qh, BLOCK_H, R_PAD)
    q = tl.load(q_ptr + row, mask=rmask, other=0.0)
    do = tl.load(do_ptr + row, mask=rmask, other=0.0)
    slots = tl.arange(0, BLOCK_N)
    for n0 in range(0, W, BLOCK_N):
        ids = tl.load(idx_ptr + t * stride_it + n0 + slots, mask=n0 + slots < W, other=-1).to(tl.int64)
        valid = ids >= 0
        if tl.max(valid.to(tl.int32), 0) > 0:
            at = c * stride_st + heads[None, :] * stride_sh + (n0 + slots)[:, None]  # [BLOCK_N, BLOCK_H]
            tmask = valid[:, None] & hmask[None, :]
            p_t = tl.load(p_ptr + at, mask=tmask, other=0.0)
            ds_t = tl.load(ds_ptr + at, mask=tmask, other=0.0)
            if IEEE:
                dk = tl.dot(ds_t, q, input_precision="ieee")
                dk = tl.dot(p_t, do, dk, input_precision="ieee")
            else:
                dk = tl.dot(ds_t, q)
                dk = tl.dot(p_t, do, dk)
            tl.atomic_add(dlat_ptr + ids[:, None] * stride_dlt + cols[None, :], dk,
                          mask=valid[:, None] & cmask[None, :], sem="relaxed")


def _pow2(n: int, least: int = 16) -> int:
    return max(least, triton.next_power_of_2(n))


def _check(q_lat, latent, idx):
    if q_lat.dtype not in _DTYPES or latent.dtype != q_lat.dtype:
        raise TypeError(f"sparse_triton takes fp16, bf16 or fp32 q_lat and latent of one dtype, "
                        f"got {q_lat.dtype} and {latent.dtype}")
    if idx.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"idx must be int32 or int64, got {idx.dtype}")


def forward(q_lat, latent, idx, scale, *, slots=None, BLOCK_N=None, BLOCK_RO=None, num_warps=None, num_stages=None):
    """-> (o_lat [T, H, R] in the inputs' dtype, lse [T, H] fp32). Keyword arguments override FWD_CONFIG.
    With `slots` [T], latent is a decode cache [S, cap, R] and idx holds positions in slot slots[t]."""
    _check(q_lat, latent, idx)
    q_lat, latent, idx = q_lat.contiguous(), latent.contiguous(), idx.contiguous()
    T, H, R = q_lat.shape
    if slots is None:
        slot_arg, stride_ls = idx, 0  # never read: SLOTTED is off
    else:
        if latent.dim() != 3 or slots.shape != (T,):
            raise ValueError(f"a slotted call takes latent [S, cap, R] and slots [T={T}], got "
                             f"{tuple(latent.shape)} and {tuple(slots.shape)}")
        slot_arg, stride_ls = slots.contiguous(), latent.stride(0)
    W = idx.shape[1]
    cfg = dict(FWD_CONFIG)
    cfg.update({k: v for k, v in dict(BLOCK_N=BLOCK_N, BLOCK_RO=BLOCK_RO, num_warps=num_warps,
                                      num_stages=num_stages).items() if v is not None})
    r_pad = _pow2(R)
    block_ro = min(r_pad, _pow2(cfg["BLOCK_RO"] or r_pad))
    out = torch.empty_like(q_lat)
    lse = torch.empty(T, H, dtype=torch.float32, device=q_lat.device)
    if T == 0:
        return out, lse
    grid = (T, r_pad // block_ro)
    _fwd_kernel[grid](q_lat, latent, idx, out, lse, slot_arg, H, R,
                      q_lat.stride(0), q_lat.stride(1), stride_ls, latent.stride(-2), idx.stride(0),
                      out.stride(0), out.stride(1), float(scale) * LOG2E,
                      W=W, BLOCK_H=_pow2(H), BLOCK_N=_pow2(cfg["BLOCK_N"]), R_PAD=r_pad, BLOCK_RO=block_ro,
                      IEEE=q_lat.dtype == torch.float32, SLOTTED=slots is not None,
                      num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out, lse


def backward(q_lat, latent, idx, out, lse, grad_out, scale, *, BLOCK_N=None, num_warps=None, num_stages=None,
             scratch_elements=None):
    """Triton backward -> (grad q_lat, grad latent) in the inputs' dtype; keywords override BWD_CONFIG.

    Rows go in chunks whose P and dS scratch ([rows, H, W] each, the inputs' dtype) stays within
    `scratch_elements` (default BWD_SCRATCH_ELEMENTS): per chunk `_bwd_dq_kernel`, then `_bwd_dlat_kernel`."""
    _check(q_lat, latent, idx)
    q_lat, latent, idx = q_lat.contiguous(), latent.contiguous(), idx.contiguous()
    out, grad_out = out.contiguous(), grad_out.contiguous().to(q_lat.dtype)
    T, H, R = q_lat.shape
    W = idx.shape[1]
    cfg = dict(BWD_CONFIG)
    cfg.update({k: v for k, v in dict(BLOCK_N=BLOCK_N, num_warps=num_warps, num_stages=num_stages).items()
                if v is not None})
    grad_q = torch.empty_like(q_lat)
    grad_latent = torch.zeros(latent.shape, dtype=torch.float32, device=latent.device)
    if T == 0 or W == 0:
        return grad_q.zero_(), grad_latent.to(latent.dtype)
    rows = max(1, min(T, (scratch_elements or BWD_SCRATCH_ELEMENTS) // (H * W)))
    probs = torch.empty(rows, H, W, dtype=q_lat.dtype, device=q_lat.device)
    dscores = torch.empty_like(probs)
    lse = lse.float().contiguous()
    shape = dict(W=W, BLOCK_H=_pow2(H), BLOCK_N=_pow2(cfg["BLOCK_N"]), R_PAD=_pow2(R),
                 IEEE=q_lat.dtype == torch.float32, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    for row0 in range(0, T, rows):
        n = min(rows, T - row0)
        _bwd_dq_kernel[(n,)](q_lat, latent, idx, out, grad_out, lse, grad_q, probs, dscores,
                             H, R, row0, q_lat.stride(0), q_lat.stride(1), latent.stride(0), idx.stride(0),
                             probs.stride(0), probs.stride(1), float(scale) * LOG2E, float(scale), **shape)
        _bwd_dlat_kernel[(n,)](q_lat, grad_out, idx, probs, dscores, grad_latent,
                               H, R, row0, q_lat.stride(0), q_lat.stride(1), idx.stride(0),
                               probs.stride(0), probs.stride(1), grad_latent.stride(0), **shape)
    return grad_q, grad_latent.to(latent.dtype)


def useful_flops(idx: torch.Tensor, heads: int, rank: int) -> int:
    """4 H R per (row, selected key) pair: the FLOP count TFLOP/s figures are quoted against."""
    return 4 * heads * rank * int((idx >= 0).sum())


class SparseMQATriton(torch.autograd.Function):
    """q_lat [T, H, R], latent [T, R], idx [T, W] -> o_lat [T, H, R]; same contract as absorbed.SparseMQA."""

    @staticmethod
    def forward(ctx, q_lat, latent, idx, bounds, scale):
        return SparseMQATriton.saved(ctx, forward, q_lat, latent, idx, bounds, scale)

    @staticmethod
    def saved(ctx, kernel, q_lat, latent, idx, bounds, scale):
        """kernel's (out, lse), with what the backward takes saved on ctx -> out."""
        out, lse = kernel(q_lat, latent, idx, scale)
        ctx.save_for_backward(q_lat, latent, idx, out, lse)
        ctx.bounds, ctx.scale, ctx.fuse = bounds, scale, current_mode()
        return out

    @staticmethod
    def backward(ctx, grad_out):
        if TRITON_BACKWARD:
            q_lat, latent, idx, out, lse = ctx.saved_tensors
            grad_q, grad_latent = backward(q_lat, latent, idx, out, lse, grad_out, ctx.scale)
            return grad_q, grad_latent, None, None, None
        with fusing(ctx.fuse):  # the autograd engine runs this outside the forward's fuse mode
            return absorbed.SparseMQA._backward(ctx, grad_out)


def attend(q, latent, kv_b_weight, idx, bounds, scale):
    """Same contract and weight folding as absorbed.attend; only the core is the Triton kernel."""
    return absorbed.through_latent(q, kv_b_weight, lambda q_lat: SparseMQATriton.apply(
        q_lat, latent.contiguous(), idx, [tuple(b) for b in bounds], scale))


def attend_cache(q, cache, kv_b_weight, idx, slots, scale):
    """Rows over a decode cache (no autograd: the rollout side); same contract and weight folding as
    absorbed.attend_cache, the core is the forward kernel reading each row's latents from its slot.
    A decode step of B requests is B programs, one per row, each over its W slots (empty blocks
    skipped), the same kernel and tiles as prefill's."""
    return absorbed.through_latent(q, kv_b_weight, lambda q_lat: forward(q_lat, cache, idx, scale, slots=slots)[0])
