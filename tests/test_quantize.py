"""`qerl quantize`: what it writes, how it streams, reruns, and how it refuses bad input."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from qerl_kernels import reference as R
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from qerl_cli.checkpoint import TensorReader, open_source, parse_linear
from qerl_cli.cli import app
from qerl_cli.errors import BadInputError, NumericalError, OutputExistsError
from qerl_cli.quantize import QuantizeConfig, parse_size, plan_units, quantize
from tests.helpers import make_tiny_hf_model

PROJS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def load_dir(d: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(d).glob("*.safetensors")):
        out.update(load_file(f))
    return out


def run(src, out, **kw) -> object:
    return quantize(QuantizeConfig(src=src, out=out, progress=False, device="cpu", **kw))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    """A sharded tiny Qwen2 whose down_proj in-features (40) is not a multiple of 16."""
    tmp = tmp_path_factory.mktemp("qwen")
    src = make_tiny_hf_model(tmp, "qwen2", intermediate=40, max_shard_size="40KB")
    res = run(src, tmp / "q")
    return src, tmp / "q", res


def test_tensors_layout_and_bits(qwen):
    src, q, res = qwen
    s, o = load_dir(src), load_dir(q)
    n_quant = 0
    for name, w in s.items():
        lin = parse_linear(name)
        if lin is not None and lin.proj != "down_proj":
            n_quant += 1
            m = lin.module
            assert name not in o
            assert o[f"{m}.weight_packed"].dtype == torch.uint8
            assert o[f"{m}.weight_packed"].shape == (w.shape[0], w.shape[1] // 2)
            assert o[f"{m}.weight_scale"].dtype == torch.float8_e4m3fn
            assert o[f"{m}.weight_scale"].shape == (w.shape[0], w.shape[1] // 16)
            assert o[f"{m}.weight_global_scale"].dtype == torch.float32
            assert o[f"{m}.weight_global_scale"].shape == (1,)
            packed, scale, _ = R.quantize(w, o[f"{m}.weight_global_scale"])
            assert torch.equal(packed, o[f"{m}.weight_packed"])
            assert torch.equal(scale.view(torch.uint8), o[f"{m}.weight_scale"].view(torch.uint8))
        else:  # embeddings, lm_head, norms, biases, the kept down_proj: byte-identical, source dtype
            assert o[name].dtype == w.dtype and torch.equal(o[name], w), name
    assert n_quant == 12 and res.summary["quantized_linears"] == 12
    assert res.summary["kept_linears"] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert 4.5 < res.summary["bits_per_weight_quantized"] < 4.6
    assert 0.05 < res.summary["max_rel_error"]["value"] < 0.2


def test_fused_siblings_share_one_global(qwen):
    src, q, _ = qwen
    s, o = load_dir(src), load_dir(q)
    for i in range(2):
        p = f"model.layers.{i}"
        qkv = [o[f"{p}.self_attn.{x}.weight_global_scale"] for x in ("q_proj", "k_proj", "v_proj")]
        own = [
            R.global_scale_for(s[f"{p}.self_attn.{x}.weight"].abs().amax())
            for x in ("q_proj", "k_proj", "v_proj")
        ]
        assert all(torch.equal(g, torch.min(torch.cat(own)).reshape(1)) for g in qkv)
        assert len({float(g) for g in own}) > 1  # the test would be vacuous if they were equal anyway
        gu = [o[f"{p}.mlp.{x}.weight_global_scale"] for x in ("gate_proj", "up_proj")]
        assert torch.equal(gu[0], gu[1])
        o_own = R.global_scale_for(s[f"{p}.self_attn.o_proj.weight"].abs().amax())
        assert torch.equal(o[f"{p}.self_attn.o_proj.weight_global_scale"], o_own)


def test_config_manifest_and_side_files(qwen):
    from compressed_tensors.quantization import QuantizationConfig

    src, q, res = qwen
    cfg = json.loads((q / "config.json").read_text())
    src_cfg = json.loads((src / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    assert cfg == src_cfg  # the rest of config.json is untouched
    QuantizationConfig.model_validate(qc)  # pydantic extra="forbid": no unknown keys
    assert qc["ignore"] == ["lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert qc["format"] == "nvfp4-pack-quantized"
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (q / f).read_bytes() == (src / f).read_bytes()
    index = (
        json.loads((q / "model.safetensors.index.json").read_text())
        if (q / "model.safetensors.index.json").exists()
        else None
    )
    assert index is None or set(index["weight_map"].values()) == {p.name for p in q.glob("*.safetensors")}
    m = json.loads((q / "manifest.json").read_text())
    assert m["stage"] == "quantize" and m["source"] == str(src.resolve())
    assert set(m["inputs"]) == {"src_model_hash", "src_config_sha256", "src_index_sha256", "src_text"}
    s = m["summary"]
    assert s["quantized_linears"] == 12 and s["kept_tensors"] == len(load_dir(src)) - 12
    assert s["size_after_bytes"] < s["size_before_bytes"] and s["seconds"] >= 0
    assert not list(q.parent.glob(".q.tmp-*"))


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_every_architecture_quantizes_all_seven_projections(tmp_path, arch):
    src = make_tiny_hf_model(tmp_path, arch, layers=2)
    res = run(src, tmp_path / "q")
    o = load_dir(tmp_path / "q")
    for i in range(2):
        for proj in PROJS:
            blk = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            assert f"model.layers.{i}.{blk}.{proj}.weight_packed" in o
    assert res.summary["quantized_linears"] == 14 and res.summary["kept_linears"] == []
    if arch == "qwen3":
        assert o["model.layers.0.self_attn.q_norm.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_fp16_and_fp32_sources(tmp_path, dtype):
    src = make_tiny_hf_model(tmp_path, "qwen2", dtype=dtype, init_std=0.05)
    run(src, tmp_path / "q")
    s, o = load_dir(src), load_dir(tmp_path / "q")
    assert o["model.embed_tokens.weight"].dtype == dtype
    w = s["model.layers.0.self_attn.o_proj.weight"]
    packed, scale, g = R.quantize(w)
    assert torch.equal(o["model.layers.0.self_attn.o_proj.weight_packed"], packed)
    assert torch.equal(o["model.layers.0.self_attn.o_proj.weight_global_scale"], g)


def test_an_all_zero_sibling_does_not_set_the_shared_global(tmp_path):
    # A pruned v_proj / up_proj: its own global is the 1.0 fallback (2688 / 0); as the minimum it pushed
    # q/k's and gate's block scales into fp8's subnormals. Left out, they keep their own accuracy.
    src = make_tiny_hf_model(tmp_path, "llama", hidden=64, init_std=0.003)
    sd = load_dir(src)
    for name in ("model.layers.0.self_attn.v_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        sd[name].zero_()
    for f in src.glob("*.safetensors"):
        f.unlink()
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    run(src, tmp_path / "q")
    o = load_dir(tmp_path / "q")
    p = "model.layers.0"
    want = torch.min(torch.cat([R.global_scale_for(sd[f"{p}.self_attn.{x}.weight"].abs().amax())
                                for x in ("q_proj", "k_proj")])).reshape(1)
    for x in ("q_proj", "k_proj", "v_proj"):
        assert torch.equal(o[f"{p}.self_attn.{x}.weight_global_scale"], want), x
    assert float(o[f"{p}.mlp.gate_proj.weight_global_scale"]) > 1000  # not the 1.0 fallback
    assert torch.equal(o[f"{p}.mlp.up_proj.weight_global_scale"], o[f"{p}.mlp.gate_proj.weight_global_scale"])
    for x in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "self_attn.v_proj", "mlp.up_proj"):
        w = sd[f"{p}.{x}.weight"].float()
        deq = R.dequantize(o[f"{p}.{x}.weight_packed"], o[f"{p}.{x}.weight_scale"], o[f"{p}.{x}.weight_global_scale"],
                           torch.float32)
        if w.abs().amax() == 0:
            assert not deq.any(), x
        else:
            assert float((deq - w).norm() / w.norm()) < 0.15, x


def test_fp16_global_overflow_uses_fp32_global(tmp_path):
    """fp16 weights with amax < 0.041: compressed-tensors' fp16 global overflows to 1.0; qerl does not."""
    src = make_tiny_hf_model(tmp_path, "qwen2", dtype=torch.float16, init_std=0.002)
    res = run(src, tmp_path / "q")
    assert res.summary["fp32_global_fallback"]
    assert res.summary["max_rel_error"]["value"] < 0.2


