"""Decode steps replayed from CPU op graphs (``_C.OpGraph``), the CPU's CUDA graphs.

On the CPU a decode step of a small model is bound by Python: each of its few hundred kernel
calls costs about as much again in module calls, argument parsing and allocations (the default
model, one sequence: 45% of a step). Each batch size up to ``MAX_BATCH`` gets one graph,
recorded at startup over static input buffers: the kernel calls of the model's layers, from the
token embeddings to the final norm. A decode-only step embeds its tokens (eagerly: one lookup),
copies them and its arrays into the buffers, pads and replays; the LM head and sampling then run
as usual on the replay's hidden states. Padded rows decode one token of a one-token context in
the null block, and their KV writes are skipped (slot -1), as in the CUDA graphs.

Hybrid models (sliding-window and full-attention layers) get a slot mapping and a block table per
KV group. A replay runs the same kernels on the same memory as the recording: its results are an
eager step's of the same padded batch (a float kernel may sum the odd row of an unpadded batch in
another order: the logits' last bits). A forward pass that computes anything in torch (not in
Octavo's kernels) cannot be replayed so: the recording checks every torch op it sees and refuses.
Such a model runs eagerly, and batch sizes from which a product runs in torch (where torch's GEMM
takes over, layers/crossover.py) keep no graph.
"""

from __future__ import annotations

import bisect
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .. import _C
from ..layers.attention import AttentionMetadata
from .cuda_graphs import graph_sizes

# Each graph keeps every intermediate tensor of its forward pass (the default model: 0.84 MiB a
# row; Llama 3 8B in float32: 7.7 MB). Batches up to PADDED_BATCH replay the next recorded size,
# padded. Larger sizes, up to MAX_BATCH and while the graphs' tensors stay within MEMORY bytes,
# replay only the batches that fill them to within MAX_PADDING: a padded row costs a row's kernel
# time, which at these sizes is about what the graph saves in Python (the default model's decode
# step of 64 rows with gguf_a8: 77 ms eager, 71 ms replayed).
PADDED_BATCH = 8
MAX_BATCH = 64
MEMORY = 256 << 20
MAX_PADDING = 1 / 8

_ALLOCATIONS = {torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default}


class NotRecordable(RuntimeError):
    """The forward pass did arithmetic in torch, which a replay would not repeat."""


class _KernelsOnly(TorchDispatchMode):
    """Lets through the torch ops a replay does not need to repeat (allocations, and views or
    no-op conversions of an existing tensor); raises NotRecordable on any other."""

    allocated = 0  # bytes

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Else torch wraps __torch_dispatch__ to keep Dynamo out of it, which imports Dynamo on the
        # first call: a second of startup. Nothing here compiles.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.allocated += out.untyped_storage().nbytes()
            return out
        if not func._schema.is_mutable and _aliases(out, args):
            return out
        raise NotRecordable(f"the forward pass computes {func} in torch")


def _aliases(out, args) -> bool:
    """Whether every tensor out is a view of args[0]'s memory."""
    if not args or not isinstance(args[0], torch.Tensor):
        return False
    outs = out if isinstance(out, (list, tuple)) else [out]
    storage = args[0].untyped_storage().data_ptr()
    return all(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() == storage for t in outs)


class CpuGraphs:
    """The recorded graphs of one model and their static inputs; ``run`` replays one."""

    def __init__(self, model, max_num_seqs: int, max_blocks_per_seq: int, num_kv_groups: int = 1):
        self.model = model
        self.sizes = graph_sizes(min(max_num_seqs, MAX_BATCH))
        largest = self.sizes[-1]
        int32 = dict(dtype=torch.int32)
        self.input_ids = torch.zeros(largest, **int32)
        self.positions = torch.zeros(largest, **int32)
        # Per KV group (hybrid models: one per attention type, kv_groups.py; group 0 first).
        self.slot_mappings = torch.full((num_kv_groups, largest), -1, **int32)  # padded rows write no KV
        self.block_tables = torch.zeros(num_kv_groups, largest, max_blocks_per_seq, **int32)
        self.seq_lens = torch.ones(largest, **int32)  # and read one key of the null block
        self.query_start_loc = torch.arange(largest + 1, **int32)
        self.embeds = torch.zeros(largest, model.config.hidden_size, dtype=model.dtype)
        self.indices = torch.arange(largest)
        self.graphs: dict[int, tuple[_C.OpGraph, torch.Tensor]] = {}
        self.nbytes = 0  # of the tensors the graphs allocated (and keep)
        start = time.perf_counter()
        row_bytes = 0  # of the last graph recorded
        for size in self.sizes:
            if size > PADDED_BATCH and self.nbytes + row_bytes * size > MEMORY:
                break
            try:
                before = self.nbytes
                self.graphs[size] = self._record(size)
                row_bytes = (self.nbytes - before) // size
            except NotRecordable:
                # From some batch size on, a product may run in torch (layers/crossover.py): the
                # sizes below it keep their graphs.
                if not self.graphs:
                    raise
                break
        self.sizes = sorted(self.graphs)
        self.capture_seconds = time.perf_counter() - start

    def _record(self, size: int) -> tuple[_C.OpGraph, torch.Tensor]:
        groups = [AttentionMetadata(slot_mapping=slots[:size], query_start_loc=self.query_start_loc[:size + 1],
                                    seq_lens=self.seq_lens[:size], block_tables=table[:size], num_decodes=size)
                  for slots, table in zip(self.slot_mappings, self.block_tables)]
        meta = groups[0]
        if len(groups) > 1:
            meta.groups = groups
        graph, mode = _C.OpGraph(), _KernelsOnly()
        with mode:
            graph.begin_capture()
            try:
                hidden = self.model(None, self.positions[:size], meta, inputs_embeds=self.embeds[:size])
            finally:
                graph.end_capture()
        self.nbytes += mode.allocated
        return graph, hidden

    def run(self, out, logits_out: torch.Tensor | None = None) -> torch.Tensor | None:
        """The logits of a decode-only step (one token per request), or None when the step is not
        one a graph was recorded for."""
        n, table = out.num_reqs, out.block_table
        if out.total_num_scheduled_tokens != n or n > self.sizes[-1] or table.shape[1] > self.block_tables.shape[2]:
            return None
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        if size > PADDED_BATCH and size - n > n * MAX_PADDING:
            return None
        self._stage_inputs(out, size)
        graph, hidden = self.graphs[size]
        graph.replay()
        return self.model.compute_logits(hidden[:n], self.indices[:n], logits_out)

    def _stage_inputs(self, out, size: int) -> None:
        """The step's n requests into the static buffers, rows n.. size padded. Table entries past
        a row's own keep older block ids, which are never read past its seq_len."""
        n, width = out.num_reqs, out.block_table.shape[1]
        for buffer, array in zip((self.input_ids, self.positions, self.seq_lens),
                                 (out.input_ids, out.positions, out.seq_lens)):
            buffer.numpy()[:n] = array
        slots, tables = self.slot_mappings.numpy(), self.block_tables.numpy()
        slots[0, :n], tables[0, :n, :width] = out.slot_mapping, out.block_table
        if len(slots) > 1:
            slots[1:, :n], tables[1:, :n, :width] = out.group_slot_mappings, out.group_block_tables
        slots[:, n:size], tables[:, n:size, 0] = -1, 0
        self.seq_lens[n:size] = 1
        self.embeds[:n] = self.model.embed(self.input_ids[:n])
        self.embeds[n:size] = 0  # the layers overwrite their input: padded rows start again from zeros
