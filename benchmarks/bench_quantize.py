"""Benchmark `qerl quantize` end to end (process start, I/O and hashing included).

Two measurements, each on random weights of a real model's shapes (the quantizer's speed does
not depend on the values):

- ``gpu``: a Qwen2.5-7B-shaped bf16 checkpoint (~15 GB, 4 GB shards) is generated on the GPU,
  written to local disk, then ``qerl quantize --device cuda`` runs twice: once after evicting
  the source from the page cache (``posix_fadvise(DONTNEED)``: the disk read is part of the
  time) and once with the source cached.
- ``cpu``: a Qwen2.5-0.5B-shaped checkpoint, ``qerl quantize --device cpu``, reported as params/s,
  beside llm-compressor's ``oneshot`` with the ``NVFP4A16`` scheme when a Python that has
  llmcompressor is given (``--llmcompressor-python``; it has to live in its own venv because it
  pins older transformers/compressed-tensors). Both outputs are then compared tensor by tensor.

Each run writes a JSON result; ``write-docs`` renders results into the ``## quantize`` section of
docs/benchmarks.md (other sections are left alone).

    python benchmarks/bench_quantize.py gpu --workdir /tmp/qerl-bench --json $OUT/quantize_gpu.json
    python benchmarks/bench_quantize.py cpu --workdir /tmp/qerl-bench-cpu \
        --llmcompressor-python /tmp/lcvenv/bin/python --json /tmp/quantize_cpu.json
    python benchmarks/bench_quantize.py write-docs /tmp/quantize_gpu.json /tmp/quantize_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks.md"
PEAK_RSS_GB = [0.0]

SHAPES = {
    # Qwen/Qwen2.5-7B-Instruct config.json
    "qwen2.5-7b": dict(
        hidden=3584, intermediate=18944, layers=28, heads=28, kv_heads=4, vocab=152064, tie=False
    ),
    # Qwen/Qwen2.5-0.5B-Instruct config.json
    "qwen2.5-0.5b": dict(
        hidden=896, intermediate=4864, layers=24, heads=14, kv_heads=2, vocab=151936, tie=True
    ),
    # smoke test of this script only (seconds on CPU); not a benchmark
    "tiny": dict(hidden=128, intermediate=256, layers=2, heads=4, kv_heads=2, vocab=1000, tie=False),
}


def tensor_shapes(s: dict) -> list[tuple[str, tuple[int, ...]]]:
    h, i, hd = s["hidden"], s["intermediate"], s["hidden"] // s["heads"]
    kv = s["kv_heads"] * hd
    out = [("model.embed_tokens.weight", (s["vocab"], h))]
    for layer in range(s["layers"]):
        p = f"model.layers.{layer}"
        out += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_proj.weight", (h, h)),
            (f"{p}.self_attn.q_proj.bias", (h,)),
            (f"{p}.self_attn.k_proj.weight", (kv, h)),
            (f"{p}.self_attn.k_proj.bias", (kv,)),
            (f"{p}.self_attn.v_proj.weight", (kv, h)),
            (f"{p}.self_attn.v_proj.bias", (kv,)),
            (f"{p}.self_attn.o_proj.weight", (h, h)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.mlp.gate_proj.weight", (i, h)),
            (f"{p}.mlp.up_proj.weight", (i, h)),
            (f"{p}.mlp.down_proj.weight", (h, i)),
        ]
    out.append(("model.norm.weight", (h,)))
    if not s["tie"]:
        out.append(("lm_head.weight", (s["vocab"], h)))
    return out


def make_checkpoint(out: Path, shape_name: str, device: str, shard_bytes: int = 4 * 10**9) -> dict:
    """Random bf16 checkpoint with HF names/config; generated on ``device``; skipped if complete."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    s = SHAPES[shape_name]
    done = out / ".complete"
    if done.exists():
        return json.loads(done.read_text())
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(0)
    shards, cur, size = [], {}, 0
    for name, shp in tensor_shapes(s):
        if name.endswith("norm.weight"):
            t = torch.ones(shp, dtype=torch.bfloat16)
        else:
            t = (
                (torch.randn(shp, generator=gen, device=device, dtype=torch.float32) * 0.02)
                .to(torch.bfloat16)
                .cpu()
            )
        nb = t.numel() * 2
        if cur and size + nb > shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name] = t
        size += nb
    shards.append(cur)
    weight_map, total = {}, 0
    for k, sd in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(sd, out / fname, metadata={"format": "pt"})
        for n, t in sd.items():
            weight_map[n] = fname
            total += t.numel() * 2
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    cfg = Qwen2Config(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        tie_word_embeddings=s["tie"],
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        dtype="bfloat16",
    )
    cfg.save_pretrained(out)
    info = {
        "shape": shape_name,
        "bytes": total,
        "params": total // 2,
        "gen_s": round(time.perf_counter() - t0, 1),
    }
    done.write_text(json.dumps(info))
    return info


