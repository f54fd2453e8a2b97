"""The fragment-ordered code layout of the Gluon small-M kernel, on CPU (the kernel itself: GPU tests)."""

import torch
from qerl_kernels.gemm_gluon import to_frag
from qerl_kernels.twiddle import block


def test_to_frag_puts_each_lanes_groups_where_the_kernel_reads_them():
    n, kg = 48, 24  # 3 row blocks, 3 K steps
    logical = torch.arange(n * kg, dtype=torch.int64).view(n, kg) * 7919
    blocked = block(logical.view(torch.uint8)).view(torch.int64)
    scales = (torch.arange(n * kg) * 31 % 256).to(torch.uint8).view(n, kg)
    codes, sc = to_frag(blocked, scales)
    codes, sc = codes.reshape(-1), sc.reshape(-1)
    steps = kg // 8
    for rb in range(n // 16):
        for step in range(steps):
            for lane in range(32):
                for reg in range(4):
                    # The kernel's address (_load_step_frag) and the (row, group) its decode assumes.
                    off = ((rb * steps + step) * 32 + lane) * 4 + reg
                    row = rb * 16 + (reg // 2) * 8 + lane // 4
                    group = step * 8 + lane % 4 + 4 * (reg % 2)
                    assert codes[off] == logical[row, group]
                    assert sc[off] == scales[row, group]
