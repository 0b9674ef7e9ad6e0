"""One forward pass per scheduler step, over a KV cache the runner owns."""

from __future__ import annotations

import numpy as np
import torch

from ..kv_cache import empty_kv_cache
from ..layers.attention import AttentionMetadata


def kv_cache_block_bytes(model, block_size: int) -> int:
    """Bytes one block takes across every layer (K and V)."""
    c = model.config
    elem = torch.empty((), dtype=model.dtype).element_size()
    return 2 * c.num_hidden_layers * c.num_key_value_heads * block_size * c.head_dim * elem


def _tensor(array: np.ndarray) -> torch.Tensor:
    # The scheduler's arrays are read-only views of its own buffers, valid until the next step;
    # a copy of a few KiB per step is cheaper than keeping them alive and writable.
    return torch.from_numpy(np.array(array))


class ModelRunner:
    """Holds the model and its paged KV cache; ``execute`` runs one step and returns the logits
    of the tokens the scheduler wants sampled."""

    def __init__(self, model, num_blocks: int, block_size: int):
        self.model, self.num_blocks, self.block_size = model, num_blocks, block_size
        c = model.config
        shape = (num_blocks, c.num_key_value_heads, block_size, c.head_dim)
        for attn in model.attention_layers():
            attn.kv_cache = (empty_kv_cache(shape, model.dtype), empty_kv_cache(shape, model.dtype))

    @torch.inference_mode()
    def execute(self, out, extra_rows: np.ndarray | None = None) -> torch.Tensor:
        """out: a SchedulerOutput -> float32 logits [num_reqs, vocab] in batch order, followed
        by the logits of the flat token rows ``extra_rows`` when given (prompt logprobs)."""
        meta = AttentionMetadata(slot_mapping=_tensor(out.slot_mapping), query_start_loc=_tensor(out.query_start_loc),
                                 seq_lens=_tensor(out.seq_lens), block_tables=_tensor(out.block_table))
        hidden = self.model(_tensor(out.input_ids), _tensor(out.positions), meta)
        indices = out.logits_indices if extra_rows is None else np.concatenate([out.logits_indices, extra_rows])
        return self.model.compute_logits(hidden, _tensor(indices).long())
