"""Prompt datasets: row shapes, file:line errors, templates, chat template, long prompts."""

import json

import pytest

from qerl_cli.data import (
    EncodeReport,
    PromptRow,
    encode_prompts,
    load_prompts,
    load_template,
    parse_chat_template_kwargs,
    render_prompt,
)
from qerl_cli.errors import BadInputError
from tests.helpers import THINKING_CHAT_TEMPLATE, make_tiny_tokenizer


@pytest.fixture(scope="module")
def chat_tok():
    return make_tiny_tokenizer()


@pytest.fixture(scope="module")
def plain_tok():
    tok = make_tiny_tokenizer()
    tok.chat_template = None
    return tok


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_row_shapes(tmp_path):
    p = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"prompt": "What is 2+2?", "answer": 4, "id": "a"},
            {"messages": [{"role": "user", "content": "hi"}]},
            {"question": "Natalia sold 48 clips...", "answer": "48/2 = 24\n#### 1,072"},  # GSM8K
            {"problem": "Find x.", "answer": "\\frac{1}{2}", "unique_id": "test/algebra/1.json"},  # MATH-500
            {"problem": "Find y.", "solution": "So $y = \\boxed{7}$."},
            "",
            {"prompt": "no answer"},
        ],
    )
    rows = load_prompts(p)
    assert [r.id for r in rows] == ["a", "1", "2", "test/algebra/1.json", "4", "5"]
    assert [r.answer for r in rows] == ["4", None, "1072", "\\frac{1}{2}", "7", None]
    assert rows[1].messages == [{"role": "user", "content": "hi"}] and rows[1].prompt is None
    assert rows[1].prompt_field == rows[1].messages and rows[0].prompt_field == "What is 2+2?"
    assert rows[2].prompt.startswith("Natalia")
    assert rows[6 - 1].where == f"{p}:7"


def test_parquet_and_json_list(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a", "b"], "answer": ["1", "2"]}), tmp_path / "d.parquet")
    rows = load_prompts(tmp_path / "d.parquet")
    assert [(r.prompt, r.answer, r.id) for r in rows] == [("a", "1", "0"), ("b", "2", "1")]
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "bad.parquet")
    with pytest.raises(BadInputError, match=r"bad.parquet:row 1: row has neither `prompt` nor `messages` \(keys: text\)"):
        load_prompts(tmp_path / "bad.parquet")
    (tmp_path / "d.json").write_text(json.dumps([{"prompt": "x"}]))
    assert load_prompts(tmp_path / "d.json")[0].prompt == "x"
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(BadInputError, match="not a readable Parquet file"):
        load_prompts(tmp_path / "junk.parquet")


@pytest.mark.parametrize(
    "lines, msg",
    [
        ([{"prompt": "ok"}, "{not json"], r"d.jsonl:2: not valid JSON"),
        ([{"prompt": "ok"}, {"text": "x"}], r"d.jsonl:2: row has neither `prompt` nor `messages` \(keys: text\)"),
        (["[1, 2]"], r"d.jsonl:1: expected a JSON object"),
        ([{"prompt": ""}], r"d.jsonl:1: `prompt` must be a non-empty string"),
        ([{"prompt": 5}], r"d.jsonl:1: `prompt` must be a non-empty string"),
        ([{"messages": []}], r"d.jsonl:1: `messages` must be a non-empty list"),
        ([{"messages": [{"role": "user"}]}], r"d.jsonl:1: messages\[0\] needs string `role` and `content`"),
        ([{"prompt": "a", "answer": {"x": 1}}], r"d.jsonl:1: `answer` must be a string or number"),
        ([{"prompt": "a", "answer": "#### none"}], r"d.jsonl:1: `answer` has #### but no number"),
        ([{"prompt": "a", "id": 1}, {"prompt": "b", "id": "1"}], r"d.jsonl:2: id '1' already used at .*d.jsonl:1"),
        ([{"prompt": "a", "id": [1]}], r"d.jsonl:1: `id` must be"),
    ],
)
def test_bad_rows_name_file_and_line(tmp_path, lines, msg):
    p = write_jsonl(tmp_path / "d.jsonl", lines)
    with pytest.raises(BadInputError, match=msg):
        load_prompts(p)


def test_missing_empty_and_dir(tmp_path):
    with pytest.raises(BadInputError, match="does not exist"):
        load_prompts(tmp_path / "nope.jsonl")
    (tmp_path / "e.jsonl").write_text("\n\n")
    with pytest.raises(BadInputError, match="holds no rows"):
        load_prompts(tmp_path / "e.jsonl")
    with pytest.raises(BadInputError, match="is a directory"):
        load_prompts(tmp_path)
    (tmp_path / "b.jsonl").write_bytes(b'{"prompt": "\xff"}\n')
    with pytest.raises(BadInputError, match="not UTF-8"):
        load_prompts(tmp_path / "b.jsonl")


