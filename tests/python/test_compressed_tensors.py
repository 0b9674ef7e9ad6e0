"""compressed-tensors int8 checkpoints (llm-compressor's W8A8 and W8A16): a tiny Llama whose
projections this test writes in the layout octavo/loader/compressed_tensors.py describes loads with
every projection in the checkpoint's integers, runs bit for bit like the float checkpoint quantized
at load time with quantization="w8a8", and close to the float model; configurations Octavo does
not read fail with a message naming the field."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from octavo import LLM, SamplingParams
from octavo.layers.linear import QuantizedWeight, linear
from octavo.loader import load_model
from test_detokenizer import _byte_level_bpe
from test_models import attach_kv_cache, step, tiny_checkpoint

# w1 / w2 / w3: Mixtral's experts. Routers ("gate") stay float, as llm-compressor's recipes leave them.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")
W8A8 = {"weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False,
                    "group_size": None, "actorder": None, "block_structure": None, "observer": "minmax",
                    "observer_kwargs": {}},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True,
                              "group_size": None, "actorder": None, "block_structure": None, "observer": None,
                              "observer_kwargs": {}},
        "output_activations": None, "targets": ["Linear"]}


def quantize(w: torch.Tensor, per_tensor: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8, scale float32 [N] or [1]): max |w| / 127 per row (or tensor), q = round(w / scale)
    in [-127, 127], the formula of Octavo's load-time int8."""
    w = w.float()
    scale = w.abs().amax().reshape(1) / 127 if per_tensor else w.abs().amax(dim=1) / 127
    scale[scale == 0] = 1.0
    q = torch.round(w / (scale if per_tensor else scale[:, None])).clamp(-127, 127).to(torch.int8)
    return q, scale


def write_checkpoints(tmp_path, strategy: str = "channel", activations: bool = True, dtype=torch.float32,
                      make=None, **overrides):
    """(compressed-tensors checkpoint, float checkpoint) of a tiny model (make(path, **config): a
    Llama by default) with an untied LM head, which stays float (ignored) as llm-compressor's
    recipes leave it. The float checkpoint holds the weights before quantizing."""
    float_dir, quant_dir = tmp_path / "float", tmp_path / "w8a8"
    tokenizer = _byte_level_bpe()
    for d in (float_dir, quant_dir):
        tokenizer.save_pretrained(d)
    make = make or (lambda path, **config: tiny_checkpoint("llama", path, **config))
    make(float_dir, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False,
         **overrides)
    tensors = {k: v.to(dtype) for k, v in load_file(str(float_dir / "model.safetensors")).items()}
    quantized = {}
    for name, tensor in tensors.items():
        prefix = name.removesuffix(".weight")
        if prefix.rsplit(".", 1)[-1] in PROJECTIONS:
            q, scale = quantize(tensor, strategy == "tensor")
            quantized[name] = q
            quantized[f"{prefix}.weight_scale"] = (scale if strategy == "tensor" else scale[:, None]).to(dtype)
        else:
            quantized[name] = tensor
    save_file(tensors, str(float_dir / "model.safetensors"))
    save_file(quantized, str(quant_dir / "model.safetensors"))
    config = json.loads((float_dir / "config.json").read_text())
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (float_dir / "config.json").write_text(json.dumps(config))
    group = json.loads(json.dumps(W8A8))
    group["weights"]["strategy"] = strategy
    if not activations:
        group["input_activations"] = None
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": group}, "ignore": ["lm_head"], "kv_cache_scheme": None,
        "global_compression_ratio": None,
        "sparsity_config": {"format": "dense", "targets": [], "ignore": [], "global_sparsity": 0.0,
                            "sparsity_structure": "unstructured"}}
    (quant_dir / "config.json").write_text(json.dumps(config))
    return quant_dir, float_dir


def fused(model) -> list[tuple[str, object, list[str]]]:
    """(what, weight, the checkpoint projections stacked in it) for every layer's projections."""
    out = []
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        out += [(f"{p}qkv", layer.self_attn.qkv_weight, [f"{p}self_attn.{x}_proj" for x in "qkv"]),
                (f"{p}o", layer.self_attn.o_weight, [f"{p}self_attn.o_proj"]),
                (f"{p}gate_up", layer.mlp.gate_up_weight, [f"{p}mlp.gate_proj", f"{p}mlp.up_proj"]),
                (f"{p}down", layer.mlp.down_weight, [f"{p}mlp.down_proj"])]
    return out


