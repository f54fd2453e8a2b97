"""LLMEngine: batched, continuously scheduled generation on the shared qerl model.

One ``generate`` call turns P prompts into P groups of n completions. Each step either prefills the
groups the scheduler just admitted (one forward over their prompts; the n completions of a prompt
all start from that single prefill, sharing its KV blocks) or decodes one token for every running
sequence. Finished sequences free their slot and blocks immediately and waiting prompts take them
(continuous batching). Decode is pipelined one step ahead of the host: step t+1 is launched from
device-resident state before step t's tokens are read back and checked for EOS/stop strings, so
host bookkeeping overlaps GPU work; a sequence that stopped at step t has its step-t+1 token
discarded (its K/V reserve holds one spare slot for it). The model, its LoRA and AQN noise are
whatever the caller set on it, so the rollout policy is exactly the training policy's code.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from qerl_cli.engine.block_manager import BlockManager
from qerl_cli.engine.host_memory import available_ram
from qerl_cli.engine.model_runner import ModelRunner
from qerl_cli.engine.sampler import sample, sequence_seed
from qerl_cli.engine.sampling_params import Completion, SamplingParams
from qerl_cli.engine.scheduler import Group, Scheduler
from qerl_cli.engine.sequence import Sequence
from qerl_cli.errors import BadInputError, OutOfMemoryError
from qerl_cli.layers.attention import fuse_projections, group_lora
from qerl_cli.layers.lora import lora_modules

_SEED_MASK = (1 << 62) - 1
CPU_KV_SHARE = 0.5  # of the RAM available as a CPU engine is built: the rest for activations, logits, other processes
# A CPU engine's cache in GiB, at most (vLLM's CPU backend: VLLM_CPU_KVCACHE_SPACE, 4 by default). The cache is zeroed
# up front, and the default --max-num-seqs of a model's whole context "could use" hundreds of GiB: half the RAM
# would be taken and written for sequences a CPU never runs at once.
CPU_KV_ENV, CPU_KV_GIB_DEFAULT = "QERL_CPU_KV_CACHE_GIB", 4.0
_PREFIX_TOKENS = 5  # decoded before a piece of text so it reads as in the whole (vLLM's prefix offset)


def cpu_kv_cap() -> float:
    """Bytes a CPU engine's KV cache may take at most: QERL_CPU_KV_CACHE_GIB, 4 GiB by default."""
    raw = os.environ.get(CPU_KV_ENV, "").strip()
    try:
        gib = float(raw) if raw else CPU_KV_GIB_DEFAULT
    except ValueError:
        gib = -1.0
    if not gib > 0 or gib == float("inf"):
        raise BadInputError(f"{CPU_KV_ENV}={raw!r} is no size in GiB", hint=f"e.g. {CPU_KV_ENV}=8; unset: {CPU_KV_GIB_DEFAULT:g}")
    return gib * 2**30


