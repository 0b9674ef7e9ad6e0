"""GGUF files of more architectures than Llama: tiny Qwen2 (q, k, v biases) and Qwen3 (q / k norms,
its own head size) checkpoints written as llama.cpp's converter writes them (Llama's q / k rows
interleaved, Qwen's not; float32 or Q8_0 blocks), read back by transformers' GGUF loader as the
checkpoint they came from, and run by Octavo to transformers' greedy tokens."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

gguf = pytest.importorskip("gguf")

from octavo import LLM, SamplingParams  # noqa: E402
from octavo.layers.linear import QuantizedWeight  # noqa: E402
from octavo.loader import load_model  # noqa: E402
from octavo.loader.gguf_file import gguf_config  # noqa: E402
from test_models import tiny_checkpoint  # noqa: E402

# Hugging Face module name -> llama.cpp's, within a layer
LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
               "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
               "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(name: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    _, _, layer, rest = name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{LAYER_NAMES[module]}.{kind}"


def interleave(data: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q / k row order for Llama: each head's two rotary halves interleaved."""
    return data.reshape(heads, 2, data.shape[0] // heads // 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)


def gguf_writer(c, arch: str, path) -> "gguf.GGUFWriter":
    """A writer of ``arch`` with the metadata of Hugging Face config ``c`` (RoPE: its full-attention
    layers' where it has several kinds)."""
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    writer = gguf.GGUFWriter(str(path), arch)
    for add, value in ((writer.add_block_count, c.num_hidden_layers), (writer.add_context_length, 256),
                       (writer.add_embedding_length, c.hidden_size),
                       (writer.add_feed_forward_length, c.intermediate_size),
                       (writer.add_head_count, c.num_attention_heads),
                       (writer.add_head_count_kv, c.num_key_value_heads),
                       (writer.add_layer_norm_rms_eps, c.rms_norm_eps), (writer.add_vocab_size, c.vocab_size),
                       (writer.add_rope_freq_base, rope["rope_theta"]),
                       (writer.add_key_length, c.head_dim), (writer.add_value_length, c.head_dim)):
        add(value)
    return writer


def finish(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_gguf(model, arch: str, path, q8_0: bool = False) -> None:
    """``model``'s weights as llama.cpp's converter lays them out for ``arch``; matrices in Q8_0
    blocks with ``q8_0`` (the embedding stays float32)."""
    c = model.config
    writer = gguf_writer(c, arch, path)
    for name, tensor in model.state_dict().items():
        data = tensor.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            data = interleave(data, c.num_attention_heads if "q_proj" in name else c.num_key_value_heads)
        if q8_0 and data.ndim == 2 and name != "model.embed_tokens.weight":
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0),
                              raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name(name), data)
    finish(writer)


# kind (test_models.ARCHITECTURES) -> llama.cpp's architecture name; Qwen3 with a head size that
# is not hidden_size / heads, which only attention.key_length tells.
FILES = {"llama": ("llama", {}), "qwen2": ("qwen2", {}), "qwen3": ("qwen3", {"head_dim": 64}),
         "mistral": ("llama", {"sliding_window": None})}


@pytest.fixture(scope="module", params=list(FILES))
def written(request, tmp_path_factory):
    kind = request.param
    arch, overrides = FILES[kind]
    path = tmp_path_factory.mktemp(kind)
    reference = tiny_checkpoint(kind, path / "hf", tie_word_embeddings=False, **overrides)
    write_gguf(reference, arch, path / "model.gguf")
    write_gguf(reference, arch, path / "q8_0.gguf", q8_0=True)
    return kind, reference, path


def greedy(model, prompt: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(prompt):].tolist()


def test_transformers_reads_the_written_file_as_the_checkpoint(written):
    """The layout written is llama.cpp's as transformers' GGUF loader undoes it. transformers
    reads Qwen3's head size from hidden_size / heads, so its file is checked by Octavo's tests below."""
    kind, reference, path = written
    if kind == "qwen3":
        assert gguf_config(path / "model.gguf").head_dim == 64
        return
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path, gguf_file="model.gguf", dtype=torch.float32)
    ours = reference.state_dict()
    for name, tensor in theirs.state_dict().items():
        assert torch.equal(tensor, ours[name]), name


def test_octavo_loads_each_tensor_where_the_checkpoint_has_it(written):
    kind, reference, path = written
    from_file, from_hf = load_model(path / "model.gguf"), load_model(path / "hf", "float32")
    config = gguf_config(path / "model.gguf")
    assert config.architecture == reference.config.architectures[0].replace("Mistral", "Llama")
    assert (config.head_dim, config.attention_bias) == (from_hf.config.head_dim, from_hf.config.attention_bias)
    theirs = dict(from_hf.named_parameters())
    for name, tensor in from_file.named_parameters():
        assert torch.equal(tensor, theirs[name]), name


def test_greedy_tokens_are_transformers(written):
    kind, reference, path = written
    llm = LLM(str(path / "model.gguf"), skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=16 << 20)
    prompts = [[5, 9, 13, 200], list(range(30, 70)), [7] * 9]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outputs] == [greedy(reference, p, 12) for p in prompts]


def test_q8_0_projections_stay_in_their_blocks(written):
    """Every matrix but the embedding in Q8_0: the projections and the LM head load as blocks
    that decode to gguf's dequantized values (Qwen2's biases stay float32 beside them)."""
    kind, _, path = written
    model = load_model(path / "q8_0.gguf")
    blocks = [m for m in model.modules() if isinstance(m, QuantizedWeight)]
    assert len(blocks) == 4 * model.config.num_hidden_layers + 1 and {b.weight_format for b in blocks} == {"q8_0"}
    reader = gguf.GGUFReader(str(path / "q8_0.gguf"))
    down = next(t for t in reader.tensors if t.name == "blk.1.ffn_down.weight")
    expected = torch.from_numpy(gguf.quants.dequantize(down.data, down.tensor_type))
    assert torch.equal(model.layers[1].mlp.down_weight.dequantize(), expected)