def written(tensors: dict, parts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """The checkpoint's integers and per-row float32 scales of a fused weight."""
    qs, scales = [], []
    for part in parts:
        q, scale = tensors[f"{part}.weight"], tensors[f"{part}.weight_scale"].float()
        qs.append(q)
        scales.append(scale.reshape(-1).expand(q.shape[0]))
    return torch.cat(qs), torch.cat(scales)


@pytest.mark.parametrize("strategy,activations,dtype", [
    ("channel", True, torch.float32), ("tensor", True, torch.float32), ("channel", False, torch.float32),
    ("channel", True, torch.bfloat16)], ids=["w8a8-channel", "w8a8-tensor", "w8a16", "w8a8-bf16"])
def test_projections_hold_the_checkpoint_integers(tmp_path, strategy, activations, dtype):
    quant_dir, _ = write_checkpoints(tmp_path, strategy, activations, dtype)
    tensors = load_file(str(quant_dir / "model.safetensors"))
    model = load_model(quant_dir)
    for what, weight, parts in fused(model):
        assert isinstance(weight, QuantizedWeight), what
        assert weight.weight_format == ("int8_a8" if activations else "int8"), what
        q, scales = written(tensors, parts)
        assert torch.equal(weight.qweight, q) and torch.equal(weight.scales, scales), what
        assert torch.equal(weight.dequantize(), q.float() * scales[:, None]), what
    assert isinstance(model.lm_head, torch.nn.Parameter) and torch.equal(model.lm_head.data, tensors["lm_head.weight"])


def test_compression_config_key_loads_as_quantization_config(tmp_path):
    """Older llm-compressor checkpoints write their settings under compression_config (without
    quant_method); they load as the same projections."""
    quant_dir, _ = write_checkpoints(tmp_path)
    config = json.loads((quant_dir / "config.json").read_text())
    settings = config.pop("quantization_config")
    del settings["quant_method"]
    config["compression_config"] = settings
    (quant_dir / "config.json").write_text(json.dumps(config))
    model = load_model(quant_dir)
    tensors = load_file(str(quant_dir / "model.safetensors"))
    for what, weight, parts in fused(model):
        assert isinstance(weight, QuantizedWeight) and weight.weight_format == "int8_a8", what
        assert torch.equal(weight.qweight, written(tensors, parts)[0]), what


def greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    attach_kv_cache(model, num_blocks=8)
    logits = [step(model, prompt, 0)]
    tokens = list(prompt)
    for _ in range(steps):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(step(model, tokens[-1:], len(tokens) - 1))
    assert all(torch.isfinite(t).all() for t in logits)
    return tokens[len(prompt):], logits


PROMPT = [5, 6, 7, 8, 40, 41, 42, 43, 44, 45, 46, 47, 200, 17, 3, 9, 12]


@pytest.mark.parametrize("kind", ["llama", "qwen3-moe", "mixtral"])
def test_runs_bit_for_bit_like_load_time_w8a8(tmp_path, kind):
    """The same integers and scales as quantization="w8a8" makes from the float checkpoint (expert
    stacks too): the same logits, exactly, at prefill (17 rows) and decode (1 row). The load-time
    quantizer puts the LM head in int8 too; this checkpoint keeps it float, so the reference gets
    the float one."""
    from test_moe_models import tiny_moe_checkpoint

    make = None if kind == "llama" else lambda path, **config: tiny_moe_checkpoint(kind, path, **config)
    quant_dir, float_dir = write_checkpoints(tmp_path, make=make)
    model, reference = load_model(quant_dir, "float32"), load_model(float_dir, "float32", quantization="w8a8")
    ours = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedWeight)}
    theirs = {n: m for n, m in reference.named_modules() if isinstance(m, QuantizedWeight) and n != "lm_head"}
    assert ours.keys() == theirs.keys() and any(".experts" in n or "w13" in n for n in ours) == (kind != "llama")
    for name, weight in ours.items():
        assert weight.weight_format == theirs[name].weight_format == "int8_a8", name
        assert torch.equal(weight.qweight, theirs[name].qweight), name
        assert torch.equal(weight.scales, theirs[name].scales), name
    reference.lm_head = model.lm_head
    tokens, logits = greedy(model, PROMPT, 6)
    ref_tokens, ref_logits = greedy(reference, PROMPT, 6)
    assert tokens == ref_tokens
    for ours, theirs in zip(logits, ref_logits):
        assert torch.equal(ours, theirs)


@pytest.mark.parametrize("strategy,activations", [("channel", True), ("tensor", True), ("channel", False)])
def test_logits_stay_close_to_the_float_model(tmp_path, strategy, activations):
    quant_dir, float_dir = write_checkpoints(tmp_path, strategy, activations)
    _, logits = greedy(load_model(quant_dir, "float32"), PROMPT, 2)
    _, ref = greedy(load_model(float_dir, "float32"), PROMPT, 2)
    for ours, theirs in zip(logits, ref):
        error = (ours - theirs).norm() / theirs.norm()
        assert error < 0.05, error


