"""KDA kernels behind one interface. `get_backend(name)` returns a module-like object with
`chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
cu_seqlens, cu_seqlens_cpu)` and `recurrent_step(q, k, v, g, beta, state)` and
`short_conv(q, k, v, weight, positions, cu_seqlens, cu_seqlens_cpu)` (cu_seqlens_cpu: the same
offsets on the host, so that planning the varlen chunks never reads the device).

- "torch": `naive.py`, pure torch, CPU and GPU; the reference.
- "fla":   fla's Triton kernels (CUDA only).
"""

from __future__ import annotations

import importlib

BACKENDS = ("torch", "fla")


def get_backend(name: str):
    if name not in BACKENDS:
        raise ValueError(f"unknown KDA backend {name!r}; allowed: {', '.join(BACKENDS)}")
    if name == "torch":
        return importlib.import_module("glmkit.kernels.kda.naive")
    module = importlib.import_module("glmkit.kernels.kda.fla")
    module._ops()  # fail now, with the package name, rather than at the first forward
    return module
