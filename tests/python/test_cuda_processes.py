"""The engine's processes on a GPU: an engine core in a process of its own, a worker in a process
of its own (the "mp" executor at one rank) and both together give the in-process engine's greedy
tokens, logprobs and seeded samples on the GPU, with CUDA graphs and eagerly, and return every KV
block; a worker killed mid-run ends the engine with a clear error. Runs only where a GPU is
present and this build carries CUDA kernels."""

from __future__ import annotations

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from octavo import LLM, SamplingParams  # noqa: E402
from octavo.device import cuda_unusable_reason  # noqa: E402
from test_cuda_engine import tiny_model_dir  # noqa: E402
from test_tensor_parallel import kill_worker_mid_run  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(cuda_unusable_reason() is not None,
                                                   reason=cuda_unusable_reason() or "")]

LAYOUTS = {"core process": {"multiprocess": True}, "worker process": {"distributed_executor_backend": "mp"},
           "core and worker processes": {"multiprocess": True, "distributed_executor_backend": "mp"}}


def make_llm(path, enforce_eager: bool, **layout) -> LLM:
    return LLM(model=str(path), dtype="float32", device="cuda", kv_cache_memory_bytes=64 << 20, max_num_seqs=8,
               max_model_len=256, enforce_eager=enforce_eager, **layout)


def workload(llm: LLM, tokenizer) -> list[tuple[list[int], float, list[int]]]:
    """Greedy requests with logprobs and seeded samples of several lengths, so that decode
    steps run with 8 down to 1 rows; each output's tokens, cumulative logprob and top ids."""
    prompts = [tokenizer.encode(t) for t in ("Hello world", "Straße und Meer", "x", "a longer prompt " * 6)] * 2
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True, logprobs=2) for i in range(4)]
    params += [SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=5 + 2 * i, ignore_eos=True, logprobs=2)
               for i in range(4)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].cumulative_logprob,
             [sorted(step) for step in o.outputs[0].logprobs]) for o in outputs]


@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_each_process_layout_gives_the_in_process_outputs(enforce_eager, tmp_path):
    tokenizer, _ = tiny_model_dir(tmp_path)
    expected = workload(make_llm(tmp_path, enforce_eager), tokenizer)
    for name, layout in LAYOUTS.items():
        llm = make_llm(tmp_path, enforce_eager, **layout)
        try:
            got = workload(llm, tokenizer)
            assert [g[0] for g in got] == [e[0] for e in expected], name
            assert [g[2] for g in got] == [e[2] for e in expected], name
            assert [g[1] for g in got] == pytest.approx([e[1] for e in expected], abs=1e-4), name
            assert llm.collective_rpc(lambda worker: worker.device.type) == ["cuda"]
            assert llm.llm_engine.stats.num_used_blocks == 0
            assert llm.collective_rpc(lambda worker: worker.runner.cuda_graphs is None) == [enforce_eager]
        finally:
            llm.llm_engine.shutdown()


def test_a_killed_gpu_worker_ends_the_engine_with_a_clear_error(tmp_path):
    tiny_model_dir(tmp_path)
    llm = make_llm(tmp_path, enforce_eager=False, distributed_executor_backend="mp")
    kill_worker_mid_run(llm, 0)
