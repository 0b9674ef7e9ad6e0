"""Decode steps replayed from CUDA graphs.

A decode step launches a few hundred small kernels; on a GPU their launch costs add up to more
than the work at small batches. Each padded batch size in ``BATCH_SIZES`` (up to max_num_seqs)
gets one graph, captured at startup over static input buffers. A decode-only step of B requests
copies its arrays into the buffers, pads to the next captured size and replays; padded rows
decode one token of a one-token context in the null block, and their KV writes are skipped
(slot -1). Prefill and mixed steps, and larger batches, run eagerly.

The static int32 inputs live in one device buffer mirrored by one pinned host buffer, so a
replay's inputs travel in a single asynchronous copy.
"""

from __future__ import annotations

import bisect
import time

import torch

from .. import _C
from ..layers.attention import AttentionMetadata
from .model_runner import profile_activation_bytes

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def graph_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes captured: every size below max_num_seqs and the first that holds it (256
    at most)."""
    return sorted({b for b in BATCH_SIZES if b < max_num_seqs} |
                  {next((b for b in BATCH_SIZES if b >= max_num_seqs), BATCH_SIZES[-1])})


def graph_pool_bytes(model, max_num_seqs: int, block_size: int) -> int:
    """An estimate of the graphs' private memory pool, which stays allocated beside the KV cache:
    a step of the largest size (its intermediates, which the smaller graphs' captures reuse) and
    the float32 logits each other graph keeps as its output."""
    sizes = graph_sizes(max_num_seqs)
    step = profile_activation_bytes(model, sizes[-1], sizes[-1], block_size)
    return step + sum(sizes[:-1]) * model.config.vocab_size * 4


class CudaGraphs:
    """The captured graphs of one model and their static inputs; ``run`` replays one."""

    def __init__(self, model, max_num_seqs: int, max_blocks_per_seq: int):
        self.model = model
        device = model.embed_tokens.device
        self.sizes = graph_sizes(max_num_seqs)
        largest = self.sizes[-1]

        # [input_ids | positions | slot_mapping | seq_lens] x largest, then block_tables.
        self._host = torch.zeros(4 * largest + largest * max_blocks_per_seq, dtype=torch.int32, pin_memory=True)
        host = self._host.numpy()
        host[2 * largest:3 * largest] = -1  # no KV write
        host[3 * largest:4 * largest] = 1   # one key, in block 0: the null block
        self._inputs = self._host.to(device)
        self._copied = torch.cuda.Event()
        self.input_ids, self.positions, self.slot_mapping, self.seq_lens = self._inputs[:4 * largest].view(4, largest)
        self.block_tables = self._inputs[4 * largest:].view(largest, max_blocks_per_seq)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(largest, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        start = time.perf_counter()
        pool = None
        try:
            for size in reversed(self.sizes):  # the largest first: later ones reuse its memory pool
                self._forward(size)  # warm-up outside the capture: kernels load, lazy handles are made
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    logits = self._forward(size)
                pool = graph.pool()
                self.graphs[size] = (graph, logits)
            torch.cuda.synchronize(device)
        finally:  # even after a failed capture: Octavo's kernels go back to torch's stream
            _C.set_cuda_stream(torch.cuda.current_stream().cuda_stream)  # not the capture's side stream
        self.capture_seconds = time.perf_counter() - start

    def _forward(self, size: int) -> torch.Tensor:
        _C.set_cuda_stream(torch.cuda.current_stream().cuda_stream)  # the capturing stream, in a capture
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
                                 seq_lens=self.seq_lens[:size], block_tables=self.block_tables[:size])
        hidden = self.model(self.input_ids[:size], self.positions[:size], meta)
        return self.model.compute_logits(hidden, self.logits_indices[:size])

    def run(self, out) -> torch.Tensor | None:
        """The logits of a decode-only step (one token per request), or None when the step is not
        one a graph was captured for."""
        n, table = out.num_reqs, out.block_table
        if out.total_num_scheduled_tokens != n or n > self.sizes[-1] or table.shape[1] > self.block_tables.shape[1]:
            return None
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        self._stage_inputs(out, size)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]

    def _stage_inputs(self, out, size: int) -> None:
        """Writes a step's n requests, padded to ``size``, into the pinned buffer and copies what the
        graph of that size reads. Padded rows get slot -1 and one key, in the null block; other
        table entries past the step's keep older block ids, which are never read past a row's
        seq_len."""
        self._copied.synchronize()  # the last copy has read the pinned buffer
        n, largest, width = out.num_reqs, self.sizes[-1], self.block_tables.shape[1]
        host = self._host.numpy()
        rows = host[:4 * largest].reshape(4, largest)
        for row, array in zip(rows, (out.input_ids, out.positions, out.slot_mapping, out.seq_lens)):
            row[:n] = array
        rows[2, n:size], rows[3, n:size] = -1, 1
        tables = host[4 * largest:].reshape(largest, width)
        tables[:n, :out.block_table.shape[1]] = out.block_table
        tables[n:size, 0] = 0  # padded rows read their one key from the null block
        used = 4 * largest + size * width
        self._inputs[:used].copy_(self._host[:used], non_blocking=True)
        self._copied.record()
