"""Stop strings and completion text against real tokenizers of two families, built offline.

The engine appends sampled tokens one at a time (``LLMEngine._append``) and turns a finished sequence
into its record (``_completion``); these tests drive both with chosen token ids, so they check the text
handling alone: where generation stops, the recorded text, and that the two agree (the reward reads
the text, training the tokens).
"""

from __future__ import annotations

import pytest

pytest.importorskip("tokenizers")

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402

from qerl_cli.engine.llm_engine import LLMEngine  # noqa: E402
from qerl_cli.engine.sampling_params import SamplingParams  # noqa: E402
from qerl_cli.engine.sequence import Sequence  # noqa: E402

CORPUS = ["Q: Mia has 21 apples. How many? A: 21+8=29. #### 29\n\nQ: next", "Hello world, 你好 世界 emoji 😀 ok",
          "<answer>42</answer> The answer is 42. Question: what?"] * 40


@pytest.fixture(scope="module")
def qwen_style():
    """Byte-level BPE with Qwen's special tokens: <|im_end|> is EOS, <|im_start|> another special token."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")


@pytest.fixture(scope="module")
def sentencepiece_style():
    """Llama-2 / Mistral style: Metaspace, byte fallback, a decoder that strips the first leading space."""
    tok = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)],
        limit_alphabet=60))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _run(tok, prompt_ids, completion_ids, stop=(), max_new=64):
    """Feed ``completion_ids`` as the engine appends sampled tokens; -> (Completion, tokens kept)."""
    engine = object.__new__(LLMEngine)
    engine.tokenizer, engine.eos_token_ids = tok, {tok.eos_token_id}
    sp = SamplingParams(temperature=0, max_new_tokens=max_new, stop=tuple(stop))
    s = Sequence(group=0, child=0, token_ids=list(prompt_ids), num_prompt=len(prompt_ids),
                 max_len=len(prompt_ids) + max_new)
    for t in completion_ids:
        if engine._append(s, t, -0.5, sp, set(engine.eos_token_ids)):
            break
    return engine._completion(s, sp)


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def test_a_stop_is_found_on_the_text_as_recorded_around_special_tokens(qwen_style):
    # "\n" <|im_start|> "\n": the recorded text (special tokens not shown) reads "\n\n" there, so generation
    # stops there, as vLLM does; it ran on while the text was cut there, and training got 8 tokens the
    # reward never saw.
    tok = qwen_style
    ims = tok.convert_tokens_to_ids("<|im_start|>")
    comp = _ids(tok, "A: 29\n") + [ims] + _ids(tok, "\nQ: next one\n\nQ: again")
    c = _run(tok, _ids(tok, "hi"), comp, stop=["\n\n"])
    assert c.finish_reason == "stop" and c.stop_reason == "\n\n" and c.text == "A: 29"
    assert c.token_ids == comp[: comp.index(ims) + 2]
    assert tok.decode(c.token_ids, skip_special_tokens=True) == "A: 29\n\n"


def test_a_leading_space_survives_at_the_completions_start(sentencepiece_style):
    # Decoded alone, "▁Q:" reads "Q:": a stop " Q:" as the first token was never found, and the text lost
    # its space. Read after the prompt's last tokens, as vLLM reads it, both are as in the whole text.
    tok = sentencepiece_style
    prompt = tok("Q: Mia has 21 apples. A:")["input_ids"]
    comp = _ids(tok, "Q: next and more words here")
    assert tok.convert_ids_to_tokens(comp)[0].startswith("▁")
    whole = tok.decode(prompt + comp, skip_special_tokens=True)[len(tok.decode(prompt, skip_special_tokens=True)):]
    assert whole.startswith(" Q:")
    stopped = _run(tok, prompt, comp, stop=[" Q:"])
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) < len(comp) and stopped.text == ""
    free = _run(tok, prompt, comp)
    assert free.text == whole and free.finish_reason == "length"


def test_a_character_cut_by_the_length_limit_leaves_no_replacement_mark(qwen_style):
    tok = qwen_style
    emoji = _ids(tok, " 🎉")
    assert len(emoji) >= 3  # its bytes over several tokens (the corpus has no space before it)
    comp = _ids(tok, "#### 72") + emoji
    full = _run(tok, _ids(tok, "hi"), comp, max_new=len(comp))
    assert full.text == "#### 72 🎉"
    for cut in range(1, len(emoji)):  # the emoji's bytes cut short: held back, as vLLM does
        c = _run(tok, _ids(tok, "hi"), comp, max_new=len(comp) - cut)
        assert c.finish_reason == "length" and "\ufffd" not in c.text and c.text.startswith("#### 72")


def test_a_stop_that_is_one_special_token_stops_as_that_token(qwen_style):
    # Matched on the recorded text, "<|im_start|>" would never match (special tokens are not shown there):
    # it stops as a token id instead, for both engines; one hidden inside other text is refused.
    from qerl_cli.errors import BadInputError
    from qerl_cli.runtime import split_stops

    tok = qwen_style
    ims = tok.convert_tokens_to_ids("<|im_start|>")
    assert split_stops(tok, ("<|im_start|>", "\n\n", "Q:")) == (("\n\n", "Q:"), (ims,))
    with pytest.raises(BadInputError, match="special token <\\|im_start\\|>"):
        split_stops(tok, ("\n<|im_start|>",))
    assert split_stops(tok, ()) == ((), ())


def test_special_tokens_inside_a_stop_do_not_push_it_out_of_the_window(qwen_style):
    # The window was counted in tokens, each taken for a byte of text at least; special tokens show none.
    tok = qwen_style
    sp = [tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|endoftext|>", "<|im_start|>")]
    comp = _ids(tok, "A: 29\n") + sp + _ids(tok, "\nQ: next one and more words here ok")
    c = _run(tok, _ids(tok, "hi"), comp, stop=["\n\n"])
    assert c.finish_reason == "stop" and c.text == "A: 29" and c.token_ids == comp[: len(_ids(tok, "A: 29\n")) + 4]


def test_ids_past_the_vocabulary_inside_a_stop_do_not_push_it_out_of_the_window(qwen_style):
    # A model's embedding may have rows past the tokenizer's ids (Qwen2.5: 151936 for 151665 tokens); sampled,
    # they decode to nothing, yet each counted as a byte of the window: "Q" pad pad pad ":" ran on past the stop
    # "Q:" to the length limit, its recorded text holding the stop.
    tok = qwen_style
    pad = len(tok) + 5
    head = _ids(tok, "A: 29. ")
    comp = head + _ids(tok, "Q") + [pad] * 3 + _ids(tok, ":") + _ids(tok, " next one and more")
    c = _run(tok, _ids(tok, "hi"), comp, stop=["Q:"])
    assert c.finish_reason == "stop" and c.text == "A: 29. " and c.token_ids == comp[: len(head) + 5]


def _reference_stop_hit(engine, s, stops):
    """The stop check before its shortcuts (session 41): walk the window back token by token, always decode."""
    need = max(len(x.encode("utf-8")) for x in stops) + 2
    start, special = len(s), engine._special_ids()
    while start > s.num_prompt and need:
        start -= 1
        need -= s.token_ids[start] not in special
    if start == s.num_prompt:
        tail = engine._text(s, start, len(s))
    else:
        tail = engine.tokenizer.decode(s.token_ids[start:], skip_special_tokens=True)
    hits = [(i, x) for x in stops if (i := tail.find(x)) >= 0]
    return min(hits, key=lambda h: h[0])[1] if hits else None


@pytest.mark.parametrize("family", ["qwen_style", "sentencepiece_style"])
def test_the_stop_checks_shortcuts_give_the_full_decodes_verdict(family, request):
    # The per-step stop check skips the decode when no token of its window shows a character every stop
    # needs, and calls the Rust decoder directly: every verdict must equal the always-decoding check's,
    # over streams with CJK, emoji, special tokens inside the window and one-token prompts.
    import random

    tok = request.getfixturevalue(family)
    engine = object.__new__(LLMEngine)
    engine.tokenizer, engine.eos_token_ids = tok, {tok.eos_token_id}
    rng = random.Random(0)
    words = "".join(CORPUS[:3]).replace("\n", " \n ").split(" ")
    ids = _ids(tok, " ".join(rng.choice(words) for _ in range(1500)))  # shuffled, so merges do not swallow it
    specials = sorted(engine._special_ids() - {tok.eos_token_id})
    hits = 0
    for stops in [("####",), ("</answer>",), ("你好",), ("😀",), (" ",), ("\n\n",), ("Question:", "42"), (" Q:",),
                  ("<|im_start|>x",), ("A: 21",)]:
        for _ in range(25):
            p = rng.choice([1, 2, 5])
            a = rng.randrange(0, len(ids) - 80)
            comp = ids[a + p : a + p + 60]
            for _k in range(rng.choice([0, 1, 3, 30])):  # 30: specials inside nearly every window
                comp.insert(rng.randrange(len(comp) + 1), rng.choice(specials))
            s = Sequence(group=0, child=0, token_ids=list(ids[a : a + p]), num_prompt=p, max_len=p + 80)
            for t in comp:
                s.token_ids.append(t)
                want = _reference_stop_hit(engine, s, stops)
                assert engine._stop_string_hit(s, stops) == want, (family, stops, s.token_ids[p:])
                hits += want is not None
    assert hits > 100  # the streams do reach the stops


def test_the_stop_check_reads_token_ids_past_the_tokenizers_length():
    # A vocabulary whose ids skip numbers: len(tokenizer) counts tokens, so a table of ids 0..len-1 left
    # "</answer>" (id 50) out, found no token that could show the stop, and skipped every window.
    from tokenizers import models

    vocab = {c: i for i, c in enumerate(["<eos>", "a", "b", "c", " ", "d", "e", "f", "g", "h", "#"])}
    vocab["</answer>"] = 50
    base = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    base.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=base, eos_token="<eos>")
    engine = object.__new__(LLMEngine)
    engine.tokenizer, engine.eos_token_ids = tok, {0}
    s = Sequence(group=0, child=0, token_ids=[1, 2], num_prompt=2, max_len=100)
    for t in [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4, 50]:
        s.token_ids.append(t)
    assert _reference_stop_hit(engine, s, ("</answer>",)) == "</answer>"
    assert engine._stop_string_hit(s, ("</answer>",)) == "</answer>"
