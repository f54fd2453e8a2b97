"""ModelRunner: owns the paged KV cache and runs prefill and decode steps of the shared model.

Prefill runs the right-padded prompts of newly admitted groups as one batch (the training path's
causal SDPA) while writing their K/V into the cache; only the last prompt position goes through
``lm_head``. Decode feeds one token per running sequence and attends over its blocks. On CUDA the
decode step (model + ``lm_head``) is captured as CUDA graphs for a ladder of batch sizes and
replayed with inputs copied into static buffers: a 7B decode step is ~1,000 small kernels, whose
launch cost would otherwise rival the weight reads at small batch sizes. Block tables live on the
device, one row per sequence slot, written once at admission; each step only ships five int64
vectors host -> device in one copy.
"""

from __future__ import annotations

import torch

from qerl_cli.engine.block_manager import BlockManager
from qerl_cli.engine.scheduler import Group
from qerl_cli.engine.sequence import Sequence
from qerl_cli.layers.attention import ForwardContext, set_context


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class ModelRunner:
    def __init__(self, model, *, max_num_seqs: int, max_model_len: int, block_size: int, num_blocks: int,
                 enforce_eager: bool = False):
        self.model, self.device = model, model.device
        cfg = model.config
        self.block_size, self.max_num_seqs, self.max_model_len = block_size, max_num_seqs, max_model_len
        self.max_blocks = -(-max_model_len // block_size)
        self.kv = torch.zeros(2, cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                              dtype=model.dtype, device=self.device)
        for i, layer in enumerate(model.model.layers):
            layer.self_attn.k_cache, layer.self_attn.v_cache = self.kv[0, i], self.kv[1, i]
        self.block_tables = torch.zeros(max_num_seqs, self.max_blocks, dtype=torch.int32, device=self.device)
        self.use_graphs = self.device.type == "cuda" and not enforce_eager
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if self.use_graphs:
            self._capture()

    @property
    def kv_bytes_per_token(self) -> int:
        cfg = self.model.config
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * self.kv.element_size()

    def set_block_table(self, seq: Sequence) -> None:
        row = torch.tensor(seq.block_table, dtype=torch.int32)
        self.block_tables[seq.slot, : len(row)].copy_(row, non_blocking=False)

    # ---- prefill ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, groups: list[Group]) -> torch.Tensor:
        """Write the prompts' K/V (into child 0's blocks, shared full blocks) -> last-position logits [G, V]."""
        bs = self.block_size
        lens = [len(g.prompt_ids) for g in groups]
        longest = max(lens)
        ids = torch.zeros(len(groups), longest, dtype=torch.long)
        slots = torch.full((len(groups), longest), BlockManager.SCRATCH * bs, dtype=torch.long)
        for b, g in enumerate(groups):
            p = lens[b]
            ids[b, :p] = torch.tensor(g.prompt_ids)
            table = torch.tensor(g.seqs[0].block_table, dtype=torch.long)
            pos = torch.arange(p)
            slots[b, :p] = table[pos // bs] * bs + pos % bs
        ids, slots = ids.to(self.device), slots.view(-1).to(self.device)
        positions = torch.arange(longest, device=self.device).expand(len(groups), longest)
        set_context(ForwardContext(is_prefill=True, slot_mapping=slots))
        try:
            hidden = self.model(ids, positions)
        finally:
            set_context(None)
        last = torch.tensor(lens, device=self.device) - 1
        logits = self.model.compute_logits(hidden[torch.arange(len(groups), device=self.device), last])
        self._fork_partial_blocks(groups)
        for g in groups:
            for s in g.seqs:
                self.set_block_table(s)
        return logits

    def _fork_partial_blocks(self, groups: list[Group]) -> None:
        """Copy each prompt's partial last block from child 0 to its siblings (full blocks are shared)."""
        src, dst = [], []
        for g in groups:
            p = len(g.prompt_ids)
            if p % self.block_size == 0:
                continue
            k = p // self.block_size
            for s in g.seqs[1:]:
                src.append(g.seqs[0].block_table[k])
                dst.append(s.block_table[k])
        if src:
            src_t = torch.tensor(src, device=self.device)
            dst_t = torch.tensor(dst, device=self.device)
            self.kv[:, :, dst_t] = self.kv[:, :, src_t]

    # ---- decode ----------------------------------------------------------------------------------
    def _decode_inputs(self, seqs: list[Sequence], pad_to: int) -> torch.Tensor:
        # Built as Python lists and shipped in one pinned host -> device copy: per-element tensor
        # writes cost ~5 us each, which at 256 sequences was milliseconds per step.
        bs = self.block_size
        pad = pad_to - len(seqs)
        pos = [len(s) - 1 for s in seqs]
        rows = (
            [s.token_ids[-1] for s in seqs] + [0] * pad,
            pos + [0] * pad,
            [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, pos)] + [BlockManager.SCRATCH * bs] * pad,
            [p + 1 for p in pos] + [1] * pad,  # padding entries: context 1, scratch slot, slot 0's table
            [s.slot for s in seqs] + [0] * pad,
        )
        host = torch.tensor(rows, dtype=torch.long)
        if self.device.type == "cuda":
            host = host.pin_memory()
        return host.to(self.device, non_blocking=True)

    def _decode_step(self, ids, positions, slot_mapping, context_lens, slot_idx, max_context_len=0) -> torch.Tensor:
        tables = self.block_tables.index_select(0, slot_idx)
        set_context(ForwardContext(is_prefill=False, slot_mapping=slot_mapping, block_tables=tables,
                                   context_lens=context_lens, max_context_len=max_context_len))
        try:
            hidden = self.model(ids[:, None], positions[:, None])
        finally:
            set_context(None)
        return self.model.compute_logits(hidden[:, 0])

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One new token per sequence -> logits [len(seqs), V] (fp32)."""
        n = len(seqs)
        if not self.use_graphs:
            r = self._decode_inputs(seqs, n)
            return self._decode_step(r[0], r[1], r[2], r[3].int(), r[4], max(len(s) for s in seqs))
        b = next(x for x in self.graph_sizes if x >= n)
        self.static_inputs[:, :b].copy_(self._decode_inputs(seqs, b))
        self.static_inputs_i32[:b].copy_(self.static_inputs[3, :b])
        self.graphs[b].replay()
        return self.static_logits[:n]

    def _capture(self) -> None:
        self.graph_sizes = graph_batch_sizes(self.max_num_seqs)
        m = self.max_num_seqs
        self.static_inputs = torch.zeros(5, m, dtype=torch.long, device=self.device)
        self.static_inputs[3].fill_(1)
        self.static_inputs_i32 = torch.ones(m, dtype=torch.int32, device=self.device)
        self.static_logits = torch.zeros(m, self.model.config.vocab_size, dtype=torch.float32, device=self.device)
        pool = None
        with torch.inference_mode():
            for b in reversed(self.graph_sizes):
                x = self.static_inputs[:, :b]
                args = (x[0], x[1], x[2], self.static_inputs_i32[:b], x[4])
                self.static_logits[:b] = self._decode_step(*args)  # warm up: autotune, lazy caches
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool):
                    self.static_logits[:b] = self._decode_step(*args)
                pool = pool or g.pool()
                self.graphs[b] = g
        torch.cuda.synchronize()
