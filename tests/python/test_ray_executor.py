"""The Ray executor (distributed_executor_backend="ray"): a Ray actor per rank on a local Ray
cluster, every architecture at tensor_parallel_size=2 (and two pipeline stages, and one rank)
giving the in-process worker's greedy tokens and logprobs, each rank holding only its part, and
a rank that dies or fails alone ending the engine with a clear error. One local cluster serves
the module (started by its first engine, shut down with its last)."""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time

import psutil
import pytest
import torch

ray = pytest.importorskip("ray")

from octavo import SamplingParams  # noqa: E402
from octavo.engine.core_messages import EngineDeadError  # noqa: E402
from octavo.entrypoints.openai.cli_args import add_arguments  # noqa: E402
from test_detokenizer import _byte_level_bpe  # noqa: E402
from test_models import ARCHITECTURES  # noqa: E402
from test_tensor_parallel import assert_same, checkpoint, engine, run  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return _byte_level_bpe()


@pytest.fixture(scope="module")
def untied(tokenizer, tmp_path_factory):
    """(checkpoint, its TP = 2 engine on Ray): the module's first engine, which starts the local
    cluster; the cluster and every Ray process it started end with it."""
    path = checkpoint(tmp_path_factory.mktemp("untied"), "llama", tokenizer, tie_word_embeddings=False)
    llm = engine(path, 2, distributed_executor_backend="ray")
    yield path, llm
    ray_processes = psutil.Process().children(recursive=True)
    llm.llm_engine.shutdown()
    assert not ray.is_initialized()
    _, alive = psutil.wait_procs(ray_processes, timeout=30)
    assert not alive, [p.name() for p in alive]


def gone(pids: list[int], timeout: float = 10) -> bool:
    """Whether the processes end within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while any(psutil.pid_exists(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not any(psutil.pid_exists(pid) for pid in pids)


def ray_engine(path, tp: int):
    return engine(path, tp, distributed_executor_backend="ray")


@pytest.mark.parametrize("kind", list(ARCHITECTURES))
def test_tp2_on_ray_matches_tp1_in_process(kind, untied, tokenizer, tmp_path):
    path = checkpoint(tmp_path, kind, tokenizer)
    two = ray_engine(path, 2)
    try:
        assert_same(run(two), run(engine(path, 1)))
    finally:
        two.llm_engine.shutdown()
    assert ray.is_initialized()  # the module's engine still uses the cluster


def test_pipeline_stages_on_ray_match_one_process(untied):
    """Two stages, a step in flight on each: the actors run their steps in the order sent."""
    path, _ = untied
    stages = engine(path, 1, pipeline_parallel_size=2, distributed_executor_backend="ray")
    try:
        assert_same(run(stages), run(engine(path, 1)))
        assert stages.collective_rpc(lambda worker: worker.driver) == [False, True]
    finally:
        stages.llm_engine.shutdown()


def test_one_rank_on_ray_matches_in_process_with_steps_through_the_object_store(untied, monkeypatch):
    """(Steps under INLINE_STEP_BYTES travel inside the calls, as in the tests above.)"""
    from octavo.executor import ray_executor

    monkeypatch.setattr(ray_executor, "INLINE_STEP_BYTES", 0)
    path, _ = untied
    one = ray_engine(path, 1)
    try:
        assert_same(run(one), run(engine(path, 1)))
        assert one.collective_rpc(lambda worker: (worker.rank, worker.world_size)) == [(0, 1)]
    finally:
        one.llm_engine.shutdown()


def test_each_rank_holds_only_its_part_in_its_own_actor(untied):
    path, two = untied

    def weight_bytes(model):
        return sum(p.numel() * p.element_size() for p in model.parameters())

    def norm_bytes(model):
        return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "norm" in name)

    whole = engine(path, 1).apply_model(weight_bytes)[0]
    ranks, norms = two.apply_model(weight_bytes), two.apply_model(norm_bytes)
    assert all(r - n <= (whole - n) / 2 + 2 * 128 * 4 for r, n in zip(ranks, norms))  # an odd row at most
    assert sum(ranks) - norms[1] == whole
    pids = two.collective_rpc(lambda worker: os.getpid())
    assert len(set(pids)) == 2 and os.getpid() not in pids


def test_an_error_every_rank_raises_is_the_calls_and_the_engine_lives_on(untied):
    _, two = untied
    with pytest.raises(AttributeError, match="no_such_method"):
        two.collective_rpc("no_such_method")
    assert two.generate("Hello", SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids


def test_a_killed_actor_ends_the_engine_with_a_clear_error(untied):
    path, _ = untied
    llm = ray_engine(path, 2)
    pids = llm.collective_rpc(lambda worker: os.getpid())
    threading.Timer(0.5, os.kill, (pids[1], signal.SIGKILL)).start()
    deadline = time.monotonic() + 60
    with pytest.raises(EngineDeadError, match="worker 1 died"):
        while time.monotonic() < deadline:
            llm.generate(["Hello"] * 4, SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)
    assert gone(pids[:1])  # the other rank is killed with it
    with pytest.raises(EngineDeadError):
        llm.generate("Hello", use_tqdm=False)
    assert ray.is_initialized()


def test_a_rank_that_fails_alone_ends_the_engine_without_waiting_for_the_others(untied):
    """Rank 1 raises while rank 0 would wait a minute (as in a collective its peer never
    joins): the engine ends within the grace period, and both actors are killed."""
    path, _ = untied
    llm = ray_engine(path, 2)
    pids = llm.collective_rpc(lambda worker: os.getpid())
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="worker 1 failed: ZeroDivisionError"):
        llm.collective_rpc(lambda worker: time.sleep(60) if worker.rank == 0 else 1 / 0)
    assert time.monotonic() - started < 10
    assert gone(pids)
    with pytest.raises(EngineDeadError):
        llm.generate("Hello", use_tqdm=False)


def test_backend_names_are_checked(untied):
    path, _ = untied
    with pytest.raises(ValueError, match="must be 'uni', 'mp' or 'ray', got 'rays'"):
        engine(path, 2, distributed_executor_backend="rays")
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(["--distributed-executor-backend", "ray"]).distributed_executor_backend == "ray"


def test_the_cluster_not_this_machine_decides_how_many_ranks_fit(untied, monkeypatch):
    """This machine's CPU count does not bound Ray's ranks (they may run on other nodes); the
    cluster's resources do, and ranks it has no room for fail with what it has, and leave the
    engine that was there running."""
    from octavo.engine.llm_engine import _check_parallel_sizes
    from octavo.executor import ray_executor

    many = len(os.sched_getaffinity(0)) + 1
    with pytest.raises(ValueError, match="each rank needs one"):
        _check_parallel_sizes(torch.device("cpu"), many, 1, 1, "mp")
    _check_parallel_sizes(torch.device("cpu"), many, 1, 1, "ray")
    path, llm = untied
    monkeypatch.setattr(ray_executor, "CPU_BUNDLE", 10**4)
    monkeypatch.setattr(ray_executor, "PLACEMENT_SECONDS", 2)
    with pytest.raises(RuntimeError, match=r"the Ray cluster found no room for 2 ranks of \{'CPU': 10000\}"):
        ray_engine(path, 2)
    assert len(run(llm)) == 4

