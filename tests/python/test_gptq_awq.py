"""GPTQ (v1 and v2 zero points, with and without act-order) and AWQ checkpoints: a tiny Llama
whose projections are packed by this test from known integers, following the layouts written in
octavo/loader/gptq_awq.py, loads with every projection in int4 and runs exactly like the float
checkpoint of the weights those integers stand for."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from octavo import LLM, SamplingParams
from octavo.layers.linear import QuantizedWeight
from octavo.loader import load_model
from test_detokenizer import _byte_level_bpe
from test_models import tiny_checkpoint

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# w1 / w3 / w2: Mixtral's experts.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


def as_int32(values: torch.Tensor) -> torch.Tensor:
    return ((values + 2**31) % 2**32 - 2**31).to(torch.int32)


def pack(nibbles: torch.Tensor, dim: int, order=tuple(range(8))) -> torch.Tensor:
    """Eight 4-bit values along ``dim`` per int32; slot i holds the value at offset order[i]."""
    moved = nibbles.long().movedim(dim, -1)
    groups = moved.reshape(*moved.shape[:-1], -1, 8)
    packed = sum(groups[..., order[i]] << (4 * i) for i in range(8))
    return as_int32(packed).movedim(-1, dim)


def quantize_layer(n: int, k: int, g: int, method: str, g_idx: torch.Tensor, v1: bool, gen):
    """Packed tensors of a Linear [n, k] and the float weights they stand for."""
    q = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(1 if v1 else 0, 16, (k // g, n), generator=gen)
    scales = (torch.rand(k // g, n, generator=gen) * 0.02 + 0.001).half()
    weight = ((q - zeros[g_idx]).float() * scales.float()[g_idx]).t().contiguous()
    if method == "gptq":
        tensors = {"qweight": pack(q, 0), "qzeros": pack(zeros - (1 if v1 else 0), 1), "scales": scales,
                   "g_idx": g_idx.to(torch.int32)}
    else:
        tensors = {"qweight": pack(q, 1, AWQ_ORDER), "qzeros": pack(zeros, 1, AWQ_ORDER), "scales": scales}
    return tensors, weight


def write_checkpoints(tmp_path, method: str, g: int, act_order: bool = False, v1: bool = True, make=None,
                      **overrides):
    """(quantized checkpoint, float checkpoint of the same weights). make(path, **config): the float
    checkpoint's maker (a tiny Llama by default); every projection named in PROJECTIONS is packed,
    experts' too."""
    float_dir, quant_dir = tmp_path / "float", tmp_path / method
    tokenizer = _byte_level_bpe()
    for d in (float_dir, quant_dir):
        tokenizer.save_pretrained(d)
    make = make or (lambda path, **config: tiny_checkpoint("llama", path, **config))
    make(float_dir, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, **overrides)
    tensors = load_file(str(float_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(g + act_order)
    # Act-order groups follow the input's Hessian, which projections reading the same input
    # share: one order per input width here (q/k/v and gate/up read the same activations).
    orders = {}
    quantized = {}
    for name in list(tensors):
        prefix = name.removesuffix(".weight")
        if prefix.rsplit(".", 1)[-1] in PROJECTIONS:
            n, k = tensors[name].shape
            if k not in orders:
                orders[k] = (torch.randperm(k, generator=gen) // g) if act_order else torch.arange(k) // g
            packed, tensors[name] = quantize_layer(n, k, g, method, orders[k], v1, gen)
            quantized.update({f"{prefix}.{part}": t for part, t in packed.items()})
        else:
            quantized[name] = tensors[name]
    save_file(tensors, str(float_dir / "model.safetensors"))
    save_file(quantized, str(quant_dir / "model.safetensors"))
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": g, "desc_act": act_order}
    if method == "gptq":
        config["quantization_config"]["checkpoint_format"] = "gptq" if v1 else "gptq_v2"
    else:
        config["quantization_config"].update(version="gemm", zero_point=True)
    (quant_dir / "config.json").write_text(json.dumps(config))
    return quant_dir, float_dir


@pytest.mark.parametrize("method,g,act_order,v1", [("gptq", 32, False, True), ("gptq", 64, True, True),
                                                   ("gptq", 128, False, False), ("awq", 32, False, True),
                                                   ("awq", 128, False, True)])
def test_checkpoint_runs_like_its_float_weights(tmp_path, method, g, act_order, v1):
    quant_dir, float_dir = write_checkpoints(tmp_path, method, g, act_order, v1)
    model, reference = load_model(quant_dir, "float32"), load_model(float_dir, "float32")
    for layer, ref in zip(model.layers, reference.layers):
        for ours, theirs in ((layer.self_attn.qkv_weight, ref.self_attn.qkv_weight),
                             (layer.mlp.gate_up_weight, ref.mlp.gate_up_weight),
                             (layer.mlp.down_weight, ref.mlp.down_weight)):
            assert isinstance(ours, QuantizedWeight) and ours.weight_format == "int4" and ours.group_size == g
            assert (ours.input_order is not None) == act_order
            assert torch.equal(ours.dequantize(), theirs.data)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [20, 21]]
    runs = [LLM(model=str(d), kv_cache_memory_bytes=16 << 20, device="cpu").generate(prompts, params, use_tqdm=False)
            for d in (quant_dir, float_dir)]
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]


def fused_weights(model) -> list:
    return [w for layer in model.layers for w in (layer.self_attn.qkv_weight, layer.self_attn.o_weight,
                                                  layer.mlp.gate_up_weight, layer.mlp.down_weight)]


@pytest.mark.parametrize("method,g,act_order,overrides", [
    ("gptq", 32, False, {}), ("gptq", 32, True, {}), ("gptq", 128, False, {}), ("awq", 64, False, {}),
    # intermediate 192 = 96 + 96 inputs of down_proj a rank: a cut inside a group of 64
    ("awq", 64, False, {"intermediate_size": 192})], ids=["gptq", "gptq-act-order", "gptq-one-group", "awq",
                                                            "awq-cut-in-a-group"])
def test_each_tensor_parallel_rank_holds_its_part_of_the_integers(tmp_path, method, g, act_order, overrides):
    """At TP = 2 each rank's weights are the float checkpoint's part for that rank, exactly: int4
    where the cut keeps whole groups (outputs always; inputs on group boundaries, or inside the
    one group of a group-less checkpoint), floats where an input cut splits groups (act-order
    groups scattered over the inputs, or a cut inside a group)."""
    quant_dir, float_dir = write_checkpoints(tmp_path, method, g, act_order, **overrides)
    for rank in range(2):
        model = load_model(quant_dir, "float32", tp_rank=rank, tp_size=2)
        reference = load_model(float_dir, "float32", tp_rank=rank, tp_size=2)
        for i, (ours, theirs) in enumerate(zip(fused_weights(model), fused_weights(reference))):
            column_parallel = i % 2 == 0  # qkv and gate_up: cut on outputs, which never splits a group
            splits_groups = not column_parallel and (act_order or (overrides and i % 4 == 3))
            assert isinstance(ours, QuantizedWeight) != splits_groups, i
            if splits_groups:
                assert torch.equal(ours.data, theirs.data)
            else:
                assert (ours.input_order is not None) == act_order
                assert torch.equal(ours.dequantize(), theirs.data)


def test_a_gptq_checkpoint_at_tp2_answers_as_at_tp1(tmp_path):
    from test_tensor_parallel import assert_same, engine, run

    quant_dir, _ = write_checkpoints(tmp_path, "gptq", 32, act_order=True)
    two = engine(quant_dir, 2)
    try:
        one = engine(quant_dir, 1)
        assert_same(run(two), run(one))

        def held(m):  # a rank's bytes of the first layer's gate_up integers
            return m.layers[0].mlp.gate_up_weight.qweight.numel()

        assert two.apply_model(held) == [one.apply_model(held)[0] // 2] * 2
    finally:
        two.llm_engine.shutdown()


def test_unsupported_gptq_and_awq_variants_are_named(tmp_path):
    quant_dir, _ = write_checkpoints(tmp_path, "gptq", 32)
    config = json.loads((quant_dir / "config.json").read_text())
    for change, message in (({"bits": 8}, "8 bits"), ({"quant_method": "awq", "version": "gemv"}, "gemv")):
        (quant_dir / "config.json").write_text(json.dumps({**config, "quantization_config": {
            **config["quantization_config"], **change}}))
        with pytest.raises(ValueError, match=message):
            load_model(quant_dir)


def test_a_quantized_checkpoint_is_not_quantized_again_and_missing_parts_are_named(tmp_path):
    from octavo.layers.quantize import quantize_model
    from octavo.loader.quantized_checkpoint import write_quantized_checkpoint

    quant_dir, _ = write_checkpoints(tmp_path, "gptq", 32)
    with pytest.raises(ValueError, match="quantized already"):
        quantize_model(load_model(quant_dir), "int8")
    with pytest.raises(ValueError, match="quantized already"):
        write_quantized_checkpoint(quant_dir, tmp_path / "again", "int4")
    with pytest.raises(ValueError, match="no config.json"):
        write_quantized_checkpoint(quant_dir / "model.safetensors", tmp_path / "again", "int4")
    tensors = load_file(str(quant_dir / "model.safetensors"))
    del tensors["model.layers.0.mlp.down_proj.qzeros"]
    save_file(tensors, str(quant_dir / "model.safetensors"))
    with pytest.raises(ValueError, match="has model.layers.0.mlp.down_proj.qweight but lacks "
                                         "model.layers.0.mlp.down_proj.qzeros"):
        load_model(quant_dir)


def test_agreeing_parts_are_placed_without_a_float_copy(tmp_path, monkeypatch):
    """Every projection goes into the model as int4 before the floats are loaded: none is
    dequantized, so loading never holds the float model in memory."""
    quant_dir, _ = write_checkpoints(tmp_path, "gptq", 32, act_order=True)
    monkeypatch.setattr(QuantizedWeight, "dequantize", lambda self: pytest.fail("a weight was dequantized"))
    model = load_model(quant_dir, "float32")
    for layer in model.layers:
        for weight in (layer.self_attn.qkv_weight, layer.self_attn.o_weight, layer.mlp.gate_up_weight,
                       layer.mlp.down_weight):
            assert isinstance(weight, QuantizedWeight)


def test_fused_parts_with_different_act_orders_load_as_floats(tmp_path):
    """q_proj gets an act-order of its own, so layer 0's fused QKV weight cannot be one int4
    weight: it is dequantized into floats, exactly the float checkpoint's, and the rest stays int4."""
    quant_dir, float_dir = write_checkpoints(tmp_path, "gptq", 32, act_order=True)
    quantized, floats = load_file(str(quant_dir / "model.safetensors")), load_file(str(float_dir / "model.safetensors"))
    prefix = "model.layers.0.self_attn.q_proj"
    n, k = floats[f"{prefix}.weight"].shape
    gen = torch.Generator().manual_seed(7)
    packed, floats[f"{prefix}.weight"] = quantize_layer(n, k, 32, "gptq", torch.randperm(k, generator=gen) // 32,
                                                        True, gen)
    quantized.update({f"{prefix}.{part}": t for part, t in packed.items()})
    save_file(quantized, str(quant_dir / "model.safetensors"))
    save_file(floats, str(float_dir / "model.safetensors"))
    model, reference = load_model(quant_dir, "float32"), load_model(float_dir, "float32")
    qkv = model.layers[0].self_attn.qkv_weight
    assert isinstance(qkv, torch.nn.Parameter) and torch.equal(qkv.data, reference.layers[0].self_attn.qkv_weight.data)
    assert isinstance(model.layers[0].mlp.gate_up_weight, QuantizedWeight)
    assert all(isinstance(layer.self_attn.qkv_weight, QuantizedWeight) for layer in model.layers[1:])


def test_quantized_parts_are_checked_against_the_config(tmp_path):
    quant_dir, _ = write_checkpoints(tmp_path, "awq", 32)
    config = json.loads((quant_dir / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    (quant_dir / "config.json").write_text(json.dumps({**config, "intermediate_size": inter + 32}))
    with pytest.raises(ValueError, match=rf"'model.layers.0.mlp.gate_proj.weight' has shape \({inter}, {hidden}\), "
                                         rf"expected \({inter + 32}, {hidden}\) from config.json"):
        load_model(quant_dir)