def test_render_chat_and_plain(tmp_path, chat_tok, plain_tok):
    rows = load_prompts(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "2+2?"}, {"messages": [{"role": "user", "content": "hi"}]}]))
    assert render_prompt(rows[0], chat_tok) == "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert render_prompt(rows[0], chat_tok, chat_template=False) == "2+2?"
    assert render_prompt(rows[0], plain_tok) == "2+2?"
    with_sys = render_prompt(rows[0], chat_tok, system_prompt="Be brief.")
    assert with_sys.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?")
    assert render_prompt(rows[1], chat_tok, template="Q: {prompt}") == "<|im_start|>user\nQ: hi<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(BadInputError, match=r"d.jsonl:2: row has `messages` but the tokenizer has no chat template"):
        render_prompt(rows[1], plain_tok)
    with pytest.raises(BadInputError, match="tokenizer has no chat template"):
        render_prompt(rows[0], plain_tok, chat_template=True)


def test_template_string_and_file(tmp_path, plain_tok):
    assert load_template(None) is None
    t = load_template("Solve: {prompt}\nPut the answer after ####.")
    rows = load_prompts(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "\\frac{1}{2} + {x}"}]))
    # braces in the prompt must survive (plain replacement, not str.format)
    assert render_prompt(rows[0], plain_tok, template=t) == "Solve: \\frac{1}{2} + {x}\nPut the answer after ####."
    (tmp_path / "t.txt").write_text("Q: {prompt}\nA:")
    assert load_template(str(tmp_path / "t.txt")) == "Q: {prompt}\nA:"
    # the final newline an editor or `echo` writes is no part of the prompt (it cut the tiny model's eval from 40% to 5%)
    (tmp_path / "t.txt").write_text("Q: {prompt}\nA:\n")
    assert load_template(str(tmp_path / "t.txt")) == "Q: {prompt}\nA:"
    (tmp_path / "t.txt").write_bytes(b"Q: {prompt}\r\nA:\r\n")  # a Windows editor's
    assert load_template(str(tmp_path / "t.txt")) == "Q: {prompt}\nA:"
    (tmp_path / "t.txt").write_text("Q: {prompt}\nA:\n\n")  # only the one: a blank line asked for stays
    assert load_template(str(tmp_path / "t.txt")) == "Q: {prompt}\nA:\n"
    with pytest.raises(BadInputError, match=r"must contain \{prompt\}"):
        load_template("no placeholder")


def test_encode_and_long_prompts(tmp_path, plain_tok, chat_tok):
    rows = load_prompts(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}, {"prompt": "Natalia sold clips " * 20}, {"prompt": "ok"}]))
    enc = encode_prompts(rows, plain_tok)
    assert [e.token_ids for e in enc][0] == plain_tok("hi")["input_ids"]
    n_long = len(enc[1].token_ids)
    report = EncodeReport()
    kept = encode_prompts(rows, plain_tok, max_prompt_tokens=n_long - 1, report=report)
    assert [e.row.id for e in kept] == ["0", "2"]
    assert report.skipped_long == [f"{tmp_path / 'd.jsonl'}:2 ({n_long} tokens)"]
    with pytest.raises(BadInputError, match=rf"d.jsonl:2: prompt has {n_long} tokens, more than the {n_long - 1}"):
        encode_prompts(rows, plain_tok, max_prompt_tokens=n_long - 1, on_long="error")
    with pytest.raises(BadInputError, match="--long-prompts must be one of"):
        encode_prompts(rows, plain_tok, on_long="truncate")
    # chat-rendered ids are the template text's ids, with no extra special tokens in front
    chat = encode_prompts(rows[:1], chat_tok)[0]
    assert chat_tok.decode(chat.token_ids) == chat.text


def test_skip_bad_lines(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, "{oops", {"text": "x"}, {"prompt": "b", "id": "0"}, {"prompt": "c"}])
    with pytest.raises(BadInputError, match="d.jsonl:2: not valid JSON.*--skip-bad-lines"):
        load_prompts(p)
    bad = []
    rows = load_prompts(p, skip_bad_lines=True, bad_lines=bad)
    assert [r.prompt for r in rows] == ["a", "c"]
    assert [b.split(": ")[0].rsplit("/", 1)[-1] for b in bad] == ["d.jsonl:2", "d.jsonl:3", "d.jsonl:4"]
    write_jsonl(tmp_path / "all_bad.jsonl", ["{", "{"])
    with pytest.raises(BadInputError, match="holds no valid rows"):
        load_prompts(tmp_path / "all_bad.jsonl", skip_bad_lines=True)


def test_conversational_prompt_rows(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": [{"role": "user", "content": "1+1?"}], "reward_model": {"ground_truth": "2"}, "data_source": "x"},
        {"prompt": [{"role": "user"}]},
    ])
    with pytest.raises(BadInputError, match=r"d.jsonl:2: messages\[0\] needs string `role` and `content`"):
        load_prompts(p)
    row = load_prompts(p, skip_bad_lines=True)[0]
    assert row.messages == [{"role": "user", "content": "1+1?"}] and row.prompt is None and row.answer == "2"


