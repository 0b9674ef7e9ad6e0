"""The engine core: the native scheduler and the executor, one step at a time.

step() = schedule() -> executor.execute_model() -> update_from_output() -> what changed for each
request (EngineCoreOutputs). With pipeline parallel, one step per stage is kept in flight (vLLM's
batch queue): step() schedules and submits a batch while the queue has room, and otherwise
completes the oldest. The core knows token ids only: text, stop strings and RequestOutputs
are the front end's (llm_engine.py). It runs in the front end's process (InprocClient) or in its
own, behind ZeroMQ (core_proc.py).
"""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

import numpy as np

from .. import Scheduler, SchedulerConfig
from ..executor import Executor
from ..executor.configs import CacheConfig, WorkerConfig
from ..executor.step_io import NewRequest, StepInput
from ..config import ModelConfig
from ..speculative import MODEL_METHODS, SpeculativeConfig, Speculator, draft_cost
from ..structured_output import StructuredOutputManager
from .core_messages import ERROR, EngineCoreInfo, EngineCoreOutputs, EngineCoreRequest, EngineDeadError, SchedulerStats

logger = logging.getLogger("octavo.engine")

# Tokens per step when chunked prefill is on. Measured on the default model, 2 cores (tables in
# bench/RESULTS.md): 64 requests of 128 in / 128 out run at 394-424 output tok/s with every
# budget from 512 to 8192 (before `linear` took input rows in L2-sized chunks, 8192 ran at 240).
# Throughput does not choose, so the smaller budget wins: it bounds the step time that running
# decodes wait behind a prefill (inter-token latency under load).
# Without chunked prefill a step must hold a whole prompt: max_model_len.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 1024


@dataclass
class EngineCoreConfig:
    worker: WorkerConfig
    max_model_len: int | None = None  # None: the model's
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    block_size: int = 16
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    scheduling_policy: str = "fcfs"
    distributed_executor_backend: str | None = None
    tokenizer: str | None = None  # where structured output loads the vocabulary from (None: no tokenizer)
    speculative_config: SpeculativeConfig | None = None


@dataclass
class _InFlight:
    """A step submitted to the executor and not yet completed."""

    handles: list[int]
    request_ids: list[str]
    chunks: list[tuple[int, int, int, int]]  # prompt-logprob rows (StepInput.prompt_logprobs)
    cached: np.ndarray
    num_draft_tokens: np.ndarray  # [R] drafts each request verifies


@dataclass
class _Live:
    """A core request the scheduler holds."""

    request_id: str
    prompt_logprobs: int | None  # top tokens per prompt position when it records prompt logprobs
    num_prompt_tokens: int
    reported_cache_hits: bool = False


