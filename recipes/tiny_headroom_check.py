#!/usr/bin/env python
"""Sanity check of the bundled task's RL headroom, independent of qerl's stages.

A minimal GRPO loop written with plain transformers + PEFT LoRA (no qerl engine, no NVFP4, no
AQN): sample G completions per prompt at temperature 1, reward 1 if ``#### N`` is right, group-
normalised advantages, token-mean policy-gradient loss (on-policy, one update per batch, so the
PPO ratio is 1 and clipping never acts). It answers one question for docs/tiny-model.md: can a
few minutes of CPU GRPO raise the bundled model's greedy test pass@1 by >= 15 points? The real
loop is ``qerl rollout`` -> ``qerl train-step`` (recipes/quickstart.sh).

    python recipes/tiny_headroom_check.py --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "recipes"))

from pretrain_tiny import pass_at_k  # noqa: E402

from qerl_cli.assets import tiny_model_dir, tiny_task_file  # noqa: E402
from qerl_cli.tasks import arith  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("-G", "--num-generations", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--lora-rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=5)
    args = ap.parse_args(argv)

    import peft
    import transformers

    transformers.logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)

    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir())
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32)
    cfg = peft.LoraConfig(r=args.lora_rank, lora_alpha=args.lora_rank, lora_dropout=0.0,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    model = peft.get_peft_model(base, cfg)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.0)

    train = [json.loads(x) for x in tiny_task_file("train").read_text().splitlines()]
    test = [json.loads(x) for x in tiny_task_file("test").read_text().splitlines()]

    def greedy():
        model.eval()
        return pass_at_k(model, tok, test)[0]

    log = {"greedy_pass@1": [(0, greedy())]}
    print(f"step 0: greedy test pass@1 {log['greedy_pass@1'][-1][1]:.3f}", flush=True)
    t0 = time.time()
    for step in range(1, args.steps + 1):
        rows = rng.sample(train, args.prompts)
        model.eval()
        tok.padding_side = "left"
        enc = tok([r["prompt"] for r in rows], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(**enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=40,
                                 num_return_sequences=args.num_generations, pad_token_id=tok.pad_token_id)
        plen = enc["input_ids"].shape[1]
        comp = gen[:, plen:]
        texts = tok.batch_decode(comp, skip_special_tokens=True)
        answers = [r["answer"] for r in rows for _ in range(args.num_generations)]
        reward = torch.tensor([float(arith.is_correct(t, a)) for t, a in zip(texts, answers)])
        g = reward.view(args.prompts, args.num_generations)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-4)).view(-1)
        # completion mask: tokens up to and including the first EOS
        is_eos = comp == tok.eos_token_id
        after = (is_eos.cumsum(1) - is_eos.long()) > 0
        cmask = (~after) & (comp != tok.pad_token_id)
        attn = torch.cat([enc["attention_mask"].repeat_interleave(args.num_generations, 0), cmask.long()], 1)
        model.train()
        logits = model(input_ids=gen, attention_mask=attn).logits[:, plen - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, comp.unsqueeze(-1)).squeeze(-1)
        loss = -(logp * adv.unsqueeze(1) * cmask).sum() / cmask.sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        print(f"step {step}: reward {reward.mean():.3f}  {time.time() - t0:.0f}s", flush=True)
        if step % args.eval_every == 0 or step == args.steps:
            log["greedy_pass@1"].append((step, greedy()))
            print(f"step {step}: greedy test pass@1 {log['greedy_pass@1'][-1][1]:.3f}", flush=True)
    log["seconds"] = round(time.time() - t0, 1)
    log["args"] = vars(args)
    print(json.dumps(log))


if __name__ == "__main__":
    main()
