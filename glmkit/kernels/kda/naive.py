"""Pure-torch KDA (Kimi Delta Attention): the reference every fast backend is tested against.

Layout follows fla: q, k [B, T, H, K]; v [B, T, H, V]; g (log-space per-channel decay) [B, T, H, K];
beta [B, T, H]; state [B, H, K, V] in float32. All math is float32.

Recurrence per head:  S' = diag(exp g_t) S;  S = S' + beta_t k_t (v_t - S'^T k_t)^T;  o_t = S^T (scale q_t).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from glmkit.kernels.fuse import fusable

DECAY_BUDGET = 1 << 30  # bytes of pairwise in-chunk decays held at once by the chunked form


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps), the form fla's kernels use (not max(||x||, eps))."""
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return q * scale, k, v, g, beta


@fusable
def short_conv(q, k, v, weight: torch.Tensor, positions: torch.Tensor, cu_seqlens=None, cu_seqlens_cpu=None):
    """SiLU(causal depthwise conv) of the q, k and v projections over packed rows, in fp32, never
    across sequences. q, k, v [T, C] each, weight [3C, kernel] fp32 (q, k, v channels), positions
    [T] (index inside each sequence) -> three [T, C] in the inputs' dtype:
    out[t] = sum_s w[kernel-1-s] * in[t-s] over s <= positions[t]. (The offsets are for kernels that
    walk sequences; positions say the same here.)"""
    kernel = weight.shape[1]
    outs = []
    for part, w in zip((q, k, v), weight.chunk(3)):
        conv = torch.zeros_like(part, dtype=torch.float32)
        for shift in range(kernel):
            src = part.float() if shift == 0 else F.pad(part.float(), (0, 0, shift, 0))[:-shift]
            conv = conv + w[:, kernel - 1 - shift] * src * (positions >= shift)[:, None]
        outs.append(F.silu(conv).to(part.dtype))
    return outs


def recurrent_step(q, k, v, g, beta, state):
    """One token for a batch. q, k, g [B, H, K]; v [B, H, V]; beta [B, H]; state [B, H, K, V] fp32
    (already scaled / normalised inputs). Returns (o [B, H, V], new state)."""
    state = state * g.exp()[..., None]
    delta = (v - torch.einsum("bhk,bhkv->bhv", k, state)) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return torch.einsum("bhk,bhkv->bhv", q, state), state


