"""CPU op graphs: kernel calls recorded once and replayed without Python (_C.OpGraph), and the
decode steps that replay them (worker/cpu_graphs.py) against eager steps of the same model."""
import numpy as np
import pytest
import torch

from octavo import _C, LLM, SamplingParams
from octavo.layers import linear as linear_module
from octavo.models import llama
from octavo.worker import cpu_graphs
from test_cuda_engine import tiny_model_dir
from test_gemma3 import tiny_gemma


def rms_norm_then_linear(x, norm_weight, weight, normed, out):
    _C.ops.rms_norm(normed, x, norm_weight, 1e-6)
    _C.ops.linear(out, normed, weight)


def test_a_replay_reruns_the_kernels_on_what_the_tensors_hold_now():
    torch.manual_seed(0)
    x, norm_weight, weight = torch.randn(3, 64), torch.rand(64), torch.randn(32, 64)
    normed, out = torch.empty(3, 64), torch.empty(3, 32)
    graph = _C.OpGraph()
    graph.begin_capture()
    rms_norm_then_linear(x, norm_weight, weight, normed, out)  # the calls run while recorded
    graph.end_capture()
    assert len(graph) == 2
    recorded = out.clone()
    for _ in range(3):
        x.copy_(torch.randn(3, 64))
        weight.mul_(-0.5)
        graph.replay()
        expected_normed, expected = torch.empty(3, 64), torch.empty(3, 32)
        rms_norm_then_linear(x, norm_weight, weight, expected_normed, expected)
        assert torch.equal(out, expected)
    assert not torch.equal(out, recorded)


def test_a_graph_keeps_the_tensors_it_recorded_alive():
    x, weight = torch.randn(2, 32), torch.randn(16, 32)
    graph = _C.OpGraph()
    graph.begin_capture()
    out = torch.empty(2, 16)
    _C.ops.linear(out, torch.ones(2, 32) * x, weight)  # the input is a temporary Python drops
    graph.end_capture()
    expected = out.clone()
    del x, weight
    for _ in range(50):  # the freed memory would be reused by now
        torch.randn(2, 32) @ torch.randn(32, 16)
    out.zero_()
    graph.replay()
    assert torch.equal(out, expected)


def test_recording_errors_are_clear_and_leave_the_thread_usable():
    graph, other = _C.OpGraph(), _C.OpGraph()
    with pytest.raises(ValueError, match="not recording"):
        graph.end_capture()
    graph.begin_capture()
    with pytest.raises(ValueError, match="already recording"):
        other.begin_capture()
    logits = torch.randn(1, 8)
    ints = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="sample cannot be recorded"):
        _C.ops.sample(logits, torch.zeros(1), ints, ints.clone(), torch.zeros(1, dtype=torch.int32))
    graph.end_capture()
    with pytest.raises(ValueError, match="records once"):
        graph.begin_capture()
    out = torch.empty(1, 8)
    _C.ops.rms_norm(out, logits, torch.ones(8), 1e-6)  # not recording any more: runs as usual
    assert len(graph) == 0 and torch.isfinite(out).all()
    dropped = _C.OpGraph()
    dropped.begin_capture()
    del dropped  # freed while recording: the thread records nothing more, and can record again
    _C.ops.rms_norm(out, logits, torch.ones(8), 1e-6)
    again = _C.OpGraph()
    again.begin_capture()
    again.end_capture()


def generate_both_ways(path, prompts, params, **kwargs):
    """Outputs (tokens and log-probabilities) of eager steps and of CPU graphs, and whether
    each LLM replayed graphs."""
    results = []
    for eager in (True, False):
        llm = LLM(model=str(path), dtype="float32", kv_cache_memory_bytes=32 << 20, enforce_eager=eager, **kwargs)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        graphs = llm.collective_rpc(lambda worker: worker.runner.cpu_graphs)[0]
        assert llm.llm_engine.scheduler.block_pool.num_used_blocks == 0
        results.append(([[(t, lp[t].logprob) for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                         for o in outputs], graphs))
        del llm
    (eager, no_graphs), (replayed, graphs) = results
    assert no_graphs is None
    return eager, replayed, graphs


def prompts_of(tokenizer, n):
    return [tokenizer.encode(t) for t in ("Hello world", "Straße und Meer", "x", "a longer prompt " * 6, "q")[:n]]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_replayed_decode_steps_equal_eager_ones(kind, tmp_path):
    tokenizer, _ = tiny_model_dir(tmp_path, kind)
    # Requests end in pairs: decode steps of 4, 2 and 1 rows, each a recorded size.
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (30, 20, 10, 10)]
    eager, replayed, graphs = generate_both_ways(tmp_path, prompts_of(tokenizer, 4), params, max_num_seqs=8)
    assert graphs.sizes == [1, 2, 4, 8]
    assert replayed == eager  # the same kernels on the same rows: the same bits


def test_a_hybrid_model_replays_with_a_block_table_per_kv_group(tmp_path):
    """Gemma 3: sliding-window layers in their own KV groups, contexts past the window, per-head
    q / k norms read in place."""
    tiny_gemma(tmp_path, sliding_window=20)
    rng = np.random.default_rng(5)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(0, 300, n)]} for n in (40, 7, 25, 3)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (30, 20, 10, 10)]
    eager, replayed, graphs = generate_both_ways(tmp_path, prompts, params, max_num_seqs=8,
                                                 skip_tokenizer_init=True, max_model_len=256)
    assert graphs.sizes == [1, 2, 4, 8] and len(graphs.block_tables) == 6  # 1 full + 5 sliding groups
    assert replayed == eager


