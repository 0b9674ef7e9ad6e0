"""Decode steps replayed from CUDA graphs.

A decode step launches a few hundred small kernels; on a GPU their launch costs add up to more
than the work at small batches. Each padded batch size in ``BATCH_SIZES`` (up to max_num_seqs)
gets one graph, captured at startup over static input buffers. A decode-only step of B requests
copies its arrays into the buffers, pads to the next captured size and replays; padded rows
decode one token of a one-token context in the null block, and their KV writes are skipped
(slot -1). Prefill and mixed steps, and larger batches, run eagerly.
"""

from __future__ import annotations

import bisect
import time

import numpy as np
import torch

from .. import _C
from ..layers.attention import AttentionMetadata

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class CudaGraphs:
    """The captured graphs of one model and their static inputs; ``run`` replays one."""

    def __init__(self, model, max_num_seqs: int, max_blocks_per_seq: int):
        self.model = model
        device = model.embed_tokens.device
        # Every size below max_num_seqs and the first that holds it (256 at most).
        self.sizes = sorted({b for b in BATCH_SIZES if b < max_num_seqs} |
                            {next((b for b in BATCH_SIZES if b >= max_num_seqs), BATCH_SIZES[-1])})
        largest = self.sizes[-1]

        def buffer(*shape, fill):
            return torch.full(shape, fill, dtype=torch.int32, device=device)

        self.input_ids, self.positions = buffer(largest, fill=0), buffer(largest, fill=0)
        self.slot_mapping = buffer(largest, fill=-1)
        self.seq_lens = buffer(largest, fill=1)
        self.block_tables = buffer(largest, max_blocks_per_seq, fill=0)  # 0: the null block
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(largest, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        start = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):  # the largest first: later ones reuse its memory pool
            self._forward(size)  # warm-up: kernels load, workspaces grow, outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = (graph, logits)
        torch.cuda.synchronize(device)
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
        for buffer, array in ((self.input_ids, out.input_ids), (self.positions, out.positions),
                              (self.slot_mapping, out.slot_mapping), (self.seq_lens, out.seq_lens)):
            buffer[:n].copy_(torch.from_numpy(np.array(array)))
        self.slot_mapping[n:size].fill_(-1)
        self.seq_lens[n:size].fill_(1)
        self.block_tables[:n, :table.shape[1]].copy_(torch.from_numpy(np.array(table)))
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[:n]
