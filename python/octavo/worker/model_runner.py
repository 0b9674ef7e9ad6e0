"""One forward pass per scheduler step, over a KV cache the runner owns."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import torch

from .. import _C
from ..distributed.parallel_state import recv_from_previous_stage, send_to_next_stage
from ..kv_cache import empty_kv_cache
from ..kv_groups import KVGroups, plan_kv_groups
from ..layers.attention import AttentionMetadata
from ..layers.linear import QuantizedWeight
from .staging import Staging


def kv_cache_block_bytes(model, block_size: int, groups: KVGroups | None = None,
                         dtype: torch.dtype | None = None) -> int:
    """Bytes one block takes across the KV tensors (K and V) on this rank (its KV heads): one
    per layer, or one per layer of a group (``groups``: a hybrid model's, kv_groups.py), in
    ``dtype`` (default: the model's)."""
    c = model.config
    elem = torch.empty((), dtype=dtype or model.dtype).element_size()
    num_tensors = groups.size if groups is not None else len(model.layers)
    return 2 * num_tensors * model.shard.num_kv_heads * block_size * c.head_dim * elem


# Prompt-logprob rows whose logits are made on the device at once: with a step's sampled rows,
# what the KV budget leaves room for (worker/gpu_memory.py).
PROMPT_LOGITS_ROWS = 256


class ModelRunner:
    """Holds the model and its paged KV cache; ``execute`` runs one step and returns the logits
    of the tokens the scheduler wants sampled (on the model's device). A pipeline stage before
    the last sends its activations on and returns no logits."""

    def __init__(self, model, num_blocks: int, block_size: int, groups: KVGroups | None = None,
                 kv_dtype: torch.dtype | None = None):
        """kv_dtype: what the cache holds (default: the model's dtype; kv_cache.kv_cache_dtype)."""
        self.model, self.num_blocks, self.block_size = model, num_blocks, block_size
        self.kv_dtype = kv_dtype or model.dtype
        self.device = model.embed_tokens.device
        self.cuda_graphs = None  # see capture_cuda_graphs
        self.cpu_graphs = None   # see record_cpu_graphs
        self._logits = None      # see logits_out
        # An EAGLE head reads each step's hidden states (its final rows: ``hidden``; the model's
        # aux_hidden_states), so such steps run eagerly.
        self.keep_hidden, self.hidden = False, None
        self.staging = Staging(self.device)
        use_device(self.device)
        c = model.config
        shape = (num_blocks, model.shard.num_kv_heads, block_size, c.head_dim)
        layers = model.attention_layers()
        self.groups = groups or plan_kv_groups([0] * len(layers))
        # Group g's i-th layer reads and writes KV tensor pair i through group g's block table.
        for i in range(self.groups.size):
            cache = tuple(empty_kv_cache(shape, self.kv_dtype, self.device) for _ in "kv")
            for g, members in enumerate(self.groups.layers):
                layers[members[i]].kv_cache, layers[members[i]].kv_group = cache, g

    def _plan(self, out) -> np.ndarray:
        """The CUDA attention kernels' batch layout (plan_paged_attention)."""
        s = self.model.shard
        plan = np.empty(len(out.query_start_loc), dtype=np.int32)
        _C.ops.plan_paged_attention(plan, np.array(out.query_start_loc), s.num_heads, s.num_kv_heads)
        return plan

    @torch.inference_mode()
    def capture_cuda_graphs(self, max_num_seqs: int, max_blocks_per_seq: int) -> float:
        """Captures the decode graphs (worker/cuda_graphs.py); returns the seconds it took."""
        from .cuda_graphs import CudaGraphs

        use_device(self.device)
        self.cuda_graphs = CudaGraphs(self.model, max_num_seqs, max_blocks_per_seq)
        return self.cuda_graphs.capture_seconds

    @torch.inference_mode()
    def record_cpu_graphs(self, max_num_seqs: int, max_blocks_per_seq: int) -> float:
        """Records the decode graphs (worker/cpu_graphs.py); returns the seconds it took. Raises
        cpu_graphs.NotRecordable for a model whose forward pass computes in torch."""
        from .cpu_graphs import CpuGraphs

        self.cpu_graphs = CpuGraphs(self.model, max_num_seqs, max_blocks_per_seq, len(self.groups.windows))
        return self.cpu_graphs.capture_seconds

    @torch.inference_mode()
    def execute(self, out, extra_rows: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """out: a SchedulerOutput -> float32 logits [num_reqs, vocab] in batch order (on the
        model's device), and those of the flat token rows ``extra_rows`` when given (prompt
        logprobs; on the CPU, made PROMPT_LOGITS_ROWS rows at a time so that a long prompt's
        logits never sit on the device at once)."""
        use_device(self.device)
        if len(out.block_copies):
            self.copy_blocks(out.block_copies)
        n = len(out.logits_indices)
        if (self.cuda_graphs or self.cpu_graphs) is not None and extra_rows is None and not self.keep_hidden:
            logits = self.cuda_graphs.run(out) if self.cuda_graphs else self.cpu_graphs.run(out, self.logits_out(n))
            if logits is not None:
                return logits, None
        indices = out.logits_indices if extra_rows is None else np.concatenate([out.logits_indices, extra_rows])
        input_ids, positions, meta, indices = self.inputs(out, indices)
        hidden = self._forward(input_ids, positions, meta)
        if hidden is None:  # a stage before the last
            return None, None
        if self.keep_hidden:
            self.hidden = hidden
        logits = self.model.compute_logits(hidden, indices[:n], self.logits_out(n))
        if extra_rows is None:
            return logits, None
        extra = indices[n:]
        return logits, torch.cat([self.model.compute_logits(hidden, extra[i:i + PROMPT_LOGITS_ROWS]).cpu()
                                  for i in range(0, len(extra), PROMPT_LOGITS_ROWS)])

    def logits_out(self, rows: int) -> torch.Tensor | None:
        """Where a step's logits go on the CPU when the LM head is quantized (its product writes
        into it): one float32 buffer, grown to the most rows a step has had. A fresh tensor each
        step (Gemma 3's 64 x 262144 logits are 67 MB) paid a page fault and the OS's zeroing for
        every page: 26 ms of a 70 ms LM head. The logits are read within the step (sampling)."""
        head = getattr(self.model, "lm_head", None)
        if self.device.type != "cpu" or self.model.dtype != torch.float32 or not isinstance(head, QuantizedWeight):
            return None
        if self._logits is None or self._logits.shape[0] < rows:
            self._logits = torch.empty(rows, head.shape[0])
        return self._logits[:rows]

    def inputs(self, out, indices: np.ndarray):
        """A step's arrays on the device: (input_ids, positions, AttentionMetadata, indices)."""
        # The scheduler's arrays are read-only views of its buffers, valid until its next step:
        # staging copies them.
        arrays = [out.input_ids, out.positions, out.slot_mapping, out.query_start_loc, out.seq_lens, out.block_table,
                  indices.astype(np.int64)]
        if self.device.type == "cuda":  # the CPU kernel needs no plan
            arrays.append(self._plan(out))
        hybrid = len(getattr(out, "group_block_tables", ())) > 0  # dummy steps have one group
        if hybrid:
            arrays += [out.group_slot_mappings, out.group_block_tables]
        input_ids, positions, slot_mapping, query_start_loc, seq_lens, block_tables, indices, *rest = \
            self.staging.to_device(*arrays)
        plan = rest.pop(0) if self.device.type == "cuda" else None
        meta = AttentionMetadata(slot_mapping=slot_mapping, query_start_loc=query_start_loc, seq_lens=seq_lens,
                                 block_tables=block_tables, plan=plan, num_decodes=leading_decodes(out.query_start_loc))
        if rest:  # groups 1, 2, ...: the same batch through their own block tables
            meta.groups = [meta] + [replace(meta, slot_mapping=slots, block_tables=table)
                                    for slots, table in zip(*rest)]
        return input_ids, positions, meta, indices

    def copy_blocks(self, pairs: np.ndarray) -> None:
        """Partial-block cache hits: each (src, dst) pair's KV, every layer's K and V, before the
        step reads it (the scheduler holds src until the step ends)."""
        pairs = torch.from_numpy(np.asarray(pairs, dtype=np.int64).reshape(-1, 2)).to(self.device)
        src, dst = pairs[:, 0], pairs[:, 1]
        for attn in self.model.attention_layers():
            for cache in attn.kv_cache:
                cache.index_copy_(0, dst, cache.index_select(0, src))

    def _forward(self, input_ids, positions, meta) -> torch.Tensor | None:
        """The model's part on this stage: hidden states on the last stage, else None (the
        activations went to the next stage; a failure goes there too, so that it does not wait)."""
        stage = self.model.stage
        if stage.world == 1:
            return self.model(input_ids, positions, meta)
        try:
            intermediate = None if stage.is_first else recv_from_previous_stage(
                (2, len(input_ids), self.model.config.hidden_size), self.model.dtype)
            hidden = self.model(input_ids, positions, meta, intermediate)
        except BaseException:
            if not stage.is_last:
                send_to_next_stage(None)
            raise
        if stage.is_last:
            return hidden
        send_to_next_stage(hidden)
        return None

    @torch.inference_mode()
    def warm_up(self, num_tokens: int, num_logits: int) -> None:
        """Runs the largest step once over the real cache (blocks 1.., unused at startup), so that
        torch's allocator holds what such a step needs before any request arrives, and a GPU that
        cannot fit it fails here rather than mid-run."""
        self.execute(dummy_step(num_tokens, num_logits, self.block_size))

    def release(self) -> None:
        """Drops the KV cache (a profiling runner's, before the real one is allocated)."""
        for attn in self.model.attention_layers():
            attn.kv_cache = None


def use_device(device: torch.device) -> None:
    """Octavo's CUDA kernels launch on this thread's current device and stream: makes them
    ``device`` and torch's current stream there (the engine may step from another thread). A
    no-op for the CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)
        _C.set_cuda_stream(torch.cuda.current_stream(device).cuda_stream)


def leading_decodes(query_start_loc: np.ndarray) -> int:
    """How many requests at the start of a step have one query token each."""
    not_one = np.flatnonzero(np.diff(query_start_loc) != 1)
    return int(not_one[0]) if len(not_one) else len(query_start_loc) - 1


def dummy_step(num_tokens: int, num_logits: int, block_size: int) -> SimpleNamespace:
    """A step of one prompt of ``num_tokens`` tokens in blocks 1.. (in order) and ``num_logits``
    sampled rows: the scheduler's output arrays, for profiling and warming up."""
    num_blocks = -(-num_tokens // block_size)
    positions = np.arange(num_tokens, dtype=np.int32)
    return SimpleNamespace(
        num_reqs=1, total_num_scheduled_tokens=num_tokens,
        input_ids=np.zeros(num_tokens, dtype=np.int32), positions=positions, slot_mapping=positions + block_size,
        query_start_loc=np.array([0, num_tokens], dtype=np.int32), seq_lens=np.array([num_tokens], dtype=np.int32),
        block_table=np.arange(1, num_blocks + 1, dtype=np.int32)[None, :],
        logits_indices=np.full(num_logits, num_tokens - 1, dtype=np.int32), block_copies=np.zeros(0, dtype=np.int32))


def slot_mapping(table: np.ndarray, positions: np.ndarray, block_size: int) -> np.ndarray:
    """Each position's KV slot in its request's block table row (table: one row per position)."""
    return (table[np.arange(len(positions)), positions // block_size] * block_size
            + positions % block_size).astype(np.int32)


def check_max_positions(what: str, config, max_model_len: int) -> None:
    """A drafter runs to max_model_len: its rotary table must reach it."""
    if config.max_position_embeddings < max_model_len:
        raise ValueError(f"{what}'s max_position_embeddings ({config.max_position_embeddings}) is below "
                         f"max_model_len ({max_model_len})")


def dummy_batch(num_reqs: int, num_tokens: int, block_size: int, blocks_each: int) -> SimpleNamespace:
    """A step of ``num_reqs`` requests of ``num_tokens`` tokens each at positions 0.., request i in
    blocks 1 + i * blocks_each.., sampling each one's last row: for timing steps at startup."""
    starts = np.arange(num_reqs + 1, dtype=np.int32) * num_tokens
    positions = np.tile(np.arange(num_tokens, dtype=np.int32), num_reqs)
    table = 1 + np.arange(num_reqs * blocks_each, dtype=np.int32).reshape(num_reqs, blocks_each)
    return SimpleNamespace(
        num_reqs=num_reqs, total_num_scheduled_tokens=len(positions), input_ids=np.zeros(len(positions), np.int32),
        positions=positions, slot_mapping=slot_mapping(np.repeat(table, num_tokens, axis=0), positions, block_size),
        query_start_loc=starts, seq_lens=np.full(num_reqs, num_tokens, dtype=np.int32), block_table=table,
        logits_indices=starts[1:] - 1, block_copies=np.zeros(0, dtype=np.int32))


def reserve_workspaces(model, max_tokens: int, max_seqs: int, max_blocks_per_seq: int, block_size: int) -> int:
    """Allocates every CUDA kernel workspace that a step of at most ``max_tokens`` tokens over at
    most ``max_seqs`` requests can need, at its largest size, on the model's device (so that the
    KV cache is sized around them and no step allocates them later); returns the bytes held."""
    c = model.config
    use_device(model.embed_tokens.device)  # new buffers are cleared on Octavo's stream
    return _C.reserve_cuda_workspaces(max_tokens=max_tokens, max_seqs=max_seqs,
                                      num_heads=model.shard.num_heads, num_kv_heads=model.shard.num_kv_heads,
                                      head_size=c.head_dim, max_blocks_per_seq=max_blocks_per_seq,
                                      block_size=block_size, vocab_size=c.vocab_size)


def profile_activation_bytes(model, num_tokens: int, num_logits: int, block_size: int) -> int:
    """Peak GPU memory a step of ``num_tokens`` tokens (one prompt) and ``num_logits`` sampled rows
    takes beyond the weights and the KV cache, measured by running one."""
    device = model.embed_tokens.device
    step = dummy_step(num_tokens, num_logits, block_size)
    runner = ModelRunner(model, step.block_table.shape[1] + 1, block_size)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    runner.execute(step)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    runner.release()
    torch.cuda.empty_cache()
    return peak