def evict_page_cache(d: Path) -> bool:
    """Drop a directory's files from the page cache (no root needed); False if unsupported."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for p in d.iterdir():
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def timed(cmd: list[str], env=None) -> tuple[float, str]:
    """Wall time of a subprocess; that child's own peak RSS (from wait4) lands in ``PEAK_RSS_GB[0]``.

    The parent keeps torch out of its memory (checkpoints are generated in a child too): a
    vforked child's peak RSS is reported as at least its parent's.
    """
    with tempfile.TemporaryFile() as log:
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        _, status, usage = os.wait4(p.pid, 0)
        dt = time.perf_counter() - t0
        p.returncode = os.waitstatus_to_exitcode(status)
        log.seek(0)
        text = log.read().decode(errors="replace")
    PEAK_RSS_GB[0] = usage.ru_maxrss / 1e6
    if p.returncode != 0:
        raise SystemExit(f"command failed ({p.returncode}): {' '.join(cmd)}\n{text[-3000:]}")
    return dt, text


def make_in_child(out: Path, shape: str, device: str) -> dict:
    subprocess.run(
        [sys.executable, __file__, "make", "--out", str(out), "--shape", shape, "--device", device],
        check=True,
    )
    return json.loads((out / ".complete").read_text())


def qerl_cmd(src: Path, out: Path, device: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "qerl_cli",
        "quantize",
        str(src),
        "--out",
        str(out),
        "--device",
        device,
        "--force",
    ]


def machine() -> dict:
    """Versions and hardware, read in a child process so this one never imports torch."""
    code = (
        "import json, os, platform, torch; i = {'python': platform.python_version(), 'torch': torch.__version__,"
        " 'cpus': os.cpu_count()}\n"
        "if torch.cuda.is_available(): i['gpu'] = torch.cuda.get_device_name(0)\n"
        "print(json.dumps(i))"
    )
    info = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout)
    try:
        info["cpu"] = next(
            line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")
        )
    except (OSError, StopIteration):
        info["cpu"] = platform.processor()
    return info


def summary_of(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())["summary"]


def bench_gpu(args) -> dict:
    work = Path(args.workdir)
    src, out = work / f"{args.shape}-random", work / f"{args.shape}-nvfp4"
    info = make_in_child(src, args.shape, args.device)
    runs = []
    for mode in ("cold", "warm"):
        evicted = evict_page_cache(src) if mode == "cold" else False
        dt, log = timed(qerl_cmd(src, out, args.device))
        runs.append(
            {
                "mode": mode,
                "evicted": evicted,
                "seconds": round(dt, 2),
                "gb_per_s": round(info["bytes"] / 1e9 / dt, 2),
                "peak_rss_gb": round(PEAK_RSS_GB[0], 2),
            }
        )
    s = summary_of(out)
    return {
        "bench": "gpu",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "model": info,
        "runs": runs,
        "summary": {
            k: s[k]
            for k in (
                "size_before_bytes",
                "size_after_bytes",
                "bits_per_weight_quantized",
                "max_rel_error",
                "quantized_linears",
                "seconds",
            )
        },
        "command": " ".join(qerl_cmd(src, out, args.device)),
    }


_LLMC_SCRIPT = r"""
import sys, time, torch
t0 = time.perf_counter()
from transformers import AutoModelForCausalLM
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
src, out = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="NVFP4A16", ignore=["lm_head"]))
model.save_pretrained(out, save_compressed=True)
print("llmc_inner_s", time.perf_counter() - t0)
"""


def compare_outputs(a: Path, b: Path) -> dict:
    """Tensor-by-tensor comparison of two NVFP4 checkpoints (qerl vs llm-compressor)."""
    import torch
    from safetensors.torch import load_file

    def load(d):
        sd = {}
        for f in sorted(d.glob("*.safetensors")):
            sd.update(load_file(f))
        return sd

    x, y = load(a), load(b)
    keys = sorted(k for k in x if k.endswith(("weight_packed", "weight_scale", "weight_global_scale")))
    diff = [k for k in keys if k not in y or not torch.equal(x[k].view(torch.uint8), y[k].view(torch.uint8))]
    return {"compared": len(keys), "differ": len(diff), "first_differing": diff[:5]}


def bench_cpu(args) -> dict:
    work = Path(args.workdir)
    src, out = work / f"{args.shape}-random", work / f"{args.shape}-nvfp4"
    info = make_in_child(src, args.shape, "cpu")
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    dt, _ = timed(qerl_cmd(src, out, "cpu"), env=env)
    res = {
        "bench": "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "machine": machine(),
        "model": info,
        "qerl": {
            "peak_rss_gb": round(PEAK_RSS_GB[0], 2),
            "seconds": round(dt, 2),
            "params_per_s": round(info["params"] / dt),
            "command": " ".join(qerl_cmd(src, out, "cpu")),
        },
        "summary": summary_of(out),
    }
    if args.llmcompressor_python:
        lout = work / f"{args.shape}-llmc"
        script = work / "llmc_oneshot.py"
        script.write_text(_LLMC_SCRIPT)
        cmd = [args.llmcompressor_python, str(script), str(src), str(lout)]
        ver = (
            subprocess.run(
                [
                    args.llmcompressor_python,
                    "-c",
                    "import llmcompressor, compressed_tensors, transformers;"
                    "print(llmcompressor.__version__, compressed_tensors.__version__, transformers.__version__)",
                ],
                capture_output=True,
                text=True,
            )
            .stdout.strip()
            .splitlines()[-1:]
        )  # last line: loggers may print before it
        ver = ver[0] if ver else "?"
        try:
            ldt, _ = timed(cmd, env=env)
        except SystemExit as e:  # keep qerl's numbers; say why the comparison is missing
            res["llmcompressor_error"] = str(e)[-2000:]
            return res
        res["llmcompressor"] = {
            "peak_rss_gb": round(PEAK_RSS_GB[0], 2),
            "seconds": round(ldt, 2),
            "params_per_s": round(info["params"] / ldt),
            "versions": ver,
            "command": " ".join(cmd),
        }
        res["speedup"] = round(ldt / dt, 2)
        res["bit_identity_vs_llmcompressor"] = compare_outputs(out, lout)
    return res


def render(results: list[dict]) -> str:
    lines = ["## quantize", ""]
    for r in results:
        m = r["machine"]
        if r["bench"] == "gpu":
            s = r["summary"]
            lines += [
                f"### {r['model']['shape']}-shaped random bf16 checkpoint on {m.get('gpu', 'CPU')} ({r['date']})",
                "",
                f"{r['model']['params'] / 1e9:.2f} B params, {r['model']['bytes'] / 1e9:.1f} GB in 4 GB shards on local disk; "
                f"output {s['size_after_bytes'] / 1e9:.2f} GB, {s['bits_per_weight_quantized']} bits per quantized weight, "
                f"{s['quantized_linears']} Linears. End to end = process start to exit (reads, GPU quantize, "
                "writes, sha256 of outputs for the manifest).",
                "",
                "| source in page cache | wall time | source GB/s | peak RSS of the qerl process |",
                "| --- | ---: | ---: | ---: |",
            ]
            for run in r["runs"]:
                label = (
                    "no (evicted with posix_fadvise)"
                    if run["mode"] == "cold" and run["evicted"]
                    else run["mode"]
                )
                rss = f"{run['peak_rss_gb']} GB" if "peak_rss_gb" in run else "not measured"
                lines.append(
                    f"| {'yes' if run['mode'] == 'warm' else label} | {run['seconds']:.1f} s | {run['gb_per_s']} | {rss} |"
                )
            lines += ["", f"Command: `{r['command']}` (via `python benchmarks/bench_quantize.py gpu`).", ""]
        else:
            lines += [
                f"### {r['model']['shape']}-shaped random bf16 checkpoint on CPU ({m.get('cpu', '?')}, {m['cpus']} cores, "
                f"{r['date']})",
                "",
                "| tool | wall time | params/s | peak RSS |",
                "| --- | ---: | ---: | ---: |",
                f"| qerl quantize --device cpu | {r['qerl']['seconds']:.1f} s | {r['qerl']['params_per_s'] / 1e6:.1f} M | "
                f"{r['qerl'].get('peak_rss_gb', '?')} GB |",
            ]
            if "llmcompressor_error" in r:
                lines += ["", f"llm-compressor did not run: `{r['llmcompressor_error'].splitlines()[-1]}`"]
            if "llmcompressor" in r:
                lc = r["llmcompressor"]
                lines.append(
                    f"| llm-compressor oneshot NVFP4A16 ({lc['versions'].split()[0]}) | {lc['seconds']:.1f} s | "
                    f"{lc['params_per_s'] / 1e6:.1f} M | {lc.get('peak_rss_gb', '?')} GB |"
                )
                bi = r["bit_identity_vs_llmcompressor"]
                lines += [
                    "",
                    f"qerl is {r['speedup']}x faster. Output tensors compared byte for byte with "
                    f"llm-compressor's: {bi['compared']} compared, {bi['differ']} differ.",
                ]
            lines += [
                "",
                f"Command: `{r['qerl']['command']}` (via `python benchmarks/bench_quantize.py cpu`).",
                "",
            ]
    return "\n".join(lines).rstrip() + "\n"


def write_docs(paths: list[str]) -> None:
    results = [json.loads(Path(p).read_text()) for p in paths]
    section = render(results)
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n\n"
    start = text.find("## quantize\n")
    if start < 0:
        text = text.rstrip() + "\n\n" + section
    else:
        nxt = text.find("\n## ", start + 1)
        text = text[:start] + section + ("" if nxt < 0 else "\n" + text[nxt + 1 :])
    DOCS.parent.mkdir(parents=True, exist_ok=True)
    DOCS.write_text(text)
    print(section)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gpu", help="Qwen2.5-7B-shaped checkpoint, --device cuda")
    g.add_argument("--workdir", default="/tmp/qerl-bench")
    g.add_argument("--json", required=True)
    g.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
    g.add_argument("--device", default="cuda", help="cpu only to smoke-test this script")
    c = sub.add_parser("cpu", help="Qwen2.5-0.5B-shaped checkpoint, --device cpu (+ llm-compressor)")
    c.add_argument("--workdir", default="/tmp/qerl-bench-cpu")
    c.add_argument("--json", required=True)
    c.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    c.add_argument(
        "--llmcompressor-python", default=None, help="python of a venv with llmcompressor installed"
    )
    mk = sub.add_parser("make", help="only write a random checkpoint (used by gpu/cpu in a child process)")
    mk.add_argument("--out", required=True)
    mk.add_argument("--shape", required=True, choices=sorted(SHAPES))
    mk.add_argument("--device", default="cpu")
    w = sub.add_parser("write-docs", help="render result JSONs into docs/benchmarks.md '## quantize'")
    w.add_argument("results", nargs="+")
    args = ap.parse_args()
    if args.cmd == "write-docs":
        write_docs(args.results)
        return
    if args.cmd == "make":
        print(json.dumps(make_checkpoint(Path(args.out), args.shape, args.device)))
        return
    res = bench_gpu(args) if args.cmd == "gpu" else bench_cpu(args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(res, indent=2))
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
