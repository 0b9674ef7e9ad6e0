"""The draft model of speculative decoding ("draft_model"): a smaller model (or the target's own
weights quantized) that the driver worker runs after a step to draft the next tokens of the
requests the engine core chose (StepInput.draft_rows), greedily.

Its paged KV cache has the target's block ids: the scheduler's block tables serve both, with
num_speculative_tokens slots of lookahead for the positions the draft runs ahead. The draft
computes its KV lazily: a request's first drafting catches up over its whole context, later
ones over the tokens since (the accepted drafts and the token after them). The catch-up pass's
last row gives the first draft; num_speculative_tokens - 1 passes of one token per request give
the rest. Only a request's own catch-ups count as its draft KV: a block it found in the prefix
cache may have been filled by a request that never drafted, so its first catch-up writes the
draft KV of shared blocks again (the same tokens give the same bits).
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import torch

from ..executor.step_io import StepInput
from .model_runner import ModelRunner, check_max_positions, dummy_batch, slot_mapping


def load_draft_model(spec, config, device: torch.device, target):
    """spec: the SpeculativeConfig; config: the target's WorkerConfig; target: its ModelConfig."""
    from ..layers.crossover import calibrate
    from ..loader import load_model

    model = load_model(spec.model, config.dtype, config.load_format, device, spec.quantization)
    if model.config.vocab_size != target.vocab_size:
        raise ValueError(f"the draft model's vocabulary ({model.config.vocab_size} tokens) is not the target's "
                         f"({target.vocab_size}): they must share a tokenizer")
    calibrate(model)
    return model


class DraftModel:
    def __init__(self, model, num_blocks: int, block_size: int, num_speculative_tokens: int, max_model_len: int):
        check_max_positions("the draft model", model.config, max_model_len)
        self.runner = ModelRunner(model, num_blocks, block_size)
        self.block_size, self.k, self.max_model_len = block_size, num_speculative_tokens, max_model_len
        self.computed: dict[int, int] = {}  # by handle: tokens whose draft KV the request wrote itself
        # The last propose's time, or None when it caught a request up over more than the tokens
        # of one step (a request's first drafting: a cost paid once, not each step).
        self.seconds: float | None = 0.0

    def forget(self, handles: list[int]) -> None:
        """Finished requests, and preempted ones (their blocks went back to the pool)."""
        for handle in handles:
            self.computed.pop(handle, None)

    def propose(self, step: StepInput, states, samples: list[bool], sampled=None) -> tuple[np.ndarray, np.ndarray]:
        """Drafts for the step's requests at step.draft_rows that sampled in it (states: every
        request's SamplingState, its outputs updated). Returns every request's drafts as
        (offsets [R + 1], tokens) int32; the others get none."""
        started = time.perf_counter()
        rows = [i for i in step.draft_rows if samples[i]]
        tokens = [states[i].prompt_token_ids + states[i].output_token_ids for i in rows]
        rows = [i for i, t in zip(rows, tokens) if len(t) < self.max_model_len - 1]  # room for a draft
        tokens = [t for t in tokens if len(t) < self.max_model_len - 1]
        drafts = [[] for _ in range(step.num_reqs)]
        self._steady = True
        if rows:
            handles = step.req_handles[rows].tolist()
            table = step.block_table[rows]
            last = self._catch_up(handles, table, tokens)
            for i, t in zip(rows, self._decode(table, np.array([len(t) for t in tokens]), last)):
                drafts[i] = t
        offsets = np.cumsum([0] + [len(d) for d in drafts]).astype(np.int32)
        self.seconds = time.perf_counter() - started if self._steady else None
        return offsets, np.array([t for d in drafts for t in d], dtype=np.int32)

    @property
    def blocks_each(self) -> int:
        """The blocks a request of time_step spans: k + 1 tokens caught up, k - 1 drafts' KV."""
        return -(-(2 * self.k) // self.block_size)

    def time_step(self, n: int) -> float:
        """The seconds of a steady step's drafting for n requests whose k drafts were all accepted
        (a catch-up of k + 1 tokens each, then the passes; the last draft's copy to the host
        waits for the device), over blocks 1.. at startup: for step_costs.py."""
        step = dummy_batch(n, self.k + 1, self.block_size, self.blocks_each)
        started = time.perf_counter()
        self._decode(step.block_table, step.seq_lens, self.runner.execute(step)[0])
        return time.perf_counter() - started

    def _catch_up(self, handles: list[int], table: np.ndarray, tokens: list[list[int]]) -> torch.Tensor:
        """One pass over each request's tokens the draft has no KV of; their last rows' logits."""
        starts = [min(self.computed.get(h, 0), len(t) - 1) for h, t in zip(handles, tokens)]
        inputs = [t[s:] for s, t in zip(starts, tokens)]
        lengths = np.array([len(x) for x in inputs])
        self._steady = int(lengths.max()) <= self.k + 1
        positions = np.concatenate([np.arange(s, len(t), dtype=np.int32) for s, t in zip(starts, tokens)])
        query_start_loc = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        for h, t in zip(handles, tokens):
            self.computed[h] = len(t)
        return self.runner.execute(SimpleNamespace(
            input_ids=np.array([x for i in inputs for x in i], dtype=np.int32), positions=positions,
            slot_mapping=slot_mapping(np.repeat(table, lengths, axis=0), positions, self.block_size),
            query_start_loc=query_start_loc, seq_lens=np.array([len(t) for t in tokens], dtype=np.int32),
            block_table=table, logits_indices=query_start_loc[1:] - 1, block_copies=np.zeros(0, dtype=np.int32)))[0]

    def _decode(self, table: np.ndarray, lengths: np.ndarray, logits: torch.Tensor) -> list[list[int]]:
        """Greedy drafts from the catch-up's logits: k per request, fewer near max_model_len."""
        drafts = [[] for _ in lengths]
        live = np.arange(len(lengths))
        positions = lengths.astype(np.int32)  # where each next draft token goes in
        for j in range(self.k):
            tokens = logits.argmax(dim=-1).to(torch.int32).cpu().numpy()
            for row, token in zip(live.tolist(), tokens.tolist()):
                drafts[row].append(token)
            keep = positions < self.max_model_len - 1  # the next draft's position stays inside the model
            live, positions, tokens = live[keep], positions[keep], tokens[keep]
            if j == self.k - 1 or len(live) == 0:
                break
            n = len(live)
            logits = self.runner.execute(SimpleNamespace(
                input_ids=tokens, positions=positions,
                slot_mapping=slot_mapping(table[live], positions, self.block_size),
                query_start_loc=np.arange(n + 1, dtype=np.int32), seq_lens=positions + 1, block_table=table[live],
                logits_indices=np.arange(n, dtype=np.int32), block_copies=np.zeros(0, dtype=np.int32)))[0]
            positions = positions + 1
        return drafts
