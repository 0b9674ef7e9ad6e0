"""EAGLE drafting (speculative decoding's "eagle" and "eagle3"): the driver worker runs the
draft head (models/llama_eagle.py) after each step, on the target's hidden states of that step.

A head's KV at position i comes from the target's hidden state at i, which only the step that
computed position i has. So the head catches up after every step, for every request, over the
step's rows whose target KV stays: a prefill chunk's rows, and a decoding request's rows up to
its last accepted draft. Row i's input token is token i + 1: the next scheduled token, the token
the step sampled after the last row, or a prefill chunk's next prompt token. Then, for the
requests the engine core chose (StepInput.draft_rows), the catch-up's last row gives the first
draft, and num_speculative_tokens - 1 passes of one token each give the rest, each from the
previous pass's output and draft token. Those passes write KV past the verified tokens, on the
num_speculative_tokens - 1 lookahead slots; the next catch-up writes those positions again.

The head's paged KV cache has the target's block ids, so the scheduler's block tables and slot
mappings serve both; partial-block prefix-cache hits copy its blocks as they copy the target's.
A block a request found in the prefix cache holds head KV from the request that computed it.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import torch

from ..executor.step_io import SamplerOutput, StepInput
from .model_runner import ModelRunner, check_max_positions, dummy_batch, slot_mapping


class EagleDrafter:
    def __init__(self, head, target_runner: ModelRunner, num_blocks: int, block_size: int,
                 num_speculative_tokens: int, max_model_len: int):
        check_max_positions("the EAGLE head", head.config, max_model_len)
        self.head, self.target = head, target_runner
        self.runner = ModelRunner(head, num_blocks, block_size)
        target_runner.keep_hidden = True
        self.block_size, self.k, self.max_model_len = block_size, num_speculative_tokens, max_model_len
        self.seconds = 0.0  # the last propose's drafting, after the catch-up

    def forget(self, handles: list[int]) -> None:
        """Nothing to forget: the head's KV follows the target's, step by step."""

    @torch.inference_mode()
    def propose(self, step: StepInput, states, samples: list[bool], sampled: SamplerOutput):
        """After the step: the head's catch-up, then drafts for step.draft_rows that sampled.
        Returns every request's drafts as (offsets [R + 1], tokens) int32."""
        self.seconds = 0.0
        if len(step.block_copies):
            self.runner.copy_blocks(step.block_copies)
        drafts = [[] for _ in range(step.num_reqs)]
        if step.num_reqs:
            counts, rows, next_tokens = _catch_up_rows(step, states, samples, sampled.per_request())
            normed, carry, newest = self._catch_up(step, counts, rows, next_tokens)
            if normed.is_cuda:  # the clock below times the drafting alone, not the catch-up's queued kernels
                torch.cuda.synchronize(normed.device)
            started = time.perf_counter()
            pick = [i for i in step.draft_rows if samples[i] and newest[i] + 2 <= self.max_model_len]
            if pick:
                last = np.cumsum(counts)[pick] - 1
                for i, tokens in zip(pick, self._decode(step.block_table[pick], newest[pick], normed, carry, last)):
                    drafts[i] = tokens
            self.seconds = time.perf_counter() - started
        offsets = np.cumsum([0] + [len(d) for d in drafts]).astype(np.int32)
        return offsets, np.array([t for d in drafts for t in d], dtype=np.int32)

    @property
    def blocks_each(self) -> int:
        """The blocks a request of time_step spans: one token caught up, k - 1 drafts' KV."""
        return -(-self.k // self.block_size)

    @torch.inference_mode()
    def time_step(self, n: int) -> float:
        """The seconds of one step's drafting for n requests (after a catch-up of one token each
        over a zero hidden state, which is not timed: it runs anyway), over blocks 1.. at
        startup: for step_costs.py."""
        step = dummy_batch(n, 1, self.block_size, self.blocks_each)
        ids, pos, meta, _ = self.runner.inputs(step, np.zeros(0, dtype=np.int64))
        hidden = torch.zeros(n, self.head.config.hidden_size, dtype=self.head.dtype, device=self.runner.device)
        normed, carry = self.head(ids, pos, hidden, meta)
        if normed.is_cuda:
            torch.cuda.synchronize(normed.device)
        started = time.perf_counter()
        self._decode(step.block_table, step.seq_lens, normed, carry, np.arange(n))
        return time.perf_counter() - started

    def _catch_up(self, step: StepInput, counts: list[int], rows: np.ndarray, next_tokens: list[int]):
        """One head pass over the step's rows ``rows`` (``counts`` per request) -> (normed, carry,
        each request's newest token's position: the tokens before it)."""
        positions = step.positions[rows]
        query_start_loc = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        seq_lens = (positions[query_start_loc[1:] - 1] + 1).astype(np.int32)
        ids, pos, meta, index = self.runner.inputs(SimpleNamespace(
            input_ids=np.asarray(next_tokens, dtype=np.int32), positions=positions,
            slot_mapping=step.slot_mapping[rows], query_start_loc=query_start_loc, seq_lens=seq_lens,
            block_table=step.block_table), rows)
        normed, carry = self.head(ids, pos, self._target_hidden(index), meta)
        return normed, carry, seq_lens

    def _target_hidden(self, index: torch.Tensor) -> torch.Tensor:
        """The first pass's hidden input at the target's rows ``index``."""
        if not self.head.eagle3:
            return self.target.hidden[index]
        return self.head.combine(torch.cat([h[index] for h in self.target.model.aux_hidden_states], dim=-1))

    def _decode(self, table: np.ndarray, newest: np.ndarray, normed, carry, last: np.ndarray) -> list[list[int]]:
        """Greedy drafts: the first from the catch-up's rows ``last``, then k - 1 one-token
        passes; draft j of a request goes at position newest + j, and stops at max_model_len."""
        device = normed.device
        tokens = self.head.greedy(normed, torch.from_numpy(last).to(device))
        hidden = carry[torch.from_numpy(last).to(device)]
        drafts = [[t] for t in tokens.tolist()]
        live = np.arange(len(newest))
        for j in range(1, self.k):
            keep = newest[live] + j + 1 < self.max_model_len  # draft j + 1's position inside the model
            if not keep.all():
                hidden, tokens = hidden[torch.from_numpy(keep).to(device)], tokens[torch.from_numpy(keep).to(device)]
                live = live[keep]
            if len(live) == 0:
                break
            positions = (newest[live] + j - 1).astype(np.int32)  # draft j's input row sits after draft j - 1
            n = len(live)
            ids, pos, meta, _ = self.runner.inputs(SimpleNamespace(
                input_ids=tokens.to(torch.int32).cpu().numpy(), positions=positions,
                slot_mapping=slot_mapping(table[live], positions, self.block_size),
                query_start_loc=np.arange(n + 1, dtype=np.int32), seq_lens=positions + 1, block_table=table[live]),
                np.zeros(0, dtype=np.int64))
            normed, hidden = self.head(ids, pos, hidden, meta)
            tokens = self.head.greedy(normed, torch.arange(n, device=device))
            for row, token in zip(live.tolist(), tokens.tolist()):
                drafts[row].append(token)
        return drafts


def _catch_up_rows(step: StepInput, states, samples: list[bool], sampled: list[list[int]]):
    """The step's rows whose target KV stays, with each row's next token: (rows per request,
    flat row indices, next tokens)."""
    starts = step.query_start_loc.tolist()
    ids, num_drafts = step.input_ids, step.num_draft_tokens.tolist()
    counts, rows, next_tokens = [], [], []
    for i, state in enumerate(states):
        a, b = starts[i], starts[i + 1]
        if samples[i]:  # its verified tokens, then the token after them
            n, after = b - a - num_drafts[i] + len(sampled[i]) - 1, sampled[i][-1]
        else:  # a prefill chunk: the prompt (or a preempted request's tokens) goes on
            n = b - a
            at = int(step.seq_lens[i]) - len(state.prompt_token_ids)
            after = state.prompt_token_ids[step.seq_lens[i]] if at < 0 else state.output_token_ids[at]
        counts.append(n)
        rows.append(np.arange(a, a + n))
        next_tokens += ids[a + 1:a + n].tolist() + [after]
    return counts, np.concatenate(rows), next_tokens
