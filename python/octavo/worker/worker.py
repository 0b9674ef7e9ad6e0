"""A worker: one rank's device, model (shard), KV cache, CUDA graphs and sampler, and the sampling
state of every request it runs. The executor creates it, sizes its cache and hands it steps."""

from __future__ import annotations

import logging
import time
import traceback

import numpy as np
import torch

from .. import _C
from ..distributed.parallel_state import alone, init_model_parallel
from ..executor.configs import CacheConfig, WorkerConfig
from ..executor.step_io import PromptLogprobs, RowFailure, StepInput, StepOutput, StepTimes
from ..kv_cache import kv_cache_dtype
from ..kv_groups import model_kv_groups
from ..layers import bf16_tiles
from ..layers.crossover import calibrate as calibrate_linear
from ..loader import load_model
from ..logits_processor import LogitsProcessors
from ..logits_processor import resolve as resolve_logits_processors
from ..models.llama_eagle import load_eagle_head
from ..speculative import EAGLE_METHODS
from .cpu_graphs import NotRecordable
from .gpu_memory import GpuMemoryPlan
from .draft_model import DraftModel, load_draft_model
from .eagle import EagleDrafter
from .model_runner import ModelRunner, kv_cache_block_bytes
from .sampler import SamplingState, join_requests, sample
from .staging import Staging
from .step_costs import drafting_rows, row_costs

logger = logging.getLogger("octavo.worker")

DEFAULT_KV_CACHE_BYTES = 1 << 30  # CPU default when neither the user nor the model says more


