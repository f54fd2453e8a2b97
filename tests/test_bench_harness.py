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