def test_output_shards_are_valid_safetensors(tmp_path):
    src = make_tiny_hf_model(tmp_path, "llama")
    run(src, tmp_path / "q", max_shard_size="20KB")
    q = tmp_path / "q"
    index = json.loads((q / "model.safetensors.index.json").read_text())
    shards = sorted(p.name for p in q.glob("*.safetensors"))
    assert len(shards) > 2 and set(index["weight_map"].values()) == set(shards)
    for shard in shards:
        with safe_open(q / shard, "pt") as f:
            for k in f.keys():
                assert index["weight_map"][k] == shard
                f.get_tensor(k)


def test_streams_each_tensor_once_in_file_order(tmp_path, monkeypatch):
    src = make_tiny_hf_model(tmp_path, "qwen2", max_shard_size="30KB")
    reads = []
    orig = TensorReader.get

    def spy(self, name):
        reads.append((self.infos[name].file.name, self.infos[name].start))
        return orig(self, name)

    monkeypatch.setattr(TensorReader, "get", spy)
    res = run(src, tmp_path / "q")
    assert len(reads) == len(set(reads)) == len(load_dir(src))  # every tensor read exactly once
    source = open_source(src)
    units, _ = plan_units(source)
    expected = [(source.tensors[n].file.name, source.tensors[n].start) for u in units for n in u.names()]
    assert reads == expected
    # units are visited in file order (shard, offset) of their first tensor: sequential disk reads
    shard_pos = {p.name: i for i, p in enumerate(source.shard_files)}
    pos = {n: (shard_pos[i.file.name], i.start) for n, i in source.tensors.items()}
    firsts = [min(pos[n] for n in u.names()) for u in units]
    assert firsts == sorted(firsts)
    assert any(len(u.quant) == 3 for u in units) and any(len(u.quant) == 2 for u in units)
    assert res.summary["quantized_linears"] == 14