class Worker:
    """Rank ``rank`` of ``world_size`` = tensor_parallel_size x pipeline_parallel_size: tensor-
    parallel rank ``rank % tp`` of pipeline stage ``rank // tp``. Every rank runs each step's
    forward pass on its part of the model; the last stage's first rank alone samples (and keeps
    the requests' sampling state): it is the ``driver``, whose StepOutput the executor returns.
    ``shared_memory``: where CPU ranks of this machine meet to all-reduce (parallel_state.py)."""

    def __init__(self, config: WorkerConfig, rank: int = 0, world_size: int = 1, init_method: str | None = None,
                 shared_memory: str | None = None):
        self.config, self.rank, self.world_size = config, rank, world_size
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        if world_size != tp * pp:
            raise ValueError(f"world_size {world_size} is not tensor_parallel_size {tp} x pipeline_parallel_size {pp}")
        self.tp_rank, self.pp_rank = rank % tp, rank // tp
        self.driver = self.tp_rank == 0 and self.pp_rank == pp - 1
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and world_size > 1:  # a GPU per rank
            self.device = torch.device("cuda", rank)
        init_model_parallel(rank, tp, pp, init_method, self.device, shared_memory)
        self.model = self.runner = self.memory = self._staging = self.logits_processors = None
        # Speculative decoding's draft model or EAGLE head, and what runs it (the driver's).
        self.draft_model = self.drafter = None
        self.states: dict[int, SamplingState] = {}  # by scheduler handle
        self.num_steps = 0

    def load_model(self) -> None:
        c = self.config
        self.model = load_model(c.model, c.dtype, c.load_format, self.device, c.quantization, self.tp_rank,
                                c.tensor_parallel_size, self.pp_rank, c.pipeline_parallel_size,
                                c.enable_expert_parallel)
        self.kv_groups = model_kv_groups(self.model)
        self.kv_dtype = kv_cache_dtype(c.kv_cache_dtype, self.model.dtype, self.device)
        calibrate_linear(self.model)  # CPU: torch's GEMM or Octavo's kernel, by rows, on this machine
        if bf16_tiles.worth_packing(self.model):  # AMX: bfloat16 weights packed into tiles once
            bf16_tiles.pack_model(self.model)
        spec = c.speculative
        if self.driver and spec is not None and spec.method == "draft_model":
            self.draft_model = load_draft_model(spec, c, self.device, self.model.config)
        elif self.driver and spec is not None and spec.method in EAGLE_METHODS:
            self.draft_model = load_eagle_head(spec.model, spec.method, self.model)

    def model_summary(self) -> tuple:
        """(ModelConfig, the dtype the weights were loaded as, its KV groups: kv_groups.py)."""
        return self.model.config, self.model.dtype, self.kv_groups

    def kv_cache_bytes(self, cache: CacheConfig) -> tuple[int, int]:
        """(bytes this worker can give its KV cache, bytes one block takes here)."""
        graphs = self._graphs(cache)
        if self.device.type == "cuda":  # profiles a step of the largest size
            self.memory = GpuMemoryPlan(self.model, cache.max_num_batched_tokens, cache.max_num_seqs,
                                        cache.max_model_len, cache.block_size, graphs, cache.num_speculative_tokens)
        budget = cache.kv_cache_memory_bytes or (self.memory.kv_cache_bytes(cache.gpu_memory_utilization)
                                                 if self.memory else DEFAULT_KV_CACHE_BYTES)
        block_bytes = kv_cache_block_bytes(self.model, cache.block_size, self.kv_groups, self.kv_dtype)
        if self.draft_model is not None:  # its cache has a block for each of the target's
            block_bytes += kv_cache_block_bytes(self.draft_model, cache.block_size)
        return budget, block_bytes

    def initialize_cache(self, num_blocks: int, cache: CacheConfig) -> None:
        """Allocates the KV cache, captures the decode graphs and warms up (on a GPU)."""
        self.runner = ModelRunner(self.model, num_blocks, cache.block_size, self.kv_groups, self.kv_dtype)
        self._staging = Staging(self.runner.device)
        spec = self.config.speculative
        if self.draft_model is not None:
            sizes = (num_blocks, cache.block_size, spec.num_speculative_tokens, cache.max_model_len)
            self.drafter = (DraftModel(self.draft_model, *sizes) if spec.method == "draft_model"
                            else EagleDrafter(self.draft_model, self.runner, *sizes))
        if self.driver and self.config.logits_processors:
            self.logits_processors = LogitsProcessors(resolve_logits_processors(self.config.logits_processors),
                                                      self.model.config.vocab_size, cache.max_num_seqs,
                                                      self.runner.device)
        max_blocks = -(-cache.max_model_len // cache.block_size)
        if self._graphs(cache) and self.device.type == "cuda":
            seconds = self.runner.capture_cuda_graphs(cache.max_num_seqs, max_blocks)
            print(f"octavo: captured CUDA graphs for decode batches of {self.runner.cuda_graphs.sizes} "
                  f"in {seconds:.1f} s")
        elif self._graphs(cache):
            self._record_cpu_graphs(cache.max_num_seqs, max_blocks)
        if self.memory:
            self.memory.warm_up(self.runner)
            print(f"octavo: {self.memory.report()}")

    @torch.inference_mode()
    def measure_step_costs(self, cache: CacheConfig) -> tuple[float, list[tuple[int, float]]] | None:
        """Speculative decoding's prices here (step_costs.py), before any request: a step's fixed
        cost in rows, and the drafter's time in rows for some numbers of drafting requests (the
        driver's; none without a drafter). Every rank runs the target's steps (they are
        collective); None when the cache is too small to time them."""
        most = min(cache.max_num_batched_tokens, cache.max_num_seqs * (1 + cache.num_speculative_tokens))
        costs = row_costs(self.runner, most)  # no more rows of logits than the memory plan holds
        if costs is None:
            return None
        fixed_rows, row_seconds = costs
        if self.drafter is None:
            return fixed_rows, []
        with alone():
            return fixed_rows, drafting_rows(self.drafter, cache.max_num_seqs, row_seconds)

    def _record_cpu_graphs(self, max_num_seqs: int, max_blocks: int) -> None:
        try:
            seconds = self.runner.record_cpu_graphs(max_num_seqs, max_blocks)
        except NotRecordable as e:
            print(f"octavo: decode steps run eagerly: {e}")
            return
        graphs = self.runner.cpu_graphs
        print(f"octavo: recorded CPU graphs for decode batches of {graphs.sizes} in {seconds:.1f} s "
              f"({graphs.nbytes / 2**20:.1f} MiB of activations)")

    def _graphs(self, cache: CacheConfig) -> bool:
        """Decode steps replay CUDA graphs on one GPU and CPU graphs on the CPU; tensor- and
        pipeline-parallel ranks run eagerly (their collectives are not captured), and so do the
        steps an EAGLE head reads and, on a GPU, hybrid models' (its graphs take one block table)."""
        spec = self.config.speculative
        return (not cache.enforce_eager and self.world_size == 1
                and not (self.kv_groups.hybrid and self.device.type == "cuda")
                and not (spec is not None and spec.method in EAGLE_METHODS))

    @torch.inference_mode()
    def execute_model(self, step: StepInput) -> StepOutput | None:
        """One forward pass and sampling (the driver; other ranks return None). A forward failure
        raises (the whole step is lost); a request whose sampling fails alone is reported in
        ``failures``, the others sample."""
        self.num_steps += 1
        started = time.perf_counter()
        chunks = step.prompt_logprobs
        rows = None if chunks is None else np.concatenate(
            [np.arange(step.query_start_loc[i], step.query_start_loc[i] + last - first) for i, first, last, _ in chunks])
        if not self.driver:  # its part of the forward pass and of the logits' gathering
            self.runner.execute(step, rows)
            return None
        states = self._update_states(step)
        logits, prompt_logits = self.runner.execute(step, rows)
        if step.grammar_bitmask is not None:  # structured output: the tokens each grammar rules out
            _C.ops.apply_token_bitmask(logits, *self._staging.to_device(step.grammar_bitmask, step.grammar_rows))
        if self.logits_processors is not None:
            self.logits_processors.apply(logits, step.req_handles.tolist(), states)
        prompt = [] if chunks is None else prompt_logprobs(chunks, prompt_logits, step, self.states)
        drafts = step.drafts()
        sampled, failures = self._sample(logits, states, drafts)
        samples = self._keep_sampled(step, states, sampled)
        out = StepOutput(sampled, failures, prompt)
        if self.drafter is not None:
            out.times = StepTimes(step.total_num_scheduled_tokens, time.perf_counter() - started)
            out.draft_offsets, out.draft_token_ids = self._draft(step, states, samples, sampled)
            out.times.drafted = int(np.count_nonzero(np.diff(out.draft_offsets)))
            out.times.draft_seconds = self.drafter.seconds
            if out.times.draft_seconds is None:  # a time that says nothing of later steps
                out.times = None
        return out

    def _draft(self, step: StepInput, states: list[SamplingState], samples: list[bool], sampled):
        """The drafter's proposals for the next step. Drafts are optional: when drafting fails,
        the step's requests get none (the error goes to the log) and their tokens stand."""
        try:
            with alone():  # the draft model is whole on the driver
                return self.drafter.propose(step, states, samples, sampled)
        except Exception:  # noqa: BLE001 - a failed proposal must not fail the requests
            logger.exception("drafting failed; the step's requests get no drafts")
            self.drafter.seconds = 0.0
            return np.zeros(step.num_reqs + 1, dtype=np.int32), np.zeros(0, dtype=np.int32)

    def _update_states(self, step: StepInput) -> list[SamplingState]:
        for handle in step.finished_handles:
            self.states.pop(handle, None)
        if self.drafter is not None:
            self.drafter.forget(step.finished_handles + step.preempted_handles)
        for r in step.new_requests:
            self.states[r.handle] = SamplingState(r.params, r.prompt_token_ids, r.seed, r.stop_token_ids)
        return [self.states[h] for h in step.req_handles.tolist()]

    def _sample(self, logits: torch.Tensor, states: list[SamplingState], drafts: list[list[int]] | None):
        """Samples every request (verifying its drafts, if any); when that fails, samples each
        request alone: one whose sampling fails alone gets token 0 and is reported, the others
        keep their tokens (a request's draw does not depend on the batch)."""
        try:
            return sample(logits, states, self._staging, drafts), []
        except Exception:  # noqa: BLE001 - isolate the culprit below
            pass
        rows = np.cumsum([0] + [1 + (len(d) if drafts else 0) for d in drafts or states]).tolist()
        alone, failures = [], []
        for i, state in enumerate(states):
            try:
                alone.append(sample(logits[rows[i]:rows[i + 1]], [state], self._staging, drafts and drafts[i:i + 1]))
            except Exception:  # noqa: BLE001
                failures.append(RowFailure(i, traceback.format_exc()))
                alone.append(None)
        return join_requests(alone, drafts is not None), failures

    @staticmethod
    def _keep_sampled(step: StepInput, states: list[SamplingState], sampled) -> list[bool]:
        """A request's tokens are its next outputs once the step reaches the end of its tokens
        (prompt and outputs so far, then its drafts); a prefill chunk short of it samples
        nothing. The scheduler applies the same rule, so both keep the same outputs (up to a
        stop, after which the worker forgets the request). Returns which requests sampled."""
        ends = step.seq_lens - step.num_draft_tokens
        samples = [end == len(s.prompt_token_ids) + len(s.output_token_ids) for s, end in zip(states, ends.tolist())]
        for state, kept, tokens in zip(states, samples, sampled.per_request()):
            if kept:
                state.output_token_ids += tokens
        return samples


def prompt_logprobs(chunks: np.ndarray, logits: torch.Tensor, step: StepInput,
                    states: dict[int, SamplingState]) -> list[PromptLogprobs]:
    """logits: float32 [sum of chunk rows, vocab] in chunk order -> each chunk's prompt tokens'
    logprobs and ranks, and its top-k tokens (ranked as the sampler and vLLM rank)."""
    logp = torch.log_softmax(logits, dim=-1)
    results, at = [], 0
    for i, first, last, k in chunks.tolist():
        block = logp[at:at + last - first]
        at += last - first
        prompt = states[int(step.req_handles[i])].prompt_token_ids
        targets = torch.tensor(prompt[first + 1:last + 1], dtype=torch.int64)
        chosen = block.gather(1, targets[:, None])[:, 0]
        ranks = (block >= chosen[:, None]).sum(dim=1)
        top = block.topk(block.shape[1] if k == -1 else k, dim=1)
        results.append(PromptLogprobs(chosen.numpy(), ranks.to(torch.int32).numpy(),
                                      top.indices.to(torch.int32).numpy(), top.values.numpy()))
    return results
