"""KDA (Kimi Delta Attention) layer: gated delta-rule linear attention with per-channel decay.

    q, k, v = SiLU(causal depthwise conv(W x))       conv kernel 4, per channel, never across sequences
    g       = lower_bound * sigmoid(exp(A_log) * (f_b(f_a x) + dt_bias))   (log-space decay per channel)
    beta    = sigmoid(b_proj x)
    o       = KDA(l2norm q, l2norm k, v, g, beta)     chunked (train / prefill) or recurrent (decode)
    out     = o_proj(RMSNorm(o) * sigmoid(g_b(g_a x)))

Parameter names are the checkpoint's (`self_attn.q_conv1d.weight`, `self_attn.f_a_proj`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from glmkit.kernels.fuse import fusable
from glmkit.kernels.kda.naive import l2norm
from glmkit.model.norms import GatedRMSNorm
from glmkit.model.packed import Packed


@fusable
def log_decay(g: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """g [..., H, K] (f_b(f_a x)) -> log-space decay [..., H, K] in fp32."""
    g = g.float() + dt_bias.float().view(g.shape[-2:])
    rate = A_log.float().exp()[:, None]
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * g)
    return -rate * F.softplus(g, threshold=20.0)


@dataclass
class KDAState:
    """Decode cache of one KDA layer for B requests: conv [B, 3*H*K, kernel-1] (pre-activation
    inputs of the short conv), recurrent [B, H, K, V] (fp32)."""

    conv: torch.Tensor
    recurrent: torch.Tensor


class KimiDeltaAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        D, H, K = config.hidden_size, config.linear_num_heads, config.linear_head_dim
        self.num_heads, self.head_dim, self.kernel = H, K, config.linear_conv_kernel_dim
        self.lower_bound = config.linear_lower_bound
        HK = H * K
        self.q_proj = nn.Linear(D, HK, bias=False)
        self.k_proj = nn.Linear(D, HK, bias=False)
        self.v_proj = nn.Linear(D, HK, bias=False)
        # depthwise causal convs, kept in fp32 like the reference
        self.q_conv1d = nn.Conv1d(HK, HK, self.kernel, groups=HK, bias=False, dtype=torch.float32)
        self.k_conv1d = nn.Conv1d(HK, HK, self.kernel, groups=HK, bias=False, dtype=torch.float32)
        self.v_conv1d = nn.Conv1d(HK, HK, self.kernel, groups=HK, bias=False, dtype=torch.float32)
        self.A_log = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(HK, dtype=torch.float32))
        self.f_a_proj = nn.Linear(D, K, bias=False)
        self.f_b_proj = nn.Linear(K, HK, bias=False)
        self.b_proj = nn.Linear(D, H, bias=False)
        self.g_a_proj = nn.Linear(D, K, bias=False)
        self.g_b_proj = nn.Linear(K, HK, bias=False)
        self.o_norm = GatedRMSNorm(K, config.rms_norm_eps)
        self.o_proj = nn.Linear(HK, D, bias=False)

    # ---- pieces shared by both paths -------------------------------------------------------
    def _conv_weight(self) -> torch.Tensor:
        """[3*H*K, kernel] fp32, q then k then v channels."""
        return torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0].float()

    def _mixed(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)

    def _decay(self, x: torch.Tensor) -> torch.Tensor:
        """Log-space decay g [..., H, K] in fp32."""
        g = self.f_b_proj(self.f_a_proj(x)).unflatten(-1, (self.num_heads, self.head_dim))
        return log_decay(g, self.dt_bias, self.A_log, self.lower_bound)

    def _output(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        gate = self.g_b_proj(self.g_a_proj(x)).unflatten(-1, (self.num_heads, self.head_dim))
        return self.o_proj(self.o_norm(o, gate).flatten(-2))

    def _split(self, mixed: torch.Tensor):
        return [t.unflatten(-1, (self.num_heads, self.head_dim)) for t in mixed.chunk(3, dim=-1)]

    # ---- train path and prefill ------------------------------------------------------------
    def forward_packed(self, x: torch.Tensor, packed: Packed, kda, want_state: bool = False):
        """x [T, D] packed -> (out [T, D], KDAState for the N sequences or None)."""
        projected = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q, k, v = (t.unflatten(-1, (self.num_heads, self.head_dim))
                   for t in kda.short_conv(*projected, self._conv_weight(), packed.positions, packed.cu_seqlens,
                                           packed.cu_seqlens_cpu()))
        g = self._decay(x)
        beta = torch.sigmoid(self.b_proj(x))
        o, final = kda.chunk_kda(q[None], k[None], v[None], g[None], beta[None], scale=None,
                                 initial_state=None, output_final_state=want_state,
                                 use_qk_l2norm_in_kernel=True, cu_seqlens=packed.cu_seqlens,
                                 cu_seqlens_cpu=packed.cu_seqlens_cpu())
        out = self._output(o[0], x)
        if not want_state:
            return out, None
        return out, KDAState(self._conv_tails(torch.cat(projected, dim=-1), packed), final)

    def _conv_tails(self, mixed: torch.Tensor, packed: Packed) -> torch.Tensor:
        """Last kernel-1 conv inputs of every sequence, zeros in front of short ones: [N, C, kernel-1]."""
        width = self.kernel - 1
        padded = F.pad(mixed, (0, 0, width, 0))  # row r of `mixed` is row r + width here
        ends = packed.cu_seqlens[1:] + width
        rows = ends[:, None] - width + torch.arange(width, device=mixed.device)
        starts = packed.cu_seqlens[:-1, None] + width
        tails = padded[rows] * (rows >= starts)[..., None]
        return tails.transpose(1, 2).contiguous()

    # ---- rollout: a prefill chunk that continues a cache ---------------------------------------
    def forward_chunk(self, x: torch.Tensor, packed: Packed, slots: torch.Tensor, state: KDAState, kda):
        """x [T, D]: the next tokens of N requests, packed; request n continues cache slot slots[n]
        of `state`, whose conv and recurrent states are read and updated in place.

        Each request's cached conv inputs (the last kernel-1 pre-activation rows) go in front of its
        chunk, so the short conv runs over packed sequences of kernel-1 + chunk rows exactly as in a
        prefill (cached rows of a request shorter than kernel-1 are zeros, which add nothing);
        chunk_kda starts from the cached recurrent states."""
        width, N = self.kernel - 1, packed.num_sequences
        mixed = self._mixed(x)
        lengths = packed.lengths()
        longer = Packed.from_lengths([n + width for n in lengths], device=x.device)
        # chunk row r of request n is row r + width * (n + 1) of the longer packing
        rows = torch.arange(x.shape[0], device=x.device) + width * (packed.seq_index + 1)
        cached = longer.cu_seqlens[:-1, None] + torch.arange(width, device=x.device)
        extended = mixed.new_empty(x.shape[0] + N * width, mixed.shape[-1])
        extended[rows] = mixed
        extended[cached.flatten()] = state.conv[slots].transpose(1, 2).flatten(0, 1).to(mixed.dtype)
        q, k, v = (t[rows].unflatten(-1, (self.num_heads, self.head_dim))
                   for t in kda.short_conv(*extended.chunk(3, dim=-1), self._conv_weight(), longer.positions,
                                           longer.cu_seqlens, longer.cu_seqlens_cpu()))
        g = self._decay(x)
        beta = torch.sigmoid(self.b_proj(x))
        o, final = kda.chunk_kda(q[None], k[None], v[None], g[None], beta[None], scale=None,
                                 initial_state=state.recurrent[slots], output_final_state=True,
                                 use_qk_l2norm_in_kernel=True, cu_seqlens=packed.cu_seqlens,
                                 cu_seqlens_cpu=packed.cu_seqlens_cpu())
        state.conv[slots] = self._conv_tails(extended, longer).to(state.conv.dtype)
        state.recurrent[slots] = final.float()
        return self._output(o[0], x)

    # ---- rollout decode --------------------------------------------------------------------
    def forward_step(self, x: torch.Tensor, state: KDAState, kda) -> torch.Tensor:
        """x [B, D], one new token per request; updates `state` in place."""
        mixed = self._mixed(x)
        window = torch.cat([state.conv, mixed[:, :, None]], dim=-1)
        state.conv.copy_(window[:, :, 1:])
        conv = (window.float() * self._conv_weight()).sum(-1)
        q, k, v = (t.float() for t in self._split(F.silu(conv).to(x.dtype)))
        q = l2norm(q) * self.head_dim ** -0.5
        k = l2norm(k)
        beta = torch.sigmoid(self.b_proj(x)).float()
        o, recurrent = kda.recurrent_step(q, k, v, self._decay(x), beta, state.recurrent)
        state.recurrent.copy_(recurrent)  # in place: a captured CUDA graph keeps reading this tensor
        return self._output(o.to(x.dtype), x)

    def empty_state(self, batch: int, dtype, device) -> KDAState:
        HK = self.num_heads * self.head_dim
        return KDAState(torch.zeros(batch, 3 * HK, self.kernel - 1, dtype=dtype, device=device),
                        torch.zeros(batch, self.num_heads, self.head_dim, self.head_dim,
                                    dtype=torch.float32, device=device))