def test_prompt_and_answer_keys(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [
        {"input": "What is 3+4?", "meta": {"gold": 7}, "messages": [{"role": "user", "content": "ignored"}]},
        {"input": [{"role": "user", "content": "chat"}], "meta": {"gold": "1"}},
    ])
    rows = load_prompts(p, prompt_key="input", answer_key="meta.gold")
    assert (rows[0].prompt, rows[0].messages, rows[0].answer) == ("What is 3+4?", None, "7")
    assert rows[1].messages == [{"role": "user", "content": "chat"}] and rows[1].answer == "1"
    with pytest.raises(BadInputError, match=r"d.jsonl:1: row has no `meta.answer` \(named by --answer-key"):
        load_prompts(p, answer_key="meta.answer")
    with pytest.raises(BadInputError, match=r"d.jsonl:1: row has no `query` \(named by --prompt-key; keys: input, messages, meta\)"):
        load_prompts(p, prompt_key="query")


@pytest.mark.parametrize("gold,said", [
    ([], "must be a string or number, got list"), ({"value": 7}, "must be a string or number, got dict"),
    (False, "must be a string or number, got bool"), ("#### ", "has #### but no number after it"),
])
def test_a_reference_of_the_wrong_kind_under_answer_key_is_named_by_its_column(tmp_path, gold, said):
    # "`answer` must be a string or number, got list", of a file with no `answer` at all: the column is the user's
    # (review s59r12); a null or blank one was named so in s59r06, and 0 is a reference like any number
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "meta": {"gold": 0}}, {"prompt": "b", "meta": {"gold": gold}}])
    with pytest.raises(BadInputError) as e:
        load_prompts(p, answer_key="meta.gold")
    assert str(e.value) == f"{p}:2: `meta.gold` {said}"
    assert load_prompts(p, answer_key="meta.gold", skip_bad_lines=True)[0].answer == "0"
    verl = write_jsonl(tmp_path / "v.jsonl", [{"prompt": "b", "reward_model": {"ground_truth": gold}}])
    with pytest.raises(BadInputError, match=f"v.jsonl:1: `reward_model.ground_truth` {said}"):
        load_prompts(verl)


def test_a_rows_keys_in_a_message_stay_one_short_line(tmp_path):
    # no_answer's hint (and the other messages listing a row's keys) named every key: 2,500 characters for a row of
    # 300 columns, and a JSON key holding a newline broke the one-line error in two (review s59r12)
    from qerl_cli.data import no_answer

    wide = {"prompt": "x", "final\nanswer": "7", "k" * 500: 1, **{f"col{i:03d}": i for i in range(300)}}
    p = write_jsonl(tmp_path / "d.jsonl", [wide])
    lacks, hint = no_answer(p, load_prompts(p)[0], None)
    assert hint.endswith("the row's keys: col000, col001, col002, col003, col004, col005, col006, col007, col008, "
                         "col009, col010, col011, col012, col013, col014, col015, col016, col017, col018, col019 and "
                         "283 more")
    wide = {"prompt": "x", "final\nanswer": "7", "k" * 500: 1}
    p = write_jsonl(tmp_path / "d.jsonl", [wide])
    lacks, hint = no_answer(p, load_prompts(p)[0], None)
    assert hint.endswith("the row's keys: final\\nanswer, " + "k" * 37 + "..., prompt")
    with pytest.raises(BadInputError) as e:
        load_prompts(p, answer_key="gold")
    assert "\n" not in str(e.value) and str(e.value).endswith("keys: final\\nanswer, " + "k" * 37 + "..., prompt)")


def test_files_saved_by_windows_tools_load(tmp_path):
    # A UTF-8 byte-order mark and CRLF line ends (Notepad, PowerShell's Out-File) used to fail line 1 as bad JSON.
    bom = "\ufeff"
    (tmp_path / "p.jsonl").write_text(bom + '{"prompt": "Q: 1+1?", "answer": "2"}\r\n\r\n{"prompt": "Q: 2+2?"}\r\n',
                                      encoding="utf-8", newline="")
    rows = load_prompts(tmp_path / "p.jsonl")
    assert [(r.prompt, r.answer) for r in rows] == [("Q: 1+1?", "2"), ("Q: 2+2?", None)]
    (tmp_path / "p.json").write_text(bom + '[{"prompt": "Q: 3?"}]', encoding="utf-8")
    assert [r.prompt for r in load_prompts(tmp_path / "p.json")] == ["Q: 3?"]
    (tmp_path / "t.txt").write_text(bom + "Solve: {prompt}", encoding="utf-8")
    assert load_template(str(tmp_path / "t.txt")) == "Solve: {prompt}"


def test_jsonl_strings_may_hold_unicode_line_separators(tmp_path):
    # json.dumps(ensure_ascii=False) writes U+2028 / U+2029 / U+0085 raw; JSON Lines splits at \n only.
    p = tmp_path / "sep.jsonl"
    p.write_text("".join(json.dumps({"prompt": f"a{c}b", "answer": "1"}, ensure_ascii=False) + "\n"
                         for c in ("\u2028", "\u2029", "\x85")), encoding="utf-8")
    rows = load_prompts(p)
    assert [r.prompt for r in rows] == ["a\u2028b", "a\u2029b", "a\x85b"]
    assert [r.where.rsplit(":", 1)[1] for r in rows] == ["1", "2", "3"]


