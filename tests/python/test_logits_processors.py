"""Custom logits processors through vLLM v1's interface: a processor that forces each request's
extra_args["target_token"] keeps the right token on the right request while requests come and
finish at different steps (the batch updates: removed, added, moved), leaves the others' tokens
as they are without it, refuses bad extra_args at admission, is loaded by "module:Class" name,
and runs in an engine core process of its own and behind the server (vllm_xargs)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

SAMPLED = dict(temperature=1.0, ignore_eos=True)


class ForceToken(LogitsProcessor):
    """vLLM's documented example: each request with extra_args["target_token"] gets that token."""

    moves = 0  # seen in all batch updates (in-process engines)

    def __init__(self, vllm_config, device, is_pin_memory):
        self.vocab_size = vllm_config.model_config.vocab_size
        self.targets: dict[int, int] = {}  # batch index -> token

    @classmethod
    def validate_params(cls, sampling_params):
        target = (sampling_params.extra_args or {}).get("target_token")
        if target is not None and not isinstance(target, int):
            raise ValueError(f"target_token must be an int, got {target!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if batch_update is None:
            return
        for i in batch_update.removed:
            self.targets.pop(i, None)
        for i, params, _, _ in batch_update.added:
            target = (params.extra_args or {}).get("target_token")
            if target is None:
                self.targets.pop(i, None)
            else:
                self.targets[i] = target
        ForceToken.moves += len(batch_update.moved)
        for a, b, direction in batch_update.moved:
            assert direction is MoveDirectionality.UNIDIRECTIONAL
            if a in self.targets:
                self.targets[b] = self.targets.pop(a)
            else:
                self.targets.pop(b, None)
        assert all(i < batch_update.batch_size for i in self.targets)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        for i, token in self.targets.items():
            logits[i] = float("-inf")
            logits[i, token] = 0.0
        return logits


class CountCalls(LogitsProcessor):
    """Argmax-invariant: vLLM skips it in steps where every request is greedy."""

    calls = 0

    def __init__(self, vllm_config, device, is_pin_memory):
        pass

    def is_argmax_invariant(self) -> bool:
        return True

    def update_state(self, batch_update):
        pass

    def apply(self, logits):
        CountCalls.calls += 1
        return logits


@pytest.fixture(scope="module")
def llm(tiny_path):
    return LLM(model=str(tiny_path), dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=128,
               logits_processors=[ForceToken, CountCalls])


def test_targets_stay_with_their_requests_as_the_batch_changes(llm, tiny_path):
    # Different lengths: requests finish at different steps, so the batch loses and moves rows.
    ForceToken.moves = 0
    params = [SamplingParams(**SAMPLED, seed=i, max_tokens=4 + 3 * i,
                             extra_args={"target_token": 40 + i} if i % 2 else None) for i in range(8)]
    outs = llm.generate([f"prompt {i}" for i in range(8)], params, use_tqdm=False)
    plain = LLM(model=str(tiny_path), dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=128)
    free = plain.generate([f"prompt {i}" for i in range(0, 8, 2)], params[::2], use_tqdm=False)
    for i, out in enumerate(outs):
        tokens = list(out.outputs[0].token_ids)
        assert len(tokens) == 4 + 3 * i
        if i % 2:
            assert tokens == [40 + i] * len(tokens)
    assert [list(o.outputs[0].token_ids) for o in outs[::2]] == [list(o.outputs[0].token_ids) for o in free]
    assert ForceToken.moves > 0, "the batch was condensed as requests finished"


def test_argmax_invariant_processors_skip_greedy_steps(llm):
    CountCalls.calls = 0
    llm.generate(["a", "b"], SamplingParams(temperature=0.0, max_tokens=5), use_tqdm=False)
    assert CountCalls.calls == 0
    llm.generate(["a", "b"], SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert CountCalls.calls == 5


def test_bad_extra_args_are_refused_when_added(llm):
    with pytest.raises(ValueError, match="target_token must be an int"):
        llm.generate("x", SamplingParams(extra_args={"target_token": "seven"}), use_tqdm=False)
    with pytest.raises(ValueError, match="extra_args must be a dict"):
        SamplingParams(extra_args=[1])


def test_bad_processors_are_refused(tiny_path):
    with pytest.raises(ValueError, match="cannot be imported"):
        LLM(model=str(tiny_path), logits_processors=["no_such_module:Thing"])
    with pytest.raises(ValueError, match="must be a LogitsProcessor subclass"):
        LLM(model=str(tiny_path), logits_processors=[dict])


@pytest.fixture
def importable(monkeypatch):
    """This test module importable by name in processes the engine starts."""
    here = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")])))


def test_by_name_in_an_engine_core_process(tiny_path, importable):
    llm = LLM(model=str(tiny_path), dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=128,
              logits_processors=["test_logits_processors:ForceToken"], multiprocess=True)
    try:
        out = llm.generate(["a", "b"], [SamplingParams(**SAMPLED, max_tokens=6, extra_args={"target_token": 33}),
                                        SamplingParams(**SAMPLED, max_tokens=6)], use_tqdm=False)
        assert list(out[0].outputs[0].token_ids) == [33] * 6
        assert list(out[1].outputs[0].token_ids) != [33] * 6
    finally:
        llm.llm_engine.shutdown()


def test_vllm_xargs_through_the_server(tiny_path, importable, tmp_path):
    pytest.importorskip("openai")
    import httpx
    from live_server import LiveServer

    server = LiveServer(str(tiny_path), "--max-model-len", "128", "--logits-processors",
                        "test_logits_processors:ForceToken", log=tmp_path / "serve.log")
    try:
        body = {"prompt": "hi", "max_tokens": 5, "ignore_eos": True, "vllm_xargs": {"target_token": 21}}
        r = httpx.post(f"{server.url}/v1/completions", json={**body, "return_token_ids": True}, timeout=60)
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == [21] * 5
        r = httpx.post(f"{server.url}/v1/completions", json={**body, "vllm_xargs": {"target_token": "x"}}, timeout=60)
        assert r.status_code == 400 and "target_token must be an int" in r.json()["error"]["message"]
    finally:
        server.stop_cleanly()