def test_at_most_three_units_of_source_tensors_alive(tmp_path, monkeypatch):
    """Streaming bound: source tensors are freed as soon as their unit is written."""
    import weakref

    src = make_tiny_hf_model(tmp_path, "qwen2", layers=4, hidden=64, intermediate=128)
    alive: dict[str, int] = {}
    peak = [0]
    orig = TensorReader.get

    def tracked(self, name):
        t = orig(self, name)
        alive[name] = t.numel() * t.element_size()
        weakref.finalize(t, alive.pop, name, None)
        peak[0] = max(peak[0], sum(alive.values()))
        return t

    monkeypatch.setattr(TensorReader, "get", tracked)
    run(src, tmp_path / "q")
    source = open_source(src)
    units, _ = plan_units(source)
    unit_bytes = sorted(sum(source.tensors[n].nbytes for n in u.names()) for u in units)
    assert not alive
    assert peak[0] <= sum(unit_bytes[-3:]) < source.total_bytes / 2


def test_rerun_is_already_done_and_force_redoes(tmp_path):
    src = make_tiny_hf_model(tmp_path, "qwen2")
    first = run(src, tmp_path / "q")
    assert not first.already_done
    again = run(src, tmp_path / "q")
    assert again.already_done and again.summary == first.summary
    forced = run(src, tmp_path / "q", force=True)
    assert not forced.already_done
    # deterministic: the redone output is byte-identical, file by file
    assert forced.manifest["outputs"] == first.manifest["outputs"]
    assert (
        json.loads((tmp_path / "q" / "manifest.json").read_text())["fingerprint"]
        == forced.manifest["fingerprint"]
    )
    with pytest.raises(OutputExistsError):
        run(src, tmp_path / "q", format="modelopt")


def test_rerun_after_the_source_tokenizer_or_generation_config_changed_is_not_done(tmp_path):
    src = make_tiny_hf_model(tmp_path, "qwen2")
    run(src, tmp_path / "q")
    gen = json.loads((src / "generation_config.json").read_text())
    gen["eos_token_id"] = [2, 7]
    (src / "generation_config.json").write_text(json.dumps(gen))
    with pytest.raises(OutputExistsError, match="different inputs"):
        run(src, tmp_path / "q")
    assert not run(src, tmp_path / "q", force=True).already_done
    assert json.loads((tmp_path / "q" / "generation_config.json").read_text())["eos_token_id"] == [2, 7]
    assert run(src, tmp_path / "q").already_done