class EngineCore:
    def __init__(self, config: EngineCoreConfig):
        self.executor = Executor.create(config.worker, config.distributed_executor_backend)
        model_config = self.executor.model_config
        max_model_len = config.max_model_len or model_config.max_position_embeddings
        if max_model_len > model_config.max_position_embeddings:  # positions past it have no rotary angles
            raise ValueError(f"User-specified max_model_len ({max_model_len}) is greater than the derived "
                             f"max_model_len (max_position_embeddings={model_config.max_position_embeddings} in "
                             "the model's config.json)")
        budget = config.max_num_batched_tokens or (DEFAULT_MAX_NUM_BATCHED_TOKENS if config.enable_chunked_prefill
                                                   else max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len))
        spec = config.speculative_config
        cache = CacheConfig(config.block_size, budget, config.max_num_seqs, max_model_len,
                            config.kv_cache_memory_bytes, config.gpu_memory_utilization, config.enforce_eager,
                            spec.num_speculative_tokens if spec else 0)
        num_blocks = self.executor.determine_num_blocks(cache)
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=num_blocks, block_size=config.block_size, max_model_len=max_model_len,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=budget,
            enable_chunked_prefill=config.enable_chunked_prefill, enable_prefix_caching=config.enable_prefix_caching,
            num_lookahead_tokens=spec.num_lookahead_tokens if spec else 0, policy=config.scheduling_policy,
            kv_group_windows=self.executor.kv_groups.scheduler_windows()))
        self._report_kv_groups(config.block_size)
        self.executor.initialize_cache(num_blocks, cache)
        self.info = EngineCoreInfo(model_config, str(self.executor.model_dtype).removeprefix("torch."),
                                   config.worker.device, max_model_len, config.max_num_seqs, num_blocks,
                                   config.block_size, self.executor.kv_block_bytes, config.scheduling_policy,
                                   self.executor.kv_groups.scheduler_windows(), budget)
        self._live: dict[int, _Live] = {}  # by scheduler handle
        self._unsent: dict[int, NewRequest] = {}  # sampling states the workers get with the first step
        self._finished_handles: list[int] = []  # finished in steps that ran no model: workers forget them next
        self._num_wanting_prompt_logprobs = 0
        self._queue: deque[_InFlight] = deque()
        self._depth = config.worker.pipeline_parallel_size  # steps in flight at most
        self.speculator = _speculator(config.speculative_config, config.worker.device, model_config)
        if self.speculator is not None:
            self._price_speculation(cache)
        self._tokenizer = config.tokenizer
        self._grammars: StructuredOutputManager | None = None  # made at the first constrained request
        self._compiling: dict[str, tuple[EngineCoreRequest, Future]] = {}  # waiting for their grammar
        self._refused: list[str] = []  # their grammar failed to compile: reported by the next step

    def _report_kv_groups(self, block_size: int, num_tokens: int = 8192) -> None:
        """Hybrid models: what a long request's KV takes against full attention on every layer."""
        groups = self.executor.kv_groups
        if not groups.hybrid:
            return
        held = groups.blocks_held(num_tokens, block_size) * self.executor.kv_block_bytes
        print(f"octavo: KV cache groups: {groups.describe()}; a {num_tokens}-token request holds {held / 2**20:.1f} "
              f"MiB of KV, {groups.kv_fraction(num_tokens, block_size):.2f} of full attention on every layer")

    def _price_speculation(self, cache: CacheConfig) -> None:
        """The cost rule's prices on this machine and model, measured before any request."""
        costs = self.executor.collective_rpc("measure_step_costs", (cache,))[self.executor.driver_rank]
        if costs is None:
            return
        self.speculator.calibrate(*costs)
        drafting = "".join(f"; drafting for {n} request(s) = {rows:.1f} rows" for n, rows in costs[1])
        print(f"octavo: speculative decoding prices: a step's fixed cost = {costs[0]:.1f} rows{drafting}")

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, r: EngineCoreRequest) -> None:
        """Raises ValueError when the scheduler refuses the request. A request with structured
        output joins the scheduler once its grammar is compiled (a later step)."""
        if r.params.structured_outputs is not None:
            self._compiling[r.request_id] = (r, self.grammars.compile(r.params.structured_outputs))
            return
        self._schedule_request(r)

    def _schedule_request(self, r: EngineCoreRequest) -> int:
        p = r.params
        handle = self.scheduler.add_request(
            r.request_id, r.prompt_token_ids, max_tokens=p.max_tokens, min_tokens=p.min_tokens,
            eos_token_id=r.eos_token_id, stop_token_ids=r.stop_token_ids, ignore_eos=p.ignore_eos,
            priority=r.priority, skip_reading_prefix_cache=r.wants_prompt_logprobs)
        banned = r.stop_token_ids + ([] if p.ignore_eos or r.eos_token_id < 0 else [r.eos_token_id])
        self._unsent[handle] = NewRequest(handle, p, r.prompt_token_ids, r.seed, banned)
        self._live[handle] = _Live(r.request_id, p.prompt_logprobs if r.wants_prompt_logprobs else None,
                                   len(r.prompt_token_ids))
        self._num_wanting_prompt_logprobs += r.wants_prompt_logprobs
        return handle

    @property
    def grammars(self) -> StructuredOutputManager:
        if self._grammars is None:
            if self._tokenizer is None:
                raise ValueError("structured outputs need a tokenizer, and this engine has none")
            self._grammars = StructuredOutputManager(self._tokenizer, self.executor.model_config.vocab_size)
        return self._grammars

    def _admit_compiled(self) -> None:
        """Requests whose grammar is ready join the scheduler; those whose compile failed, or
        that the scheduler refuses, are reported with "error" by the next step."""
        for rid in [rid for rid, (_, future) in self._compiling.items() if future.done()]:
            r, future = self._compiling.pop(rid)
            try:
                state = future.result()
                self._grammars.add(self._schedule_request(r), state, r.params.structured_outputs._reasoning_end)
            except Exception as e:  # noqa: BLE001 - this request's problem alone
                _log_failure("compiling the grammar", [rid], e)
                self._refused.append(rid)

    def _wait_for_grammars(self) -> None:
        """Nothing to run until a grammar is ready: wait for one briefly rather than spin."""
        if self._compiling and not self._queue:
            wait([future for _, future in self._compiling.values()], timeout=0.01, return_when=FIRST_COMPLETED)

    def add_samples(self, samples: list[EngineCoreRequest]) -> None:
        """One front-end request's samples, all or none: when the scheduler refuses one
        (ValueError), those added before are aborted and the error raised."""
        added = []
        try:
            for r in samples:
                self.add_request(r)
                added.append(r.request_id)
        except Exception:
            self.abort_requests(added)
            raise

    def abort_requests(self, request_ids: list[str]) -> None:
        """Takes effect after the current step; aborted requests report no output."""
        for rid in request_ids:
            if rid in self._compiling:
                self._compiling.pop(rid)[1].cancel()
            handle = self.scheduler.handle_of(rid)
            if handle is not None and handle in self._live:
                self._forget(handle)
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._queue) or bool(self._compiling) \
            or bool(self._refused)

    def _forget(self, handle: int) -> None:
        live = self._live.pop(handle)
        if self._grammars is not None:
            self._grammars.remove(handle)
        if self.speculator is not None:
            self.speculator.forget(handle)
        self._unsent.pop(handle, None)
        self._num_wanting_prompt_logprobs -= live.prompt_logprobs is not None

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """Schedules and submits a step while fewer than one per pipeline stage are in flight;
        otherwise (or when nothing more can be scheduled) completes the oldest and reports it. A
        forward failure finishes the requests of every step in flight with "error"; a sampling
        failure, the request alone. Raises only for a failure outside both (end_failed_step()
        then fails the open steps' requests)."""
        if self._compiling:
            self._admit_compiled()
        if self._refused:
            refused, self._refused = self._refused, []
            return self.error_outputs(refused)
        if len(self._queue) < self._depth:
            out = self.scheduler.schedule(self._batch_cap())
            if out.num_reqs:
                self._queue.append(self._submit(out))
                if len(self._queue) < self._depth:
                    return EngineCoreOutputs.empty(self.stats())
            else:
                self._finished_handles.extend(out.finished_handles.tolist())
                if not self._queue:  # schedule() opened an empty step: close it
                    self.scheduler.update_from_output(np.zeros(0, dtype=np.int32))
                    self._wait_for_grammars()
                    return EngineCoreOutputs.empty(self.stats())
        return self._complete(self._queue.popleft())

    def _batch_cap(self) -> int:
        """With pipeline stages, a step takes its share of the requests (one batch per stage in
        flight), else the stages would take turns on one batch; 0 (no cap) otherwise."""
        if self._depth == 1:
            return 0
        s = self.scheduler
        return max(1, -(-(s.num_running + s.num_waiting) // self._depth))

    def _submit(self, out) -> _InFlight:
        handles = out.req_handles.tolist()
        chunks = self._prompt_chunks(out, handles) if self._num_wanting_prompt_logprobs else []
        # Steps that overlap must not share the scheduler's buffers, which its next step rewrites.
        step = StepInput.from_scheduler(out, copy=self._depth > 1, new_requests=self._new_requests(out),
                                        finished_handles=self._finished(out),
                                        prompt_logprobs=np.array(chunks, dtype=np.int32) if chunks else None)
        if self._grammars is not None:
            step.grammar_bitmask, step.grammar_rows = self._grammars.bitmask(handles, step.drafts()) or (None, None)
        if self.speculator is not None and self.speculator.config.method in MODEL_METHODS:
            step.draft_rows = self.speculator.draft_rows(handles, self.scheduler.num_running)
            step.preempted_handles = out.preempted_handles.tolist()
        pending = _InFlight(handles, [self._live[h].request_id for h in handles], chunks,
                            self._cache_hits(out, handles), np.array(out.num_draft_tokens))
        self.executor.submit(step)
        return pending

    def _complete(self, step: _InFlight) -> EngineCoreOutputs:
        try:
            result = self.executor.receive()
        except EngineDeadError:  # the workers are gone: nothing more can run
            raise
        except Exception as e:  # noqa: BLE001 - whatever broke, the other requests keep running
            return self._fail_in_flight(e)
        # Tokens from a worker process come in a read-only buffer, which DLPack does not export.
        sampled_offsets = result.sampled.offsets
        update = self.scheduler.update_from_output(
            np.require(result.sampled.token_ids, requirements="W"),
            None if sampled_offsets is None else np.require(sampled_offsets, requirements="W"))
        finish_reasons = np.array(update.finish_reasons)
        request_ids = step.request_ids
        for f in result.failures:
            finish_reasons[f.row] = ERROR
        if result.failures:
            _log_failure("sampling", [request_ids[f.row] for f in result.failures], result.failures[0].error)
            self.scheduler.abort_requests([request_ids[f.row] for f in result.failures])
        if self._grammars is not None:
            self._advance_grammars(step, update, finish_reasons)
        for i in np.flatnonzero(finish_reasons).tolist():
            if step.handles[i] in self._live:
                self._forget(step.handles[i])
        if self.speculator is not None:
            self._speculate(step, update, finish_reasons, result)
        sampled = result.sampled if result.sampled.logprobs is not None else None  # else new_token_ids say it all
        return EngineCoreOutputs(
            request_ids, np.array(update.new_token_offsets), np.array(update.new_token_ids), finish_reasons,
            np.array(update.stop_reasons), step.cached, sampled,
            [(i, first, logprobs) for (i, first, _, _), logprobs in zip(step.chunks, result.prompt_logprobs)],
            self.stats())

    def _advance_grammars(self, step: _InFlight, update, finish_reasons: np.ndarray) -> None:
        """Each constrained request's grammar takes the tokens the step gave it; a request whose
        grammar refuses one fails (its row finishes with "error")."""
        offsets, tokens = np.asarray(update.new_token_offsets), np.asarray(update.new_token_ids)
        refused = []
        for i, handle in enumerate(step.handles):
            if handle in self._grammars and finish_reasons[i] != ERROR:
                if not self._grammars.accept(handle, tokens[offsets[i]:offsets[i + 1]].tolist()):
                    finish_reasons[i] = ERROR
                    refused.append(step.request_ids[i])
        if refused:
            _log_failure("structured output", refused, "the grammar refused a sampled token")
            self.scheduler.abort_requests(refused)

    def _speculate(self, step: _InFlight, update, finish_reasons: np.ndarray, result) -> None:
        """Counts the step's accepted drafts, then drafts for the requests that sampled and run on
        (a draft model's came with the step's result)."""
        if result.sampled.offsets is not None:
            self.speculator.record(step.handles, step.num_draft_tokens, np.diff(result.sampled.offsets))
        if result.times is not None:
            self.speculator.record_times(result.times)
        new = np.diff(update.new_token_offsets)
        handles = [h for h, n, f in zip(step.handles, new.tolist(), finish_reasons.tolist()) if n and not f]
        drafted = None
        if result.draft_offsets is not None:
            offsets, tokens = result.draft_offsets.tolist(), result.draft_token_ids.tolist()
            drafted = {h: tokens[offsets[i]:offsets[i + 1]] for i, h in enumerate(step.handles)}
        self.speculator.propose(self.scheduler, handles, self._grammars, drafted)

    def _fail_in_flight(self, error: Exception) -> EngineCoreOutputs:
        """The oldest step's forward pass failed: its KV may be half written, and the steps in
        flight behind it may read that KV (a continued prompt, a prefix-cache hit), so every open
        step fails; their requests finish with "error" and none of that KV is kept."""
        handles = self._end_open_steps()
        request_ids = [self._live[h].request_id for h in handles]
        _log_failure("the forward pass", request_ids, error)
        return self._fail(handles, request_ids)

    def end_failed_step(self) -> EngineCoreOutputs:
        """After step() raised: ends the scheduler's open steps, failing the requests they
        scheduled, so that the next step can run."""
        if not self.scheduler.in_step:
            return EngineCoreOutputs.empty(self.stats())
        handles = self._end_open_steps()
        return self._fail(handles, [self._live[h].request_id for h in handles])

    def _end_open_steps(self) -> list[int]:
        """Drops the results of the steps submitted and not yet completed (the workers ran them)
        and closes every open step as failed; returns the live requests those steps ended."""
        for _ in range(len(self._queue)):
            try:
                self.executor.receive()
            except EngineDeadError:
                raise
            except Exception:  # noqa: BLE001 - failed anyway
                pass
        self._queue.clear()
        failed = []
        while self.scheduler.in_step:
            failed += self.scheduler.fail_step()
        return [h for h in failed if h in self._live]

    def _new_requests(self, out) -> list[NewRequest]:
        """The sampling states of the step's requests that the workers have not seen."""
        handles = out.req_handles
        return [r for i in np.flatnonzero(out.is_new).tolist() if (r := self._unsent.pop(int(handles[i]), None))]

    def _finished(self, out) -> list[int]:
        handles = self._finished_handles + out.finished_handles.tolist()
        self._finished_handles = []
        return handles

    def _prompt_chunks(self, out, handles: list[int]) -> list[tuple[int, int, int, int]]:
        """StepInput.prompt_logprobs rows: the hidden state at prompt position j predicts token
        j + 1, so a chunk over positions [first, first + L) yields the entries of prompt tokens
        first + 1 .. min(first + L, P - 1)."""
        chunks = []
        starts, positions = out.query_start_loc, out.positions
        for i, handle in enumerate(handles):
            live = self._live[handle]
            if live.prompt_logprobs is None:
                continue
            begin, end = int(starts[i]), int(starts[i + 1])
            first = int(positions[begin])
            last = min(first + end - begin, live.num_prompt_tokens - 1)
            if last > first:  # else a decode step, or a recompute past the prompt after preemption
                chunks.append((i, first, last, live.prompt_logprobs))
        return chunks

    def _cache_hits(self, out, handles: list[int]) -> np.ndarray:
        """[R] int32: each request's cached prompt tokens when first scheduled, else -1."""
        cached = np.full(len(handles), -1, dtype=np.int32)
        for i in np.flatnonzero(out.is_new).tolist():
            live = self._live[handles[i]]
            if not live.reported_cache_hits:
                live.reported_cache_hits = True
                cached[i] = out.num_computed_tokens[i]
        return cached

    def _fail(self, handles: list[int], request_ids: list[str]) -> EngineCoreOutputs:
        """Finishes these requests with "error" (aborting them in the scheduler)."""
        for handle in handles:
            self._forget(handle)
        self.scheduler.abort_requests(request_ids)
        return self.error_outputs(request_ids)

    def error_outputs(self, request_ids: list[str]) -> EngineCoreOutputs:
        """Outputs that finish these requests with "error"."""
        n = len(request_ids)
        return EngineCoreOutputs(request_ids, np.zeros(n + 1, dtype=np.int32), np.zeros(0, dtype=np.int32),
                                 np.full(n, ERROR, dtype=np.int8), np.full(n, -1, dtype=np.int32),
                                 np.full(n, -1, dtype=np.int32), stats=self.stats())

    def stats(self) -> SchedulerStats:
        s = self.scheduler
        pool, prefix = s.block_pool, s.prefix_cache_stats
        spec = None if self.speculator is None else self.speculator.counts.snapshot()
        return SchedulerStats(s.num_waiting, s.num_running, pool.usage, pool.num_used_blocks, prefix["queries"],
                              prefix["hits"], s.num_preemptions, spec)

    # ---- the model, through the executor ---------------------------------------------------

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        return self.executor.collective_rpc(method, args, kwargs)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        if self._grammars is not None:
            self._grammars.shutdown()
        self.executor.shutdown()


def _speculator(spec: SpeculativeConfig | None, device: str, target: ModelConfig) -> Speculator | None:
    if spec is None:
        return None
    return Speculator(spec, device.split(":")[0], draft_cost(spec, target))


def _log_failure(where: str, request_ids: list[str], error: Exception | str) -> None:
    """error: the exception, or its traceback as text (from a worker)."""
    message = "%s failed; aborting request(s) %s"
    if isinstance(error, str):
        logger.error(message + "\n%s", where, ", ".join(request_ids), error.rstrip())
    else:
        logger.error(message, where, ", ".join(request_ids), exc_info=(type(error), error, error.__traceback__))
