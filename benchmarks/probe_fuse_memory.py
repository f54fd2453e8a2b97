"""What fusing q/k/v and gate/up costs in GPU memory on a 32B bf16 model (random weights, LoRA r=16):
allocated and reserved GiB after building the model and after ``fuse_projections``. Each fused tensor is
a new allocation and its parts' old tensors return to the caching allocator, in pieces that live tensors
of the same segments keep from being handed back.

    python benchmarks/probe_fuse_memory.py
"""
import torch

from qerl_cli.layers.attention import fuse_projections
from qerl_cli.layers.lora import LoraSpec
from qerl_cli.models import build_random_model, preset


def gib() -> str:
    return f"allocated {torch.cuda.memory_allocated() / 2**30:.2f} reserved {torch.cuda.memory_reserved() / 2**30:.2f} GiB"


m = build_random_model(preset("qwen2.5-32b"), device="cuda", dtype=torch.bfloat16, quantized=False,
                       lora=LoraSpec(r=16, alpha=16), max_positions=4096)
print("after build:", gib(), flush=True)
fuse_projections(m)
print("after fuse:", gib(), flush=True)
torch.cuda.empty_cache()
print("after empty_cache:", gib(), flush=True)