def test_named_chat_templates_are_copied_and_a_changed_one_is_not_done(tmp_path):
    # transformers saves a tokenizer's named templates ("tool_use") in additional_chat_templates/*.jinja;
    # quantize and merge copied top-level files only, so QDIR and the merged checkpoint lost them silently
    # (AutoTokenizer then read chat_template as one string; apply_chat_template(chat_template="tool_use")
    # returned the text "tool_use").
    from transformers import AutoTokenizer

    from qerl_cli.checkpoint import open_source
    from qerl_cli.merge import write_plain_config

    src = make_tiny_hf_model(tmp_path, "qwen2")
    (src / "additional_chat_templates").mkdir()
    (src / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS {{ messages[0]['content'] }}")
    q = tmp_path / "q"
    run(src, q)
    assert (q / "additional_chat_templates" / "tool_use.jinja").read_text() == "TOOLS {{ messages[0]['content'] }}"
    tok = AutoTokenizer.from_pretrained(q)
    assert isinstance(tok.chat_template, dict) and "tool_use" in tok.chat_template
    (src / "additional_chat_templates" / "tool_use.jinja").write_text("TOOLS2 {{ messages[0]['content'] }}")
    with pytest.raises(OutputExistsError, match="different inputs"):
        run(src, q)
    assert not run(src, q, force=True).already_done
    assert (q / "additional_chat_templates" / "tool_use.jinja").read_text().startswith("TOOLS2")
    merged = tmp_path / "m"
    merged.mkdir()
    write_plain_config(open_source(q), merged)  # what `qerl merge` writes beside the weights
    assert (merged / "additional_chat_templates" / "tool_use.jinja").read_text().startswith("TOOLS2")

def test_modelopt_format(tmp_path):
    src = make_tiny_hf_model(tmp_path, "qwen2", intermediate=40)
    run(src, tmp_path / "ct")
    run(src, tmp_path / "mo", format="modelopt")
    ct, mo = load_dir(tmp_path / "ct"), load_dir(tmp_path / "mo")
    m = "model.layers.1.mlp.gate_proj"
    assert torch.equal(mo[f"{m}.weight"], ct[f"{m}.weight_packed"])  # same packed bytes
    assert torch.equal(mo[f"{m}.weight_scale"].view(torch.uint8), ct[f"{m}.weight_scale"].view(torch.uint8))
    s2 = mo[f"{m}.weight_scale_2"]
    assert s2.shape == () and s2.dtype == torch.float32
    assert torch.equal(s2, 1.0 / ct[f"{m}.weight_global_scale"][0])  # a multiplier, not a divisor
    n = mo[f"{m}.weight"].shape[0]
    deq_mo = R.decode_codes(R.unpack_codes(mo[f"{m}.weight"])).view(n, -1, 16) * (
        mo[f"{m}.weight_scale"].float().unsqueeze(-1) * s2
    )
    deq_ct = R.dequantize(
        ct[f"{m}.weight_packed"], ct[f"{m}.weight_scale"], ct[f"{m}.weight_global_scale"], torch.float32
    )
    torch.testing.assert_close(deq_mo.reshape(n, -1), deq_ct, rtol=2e-7, atol=0)
    hq = json.loads((tmp_path / "mo" / "hf_quant_config.json").read_text())
    assert hq["quantization"]["quant_algo"] == "NVFP4" and hq["quantization"]["group_size"] == 16
    assert "model.layers.0.mlp.down_proj" in hq["quantization"]["exclude_modules"]
    assert "quantization_config" not in json.loads((tmp_path / "mo" / "config.json").read_text())


def test_parse_size():
    assert parse_size("5GB") == 5_000_000_000 and parse_size("64KiB") == 65536 and parse_size(7) == 7
    with pytest.raises(BadInputError):
        parse_size("lots")


# ---- bad input: one line, exit code, nothing written ------------------------------------------
def _break(kind: str, tmp: Path) -> Path:
    if kind == "missing":
        return tmp / "nope"
    if kind == "file":
        p = tmp / "file.txt"
        p.write_text("x")
        return p
    src = make_tiny_hf_model(
        tmp, "qwen2", max_shard_size="40KB" if kind in ("missing_shard", "missing_tensor") else None
    )
    if kind == "no_config":
        (src / "config.json").unlink()
    elif kind == "pickle_only":
        for p in src.glob("*.safetensors"):
            p.unlink()
        (src / "pytorch_model.bin").write_bytes(pickle.dumps({"a": 1}))
    elif kind == "no_weights":
        for p in src.glob("*.safetensors"):
            p.unlink()
    elif kind == "missing_shard":
        sorted(src.glob("model-*.safetensors"))[1].unlink()
    elif kind == "missing_tensor":
        idx = json.loads((src / "model.safetensors.index.json").read_text())
        idx["weight_map"]["model.layers.9.mlp.up_proj.weight"] = next(iter(idx["weight_map"].values()))
        (src / "model.safetensors.index.json").write_text(json.dumps(idx))
    elif kind in ("dropped_tensor", "foreign_tensor"):  # wrote an unloadable checkpoint with exit 0 (a review)
        f = src / "model.safetensors"
        sd = load_file(f)
        if kind == "dropped_tensor":
            del sd["model.layers.0.self_attn.q_proj.weight"]
        else:
            sd["model.layers.5.mlp.up_proj.weight"] = sd["model.layers.1.mlp.up_proj.weight"].clone()
        save_file(sd, f, metadata={"format": "pt"})
    elif kind in ("nan", "inf"):
        f = src / "model.safetensors"
        sd = load_file(f)
        sd["model.layers.1.mlp.up_proj.weight"][3, 5] = float("nan") if kind == "nan" else float("inf")
        save_file(sd, f, metadata={"format": "pt"})
    elif kind == "truncated":
        f = src / "model.safetensors"
        f.write_bytes(f.read_bytes()[:-100])
    elif kind == "unsupported_arch":
        cfg = json.loads((src / "config.json").read_text())
        cfg["model_type"] = "gpt2"
        (src / "config.json").write_text(json.dumps(cfg))
    elif kind == "quantized":
        q = tmp / "q0"
        run(src, q)
        return q
    return src


BAD = {
    "missing": (2, "does not exist"),
    "file": (2, "not a directory"),
    "no_config": (2, "no config.json"),
    "pickle_only": (2, "never unpickles"),
    "no_weights": (2, "no *.safetensors"),
    "missing_shard": (2, "names shard"),
    "missing_tensor": (2, "model.layers.9.mlp.up_proj.weight"),
    "dropped_tensor": (2, "lacks tensor 'model.layers.0.self_attn.q_proj.weight'"),
    "foreign_tensor": (2, "unexpected tensor 'model.layers.5.mlp.up_proj.weight'"),
    "nan": (5, "model.layers.1.mlp.up_proj.weight"),
    "inf": (5, "model.layers.1.mlp.up_proj.weight"),
    "truncated": (2, "model.safetensors"),
    "unsupported_arch": (2, "gpt2"),
    "quantized": (2, "already quantized"),
}


@pytest.mark.parametrize("kind", sorted(BAD))
def test_bad_input_one_line_nothing_written(tmp_path, kind, monkeypatch):
    src = _break(kind, tmp_path)
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("unpickled a file"))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load called"))
    out = tmp_path / "out"
    r = CliRunner().invoke(app, ["quantize", str(src), "--out", str(out), "--device", "cpu", "--no-progress"])
    code, needle = BAD[kind]
    assert r.exit_code == code, r.output
    err = r.stderr.strip()
    assert err.startswith("error: ") and "\n" not in err and needle in err, err
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_nan_is_named_and_library_raises_numerical_error(tmp_path):
    src = _break("nan", tmp_path)
    with pytest.raises(NumericalError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        run(src, tmp_path / "out")


def test_output_exists_without_force(tmp_path):
    src = make_tiny_hf_model(tmp_path, "qwen2")
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    for extra in ([], ["--force"]):  # a directory that is not a qerl output is never replaced
        r = CliRunner().invoke(app, ["quantize", str(src), "--out", str(out), "--no-progress", *extra])
        assert r.exit_code == 4 and "no valid qerl manifest" in r.stderr
        assert (out / "precious.txt").read_text() == "keep me"
    other = tmp_path / "other"
    r = CliRunner().invoke(
        app, ["quantize", str(src), "--out", str(other), "--no-progress", "--format", "modelopt"]
    )
    assert r.exit_code == 0
    r = CliRunner().invoke(app, ["quantize", str(src), "--out", str(other), "--no-progress"])
    assert r.exit_code == 4 and "--force" in r.stderr and (other / "hf_quant_config.json").exists()
    r = CliRunner().invoke(app, ["quantize", str(src), "--out", str(other), "--no-progress", "--force"])
    assert r.exit_code == 0 and not (other / "hf_quant_config.json").exists()


def test_cli_end_to_end_and_already_done(tmp_path):
    src = make_tiny_hf_model(tmp_path, "qwen2", intermediate=40)
    out = tmp_path / "q"
    r = CliRunner().invoke(app, ["quantize", str(src), "--out", str(out), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert "largest per-layer relative error" in r.stderr and "down_proj" in r.stderr
    assert "tensors" in r.stderr and "/s" in r.stderr  # the progress bar: tensor count and throughput
    r = CliRunner().invoke(app, ["quantize", str(src), "--out", str(out), "--device", "cpu"])
    assert r.exit_code == 0 and "already done" in r.stdout
    r = CliRunner().invoke(app, ["quantize", str(src), "--out", str(tmp_path / "q2"), "--device", "cpu", "-q"])
    assert r.exit_code == 0 and r.stderr == "" and r.stdout.strip() == f"wrote {tmp_path / 'q2'}"  # -q as elsewhere


def test_cli_rejects_bad_flags(tmp_path):
    src = make_tiny_hf_model(tmp_path, "qwen2")
    for flags, needle in ((["--format", "gguf"], "--format"), (["--device", "tpu"], "--device")):
        r = CliRunner().invoke(app, ["quantize", str(src), "--out", str(tmp_path / "o"), *flags])
        assert r.exit_code == 2 and needle in r.stderr
    if not torch.cuda.is_available():
        r = CliRunner().invoke(app, ["quantize", str(src), "--out", str(tmp_path / "o"), "--device", "cuda"])
        assert r.exit_code == 2 and "CUDA" in r.stderr
        # cuda:N as every other stage takes it (a recipe passes one DEVICE to all; it was "not one of ...")
        r = CliRunner().invoke(app, ["quantize", str(src), "--out", str(tmp_path / "o"), "--device", "cuda:1"])
        assert r.exit_code == 2 and "--device cuda:1: no CUDA device is visible" in r.stderr
    assert not (tmp_path / "o").exists()


def test_help_explains_every_flag():
    r = CliRunner().invoke(app, ["quantize", "--help"], env={"COLUMNS": "200", "TERM": "dumb"})
    assert r.exit_code == 0
    for flag in ("--out", "--format", "--device", "--max-shard-size", "--force", "--progress"):
        assert flag in r.output
    assert "Example" in r.output and "qerl quantize" in r.output


def test_no_thread_or_file_handle_leak_on_failure(tmp_path):
    src = _break("nan", tmp_path)
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    for _ in range(3):
        with pytest.raises(NumericalError):
            run(src, tmp_path / "out")
    after = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    assert after <= before


def test_row_blocks_give_the_same_bytes_as_one_call():
    from qerl_cli.quantize import _quantize_in_row_blocks

    w = (torch.randn(600, 8192, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    g = R.global_scale_for(w.abs().amax())
    packed, scale, err = _quantize_in_row_blocks(w, g)  # 512-row blocks on CPU: two of them
    p, s, _ = R.quantize(w, g)
    assert torch.equal(packed, p) and torch.equal(scale.view(torch.uint8), s.view(torch.uint8))
    d = R.dequantize(p, s, g, torch.float32)
    assert abs(err - float((d - w.float()).norm() / w.float().norm())) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_error_of_a_weight_near_the_dtype_max_is_not_reported_as_zero(dtype):
    from qerl_cli.quantize import _quantize_in_row_blocks

    torch.manual_seed(0)
    w = torch.randn(64, 128)
    w = (w / w.abs().max() * 3e38).to(dtype)  # amax > 2^127: the norms' power-of-two scale was inf in fp32
    g = R.global_scale_for(w.abs().amax())
    packed, scale, err = _quantize_in_row_blocks(w, g)
    deq = R.dequantize(packed, scale, g, dtype=torch.float64)
    true = float((deq - w.double()).norm() / w.double().norm())
    assert 0.05 < true < 0.2
    assert err == pytest.approx(true, rel=1e-3)


@pytest.mark.gpu
def test_cuda_and_cpu_write_identical_files(tmp_path):
    src = make_tiny_hf_model(tmp_path, "qwen2", intermediate=40)
    a = quantize(QuantizeConfig(src=src, out=tmp_path / "cpu", device="cpu", progress=False))
    b = quantize(QuantizeConfig(src=src, out=tmp_path / "cuda", device="cuda", progress=False))
    assert b.summary["device"].startswith("cuda")
    assert a.manifest["outputs"] == b.manifest["outputs"]


def test_mistral_consolidated_weights_are_ignored(tmp_path):
    src = make_tiny_hf_model(tmp_path, "mistral")
    save_file(
        {"layers.0.attention.wq.weight": torch.zeros(64, 64, dtype=torch.bfloat16)},
        src / "consolidated.safetensors",
    )
    run(src, tmp_path / "q")
    out = load_dir(tmp_path / "q")
    assert (
        not any(k.startswith("layers.") for k in out)
        and not (tmp_path / "q" / "consolidated.safetensors").exists()
    )
    from qerl_cli.models.loader import load_model

    load_model(src)  # the 16-bit baseline reads the directory quantize read (it had refused its wq)


def test_a_checkpoint_with_a_quantized_lm_head_is_refused_by_name(tmp_path):
    from qerl_cli.models.loader import load_model

    src = make_tiny_hf_model(tmp_path, "qwen2")
    run(src, tmp_path / "q")
    f = tmp_path / "q" / "model.safetensors"
    t = load_file(f)
    packed, scale, glob = R.quantize(t.pop("lm_head.weight"))
    t.update({"lm_head.weight_packed": packed, "lm_head.weight_scale": scale, "lm_head.weight_global_scale": glob})
    save_file(t, f)
    with pytest.raises(BadInputError, match="lm_head is NVFP4-quantized"):
        load_model(tmp_path / "q")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_layer_too_small_for_any_global_is_reported_as_lost_not_as_exact(tmp_path, dtype):
    # amax ~1e-36: 2688 / amax overflows even in fp32, so the global stays compressed-tensors' 1.0 and
    # the layer dequantizes to zeros. The summary listed an fp32 global that was never used, and the
    # fp32 norms underflowed to a 0% error (audit 2026-11-26).
    m = "model.layers.0.self_attn.o_proj"
    src = make_tiny_hf_model(tmp_path, "llama", dtype=dtype, tokenizer=False)
    sd = load_file(src / "model.safetensors")
    sd[m + ".weight"] = (sd[m + ".weight"].double() * 1e-36 / 0.02).to(dtype)
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    res = quantize(QuantizeConfig(src=src, out=tmp_path / "q", device="cpu", progress=False))
    out = load_file(tmp_path / "q" / "model.safetensors")
    assert out[m + ".weight_global_scale"].item() == 1.0
    assert m not in res.summary["fp32_global_fallback"]
    deq = R.dequantize(out[m + ".weight_packed"], out[m + ".weight_scale"], out[m + ".weight_global_scale"], torch.float32)
    assert not deq.any()
    assert res.summary["per_layer_max_rel_error"]["0"] == pytest.approx(1.0)


def test_a_model_with_nothing_to_quantize_is_refused(tmp_path):
    # hidden 56, intermediate 40: no Linear has in-features divisible by 16; the output was a dense copy
    # labelled NVFP4, every Linear in `ignore`, without a word (audit 2026-11-26).
    src = make_tiny_hf_model(tmp_path, "qwen2", hidden=56, intermediate=40, heads=7, kv_heads=1, tokenizer=False)
    with pytest.raises(BadInputError, match="no decoder Linear can be quantized"):
        quantize(QuantizeConfig(src=src, out=tmp_path / "q", device="cpu", progress=False))
    assert not (tmp_path / "q").exists()


def test_the_library_leaves_the_process_malloc_alone_and_the_cli_tunes_it(tmp_path, monkeypatch):
    # glibc's fixed mmap threshold returns freed tensors to the OS at once, but for the whole process and
    # for good (a later train step 1.6x slower in the same process): only the CLI, whose process ends, sets it.
    import qerl_cli.quantize as qz

    calls = []
    monkeypatch.setattr(qz, "return_freed_memory_to_os", lambda: calls.append(1))
    src = make_tiny_hf_model(tmp_path, "qwen2")
    run(src, tmp_path / "lib")
    assert calls == []
    r = CliRunner().invoke(app, ["quantize", str(src), "--out", str(tmp_path / "cli"), "--no-progress"])
    assert r.exit_code == 0 and calls == [1]


def test_a_null_quantization_config_is_a_plain_model(tmp_path):
    src = make_tiny_hf_model(tmp_path, "qwen2")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = None  # transformers and qerl's loader read this as unquantized
    (src / "config.json").write_text(json.dumps(cfg))
    run(src, tmp_path / "q")
    out_cfg = json.loads((tmp_path / "q" / "config.json").read_text())
    assert out_cfg["quantization_config"]["format"] == "nvfp4-pack-quantized"
    run(src, tmp_path / "m", format="modelopt")
    assert "quantization_config" not in json.loads((tmp_path / "m" / "config.json").read_text())


def _as_written_before_src_text(out: Path) -> None:
    """Rewrite ``out``'s manifest as qerl before 2026-11-27 wrote it: no src_text input in the fingerprint."""
    from qerl_cli.hashing import sha256_json

    m = json.loads((out / "manifest.json").read_text())
    m["inputs"].pop("src_text")
    m["fingerprint"] = sha256_json({"stage": "quantize", "config": m["config"], "inputs": m["inputs"]})
    (out / "manifest.json").write_text(json.dumps(m))


def test_an_older_output_is_done_only_while_its_copied_text_files_match_the_source(tmp_path):
    # Outputs written before src_text was counted stayed 'already done' whatever the source's text files
    # became: the stale generation_config.json (its eos) was kept, the case the src_text input was added for.
    src = make_tiny_hf_model(tmp_path, "qwen2")
    run(src, tmp_path / "q")
    _as_written_before_src_text(tmp_path / "q")
    assert run(src, tmp_path / "q").already_done  # unchanged source: still done
    gen = json.loads((src / "generation_config.json").read_text())
    (src / "generation_config.json").write_text(json.dumps(dict(gen, eos_token_id=[2, 7])))
    with pytest.raises(OutputExistsError, match="input src_text changed"):
        run(src, tmp_path / "q")


def test_other_frameworks_weights_and_shard_indexes_are_not_copied(tmp_path):
    """A hub snapshot's TF/Flax/GGUF weights and pytorch_model.bin.index.json are the source's dense
    weights: they do not belong in the NVFP4 directory (they were copied, and left out of "size after")."""
    src = make_tiny_hf_model(tmp_path, arch="llama", hidden=32, layers=1, tokenizer=False)
    extra = ["tf_model.h5", "flax_model.msgpack", "model-f16.gguf", "model.onnx", "pytorch_model.bin.index.json"]
    for name in extra:
        (src / name).write_bytes(b"{}")
    (src / "README.md").write_text("kept\n")
    res = quantize(QuantizeConfig(src=src, out=tmp_path / "q", device="cpu", progress=False))
    for name in extra:
        assert not (tmp_path / "q" / name).exists() and name not in res.summary["copied_files"], name
    assert (tmp_path / "q" / "README.md").exists()


@pytest.mark.parametrize("stale", ["single", "index"])
def test_a_directory_with_two_checkpoints_is_refused(tmp_path, stale):
    """save_pretrained into a used directory leaves the other layout behind: transformers then loads
    model.safetensors and vLLM the index's shards; quantize silently took the shards (or, for a stale
    index, named a missing shard) instead of saying the source is ambiguous."""
    import transformers

    src = make_tiny_hf_model(tmp_path, arch="llama", hidden=32, layers=1, tokenizer=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(src)
    if stale == "single":
        model.save_pretrained(src, max_shard_size="20KB")  # model.safetensors stays beside the new shards
    else:
        model.save_pretrained(src, max_shard_size="20KB")
        for p in src.glob("model-*.safetensors"):
            p.unlink()
        model.save_pretrained(src)  # the index stays, naming deleted shards
    assert (src / "model.safetensors").is_file() and (src / "model.safetensors.index.json").is_file()
    with pytest.raises(BadInputError, match="two checkpoints"):
        quantize(QuantizeConfig(src=src, out=tmp_path / "q", device="cpu", progress=False))
    assert not (tmp_path / "q").exists()
