"""Data parallel: several engine cores behind one front end, each with its own scheduler and
KV cache; requests spread over them by load and come back as one engine's would."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

pytest.importorskip("zmq")

import torch  # noqa: E402

from octavo import LLM, SamplingParams, get_num_threads  # noqa: E402
from octavo.engine.core import EngineCoreConfig  # noqa: E402
from octavo.engine.dp_client import placement  # noqa: E402
from octavo.executor.configs import WorkerConfig  # noqa: E402
from octavo.engine.core_messages import EngineDeadError  # noqa: E402
from test_engine_core_process import core_processes_of  # noqa: E402


def engine(path, dp: int) -> LLM:
    return LLM(model=str(path), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=128,
               data_parallel_size=dp)


def view(outputs):
    return [[(c.token_ids, c.text, c.finish_reason) for c in o.outputs] for o in outputs]


def test_two_cores_answer_as_one_and_share_the_load(tiny_path):
    two, one = engine(tiny_path, 2), engine(tiny_path, 1)
    try:
        prompts = [f"Request {i}: " + "word " * i for i in range(12)]
        params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                  SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=8, ignore_eos=True),
                  SamplingParams(temperature=0, max_tokens=24, stop=["o"], ignore_eos=True)] * 4
        assert view(two.generate(prompts, params, use_tqdm=False)) == view(one.generate(prompts, params, use_tqdm=False))
        steps = two.collective_rpc(lambda worker: (os.getpid(), worker.num_steps))
        assert len({pid for pid, _ in steps}) == 2 and all(n > 0 for _, n in steps)  # both cores ran requests
        # Each core keeps to its own share of the CPUs, with a thread for each of them.
        cpus = sorted(os.sched_getaffinity(0))
        share = len(cpus) // 2
        placed = two.collective_rpc(lambda worker: (sorted(os.sched_getaffinity(0)), get_num_threads(),
                                                    torch.get_num_threads()))
        assert placed == [(cpus[:share], share, share), (cpus[share:2 * share], share, share)]
        assert two.llm_engine.stats.num_used_blocks == 0 and not two.llm_engine.has_unfinished_requests()
        assert two.llm_engine.core._load == [0, 0]
    finally:
        two.llm_engine.shutdown()


def test_a_dead_core_ends_the_engine_with_a_clear_error(tiny_path):
    llm = engine(tiny_path, 2)
    core = llm.llm_engine.core.clients[1].process
    threading.Timer(0.5, os.kill, (core.pid, signal.SIGKILL)).start()
    deadline = time.monotonic() + 60
    with pytest.raises(EngineDeadError, match="died"):
        while time.monotonic() < deadline:
            llm.generate(["Hello"] * 4, SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)
    llm.llm_engine.shutdown()
    assert all(client.process.poll() is not None for client in llm.llm_engine.core.clients)


def test_a_bad_size_is_refused(tiny_path):
    with pytest.raises(ValueError, match="data_parallel_size must be an integer of at least 1"):
        engine(tiny_path, 0)
    with pytest.raises(ValueError, match="each rank needs one"):
        engine(tiny_path, 10**9)


def test_the_server_runs_two_cores(tmp_path):
    import httpx

    from live_server import LiveServer

    server = LiveServer("--max-model-len", "256", "--data-parallel-size", "2", log=tmp_path / "serve.log")
    try:
        assert len(core_processes_of(server.process.pid)) == 2
        body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
        texts = [httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
                 for _ in range(4)]
        assert len(set(texts)) == 1 and texts[0]
    finally:
        server.stop_cleanly(signal.SIGTERM)


def test_gpu_cores_get_their_ranks_gpus_in_order():
    def config(device: str, tp: int) -> EngineCoreConfig:
        return EngineCoreConfig(WorkerConfig("m", "float32", "dummy", device, None, tp, 1))

    gpus = ["0", "1", "2", "3"]
    assert [placement(config("cuda:0", 2), core, 2, gpus) for core in range(2)] == \
        [{"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    assert placement(config("cuda", 1), 2, 4, ["5", "6", "7", "9"]) == {"CUDA_VISIBLE_DEVICES": "7"}
    assert placement(config("cpu", 1), 1, 2, ["0", "1", "2", "3", "4"]) == {"OCTAVO_CPU_AFFINITY": "2,3"}
    with pytest.raises(ValueError, match="device must be 'cuda', not 'cuda:1'"):
        placement(config("cuda:1", 1), 0, 2, gpus)

