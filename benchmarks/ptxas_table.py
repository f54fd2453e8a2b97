"""ptxas's performance warnings for every Gluon tile of the kernel table, without a GPU.

Usage: ``python benchmarks/ptxas_table.py [--ms 64,128] [--pair]`` prints, per table entry (and with
``--pair`` also the pairing launch the engine makes of it: SwiGLU on gate/up, rotary on q/k/v), the
registers per thread, spill bytes, and whether ptxas serialised the kernel's wgmmas (its C7515 warning,
"wgmma.mma_async instructions are serialized due to ..."). Exits 1 if any entry is serialised or spills.

Why: a serialised wgmma pipeline makes a tile silently slow, not wrong, and the warning only appears
in ``ptxas -v`` output, which Triton does not show. The twentieth kernel pass found one this way (an
MMA left in flight across a loop's back edge, docs/benchmarks.md). Triton compiles each tile ahead of
time for sm_90 (``GluonASTSource`` + ``GPUTarget``) into a fresh cache, with ``TRITON_DUMP_PTXAS_LOG``
so that Triton prints the log of its own ptxas call (the binary and flags that build the cubin). The local Triton may differ from the GPU machine's; run it with that
version's wheel on ``PYTHONPATH`` to check what the H100 builds.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROPE_SIG = {"P": "*i64", "CS": "*fp32", "SLOT": "*i64", "KC": "*bf16", "VC": "*bf16", "NQ": "i32", "NK": "i32"}
GATE_UP, QKV = {37888, 55296}, {4608, 7168}


def _epilogue(sig: dict, consts: dict, pair: int) -> tuple[dict, dict]:
    """The pairing epilogue's arguments (gemm_gluon.pair_mode): the rotary pointers, or the Nones a plain or
    SwiGLU launch passes."""
    consts = {**consts, "PAIR": pair, "HD": 64}
    if pair == 2:
        return {**sig, **ROPE_SIG}, consts
    return {**sig, "NQ": "i32", "NK": "i32"}, {**consts, **dict.fromkeys(("P", "CS", "SLOT", "KC", "VC"))}


def gluon_source(cfg, pair: int = 0, pdl: bool = False):
    """(source, compile options) of the Gluon kernel a launch of ``cfg`` runs, with pairing epilogue ``pair``
    (0 plain, 1 SwiGLU, 2 rotary, 3 SwiGLU in K order), as the launchers pass them; ``pdl``: as launched
    after its own ``permute_x`` (X-by-TMA tiles over natural X, kernels/pdl.py)."""
    from qerl_kernels.gemm_gluon_tma import x_layout
    from triton.experimental.gluon._runtime import GluonASTSource

    ptrs = {"G": "*fp32", "B": "*bf16", "Y": "*bf16", "WS": "*fp32", "CNT": "*i32", "M": "i32", "N": "i32", "KG": "i32"}
    consts = dict(BM=cfg.bm, BN=cfg.bn, HAS_BIAS=pair == 2, NW=cfg.warps)
    opts = dict(num_warps=cfg.warps)
    xdesc = f"tensordesc<bf16[{cfg.bm},64],{x_layout(cfg.bm)!r}>"
    if cfg.ws:
        from qerl_kernels.gemm_gluon_ws import (
            _nvfp4_fwd_gluon_ws_kernel,
            code_layout,
            duo_consumer_regs,
            duo_runs,
            scale_layout,
            y_layout,
        )

        rows = cfg.bn // 2 if pair else cfg.bn
        duo = duo_runs(cfg, pair in (1, 3), SimpleNamespace() if pair == 2 else None, cfg.split_k, cfg.halves, 1)
        kernel = _nvfp4_fwd_gluon_ws_kernel
        sig = {"X": xdesc if cfg.xtma else "*bf16", "c_desc": f"tensordesc<i64[{rows // 16},128],{code_layout()!r}>",
               "s_desc": f"tensordesc<u8[{rows},16],{scale_layout()!r}>", **ptrs, "pairs_per_split": "i32",
               "n_full": "i32", "stride_xm": "i32", "stride_ym": "i32"}
        consts.update(SPLIT=min(cfg.split_k, 2), STAGES=cfg.stages, PREGS=cfg.pregs, HALF=cfg.half, HALVES=cfg.halves,
                      XTMA=cfg.xtma, DUO=duo, CREGS=duo_consumer_regs(cfg) if duo else 0, XSTAGES=cfg.xstages,
                      PERSIST=bool(duo and cfg.persist and cfg.xstages and cfg.split_k == 1 and not cfg.halves),
                      NW=4 if duo else cfg.warps)
        consts.update(TSTORE=bool(consts["PERSIST"] and getattr(cfg, "tstore", False) and pair == 0))
        consts.update(TAIL=bool(consts["TSTORE"] and getattr(cfg, "tail", False)), PDL=bool(pdl and cfg.xtma))
        sig["parts"] = "i32"
        if consts["TSTORE"]:
            sig["YD"] = f"tensordesc<bf16[{cfg.bm},64],{y_layout(cfg.bm)!r}>"
        else:
            consts["YD"] = None
        opts.update(num_warps=4 if duo else cfg.warps, maxnreg=cfg.maxnreg)
    elif cfg.xtma:
        from qerl_kernels.gemm_gluon_tma import _nvfp4_fwd_gluon_tma_kernel, _nvfp4_fwd_gluon_tma_sk_kernel

        sig = {"x_desc": xdesc, "PW": "*i64", "S": "*u8", **ptrs}
        consts.update(STAGES=max(2, cfg.stages), INFLIGHT=cfg.inflight)
        if cfg.sk:
            kernel = _nvfp4_fwd_gluon_tma_sk_kernel
            sig.update(units="i32", nprog="i32", stride_sn="i32", stride_ym="i32")
            return GluonASTSource(kernel, {**sig, **{k: "constexpr" for k in consts}}, constexprs=consts), opts
        kernel = _nvfp4_fwd_gluon_tma_kernel
        sig.update(steps_per_split="i32", n_full="i32", stride_sn="i32", stride_ym="i32")
        consts.update(SPLIT=min(cfg.split_k, 2), HALVES=cfg.halves, PDL=pdl)
    else:
        from qerl_kernels.gemm_gluon import _nvfp4_fwd_gluon_kernel

        kernel = _nvfp4_fwd_gluon_kernel
        sig = {"X": "*bf16", "PW": "*i64", "S": "*u8", **ptrs, "steps_per_split": "i32", "stride_xm": "i32",
               "stride_sn": "i32", "stride_ym": "i32"}
        consts.update(SPLIT=min(cfg.split_k, 2))
    sig, consts = _epilogue(sig, consts, pair)
    return GluonASTSource(kernel, {**sig, **{k: "constexpr" for k in consts}}, constexprs=consts), opts


def compile_with_log(src, opts) -> str:
    """Compile for sm_90 and return ptxas's ``-v`` log, from the very ptxas call (binary and flags) Triton
    makes for the cubin: a fresh cache forces the call, TRITON_DUMP_PTXAS_LOG prints its log."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    out = io.StringIO()
    with tempfile.TemporaryDirectory() as cache, contextlib.redirect_stdout(out):
        old = knobs.cache.dir, knobs.nvidia.dump_ptxas_log
        knobs.cache.dir, knobs.nvidia.dump_ptxas_log = cache, True
        try:
            triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
        finally:
            knobs.cache.dir, knobs.nvidia.dump_ptxas_log = old
    return out.getvalue()


