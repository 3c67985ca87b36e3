"""fla backend (CUDA): `chunk_kda` for train and prefill, `fused_recurrent_kda` for decode, and
fla's varlen `causal_conv1d` (forward and backward kernels) for the short convs in front of them."""

from __future__ import annotations

# From benchmarks/bench_short_conv_gpu.py on an H200 (64 x 128 channels per part, bf16): fla's kernel
# is 0.73x the inductor-fused reference at 4096 tokens and 2.9x at 32768 (forward; 0.80x and 1.81x
# with the backward); the lines cross near 5-6k tokens.
FLA_CONV_MIN_TOKENS = 8192


def _ops():
    try:
        from fla.ops.kda import chunk_kda, fused_recurrent_kda
    except ImportError as err:  # the message names the package a user installs
        raise ImportError(
            "KDA backend 'fla' needs flash-linear-attention (fla-core) 0.6: pip install -e '.[gpu]' "
            f"on a CUDA machine ({err})") from err
    return chunk_kda, fused_recurrent_kda


def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
              use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None):
    chunk, _ = _ops()
    if initial_state is not None:
        initial_state = initial_state.float()  # fla requires an fp32 state
    return chunk(q, k, v, g=g, beta=beta, scale=scale, initial_state=initial_state,
                 output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                 cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)


def short_conv(q, k, v, weight, positions, cu_seqlens, cu_seqlens_cpu=None):
    """Same contract as naive.short_conv (which it is tested against): one fla kernel per part, SiLU
    fused, sums in fp32, sequences never mixed (cu_seqlens). Below FLA_CONV_MIN_TOKENS packed tokens
    the reference runs instead (fused by inductor where the run fuses): it is the faster one there."""
    if q.shape[0] < FLA_CONV_MIN_TOKENS:
        from glmkit.kernels.kda import naive

        return naive.short_conv(q, k, v, weight, positions, cu_seqlens, cu_seqlens_cpu)
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except ImportError as err:
        raise ImportError(f"KDA backend 'fla' needs flash-linear-attention (fla-core) 0.6 ({err})") from err
    return [causal_conv1d(part[None], weight=w, activation="silu", cu_seqlens=cu_seqlens,
                          cu_seqlens_cpu=cu_seqlens_cpu)[0][0]
            for part, w in zip((q, k, v), weight.chunk(3))]


def recurrent_step(q, k, v, g, beta, state):
    """One decode token for a batch; same contract as naive.recurrent_step (inputs already normalised
    and scaled, so the kernel is called with scale=1)."""
    _, fused = _ops()
    o, state = fused(q[:, None], k[:, None], v[:, None], g=g[:, None], beta=beta[:, None], scale=1.0,
                     initial_state=state.float(), output_final_state=True)
    return o[:, 0].float(), state