def test_padded_batches_decode_the_same_tokens(tmp_path):
    tokenizer, _ = tiny_model_dir(tmp_path)
    # Requests end one after another: decode steps of 5 rows (padded to the graph of 8), 4, 3 (to 4), 2, 1.
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1) for n in (40, 31, 22, 13, 4)]
    eager, replayed, _ = generate_both_ways(tmp_path, prompts_of(tokenizer, 5), params, max_num_seqs=8)
    # A float kernel may sum a row in another order where it is the odd one of a batch (5 rows
    # against 8): the last bits of the logits may differ, the tokens do not.
    assert [[t for t, _ in row] for row in replayed] == [[t for t, _ in row] for row in eager]
    for ours, theirs in zip(replayed, eager):
        torch.testing.assert_close(torch.tensor([lp for _, lp in ours]), torch.tensor([lp for _, lp in theirs]),
                                   rtol=0, atol=1e-4)


def test_sampling_with_temperature_and_seeds_is_unchanged_by_graphs(tmp_path):
    tokenizer, _ = tiny_model_dir(tmp_path)
    prompts = [tokenizer.encode(t) for t in ("Hello world", "x", "abc")]
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=s, max_tokens=20, logprobs=2) for s in (1, 2, 3)]
    eager, replayed, _ = generate_both_ways(tmp_path, prompts, params, max_num_seqs=4)
    assert replayed == eager


def test_a_forward_pass_that_computes_in_torch_runs_eagerly(tmp_path, monkeypatch, capfd):
    tokenizer, _ = tiny_model_dir(tmp_path)
    layer_forward = llama.LlamaDecoderLayer.forward

    def forward_with_torch_arithmetic(self, x, residual, positions, rope, meta):
        x, residual = layer_forward(self, x, residual, positions, rope, meta)
        return x * 1.0, residual  # a replay would not repeat this product

    monkeypatch.setattr(llama.LlamaDecoderLayer, "forward", forward_with_torch_arithmetic)
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory_bytes=32 << 20)
    assert "decode steps run eagerly: the forward pass computes aten.mul" in capfd.readouterr().out
    assert llm.collective_rpc(lambda worker: worker.runner.cpu_graphs)[0] is None
    out = llm.generate([tokenizer.encode("Hello")], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 5


def test_batch_sizes_past_a_torch_product_keep_the_smaller_graphs(tmp_path, monkeypatch):
    tokenizer, _ = tiny_model_dir(tmp_path)
    # As where torch's GEMM overtakes Octavo's kernel from 4 rows on (layers/crossover.py).
    monkeypatch.setattr(linear_module, "_dense_kernel_takes", lambda x, weight: x.shape[0] < 4)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0) for n in (12, 12, 6, 3)]
    eager, replayed, graphs = generate_both_ways(tmp_path, prompts_of(tokenizer, 4), params, max_num_seqs=8)
    assert graphs.sizes == [1, 2]
    assert replayed == eager


def test_large_batches_replay_only_when_they_nearly_fill_a_graph(tmp_path, monkeypatch):
    """Past PADDED_BATCH rows a padded row costs a row's kernels: 30 requests replay the graph of
    32, 20 run eagerly (12 padded rows would be more than an eighth), 4 replay again."""
    tokenizer, _ = tiny_model_dir(tmp_path)
    steps = []
    run = cpu_graphs.CpuGraphs.run

    def counted(self, out, logits_out=None):
        logits = run(self, out, logits_out)
        if out.total_num_scheduled_tokens == out.num_reqs:  # decode-only steps
            steps.append((out.num_reqs, logits is not None))
        return logits

    monkeypatch.setattr(cpu_graphs.CpuGraphs, "run", counted)
    rng = np.random.default_rng(3)
    prompts = [{"prompt_token_ids": [int(t) for t in rng.integers(0, 300, 5 + i)]} for i in range(30)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=1)
              for n in [12] * 4 + [8] * 16 + [4] * 10]
    eager, replayed, graphs = generate_both_ways(tmp_path, prompts, params, max_num_seqs=32)
    assert graphs.sizes == [1, 2, 4, 8, 16, 32]
    assert {(30, True), (20, False), (4, True)} == set(steps)
    assert [[t for t, _ in row] for row in replayed] == [[t for t, _ in row] for row in eager]
    for ours, theirs in zip(replayed, eager):
        torch.testing.assert_close(torch.tensor([lp for _, lp in ours]), torch.tensor([lp for _, lp in theirs]),
                                   rtol=0, atol=1e-4)


def test_graphs_past_the_memory_budget_are_not_recorded(tmp_path, monkeypatch):
    tiny_model_dir(tmp_path)
    monkeypatch.setattr(cpu_graphs, "MEMORY", 1)  # only the padded sizes, which are always recorded
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_memory_bytes=32 << 20, max_num_seqs=64)
    assert llm.collective_rpc(lambda worker: worker.runner.cpu_graphs.sizes)[0] == [1, 2, 4, 8]
