"""The front end of the offline engine: requests in, RequestOutputs out, one core step at a time.

The engine core (core.py) schedules and runs the model and reports each request's new token ids;
this side checks requests, turns the tokens into text, logprobs and RequestOutputs (output
processing: detokenize, stop strings), and gathers a request's n samples ("<id>#<i>" in the core)
into one output. The core runs in this process (InprocClient) or in its own (MPClient).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import numpy as np
import torch

from .. import _C, structured_output
from ..device import cpu_only_reason, resolve_device
from ..executor.configs import WorkerConfig
from ..generation_config import load_generation_config
from ..kv_cache import check_kv_cache_dtype
from ..logits_processor import resolve as resolve_logits_processors
from ..outputs import RequestMetrics, RequestOutput
from ..sampling_params import SamplingParams, check_utf8
from ..speculative import EAGLE_METHODS, SpeculativeConfig
from .core import EngineCoreConfig
from .core_client import InprocClient, make_client
from .core_messages import ERROR, FINISH_REASON_NAMES, EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from .output_processor import OutputProcessor, RequestState, SampleState

logger = logging.getLogger("octavo.engine")

# Samples (n) of one request at most. vLLM sets none, but each sample is a request of its own
# here, so n = 2**31 would fill memory before anything ran; the server's own default is 128.
MAX_N = 1 << 16


class LLMEngine:
    """Owns the tokenizer, the output processing and a client of the engine core (which owns
    the scheduler and, through its executor, the model)."""

    def __init__(self, model: str | Path, tokenizer=None, dtype="auto", max_model_len: int | None = None,
                 max_num_seqs: int = 256, max_num_batched_tokens: int | None = None,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True, block_size: int = 16,
                 kv_cache_memory_bytes: int | None = None, seed: int = 0, load_format: str = "safetensors",
                 quantization: str | None = None, device: str = "auto", gpu_memory_utilization: float = 0.9,
                 enforce_eager: bool = False, max_logprobs: int = 20, scheduling_policy: str = "fcfs",
                 generation_config: str = "auto", tensor_parallel_size: int = 1, data_parallel_size: int = 1,
                 distributed_executor_backend: str | None = None, multiprocess: bool = False,
                 pipeline_parallel_size: int = 1, enable_expert_parallel: bool = False,
                 tokenizer_path: str | Path | None = None, structured_outputs_config: dict | None = None,
                 logits_processors: list | None = None, speculative_config: dict | None = None,
                 kv_cache_dtype: str = "auto"):
        """max_logprobs: the most logprobs a request may ask for, per token (-1: no limit);
        scheduling_policy: "fcfs" or "priority" (lower priority values first); generation_config:
        where sampling defaults come from ("auto", "vllm" or a folder); all as vLLM's.
        tensor_parallel_size: worker processes the model is split over; distributed_executor_backend:
        "uni", "mp" or "ray" (default: "mp" for more than one); multiprocess: run the engine core in a
        process of its own (as the server does); data_parallel_size: that many engine cores, each
        in its own process with its own KV cache, requests going to the least loaded;
        pipeline_parallel_size: stages the layers are split over, a worker process each, with a
        batch per stage in flight; enable_expert_parallel: mixture-of-experts layers place whole
        experts on the tensor-parallel ranks (each engine's own: data-parallel engines each hold
        every expert) instead of cutting each expert over them. tokenizer_path: where ``tokenizer``
        was loaded from (default: the model), for the engine core's structured output;
        structured_outputs_config: {"backend": "auto" | "xgrammar" | "guidance"}, as vLLM's;
        logits_processors: LogitsProcessor classes or "module:Class" names (logits_processor.py);
        speculative_config: vLLM's dict, e.g. {"method": "ngram", "num_speculative_tokens": 4,
        "prompt_lookup_max": 3} (speculative.py); kv_cache_dtype: what the KV cache holds, "auto" (the
        model's dtype), "bfloat16" or "float16" (CPU only: half a float32 model's cache bytes)."""
        self.model_path = Path(model)
        self.generation_config = load_generation_config(model, generation_config)
        if max_logprobs < -1:
            raise ValueError(f"max_logprobs must be -1 (no limit) or non-negative, got {max_logprobs}")
        self.max_logprobs = max_logprobs
        if not 0 < gpu_memory_utilization <= 1:  # checked on any device: a bad value is a bad value
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        self.device = _device(model, device, quantization)
        _check_parallel_sizes(self.device, tensor_parallel_size, pipeline_parallel_size, data_parallel_size,
                              distributed_executor_backend)
        check_kv_cache_dtype(kv_cache_dtype)
        self.structured_outputs_backend = _structured_outputs_backend(structured_outputs_config)
        self.logits_processor_classes = resolve_logits_processors(logits_processors)
        self.speculative_config = speculative = _speculative_config(speculative_config, tensor_parallel_size,
                                                                    pipeline_parallel_size, logits_processors)
        worker = WorkerConfig(str(model), dtype, load_format, str(self.device), quantization, tensor_parallel_size,
                              pipeline_parallel_size, enable_expert_parallel, tuple(logits_processors or ()),
                              speculative, kv_cache_dtype)
        self.core = make_client(EngineCoreConfig(
            worker, max_model_len, max_num_seqs, max_num_batched_tokens, enable_prefix_caching,
            enable_chunked_prefill, block_size, kv_cache_memory_bytes, gpu_memory_utilization, enforce_eager,
            scheduling_policy, distributed_executor_backend,
            None if tokenizer is None else str(tokenizer_path or model), speculative), multiprocess, data_parallel_size)
        info = self.info = self.core.info
        self.model_config, self.max_model_len = info.model_config, info.max_model_len
        tokens = (info.num_blocks - 1) * info.block_size
        gib = info.num_blocks * info.kv_block_bytes / 2**30
        # Hybrid models: a block holds one group's layers, and a request holds blocks in every group.
        per = " per layer group" if info.kv_group_windows else ""
        blocks = _C.max_kv_blocks_per_request(self.max_model_len, info.block_size, info.kv_group_windows,
                                              info.max_step_tokens)
        cache_dtype = "" if kv_cache_dtype == "auto" else f" {kv_cache_dtype}"
        print(f"octavo: KV cache of {info.num_blocks} blocks = {tokens} tokens{per} ({gib:.2f} GiB{cache_dtype} on "
              f"{info.device}); {(info.num_blocks - 1) / blocks:.1f}x concurrency at {self.max_model_len} tokens per "
              "request")
        self.tokenizer = tokenizer
        self.output_processor = OutputProcessor(tokenizer)
        self._rng = np.random.default_rng(seed)
        self._requests: dict[str, RequestState] = {}
        self._by_core_id: dict[str, tuple[RequestState, SampleState]] = {}

    @property
    def stats(self) -> SchedulerStats:
        """The scheduler's state: now (core in this process) or as its last step left it."""
        return self.core.stats()

    @property
    def core_is_remote(self) -> bool:
        """The engine core runs in a process of its own."""
        return not isinstance(self.core, InprocClient)

    @property
    def scheduler(self):
        """The native scheduler, when the core runs in this process (tests inspect it)."""
        return self.core.scheduler

    # ---- requests -------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None, priority: int = 0) -> None:
        check_utf8("request_id", request_id)
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if priority != 0 and self.info.scheduling_policy != "priority":
            raise ValueError(f"Got priority {priority} but Priority scheduling is not enabled.")
        if not -(1 << 31) <= priority < (1 << 31):
            raise ValueError(f"priority must be a 32-bit integer, got {priority}")
        params = self.check_request(prompt_token_ids, params)
        now = time.time()
        metrics = RequestMetrics(arrival_time=now, last_token_time=now, first_scheduled_time=None,
                                 first_token_time=None, time_in_queue=None)
        request = RequestState(request_id, prompt, list(prompt_token_ids), params, metrics)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = [None] * len(prompt_token_ids)
        eos = -1 if self.tokenizer is None or self.tokenizer.eos_token_id is None else self.tokenizer.eos_token_id
        stop_token_ids = self._stop_token_ids(params, eos)
        core_requests = []
        for i in range(params.n):
            seed = params.sample_seed(i) if params.seed is not None else int(self._rng.integers(1 << 62))
            core_requests.append(EngineCoreRequest(
                f"{request_id}#{i}", request.prompt_token_ids, params, seed, eos, stop_token_ids, priority,
                wants_prompt_logprobs=request.prompt_logprobs is not None and i == 0))
            request.samples.append(SampleState(i, core_requests[-1].request_id, self.output_processor.detokenizer(request),
                                               logprobs=[] if params.logprobs is not None else None))
        self.core.add_requests(core_requests)  # all or none: a refused sample raises ValueError
        self._requests[request_id] = request
        for s in request.samples:
            self._by_core_id[s.core_id] = (request, s)

    def _stop_token_ids(self, params: SamplingParams, eos: int) -> list[int]:
        """The request's stop tokens plus the model's other EOS ids (generation_config.json's), as vLLM."""
        own = list(params.stop_token_ids or [])
        if params.ignore_eos:
            return own
        vocab = self.model_config.vocab_size
        return own + [t for t in self.generation_config.eos_token_ids if t != eos and 0 <= t < vocab and t not in own]

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Raises ValueError for a request the engine cannot run; returns the params it will use
        (max_tokens filled in, or capped to what max_model_len leaves: the server refuses such a
        request before it gets here). Reads only the engine's configuration, so any thread may call it."""
        if not prompt_token_ids:
            raise ValueError("The decoder prompt cannot be empty")
        if params.n > MAX_N:  # each sample is a request of its own: a runaway n would take every byte
            raise ValueError(f"n={params.n} is more than the engine's limit of {MAX_N} samples per request")
        vocab = self.model_config.vocab_size
        if max(prompt_token_ids) >= vocab or min(prompt_token_ids) < 0:
            bad = next(t for t in prompt_token_ids if not 0 <= t < vocab)
            raise ValueError(f"Token id {bad} is out of vocabulary (the vocabulary has {vocab} tokens)")
        params = self._check_biases(params, vocab)
        if params.structured_outputs is not None:
            params = self._check_structured_outputs(params)
        for cls in self.logits_processor_classes:
            cls.validate_params(params)
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
        self._check_fits_cache(len(prompt_token_ids), params.max_tokens)
        for token in params.stop_token_ids or []:
            if token >= vocab:
                raise ValueError(f"stop_token_ids contains token id {token}, which is out of vocabulary "
                                 f"(the vocabulary has {vocab} tokens)")
        self._check_logprobs(params.logprobs, "sample")
        self._check_logprobs(params.prompt_logprobs, "prompt")
        return params

    def _check_biases(self, params: SamplingParams, vocab: int) -> SamplingParams:
        """logit_bias and allowed_token_ids within the model's vocabulary (vLLM's messages); bad_words
        tokenized into a copy of params."""
        outside = sorted(t for t in params.logit_bias or {} if t >= vocab)
        if outside:
            raise ValueError(f"token_id(s) {outside} in logit_bias contain out-of-vocab token ids. "
                             f"Vocabulary size: {vocab}")
        if params.allowed_token_ids is not None and max(params.allowed_token_ids) >= vocab:
            raise ValueError("allowed_token_ids contains out-of-vocab token id!")
        if not params.bad_words:
            return params
        if self.tokenizer is None:
            raise ValueError("bad_words need a tokenizer, and this engine was created without one")
        params = params.clone()
        params.update_from_tokenizer(self.tokenizer)
        bad = sorted({t for word in params.bad_words_token_ids for t in word if t >= vocab})
        if bad:
            raise ValueError(f"The model vocabulary size is {vocab}, but the following tokens were specified as "
                             f"bad: {bad}. All token id values should be integers satisfying: 0 <= token_id < {vocab}.")
        return params

    def _check_structured_outputs(self, params: SamplingParams) -> SamplingParams:
        """The constraint compiles (ValueError with the backend's message otherwise); a copy of
        params records the backend that will compile it."""
        if self.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer, and this engine was created without one")
        chosen = params.structured_outputs._backend  # the server's protocol checked it already
        if chosen is not None and self.structured_outputs_backend in ("auto", chosen):
            return params
        params = params.clone()
        structured_output.validate(params.structured_outputs, self.structured_outputs_backend)
        return params

    def _check_fits_cache(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """The scheduler's rule, checked here so that a core in another process never refuses:
        a request must fit the whole KV cache at its longest (its last token needs no slot), in
        all its KV groups at once (hybrid models)."""
        longest = min(num_prompt_tokens + max_tokens, self.max_model_len)
        info = self.info
        needed = _C.max_kv_blocks_per_request(longest - 1, info.block_size, info.kv_group_windows,
                                              info.max_step_tokens)
        usable = info.num_blocks - 1
        if needed > usable:
            raise ValueError(f"The request needs up to {needed} KV blocks ({longest} tokens) but the whole KV cache "
                             f"has {usable}; lower max_tokens or give the KV cache more memory")

    def _check_logprobs(self, num: int | None, kind: str) -> None:
        """vLLM's rule and message: -1 means the whole vocabulary; at most max_logprobs."""
        if num is None:
            return
        vocab = self.model_config.vocab_size
        limit = vocab if self.max_logprobs == -1 else self.max_logprobs
        if (vocab if num == -1 else num) > limit:
            raise ValueError(f"Requested {kind} logprobs of {vocab if num == -1 else num}, which is greater "
                             f"than max allowed: {limit}")

    def abort_request(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            request = self._requests.get(rid)
            if request is not None:
                self.core.abort_requests([s.core_id for s in request.samples])
                self._forget(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # ---- the step -------------------------------------------------------------------------

    def step(self, timeout: float | None = None) -> list[RequestOutput]:
        """One core step; returns the outputs of the requests that changed. ``timeout``: with
        the core in another process, the most seconds to wait for its next step ([] then).

        A failure inside the step ends only the requests it concerns, with finish_reason "error"
        (the exception goes to the log): all of the step's requests when the forward pass fails,
        the request alone when its sampling, detokenizing or stop check fails."""
        return self._process(self.core.step(timeout))

    def end_failed_step(self) -> list[RequestOutput]:
        """After step() raised: fails the requests of the core's open step (their last outputs
        are returned), so that the next step can run."""
        return self._process(self.core.end_failed_step())

    def _process(self, core: EngineCoreOutputs) -> list[RequestOutput]:
        touched: dict[str, RequestState] = {}
        failures: dict[str, RequestState] = {}
        chunks = {}
        for row, first, logprobs in core.prompt_logprobs:
            chunks.setdefault(row, []).append((first, logprobs))
        offsets = core.new_token_offsets.tolist()
        for row, (core_id, reason) in enumerate(zip(core.request_ids, core.finish_reasons.tolist())):
            entry = self._by_core_id.get(core_id)
            if entry is None:  # aborted here since
                continue
            request, sample = entry
            if reason == ERROR:
                failures[request.request_id] = request
                continue
            try:
                if self._apply(request, sample, core, row, offsets, chunks.get(row, ())):
                    touched[request.request_id] = request
            except Exception as e:  # noqa: BLE001 - a detokenizer or stop-check failure is this request's
                logger.error("its outputs failed; aborting request(s) %s", request.request_id,
                             exc_info=(type(e), e, e.__traceback__))
                failures[request.request_id] = request
        outputs = [self.output(r) for r in touched.values() if r.request_id not in failures]
        return [o for o in outputs if o is not None] + self._fail(failures)

    def _apply(self, request: RequestState, sample: SampleState, core: EngineCoreOutputs, row: int,
               offsets: list[int], chunks) -> bool:
        """Applies row ``row`` of a core step to its sample; True when the request has something
        new to show."""
        cached = int(core.num_cached_tokens[row])
        if cached >= 0 and sample.index == 0 and request.num_cached_tokens is None:
            request.num_cached_tokens = cached
        for first, logprobs in chunks:
            self.output_processor.record_prompt_logprobs(request, first, logprobs)
        if sample.finish_reason is not None:  # a stop string ended it here; a remote core ran on meanwhile
            return False
        touched = False
        reason = int(core.finish_reasons[row])
        if offsets[row + 1] > offsets[row]:
            new = core.new_token_ids[offsets[row]:offsets[row + 1]].tolist()
            stop_token = FINISH_REASON_NAMES[reason] == "stop"  # the core stops on tokens only
            if self.output_processor.append(request, sample, new, core.sampled, row, stop_token):  # a stop string
                self.core.abort_requests([sample.core_id])
            touched = True
        if reason and sample.finish_reason is None:
            stop = int(core.stop_reasons[row])
            sample.finish_reason, sample.stop_reason = FINISH_REASON_NAMES[reason], stop if stop >= 0 else None
            touched = True
        return touched

    def _fail(self, failures: dict[str, RequestState]) -> list[RequestOutput]:
        """Finishes each request with finish_reason "error" and returns its last outputs."""
        outputs = []
        for request in failures.values():
            unfinished = [s for s in request.samples if s.finish_reason is None]
            self.core.abort_requests([s.core_id for s in unfinished])
            for s in unfinished:
                s.finish_reason = "error"
            output = self.output(request)
            if output is not None:
                outputs.append(output)
        return outputs

    def output(self, request: RequestState) -> RequestOutput | None:
        """The request's output (output_processor.output); a finished request is forgotten."""
        if request.finished():
            self._forget(request)
        return self.output_processor.output(request)

    def _forget(self, request: RequestState) -> None:
        """Drops a finished or aborted request from the engine's maps."""
        del self._requests[request.request_id]
        for s in request.samples:
            self._by_core_id.pop(s.core_id, None)

    # ---- the model, through the core's executor --------------------------------------------

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        return self.core.collective_rpc(method, args, kwargs)

    def apply_model(self, func) -> list:
        return self.core.collective_rpc(_apply_model, (func,))

    def reset_prefix_cache(self) -> bool:
        return self.core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.core.shutdown()


def _apply_model(worker, func):
    return func(worker.model)


def _check_parallel_sizes(device: torch.device, tp: int, pp: int, dp: int, backend: str | None = None) -> None:
    """Every rank needs a device of its own (a GPU, or on the CPU a core): more ranks than this
    machine has are refused before any process starts. Ray places ranks on the nodes of its
    cluster, so there the cluster's resources decide (RayExecutor says when they fall short)."""
    for name, size in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp), ("data_parallel_size", dp)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} must be an integer of at least 1, got {size!r}")
    if backend == "ray":
        return
    have, what = (torch.cuda.device_count(), "GPUs") if device.type == "cuda" else \
        (len(os.sched_getaffinity(0)), "CPUs this process may use")
    if tp * pp * dp > have:
        raise ValueError(f"tensor_parallel_size x pipeline_parallel_size x data_parallel_size = {tp * pp * dp} "
                         f"ranks, but there are only {have} {what}: each rank needs one")


def _speculative_config(config, tensor_parallel_size: int, pipeline_parallel_size: int,
                        logits_processors) -> SpeculativeConfig | None:
    speculative = SpeculativeConfig.from_dict(config)
    if speculative is not None and speculative.method in EAGLE_METHODS and tensor_parallel_size > 1:
        raise ValueError("EAGLE heads are not supported with tensor parallelism yet (they share the target's "
                         "embedding and LM head, which tensor parallelism cuts)")
    if speculative is not None and pipeline_parallel_size > 1:
        raise ValueError("speculative decoding is not supported with pipeline parallelism (pipeline_parallel_size > 1)")
    if speculative is not None and logits_processors:
        raise ValueError("speculative decoding is not supported with custom logits processors: they see one row "
                         "per request, a step verifying drafts has several")
    return speculative


def _device(model, device: str, quantization: str | None = None) -> torch.device:
    resolved = resolve_device(device)
    reason = cpu_only_reason(model, quantization) if resolved.type == "cuda" else None
    if reason and device in (None, "auto"):  # "auto" means the best device this model can use
        print(f"octavo: running on the CPU: {reason}")
        return torch.device("cpu")
    if reason:
        raise ValueError(f"device={str(device)!r}: {reason}; use device='cpu'")
    return resolved


def _structured_outputs_backend(config: dict | None) -> str:
    """vLLM's structured_outputs_config, of which Octavo reads the backend."""
    config = dict(config or {})
    backend = config.pop("backend", "auto")
    if config:
        raise ValueError(f"structured_outputs_config takes only 'backend', got {sorted(config)}")
    if backend not in structured_output.BACKENDS:
        raise ValueError(f"structured_outputs_config backend must be one of {structured_output.BACKENDS}, "
                         f"got {backend!r}")
    return backend
