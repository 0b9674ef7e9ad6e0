"""bench/python/bench_cpu_peers.py's parts that run without the peers: the GGUF files it writes
for llama.cpp, its workloads, and an Octavo worker end to end on a tiny model."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest

from test_detokenizer import _byte_level_bpe
from test_models import tiny_checkpoint

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "python" / "bench_cpu_peers.py"


@pytest.fixture(scope="module")
def peers():
    spec = importlib.util.spec_from_file_location("bench_cpu_peers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_q8_gguf(path: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    tensors = {"blk.0.attn_q.weight": rng.standard_normal((8, 64)).astype(np.float32),
               "blk.0.attn_norm.weight": rng.standard_normal(64).astype(np.float32)}
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "c"])
    for name, values in tensors.items():
        if values.ndim == 2:
            quant = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(name, quant, raw_shape=quant.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tensors


@pytest.mark.parametrize("type_name,matrix_type", [("F32", gguf.GGMLQuantizationType.F32),
                                                    ("F16", gguf.GGMLQuantizationType.F16)])
def test_gguf_files_keep_the_metadata_and_the_dequantized_weights(peers, tmp_path, type_name, matrix_type):
    src, dst = tmp_path / "m.Q8_0.gguf", tmp_path / f"m.{type_name}.gguf"
    write_q8_gguf(src)
    peers.retype_gguf(src, dst, type_name)
    before, after = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(dst))
    for name in ("general.architecture", "llama.block_count", "tokenizer.ggml.model", "tokenizer.ggml.tokens"):
        assert after.fields[name].contents() == before.fields[name].contents()
    old = {t.name: t for t in before.tensors}
    for tensor in after.tensors:
        expected = gguf.quants.dequantize(old[tensor.name].data, old[tensor.name].tensor_type)
        matrix = tensor.name.endswith("attn_q.weight")
        assert tensor.tensor_type == (matrix_type if matrix else gguf.GGMLQuantizationType.F32)
        values = np.asarray(tensor.data, dtype=np.float32).reshape(expected.shape)
        np.testing.assert_array_equal(values, expected.astype(np.float16 if matrix and type_name == "F16"
                                                              else np.float32).astype(np.float32))


def test_a_dummy_gguf_has_the_shape_and_plausible_weights(peers, tmp_path, monkeypatch):
    src = tmp_path / "src.gguf"
    write_q8_gguf(src)
    shape = {"block_count": 2, "embedding_length": 64, "feed_forward_length": 96, "attention.head_count": 4,
             "attention.head_count_kv": 2, "rope.dimension_count": 16}
    monkeypatch.setitem(peers.GGUF_SHAPES, "tiny", shape)
    dst = peers.dummy_gguf(src, tmp_path / "dummy.gguf", "tiny")
    reader = gguf.GGUFReader(str(dst))
    assert reader.fields["llama.block_count"].contents() == 2
    assert reader.fields["llama.feed_forward_length"].contents() == 96
    assert reader.fields["tokenizer.ggml.tokens"].contents() == ["a", "b", "c"]
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 2 + 2 * 9  # embedding, final norm; 7 projections and 2 norms per layer
    expected = {"token_embd.weight": ((3, 64), "Q8_0"), "blk.1.attn_k.weight": ((32, 64), "Q4_1"),
                "blk.1.ffn_down.weight": ((64, 96), "Q4_1"), "blk.0.ffn_up.weight": ((96, 64), "Q4_1")}
    for name, (rows_cols, kind) in expected.items():
        t = tensors[name]
        assert t.tensor_type.name == kind
        values = gguf.quants.dequantize(t.data, t.tensor_type)
        assert values.shape == rows_cols
        assert np.abs(values).max() <= 0.52 and values.std() > 0.01  # Q8_0: 0.004 * int8; Q4_1: ±0.03
    assert peers.gguf_tensor_bytes(str(dst)) == sum(int(t.n_bytes) for t in reader.tensors)


def test_workloads_are_the_issues(peers):
    requests = peers.offline_requests(49152)
    assert len(requests) == 64 and requests == peers.offline_requests(49152)
    assert all(32 <= len(p) <= 256 and 32 <= o <= 128 and min(p) >= 100 and max(p) < 49052 for p, o in requests)
    assert len(peers.single_prompt(49152)) == 32
    batched = peers.batched_prompts(49152)  # llama.cpp's batched-bench shape
    assert batched == peers.batched_prompts(49152) and len(batched) == 64
    assert all(len(p) == 128 and min(p) >= 100 and max(p) < 49052 for p in batched)


def test_an_octavo_worker_reports_every_workload(peers, tmp_path):
    tokenizer = _byte_level_bpe()
    tokenizer.save_pretrained(tmp_path)
    tiny_checkpoint("llama", tmp_path, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id,
                    max_position_embeddings=1024)
    proc = subprocess.run([sys.executable, str(SCRIPT), "--worker", "octavo", "--workload", "offline", "single", "batched",
                           "--model", str(tmp_path), "--dtype", "float32", "--vocab", str(len(tokenizer))],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["offline_tok_s"] > 0 and result["single_tok_s"] > 0 and result["batched_tok_s"] > 0
    assert result["startup_s"] > 0
    assert len(result["tokens"]) == peers.AGREE_TOKENS