class LLMEngine:
    def __init__(self, model, tokenizer=None, max_num_seqs: int = 256, max_model_len: int | None = None, *,
                 block_size: int = 16, num_blocks: int | None = None, max_num_batched_tokens: int = 16384,
                 gpu_memory_utilization: float = 0.9, enforce_eager: bool = False):
        cfg = model.config
        # -1: the pipelined decode may compute one position past a finished sequence's end.
        limit = min(cfg.max_position_embeddings, model.model.rotary.max_positions) - 1
        if cfg.sliding_window:
            limit = min(limit, cfg.sliding_window)  # windowed attention is not implemented: stay inside it
        self.max_model_len = min(max_model_len or limit, limit)
        self.model, self.tokenizer = model, tokenizer
        fuse_projections(model)  # one q/k/v and one gate/up GEMM per layer; shares memory with the parts
        self._lora = [m for _, m in lora_modules(model)]
        self._sync_lora()  # before graph capture, so the graphs read the in-place-refreshed copies
        self.max_num_seqs = max_num_seqs
        self.block_size = block_size
        if num_blocks is None:
            num_blocks = self._auto_num_blocks(max_num_batched_tokens, gpu_memory_utilization)
        self.num_blocks = num_blocks
        self.max_num_batched_tokens = max(max_num_batched_tokens, self.max_model_len)
        try:
            self.runner = ModelRunner(model, max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
                                      block_size=block_size, num_blocks=num_blocks, enforce_eager=enforce_eager)
        except torch.cuda.OutOfMemoryError:
            raise OutOfMemoryError(f"out of GPU memory allocating the KV cache ({num_blocks} blocks of {block_size} tokens) "
                                   "or capturing decode graphs", hint="lower --max-num-seqs or --max-model-len") from None
        self.eos_token_ids = self._eos_ids()
        self.stats: dict = {}

    # ---- setup -----------------------------------------------------------------------------------
    def _auto_num_blocks(self, max_batched: int, utilization: float) -> int:
        cfg, dev = self.model.config, self.model.device
        elem = torch.empty(0, dtype=self.model.dtype).element_size()
        block_bytes = 2 * cfg.num_layers * self.block_size * cfg.num_kv_heads * cfg.head_dim * elem
        wanted = self.max_num_seqs * -(-(self.max_model_len + 1) // self.block_size) + 1
        if dev.type == "cuda":
            free, _ = torch.cuda.mem_get_info(dev)
            act = max_batched * (3 * cfg.intermediate_size + 6 * cfg.hidden_size + 3 * cfg.num_heads * cfg.head_dim) * elem * 2
            logits = 4 * self.max_num_seqs * cfg.vocab_size * 4
            budget = free * utilization - act - logits - (1 << 30)
        else:
            # What the request can use, up to QERL_CPU_KV_CACHE_GIB and a share of the RAM free now. A flat 1 GiB
            # held a 1.5B model's cache to ~18k tokens: one group of 8 x 4096 was refused ("give the engine more
            # memory", which nothing did); and on a machine with less free it took RAM the model needed.
            avail, cap = available_ram(), cpu_kv_cap()
            budget = min(CPU_KV_SHARE * avail, cap) if avail is not None else cap
        blocks = int(min(wanted, budget // block_bytes))
        self.kv_cache_gib = blocks * block_bytes / 2**30  # for the hint of a prompt the cache cannot hold
        if blocks < 2:
            raise BadInputError(f"no memory left for the KV cache ({budget / 2**30:.1f} GiB budget)",
                                hint="lower --max-num-seqs or use a smaller model" if dev.type == "cuda" else
                                f"the CPU cache takes at most {CPU_KV_SHARE:.0%} of the RAM available; free RAM or "
                                "use a smaller model")
        return blocks

    def _cache_hint(self) -> str | None:
        """What bounded a CPU engine's KV cache, for a prompt group it cannot hold (on a GPU: the free memory)."""
        if self.model.device.type == "cuda" or not hasattr(self, "kv_cache_gib"):
            return None
        return (f"the CPU KV cache is {self.num_blocks} blocks of {self.block_size} tokens ({self.kv_cache_gib:.2f} "
                f"GiB), at most {CPU_KV_ENV} ({cpu_kv_cap() / 2**30:g} GiB) and {CPU_KV_SHARE:.0%} of the RAM available "
                f"when the engine was built: raise {CPU_KV_ENV}, free RAM, or lower the completions per prompt, "
                "--max-new-tokens or --max-model-len")

    def _eos_ids(self) -> set[int]:
        ids = set(self.model.config.eos_token_ids)
        tok_eos = getattr(self.tokenizer, "eos_token_id", None)
        if tok_eos is not None:
            ids.add(int(tok_eos))
        gen = Path(self.model.model_dir or "/nonexistent") / "generation_config.json"
        if gen.exists():
            ids.update(generation_eos_ids(gen))
        return {int(i) for i in ids}

    def _sync_lora(self) -> None:
        """Refresh LoRA inference copies from the fp32 masters (in place: captured graphs see them).

        The CUDA graphs fix the model's *structure* at engine creation (which LoRA modules are
        enabled); values (LoRA weights, AQN noise) may change between ``generate`` calls.
        """
        state = tuple(m.enabled for m in self._lora)
        if hasattr(self, "_lora_state") and state != self._lora_state:
            raise RuntimeError("LoRA modules were enabled/disabled after the engine was built; build a new LLMEngine")
        self._lora_state = state
        for m in self._lora:
            m.refresh_inference_copies(self.model.dtype)
        group_lora(self.model, self.model.dtype)

    # ---- generation ------------------------------------------------------------------------------
    def generate(self, prompt_token_ids: list[list[int]], sp: SamplingParams, n: int = 1,
                 progress: Callable[[int, int], None] | None = None,
                 seeds: list[int] | None = None) -> list[list[Completion]]:
        """n completions for each prompt, in prompt order. ``progress(prompts_done, tokens_generated)`` is
        called whenever a prompt's group completes. ``seeds``: one per prompt, so that a prompt's
        completions depend on its own seed only, not on the call it came in (else ``sp.seed`` and the
        prompt's index in this call)."""
        if seeds is not None and len(seeds) != len(prompt_token_ids):
            raise ValueError(f"{len(seeds)} seeds for {len(prompt_token_ids)} prompts")
        # Out of memory propagates as torch's error: each stage names its own flags to lower (cli.OOM_HINTS);
        # a hint here named max_num_batched_tokens, which no stage takes, and dropped rollout's --batch-prompts.
        return self._generate(prompt_token_ids, sp, n, progress, seeds)

    def _generate(self, prompt_token_ids: list[list[int]], sp: SamplingParams, n: int,
                  progress: Callable[[int, int], None] | None, prompt_seeds: list[int] | None) -> list[list[Completion]]:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if sp.stop and self.tokenizer is None:  # they are matched on the decoded text: without one, never
            raise ValueError(f"stop strings {sp.stop!r} need the engine's tokenizer (LLMEngine(model, tokenizer))")
        vocab = self.model.config.vocab_size
        groups = []
        for i, p in enumerate(prompt_token_ids):
            if not p:
                raise BadInputError(f"prompt {i} is empty")
            if len(p) >= self.max_model_len:
                raise BadInputError(f"prompt {i} has {len(p)} tokens; the engine's max_model_len is {self.max_model_len}")
            if min(p) < 0 or max(p) >= vocab:
                raise BadInputError(f"prompt {i} has a token id outside [0, {vocab})")
            groups.append(Group(i, list(p), n, min(len(p) + sp.max_new_tokens, self.max_model_len)))
        sched = Scheduler(BlockManager(self.num_blocks, self.block_size), self.max_num_seqs, self.max_num_batched_tokens)
        try:
            for g in groups:
                sched.add(g)
        except ValueError as e:
            raise BadInputError(str(e), hint=self._cache_hint()) from None
        self._sync_lora()
        self.runner.bind()
        stop_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else self.eos_token_ids)
        t0 = time.perf_counter()
        self._done = self._tokens = 0
        steps = prefill_tokens = 0
        runner = self.runner
        pending = None  # the decode step in flight: (its sequences, host copies of tokens/logprobs, event)
        while sched.has_work():
            if pending is None:
                admitted = sched.admit()
                if admitted:
                    logits = runner.prefill(admitted)
                    prefill_tokens += sum(len(g.prompt_ids) for g in admitted)
                    seqs = [s for g in admitted for s in g.seqs]
                    for s in seqs:
                        s.rng = sequence_seed(sp.seed, prompt_seeds, s.group, s.child)
                    seeds = torch.tensor([(s.rng + len(s)) & _SEED_MASK for s in seqs], device=logits.device)
                    tok, lp = sample(logits.repeat_interleave(n, dim=0), sp, seeds)
                    self._process(seqs, tok.tolist(), lp.tolist(), sched, groups, sp, stop_ids, progress)
                    continue
                if not sched.running:  # unreachable: add() rejects groups that could never fit
                    raise RuntimeError("scheduler stalled with waiting prompts and nothing running")
                batch = list(sched.running)
                runner.load_batch(batch)
            # Launch this step on the device, then do the host work of the previous one meanwhile.
            logits = runner.step()
            tok, lp = sample(logits, sp, runner.seeds())
            runner.advance(tok)
            current = (batch, *_to_host(tok, lp))
            steps += 1
            if pending is not None:
                changed = self._process(*_wait(pending), sched, groups, sp, stop_ids, progress)
            else:
                changed = False
            pending = current
            if changed or (sched.waiting and sched.can_admit()):
                # The batch changes: finish the step in flight (tokens of sequences that already
                # stopped are dropped) and reload from the host next iteration.
                self._process(*_wait(pending), sched, groups, sp, stop_ids, progress)
                pending = None
        tokens = self._tokens
        elapsed = time.perf_counter() - t0
        self.stats = {"generated_tokens": tokens, "prefill_tokens": prefill_tokens, "decode_steps": steps,
                      "elapsed_s": elapsed, "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0}
        return [[self._completion(s, sp) for s in g.seqs] for g in groups]

    def _process(self, seqs, toks, lps, sched, groups, sp, stop_ids, progress) -> bool:
        """Append one sampled token per sequence; returns whether any sequence finished."""
        finished = False
        for s, t, lp in zip(seqs, toks, lps):
            if s.finished:  # computed one step past its end by the pipelined decode: discard
                continue
            self._tokens += 1
            if self._append(s, t, lp, sp, stop_ids):
                finished = True
                sched.finish(s)
                g = groups[s.group]
                g.done += 1
                if g.done == g.n:
                    self._done += 1
                    if progress is not None:
                        progress(self._done, self._tokens)
        return finished

    def _append(self, s: Sequence, token: int, logprob: float, sp: SamplingParams, stop_ids: set[int]) -> bool:
        s.token_ids.append(token)
        s.logprobs.append(logprob)
        if token in stop_ids:
            s.finish_reason, s.stop_reason = "stop", token
        # A token that shows no text cannot complete a stop (the text is the one checked a token ago);
        # checked anyway, a run of them walked the window back over the whole run: O(n^2) a sequence.
        elif (sp.stop and self.tokenizer is not None and not self._silent(token)
              and (hit := self._stop_string_hit(s, sp.stop))):
            s.finish_reason, s.stop_reason = "stop", hit
        elif len(s) >= s.max_len:
            s.finish_reason = "length"
        return s.finished

    def _stop_string_hit(self, s: Sequence, stops: tuple[str, ...]) -> str | None:
        # Decode only a tail long enough to hold any stop string: O(1) per step instead of O(length).
        # Sized in UTF-8 bytes, not characters: byte-level BPE spends up to 4 tokens on one character
        # ("你好" is 6 tokens in Qwen's vocabulary), and a token that shows text is never less than one byte. Matched
        # on the text as recorded (special tokens not shown, as vLLM matches): on the raw decode,
        # text joined across a special token was cut where generation had not stopped.
        need, enders = self._stop_plan(stops)
        ids, n, special = s.token_ids, len(s), self._special_ids()
        start = n - need
        if not (start > s.num_prompt and (not special or special.isdisjoint(ids[start:]))
                and max(ids[start:]) < self._vocab_end()):
            start = n  # tokens that show no text (special, past the vocabulary) do not count
            while start > s.num_prompt and need:
                start -= 1
                need -= not self._silent(ids[start])
        if start == s.num_prompt:  # the completion's first tokens: read after the prompt's (a leading space)
            tail = self._text(s, start, n)
        else:  # a stop completed by the last token lies >= 2 tokens past the window's first
            window = ids[start:]
            if enders is not None and enders.isdisjoint(window) and max(window) < len(self._texts):
                return None  # no window token shows any stop's key character: no decode
            tail = self._decode(window)
        # The stop the text is cut at (the earliest in it), when one token completes two of them.
        hits = [(i, x) for x in stops if (i := tail.find(x)) >= 0]
        return min(hits, key=lambda h: h[0])[1] if hits else None

    def _stop_plan(self, stops: tuple[str, ...]):
        """(tokens the stop window spans, ids of the tokens that can show a stop's key character or None),
        once per stop set. Each stop gets a key: its printable non-space ASCII character that the fewest
        tokens show. A decoder puts such a character into the text only from a token whose own text
        holds it (byte-level: an ASCII byte decodes as itself; Metaspace/byte fallback/strip change
        spaces only), so a window none of whose tokens holds any key holds no stop. No key (a stop of
        spaces or non-ASCII only): None, always decode."""
        cache = self.__dict__.setdefault("_stop_plans", {})
        plan = cache.get(stops)
        if plan is None:
            need = max(len(x.encode("utf-8")) for x in stops) + 2
            texts = self._token_texts()
            enders: set[int] | None = set()
            for x in stops:
                keys = {c for c in x if "!" <= c <= "~"}
                if not keys or texts is None:
                    enders = None
                    break
                sets = {c: [v for v, t in enumerate(texts) if c in t] for c in keys}
                enders.update(min(sets.values(), key=len))
            plan = cache[stops] = (need, frozenset(enders) if enders is not None else None)
        return plan

    def _token_texts(self) -> list[str] | None:
        """Each token id's own text (special tokens: none), or None where the vocabulary is unknown."""
        texts = getattr(self, "_texts", None)
        if texts is None:
            try:
                size = len(self.tokenizer)
            except TypeError:
                return None
            vocab = getattr(self.tokenizer, "get_vocab", dict)()
            size = max(size, max(vocab.values(), default=-1) + 1)  # ids may skip numbers: len() counts tokens
            ids = [[v] for v in range(size)]
            if self._fast_decoder():  # 0.4 s for a 152k vocabulary, against ~0.7 s one call at a time
                texts = self.tokenizer.backend_tokenizer.decode_batch(ids, skip_special_tokens=True)
            else:
                texts = [self._decode(v) for v in ids]
            self._texts = texts
        return texts

    def _decode(self, ids: list[int]) -> str:
        """``tokenizer.decode(ids, skip_special_tokens=True)``, by the Rust decoder directly where it may be."""
        fast = self._fast_decoder()
        if fast:
            return fast(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _fast_decoder(self):
        """The Rust tokenizer's ``decode`` where the Python wrapper adds nothing to it (stock fast tokenizer,
        no clean-up pass: ~2.7 us less per call), else None; decided once."""
        fast = getattr(self, "_fast_decode", False)
        if fast is False:
            tok, fast = self.tokenizer, None
            try:
                from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

                if (isinstance(tok, PreTrainedTokenizerFast) and type(tok).decode is PreTrainedTokenizerBase.decode
                        and type(tok)._decode is PreTrainedTokenizerFast._decode
                        and tok.clean_up_tokenization_spaces is False):
                    fast = tok.backend_tokenizer.decode
            except (ImportError, AttributeError):
                pass
            self._fast_decode = fast
        return fast

    def _vocab_end(self) -> int | float:
        """One past the tokenizer's last id (inf where the vocabulary is unknown). A model's embedding may have
        rows past it (Qwen2.5: 151936 for 151665 tokens), which a model can sample and decoders drop."""
        texts = self._token_texts()
        return math.inf if texts is None else len(texts)

    def _silent(self, token: int) -> bool:
        """Whether a token shows no text in any decode: a special token, or an id past the vocabulary (counted
        as a byte of the stop window, three of them between "Q" and ":" hid the stop "Q:")."""
        return token in self._special_ids() or token >= self._vocab_end()

    def _special_ids(self) -> frozenset[int]:
        ids = getattr(self, "_special", None)
        if ids is None:
            from qerl_cli.runtime import special_tokens

            ids = self._special = frozenset(special_tokens(self.tokenizer).values())
        return ids

    def _text(self, s: Sequence, start: int, end: int) -> str:
        """token_ids[start:end] as text, special tokens not shown, read after up to five tokens before
        them (vLLM's prefix offset): SentencePiece-style decoders drop the first token's leading space
        ("▁Q:" alone decodes to "Q:"), so a completion decoded alone lost its space, and a stop string
        starting with one was never found at its start."""
        ids, decode = s.token_ids, self._decode
        lo = max(start - _PREFIX_TOKENS, 0)
        if lo < start:
            head = decode(ids[lo:start])
            full = decode(ids[lo:end])
            if full.startswith(head):
                return full[len(head):]
        return decode(ids[start:end])

    def _completion(self, s: Sequence, sp: SamplingParams) -> Completion:
        text = ""
        if self.tokenizer is not None:
            end = len(s)
            if isinstance(s.stop_reason, int):
                # The EOS or stop token stays in token_ids (with its logprob) but not in text, as vLLM's detokenizer
                # leaves it out; also when the tokenizer does not mark it special (skip_special_tokens kept an
                # ordinary token's text, and a stop_token_ids hit was kept on purpose, wrongly, as "vLLM's way")
                end -= 1
            text = self._text(s, s.num_prompt, end)
            if isinstance(s.stop_reason, str):
                text = text[:_stop_cut(text, self._text(s, s.num_prompt, end - 1), sp.stop)]
            else:  # a character the length limit cut short decodes to U+FFFD; vLLM holds such bytes back too
                text = text.rstrip("\ufffd")
        return Completion(token_ids=list(s.completion_ids), logprobs=list(s.logprobs), text=text,
                          finish_reason=s.finish_reason or "length", stop_reason=s.stop_reason)


def _stop_cut(text: str, before: str, stops: tuple[str, ...]) -> int:
    """Where ``text`` is cut: at the earliest stop string that the last token's text completes (the one
    generation stopped at; ``before``: the text without that token), else the earliest anywhere."""
    new = len(os.path.commonprefix([before, text]))
    hits = [i for x in stops if (i := text.find(x, max(0, new - len(x) + 1))) >= 0]
    hits = hits or [i for x in stops if (i := text.find(x)) >= 0]
    return min(hits, default=len(text))


def _to_host(tok: torch.Tensor, lp: torch.Tensor):
    """Start copying a step's tokens and logprobs to pinned host memory; returns (tok, lp, event)."""
    if not tok.is_cuda:
        return tok, lp, None
    ht = torch.empty(tok.shape, dtype=tok.dtype, pin_memory=True)
    hl = torch.empty(lp.shape, dtype=lp.dtype, pin_memory=True)
    ht.copy_(tok, non_blocking=True)
    hl.copy_(lp, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record()
    return ht, hl, ev


def _wait(pending):
    seqs, tok, lp, ev = pending
    if ev is not None:
        ev.synchronize()
    return seqs, tok.tolist(), lp.tolist()


def generation_eos_ids(path: Path) -> list[int]:
    """``eos_token_id`` of a generation_config.json (an id, a list of them, or none), checked as config.json's is:
    a file that was not JSON was skipped without a word (generation then ran past the model's end-of-turn token),
    and a string or object there was a traceback."""
    try:
        gen = json.loads(path.read_bytes())
    except ValueError as e:
        raise BadInputError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(gen, dict):
        raise BadInputError(f"{path}: not a JSON object")
    e = gen.get("eos_token_id")
    eos = e if isinstance(e, list) else [] if e is None else [e]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in eos):
        raise BadInputError(f"{path}: eos_token_id must be a token id or a list of them, got {e!r}")
    return eos
