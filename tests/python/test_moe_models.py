"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) against Hugging Face
transformers on tiny random checkpoints made here: logits position by position over a prompt
and 32 greedy steps, greedy outputs through the step loop with chunked prefill, prefix-cache
hits, preemption and mixed batches, load-time int8 / int4 experts, GPTQ / AWQ and `octavo quantize`
experts, tensor / pipeline / expert parallel, and (on a GPU) the CUDA kernels in the engine."""
import numpy as np
import pytest
import torch
import transformers

from octavo.layers.linear import QuantizedWeight
from octavo.layers.moe import FusedMoE
from octavo.layers.quantize import quantize_model
from octavo.loader import load_model
from test_models import TINY, attach_kv_cache, step
from test_step_loop import POOLS_AND_BUDGETS, assert_batch_invariant, assert_greedy_matches

MOE = dict(num_experts_per_tok=2)
ARCHITECTURES = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM, dict(num_local_experts=8, intermediate_size=96)),
    "qwen2-moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM, dict(
        num_experts=8, moe_intermediate_size=64, shared_expert_intermediate_size=96)),
    # Renormalized weights, and a dense MLP in layer 0 (mlp_only_layers) next to an MoE one.
    "qwen3-moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, dict(
        num_experts=8, moe_intermediate_size=64, norm_topk_prob=True, mlp_only_layers=[0])),
    "olmoe": (transformers.OlmoeConfig, transformers.OlmoeForCausalLM, dict(num_experts=8, intermediate_size=64, clip_qkv=4.0)),
}
STEPS = 32
MOE_WIDTH = {"mixtral": 96, "qwen2-moe": 64, "qwen3-moe": 64, "olmoe": 64}  # each expert's intermediate rows


def tiny_moe_checkpoint(kind: str, path, **overrides) -> torch.nn.Module:
    config_cls, model_cls, extra = ARCHITECTURES[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY, **MOE, **extra, **overrides})).float().eval()
    for name, p in model.named_parameters():
        if name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight")):
            p.data.normal_(0, 0.5)  # decisive routing: no near-ties between a token's experts
        elif name.endswith("bias"):
            p.data.normal_()  # random init leaves Qwen2-MoE's q/k/v biases at zero; make them count
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def checkpoint(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return path, tiny_moe_checkpoint(request.param, path)


def decode(model, prompt: list[int], steps: int) -> tuple[torch.Tensor, list[int]]:
    """Logits of the prompt and of `steps` greedy tokens, one step at a time through the cache."""
    logits, tokens = [step(model, prompt, 0)], list(prompt)
    for _ in range(steps):
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(step(model, tokens[-1:], len(tokens) - 1))
    return torch.cat(logits), tokens


def test_logits_match_transformers_for_32_greedy_steps(checkpoint):
    path, reference = checkpoint
    model = load_model(path, dtype="float32")
    assert any(isinstance(layer.mlp, FusedMoE) for layer in model.layers)
    attach_kv_cache(model, num_blocks=8)
    prompt = torch.randint(0, TINY["vocab_size"], (21,), generator=torch.Generator().manual_seed(1)).tolist()
    ours, tokens = decode(model, prompt, STEPS)
    with torch.no_grad():
        theirs = reference(torch.tensor([tokens[:-1] + tokens[-1:]])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert ours.argmax(-1)[len(prompt) - 1:-1].tolist() == tokens[len(prompt):]


@pytest.mark.parametrize("num_blocks,budget", POOLS_AND_BUDGETS)
def test_step_loop_greedy_outputs_match_transformers(checkpoint, num_blocks, budget):
    assert_greedy_matches(*checkpoint, num_blocks, budget)


def test_output_is_the_same_alone_and_in_a_batch(checkpoint):
    assert_batch_invariant(checkpoint[0])


@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_quantized_experts_compute_their_dequantized_floats(checkpoint, method):
    """Load-time quantization covers the experts (not the router); the model then computes what
    the float model computes on the dequantized weights, and quantizing while loading equals
    quantizing the loaded model."""
    path, _ = checkpoint
    quantized = load_model(path, dtype="float32", quantization=method)
    after = quantize_model(load_model(path, dtype="float32"), method)
    floats = load_model(path, dtype="float32")
    for q_layer, a_layer, f_layer in zip(quantized.layers, after.layers, floats.layers):
        if not isinstance(q_layer.mlp, FusedMoE):
            continue
        assert isinstance(q_layer.mlp.router_weight, torch.nn.Parameter)
        for attr in ("w13", "w2"):
            weight = getattr(q_layer.mlp, attr)
            assert isinstance(weight, QuantizedWeight) and weight.weight_format == method
            assert torch.equal(weight.qweight, getattr(a_layer.mlp, attr).qweight)
        for name, weight in q_layer.mlp.named_modules():  # the experts and a shared expert
            if isinstance(weight, QuantizedWeight):
                f_layer.mlp.get_parameter(name).data.copy_(weight.dequantize())
    x = torch.randn(9, TINY["hidden_size"])
    for q_layer, f_layer in zip(quantized.layers, floats.layers):
        if isinstance(q_layer.mlp, FusedMoE):
            torch.testing.assert_close(q_layer.mlp(x), f_layer.mlp(x), rtol=1e-5, atol=1e-6)
    attach_kv_cache(quantized, num_blocks=8)
    assert torch.isfinite(step(quantized, [1, 2, 3, 4], 0)).all()


def test_w8a8_experts_keep_int8_weights_and_round_their_inputs(checkpoint):
    """quantization="w8a8": the experts hold int8's integers in format int8_a8, whose products
    round each row's inputs to int8: close to int8's results, not equal."""
    path, _ = checkpoint
    a8, plain = (load_model(path, dtype="float32", quantization=method) for method in ("w8a8", "int8"))
    x = torch.randn(9, TINY["hidden_size"])
    for a_layer, p_layer in zip(a8.layers, plain.layers):
        if not isinstance(a_layer.mlp, FusedMoE):
            continue
        for attr in ("w13", "w2"):
            weight = getattr(a_layer.mlp, attr)
            assert weight.weight_format == "int8_a8"
            assert torch.equal(weight.qweight, getattr(p_layer.mlp, attr).qweight)
        ours, theirs = a_layer.mlp(x), p_layer.mlp(x)
        assert not torch.equal(ours, theirs)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0.05 * theirs.abs().max().item())
    attach_kv_cache(a8, num_blocks=8)
    assert torch.isfinite(step(a8, [1, 2, 3, 4], 0)).all()


@pytest.mark.parametrize("kind,tp,pp,ep", [("mixtral", 2, 1, False), ("qwen2-moe", 2, 1, False), ("qwen3-moe", 1, 2, False),
                                         ("mixtral", 2, 1, True), ("qwen2-moe", 2, 1, True)])
def test_split_over_ranks_answers_as_one(kind, tp, pp, ep, tmp_path):
    """Tensor parallel cuts every expert's intermediate rows (and the shared expert's); expert
    parallel gives each rank whole experts; pipeline parallel gives each stage its layers'
    experts. All answer as one rank does."""
    pytest.importorskip("zmq")
    from test_detokenizer import _byte_level_bpe
    from test_tensor_parallel import assert_same, engine
    from test_tensor_parallel import run as generate

    tokenizer = _byte_level_bpe()
    tokenizer.save_pretrained(tmp_path)
    tiny_moe_checkpoint(kind, tmp_path, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    split = engine(tmp_path, tp, pipeline_parallel_size=pp, enable_expert_parallel=ep)
    try:
        assert_same(generate(split), generate(engine(tmp_path, 1)))
        if tp > 1:
            moe = 1 if kind == "qwen3-moe" else 0  # layer 0 of the Qwen3-MoE checkpoint is dense
            shapes = split.apply_model(lambda m: (m.layers[moe].mlp.experts, tuple(m.layers[moe].mlp.w2.shape)))
            width, hidden = MOE_WIDTH[kind], TINY["hidden_size"]
            if ep:  # four whole experts each
                assert shapes == [((0, 4), (4 * hidden, width)), ((4, 8), (4 * hidden, width))]
            else:  # every expert, half its rows each
                assert shapes == [((0, 8), (8 * hidden, width // 2))] * 2
    finally:
        split.llm_engine.shutdown()


def test_olmoe_refuses_tensor_parallel(tmp_path):
    tiny_moe_checkpoint("olmoe", tmp_path)
    with pytest.raises(ValueError, match="normalizes q and k over all heads at once"):
        load_model(tmp_path, tp_rank=0, tp_size=2)


@pytest.mark.parametrize("width,packed", [(64, True), (40, False)])
def test_bf16_experts_pack_into_tiles_only_whole(width, packed, tmp_path):
    """On AMX, bfloat16 expert stacks are packed into 32-row weight tiles where each expert's
    rows fill whole tiles, and compute what the dense stacks do; an expert ending inside a tile
    keeps its dense rows."""
    from octavo import _C
    from octavo.layers import bf16_tiles

    if "amx" not in _C.supported_cpu_isas():
        pytest.skip("needs a CPU with AMX")
    tiny_moe_checkpoint("qwen3-moe", tmp_path, moe_intermediate_size=width)
    dense, tiled = load_model(tmp_path, dtype="bfloat16"), load_model(tmp_path, dtype="bfloat16")
    bf16_tiles.pack_model(tiled)
    moe = tiled.layers[1].mlp
    assert isinstance(moe.w13, QuantizedWeight) == packed and isinstance(moe.router_weight, torch.nn.Parameter)
    previous = _C.cpu_isa()
    _C.set_cpu_isa("amx")
    try:
        for tokens in (1, 5, 40):
            x = torch.randn(tokens, TINY["hidden_size"]).bfloat16()
            torch.testing.assert_close(moe(x), dense.layers[1].mlp(x), rtol=0.02, atol=0.02)
    finally:
        _C.set_cpu_isa(previous)


# llama.cpp's layout of a MoE layer in a GGUF file: its architecture, the checkpoint's module of
# the router and experts, and each expert matrix's name there.
GGUF_MOE = {"mixtral": ("llama", "block_sparse_moe", ("w1", "w3", "w2")),
            "qwen3-moe": ("qwen3moe", "mlp", ("gate_proj", "up_proj", "down_proj"))}


def _write_moe_gguf(kind: str, hf_dir, path) -> None:
    """The checkpoint in hf_dir as llama.cpp writes a GGUF of it (Mixtral: llama with experts;
    Qwen3-MoE: qwen3moe, with q / k norms and rows not interleaved): experts' gate and up in Q4_0
    blocks, down and attention in Q8_0, the rest in floats. The checkpoint's tensors are rewritten
    as their blocks' values, so both files hold the same weights."""
    import json

    import gguf
    from safetensors.torch import load_file, save_file

    q = gguf.GGMLQuantizationType
    arch, module, (gate, up, down) = GGUF_MOE[kind]
    config = json.loads((hf_dir / "config.json").read_text())
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    num_experts = config.get("num_local_experts") or config["num_experts"]
    tensors = load_file(hf_dir / "model.safetensors")

    def blocks(name: str, qtype):
        data = gguf.quants.quantize(tensors[name].numpy(), qtype)
        tensors[name] = torch.from_numpy(gguf.quants.dequantize(data, qtype).copy())
        return data

    def interleave(data, n):  # llama.cpp's q/k row order for llama (loader/gguf_file.py undoes it)
        if not n or arch != "llama":
            return data
        return data.reshape(n, 2, data.shape[0] // n // 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)

    writer = gguf.GGUFWriter(str(path), arch)
    for add, value in ((writer.add_block_count, config["num_hidden_layers"]), (writer.add_context_length, 256),
                       (writer.add_embedding_length, config["hidden_size"]),
                       (writer.add_feed_forward_length, config["intermediate_size"]), (writer.add_head_count, heads),
                       (writer.add_head_count_kv, kv_heads), (writer.add_layer_norm_rms_eps, config["rms_norm_eps"]),
                       (writer.add_rope_freq_base, config.get("rope_theta") or config["rope_parameters"]["rope_theta"]),
                       (writer.add_rope_dimension_count, config["head_dim"]), (writer.add_vocab_size, config["vocab_size"]),
                       (writer.add_key_length, config["head_dim"]), (writer.add_value_length, config["head_dim"]),
                       (writer.add_expert_count, num_experts),
                       (writer.add_expert_used_count, config["num_experts_per_tok"])):
        add(value)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_tensor("token_embd.weight", tensors["model.embed_tokens.weight"].numpy())
    writer.add_tensor("output_norm.weight", tensors["model.norm.weight"].numpy())
    writer.add_tensor("output.weight", blocks("lm_head.weight", q.Q8_0), raw_dtype=q.Q8_0)
    for i in range(config["num_hidden_layers"]):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        for ours, theirs in (("input_layernorm", "attn_norm"), ("post_attention_layernorm", "ffn_norm"),
                             (f"{module}.gate", "ffn_gate_inp"), ("self_attn.q_norm", "attn_q_norm"),
                             ("self_attn.k_norm", "attn_k_norm")):
            if f"{p}{ours}.weight" in tensors:
                writer.add_tensor(f"{b}{theirs}.weight", tensors[f"{p}{ours}.weight"].numpy())
        for ours, theirs, n in (("q_proj", "attn_q", heads), ("k_proj", "attn_k", kv_heads), ("v_proj", "attn_v", 0),
                                ("o_proj", "attn_output", 0)):
            data = blocks(f"{p}self_attn.{ours}.weight", q.Q8_0)
            writer.add_tensor(f"{b}{theirs}.weight", interleave(data, n), raw_dtype=q.Q8_0)
        for ours, theirs, qtype in ((gate, "ffn_gate_exps", q.Q4_0), (up, "ffn_up_exps", q.Q4_0),
                                    (down, "ffn_down_exps", q.Q8_0)):
            stack = [blocks(f"{p}{module}.experts.{j}.{ours}.weight", qtype) for j in range(num_experts)]
            writer.add_tensor(f"{b}{theirs}.weight", np.stack(stack), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize("kind,architecture", [("mixtral", "MixtralForCausalLM"),
                                               ("qwen3-moe", "Qwen3MoeForCausalLM")])
def test_a_moe_gguf_runs_on_its_expert_blocks(kind, architecture, tmp_path):
    pytest.importorskip("gguf")
    hf_dir, path = tmp_path / "hf", tmp_path / f"tiny-{kind}.gguf"
    tiny_moe_checkpoint(kind, hf_dir, **({"mlp_only_layers": []} if kind == "qwen3-moe" else {}))
    _write_moe_gguf(kind, hf_dir, path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    model = load_model(path)
    moe = model.layers[0].mlp
    assert type(model).__name__ == architecture and isinstance(moe, FusedMoE)
    assert (moe.w13.weight_format, moe.w2.weight_format) == ("q4_0", "q8_0")
    attach_kv_cache(model, num_blocks=8)
    prompt = torch.randint(0, TINY["vocab_size"], (13,), generator=torch.Generator().manual_seed(2)).tolist()
    ours, tokens = decode(model, prompt, 8)
    with torch.no_grad():
        theirs = reference(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind,method,g,act_order", [("qwen3-moe", "gptq", 32, False), ("mixtral", "awq", 32, False),
                                                     ("qwen2-moe", "gptq", 32, True)])
def test_gptq_and_awq_experts_run_like_their_float_weights(kind, method, g, act_order, tmp_path):
    """Packed GPTQ / AWQ experts stack into int4 expert stacks without a float copy and run as the
    float checkpoint of the weights they stand for; act-order experts (a permutation of the inputs
    per expert, which fused_moe has no place for) load as floats."""
    from octavo import LLM, SamplingParams
    from test_gptq_awq import write_checkpoints

    quant_dir, float_dir = write_checkpoints(tmp_path, method, g, act_order,
                                             make=lambda path, **config: tiny_moe_checkpoint(kind, path, **config))
    model, reference = load_model(quant_dir, "float32"), load_model(float_dir, "float32")
    moe = [(ours.mlp, theirs.mlp) for ours, theirs in zip(model.layers, reference.layers)
           if isinstance(ours.mlp, FusedMoE)]
    assert moe
    for ours, theirs in moe:
        for name in ("w13", "w2"):
            weight = getattr(ours, name)
            assert isinstance(weight, QuantizedWeight) != act_order
            floats = weight.dequantize() if isinstance(weight, QuantizedWeight) else weight.data
            assert torch.equal(floats, getattr(theirs, name).data)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[5, 6, 7, 8], [20, 21, 22]]
    runs = [LLM(model=str(d), kv_cache_memory_bytes=16 << 20, device="cpu").generate(prompts, params, use_tqdm=False)
            for d in (quant_dir, float_dir)]
    assert [o.outputs[0].token_ids for o in runs[0]] == [o.outputs[0].token_ids for o in runs[1]]


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
@pytest.mark.parametrize("source", ["gptq", "octavo"])
def test_quantized_experts_split_over_two_ranks_answer_as_one(source, expert_parallel, tmp_path):
    """GPTQ experts, and an ``octavo quantize`` checkpoint's int4 expert stacks: tensor parallel
    cuts each expert's rows (w13) and inputs (w2, whole groups); expert parallel gives each rank
    half the experts, whole."""
    from octavo.loader.quantized_checkpoint import write_quantized_checkpoint
    from test_gptq_awq import write_checkpoints
    from test_tensor_parallel import assert_same, engine, run

    make = lambda path, **config: tiny_moe_checkpoint("qwen3-moe", path, **config)  # noqa: E731
    quant_dir, float_dir = write_checkpoints(tmp_path, "gptq", 32, make=make)
    if source == "octavo":
        quant_dir = write_quantized_checkpoint(float_dir, tmp_path / "octavo", "int4")
    two = engine(quant_dir, 2, enable_expert_parallel=expert_parallel)
    try:
        one = engine(quant_dir, 1)
        assert_same(run(two), run(one))

        def held(m):  # a rank's bytes of the MoE layer's w13 integers
            return m.layers[1].mlp.w13.qweight.numel()

        assert two.apply_model(held) == [one.apply_model(held)[0] // 2] * 2
    finally:
        two.llm_engine.shutdown()


def test_moe_models_run_on_gpus_where_their_widths_are_whole_rows_of_32(tmp_path):
    from octavo.device import cpu_only_reason

    tiny_moe_checkpoint("olmoe", tmp_path / "ok", head_dim=64, hidden_size=256)  # a head size CUDA has
    assert cpu_only_reason(tmp_path / "ok") is None
    tiny_moe_checkpoint("olmoe", tmp_path / "odd", head_dim=64, hidden_size=256, intermediate_size=40)
    assert "expert intermediate size 40 is not a multiple of 32" in cpu_only_reason(tmp_path / "odd")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("kind", list(ARCHITECTURES))
def test_greedy_tokens_match_transformers_on_the_gpu(kind, enforce_eager, tmp_path):
    """The CUDA router and experts in the engine, in decode graphs and eagerly: transformers'
    greedy tokens on the same GPU, in float32, for a batch whose requests end one by one."""
    from octavo import LLM, SamplingParams

    # hidden / heads = head_dim: some transformers releases size OLMoE's q/k norms from the former.
    reference = tiny_moe_checkpoint(kind, tmp_path, head_dim=64, hidden_size=256).cuda()
    llm = LLM(model=str(tmp_path), dtype="float32", device="cuda", kv_cache_memory_bytes=64 << 20, max_num_seqs=8,
              enforce_eager=enforce_eager, skip_tokenizer_init=True)
    prompts = [[1, 5, 9, 200, 17], [3] * 40, [250], list(range(2, 70, 3))]
    lengths = [16, 11, 6, 3]
    outputs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths],
                           use_tqdm=False)
    for prompt, out, n in zip(prompts, outputs, lengths):
        tokens = list(prompt)
        with torch.no_grad():
            for _ in range(n):
                tokens.append(int(reference(torch.tensor([tokens], device="cuda")).logits[0, -1].argmax()))
        assert list(out.outputs[0].token_ids) == tokens[len(prompt):]
    assert llm.llm_engine.scheduler.block_pool.num_used_blocks == 0


def test_impossible_expert_layouts_are_refused():
    from octavo.distributed.shards import TPShard
    from octavo.layers.moe import MoEConfig

    moe = MoEConfig(num_experts=4, top_k=2, intermediate_size=64, renormalize=True)
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, 4\], got 5"):
        FusedMoE(128, MoEConfig(num_experts=4, top_k=5, intermediate_size=64, renormalize=True), torch.float32,
                 TPShard())
    with pytest.raises(ValueError, match="expert parallel over 8 ranks needs at least as many experts, got 4"):
        FusedMoE(128, moe, torch.float32, TPShard(rank=0, world=8, expert_parallel=True))
    with pytest.raises(ValueError, match="more than the experts' 64 intermediate rows"):
        FusedMoE(128, moe, torch.float32, TPShard(rank=70, world=71))