def test_llm_generates_what_the_model_decodes(tmp_path):
    quant_dir, _ = write_checkpoints(tmp_path)
    expected, _ = greedy(load_model(quant_dir, "float32"), PROMPT, 8)
    llm = LLM(model=str(quant_dir), kv_cache_memory_bytes=16 << 20, device="cpu", dtype="float32")
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == expected


def test_weights_of_minus_128_multiply_like_their_integers(isa):
    """llm-compressor's scale is max |w| / 127.5 with q in [-128, 127], so its checkpoints hold
    -128: int8_a8 must multiply it as -128 on every CPU kernel level, at every row count."""
    gen = torch.Generator().manual_seed(3)
    n, k = 64, 256
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    q[torch.rand(n, k, generator=gen) < 0.1] = -128
    scales = torch.rand(n, generator=gen) * 0.01 + 0.001
    weight = QuantizedWeight(q, "int8_a8", k, scales=scales)
    assert torch.equal(weight.dequantize(), q.float() * scales[:, None])
    for rows in (1, 7, 33):
        x = torch.randn(rows, k, generator=gen)
        d = x.abs().amax(dim=1, keepdim=True) / 127
        a = torch.round(x / d)
        ref = (a.double() @ q.double().t()) * d.double() * scales.double()
        # An input rounded the other way at a tie moves a row's sum by at most 127 units.
        bound = 2 * 128 * d.double() * scales.double() + 1e-5 * ref.abs()
        assert ((linear(x, weight).double() - ref).abs() <= bound).all(), rows


def test_each_tensor_parallel_rank_holds_its_part_of_the_integers(tmp_path):
    """At TP = 2 each rank's weights are the whole model's rows (column parallel) or inputs (row
    parallel, on 32-input blocks) with the whole rows' scales."""
    quant_dir, _ = write_checkpoints(tmp_path)
    whole = fused(load_model(quant_dir, "float32"))
    for rank in range(2):
        for i, (what, ours, _) in enumerate(fused(load_model(quant_dir, "float32", tp_rank=rank, tp_size=2))):
            theirs = whole[i][1]
            assert isinstance(ours, QuantizedWeight) and ours.weight_format == "int8_a8", what
            if i % 2 == 0:  # qkv, gate_up: output rows
                assert torch.equal(ours.dequantize(), _column_parallel_rows(what, theirs, rank)), what
            else:
                k = ours.in_features
                assert torch.equal(ours.qweight, theirs.qweight[:, rank * k:(rank + 1) * k]), what
                assert torch.equal(ours.scales, theirs.scales), what


def _column_parallel_rows(what: str, weight: QuantizedWeight, rank: int) -> torch.Tensor:
    """Rank ``rank`` of 2's rows of a fused column-parallel weight: each part's half."""
    w = weight.dequantize()
    if what.endswith("gate_up"):
        return torch.cat([half.chunk(2)[rank] for half in w.chunk(2)])
    q, kv = 4 * 32, 2 * 32  # TINY's heads and KV heads of 32
    return torch.cat([t.chunk(2)[rank] for t in w.split([q, kv, kv])])


def test_weights_off_the_32_input_blocks_load_as_floats(tmp_path):
    """intermediate_size 80: down_proj's rows are not whole blocks of 32 inputs, so it loads as the
    floats its integers stand for; the rest stays int8_a8."""
    quant_dir, _ = write_checkpoints(tmp_path, intermediate_size=80)
    tensors = load_file(str(quant_dir / "model.safetensors"))
    model = load_model(quant_dir, "float32")
    for what, weight, parts in fused(model):
        q, scales = written(tensors, parts)
        if what.endswith("down"):
            assert isinstance(weight, torch.nn.Parameter) and torch.equal(weight.data, q.float() * scales[:, None])
        else:
            assert isinstance(weight, QuantizedWeight) and weight.weight_format == "int8_a8"


def _with_config(quant_dir, change) -> None:
    config = json.loads((quant_dir / "config.json").read_text())
    change(config["quantization_config"])
    (quant_dir / "config.json").write_text(json.dumps(config))


