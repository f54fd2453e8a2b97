"""ModelRunner: owns the paged KV cache and runs prefill and decode steps of the shared model.

Prefill runs the right-padded prompts of newly admitted groups as one batch (the training path's
causal SDPA) while writing their K/V into the cache; only the last prompt position goes through
``lm_head``. Decode feeds one token per running sequence and attends over its blocks. On CUDA the
decode step (model + ``lm_head``) is captured as CUDA graphs for a ladder of batch sizes and
replayed with inputs copied into static buffers: a 7B decode step is ~1,000 small kernels, whose
launch cost would otherwise rival the weight reads at small batch sizes. Block tables live on the
device, one row per sequence slot, written once at admission; the running batch's tokens and
positions live on the device too and are advanced there, so a decode step needs no host -> device
copy unless the batch changed (one small copy then).

Prefill of a prompt (continuous batching admits one each time a group finishes) replays a CUDA
graph captured for its padded length (``PREFILL_BUCKETS``): launched eagerly, a 7B prefill of 256
tokens spends ~35 ms (~52 with LoRA) of host time on ~400-800 kernel launches that keep the GPU
busy for only ~9-10 ms, and the decode batch waits all that time. More than
``PREFILL_GRAPH_MAX_GROUPS`` prompts admitted at once, or one longer than the largest bucket, run
eagerly as one padded batch. Right padding cannot change a causal prefill's real positions; the
padded positions write into the scratch block. ``QERL_PREFILL_GRAPHS=0`` turns the graphs off.

Before capturing, one dry pass of every graph's step compiles the Triton kernels they launch side by side
(``_compile_ahead``): on a machine whose kernel cache is empty, a 7B engine for 256 sequences built in 20-23 s
instead of 39-42 s (H100, docs/benchmarks.md, "Compiling ahead").
"""

from __future__ import annotations

import os
import warnings

import torch

from qerl_cli.engine.block_manager import BlockManager
from qerl_cli.engine.scheduler import Group
from qerl_cli.engine.sequence import Sequence
from qerl_cli.errors import QerlWarning
from qerl_cli.layers import fused
from qerl_cli.layers.attention import ForwardContext, set_context

try:
    from qerl_kernels import compile_ahead
except ImportError:  # no Triton (CPU-only installs): graphs, and so this, run on CUDA only
    compile_ahead = None

PREFILL_BUCKETS = (64, 128, 256, 512, 1024, 2048)
# Up to this many prompts admitted together replay one prefill graph each; more run as one eager batch,
# whose GPU time per prompt is lower (H100, 7B NVFP4, 256 tokens: one graph 8.5 ms of kernels, an
# eager batch of 4 prompts 22.9 ms of kernels but 39-49 ms of host launch time; docs/benchmarks.md).
PREFILL_GRAPH_MAX_GROUPS = 4


