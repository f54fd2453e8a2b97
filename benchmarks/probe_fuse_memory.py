"""Reserved-but-unused memory after fusing q/k/v and gate/up of a 32B bf16 model: the fusion as it is
against the fusion with torch.cuda.empty_cache disabled (`old`, as before 2026-11-26).

    python benchmarks/probe_fuse_memory.py new; python benchmarks/probe_fuse_memory.py old
"""
import sys

import torch

import qerl_cli.layers.attention as A
from qerl_cli.layers.lora import LoraSpec
from qerl_cli.models import build_random_model, preset

if sys.argv[1] == "old":
    torch.cuda.empty_cache = lambda: None  # the fusion as it was: nothing handed back
m = build_random_model(preset("qwen2.5-32b"), device="cuda", dtype=torch.bfloat16, quantized=False,
                       lora=LoraSpec(r=16, alpha=16), max_positions=4096)
g = 2**30
print(sys.argv[1], f"after build: allocated {torch.cuda.memory_allocated() / g:.2f} reserved {torch.cuda.memory_reserved() / g:.2f} GiB")
try:
    A.fuse_projections(m)
    print(sys.argv[1], f"after fuse: allocated {torch.cuda.memory_allocated() / g:.2f} reserved {torch.cuda.memory_reserved() / g:.2f} GiB")
except torch.OutOfMemoryError as e:
    print(sys.argv[1], "fuse: OOM", str(e)[:160])
