"""Run one `qerl` stage under cProfile and print where its wall time goes.

    python benchmarks/profile_stage.py --prof $OUT/rollout.prof -- rollout --model QDIR --prompts P --out D ...

The stage runs in this process exactly as `qerl` would run it (same argv), so its start-up, loading,
engine build and work are all in the profile. Prints the functions with the largest cumulative time
(qerl's own, Triton's and torch's entry points), then the same table restricted to qerl's modules.
cProfile slows Python-heavy code; GPU time is unaffected, so read the table for where the host spends
its time, not for exact seconds.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prof", required=True, help="where to write the pstats file")
    ap.add_argument("--top", type=int, default=45)
    ap.add_argument("stage", nargs=argparse.REMAINDER, help="-- then the qerl arguments")
    args = ap.parse_args()
    argv = args.stage[1:] if args.stage[:1] == ["--"] else args.stage
    from qerl_cli.cli import main as qerl_main

    sys.argv = ["qerl", *argv]
    prof = cProfile.Profile()
    t0 = time.time()
    try:
        prof.runcall(qerl_main)
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    wall = time.time() - t0
    prof.dump_stats(args.prof)
    print(f"\n# {' '.join(argv[:1])}: {wall:.1f} s in the stage (imports of qerl_cli.cli before it)")
    st = pstats.Stats(args.prof)
    st.sort_stats("cumulative").print_stats(args.top)
    st.sort_stats("cumulative").print_stats(r"qerl_cli|qerl_kernels", args.top)


if __name__ == "__main__":
    main()