def ptxas_report(log: str) -> dict:
    """Registers, spill bytes and C7515 (serialised wgmma) reasons in a ptxas ``-v`` log."""
    regs = re.search(r"Used (\d+) registers", log)
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)]
    serial = sorted({m.group(1).strip() for m in re.finditer(r"C7515\)[^:]*: [^:]*serialized (due to[^']*)", log)})
    return {"regs": int(regs.group(1)) if regs else None, "spill_bytes": max(spills, default=0), "serialized": serial}


def table_jobs(ms: set[int] | None, pair: bool):
    """(M, N, K, config, pairing mode) for every Gluon entry of the table (and its engine pairing launch)."""
    from qerl_kernels.tile_configs import FWD_TABLE

    for (m, n, k), cfg in sorted(FWD_TABLE.items()):
        if not cfg.gluon or (ms and m not in ms):
            continue
        yield m, n, k, cfg, 0
        if pair and not cfg.sk and (n in GATE_UP or (n in QKV and cfg.bn <= 128)):
            yield m, n, k, cfg, 3 if n in GATE_UP and cfg.xtma else 1 if n in GATE_UP else 2


def main(argv=None) -> int:
    import triton

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="", help="table M buckets to check (default: all)")
    ap.add_argument("--pair", action="store_true", help="also the pairing launches the engine makes")
    args = ap.parse_args(argv)
    ms = {int(m) for m in args.ms.split(",") if m}
    print(f"# triton {triton.__version__}, sm_90a", flush=True)
    bad = 0
    for m, n, k, cfg, pair in table_jobs(ms, args.pair):
        src, opts = gluon_source(cfg, pair)
        rep = ptxas_report(compile_with_log(src, opts))
        kind = "ws" if cfg.ws else "tma-sk" if cfg.sk else "tma" if cfg.xtma else "gluon"
        flag = "SERIALIZED " if rep["serialized"] else ""
        flag += f"SPILLS {rep['spill_bytes']} B " if rep["spill_bytes"] else ""
        bad += bool(flag)
        print(f"M={m:5} {n}x{k} pair={pair} {kind} bm{cfg.bm} bn{cfg.bn} w{cfg.warps} st{cfg.stages} "
              f"r{cfg.maxnreg} h{cfg.half} duo{int(cfg.duo)} x{cfg.xstages}{' persist' if cfg.persist else ''}: "
              f"{rep['regs']} regs {flag}"
              f"{'; '.join(rep['serialized'])}", flush=True)
    print(f"# {bad} of the checked launches serialise their wgmmas or spill")
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    sys.exit(main())
