"""qerl's NVFP4 kernels (installed as ``qerl_kernels``).

``reference`` is the pure-torch source of truth; ``ops`` dispatches to Triton kernels on CUDA
and falls back to the reference elsewhere, so every stage runs on a CPU-only machine.

Modules: ``decode`` (in-register E2M1/E4M3 decode, sm_90 PTX and a portable path),
``gemm_fwd`` (Y = X W^T for every M: swap-AB + split-K at small M, ``join`` tiles at medium M),
``gemm_bwd`` (grad-input dX = dY W), ``dequant`` (NVFP4 -> dense, the large-M path before cuBLAS),
``twiddle`` (the load-time code bit layout the sm_90 decode reads), ``lora_shrink`` (the engine's
one-launch LoRA shrink x @ A^T at decode sizes), ``pdl`` (the GEMM after ``permute_x`` launched early),
``tile_configs`` / ``tile_table`` (per-shape configs measured on an H100), ``compile_ahead`` (compile the
kernels a block of host code would launch side by side, without launching them; ``compile_workers`` runs
those compiles in forked processes), ``testing`` (adversarial
weights and kernel-vs-reference checks shared by tests and benchmarks).
"""
