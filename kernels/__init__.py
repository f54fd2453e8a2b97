"""qerl's NVFP4 kernels (installed as ``qerl_kernels``).

``reference`` is the pure-torch source of truth; ``ops`` dispatches to Triton kernels on CUDA
and falls back to the reference elsewhere, so every stage runs on a CPU-only machine.
"""
