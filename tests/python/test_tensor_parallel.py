"""Tensor parallel over worker processes (gloo on this CPU): how weights are cut, and every
architecture at tensor_parallel_size=2 giving TP = 1's greedy tokens and logprobs, each rank
holding only its part, and a dead worker ending the engine with a clear error."""

from __future__ import annotations

import glob
import os
import signal
import threading
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("zmq")

from octavo import LLM, SamplingParams  # noqa: E402
from octavo.distributed.shards import TPShard, split  # noqa: E402
from octavo.engine.core_messages import EngineDeadError  # noqa: E402
from octavo.entrypoints.cli import main  # noqa: E402
from test_detokenizer import _byte_level_bpe  # noqa: E402
from test_models import ARCHITECTURES, tiny_checkpoint  # noqa: E402

STEPS = 32


@given(st.integers(1, 5000), st.integers(1, 16))
def test_split_cuts_contiguous_near_equal_ranges(total, parts):
    ranges = [split(total, parts, i) for i in range(parts)]
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [end - begin for begin, end in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@given(st.integers(1, 8), st.integers(1, 6), st.sampled_from([1, 2, 3, 4, 8]))
def test_attention_is_cut_at_kv_group_boundaries(kv_heads, group, world):
    heads = kv_heads * group

    class Config:
        num_attention_heads, num_key_value_heads, intermediate_size, vocab_size = heads, kv_heads, 64, 300

    if kv_heads < world and (world % kv_heads or group < world // kv_heads):
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            TPShard.of(Config, 0, world)
        return
    shards = [TPShard.of(Config, r, world) for r in range(world)]
    for s in shards:  # a rank's query heads all read its own KV heads
        assert s.num_heads >= 1 and s.num_kv_heads >= 1
        assert s.kv_heads[0] <= s.q_heads[0] // group and (s.q_heads[1] - 1) // group < s.kv_heads[1]
    covered = sorted(h for s in shards for h in range(*s.q_heads))
    assert covered == list(range(heads))  # every query head on exactly one rank
    assert sum(s.intermediate_size for s in shards) == 64 and sum(s.vocab_size for s in shards) == 300


@pytest.fixture(scope="module")
def tokenizer():
    return _byte_level_bpe()


def checkpoint(path, kind: str, tokenizer, **overrides):
    tokenizer.save_pretrained(path)
    tiny_checkpoint(kind, path, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, **overrides)
    return path


def engine(path, tp: int, **kwargs) -> LLM:
    return LLM(model=str(path), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=128, max_logprobs=-1,
               tensor_parallel_size=tp, **kwargs)


def run(llm: LLM) -> list:
    """Greedy tokens of a small batch and every token's whole-vocabulary logprobs."""
    prompts = ["Hello world", "Emoji time 😀", "x", "Hello world, once more. " * 4]
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, logprobs=-1)
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


# w4a8 rounds each layer's inputs to int8: where the ranks' sums (added in another order) put an
# input across a rounding boundary, a term moves by one step of the int8 grid.
LOGPROB_TOLERANCE = {"w4a8": 2e-2}


def assert_same(two: list, one: list, tolerance: float = 1e-4) -> None:
    for a, b in zip(two, one):
        assert a.token_ids == b.token_ids and a.text == b.text
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            assert max(abs(x[t].logprob - y[t].logprob) for t in x) < tolerance


# (6 heads over 3 KV groups, cut 2 + 1 like the default model's 9 / 3), odd intermediate size.
UNEVEN = dict(hidden_size=192, num_attention_heads=6, num_key_value_heads=3, intermediate_size=255)


@pytest.mark.parametrize("kind,overrides", [(kind, {}) for kind in ARCHITECTURES] + [("llama", UNEVEN)],
                         ids=list(ARCHITECTURES) + ["uneven"])
def test_every_architecture_at_tp2_matches_tp1(kind, overrides, tokenizer, tmp_path):
    path = checkpoint(tmp_path, kind, tokenizer, **overrides)
    two = engine(path, 2)
    try:
        assert_same(run(two), run(engine(path, 1)))
        shapes = two.apply_model(lambda m: (m.shard.num_heads, m.shard.num_kv_heads, m.shard.intermediate_size))
        if overrides:
            assert shapes == [(4, 2, 128), (2, 1, 127)]
    finally:
        two.llm_engine.shutdown()


# Cuts on the int4 groups' boundaries (o_proj and down: 256 inputs, 128 a rank).
ALIGNED = dict(hidden_size=256, num_attention_heads=8, num_key_value_heads=2, intermediate_size=256)


@pytest.mark.parametrize("method", ["int8", "int4", "w4a8", "fp8"])
def test_quantized_at_load_each_rank_holds_the_whole_weights_part(method, tokenizer, tmp_path):
    """Output rows are cut before quantizing, input columns after: a rank's quantized part is
    bit for bit the whole weight's, so TP = 2 answers as TP = 1 with the same quantization."""
    path = checkpoint(tmp_path, "llama", tokenizer, **ALIGNED)
    two = engine(path, 2, quantization=method)
    try:
        one = engine(path, 1, quantization=method)
        assert_same(run(two), run(one), LOGPROB_TOLERANCE.get(method, 1e-4))
        # As bytes: torch cannot unpickle a float8 tensor from another process.
        whole = one.apply_model(lambda m: m.layers[0].mlp.down_weight.qweight.view(torch.uint8).clone())[0]
        parts = two.apply_model(lambda m: m.layers[0].mlp.down_weight.qweight.view(torch.uint8).clone())
        halves = [whole[:, :whole.shape[1] // 2], whole[:, whole.shape[1] // 2:]]
        assert all(bool((p == h).all()) for p, h in zip(parts, halves))
    finally:
        two.llm_engine.shutdown()


def test_w8a8_ranks_round_their_own_part_of_each_row(tokenizer, tmp_path):
    """W8A8 rounds a row of inputs with one scale. A row-parallel rank (o_proj, down) holds half
    of each row and rounds that half with its own scale, as vLLM's ranks do: TP = 2 is then close
    to TP = 1, not its arithmetic. The ranks still hold the whole weight's integers."""
    path = checkpoint(tmp_path, "llama", tokenizer, **ALIGNED)
    two = engine(path, 2, quantization="w8a8")
    try:
        one = engine(path, 1, quantization="w8a8")
        for a, b in zip(run(two), run(one)):
            assert a.token_ids[0] == b.token_ids[0]
            first, other = a.logprobs[0], b.logprobs[0]
            assert max(abs(first[t].logprob - other[t].logprob) for t in first) < 5e-2
        down = lambda m: (m.layers[0].mlp.down_weight.weight_format,  # noqa: E731
                          m.layers[0].mlp.down_weight.qweight.clone(), m.layers[0].mlp.down_weight.scales.clone())
        _, q, scales = one.apply_model(down)[0]
        half = q.shape[1] // 2
        for i, (fmt, part, part_scales) in enumerate(two.apply_model(down)):
            assert fmt == "int8_a8" and bool((part_scales == scales).all())
            assert bool((part == q[:, i * half:(i + 1) * half]).all())
    finally:
        two.llm_engine.shutdown()


def test_each_rank_holds_only_its_part(tokenizer, tmp_path):
    path = checkpoint(tmp_path, "llama", tokenizer, tie_word_embeddings=False)

    def weight_bytes(model):
        return sum(p.numel() * p.element_size() for p in model.parameters())

    def norm_bytes(model):
        return sum(p.numel() * p.element_size() for name, p in model.named_parameters() if "norm" in name)

    whole = engine(path, 1).apply_model(weight_bytes)[0]
    two = engine(path, 2)
    try:
        # Once the ranks are connected, their sockets' directory and all-reduce file have no
        # names left to leak when the engine core is killed with SIGKILL.
        executor = two.llm_engine.core.engine_core.executor
        assert not os.path.exists(executor._dir) and not glob.glob(f"{executor._shm_prefix}*")
        ranks, norms = two.apply_model(weight_bytes), two.apply_model(norm_bytes)
        assert all(r - n <= (whole - n) / 2 + 2 * 128 * 4 for r, n in zip(ranks, norms))  # an odd row at most
        assert sum(ranks) - norms[1] == whole
    finally:
        two.llm_engine.shutdown()


def kill_worker_mid_run(llm: LLM, rank: int) -> None:
    """Kills worker ``rank`` while the engine runs: the engine must end with an error naming it
    and stop the other workers, and refuse work from then on."""
    workers = llm.llm_engine.core.engine_core.executor.processes
    threading.Timer(0.5, os.kill, (workers[rank].pid, signal.SIGKILL)).start()
    deadline = time.monotonic() + 60
    with pytest.raises(EngineDeadError, match=f"worker {rank} died"):
        while time.monotonic() < deadline:
            llm.generate(["Hello"] * 4, SamplingParams(max_tokens=100, ignore_eos=True), use_tqdm=False)
    assert all(w.poll() is not None for w in workers)  # the other ranks are stopped with it
    with pytest.raises(EngineDeadError):
        llm.generate("Hello", use_tqdm=False)


def test_a_dead_worker_ends_the_engine_with_a_clear_error(tokenizer, tmp_path):
    kill_worker_mid_run(engine(checkpoint(tmp_path, "llama", tokenizer), 2), 1)


def test_settings_tensor_parallel_cannot_run_are_refused(tokenizer, tmp_path):
    path = checkpoint(tmp_path, "llama", tokenizer)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer of at least 1"):
        engine(path, 0)
    with pytest.raises(ValueError, match="each rank needs one"):  # before any worker starts
        engine(path, 10**9)
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        engine(path, 2, distributed_executor_backend="uni")


@pytest.mark.parametrize("method,overrides,tp,pp,o_weight", [
    ("int4", ALIGNED, 2, 1, "QuantizedWeight"), ("int4", {}, 2, 1, "Parameter"), ("int8", {}, 1, 2, "QuantizedWeight"),
    ("w4a8", ALIGNED, 2, 1, "QuantizedWeight")],
    ids=["int4-tp2", "int4-tp2-cut-in-a-group", "int8-pp2", "w4a8-tp2"])
def test_an_octavo_quantized_checkpoint_split_answers_as_whole(method, overrides, tp, pp, o_weight, tokenizer,
                                                                tmp_path):
    """`octavo quantize`'s files hold the whole quantized model: each rank takes its rows and input
    columns of the integers (the attention output's as floats where its cut splits an int4 group
    of 128: the tiny model's 128 inputs cut 64 + 64), each pipeline stage its own layers."""
    path = checkpoint(tmp_path, "llama", tokenizer, **overrides)
    assert main(["quantize", str(path), str(tmp_path / "q"), "--method", method]) == 0
    if method == "w4a8":  # a CPU format: the saved checkpoint says so
        from octavo.device import cpu_only_reason
        assert "w4a8" in cpu_only_reason(tmp_path / "q")
    parted = engine(tmp_path / "q", tp, pipeline_parallel_size=pp)
    try:
        assert_same(run(parted), run(engine(tmp_path / "q", 1)), LOGPROB_TOLERANCE.get(method, 1e-4))
        kinds = parted.apply_model(lambda m: {type(layer.self_attn.o_weight).__name__ for layer in m.layers})
        assert kinds == [{o_weight}] * (tp * pp)
    finally:
        parted.llm_engine.shutdown()


@pytest.mark.parametrize("split", [["--tensor-parallel-size", "2"], ["--pipeline-parallel-size", "2"]],
                         ids=["tp2", "pp2"])
def test_the_default_model_served_split_in_two_answers_as_whole(split, tmp_path):
    """The README's chat example through `octavo serve --tensor-parallel-size 2` (the default
    model's 9 query heads in 3 KV groups: ranks of 6 + 3 heads) or `--pipeline-parallel-size 2`
    (its 30 layers as 15 + 15), and through LLM.chat on one rank."""
    import httpx

    from live_server import LiveServer

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    alone = LLM(max_model_len=256, device="cpu").chat(messages, SamplingParams(temperature=0, max_tokens=32),
                                                      use_tqdm=False)[0].outputs[0].text
    server = LiveServer("--max-model-len", "256", *split, log=tmp_path / "serve.log")
    try:
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                       json={"messages": messages, "temperature": 0, "max_tokens": 32})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == alone
        assert "Paris" in alone
    finally:
        server.stop_cleanly(signal.SIGTERM)


def test_a_rank_that_fails_alone_ends_the_engine_without_waiting_for_the_others(tokenizer, tmp_path):
    """Rank 1 raises while rank 0 would wait a minute (as in a collective its peer never
    joins): the engine ends within the grace period, and both workers are stopped."""
    llm = engine(checkpoint(tmp_path, "llama", tokenizer), 2)
    workers = llm.llm_engine.core.engine_core.executor.processes
    started = time.monotonic()
    with pytest.raises(EngineDeadError, match="worker 1 failed: ZeroDivisionError"):
        llm.collective_rpc(lambda worker: time.sleep(60) if worker.rank == 0 else 1 / 0)
    assert time.monotonic() - started < 10
    assert all(w.poll() is not None for w in workers)
    with pytest.raises(EngineDeadError):
        llm.generate("Hello", use_tqdm=False)
