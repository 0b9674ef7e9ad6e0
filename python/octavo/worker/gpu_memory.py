"""How an engine spends a GPU's memory, decided before the first request.

As vLLM sizes it, the engine may use ``gpu_memory_utilization`` of the device's memory; what is
in use already comes off it (the weights, other processes, and the kernels' workspaces, which
are reserved first at the largest step's size), and so does what the steps will take beside the
KV cache, measured by running them: a step's activation peak (a full token budget, with the
logits of its sampled rows and of one batch of prompt-logprob rows) and the decode graphs' pool.
The KV cache gets the rest. Once the cache and the graphs exist, the largest step runs once, so
that a GPU that cannot fit it fails at startup, never mid-run; the startup report says where the
memory went.
"""

from __future__ import annotations

import torch

from .cuda_graphs import graph_pool_bytes, graph_sizes
from .model_runner import PROMPT_LOGITS_ROWS, kv_cache_block_bytes, profile_activation_bytes, reserve_workspaces

_GIB = 2**30


def step_limits(step_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int, graphs: bool,
                num_speculative_tokens: int = 0) -> dict:
    """The largest step the engine runs, as ``reserve_workspaces`` takes it: the scheduler's
    token budget, raised to the batch a decode graph pads to (a captured size may pass
    max_num_seqs: attention runs on the padded rows), the rows a step samples (one per request,
    plus one per draft token with speculative decoding; never padded, never more than its
    tokens), and the widest block table a request of max_model_len tokens has."""
    padded = graph_sizes(max_num_seqs)[-1] if graphs else max_num_seqs
    max_tokens = max(step_tokens, padded)
    return dict(max_tokens=max_tokens, max_seqs=min(max_num_seqs * (1 + num_speculative_tokens), step_tokens),
                max_blocks_per_seq=-(-max_model_len // block_size))


class GpuMemoryPlan:
    """The memory of one engine's GPU: the kernels' workspaces are reserved at construction (after
    the weights are loaded), ``kv_cache_bytes`` measures the steps and sizes the cache (unless the
    user gave its size), ``warm_up`` runs the largest step, and ``report`` says where the memory
    went."""

    def __init__(self, model, step_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int,
                 graphs: bool, num_speculative_tokens: int = 0):
        self.model, self.block_size, self.max_num_seqs, self.graphs = model, block_size, max_num_seqs, graphs
        self.device = model.embed_tokens.device
        draft_rows = min(max_num_seqs * num_speculative_tokens, step_tokens)
        self.step_tokens, self.num_logits = step_tokens, max_num_seqs + draft_rows + PROMPT_LOGITS_ROWS
        self.model_bytes = torch.cuda.memory_allocated(self.device)
        self.workspace_bytes = reserve_workspaces(model, block_size=block_size,
                                                  **step_limits(step_tokens, max_num_seqs, max_model_len, block_size,
                                                                graphs, num_speculative_tokens))
        self.total = torch.cuda.mem_get_info(self.device)[1]
        self.activation_bytes = self.graph_bytes = None  # measured by kv_cache_bytes
        self.kv_bytes = self.warm_up_tokens = self.free_after_warm_up = 0

    def kv_cache_bytes(self, gpu_memory_utilization: float) -> int:
        """The KV cache's share of ``gpu_memory_utilization`` of the device, after what the steps
        take beside it (measured by running them)."""
        self.activation_bytes = profile_activation_bytes(self.model, self.step_tokens, self.num_logits, self.block_size)
        self.graph_bytes = graph_pool_bytes(self.model, self.max_num_seqs, self.block_size) if self.graphs else 0
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * gpu_memory_utilization) - (total - free) - self.activation_bytes - self.graph_bytes
        if budget <= 0:
            raise ValueError(f"no GPU memory is left for the KV cache: {total - free} of {total} bytes are in use and "
                             f"the steps need {self.activation_bytes + self.graph_bytes} more; raise "
                             f"gpu_memory_utilization ({gpu_memory_utilization}) or lower max_num_batched_tokens")
        return budget

    def warm_up(self, runner) -> None:
        """Runs the largest step over the runner's cache (as many tokens as it holds, if fewer)."""
        self.kv_bytes = runner.num_blocks * kv_cache_block_bytes(self.model, self.block_size, runner.groups)
        self.warm_up_tokens = min(self.step_tokens, (runner.num_blocks - 1) * self.block_size)
        try:
            runner.warm_up(self.warm_up_tokens, self.num_logits)
        except torch.cuda.OutOfMemoryError as e:
            raise RuntimeError(f"the largest step ({self.warm_up_tokens} tokens, {self.num_logits} rows of logits) "
                               f"does not fit in GPU memory beside the KV cache; lower gpu_memory_utilization (or "
                               f"kv_cache_memory_bytes), max_num_batched_tokens or max_num_seqs") from e
        torch.cuda.synchronize(self.device)
        self.free_after_warm_up = torch.cuda.mem_get_info(self.device)[0]

    def report(self) -> str:
        parts = [f"model {self.model_bytes / _GIB:.2f}", f"KV cache {self.kv_bytes / _GIB:.2f}",
                 f"kernel workspaces {self.workspace_bytes / _GIB:.2f}"]
        if self.activation_bytes is not None:
            parts.append(f"step activations {self.activation_bytes / _GIB:.2f}")
        if self.graph_bytes:
            parts.append(f"CUDA graphs {self.graph_bytes / _GIB:.2f}")
        return (f"GPU memory of {self.device} ({self.total / _GIB:.2f} GiB), in GiB: {', '.join(parts)}; "
                f"torch holds {torch.cuda.memory_reserved(self.device) / _GIB:.2f}; "
                f"{self.free_after_warm_up / _GIB:.2f} free after a warm-up step of {self.warm_up_tokens} tokens")