def prefill_buckets(max_model_len: int, max_tokens: int) -> list[int]:
    """Padded prompt lengths with a captured prefill graph: the buckets within both the engine's
    context (positions past it have no rotary entry) and max_tokens; longer prompts run eagerly."""
    return [b for b in PREFILL_BUCKETS if b <= min(max_model_len, max_tokens)]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class ModelRunner:
    def __init__(self, model, *, max_num_seqs: int, max_model_len: int, block_size: int, num_blocks: int,
                 enforce_eager: bool = False, max_prefill_tokens: int = 2048):
        self.model, self.device = model, model.device
        cfg = model.config
        self.block_size, self.max_num_seqs, self.max_model_len = block_size, max_num_seqs, max_model_len
        # +1 token: with the one-step lag a finished sequence may write one more K/V (into its reserve).
        self.max_blocks = -(-(max_model_len + 1) // block_size)
        self.kv = torch.zeros(2, cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                              dtype=model.dtype, device=self.device)
        self.bind()
        # One row per sequence slot, plus a last all-scratch row that padding entries point at.
        self.block_tables = torch.zeros(max_num_seqs + 1, self.max_blocks, dtype=torch.int32, device=self.device)
        self.use_graphs = self.device.type == "cuda" and not enforce_eager
        self.graph_sizes = graph_batch_sizes(max_num_seqs)
        self.state = torch.zeros(4, max_num_seqs, dtype=torch.long, device=self.device)  # ids, pos, slot, rng
        self.state[2].fill_(max_num_seqs)
        self.batch = self.padded = 0
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.prefill_graphs: dict[int, tuple[torch.cuda.CUDAGraph, dict]] = {}
        if self.use_graphs:
            # The model's dtype, as lm_head writes it: an fp32 copy was two more passes over [B, V] per step.
            self.static_logits = torch.zeros(max_num_seqs, cfg.vocab_size, dtype=model.dtype, device=self.device)
            buckets = prefill_buckets(max_model_len, max_prefill_tokens)
            if os.environ.get("QERL_PREFILL_GRAPHS", "1") == "0":
                buckets = []
            self._compile_ahead(buckets)
            self._capture()
            if buckets:
                self._capture_prefill(buckets)

    def bind(self) -> None:
        """Point every attention layer at this runner's cache. Called per generate: a second engine
        on the same model rebinds the layers, and this runner's graphs captured its own tensors."""
        for i, layer in enumerate(self.model.model.layers):
            layer.self_attn.k_cache, layer.self_attn.v_cache = self.kv[0, i], self.kv[1, i]

    @property
    def kv_bytes_per_token(self) -> int:
        cfg = self.model.config
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * self.kv.element_size()

    def set_block_table(self, seq: Sequence) -> None:
        # The whole row in one copy: past its own blocks it named the slot's previous occupant's, which another live
        # sequence may hold by now (a write past a reservation would have corrupted its cache). Scratch takes it.
        row = torch.full((self.block_tables.shape[1],), BlockManager.SCRATCH, dtype=torch.int32)
        row[: len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
        self.block_tables[seq.slot].copy_(row, non_blocking=False)

    # ---- prefill ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, groups: list[Group]) -> torch.Tensor:
        """Write the prompts' K/V (into child 0's blocks, shared full blocks) -> last-position logits [G, V]."""
        buckets = self._prefill_buckets(groups)
        if buckets is None:
            logits = self._prefill_eager(groups)
        else:
            logits = torch.cat([self._prefill_graphed(g, b) for g, b in zip(groups, buckets)])
        self._fork_partial_blocks(groups)
        for g in groups:
            for s in g.seqs:
                self.set_block_table(s)
        return logits

    def _prefill_buckets(self, groups: list[Group]) -> list[int] | None:
        """Each group's graph bucket, or None: eager (no graphs, more than PREFILL_GRAPH_MAX_GROUPS
        groups, or a prompt longer than the largest bucket)."""
        if len(groups) > PREFILL_GRAPH_MAX_GROUPS or not self.prefill_graphs:
            return None
        sizes = sorted(self.prefill_graphs)
        out = [next((b for b in sizes if b >= len(g.prompt_ids)), None) for g in groups]
        return None if None in out else out

    def _prefill_slots(self, g: Group, length: int) -> torch.Tensor:
        """Cache slot per position of the prompt padded to ``length`` (padding -> the scratch block)."""
        bs, p = self.block_size, len(g.prompt_ids)
        slots = torch.full((length,), BlockManager.SCRATCH * bs, dtype=torch.long)
        table = torch.tensor(g.seqs[0].block_table, dtype=torch.long)
        pos = torch.arange(p)
        slots[:p] = table[pos // bs] * bs + pos % bs
        return slots

    def _prefill_graphed(self, g: Group, bucket: int) -> torch.Tensor:
        graph, buf = self.prefill_graphs[bucket]
        p = len(g.prompt_ids)
        host = torch.zeros(3, bucket, dtype=torch.long)
        host[0, :p] = torch.tensor(g.prompt_ids)
        host[1] = self._prefill_slots(g, bucket)
        host[2, 0] = p - 1
        buf["inputs"].copy_(host.pin_memory(), non_blocking=True)
        graph.replay()
        return buf["logits"].clone()

    def _prefill_eager(self, groups: list[Group]) -> torch.Tensor:
        lens = [len(g.prompt_ids) for g in groups]
        longest = max(lens)
        ids = torch.zeros(len(groups), longest, dtype=torch.long)
        for b, g in enumerate(groups):
            ids[b, :lens[b]] = torch.tensor(g.prompt_ids)
        slots = torch.stack([self._prefill_slots(g, longest) for g in groups])
        ids, slots = ids.to(self.device), slots.view(-1).to(self.device)
        positions = torch.arange(longest, device=self.device).expand(len(groups), longest)
        set_context(ForwardContext(is_prefill=True, slot_mapping=slots))
        try:
            hidden = self.model(ids, positions)
        finally:
            set_context(None)
        last = torch.tensor(lens, device=self.device) - 1
        return self.model.compute_logits(hidden[torch.arange(len(groups), device=self.device), last])

    def _prefill_step(self, inputs: torch.Tensor) -> torch.Tensor:
        """One padded prompt's prefill from ``inputs`` [3, L] (ids, cache slots, last position at [2, 0])."""
        length = inputs.shape[1]
        positions = torch.arange(length, device=self.device)[None]
        set_context(ForwardContext(is_prefill=True, slot_mapping=inputs[1]))
        try:
            hidden = self.model(inputs[0][None], positions)
        finally:
            set_context(None)
        return self.model.compute_logits(hidden[0].index_select(0, inputs[2, :1]))

    def _capture_prefill(self, buckets: list[int]) -> None:
        """One graph per bucket, largest first, in the decode graphs' memory pool (never run concurrently).
        Warm-up and capture write K/V only into the scratch block (all slots point there)."""
        vocab = self.model.config.vocab_size
        with torch.inference_mode():
            for length in sorted(buckets, reverse=True):
                inputs = self._scratch_prefill_inputs(length)
                logits = torch.zeros(1, vocab, dtype=torch.float32, device=self.device)
                logits.copy_(self._prefill_step(inputs))  # warm up: kernels for this M, lazy caches
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, self._pool):
                    logits.copy_(self._prefill_step(inputs))
                self.prefill_graphs[length] = (graph, {"inputs": inputs, "logits": logits})
        torch.cuda.synchronize()

    def _scratch_prefill_inputs(self, length: int) -> torch.Tensor:
        """``_prefill_step`` inputs of ``length`` zero tokens whose K/V all go to the scratch block."""
        inputs = torch.zeros(3, length, dtype=torch.long, device=self.device)
        inputs[1].fill_(BlockManager.SCRATCH * self.block_size)
        return inputs

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
    # The running batch lives on the device: token, position, slot row and seed base per sequence.
    # Each step derives the cache slot and context length from them inside the (graphed) step, and
    # ``advance`` moves the batch forward on the device, so consecutive steps need nothing from the
    # host and the engine can launch step t+1 before it reads step t's tokens back.
    def load_batch(self, seqs: list[Sequence]) -> int:
        """Copy the batch's state to the device; returns the padded batch size it will run at."""
        n = len(seqs)
        b = next(x for x in self.graph_sizes if x >= n) if self.use_graphs else n
        pad = b - n
        rows = (
            [s.token_ids[-1] for s in seqs] + [0] * pad,
            [len(s) - 1 for s in seqs] + [0] * pad,
            [s.slot for s in seqs] + [self.max_num_seqs] * pad,  # padding reads/writes the scratch row
            [s.rng for s in seqs] + [0] * pad,
        )
        host = torch.tensor(rows, dtype=torch.long)
        if self.device.type == "cuda":
            host = host.pin_memory()
        self.state[:, :b].copy_(host, non_blocking=True)
        self.batch, self.padded = n, b
        self.max_context = max(len(s) for s in seqs)  # sizes the eager fallback's gather only
        return b

    def step(self) -> torch.Tensor:
        """Logits [n, V] (the model's dtype) for the loaded batch's next token."""
        b = self.padded
        if self.use_graphs:
            self.graphs[b].replay()
            return self.static_logits[: self.batch]
        with torch.inference_mode():
            return self._decode_step(self.state[0, :b], self.state[1, :b], self.state[2, :b], self.max_context)[: self.batch]

    def seeds(self) -> torch.Tensor:
        """Per-row sampling seeds for the token being drawn: seed base + its position (62-bit)."""
        n = self.batch
        return (self.state[3, :n] + self.state[1, :n] + 1) & ((1 << 62) - 1)  # = rng + len(seq), as at prefill

    def advance(self, tokens: torch.Tensor) -> None:
        """Feed the sampled tokens back as the next inputs, on the device."""
        n = self.batch
        self.state[0, :n].copy_(tokens)
        self.state[1, :n] += 1
        self.max_context += 1

    def _decode_step(self, ids, positions, slot_idx, max_context: int = 0) -> torch.Tensor:
        """Logits [B, V] in the model's dtype (the samplers compute in fp32 from them: exact)."""
        if fused.enabled(positions):
            tables, slot_mapping, context_lens = fused.decode_inputs(self.block_tables, slot_idx, positions,
                                                                     self.block_size)
        else:
            bs = self.block_size
            tables = self.block_tables.index_select(0, slot_idx)
            block = tables.gather(1, (positions // bs).unsqueeze(1)).squeeze(1).long()
            slot_mapping = block * bs + positions % bs
            context_lens = (positions + 1).to(torch.int32)
        set_context(ForwardContext(is_prefill=False, slot_mapping=slot_mapping, block_tables=tables,
                                   context_lens=context_lens, max_context_len=max_context or self.max_model_len + 1))
        try:
            hidden = self.model(ids[:, None], positions[:, None])
        finally:
            set_context(None)
        return self.model.raw_logits(hidden[:, 0])

    def _compile_ahead(self, buckets: list[int]) -> None:
        """Compile every Triton kernel the captures below will launch, side by side (compile_ahead's
        docstring): dry passes of each decode batch size and prefill bucket that launch nothing. The largest
        batch's step goes first: where it sent no kernel to the compile workers (each one they get is missing
        from Triton's on-disk cache), the others are taken to be cached too and the rest is skipped (the dry
        passes of every step cost ~4 s of host time on a 7B engine, more than loading the kernels; H100,
        docs/benchmarks.md, "Compiling ahead"). With no workers (``QERL_COMPILE_PROCESSES=0``) the same test
        waits for the first step's compiles on threads. ``QERL_COMPILE_AHEAD=0`` skips it all: each kernel
        then compiles when the warm-up first launches it."""
        if compile_ahead is None or os.environ.get("QERL_COMPILE_AHEAD", "1") == "0" or not compile_ahead.available():
            return
        sizes = list(reversed(self.graph_sizes))

        def rest():
            for b in sizes[1:]:
                self._decode_step(self.state[0, :b], self.state[1, :b], self.state[2, :b])
            for length in buckets:
                self._prefill_step(self._scratch_prefill_inputs(length))

        try:
            with torch.inference_mode(), compile_ahead.compile_only() as first:
                self._decode_step(self.state[0, :sizes[0]], self.state[1, :sizes[0]], self.state[2, :sizes[0]])
                if first.sent:
                    rest()
            if not first.sent and first.compiled != 0:
                with torch.inference_mode(), compile_ahead.compile_only():
                    rest()
        except Exception as e:  # noqa: BLE001 - an optimisation: the warm-up below compiles whatever is missing
            warnings.warn(f"compiling the engine's kernels ahead failed ({type(e).__name__}: {e}); they compile one "
                          "by one as the warm-up reaches them", QerlWarning, stacklevel=2)
        torch.cuda.synchronize()

    def _capture(self) -> None:
        pool = None
        with torch.inference_mode():
            for b in reversed(self.graph_sizes):
                args = (self.state[0, :b], self.state[1, :b], self.state[2, :b])
                self.static_logits[:b] = self._decode_step(*args)  # warm up: autotune, lazy caches
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool):
                    self.static_logits[:b] = self._decode_step(*args)
                pool = pool or g.pool()
                self.graphs[b] = g
        self._pool = pool
        torch.cuda.synchronize()