def test_an_unpaired_surrogate_is_named_not_a_traceback(tmp_path, plain_tok):
    rows = load_prompts(write_jsonl(tmp_path / "d.jsonl", [{"prompt": "fine"}, '{"prompt": "a \\ud800 b"}']))
    with pytest.raises(BadInputError, match=r"d.jsonl:2: prompt holds an unpaired surrogate \('\\ud800'\)"):
        encode_prompts(rows, plain_tok)


def test_an_implicit_id_colliding_with_an_explicit_one_is_explained(tmp_path):
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {"prompt": "b", "id": 0}])
    with pytest.raises(BadInputError, match=r"d.jsonl:2: id '0' already used at .*d.jsonl:1 \(a row without an id"):
        load_prompts(p)


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_blank_or_empty_boxed_references_fall_back_or_are_none(tmp_path):
    # Audit 2026-11-26: an empty \boxed{} in a solution became the reference "" (scored correct against
    # an empty \boxed{}), and a blank `answer` hid reward_model.ground_truth.
    rows = load_prompts(_jsonl(tmp_path / "d.jsonl", [
        {"problem": "y?", "solution": "$y=\\boxed{}$"},
        {"problem": "y?", "answer": "", "solution": "$y=\\boxed{}$"},
        {"prompt": [{"role": "user", "content": "1+1?"}], "answer": " ", "reward_model": {"ground_truth": "2"}},
        {"problem": "z?", "answer": "", "solution": "so \\boxed{5}"},
    ]))
    assert [r.answer for r in rows] == [None, None, "2", "5"]


def test_named_columns_do_not_fall_back_to_others(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"input": None, "question": "other column", "gold": None,
                                          "reward_model": {"ground_truth": "9"}}])
    with pytest.raises(BadInputError, match="`input` \\(named by --prompt-key\\) is null"):
        load_prompts(path, prompt_key="input")
    assert load_prompts(path, answer_key="gold")[0].answer is None


def test_default_ids_do_not_depend_on_how_another_line_is_bad(tmp_path):
    ok = lambda p: json.dumps({"prompt": p})  # noqa: E731
    for bad in ("{not json", json.dumps({"nothing": 1})):
        rows = load_prompts(_jsonl(tmp_path / "d.jsonl", [ok("a"), bad, ok("c")]), skip_bad_lines=True, bad_lines=[])
        assert [(r.id, r.prompt) for r in rows] == [("0", "a"), ("2", "c")], bad


def test_parquet_float32_and_decimal_answers_read_as_written(tmp_path):
    import decimal

    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"prompt": ["a", "b"], "answer": pa.array([0.1, 2.5], pa.float32()),
                      "reward_model": pa.array([{"ground_truth": 0.3}] * 2, pa.struct([("ground_truth", pa.float32())]))})
    pq.write_table(table, tmp_path / "f.parquet")
    assert [r.answer for r in load_prompts(tmp_path / "f.parquet")] == ["0.1", "2.5"]
    pq.write_table(table.drop(["answer"]), tmp_path / "g.parquet")
    assert [r.answer for r in load_prompts(tmp_path / "g.parquet")] == ["0.3", "0.3"]
    import numpy as np
    half = pa.table({"prompt": list("abcde"), "answer": pa.array(np.array([0.1, 2.5, 65504, 0, -0.0], np.float16))})
    pq.write_table(half, tmp_path / "half.parquet")  # pyarrow's own cast wrote 0.0999755859375
    assert [r.answer for r in load_prompts(tmp_path / "half.parquet")] == ["0.1", "2.5", "65504", "0", "-0"]
    dec = pa.table({"prompt": ["a"], "answer": pa.array([decimal.Decimal("12.50")], pa.decimal128(5, 2))})
    pq.write_table(dec, tmp_path / "h.parquet")
    assert load_prompts(tmp_path / "h.parquet")[0].answer == "12.50"


def test_parquet_float_columns_reach_a_trl_reward_as_floats_as_trl_passes_them(tmp_path):
    # qerl reads float32 / float16 columns as text, to read a reference "0.1"; the other columns a TRL-style reward is
    # passed were that text too: a `weight` column's 0.5 came as "0.5", and a reward computing with it raised after
    # the first batch's generation. datasets (TRL's) reads them as pyarrow's to_pylist does: floats.
    import numpy as np

    from qerl_cli.rewards import RewardSet

    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    f32 = pa.float32()
    table = pa.table({"prompt": ["a", "b"], "answer": pa.array([0.1, 2.5], f32),
                      "weight": pa.array([0.5, None], f32), "half": pa.array(np.array([0.25, 1], np.float16)),
                      "scores": pa.array([[0.1, 2.0], []], pa.list_(f32)),
                      "meta": pa.array([{"k": 0.1, "s": "x"}, None], pa.struct([("k", f32), ("s", pa.string())])),
                      "n": [1, 2]})
    pq.write_table(table, tmp_path / "f.parquet")
    rows = load_prompts(tmp_path / "f.parquet")
    assert [r.answer for r in rows] == ["0.1", "2.5"]  # the reference is read from the text, as before
    tenth = float(np.float32(0.1))  # 0.10000000149011612, as datasets passes it
    assert rows[0].columns == {"weight": 0.5, "half": 0.25, "scores": [tenth, 2.0], "meta": {"k": tenth, "s": "x"},
                               "n": 1}
    assert rows[1].columns == {"weight": None, "half": 1.0, "scores": [], "meta": None, "n": 2}
    (tmp_path / "r.py").write_text("def weighted(completions, weight, scores, **kwargs):\n"
                                   "    return [w * sum(s) for w, s in zip(weight, scores)]\n")
    rs = RewardSet.from_specs([f"{tmp_path / 'r.py'}:weighted"])
    got = rs.score_group(["x", "y"], rows[0].answer, rows[0].prompt, columns=rows[0].columns)
    assert [total for _, total in got] == [0.5 * (tenth + 2.0)] * 2