UNSUPPORTED = {
    "static-activations": (lambda c: c["config_groups"]["group_0"]["input_activations"].update(
        strategy="tensor", dynamic=False), r"input_activations\.dynamic is False: static activation scales"),
    "per-tensor-dynamic": (lambda c: c["config_groups"]["group_0"]["input_activations"].update(strategy="tensor"),
                           r"input_activations\.strategy is 'tensor': Octavo reads 'token'"),
    "static-token": (lambda c: c["config_groups"]["group_0"]["input_activations"].update(dynamic=False),
                     r"input_activations\.dynamic is False: static activation scales"),
    "asymmetric-weights": (lambda c: c["config_groups"]["group_0"]["weights"].update(symmetric=False),
                           r"weights\.symmetric is false: asymmetric"),
    "asymmetric-activations": (lambda c: c["config_groups"]["group_0"]["input_activations"].update(symmetric=False),
                               r"input_activations\.symmetric is false"),
    "group": (lambda c: c["config_groups"]["group_0"]["weights"].update(strategy="group", group_size=128),
              r"weights\.strategy is 'group'"),
    "4-bits": (lambda c: c["config_groups"]["group_0"]["weights"].update(num_bits=4),
               r"weights\.num_bits is 4: Octavo reads 8-bit numbers only"),
    "fp8-weights-int8-activations": (lambda c: c["config_groups"]["group_0"]["weights"].update(type="float"),
                                     r"input_activations\.type is 'int': Octavo reads 'float'"),
    "fp8-config-int8-tensors": (lambda c: (c["config_groups"]["group_0"]["weights"].update(type="float"),
                                           c["config_groups"]["group_0"]["input_activations"].update(type="float")),
                                r"expected float8_e4m3fn \[N, K\] as its config group says"),
    "pack-quantized": (lambda c: c.update(format="pack-quantized"), r"format 'pack-quantized' is not supported"),
    "kv-cache": (lambda c: c.update(kv_cache_scheme={"num_bits": 8, "type": "float"}), r"kv_cache_scheme"),
    "2:4-sparse": (lambda c: c.update(sparsity_config={"format": "sparse-24-bitmask"}), r"sparse-24-bitmask"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_unsupported_configurations_are_named(tmp_path, case):
    quant_dir, _ = write_checkpoints(tmp_path)
    change, message = UNSUPPORTED[case]
    _with_config(quant_dir, change)
    with pytest.raises(ValueError, match=message):
        load_model(quant_dir)


def test_quantizing_again_and_broken_tensors_are_refused(tmp_path):
    quant_dir, _ = write_checkpoints(tmp_path)
    with pytest.raises(ValueError, match="quantized already"):
        load_model(quant_dir, quantization="int8")
    tensors = load_file(str(quant_dir / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj"
    scale = tensors.pop(f"{name}.weight_scale")
    save_file(tensors, str(quant_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=f"has int8 {name}.weight but no {name}.weight_scale"):
        load_model(quant_dir)
    tensors[f"{name}.weight_scale"] = scale
    tensors[f"{name}.weight"] = tensors[f"{name}.weight"].float()
    save_file(tensors, str(quant_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=f"{name}.weight is torch.float32 .* expected int8"):
        load_model(quant_dir)
    del tensors[f"{name}.weight"]
    save_file(tensors, str(quant_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=f"has {name}.weight_scale but lacks {name}.weight"):
        load_model(quant_dir)


def test_only_w8a8_is_kept_off_the_gpu(tmp_path):
    from octavo.device import cpu_only_reason

    quant_dir, _ = write_checkpoints(tmp_path)
    assert "int8 activations on the CPU only" in cpu_only_reason(quant_dir)
    _with_config(quant_dir, lambda c: c["config_groups"]["group_0"].update(input_activations=None))
    assert "int8 activations" not in (cpu_only_reason(quant_dir) or "")



def test_a_w8a8_checkpoint_at_tp2_answers_as_at_tp1(tmp_path):
    """Row-parallel ranks round their own part of each input row to int8, with a scale of that
    part (as vLLM's ranks do), so logprobs move by steps of the int8 grid: TP = 2 may pick another
    greedy token only where TP = 1's two candidates are that close (the tiny random model has such
    near ties); up to there the logprobs agree within the grid's steps."""
    from test_tensor_parallel import engine, run

    quant_dir, _ = write_checkpoints(tmp_path)
    two = engine(quant_dir, 2)
    try:
        one = engine(quant_dir, 1)
        for a, b in zip(run(two), run(one)):
            for i, (x, y) in enumerate(zip(a.logprobs, b.logprobs)):
                assert max(abs(x[t].logprob - y[t].logprob) for t in x) < 2e-2
                if a.token_ids[i] != b.token_ids[i]:
                    assert abs(y[a.token_ids[i]].logprob - y[b.token_ids[i]].logprob) < 2e-2
                    break

        def held(m):  # a rank's bytes of the first layer's gate_up integers
            return m.layers[0].mlp.gate_up_weight.qweight.numel()

        assert two.apply_model(held) == [one.apply_model(held)[0] // 2] * 2
    finally:
        two.llm_engine.shutdown()
