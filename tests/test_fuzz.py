"""Fuzzing with Hypothesis: shard reader/writer, flag and config parsing, NVFP4 quantize/dequantize.

Properties, not examples: whatever the input, a parser either returns a valid value or raises
``BadInputError`` (never another exception, which the CLI would print as a traceback); the
shard writer and reader are inverse; NVFP4 round trips stay within half an E2M1 step of the block
scale and never produce NaN/Inf, for subnormals, signed zeros and huge values too; packing codes
is a bijection. Example counts are kept modest for CI.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from qerl_kernels import reference as R

from qerl_cli.errors import BadInputError

FAST = settings(max_examples=60, deadline=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# ---- shards ----------------------------------------------------------------------------------------
finite = st.floats(allow_nan=False, allow_infinity=False, width=64)
logprob = st.floats(max_value=0.0, allow_nan=False, allow_infinity=False, width=64)  # at most 0: shards refuse above
reward = st.floats(-1e15, 1e15, allow_nan=False, width=64)  # shards refuse rewards beyond (REWARD_LIMIT)
token = st.integers(0, 2**31 - 1)
text = st.text(max_size=30)  # any unicode: newlines, quotes, NUL, surrogates


@st.composite
def groups_of_records(draw):
    from qerl_cli.shards import make_record

    n_groups = draw(st.integers(1, 4))
    G = draw(st.integers(1, 3))
    recs = []
    for g in range(n_groups):
        prompt = draw(st.one_of(text, st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                                       "content": text}), max_size=2)))
        for _ in range(G):
            n = draw(st.integers(0, 5))
            recs.append(make_record(
                prompt_id=draw(text), group_id=f"g{g}", prompt=prompt,
                prompt_token_ids=draw(st.lists(token, max_size=5)), completion_token_ids=draw(
                    st.lists(token, min_size=n, max_size=n)),
                completion=draw(text), logprobs=draw(st.lists(logprob, min_size=n, max_size=n)),
                finish_reason=draw(st.sampled_from(["stop", "length"])),
                rewards=draw(st.dictionaries(st.text(min_size=1, max_size=6), finite, max_size=3)),
                reward=draw(reward), answer=draw(st.one_of(st.none(), text)), step=draw(st.integers(0, 10**6)),
                policy={"base": draw(st.text("0123456789abcdef", min_size=64, max_size=64)),
                        "adapter": draw(st.one_of(st.none(), st.text("0123456789abcdef", min_size=64, max_size=64)))},
                sampling={"temperature": draw(st.floats(0, 2)), "top_p": 1.0, "top_k": 0, "seed": draw(token)},
                noise={"sigma": draw(st.floats(0, 1)), "seed": 0, "step": 0}, engine=draw(text)))
    return recs, G


@FAST
@given(data=groups_of_records(), cut=st.floats(0, 1))
def test_shard_round_trip_and_torn_tail(tmp_path_factory, data, cut):
    from qerl_cli.shards import ReadReport, load_complete_groups, read_records, write_records

    recs, G = data
    d = tmp_path_factory.mktemp("shard")
    path = d / "shard-00000-of-00001.jsonl"
    assert write_records(path, recs) == len(recs)
    assert read_records(d) == recs
    # Cut the file anywhere (a crash mid-append): resume keeps only whole groups, in order.
    raw = path.read_bytes()
    path.write_bytes(raw[: int(len(raw) * cut)])
    groups, _ = load_complete_groups(path, G)
    kept = [r for g in groups.values() for r in g]
    assert kept == recs[: len(kept)] and len(kept) % G == 0
    report = ReadReport()
    assert read_records(path, report=report) == kept and report.bad_lines == []


@FAST
@given(lines=st.lists(st.one_of(st.binary(max_size=40), st.text(max_size=40).map(str.encode),
                                st.dictionaries(st.text(max_size=8), st.one_of(st.none(), st.integers(), text, finite),
                                                max_size=6).map(lambda d: json.dumps(d).encode())),
                      min_size=1, max_size=6))
def test_shard_reader_on_garbage_only_raises_bad_input_with_file_line(tmp_path_factory, lines):
    from qerl_cli.shards import ReadReport, read_records

    d = tmp_path_factory.mktemp("garbage")
    path = d / "shard-00000-of-00001.jsonl"
    path.write_bytes(b"\n".join(ln.replace(b"\n", b" ") for ln in lines) + b"\n")
    try:
        read_records(path)
    except BadInputError as e:
        assert f"{path}:" in str(e) or "no " in str(e)
    report = ReadReport()
    good = read_records(path, skip_bad_lines=True, report=report)
    assert len(good) + len(report.bad_lines) == sum(1 for ln in path.read_bytes().split(b"\n")[:-1] if ln.strip())


@FAST
@given(rec=st.dictionaries(st.sampled_from(["schema_version", "prompt_id", "group_id", "logprobs", "reward", "policy",
                                            "completion_token_ids", "finish_reason", "step", "x"]),
                           st.recursive(st.none() | st.booleans() | st.integers() | finite | text,
                                        lambda c: st.lists(c, max_size=3) | st.dictionaries(text, c, max_size=3),
                                        max_leaves=6)))
def test_validate_record_never_raises(rec):
    from qerl_cli.shards import validate_record

    assert validate_record(rec) is None or isinstance(validate_record(rec), str)


# ---- prompt files ------------------------------------------------------------------------------------
@FAST
@given(rows=st.lists(st.one_of(
    st.fixed_dictionaries({"prompt": text}, optional={"answer": st.one_of(text, st.integers(), finite, st.none()),
                                                     "id": st.one_of(text, st.integers())}),
    st.dictionaries(st.sampled_from(["messages", "question", "problem", "answer", "solution", "id"]),
                    st.one_of(text, st.integers(), st.none(), st.lists(st.dictionaries(text, text, max_size=2),
                                                                         max_size=2)), max_size=4),
    st.text(max_size=20)), max_size=6))
def test_prompt_loader_returns_rows_or_bad_input(tmp_path_factory, rows):
    from qerl_cli.data import load_prompts

    path = tmp_path_factory.mktemp("p") / "p.jsonl"
    path.write_text("".join((json.dumps(r) if not isinstance(r, str) else r.replace("\n", " ")) + "\n" for r in rows))
    try:
        out = load_prompts(path)
    except BadInputError as e:
        assert str(path) in str(e)
        bad: list[str] = []
        try:
            out = load_prompts(path, skip_bad_lines=True, bad_lines=bad)
        except BadInputError:
            return
        assert bad
    assert all((r.prompt is None) != (r.messages is None) for r in out)
    assert len({r.id for r in out}) == len(out)


# ---- flag parsing ------------------------------------------------------------------------------------
@FAST
@given(specs=st.lists(st.tuples(st.sampled_from(["gsm8k", "math", "format"]),
                                st.one_of(st.none(), st.floats(-2.0 ** 49, 2.0 ** 49, width=32))),  # within +-1e15
                      min_size=1, max_size=3, unique_by=lambda t: t[0]),
       joined=st.booleans())
def test_reward_specs_parse_names_and_weights(specs, joined):
    from qerl_cli.rewards import parse_reward_specs

    strs = [n if w is None else f"{n}={w!r}" for n, w in specs]
    parsed = parse_reward_specs([",".join(strs)] if joined else strs)
    assert [(s.name, s.weight) for s in parsed] == [(n, 1.0 if w is None else float(repr(w))) for n, w in specs]


@FAST
@given(spec=st.text(max_size=30))
def test_reward_spec_garbage_is_bad_input_and_imports_nothing(spec):
    import sys

    from qerl_cli.rewards import parse_reward_specs

    assume(":" not in spec)  # module:function names are imports by design (tested in test_reliability)
    before = set(sys.modules)
    try:
        parse_reward_specs([spec])
    except BadInputError:
        pass
    assert set(sys.modules) == before


@FAST
@given(n=st.integers(0, 10**6), unit=st.sampled_from(["", "B", "KB", "MB", "GB", "KiB", "MiB", "gb", "k"]),
       space=st.sampled_from(["", " "]))
def test_parse_size_valid(n, unit, space):
    from qerl_cli.quantize import parse_size

    base = 1024 if "i" in unit else 1000
    mult = {"": 1, "B": 1, "K": base, "M": base**2, "G": base**3}[unit[:1].upper() if unit[:1].upper() in "KMG" else ""]
    assert parse_size(f"{n}{space}{unit}") == n * mult


@FAST
@given(s=st.text(max_size=12))
def test_parse_size_garbage(s):
    from qerl_cli.quantize import parse_size

    try:
        v = parse_size(s)
    except BadInputError as e:
        assert "--max-shard-size" in str(e)
    else:
        assert isinstance(v, int) and v >= 0


@FAST
@given(targets=st.lists(st.sampled_from(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                         "down_proj"]), min_size=1, max_size=7, unique=True),
       sep=st.sampled_from([",", ", ", " ,"]))
def test_lora_targets_flag_parses(targets, sep):
    """--lora-targets 'a, b' reaches TrainStepConfig as exactly the named targets."""
    import qerl_cli.train_step as ts
    from tests.reliability_fixtures import invoke

    seen = {}

    def capture(cfg):
        seen["targets"] = cfg.lora_targets

    orig = ts.train_step
    ts.train_step = capture
    try:
        r = invoke(["train-step", "--model", "m", "--shards", "s", "--out", "o", "--lora-targets",
                    sep.join(targets)])
    finally:
        ts.train_step = orig
    assert r.exit_code == 0, r.output
    assert seen["targets"] == tuple(targets)


# ---- NVFP4 reference ----------------------------------------------------------------------------------
def _half_step(m: torch.Tensor) -> torch.Tensor:
    """Half the gap between neighbouring E2M1 magnitudes around |x|/denom = m."""
    return torch.where(m <= 2, 0.25, torch.where(m <= 4, 0.5, 1.0))


special = st.sampled_from([0.0, -0.0, 1e-45, -1e-45, 1.4e-45, 1e-40, -3e-39, 1.17549435e-38, 3.4e38, -3.4e38, 1e30,
                           6.0, -448.0, 0.25, 0.75])
# Mostly weight-like values (every E2M1 bucket gets hit), plus any float32 and the special ones.
values = st.one_of(st.floats(-1, 1, width=32), st.floats(-1, 1, width=32),
                   st.floats(allow_nan=False, allow_infinity=False, width=32), special)


@settings(max_examples=100, deadline=None)
@given(rows=st.integers(1, 4), groups=st.integers(1, 4), data=st.data(), dtype=st.sampled_from(
    [torch.float32, torch.bfloat16, torch.float16]))
def test_nvfp4_round_trip_error_bound(rows, groups, data, dtype):
    k = groups * 16
    flat = data.draw(st.lists(values, min_size=rows * k, max_size=rows * k))
    # Mix magnitudes: each block scaled by its own power of two (tiny blocks next to huge ones,
    # down into the subnormals, up to near the dtype's max).
    exps = data.draw(st.lists(st.integers(-140, 120), min_size=groups, max_size=groups))
    w = torch.tensor(flat, dtype=torch.float64).reshape(rows, groups, 16)
    w = (w * torch.tensor([2.0**e for e in exps], dtype=torch.float64).reshape(1, groups, 1)).reshape(rows, k)
    w = w.clamp(-3.0e38, 3.0e38).to(dtype)
    assume(bool(torch.isfinite(w).all()))  # values that overflow the dtype are refused by quantize
    packed, scale, g = R.quantize(w)
    deq = R.dequantize(packed, scale, g, dtype=torch.float32)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, k // 2)
    assert scale.dtype == torch.float8_e4m3fn and scale.shape == (rows, k // 16)
    assert torch.isfinite(deq).all() and torch.isfinite(scale.float()).all() and torch.isfinite(g).all()

    x = w.to(torch.float64)
    denom = (scale.to(torch.float64) / g.to(torch.float64)).repeat_interleave(16, dim=1)
    err = (deq.to(torch.float64) - x).abs()
    m = x.abs() / denom
    inside = m <= 6
    # Rounding: within half an E2M1 step of the block's effective scale (fp32 dequant rounding aside).
    bound = _half_step(m) * denom
    tol = 1e-6 * x.abs() + 1e-44
    assert (err[inside] <= bound[inside] + tol[inside]).all(), float((err - bound)[inside].max())
    # Beyond 6 (the e4m3 block scale rounded down): saturates at +-6 * scale, sign kept.
    sat = deq.to(torch.float64)[~inside]
    assert torch.allclose(sat.abs(), 6 * denom[~inside], rtol=1e-6, atol=0)
    assert (torch.sign(sat) == torch.sign(x[~inside])).all()
    # Where the block scale is a normal e4m3 number its rounding is <= 1/16: error <= one step of 1.
    normal = scale.to(torch.float32).repeat_interleave(16, dim=1) >= 2.0**-6
    assert (err[normal] <= denom[normal] + tol[normal]).all()
    # Zeros stay zero; nonzero outputs keep the input's sign.
    assert (deq[x == 0] == 0).all()
    nz = deq != 0
    assert (torch.sign(deq[nz].double()) == torch.sign(x[nz])).all()


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 5), half=st.integers(1, 24), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_inverse(rows, half, seed):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (rows, 2 * half), generator=gen, dtype=torch.uint8)
    packed = R.pack_codes(codes)
    assert packed.shape == (rows, half)
    assert torch.equal(R.unpack_codes(packed), codes)
    raw = torch.randint(0, 256, (rows, half), generator=gen, dtype=torch.uint8)
    assert torch.equal(R.pack_codes(R.unpack_codes(raw)), raw)
    # every code decodes to a finite E2M1 value; code 8 is -0
    vals = R.decode_codes(codes)
    assert torch.isfinite(vals).all() and set(vals.abs().unique().tolist()) <= set(R.E2M1_VALUES)


@settings(max_examples=40, deadline=None)
@given(x=st.floats(-7, 7, allow_nan=False, width=32))
def test_round_to_e2m1_is_nearest(x):
    code = R.round_to_e2m1(torch.tensor([x]))
    v = float(R.decode_codes(code)[0])
    best = min(abs(abs(x) - e) for e in R.E2M1_VALUES) if abs(x) <= 6 else abs(x) - 6
    assert math.isclose(abs(abs(x) - abs(v)), best, abs_tol=1e-7)
    assert v == 0 or math.copysign(1, v) == math.copysign(1, x)


@pytest.mark.parametrize("shape", [(16,), (4, 24), (2, 8, 16)])
def test_quantize_rejects_bad_shapes_cleanly(shape):
    with pytest.raises(ValueError):
        R.quantize(torch.zeros(shape))


# ---- config.json -------------------------------------------------------------------------------------
_cfg_values = st.one_of(st.none(), st.booleans(), st.integers(-2, 2**40), st.floats(allow_nan=True), st.text(max_size=8),
                        st.lists(st.integers(-1, 5), max_size=3), st.dictionaries(st.text(max_size=5), st.integers(),
                                                                                   max_size=2))


@FAST
@given(over=st.dictionaries(st.sampled_from(["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                             "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta",
                                             "max_position_embeddings", "rms_norm_eps", "eos_token_id",
                                             "sliding_window", "use_sliding_window", "rope_scaling", "hidden_act",
                                             "tie_word_embeddings", "attention_bias", "model_type"]),
                            _cfg_values, max_size=4))
def test_model_config_is_valid_or_bad_input(over):
    """A malformed config.json is a one-line BadInputError naming it, never a KeyError/ZeroDivisionError."""
    from qerl_cli.models.config import ModelConfig

    cfg = {"model_type": "qwen2", "vocab_size": 384, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "eos_token_id": 2}
    cfg.update(over)
    try:
        c = ModelConfig.from_hf(cfg, "x/config.json")
    except BadInputError as e:
        assert "x/config.json" in str(e)
        return
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                 "head_dim", "max_position_embeddings"):
        v = getattr(c, name)
        assert isinstance(v, int) and not isinstance(v, bool) and v > 0, (name, v)
    assert c.num_heads % c.num_kv_heads == 0
    assert math.isfinite(c.rms_norm_eps) and c.rms_norm_eps > 0 and math.isfinite(c.rope_theta) and c.rope_theta > 0


# ---- safetensors headers -------------------------------------------------------------------------------
_meta = st.one_of(
    st.fixed_dictionaries({"dtype": st.sampled_from(["F32", "BF16", "U8", "F8_E4M3", "I64", "X9", ""]),
                           "shape": st.lists(st.integers(-2, 6), max_size=3),
                           "data_offsets": st.lists(st.integers(-8, 300), min_size=0, max_size=3)}),
    _cfg_values)


@FAST
@example(header={"a": {"dtype": "U8", "shape": [-1], "data_offsets": [5, 4]}}, data_len=10, raw=None)
@example(header={"a": {"dtype": "U8", "shape": [-2, -2], "data_offsets": [0, 4]}}, data_len=10, raw=None)
@given(header=st.dictionaries(st.text(max_size=6), _meta, max_size=4), data_len=st.integers(0, 300),
       raw=st.one_of(st.none(), st.binary(max_size=64)))
def test_safetensors_header_reader_is_valid_or_bad_input(tmp_path_factory, header, data_len, raw):
    """Any header bytes -> tensors whose byte ranges fit the file, or a BadInputError naming it."""
    import struct

    from qerl_cli.checkpoint.safetensors_io import read_header, read_tensor

    body = raw if raw is not None else json.dumps(header).encode()
    path = tmp_path_factory.mktemp("st") / "w.safetensors"
    path.write_bytes(struct.pack("<Q", len(body)) + body + b"\0" * data_len)
    try:
        infos = read_header(path)
    except BadInputError as e:
        assert str(path) in str(e)
        return
    size = path.stat().st_size
    for info in infos:
        assert all(d >= 0 for d in info.shape) and 8 + len(body) <= info.start <= info.start + info.nbytes <= size
        t = read_tensor(info)
        assert tuple(t.shape) == info.shape and t.dtype == info.dtype