def test_long_template_without_prompt_is_the_usual_error_and_bad_utf8_names_the_line(tmp_path):
    with pytest.raises(BadInputError, match="must contain \\{prompt\\}"):
        load_template("Solve carefully. " * 20 + "{question}")  # 340 characters: no file name (ENAMETOOLONG)
    (tmp_path / "b.jsonl").write_bytes(b'{"prompt": "a"}\n{"prompt": "\xff"}\n')
    with pytest.raises(BadInputError, match=r"b.jsonl:2: not UTF-8"):
        load_prompts(tmp_path / "b.jsonl")


def test_system_prompt_is_never_dropped_without_a_word(tmp_path, chat_tok, plain_tok):
    # Without a chat template --system-prompt vanished; a row's own system message kept it out silently.
    rows = load_prompts(write_jsonl(tmp_path / "d.jsonl", [
        {"prompt": "2+2?"},
        {"messages": [{"role": "system", "content": "Mine."}, {"role": "user", "content": "hi"}]}]))
    for tok, flag in ((plain_tok, None), (chat_tok, False)):
        with pytest.raises(BadInputError, match="--system-prompt needs a chat template"):
            encode_prompts(rows[:1], tok, system_prompt="Be brief.", chat_template=flag)
    report = EncodeReport()
    out = encode_prompts(rows, chat_tok, system_prompt="Be brief.", report=report)
    assert report.own_system == [rows[1].where] and "Mine." in out[1].text and "Be brief." not in out[1].text


def test_an_integer_too_long_for_python_is_a_bad_line_not_a_traceback(tmp_path):
    # json.loads raises a plain ValueError (int()'s 4300-digit limit), not a JSONDecodeError
    p = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "answer": "1"}, '{"prompt": "b", "answer": ' + "9" * 5000 + "}"])
    with pytest.raises(BadInputError, match="d.jsonl:2: not valid JSON"):
        load_prompts(p)
    bad = []
    assert [r.prompt for r in load_prompts(p, skip_bad_lines=True, bad_lines=bad)] == ["a"] and len(bad) == 1
    (tmp_path / "d.json").write_text('[{"prompt": "b", "id": ' + "9" * 5000 + "}]")
    with pytest.raises(BadInputError, match="d.json: not valid JSON"):
        load_prompts(tmp_path / "d.json")


def test_a_prompt_template_is_never_dropped_from_a_chat_without_a_user_turn(tmp_path, chat_tok):
    rows = load_prompts(write_jsonl(tmp_path / "d.jsonl", [{"messages": [{"role": "human", "content": "hi"}]}]))
    assert "hi" in render_prompt(rows[0], chat_tok)  # without a template the chat renders as it is
    with pytest.raises(BadInputError, match=r"d.jsonl:1: --prompt-template .* none \(roles: human\)"):
        render_prompt(rows[0], chat_tok, template="Q: {prompt}")


