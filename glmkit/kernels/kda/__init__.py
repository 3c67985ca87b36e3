"""KDA kernels behind one interface. A backend is a module with
`chunk_kda(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
cu_seqlens, cu_seqlens_cpu)` and `recurrent_step(q, k, v, g, beta, state)` and
`short_conv(q, k, v, weight, positions, cu_seqlens, cu_seqlens_cpu)` (cu_seqlens_cpu: the same
offsets on the host, so that planning the varlen chunks never reads the device).

- "torch": `naive.py`, pure torch, CPU and GPU; the reference.
- "fla":   fla's Triton kernels (`fla.py`, CUDA only).

No "auto" (yet): the default is the reference, and fla is asked for by name on a GPU.
"""

from __future__ import annotations

from glmkit.kernels.registry import KernelBackend, OpRegistry, cuda_in

REGISTRY = OpRegistry("kda", auto_order=())
REGISTRY.register(KernelBackend("torch", "glmkit.kernels.kda.naive", "pure torch chunked delta rule (the reference)",
                                reference=True))
REGISTRY.register(KernelBackend("fla", "glmkit.kernels.kda.fla", "fla's Triton chunk_kda / fused_recurrent_kda",
                                packages=("fla", "triton"), verify=cuda_in()))
BACKENDS = REGISTRY.names


def get_backend(name: str):
    """The module of backend `name`."""
    module = REGISTRY.get(name).load()
    if name == "fla":
        module._ops()  # fail now, with the package name, rather than at the first forward
    return module
