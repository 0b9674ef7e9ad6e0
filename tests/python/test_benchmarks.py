"""`octavo bench latency` and `octavo bench throughput` end to end on a tiny random Llama, and the
weight-byte count behind the latency roofline."""
import argparse

import pytest

from octavo import LLM
from octavo.benchmarks import latency, throughput
from octavo.benchmarks.memory import decode_weight_bytes
from octavo.entrypoints.cli import build_parser
from octavo.loader import load_model
from test_detokenizer import _byte_level_bpe
from test_models import tiny_checkpoint


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-bench")
    tokenizer = _byte_level_bpe()
    tokenizer.save_pretrained(path)
    # Long enough positions for the throughput workload (prompts up to 512, outputs up to 256).
    tiny_checkpoint("llama", path, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                    max_position_embeddings=1024)
    return path


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


@pytest.mark.parametrize("tied", [True, False])
def test_decode_weight_bytes_counts_each_weight_once(tmp_path, tied):
    tiny_checkpoint("llama", tmp_path, tie_word_embeddings=tied)
    model = load_model(str(tmp_path), "float32", "safetensors")
    params = {id(p): p for p in model.parameters()}.values()
    table = model.embed_tokens.numel() * 4
    expected = sum(p.numel() * 4 for p in params) - (0 if tied else table - model.embed_tokens.shape[1] * 4)
    assert decode_weight_bytes(model) == expected


@pytest.mark.parametrize("layout", [[], ["--multiprocess"]], ids=["in-process", "core-process"])
def test_latency_reports_against_the_roofline(tiny_path, capsys, layout):
    """With the engine core in its own process a step() may bring several tokens or none: the
    rate still counts every token once."""
    result = latency.run(parse(["bench", "latency", "--model", str(tiny_path), "--prompt-len", "16",
                                "--max-tokens", "6", "--repeats", "2", *layout]))
    assert result["ttft_ms"] > 0 and result["decode_tok_s"] > 0 and result["read_gb_s"] > 0
    assert result["of_roofline"] == pytest.approx(result["decode_tok_s"] / result["roofline_tok_s"])
    out = capsys.readouterr().out
    assert "of it" in out and ("engine core in its own process" in out) == bool(layout)


def test_latency_reports_speculative_acceptance(tiny_path, capsys):
    """The tiny random model falls into loops, which prompt lookup drafts."""
    config = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'
    result = latency.run(parse(["bench", "latency", "--model", str(tiny_path), "--prompt-len", "16",
                                "--max-tokens", "40", "--repeats", "2", "--speculative-config", config]))
    assert result["num_draft_tokens"] > 0
    assert 0 < result["acceptance_rate"] <= 1 and 1 < result["mean_accepted_length"] <= 4
    assert "mean accepted length" in capsys.readouterr().out


def test_latency_stamps_each_token_once_from_a_core_process(tiny_path):
    llm = LLM(model=str(tiny_path), kv_cache_memory_bytes=16 << 20, multiprocess=True)
    try:
        ttft, stamps = latency.time_one_request(llm.llm_engine, list(range(3, 19)), 9, "r")
    finally:
        llm.llm_engine.shutdown()
    assert len(stamps) == 9 and ttft > 0 and stamps == sorted(stamps)


def test_throughput_runs_octavo_and_the_baseline(tiny_path, capsys):
    result = throughput.run(parse(["bench", "throughput", "--model", str(tiny_path), "--num-requests", "3",
                                   "--kv-cache-memory-bytes", str(64 << 20), "--baseline-batch", "1", "2"]))
    out = capsys.readouterr().out
    assert "octavo (float32): 3 requests" in out and "transformers batch 2 (3 requests)" in out
    best = max(result["transformers_batch_1"][0], result["transformers_batch_2"][0])
    assert result["ratio_output"] == pytest.approx(result["octavo_output_tok_s"] / best)


def test_serving_benchmark_against_a_server_it_starts(tiny_path, capsys):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from octavo.benchmarks import serving

    runs = serving.run(parse(["bench", "serve", "--model", str(tiny_path), "--num-prompts", "6", "--input-len", "8",
                              "--output-len", "5", "--request-rate", "inf", "50", "--vocab-range", "10", "100",
                              "--server-args", "--kv-cache-memory-bytes 16777216"]))
    assert [r["request_rate"] for r in runs] == [float("inf"), 50.0]
    for r in runs:
        assert r["completed"] == 6 and r["failed"] == 0, r["errors"]
        assert r["output_throughput"] == pytest.approx(6 * 5 / r["seconds"])
        for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_s", "health_ms"):
            assert 0 < r[name]["p50"] <= r[name]["p90"] <= r[name]["p99"]
    assert "TTFT p50" in capsys.readouterr().out


def test_dummy_shapes_and_fixed_workloads():
    from octavo.benchmarks.shapes import dummy_model_dir
    from octavo.benchmarks.throughput import workload
    from octavo.config import ModelConfig

    config = ModelConfig.from_pretrained(dummy_model_dir("llama-3-8b"))
    shape = (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads, config.head_dim)
    assert shape == (4096, 32, 8, 128)
    assert {(len(p), o) for p, o in workload(5, 1000, input_len=512, output_len=256)} == {(512, 256)}
    with pytest.raises(ValueError, match="unknown model shape"):
        dummy_model_dir("llama-9")