@pytest.mark.parametrize("magic,name", [(b"\x1f\x8b\x08\x00", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd")])
def test_a_compressed_dataset_is_named_as_such(tmp_path, magic, name):
    # a .jsonl.gz read as "not UTF-8 text (byte 1)", an encoding problem it is not (a review)
    import gzip

    p = tmp_path / "d.jsonl.gz"
    p.write_bytes(gzip.compress(b'{"prompt": "a"}\n' * 50) if name == "gzip" else magic + bytes(range(128, 250)))
    with pytest.raises(BadInputError, match=f"is {name}-compressed"):
        load_prompts(p)


@pytest.fixture(scope="module")
def thinking_tok():
    tok = make_tiny_tokenizer()
    tok.chat_template = THINKING_CHAT_TEMPLATE
    return tok


def test_chat_template_kwargs_reach_the_template_and_the_open_think_is_seen(thinking_tok):
    # Qwen3's enable_thinking could not be set: the prompt always opened <think>
    row = PromptRow("0", prompt="2+2?")
    (on,) = encode_prompts([row], thinking_tok)
    assert on.text.endswith("<|im_start|>assistant\n<think>\n") and on.opens_think
    (off,) = encode_prompts([row], thinking_tok, chat_template_kwargs={"enable_thinking": False})
    assert off.text.endswith("<think>\n\n</think>\n\n") and not off.opens_think
    assert off.token_ids != on.token_ids
    # a <think> a user message mentions is no open block: only the prompt's end counts
    (said,) = encode_prompts([PromptRow("1", prompt="Use <think>")], thinking_tok, chat_template_kwargs={"enable_thinking": False})
    assert not said.opens_think


@pytest.mark.parametrize("value, message", [
    ("{enable_thinking: false}", "--chat-template-kwargs is not valid JSON"),
    ('["enable_thinking"]', "must be a JSON object of template variables, got list"),
    ('{"add_generation_prompt": false}', "`add_generation_prompt` is set by qerl itself"),
    ('{"messages": []}', "`messages` is set by qerl itself"),
    ('{"enable-thinking": false}', "'enable-thinking' is no name a chat template can read"),
    ({"x": {1, 2}}, "must hold JSON values only"),
])
def test_chat_template_kwargs_that_are_no_template_variables_are_refused(value, message):
    with pytest.raises(BadInputError, match=message.replace("[", r"\[")):
        parse_chat_template_kwargs(value)


def test_chat_template_kwargs_parse_to_what_the_fingerprint_records():
    assert parse_chat_template_kwargs('{"enable_thinking": false}') == {"enable_thinking": False}
    assert parse_chat_template_kwargs({"tags": ("a", "b")}) == {"tags": ["a", "b"]}  # as the CLI's JSON gives it
    assert parse_chat_template_kwargs("{}") is None and parse_chat_template_kwargs(None) is None  # none: the flag unset


def test_a_chat_template_kwarg_the_template_never_reads_is_an_error(thinking_tok, plain_tok):
    # Jinja renders an unknown variable as nothing: a misspelt name changed the fingerprint and nothing else
    row = PromptRow("0", prompt="2+2?")
    with pytest.raises(BadInputError, match=r"reads no variable `enable_thinkng` \(it reads: .*enable_thinking"):
        encode_prompts([row], thinking_tok, chat_template_kwargs={"enable_thinkng": False})
    with pytest.raises(BadInputError, match="needs a chat template: the tokenizer has none$"):
        encode_prompts([row], plain_tok, chat_template_kwargs={"enable_thinking": False})
    with pytest.raises(BadInputError, match=r"none in use \(--no-chat-template\)"):
        encode_prompts([row], thinking_tok, chat_template=False, chat_template_kwargs={"enable_thinking": False})


@pytest.mark.parametrize("name, value, says", [
    ("d.jsonl", [{"prompt": "a"}, {"prompt": "b"}], "is one JSON array over several lines, not JSON Lines"),
    ("d.json", {"prompt": "a"}, "is one JSON object over several lines, not JSON Lines"),
])
def test_a_file_of_one_json_value_over_several_lines_is_named_so_not_invalid_json(tmp_path, name, value, says):
    # s54: json.dump(rows, f, indent=2) is valid JSON, yet read as JSON Lines each line was "not valid JSON", with
    # --skip-bad-lines offered (which then skipped every line).
    path = tmp_path / name
    path.write_text(json.dumps(value, indent=2))
    for skip in (False, True):
        with pytest.raises(BadInputError, match=f"{name}: {says}"):
            load_prompts(path, skip_bad_lines=skip, bad_lines=[])
    path.write_text(json.dumps({"rows": [value] if isinstance(value, dict) else value}, indent=2))
    with pytest.raises(BadInputError) as e:  # the hint was jq -c ., a one-line file of no row
        load_prompts(path)
    assert "jq -c '.rows[]' F > F.jsonl" in e.value.hint
    path.write_text(json.dumps({"rows": [value] if isinstance(value, dict) else value}))  # on one line: "keys: rows"
    with pytest.raises(BadInputError, match="neither `prompt` nor `messages`") as e:
        load_prompts(path)
    assert "jq -c '.rows[]' F > F.jsonl" in e.value.hint


@pytest.mark.parametrize("row", [
    {"conversations": [{"from": "human", "value": "2+2?"}, {"from": "gpt", "value": "4"}]},  # ShareGPT
    {"text": "2+2?", "tags": ["easy"]},
    {"rows": ["2+2?", "3+3?"]},
])
def test_a_row_with_a_list_column_is_not_called_rows_under_a_key(tmp_path, row):
    # the jq hint took any list-valued key for the rows: a ShareGPT row was told jq -c '.conversations[]' (its turns)
    path = tmp_path / "d.jsonl"
    path.write_text(f"{json.dumps(row)}\n{json.dumps(row)}\n")
    for text in (path.read_text(), json.dumps(row, indent=2)):  # a row a line, and one row pretty-printed
        path.write_text(text)
        with pytest.raises(BadInputError) as e:
            load_prompts(path)
        assert "under a key" not in e.value.hint


def test_a_null_prompt_or_messages_is_named_null_not_listed_as_present(tmp_path):
    # s54: a Parquet row with a null in its `prompt` column said "row has neither `prompt` nor `messages` (keys:
    # answer, prompt)", naming the column it claimed was missing as present.
    for key in ("prompt", "messages"):
        path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a"}, {key: None, "answer": "1"}])
        with pytest.raises(BadInputError, match=rf"d.jsonl:2: row has neither `prompt` nor `messages` \(`{key}` is null;"):
            load_prompts(path)


def test_a_row_without_an_id_taking_an_explicit_ids_index_says_it_has_none(tmp_path):
    # s54: the other order of test_an_implicit_id_colliding_with_an_explicit_one_is_explained: row 2, without an id,
    # was told its id '1' was already used, naming nothing of where it got that id.
    p = _jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "id": 1}, {"prompt": "b"}])
    with pytest.raises(BadInputError, match=r"d.jsonl:2: id '1' \(this row has no id and takes its row index\) already"):
        load_prompts(p)


