"""Compile the forward NVFP4 GEMM for sm_90 without a GPU and count its SASS: no device time needed.

Usage: ``python benchmarks/sass_kernels.py [BM BN BKW SWAP JOIN WARPS STAGES TWIDDLED PERM BLOCKED STAGGER]`` (default: the M<=16
config that wins most small-M shapes). Prints registers per thread, the wgmma wait depths
Triton chose, and the opcode histogram of the whole kernel, plus SASS instructions per decoded
weight in the K loop (loop instructions / (BN * 8 * BKW / threads)).

Why: the small-M kernels reach 0.7-1.6 TB/s of ~3 TB/s; this shows where their instructions
go (decode, layout shuffles, tensor-core waits) in seconds on a CPU machine. It uses Triton's
AOT path (``triton.compile`` with a ``GPUTarget``) and the ``nvdisasm`` bundled with Triton; the
local Triton may be newer than the GPU machine's, so counts are indicative.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def compile_fwd(bm=16, bn=128, bkw=16, swap=True, join=False, warps=4, stages=3, twiddled=False, perm=False,
                blocked=False, stagger=False, tma=False, maxnreg=None):
    import triton
    from qerl_kernels.gemm_fwd import _nvfp4_fwd_kernel
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = {"X": "*bf16", "PW": "*i32", "S": "*u8", "G": "*fp32", "B": "*bf16", "Y": "*bf16", "WS": "*fp32",
           "CNT": "*i32", "M": "i32", "N": "i32", "KW": "i32", "k_per_split": "i32", "stride_xm": "i32",
           "stride_pw": "i32", "stride_sn": "i32", "stride_ym": "i32"}
    consts = dict(BM=bm, BN=bn, BKW=bkw, GROUP_M=8, SWAP=swap, SPLIT=1, HAS_BIAS=False, FAST=True,
                  EPI=256.0, IEEE=False, JOIN=join, TWIDDLED=twiddled, PERM=perm, PROBE_NODECODE=False,
                  BLOCKED=blocked, EVEN_K=True, STAGGER=stagger, TMA=tma)
    if twiddled:
        sig["PW"] = "*i64"  # the wrapper passes whole scale groups (decode.load_word_tile)
    if tma:  # descriptors of the codes' K-step box and X's tile (gemm_fwd._tma_descriptors)
        sig["PW"] = f"tensordesc<i64[{bn // 16}, 128]>"
        sig["X"] = f"tensordesc<bf16[{bm}, {8 * bkw}]>"
    sig.update({k: "constexpr" for k in consts})
    # As at run time for the Qwen shapes: pointers, N, K/8, strides divisible by 16 (M is not specialised).
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14, 15)}
    src = ASTSource(_nvfp4_fwd_kernel, sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages, maxnreg=maxnreg))


def resource_usage(kernel) -> dict:
    """REG / STACK / SHARED / LOCAL of a compiled kernel, read by the cuobjdump that ships with Triton.
    Register spills land in STACK (bytes per thread); LOCAL stays 0 for them."""
    import triton

    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        res = subprocess.run([str(bindir / "cuobjdump"), "--dump-resource-usage", str(cubin)],
                             capture_output=True, text=True).stdout
    return {key: int(v) for key, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", res)}


def main(argv=None) -> int:
    import triton

    argv = sys.argv[1:] if argv is None else argv
    if {"-h", "--help"} & set(argv):
        print(__doc__)
        return 0
    names = ("bm", "bn", "bkw", "swap", "join", "warps", "stages", "twiddled", "perm", "blocked", "stagger", "tma",
             "maxnreg")
    flags = ("swap", "join", "twiddled", "perm", "blocked", "stagger", "tma")
    kw = {n: (v.lower() in ("1", "true") if n in flags else int(v)) for n, v in zip(names, argv)}
    cfg = {**dict(bm=16, bn=128, bkw=16, swap=True, join=False, warps=4, stages=3, twiddled=False, perm=False, blocked=False, stagger=False, tma=False), **kw}
    k = compile_fwd(**cfg)
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(k.asm["cubin"])
        sass = subprocess.run([str(bindir / "nvdisasm"), "-c", str(cubin)], capture_output=True, text=True).stdout
        res = subprocess.run([str(bindir / "cuobjdump"), "--dump-resource-usage", str(cubin)],
                             capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", res)
    waits = collections.Counter(re.findall(r"pendings = (\d+)", k.asm["ttgir"]))
    lines = [ln for ln in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]+\*/", ln)]
    ops = []
    for ln in lines:
        toks = ln.split("*/", 1)[1].split()
        toks = [t for t in toks if not t.startswith("@")]
        if toks:
            ops.append(toks[0].split(".")[0])
    # The K loop is the longest backward branch's body.
    loop = (0, 0)
    for i, ln in enumerate(lines):
        m = re.search(r"BRA `\(\.L_x_(\d+)\)", ln)
        if m:
            tgt = next((j for j, l2 in enumerate(lines) if f".L_x_{m.group(1)}:" in l2), None)
            label_idx = [j for j, l2 in enumerate(sass.splitlines()) if f".L_x_{m.group(1)}:" in l2]
            if tgt is None and label_idx:
                # labels sit on their own lines; map to the next instruction index
                full = sass.splitlines()
                before = sum(1 for l2 in full[: label_idx[0]] if re.match(r"\s*/\*[0-9a-f]+\*/", l2))
                tgt = before
            if tgt is not None and tgt < i and i - tgt > loop[1] - loop[0]:
                loop = (tgt, i)
    threads = 32 * cfg["warps"]
    weights = cfg["bn"] * 8 * cfg["bkw"] / threads
    loop_n = loop[1] - loop[0]
    print(f"config {cfg}: {regs.group(1) if regs else '?'} registers/thread, wgmma waits {dict(waits)}")
    print(f"K loop: {loop_n} SASS instructions for {weights:.0f} weights/thread = {loop_n / weights:.2f} per weight")
    print("loop opcodes:", dict(collections.Counter(ops[loop[0]:loop[1]]).most_common(14)))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    sys.exit(main())
