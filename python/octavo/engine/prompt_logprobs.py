"""Prompt logprobs: the log probability of each prompt token given the tokens before it.

The hidden state at prompt position j predicts token j + 1, so a prefill chunk covering
positions [first, first + L) yields the entries of tokens first + 1 .. min(first + L, P - 1)
(P: prompt length). Requests that ask for them skip reading the prefix cache (as vLLM does):
every prompt position must go through the model. Only sample 0 of an n > 1 request records them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..outputs import Logprob


@dataclass
class PromptChunk:
    """Flat rows row .. row + (last - first) - 1 of this step's hidden states predict prompt
    tokens first + 1 .. last of ``owner`` (the engine's _Request)."""

    owner: object
    row: int
    first: int
    last: int

    def rows(self) -> np.ndarray:
        return np.arange(self.row, self.row + self.last - self.first)


def prompt_chunks(out, batch) -> list[PromptChunk]:
    """The prompt-logprob work of one scheduler step. batch: (request, sample) per scheduled
    request, in the scheduler's order; a request qualifies when it wants prompt logprobs."""
    chunks = []
    starts, positions = out.query_start_loc, out.positions
    for i, (request, sample_) in enumerate(batch):
        if request.prompt_logprobs is None or sample_.index != 0:
            continue
        begin, end = int(starts[i]), int(starts[i + 1])
        first = int(positions[begin])
        last = min(first + end - begin, len(request.prompt_token_ids) - 1)
        if last > first:  # else a decode step, or a recompute past the prompt after preemption
            chunks.append(PromptChunk(request, begin, first, last))
    return chunks


def record_prompt_logprobs(chunks: list[PromptChunk], logits: torch.Tensor, decode) -> None:
    """logits: float32 [sum of chunk rows, vocab] in chunk order. Fills each owner's
    ``prompt_logprobs`` entries: the prompt token with its rank, plus the top-k tokens (k = the
    request's prompt_logprobs; -1 = the whole vocabulary) ranked 1..k."""
    logp = torch.log_softmax(logits, dim=-1)
    at = 0
    for c in chunks:
        block = logp[at:at + c.last - c.first]
        at += c.last - c.first
        targets = torch.tensor(c.owner.prompt_token_ids[c.first + 1:c.last + 1])
        chosen = block.gather(1, targets[:, None])[:, 0]
        ranks = (block >= chosen[:, None]).sum(dim=1)  # as the sampler and vLLM count
        k = c.owner.params.prompt_logprobs
        k = block.shape[1] if k == -1 else k
        top = block.topk(k, dim=1) if k else None
        for j in range(block.shape[0]):
            token = int(targets[j])
            entry = {token: Logprob(float(chosen[j]), int(ranks[j]), decode(token))}
            if top is not None:
                for rank, (t, lp) in enumerate(zip(top.indices[j].tolist(), top.values[j].tolist()), start=1):
                    entry.setdefault(t, Logprob(lp, rank, decode(t)))
            c.owner.prompt_logprobs[c.first + 1 + j] = entry