def test_messages_ending_with_an_assistant_turn_are_refused(tmp_path, chat_tok):
    # An SFT-style row whose last turn is the reference reply: it was rendered whole, then a new assistant turn,
    # so every rollout and eval prompt showed the model the answer it was to find.
    p = write_jsonl(tmp_path / "d.jsonl", [
        {"messages": [{"role": "user", "content": "48+24?"}, {"role": "assistant", "content": "#### 72"}], "answer": "72"},
        {"prompt": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}], "answer": "2"},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                      {"role": "user", "content": "c"}], "answer": "1"},  # a few-shot chat ending with the question
    ])
    with pytest.raises(BadInputError, match=r"d.jsonl:1: `messages` ends with an assistant turn") as e:
        load_prompts(p)
    assert "drop the final assistant message" in e.value.hint and "--chat-template-file" in e.value.hint  # a prefill
    bad = []
    rows = load_prompts(p, skip_bad_lines=True, bad_lines=bad)
    assert [r.where.rsplit(":", 1)[1] for r in rows] == ["3"] and len(bad) == 2
    assert "d.jsonl:2: `prompt` ends with an assistant turn" in bad[1]  # the column the chat was in
    assert "#### 72" not in encode_prompts(rows, chat_tok)[0].text


@pytest.mark.parametrize("chat", [
    [{"role": "human", "content": "48+24?"}, {"role": "gpt", "content": "#### 72"}],  # ShareGPT's names
    [{"role": "user", "content": "48+24?"}, {"role": "model", "content": "#### 72"}],  # Gemma's
    [{"role": "user", "content": "48+24?"}, {"role": "Assistant", "content": "#### 72"}],
])
def test_a_chat_ending_with_the_assistant_turn_under_another_name_is_refused(tmp_path, chat):
    # only `assistant` was caught: a template renders `gpt` / `model` as that turn too (Gemma's writes the assistant
    # as `model`), so the reply, the answer, was in the prompt before the new turn
    p = write_jsonl(tmp_path / "d.jsonl", [{"messages": chat, "answer": "72"},
                                           {"messages": [*chat, {"role": "tool", "content": "72"}], "answer": "72"}])
    bad = []
    rows = load_prompts(p, skip_bad_lines=True, bad_lines=bad)
    assert [r.where for r in rows] == [f"{p}:2"]  # a tool's result is a turn the model answers
    assert bad == [f"{p}:1: `messages` ends with an assistant turn (role `{chat[-1]['role']}`), which the prompt would "
                   "show the model (its reply, the answer), before a new assistant turn to generate"
                   + f" ({_hint_of(p)})"]


def _hint_of(p):
    try:
        load_prompts(p)
    except BadInputError as e:
        return e.hint
    raise AssertionError("not refused")


