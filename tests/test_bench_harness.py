"""The kernel benchmark's timing order (benchmarks/bench_kernels.py), on CPU with fake timers."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def test_interleaved_rounds_alternate_the_sides():
    from bench_kernels import interleaved_rounds

    calls = []
    qerl_times = iter([9.0, 1.0, 3.0, 2.0])
    cublas_times = iter([50.0, 10.0, 30.0])

    def qerl():
        calls.append("qerl")
        return next(qerl_times), 0.0

    def cublas():
        calls.append("cublas")
        return next(cublas_times)

    qs, cs = interleaved_rounds(5.0, 20.0, 4, qerl, cublas)
    assert calls == ["cublas", "qerl"] * 3  # the first timings are the caller's; then strictly alternate
    assert (qs, cs) == ([5.0, 9.0, 1.0, 3.0], [20.0, 50.0, 10.0, 30.0])


def test_one_round_keeps_the_first_timings():
    from bench_kernels import interleaved_rounds

    def never():
        raise AssertionError("one round times nothing again")

    assert interleaved_rounds(7.5, 11.0, 1, never, never) == ([7.5], [11.0])


def test_ptxas_report_reads_spills_and_serialised_wgmmas():
    # benchmarks/ptxas_table.py parses ptxas -v logs (lines as ptxas 12.8 and the 12.9 "blackwell" one print).
    from ptxas_table import ptxas_report

    serialised = (
        "ptxas-blackwell info    : (C7515) Potential Performance Loss: wgmma.mma_async instructions are serialized "
        "due to non wgmma instructions defining accumulator registers of a wgmma between start and end of the "
        "pipeline stage in the function '_nvfp4_fwd_gluon_ws_kernel' in line 5962\n"
        "ptxas-blackwell info    : Function properties for _nvfp4_fwd_gluon_ws_kernel\n"
        "    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads\n"
        "ptxas-blackwell info    : Used 168 registers, used 4 barriers\n")
    rep = ptxas_report(serialised)
    assert rep["regs"] == 168 and rep["spill_bytes"] == 0
    assert rep["serialized"] == ["due to non wgmma instructions defining accumulator registers of a wgmma between "
                                 "start and end of the pipeline stage in the function"]
    spilled = ("ptxas info    : Function properties for _nvfp4_fwd_gluon_tma_kernel\n"
               "    328 bytes stack frame, 352 bytes spill stores, 352 bytes spill loads\n"
               "ptxas info    : Used 255 registers, used 1 barriers, 328 bytes cumulative stack size\n")
    assert ptxas_report(spilled) == {"regs": 255, "spill_bytes": 704, "serialized": []}


def test_targets_table_has_one_backward_row_per_m(monkeypatch):
    # With --bwd-ms 1024,4096 the targets table pooled both Ms into one geomean labelled "bwd 1024".
    import torch
    from bench_kernels import render

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake")
    rec = dict(op="bwd", model="7B", layer="o", N=3584, K=3584, cublas_us=1.0, TFLOPs=1.0)
    text = render([{**rec, "M": 1024, "us": 2.0, "speedup": 0.5}, {**rec, "M": 4096, "us": 0.5, "speedup": 2.0}], "cmd")
    assert "| bwd 1024 | 0.50x | 0.50x |" in text and "| bwd 4096 | 2.00x | 2.00x |" in text
