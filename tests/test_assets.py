"""The bundled tiny model and its synthetic task: loadable, small, deterministic, correct."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from qerl_cli.assets import tiny_model_dir, tiny_task_file
from qerl_cli.tasks import arith


def _rows(split):
    return [json.loads(line) for line in tiny_task_file(split).read_text().splitlines()]


# ---- task generator --------------------------------------------------------------------------
def test_generator_is_deterministic_by_seed():
    a = [p.prompt for p in arith.generate(7, 50)]
    b = [p.prompt for p in arith.generate(7, 50)]
    c = [p.prompt for p in arith.generate(8, 50)]
    assert a == b
    assert a != c
    assert len(set(a)) == 50


def _answer_from_structure(p: arith.Problem) -> int:
    # Independent of Problem.answer: read each step's sign from the verb's wording.
    total = p.start
    for verb, n in p.steps:
        sub = any(w in verb for w in ("gives away", "sells", "loses", "uses", "drops"))
        total = total - n if sub else total + n
    return total


def test_answers_are_correct_and_recomputable_from_text():
    probs = arith.generate(3, 500)
    for p in probs:
        assert p.answer == _answer_from_structure(p)
        assert arith.parse_prompt(p.prompt) == p
        assert arith.solve(p.prompt) == p.answer
        assert 0 <= p.answer < 100
        sol = arith.worked_solution(p)
        assert arith.extract_answer(sol) == str(p.answer)
        # every equation of the worked solution is true arithmetic
        for a, op, b, c in re.findall(r"(\d+)([+-])(\d+)=(\d+)\.", sol):
            assert (int(a) + int(b) if op == "+" else int(a) - int(b)) == int(c)


def test_confused_solutions_keep_exact_arithmetic_but_flip_operations():
    rng = random.Random(0)
    flipped = total = 0
    for p in arith.generate(4, 400):
        sol = arith.worked_solution(p, rng, arith.PRETRAIN_CONFUSION)
        eqs = re.findall(r"(\d+)([+-])(\d+)=(\d+)\.", sol)
        assert len(eqs) == len(p.steps)
        for (a, op, b, c), (verb, n) in zip(eqs, p.steps):
            assert int(b) == n
            assert (int(a) + n if op == "+" else int(a) - n) == int(c) >= 0
            if verb == "drops {n}":
                total += 1
                flipped += op == "+"
        assert arith.extract_answer(sol) == eqs[-1][3]
    assert total > 20 and 0.4 < flipped / total < 0.95  # PRETRAIN_CONFUSION["drops {n}"] = 0.7


def test_answer_rule():
    assert arith.extract_answer(" 3+4=7. #### 7") == "7"
    assert arith.extract_answer("####12 trailing") == "12"
    assert arith.extract_answer(" 3+4=7. 7") is None
    assert arith.is_correct(" 5-2=3. #### 3", "3")
    assert not arith.is_correct(" 5-2=3. #### 4", "3")
    assert not arith.is_correct(" no answer", "3")


def test_parse_prompt_rejects_foreign_text():
    with pytest.raises(ValueError):
        arith.parse_prompt("Q: What is 2+2?\nA:")
    with pytest.raises(ValueError):
        arith.parse_prompt("Q: Tom has 3 pens. Tom paints 2. How many pens does Tom have?\nA:")


# ---- bundled task files ----------------------------------------------------------------------
def test_task_files_match_the_generator():
    for split in ("train", "test"):
        assert _rows(split) == arith.task_rows(split), f"{split}.jsonl is stale: rerun recipes/pretrain_tiny.py"


def test_task_files_rows_are_correct_and_splits_disjoint():
    train, test = _rows("train"), _rows("test")
    assert 50 <= len(test) <= 500 and len(train) >= 500
    for r in train + test:
        assert set(r) == {"prompt", "answer"}
        assert isinstance(r["answer"], str) and r["answer"] == str(arith.solve(r["prompt"]))
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}


def test_tiny_task_file_rejects_unknown_split():
    with pytest.raises(ValueError):
        tiny_task_file("validation")


# ---- bundled model ---------------------------------------------------------------------------
def test_model_dir_size_and_files():
    d = tiny_model_dir()
    names = {p.name for p in d.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= names
    assert not any(n.endswith(".bin") for n in names)
    assert sum(p.stat().st_size for p in d.iterdir() if p.is_file()) <= 20 * 2**20


def test_model_loads_and_is_nvfp4_friendly():
    import transformers

    d = tiny_model_dir()
    cfg = transformers.AutoConfig.from_pretrained(d)
    assert cfg.model_type == "qwen2"
    assert cfg.hidden_size % 16 == 0 and cfg.intermediate_size % 16 == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(d)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert sum(p.numel() for p in model.parameters()) <= 10_000_000
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and name != "lm_head":
            assert mod.in_features % 16 == 0, name
    gen = json.loads((d / "generation_config.json").read_text())
    assert gen["eos_token_id"] == cfg.eos_token_id and gen.get("pad_token_id") is not None


def test_tokenizer_roundtrips_task_text_and_splits_digits():
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir())
    assert isinstance(tok, transformers.PreTrainedTokenizerFast)
    assert tok.eos_token is not None and tok.pad_token is not None and tok.pad_token_id != tok.eos_token_id
    model_vocab = json.loads((tiny_model_dir() / "config.json").read_text())["vocab_size"]
    assert len(tok) <= model_vocab
    for r in _rows("test")[:50]:
        p, c = r["prompt"], arith.worked_solution(arith.parse_prompt(r["prompt"]))
        ids_p = tok(p, add_special_tokens=False)["input_ids"]
        ids_c = tok(c, add_special_tokens=False)["input_ids"]
        # prompt and completion tokenize independently (rollout token ids == retokenized text)
        assert ids_p + ids_c == tok(p + c, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids_p + ids_c) == p + c
        assert len(ids_c) + 1 <= 40
    # AutoTokenizer may pick a model-specific class (transformers 5: Qwen2Tokenizer): it must
    # tokenize exactly as the raw tokenizer.json the model was trained with.
    raw = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tiny_model_dir() / "tokenizer.json"))
    for text in [r["prompt"] for r in _rows("train")[:200]] + ["Hi 12, ok?\n\n  x  #### 7", "\u00fcber \u20ac5"]:
        assert tok(text, add_special_tokens=False)["input_ids"] == raw(text, add_special_tokens=False)["input_ids"]
    digits = tok.convert_ids_to_tokens(tok("12345", add_special_tokens=False)["input_ids"])
    assert digits == ["1", "2", "3", "4", "5"]


def test_model_solves_some_test_problems_greedily():
    """The bundled model knows the format: greedy completions end in `#### N` and some are right."""
    import transformers

    d = tiny_model_dir()
    tok = transformers.AutoTokenizer.from_pretrained(d)
    tok.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    rows = _rows("test")[:64]
    enc = tok([r["prompt"] for r in rows], return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=40, do_sample=False)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    answered = [arith.extract_answer(t) is not None for t in texts]
    correct = [arith.is_correct(t, r["answer"]) for t, r in zip(texts, rows)]
    assert sum(answered) >= 0.9 * len(rows)
    # weak but not hopeless (docs/tiny-model.md: ~20-50% greedy pass@1 on the full test split)
    assert 0.05 <= sum(correct) / len(rows) <= 0.8


def test_recipe_rebuilds_the_bundled_tokenizer_exactly():
    """recipes/pretrain_tiny.py's tokenizer is deterministic: it reproduces the committed tokenizer.json."""
    import importlib.util

    from qerl_cli.assets import ASSETS_DIR

    path = ASSETS_DIR.parents[1] / "recipes" / "pretrain_tiny.py"
    if not path.exists():
        pytest.skip("recipes/ not present (installed package)")
    spec = importlib.util.spec_from_file_location("pretrain_tiny", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    built = json.loads(mod.build_tokenizer().backend_tokenizer.to_str())
    bundled = json.loads((tiny_model_dir() / "tokenizer.json").read_text())
    assert built["model"]["vocab"] == bundled["model"]["vocab"]
    assert built["model"]["merges"] == bundled["model"]["merges"]
    assert built["pre_tokenizer"] == bundled["pre_tokenizer"]


def test_package_data_ships_every_asset_file():
    """A non-editable install must carry the model and task files (pyproject package-data)."""
    import fnmatch

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    from qerl_cli.assets import ASSETS_DIR

    pyproject = ASSETS_DIR.parents[1] / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("not a source tree")
    data = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]
    assert "qerl_cli.assets" in data["packages"] and "qerl_cli.tasks" in data["packages"]
    patterns = data["package-data"]["qerl_cli.assets"]
    files = [p.relative_to(ASSETS_DIR).as_posix() for p in ASSETS_DIR.rglob("*")
             if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".py"]
    assert files
    for f in files:
        assert any(fnmatch.fnmatch(f, pat) for pat in patterns), f"{f} not covered by {patterns}"