def test_message_content_as_text_parts(tmp_path, chat_tok):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    parts = [{"type": "text", "text": "What is 2+3?", "image": None}, {"type": "text", "text": "Be brief.", "image": None}]
    pq.write_table(pa.table({"messages": [[{"role": "user", "content": parts}]], "answer": ["5"]}), tmp_path / "d.parquet")
    [row] = load_prompts(tmp_path / "d.parquet")
    assert row.messages == [{"role": "user", "content": "What is 2+3?\nBe brief."}]  # joined as vLLM joins them
    # a text model's template reads a string: Qwen3's renders a list as nothing, so the prompt held no question
    tok = make_tiny_tokenizer()
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content if m.content is string else '' }}"
                         "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    [enc] = encode_prompts([row], tok)
    assert "What is 2+3?\nBe brief." in enc.text
    want = tok.apply_chat_template(row.messages, add_generation_prompt=True, tokenize=True)
    assert enc.token_ids == list(want["input_ids"] if hasattr(want, "keys") else want)
    p = write_jsonl(tmp_path / "d.jsonl", [
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]}]},
        {"messages": [{"role": "user", "content": [{"text": "no type"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": None}]}]},
    ])
    with pytest.raises(BadInputError, match=r"d.jsonl:1: messages\[0\].content\[0\] is a `image_url` part: prompts are text"):
        load_prompts(p)
    bad = []
    with pytest.raises(BadInputError, match="holds no valid rows"):
        load_prompts(p, skip_bad_lines=True, bad_lines=bad)
    assert "messages[0].content[0] is no {type: text, text} part" in bad[1]
    # a text part without text is no "`text` part: prompts are text only", which said text was refused
    assert bad[2].endswith("d.jsonl:3: messages[0].content[0] is a `text` part without a string `text`")


def test_message_content_parts_vllm_reads_as_text(tmp_path):
    # the Responses API's `input_text` / `output_text` parts and plain strings are text to vLLM, whose joining qerl
    # follows: they were refused, `input_text` as "is a `input_text` part: prompts are text only"
    p = write_jsonl(tmp_path / "d.jsonl", [
        {"messages": [{"role": "user", "content": [{"type": "input_text", "text": "What is 2+3?"}, "Be brief."]},
                      {"role": "assistant", "content": [{"type": "output_text", "text": "5"}]},
                      {"role": "user", "content": ["And 2+4?"]}], "answer": "6"},
    ])
    [row] = load_prompts(p)
    assert row.messages == [{"role": "user", "content": "What is 2+3?\nBe brief."}, {"role": "assistant", "content": "5"},
                            {"role": "user", "content": "And 2+4?"}]


def test_parquet_messages_with_a_field_null_in_every_row(tmp_path):
    # `datasets` / pandas write a field that is None in every message (`name`, `tool_calls`) as Arrow's null type;
    # pyarrow cannot cast a list of such structs to its own type, and the valid file was "not a readable Parquet file"
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    chat = [{"role": "system", "content": "Reason step by step.", "name": None},
            {"role": "user", "content": "What is 2+3?", "name": None}]
    pq.write_table(pa.table({"messages": [chat], "answer": ["5"], "extra": pa.array([None], pa.null())}),
                   tmp_path / "d.parquet")
    [row] = load_prompts(tmp_path / "d.parquet")
    assert row.messages == [{"role": m["role"], "content": m["content"]} for m in chat] and row.answer == "5"


def test_a_datasets_directory_or_arrow_file_is_named_with_how_to_convert_it(tmp_path):
    # s59r06: datasets' save_to_disk directory was "a directory" with no word of how to get a file from it, and its
    # data-00000-of-00001.arrow (Arrow's stream format, read as JSON Lines by its unknown suffix) was "not UTF-8 text
    # (byte 0)", an encoding problem it is not. A Parquet file under another name was "not UTF-8 text" too.
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    table = pa.table({"prompt": ["2+2?"], "answer": ["4"]})
    ds = tmp_path / "ds"  # as Dataset.save_to_disk lays it out
    ds.mkdir()
    with pa.ipc.new_stream(str(ds / "data-00000-of-00001.arrow"), table.schema) as w:
        w.write_table(table)
    (ds / "dataset_info.json").write_text("{}")
    (ds / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data-00000-of-00001.arrow"}]}))
    convert = f"import datasets; datasets.load_from_disk('{ds}').to_json('{ds}.jsonl')"
    for path, says in [(ds, "is a Hugging Face datasets directory"), (ds / "data-00000-of-00001.arrow", "is an Arrow file")]:
        with pytest.raises(BadInputError, match=says) as e:
            load_prompts(path, flag="--dataset")
        assert convert in e.value.hint and f".to_parquet('{ds}.parquet')" in e.value.hint
    splits = tmp_path / "splits"  # a DatasetDict's: its splits in subdirectories
    splits.mkdir()
    (splits / "dataset_dict.json").write_text(json.dumps({"splits": ["test"]}))
    with pytest.raises(BadInputError) as e:
        load_prompts(splits)
    assert f"datasets.load_from_disk('{splits}')['test'].to_json(" in e.value.hint
    loose = tmp_path / "t.arrow"  # Arrow's file format, alone
    with pa.ipc.new_file(str(loose), table.schema) as w:
        w.write_table(table)
    for name in ("t.arrow", "t.bin"):  # by its suffix, and by its first bytes
        path = loose.rename(tmp_path / name)
        with pytest.raises(BadInputError, match="is an Arrow file") as e:
            load_prompts(path)
        assert f"datasets.Dataset.from_file('{path}').to_json('{tmp_path / 't'}.jsonl')" in e.value.hint
    pq.write_table(table, tmp_path / "rows.data")
    with pytest.raises(BadInputError, match="is a Parquet file without the .parquet suffix") as e:
        load_prompts(tmp_path / "rows.data")
    assert e.value.hint == f"rename it: mv {tmp_path / 'rows.data'} {tmp_path / 'rows.parquet'}"
    (tmp_path / "rows.data").rename(tmp_path / "rows.parquet")
    assert load_prompts(tmp_path / "rows.parquet")[0].answer == "4"
    # a .json of JSON Lines reads as JSON Lines: datasets' to_json writes them under any name (docs/rollout.md)
    (tmp_path / "lines.json").write_text('{"prompt": "2+2?", "answer": "4"}\n{"prompt": "3+3?", "answer": "6"}\n')
    assert [r.answer for r in load_prompts(tmp_path / "lines.json")] == ["4", "6"]
