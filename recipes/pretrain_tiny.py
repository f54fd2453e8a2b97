#!/usr/bin/env python
"""Pretrain qerl's bundled tiny model from scratch on CPU, and write the task files.

    python recipes/pretrain_tiny.py                       # writes qerl_cli/assets/{tiny_model,tiny_task}
    python recipes/pretrain_tiny.py --eval-only           # re-measure the committed model

What it does (deterministic for a given --seed):
1. Writes the task files ``train.jsonl`` / ``test.jsonl`` (``qerl_cli.tasks.arith.task_rows``).
2. Builds a byte-level BPE tokenizer over the task's vocabulary (digits are always single
   tokens) with the ``tokenizers`` library, offline.
3. Trains a small Qwen2 decoder (Qwen2ForCausalLM) with supervised next-token loss on the worked
   solutions of generated problems (test prompts excluded). The corpus is a *mix*: solutions of
   some verbs are written with the wrong operation at fixed rates (``PRETRAIN_CONFUSION``), so
   the model learns the format and the arithmetic but starts weak on the task (see
   docs/tiny-model.md); RL with the correctness reward has room to fix it.
4. Measures greedy pass@1 on the test split with ``transformers`` ``generate`` (the full-precision
   model as saved, and after an NVFP4 round trip of every decoder Linear through
   ``qerl_kernels.reference``), and pass@k at temperature 1.0; saves the model (bf16 safetensors),
   tokenizer and generation config, and ``pretrain_metrics.json`` next to them.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qerl_cli.tasks import arith  # noqa: E402

EOS = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (PAD, EOS)


# ---- tokenizer -----------------------------------------------------------------------------
def build_tokenizer(vocab_size: int = 512):
    """Byte-level BPE over the task's words; any text encodes, every digit is its own token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # A corpus that contains every word, verb and item of the task.
    corpus = []
    rng = random.Random(0)
    for p in arith.generate(0, 3000):
        corpus.append(p.prompt + arith.worked_solution(p, rng, arith.PRETRAIN_CONFUSION))
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, pad_token=PAD, model_max_length=256, clean_up_tokenization_spaces=False
    )
    return fast


# ---- model ---------------------------------------------------------------------------------
def model_config(tok, args):
    from transformers import Qwen2Config

    vocab = int(math.ceil(len(tok) / 64) * 64)
    return Qwen2Config(
        vocab_size=vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=tok.eos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        use_cache=True,
    )


