"""The measured crossover between torch's GEMM and Octavo's linear kernel (layers/crossover.py):
the decision rule, the probe on real kernels, the per-machine cache, and the engine using it."""

import json
import math

import pytest
import torch
from octavo.layers import crossover, linear


def test_the_crossover_is_where_torch_stays_ahead():
    rows = (1, 4, 16, 64, 256)
    assert crossover.crossover_from(rows, [0.5, 0.6, 0.9, 1.3, 1.5]) == 64
    assert crossover.crossover_from(rows, [0.5, 0.6, 0.9, 1.05, 1.5]) == 256  # 1.05: inside the margin
    assert crossover.crossover_from(rows, [0.5, 1.5, 0.9, 1.3, 1.5]) == 64  # ahead at 4, behind at 16
    assert crossover.crossover_from(rows, [0.5, 0.6, 0.9, 1.3, 0.8]) == math.inf  # behind at the largest
    assert crossover.crossover_from(rows, [2.0] * 5) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_probe_times_both_products(dtype, monkeypatch):
    calls = []
    real = crossover.crossover_from
    monkeypatch.setattr(crossover, "crossover_from", lambda rows, ratios: calls.append(ratios) or real(rows, ratios))
    found = crossover.probe(dtype, [(96, 64), (64, 160)], rows=(1, 8, 64), repeats=2)
    assert found in (1, 8, 64, math.inf)
    assert len(calls[0]) == 3 and all(r > 0 and math.isfinite(r) for r in calls[0])


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path))
    monkeypatch.setitem(linear.TORCH_FROM_ROWS, torch.float32, linear.TORCH_FROM_ROWS[torch.float32])
    monkeypatch.setitem(linear.TORCH_FROM_ROWS, torch.bfloat16, linear.TORCH_FROM_ROWS[torch.bfloat16])
    return tmp_path / "linear_crossover.json"


def test_a_measurement_is_cached_per_machine_dtype_and_shapes(cache, monkeypatch):
    probes = []
    monkeypatch.setattr(crossover, "probe", lambda dtype, shapes: probes.append((dtype, shapes)) or 64)
    assert crossover.torch_from_rows(torch.float32, [(96, 64)]) == 64
    assert crossover.torch_from_rows(torch.float32, [(96, 64)]) == 64
    assert len(probes) == 1  # the second came from the file
    monkeypatch.setattr(crossover, "probe", lambda dtype, shapes: probes.append((dtype, shapes)) or math.inf)
    assert crossover.torch_from_rows(torch.bfloat16, [(96, 64)]) == math.inf
    assert crossover.torch_from_rows(torch.float32, [(96, 128)]) == math.inf
    assert len(probes) == 3
    saved = json.loads(cache.read_text())
    assert len(saved) == 3 and sorted(map(str, saved.values())) == ["64", "inf", "inf"]
    assert all(torch.__version__ in key and "|" in key for key in saved)


def test_a_rebuilt_extension_is_measured_again(cache, monkeypatch):
    # A build from source keeps its version when its kernels change: the extension's hash is in the key.
    monkeypatch.setattr(crossover, "probe", lambda dtype, shapes: 64)
    assert crossover.torch_from_rows(torch.float32, [(96, 64)]) == 64
    monkeypatch.setattr(crossover, "extension_hash", lambda: "0123456789ab")
    monkeypatch.setattr(crossover, "probe", lambda dtype, shapes: 16)
    assert crossover.torch_from_rows(torch.float32, [(96, 64)]) == 16
    assert len(json.loads(cache.read_text())) == 2


def test_a_broken_cache_file_is_measured_again(cache, monkeypatch):
    monkeypatch.setattr(crossover, "probe", lambda dtype, shapes: 32)
    key = crossover.machine_key(torch.float32, [(96, 64)])
    for broken in ("{not json", "[1, 2]", json.dumps({key: "fast"}), json.dumps({key: None})):
        cache.write_text(broken)
        assert crossover.torch_from_rows(torch.float32, [(96, 64)]) == 32
        assert json.loads(cache.read_text()) == {key: 32}


def test_the_engine_dispatches_from_this_machines_measurement(cache, monkeypatch, tiny_path):
    from octavo import LLM, SamplingParams

    monkeypatch.setenv("OCTAVO_LINEAR_CROSSOVER", "probe")
    seen = []
    monkeypatch.setattr(crossover, "probe", lambda dtype, shapes: seen.append((dtype, shapes)) or 3)
    llm = LLM(model=str(tiny_path), dtype="float32", kv_cache_memory_bytes=1 << 22)
    dtype, shapes = seen[0]
    c = llm.llm_engine.model_config
    assert dtype == torch.float32 and (c.intermediate_size * 2, c.hidden_size) in shapes
    assert (c.hidden_size, c.intermediate_size) in shapes and len(shapes) == len(set(shapes))
    assert linear.TORCH_FROM_ROWS[torch.float32] == 3
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4
    monkeypatch.setenv("OCTAVO_LINEAR_CROSSOVER", "builtin")
    monkeypatch.setitem(linear.TORCH_FROM_ROWS, torch.float32, math.inf)
    LLM(model=str(tiny_path), dtype="float32", kv_cache_memory_bytes=1 << 22)
    assert len(seen) == 1 and linear.TORCH_FROM_ROWS[torch.float32] == math.inf
