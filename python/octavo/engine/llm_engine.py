"""The offline engine: requests in, one scheduler step at a time, RequestOutputs out.

step() = schedule() -> forward over the flat batch -> sample -> update_from_output() ->
detokenize and check stop strings -> outputs. A request with n > 1 runs as n scheduler requests
("<id>#<i>") whose outputs are gathered into one RequestOutput.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .. import FINISH_REASONS, Scheduler, SchedulerConfig
from ..device import cpu_only_reason, resolve_device
from ..generation_config import load_generation_config
from ..layers import bf16_tiles
from ..layers.crossover import calibrate as calibrate_linear
from ..loader import load_model
from ..outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from ..runner.gpu_memory import GpuMemoryPlan
from ..runner.model_runner import ModelRunner, kv_cache_block_bytes
from ..runner.sampler import SamplerOutput, SamplingState, sample, scatter_rows
from ..runner.staging import Staging
from ..sampling_params import RequestOutputKind, SamplingParams
from .detokenizer import IncrementalDetokenizer, check_stop_strings
from .prompt_logprobs import prompt_chunks, record_prompt_logprobs

logger = logging.getLogger("octavo.engine")

DEFAULT_KV_CACHE_BYTES = 1 << 30  # CPU default when neither the user nor the model says more
# Tokens per step when chunked prefill is on. Measured on the default model, 2 cores (tables in
# bench/RESULTS.md): 64 requests of 128 in / 128 out run at 394-424 output tok/s with every
# budget from 512 to 8192 (before `linear` took input rows in L2-sized chunks, 8192 ran at 240).
# Throughput does not choose, so the smaller budget wins: it bounds the step time that running
# decodes wait behind a prefill (inter-token latency under load).
# Without chunked prefill a step must hold a whole prompt: max_model_len.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 1024


@dataclass
class _Sample:
    """One of a request's n samples: one scheduler request."""

    index: int
    handle: int  # the scheduler's
    state: SamplingState
    detokenizer: IncrementalDetokenizer | None
    cumulative_logprob: float = 0.0
    logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # What earlier DELTA outputs carried: token, logprob and character counts; done once the
    # finish reason went out.
    sent_tokens: int = 0
    sent_logprobs: int = 0
    sent_text: int = 0
    sent_final: bool = False


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    samples: list[_Sample] = field(default_factory=list)
    prompt_logprobs: list | None = None  # one entry per prompt token (the first stays None)
    num_cached_tokens: int | None = None  # prompt tokens the first sample found in the prefix cache

    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class LLMEngine:
    """Owns the model, its KV cache, the native scheduler and the tokenizer."""

    def __init__(self, model: str | Path, tokenizer=None, dtype="auto", max_model_len: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True, block_size: int = 16,
                 kv_cache_memory_bytes: int | None = None, seed: int = 0, load_format: str = "safetensors",
                 quantization: str | None = None, device: str = "auto", gpu_memory_utilization: float = 0.9,
                 enforce_eager: bool = False, max_logprobs: int = 20, scheduling_policy: str = "fcfs",
                 generation_config: str = "auto"):
        """max_logprobs: the most logprobs a request may ask for, per token (-1: no limit);
        scheduling_policy: "fcfs" or "priority" (lower priority values first); generation_config:
        where sampling defaults come from ("auto", "vllm" or a folder); all as vLLM's."""
        self.model_path = Path(model)
        self.generation_config = load_generation_config(model, generation_config)
        if max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no limit) or non-negative, got {max_logprobs}")
        self.max_logprobs = max_logprobs
        if not 0 < gpu_memory_utilization <= 1:  # checked on any device: a bad value is a bad value
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        self.device = resolve_device(device)
        reason = cpu_only_reason(model) if self.device.type == "cuda" else None
        if reason and device in (None, "auto"):  # "auto" means the best device this model can use
            print(f"octavo: running on the CPU: {reason}")
            self.device = torch.device("cpu")
        elif reason:
            raise ValueError(f"device={str(device)!r}: {reason}; use device='cpu'")
        # quantization "int8" / "int4": round to nearest as the weights are read (layers/quantize.py)
        self.model = load_model(model, dtype, load_format, self.device, quantization)
        calibrate_linear(self.model)  # CPU: torch's GEMM or Octavo's kernel, by rows, on this machine
        if bf16_tiles.worth_packing(self.model):  # AMX: bfloat16 weights packed into tiles once
            bf16_tiles.pack_model(self.model)
        self.tokenizer = tokenizer
        config = self.model.config
        self.max_model_len = max_model_len or config.max_position_embeddings
        budget_tokens = max_num_batched_tokens or self._default_budget(enable_chunked_prefill)
        graphs = self.device.type == "cuda" and not enforce_eager
        memory = GpuMemoryPlan(self.model, budget_tokens, max_num_seqs, self.max_model_len, block_size, graphs) \
            if self.device.type == "cuda" else None
        budget = kv_cache_memory_bytes or (memory.kv_cache_bytes(gpu_memory_utilization) if memory
                                           else DEFAULT_KV_CACHE_BYTES)
        num_blocks = budget // kv_cache_block_bytes(self.model, block_size)
        if num_blocks < 2:
            raise ValueError(f"kv_cache_memory_bytes={budget} holds no KV block; give at least "
                             f"{2 * kv_cache_block_bytes(self.model, block_size)} bytes")
        self.runner = ModelRunner(self.model, num_blocks, block_size)
        self._sampling_staging = Staging(self.runner.device)
        self.scheduler = Scheduler(SchedulerConfig(
            num_blocks=num_blocks, block_size=block_size, max_model_len=self.max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget_tokens,
            enable_chunked_prefill=enable_chunked_prefill, enable_prefix_caching=enable_prefix_caching,
            policy=scheduling_policy))
        if graphs:
            seconds = self.runner.capture_cuda_graphs(max_num_seqs, -(-self.max_model_len // block_size))
            print(f"octavo: captured CUDA graphs for decode batches of {self.runner.cuda_graphs.sizes} "
                  f"in {seconds:.1f} s")
        if memory:
            memory.warm_up(self.runner)
            print(f"octavo: {memory.report()}")
        tokens = (num_blocks - 1) * block_size
        gib = num_blocks * kv_cache_block_bytes(self.model, block_size) / 2**30
        print(f"octavo: KV cache of {num_blocks} blocks = {tokens} tokens ({gib:.2f} GiB on {self.device}); "
              f"{tokens / self.max_model_len:.1f}x concurrency at {self.max_model_len} tokens per request")
        self._rng = np.random.default_rng(seed)
        self._requests: dict[str, _Request] = {}
        self._by_handle: dict[int, tuple[_Request, _Sample]] = {}
        self._num_wanting_prompt_logprobs = 0  # live requests with prompt_logprobs (read every step)

    def _default_budget(self, enable_chunked_prefill: bool) -> int:
        if enable_chunked_prefill:
            return DEFAULT_MAX_NUM_BATCHED_TOKENS
        return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, self.max_model_len)

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, priority: int = 0) -> None:
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if priority != 0 and self.scheduler.config.policy != "priority":
            raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled.")
        if not -(1 << 31) <= priority < (1 << 31):
            raise ValueError(f"priority must be a 32-bit integer, got {priority}")
        params = self.check_request(prompt_token_ids, params)
        now = time.time()
        metrics = RequestMetrics(arrival_time=now, last_token_time=now, first_scheduled_time=None,
                                 first_token_time=None, time_in_queue=None)
        request = _Request(request_id, prompt, list(prompt_token_ids), params, metrics)
        wants_prompt_logprobs = params.prompt_logprobs is not None
        if wants_prompt_logprobs:
            request.prompt_logprobs = [None] * len(prompt_token_ids)
            self._num_wanting_prompt_logprobs += 1
        eos = -1 if self.tokenizer is None or self.tokenizer.eos_token_id is None else self.tokenizer.eos_token_id
        stop_token_ids = self._stop_token_ids(params, eos)
        stop_ids = stop_token_ids + ([] if params.ignore_eos or eos < 0 else [eos])
        for i in range(params.n):
            seed = params.sample_seed(i) if params.seed is not None else int(self._rng.integers(1 << 62))
            state = SamplingState(params, request.prompt_token_ids, seed, stop_ids)
            handle = self.scheduler.add_request(
                f"{request_id}#{i}", request.prompt_token_ids, max_tokens=params.max_tokens,
                min_tokens=params.min_tokens, eos_token_id=eos, stop_token_ids=stop_token_ids,
                ignore_eos=params.ignore_eos, priority=priority,
                skip_reading_prefix_cache=wants_prompt_logprobs and i == 0)
            sample_ = _Sample(i, handle, state, self._detokenizer(request),
                              logprobs=[] if params.logprobs is not None else None)
            request.samples.append(sample_)
            self._by_handle[handle] = (request, sample_)
        self._requests[request_id] = request

    def _stop_token_ids(self, params: SamplingParams, eos: int) -> list[int]:
        """The request's stop tokens plus the model's other EOS ids (generation_config.json's), as vLLM."""
        own = list(params.stop_token_ids or [])
        if params.ignore_eos:
            return own
        vocab = self.model.config.vocab_size
        return own + [t for t in self.generation_config.eos_token_ids if t != eos and 0 <= t < vocab and t not in own]

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Raises ValueError for a request the engine cannot run; returns the params it will use
        (max_tokens filled in, or capped to what max_model_len leaves: the server refuses such a
        request before it gets here). Reads only the engine's configuration, so any thread may call it."""
        if not prompt_token_ids:
            raise ValueError("The decoder prompt cannot be empty")
        vocab = self.model.config.vocab_size
        if max(prompt_token_ids) >= vocab or min(prompt_token_ids) < 0:
            bad = next(t for t in prompt_token_ids if not 0 <= t < vocab)
            raise ValueError(f"Token id {bad} is out of vocabulary (the vocabulary has {vocab} tokens)")
        if params.logit_bias is not None:
            raise ValueError("logit_bias is not supported yet")
        if len(prompt_token_ids) >= self.max_model_len:
            raise ValueError(f"The decoder prompt (length {len(prompt_token_ids)}) is longer than the maximum "
                             f"model length of {self.max_model_len}: it leaves no room to generate")
        room = self.max_model_len - len(prompt_token_ids)
        if params.max_tokens is None:  # vLLM: up to the model's context length
            params = params.clone()
            params.max_tokens = room
            if params.min_tokens > room:
                raise ValueError(f"min_tokens ({params.min_tokens}) is more than the {room} tokens the prompt leaves "
                                 f"within max_model_len ({self.max_model_len})")
        elif params.max_tokens > room:  # as vLLM offline: the output ends at max_model_len ("length")
            params = params.clone()
            params.max_tokens = room
            params.min_tokens = min(params.min_tokens, room)
        for token in params.stop_token_ids or []:
            if token >= vocab:
                raise ValueError(f"stop_token_ids contains token id {token}, which is out of vocabulary "
                                 f"(the vocabulary has {vocab} tokens)")
        self._check_logprobs(params.logprobs, "sample")
        self._check_logprobs(params.prompt_logprobs, "prompt")
        return params

    def _check_logprobs(self, num: int | None, kind: str) -> None:
        """vLLM's rule and message: -1 means the whole vocabulary; at most max_logprobs."""
        if num is None:
            return
        vocab = self.model.config.vocab_size
        limit = vocab if self.max_logprobs == -1 else self.max_logprobs
        if (vocab if num == -1 else num) > limit:
            raise ValueError(f"Requested {kind} logprobs of {vocab if num == -1 else num}, which is greater "
                             f"than max allowed: {limit}")

    def _detokenizer(self, request: _Request) -> IncrementalDetokenizer | None:
        p = request.params
        if self.tokenizer is None or not p.detokenize:
            return None
        return IncrementalDetokenizer(self.tokenizer, request.prompt_token_ids, p.skip_special_tokens,
                                      p.spaces_between_special_tokens)

    def abort_request(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            request = self._requests.get(rid)
            if request is not None:
                self.scheduler.abort_requests([f"{rid}#{s.index}" for s in request.samples])
                self._forget(request)

    def end_failed_step(self) -> list[RequestOutput]:
        """After step() raised: ends the scheduler's step if it is still open, failing the
        requests it scheduled (their last outputs are returned), so that the next step can run."""
        if not self.scheduler.in_step:
            return []
        failed = {}
        for handle in self.scheduler.fail_step():
            entry = self._by_handle.get(handle)
            if entry is not None:
                failed[entry[0].request_id] = entry[0]
        return self._fail(failed)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- the step -------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One scheduler step; returns the outputs of the requests that changed.

        A failure inside the step ends only the requests it concerns, with finish_reason "error"
        (the exception goes to the log): all of the step's requests when the forward pass fails,
        the request alone when its sampling, detokenizing or stop check fails."""
        out = self.scheduler.schedule()
        if not out.num_reqs:
            self.scheduler.update_from_output(np.zeros(0, dtype=np.int32))
            return []
        batch = [self._by_handle[h] for h in out.req_handles]
        self._record_cache_hits(out, batch)
        try:
            logits = self._forward(out, batch)
        except Exception as e:  # noqa: BLE001 - whatever broke, the other requests keep running
            self.scheduler.fail_step()  # the step's KV may be half written: none of it is kept
            return self._fail({r.request_id: r for r, _ in batch}, e, "the forward pass")
        sampled, failed = self._sample(logits, batch)
        update = self.scheduler.update_from_output(sampled.token_ids)
        touched: dict[str, _Request] = {}
        failures: dict[str, _Request] = {batch[i][0].request_id: batch[i][0] for i, _ in failed}
        offsets = update.new_token_offsets
        for i, handle in enumerate(update.req_handles):
            request, sample_ = self._by_handle[handle]
            if request.request_id in failures:
                continue
            try:
                new = update.new_token_ids[offsets[i]:offsets[i + 1]].tolist()
                if new:
                    self._append(request, sample_, new, sampled, i)
                    touched[request.request_id] = request
                if update.finish_reasons[i] and sample_.finish_reason is None:
                    sample_.finish_reason = FINISH_REASONS[update.finish_reasons[i]]
                    stop = int(update.stop_reasons[i])
                    sample_.stop_reason = stop if stop >= 0 else None
                    touched[request.request_id] = request
            except Exception as e:  # noqa: BLE001 - a detokenizer or stop-check failure is this request's
                self._log_failure(e, "its outputs", [request.request_id])
                failures[request.request_id] = request
                touched.pop(request.request_id, None)
        outputs = [self._output(r) for r in touched.values() if r.request_id not in failures]
        outputs = [o for o in outputs if o is not None]
        if failed:
            self._log_failure(failed[0][1], "sampling", [batch[i][0].request_id for i, _ in failed])
        return outputs + self._fail(failures)

    @staticmethod
    def _record_cache_hits(out, batch) -> None:
        """A request's cached prompt tokens: what its first sample skipped when first scheduled."""
        for i in np.flatnonzero(out.is_new):
            request, sample_ = batch[i]
            if request.num_cached_tokens is None and sample_.index == 0:
                request.num_cached_tokens = int(out.num_computed_tokens[i])

    def _forward(self, out, batch) -> torch.Tensor:
        """The step's logits [R, vocab]; prompt logprobs are recorded on the way."""
        chunks = prompt_chunks(out, batch) if self._wants_prompt_logprobs() else []
        logits, prompt_logits = self.runner.execute(out, np.concatenate([c.rows() for c in chunks]) if chunks
                                                    else None)
        if chunks:  # prompt_logits are on the CPU, where the Python that reads them runs
            record_prompt_logprobs(chunks, prompt_logits, self._decode)
        return logits

    def _sample(self, logits: torch.Tensor, batch) -> tuple[SamplerOutput, list[tuple[int, Exception]]]:
        """Samples every row; when that fails, finds the rows that fail alone and samples the
        others without them. Returns the output (token 0 in a failed row) and the failed rows."""
        states = [s.state for _, s in batch]
        try:
            return sample(logits, states, self._sampling_staging), []
        except Exception:  # noqa: BLE001 - isolate the culprit below
            pass
        failed = []
        for i, state in enumerate(states):
            try:
                sample(logits[i:i + 1], [state], self._sampling_staging)
            except Exception as e:  # noqa: BLE001
                failed.append((i, e))
        bad = {i for i, _ in failed}
        good = [i for i in range(len(states)) if i not in bad]
        sampled = sample(logits[good], [states[i] for i in good], self._sampling_staging) if good else None
        return scatter_rows(sampled, good, len(states)), failed

    def _fail(self, failures: dict[str, _Request], error: Exception | None = None,
              where: str | None = None) -> list[RequestOutput]:
        """Finishes each request with finish_reason "error" and returns its last outputs."""
        if error is not None and failures:
            self._log_failure(error, where, list(failures))
        outputs = []
        for request in failures.values():
            unfinished = [s for s in request.samples if s.finish_reason is None]
            self.scheduler.abort_requests([f"{request.request_id}#{s.index}" for s in unfinished])
            for s in unfinished:
                s.finish_reason = "error"
            output = self._output(request)
            if output is not None:
                outputs.append(output)
        return outputs

    @staticmethod
    def _log_failure(error: Exception, where: str, request_ids: list[str]) -> None:
        logger.error("%s failed; aborting request(s) %s", where, ", ".join(request_ids),
                     exc_info=(type(error), error, error.__traceback__))

    def _wants_prompt_logprobs(self) -> bool:
        return self._num_wanting_prompt_logprobs > 0

    def _forget(self, request: _Request) -> None:
        """Drops a finished or aborted request from the engine's maps."""
        del self._requests[request.request_id]
        for s in request.samples:
            self._by_handle.pop(s.handle, None)
        if request.prompt_logprobs is not None:
            self._num_wanting_prompt_logprobs -= 1

    def _append(self, request: _Request, sample_: _Sample, new: list[int], sampled, i: int) -> None:
        now = time.time()
        metrics = request.metrics
        if metrics.first_token_time is None:
            metrics.first_token_time = metrics.first_scheduled_time = now
            metrics.time_in_queue = now - metrics.arrival_time
        metrics.last_token_time = now
        sample_.state.output_token_ids.extend(new)
        if sample_.logprobs is not None and sampled.logprobs is not None:
            sample_.cumulative_logprob += float(sampled.logprobs[i])
            sample_.logprobs.append(self._logprob_entry(request.params, sampled, i))
        if sample_.detokenizer is None:
            return
        delta = sample_.detokenizer.add_tokens(new)
        stop = request.params.stop
        if stop and sample_.finish_reason is None:
            text, hit = check_stop_strings(sample_.detokenizer.text, len(delta), stop,
                                           request.params.include_stop_str_in_output)
            if hit is not None:
                sample_.detokenizer.text = text
                sample_.finish_reason, sample_.stop_reason = "stop", hit
                self.scheduler.abort_requests([f"{request.request_id}#{sample_.index}"])

    def _logprob_entry(self, params: SamplingParams, sampled, i: int) -> dict[int, Logprob]:
        decode = self._decode if params.detokenize else (lambda _: None)
        token = int(sampled.token_ids[i])
        entry = {token: Logprob(float(sampled.logprobs[i]), int(sampled.ranks[i]), decode(token))}
        num = sampled.top_token_ids.shape[1] if params.logprobs == -1 else params.logprobs  # -1: every token
        for j in range(num):
            t = int(sampled.top_token_ids[i, j])
            entry.setdefault(t, Logprob(float(sampled.top_logprobs[i, j]), j + 1, decode(t)))
        return entry

    def _decode(self, token: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token])

    def _output(self, request: _Request) -> RequestOutput | None:
        """The request's output as its ``output_kind`` asks; None when it has nothing to show."""
        finished = request.finished()
        if finished:
            request.metrics.finished_time = time.time()
            self._forget(request)
        kind = request.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        if kind == RequestOutputKind.DELTA:
            hold_back = request.params.output_text_buffer_length
            outputs = [o for s in request.samples if (o := self._delta(s, hold_back)) is not None]
        else:  # copies: later steps extend the sample's lists in place
            outputs = [self._completion(s, s.detokenizer.text if s.detokenizer else "", list(s.state.output_token_ids),
                                        None if s.logprobs is None else list(s.logprobs)) for s in request.samples]
        return RequestOutput(request_id=request.request_id, prompt=request.prompt,
                             prompt_token_ids=request.prompt_token_ids, prompt_logprobs=request.prompt_logprobs,
                             outputs=outputs, finished=finished, metrics=request.metrics,
                             num_cached_tokens=request.num_cached_tokens)

    def _delta(self, s: _Sample, hold_back: int) -> CompletionOutput | None:
        """What is new in sample ``s`` since its previous DELTA output. Until it finishes, the
        last ``output_text_buffer_length`` characters are held back: they may be the start of a
        stop string, which is cut from the text once complete and must never have been shown."""
        if s.sent_final:
            return None
        tokens = s.state.output_token_ids[s.sent_tokens:]
        text = s.detokenizer.text if s.detokenizer else ""
        text_end = max(len(text) - (0 if s.finish_reason is not None else hold_back), s.sent_text)
        if not tokens and s.finish_reason is None:
            return None
        logprobs = None if s.logprobs is None else s.logprobs[s.sent_logprobs:]
        out = self._completion(s, text[s.sent_text:text_end], tokens, logprobs)
        s.sent_tokens, s.sent_text = len(s.state.output_token_ids), text_end
        s.sent_logprobs = 0 if s.logprobs is None else len(s.logprobs)
        s.sent_final = s.finish_reason is not None
        return out

    @staticmethod
    def _completion(s: _Sample, text: str, token_ids: list[int], logprobs: list | None) -> CompletionOutput:
        return CompletionOutput(index=s.index, text=text, token_ids=token_ids,
                                cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
                                logprobs=logprobs, finish_reason=s.finish_reason, stop_reason=s.stop_reason)