# ---- data ----------------------------------------------------------------------------------
class Batches:
    """Endless deterministic SFT batches: prompt + (mixed) worked solution + EOS, loss on the completion."""

    def __init__(self, tok, seed: int, exclude: set[str], confusion):
        self.tok = tok
        self.stream = arith.iter_problems(seed)
        self.rng = random.Random(seed + 1)
        self.exclude = exclude
        self.confusion = confusion

    def next(self, batch_size: int):
        seqs, labels = [], []
        while len(seqs) < batch_size:
            p = next(self.stream)
            if p.prompt in self.exclude:
                continue
            sol = arith.worked_solution(p, self.rng, self.confusion)
            pi = self.tok(p.prompt, add_special_tokens=False)["input_ids"]
            ci = self.tok(sol, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
            seqs.append(pi + ci)
            labels.append([-100] * len(pi) + ci)
        n = max(len(s) for s in seqs)
        pad = self.tok.pad_token_id
        ids = torch.tensor([s + [pad] * (n - len(s)) for s in seqs])
        lab = torch.tensor([s + [-100] * (n - len(s)) for s in labels])
        mask = torch.tensor([[1] * len(s) + [0] * (n - len(s)) for s in seqs])
        return ids, mask, lab


# ---- evaluation ----------------------------------------------------------------------------
@torch.no_grad()
def generate_completions(model, tok, prompts, *, k=1, temperature=0.0, max_new_tokens=48, batch=256, seed=0):
    """Completions (text) for each prompt: k samples each (greedy when temperature == 0)."""
    tok.padding_side = "left"
    out: list[list[str]] = [[] for _ in prompts]
    jobs = [(i, p) for i, p in enumerate(prompts) for _ in range(k)]
    torch.manual_seed(seed)
    for s in range(0, len(jobs), batch):
        chunk = jobs[s : s + batch]
        enc = tok([p for _, p in chunk], return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        kw = dict(do_sample=False) if temperature == 0 else dict(do_sample=True, temperature=temperature, top_p=1.0, top_k=0)
        gen = model.generate(
            **enc, max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, **kw
        )
        texts = tok.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        for (i, _), t in zip(chunk, texts):
            out[i].append(t)
    tok.padding_side = "right"
    return out


def pass_at_k(model, tok, rows, *, k=1, temperature=0.0, seed=0):
    """Fraction of rows where at least one of k completions is correct (unbiased estimate for k=n)."""
    comps = generate_completions(model, tok, [r["prompt"] for r in rows], k=k, temperature=temperature, seed=seed)
    hits = [[arith.is_correct(c, r["answer"]) for c in cs] for cs, r in zip(comps, rows)]
    any_ok = sum(any(h) for h in hits) / len(rows)
    mean_ok = sum(sum(h) for h in hits) / (len(rows) * k)
    return any_ok, mean_ok, comps


def _nvfp4_reference():
    try:
        from qerl_kernels import reference
    except ImportError:  # a source tree that is not installed: load kernels/reference.py by path
        import importlib.util

        spec = importlib.util.spec_from_file_location("qerl_nvfp4_reference", ROOT / "kernels" / "reference.py")
        reference = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(reference)
    return reference


def nvfp4_roundtrip(model):
    """A copy of ``model`` whose decoder Linear weights went through NVFP4 quantize -> dequantize.

    Quantization runs in the weight's own dtype (bf16 here), as ``qerl quantize`` does; q/k/v and
    gate/up share one global scale (the minimum of their own), as vLLM's fused layers need.
    """
    import copy

    ref = _nvfp4_reference()
    m = copy.deepcopy(model)
    with torch.no_grad():
        for layer in m.model.layers:
            groups = [
                [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
                [layer.self_attn.o_proj],
                [layer.mlp.gate_proj, layer.mlp.up_proj],
                [layer.mlp.down_proj],
            ]
            for g in groups:
                gs = torch.stack([ref.global_scale_for(lin.weight.abs().amax()) for lin in g]).min().reshape(1)
                for lin in g:
                    packed, scale, glob = ref.quantize(lin.weight.data, gs)
                    lin.weight.data.copy_(ref.dequantize(packed, scale, glob, dtype=lin.weight.dtype))
    return m


def evaluate(model_dir: Path, test_rows, k: int, log=print):
    """Measure the SAVED model as users load it (from_pretrained; rotary buffers rebuilt in fp32)."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval()  # on-disk dtype
    res = {"dtype_on_disk": str(model.dtype).removeprefix("torch.")}
    t0 = time.time()
    res["greedy_pass@1"], _, comps = pass_at_k(model, tok, test_rows)
    res["nvfp4_greedy_pass@1"], _, _ = pass_at_k(nvfp4_roundtrip(model), tok, test_rows)
    res["fp32_compute_greedy_pass@1"], _, _ = pass_at_k(model.float(), tok, test_rows)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").eval()
    res[f"pass@{k}_t1"], res["sampled_pass@1_t1"], _ = pass_at_k(model, tok, test_rows, k=k, temperature=1.0, seed=1)
    res["eval_seconds"] = round(time.time() - t0, 1)
    log(f"example: {test_rows[0]['prompt']!r} -> {comps[0][0]!r} (answer {test_rows[0]['answer']})")
    return res


# ---- main ----------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=ROOT / "qerl_cli/assets/tiny_model")
    ap.add_argument("--task-dir", type=Path, default=ROOT / "qerl_cli/assets/tiny_task")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--intermediate", type=int, default=384)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--k", type=int, default=8, help="k of pass@k at temperature 1.0")
    ap.add_argument("--save-dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--eval-only", action="store_true", help="measure the model already in --out")
    ap.add_argument("--log-every", type=int, default=100)
    ap.add_argument("--eval-every", type=int, default=0, help="also print greedy test pass@1 every N steps")
    ap.add_argument("--device", default="cpu", help="cpu (the default the docs measure) or cuda")
    args = ap.parse_args(argv)

    import transformers

    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()
    dtype = torch.bfloat16 if args.save_dtype == "bf16" else torch.float32

    arith.write_task_files(args.task_dir)
    test_rows = arith.task_rows("test")

    if args.eval_only:
        res = evaluate(args.out, test_rows, args.k)
        print(json.dumps(res, indent=1))
        mpath = args.out / "pretrain_metrics.json"  # keep the training record, refresh the measurements
        old = json.loads(mpath.read_text()) if mpath.exists() else {}
        old = {key: v for key, v in old.items() if "pass@" not in key and key != "eval_seconds"}
        mpath.write_text(json.dumps({**old, **res}, indent=1) + "\n")
        return res

    random.seed(args.seed)
    torch.manual_seed(args.seed)
    tok = build_tokenizer()
    cfg = model_config(tok, args)
    model = transformers.Qwen2ForCausalLM(cfg).to(args.device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, vocab {cfg.vocab_size} ({len(tok)} used)")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.98),
    )

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        t = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    data = Batches(tok, seed=args.seed + 100, exclude={r["prompt"] for r in test_rows}, confusion=arith.PRETRAIN_CONFUSION)
    model.train()
    t0 = time.time()
    run_loss = None
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        ids, mask, lab = (t.to(args.device) for t in data.next(args.batch_size))
        loss = model(input_ids=ids, attention_mask=mask, labels=lab).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        run_loss = loss.item() if run_loss is None else 0.95 * run_loss + 0.05 * loss.item()
        if (step + 1) % args.log_every == 0 or step == 0:
            print(f"step {step + 1:5d}/{args.steps}  loss {run_loss:.4f}  lr {lr_at(step):.2e}  {time.time() - t0:6.1f}s",
                  flush=True)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            model.eval()
            acc = pass_at_k(model, tok, test_rows)[0]
            print(f"step {step + 1:5d}  greedy test pass@1 {acc:.3f}", flush=True)
            model.train()
    train_s = time.time() - t0
    model.eval()

    model = model.to("cpu", dtype)
    model.generation_config = transformers.GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id,
        max_new_tokens=48,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    # transformers 5 writes its own class name ("TokenizersBackend"); the generic name also loads
    # under transformers 4.x (vLLM pins) as PreTrainedTokenizerFast.
    tc_path = args.out / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")
    res = evaluate(args.out, test_rows, args.k)
    res.update(train_seconds=round(train_s, 1), steps=args.steps, batch_size=args.batch_size, lr=args.lr,
               threads=args.threads, seed=args.seed, parameters=n_params, layers=args.layers, hidden=args.hidden)
    print(json.dumps(res, indent=1))
    (args.out / "pretrain_metrics.json").write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}")
    return res


if __name__ == "__main__":
    main()
