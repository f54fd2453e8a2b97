"""What reading a step's shards costs each torchrun rank of a train-step, on CPU.

Each of N ranks (gloo, one process each, started here) does what ``_joined_step`` does from the shards to
the token arrays it trains on: ``read_step`` (parse, check), the micro-batch packing, the token arrays
of its own micro-batches (``_keep_owned``) and the fingerprint's shard hash (``_shards_hash``). Per rank it reports the wall time, the CPU time
(the ranks share the machine's cores, so the CPU time is the rank's own cost) and the peak RSS over the RSS
before reading. The step: ``--prompts`` x ``--per-group`` completions of ``--completion-len`` tokens after
``--prompt-len``-token prompts, in ``--shards`` files (made once per ``--workdir``).

    python benchmarks/bench_read_step.py --workdir /tmp/qerl-read --world-sizes 1,2,4,8

Results: docs/benchmarks.md, "Reading a step under torchrun".
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import resource
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_step(out: Path, prompts: int, per_group: int, prompt_len: int, completion_len: int, shards: int) -> Path:
    from qerl_cli.shards import make_record, shard_name, write_records

    if any(out.glob("shard-*.jsonl")):
        return out
    out.mkdir(parents=True, exist_ok=True)
    rnd = random.Random(0)
    per_shard = -(-prompts // shards)
    for s in range(shards):
        recs = []
        for g in range(s * per_shard, min(prompts, (s + 1) * per_shard)):
            prompt = [rnd.randrange(3, 150000) for _ in range(prompt_len)]
            for _ in range(per_group):
                n = rnd.randint(completion_len // 2, completion_len)  # lengths vary, as the packing sees them
                comp = [rnd.randrange(3, 150000) for _ in range(n)]
                recs.append(make_record(
                    prompt_id=f"p{g}", group_id=f"g{g}", prompt="x", prompt_token_ids=prompt,
                    completion_token_ids=comp, completion="y", logprobs=[-rnd.random() for _ in comp],
                    finish_reason="stop", rewards={"r": 1.0}, reward=float(rnd.random()), answer=None, step=0,
                    policy={"base": "0" * 64, "adapter": None}, sampling={"temperature": 1.0},
                    noise={"sigma": 0.0, "seed": 0}, engine="bench"))
        write_records(out / shard_name(s, shards), recs)
    return out


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def rank_main(shards: Path, micro_batch_tokens: int) -> None:
    import torch.distributed as dist

    from qerl_cli.train import distributed, inputs
    from qerl_cli.train.batching import pack_microbatches
    from qerl_cli.train_step import TrainStepConfig

    dist.init_process_group("gloo")
    d = distributed.setup("cpu")
    cfg = TrainStepConfig(model=shards, shards=[str(shards)], out=shards / "o", progress=False,
                          micro_batch_tokens=micro_batch_tokens)
    rss0 = _rss_mib()
    dist.barrier()
    t0, c0 = time.perf_counter(), time.process_time()
    # before 2026-11-28 (every rank read the whole step) read_step took no process group
    shared = "dist" in inspect.signature(inputs.read_step).parameters
    data = inputs.read_step(cfg, d) if shared else inputs.read_step(cfg)
    groups = pack_microbatches([p + c for p, c in zip(data.prompt_lengths, data.completion_lengths)],
                               cfg.micro_batch_tokens)
    inputs._keep_owned(data, groups, d)
    # the fingerprint's shard hash: before 2026-11-28 (session 60) each file was read and hashed again for it
    shards_hash = (inputs._shards_hash(data.file_hashes) if hasattr(data, "file_hashes")
                   else inputs._shards_hash(data.files))
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    owned = sum(len(g) for j, g in enumerate(groups) if d.owns(j))
    digest = _digest(data, groups, d)
    print(json.dumps({"rank": d.rank, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2),
                      "peak_rss_over_start_mib": round(peak - rss0, 1), "records": len(data.records),
                      "owned_records": owned, "micro_batches": len(groups), "digest": digest,
                      "shards_hash": shards_hash[:16]}), flush=True)
    dist.destroy_process_group()


def _digest(data, groups, d) -> str:
    """A digest of what this rank trains on: its sequences' arrays and every record's per-step values."""
    import hashlib

    h = hashlib.sha256(json.dumps([groups, data.group_ids, data.rewards, data.temperatures, data.truncated,
                                   data.prompt_lengths, data.completion_lengths, [list(o) for o in data.origins],
                                   data.records], default=str).encode())
    for j, g in enumerate(groups):
        for s in g if d.owns(j) else ():
            for x in (data.prompts[s], data.completions[s], data.sampling_logprobs[s]):
                h.update(x.typecode.encode() + x.tobytes())
    return h.hexdigest()[:16]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(shards: Path, world: int, micro_batch_tokens: int) -> list[dict]:
    port = str(_free_port())
    procs = []
    for r in range(world):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank-of", str(shards),
                                       "--micro-batch-tokens", str(micro_batch_tokens)],
                                      env=env, stdout=subprocess.PIPE, text=True))
    rows = []
    for p in procs:
        out, _ = p.communicate()
        if p.returncode:
            raise SystemExit(f"a rank failed (exit {p.returncode})")
        rows.append(json.loads(out.strip().splitlines()[-1]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", type=Path, default=Path("/tmp/qerl-read-step"))
    ap.add_argument("--world-sizes", default="1,2,4,8")
    ap.add_argument("--prompts", type=int, default=512)
    ap.add_argument("--per-group", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--completion-len", type=int, default=1024)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--micro-batch-tokens", type=int, default=16384)
    ap.add_argument("--rank-of", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.rank_of is not None:
        rank_main(a.rank_of, a.micro_batch_tokens)
        return
    sh = make_step(a.workdir / f"step-{a.prompts}x{a.per_group}x{a.completion_len}-{a.shards}", a.prompts,
                   a.per_group, a.prompt_len, a.completion_len, a.shards)
    size = sum(f.stat().st_size for f in sh.glob("shard-*.jsonl")) / 2**20
    print(f"step: {sh} ({size:.0f} MiB of JSON lines)")
    print("| ranks | wall s (max) | CPU s a rank (max) | CPU s all ranks | peak RSS over start, MiB a rank (max) |")
    print("| --- | --- | --- | --- | --- |")
    for world in (int(w) for w in a.world_sizes.split(",")):
        rows = run_world(sh, world, a.micro_batch_tokens)
        print(f"| {world} | {max(r['wall_s'] for r in rows):.1f} | {max(r['cpu_s'] for r in rows):.1f} | "
              f"{sum(r['cpu_s'] for r in rows):.1f} | {max(r['peak_rss_over_start_mib'] for r in rows):.0f} |",
              flush=True)
        print("  " + json.dumps(rows), file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