def recurrent_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                  use_qk_l2norm_in_kernel=False):
    """Token-by-token KDA over [B, T, ...]. Returns (o [B, T, H, V] in v's dtype, final state or None)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    B, T, H, K = k.shape
    state = (torch.zeros(B, H, K, v.shape[-1], dtype=torch.float32, device=v.device)
             if initial_state is None else initial_state.float())
    out = []
    for t in range(T):
        o_t, state = recurrent_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state)
        out.append(o_t)
    o = torch.stack(out, 1) if out else v.new_zeros(B, 0, H, v.shape[-1])
    return o.to(dtype), (state if output_final_state else None)


def _chunk_one(q, k, v, g, beta, state, chunk_size):
    """Chunked KDA for one sequence. q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; state [H, K, V].

    Inside a chunk with in-chunk cumulative log-decay G_t and new values u_t = beta_t (v_t - S'_t^T k_t):
        u = (I + diag(beta) A)^-1 diag(beta) (v - (k * exp G) S0),  A[t, s] = sum_c k_tc k_sc exp(G_tc - G_sc), s < t
        o_t = (q_t * exp G_t)^T S0 + sum_{s<=t} (sum_c q_tc k_sc exp(G_tc - G_sc)) u_s
        S_end = diag(exp G_C) S0 + sum_s (k_s * exp(G_C - G_s)) u_s^T
    Pairwise exp(G_t - G_s) (never exp(G_t) / exp(G_s)) keeps the decay products from underflowing.
    """
    T, H, K = k.shape
    pad = (-T) % chunk_size
    if pad:  # zero keys and beta, zero log-decay: padded steps leave the state unchanged
        q, k, v, g = (torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = torch.nn.functional.pad(beta, (0, 0, 0, pad))
    n = (T + pad) // chunk_size
    # [n, H, C, ...]
    q, k, v, g = (x.view(n, chunk_size, H, -1).transpose(1, 2) for x in (q, k, v, g))
    beta = beta.view(n, chunk_size, H).transpose(1, 2)
    G = g.cumsum(-2)
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    strict = causal.clone().fill_diagonal_(False)
    eye = torch.eye(chunk_size, dtype=q.dtype, device=q.device)
    q_decay = q * G.exp()
    k_to_end = k * (G[..., -1:, :] - G).exp()
    # the pairwise decays [chunks, H, C(t), C(s), K] of a group of chunks at a time (all of a long
    # sequence at once would be tens of GiB); each chunk's math is the same whatever its group
    group = max(1, DECAY_BUDGET // (H * chunk_size * chunk_size * K * 4))
    outs = []
    for g0 in range(0, n, group):
        c = slice(g0, min(n, g0 + group))
        diff = G[c, ..., :, None, :] - G[c, ..., None, :, :]
        decay = torch.where(causal[..., None], diff, torch.full_like(diff, float("-inf"))).exp()
        A = torch.einsum("nhtc,nhsc,nhtsc->nhts", k[c], k[c], decay).masked_fill(~strict, 0.0)
        Aqk = torch.einsum("nhtc,nhsc,nhtsc->nhts", q[c], k[c], decay)  # causal incl. diagonal via decay
        del diff, decay
        lhs = eye + beta[c][..., None] * A
        u_v = torch.linalg.solve_triangular(lhs, beta[c][..., None] * v[c], upper=False, unitriangular=True)
        w_k = torch.linalg.solve_triangular(lhs, beta[c][..., None] * k[c] * G[c].exp(), upper=False,
                                            unitriangular=True)
        for j, i in enumerate(range(c.start, c.stop)):
            u = u_v[j] - w_k[j] @ state
            outs.append(q_decay[i] @ state + Aqk[j] @ u)
            state = state * G[i, :, -1, :].exp()[..., None] + k_to_end[i].transpose(-1, -2) @ u
    o = torch.stack(outs).transpose(1, 2).reshape(n * chunk_size, H, -1)[:T]
    return o, state


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, chunk_size=64):
    """Chunked KDA. With `cu_seqlens` [N+1], inputs are packed as B=1 and every sequence starts from
    its own initial state (initial_state [N, H, K, V] or zeros); the final state is [N, H, K, V].

    Sequences are independent like heads, so they are laid side by side as extra heads (each padded
    to the longest; padded steps have zero key, beta and log-decay, so they leave the state alone)
    and run in one call. Short batches use a smaller chunk (the longest length rounded up to 16)."""
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    B, T, H, K = k.shape
    V = v.shape[-1]
    if cu_seqlens is None:
        lengths, starts = [T] * B, None
        qs, ks, vs, gs, bs = q, k, v, g, beta
    else:
        if B != 1:
            raise ValueError(f"packed input (cu_seqlens) needs batch size 1, got {B}")
        cu = (cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens).tolist()
        starts, lengths = cu[:-1], [b - a for a, b in zip(cu[:-1], cu[1:])]
        longest = max(lengths) if lengths else 0
        # [N, longest, ...] with each sequence left-aligned
        rows = torch.tensor([s + i for s, n in zip(starts, lengths) for i in range(n)], device=q.device)
        slots = torch.tensor([j * longest + i for j, n in enumerate(lengths) for i in range(n)], device=q.device)

        def unpack(x):
            out = x.new_zeros(len(lengths) * longest, *x.shape[2:])
            out[slots] = x[0, rows]
            return out.view(len(lengths), longest, *x.shape[2:])

        qs, ks, vs, gs, bs = (unpack(x) for x in (q, k, v, g, beta))
    N, L = len(lengths), max(lengths) if lengths else 0
    chunk = min(chunk_size, max(16, -(-L // 16) * 16))
    state = (torch.zeros(N * H, K, V, dtype=torch.float32, device=v.device) if initial_state is None
             else initial_state.float().reshape(N * H, K, V))
    heads = lambda x: x.transpose(0, 1).reshape(L, N * H, *x.shape[3:])  # noqa: E731  [N,L,H,..] -> [L,N*H,..]
    o, final = _chunk_one(heads(qs), heads(ks), heads(vs), heads(gs), heads(bs), state, chunk) if L else \
        (v.new_zeros(0, N * H, V), state)
    o = o.reshape(L, N, H, V).transpose(0, 1)  # [N, L, H, V]
    if cu_seqlens is None:
        out = o
    else:
        out = torch.zeros_like(v)
        out[0, rows] = o.reshape(N * L, H, V)[slots]
    final = final.view(N, H, K, V)
    return out.to(dtype), (final if output_final_state else None)
