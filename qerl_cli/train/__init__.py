"""Training building blocks for ``qerl train-step``.

Each module owns one piece and is usable alone: ``advantages`` (group-relative advantages),
``losses`` (policy-gradient loss types, PPO clipping, TIS, KL), ``logprobs`` (chunked token
log-probs with a memory-lean backward), ``batching`` (token-budget
micro-batches), ``optim`` (AdamW + warmup/cosine schedule + state files), ``state``
(``trainer_state.json``), ``metrics`` (per-step statistics, all-reducible; the step's record and
``--metrics-file``), ``distributed`` (torchrun process group and gradient all-reduce), ``inputs`` (the
stage's shards read into one step, its input hashes), ``checks`` (its flag and input checks), ``report``
(what the stage prints: progress, notes, warnings, result line).
"""
