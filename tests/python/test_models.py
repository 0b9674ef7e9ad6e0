"""Llama-family models on Octavo's kernels against Hugging Face transformers, on tiny random
checkpoints made here: same weights, same tokens, logits compared position by position."""
import pytest
import torch
import transformers

from octavo.config import ModelConfig
from octavo.layers.attention import AttentionMetadata
from octavo.loader import load_model
from octavo.models import model_class

BLOCK_SIZE = 16
TINY = dict(vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=256, rms_norm_eps=1e-5)

ARCHITECTURES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(tie_word_embeddings=True)),
    "llama3-rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM, dict(rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, dict(sliding_window=8)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {}),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {}),
}


def tiny_checkpoint(kind: str, path, **overrides) -> torch.nn.Module:
    config_cls, model_cls, extra = ARCHITECTURES[kind]
    torch.manual_seed(0)
    model = model_cls(config_cls(**{**TINY, **extra, **overrides})).float().eval()
    if kind == "qwen2":  # random init leaves biases at zero; make them count
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.data.normal_()
    model.save_pretrained(path)
    return model


def attach_kv_cache(model, num_blocks: int) -> None:
    c = model.config
    for attn in model.attention_layers():
        shape = (num_blocks, c.num_key_value_heads, BLOCK_SIZE, c.head_dim)
        attn.kv_cache = (torch.zeros(shape, dtype=model.dtype), torch.zeros(shape, dtype=model.dtype))


def step(model, tokens: list[int], start: int) -> torch.Tensor:
    """Runs `tokens` at positions start.. of one sequence (blocks 1, 2, ...); logits of each."""
    n = len(tokens)
    positions = torch.arange(start, start + n, dtype=torch.int32)
    table = torch.arange(1, 1 + (start + n + BLOCK_SIZE - 1) // BLOCK_SIZE, dtype=torch.int32)
    meta = AttentionMetadata(slot_mapping=(table[positions // BLOCK_SIZE] * BLOCK_SIZE + positions % BLOCK_SIZE),
                             query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                             seq_lens=torch.tensor([start + n], dtype=torch.int32), block_tables=table[None])
    hidden = model(torch.tensor(tokens), positions, meta)
    return model.compute_logits(hidden, torch.arange(n))


@pytest.mark.parametrize("kind", list(ARCHITECTURES))
def test_greedy_decode_matches_transformers(kind, tmp_path):
    reference = tiny_checkpoint(kind, tmp_path)
    model = load_model(tmp_path, dtype="float32")
    attach_kv_cache(model, num_blocks=8)
    prompt = torch.randint(0, TINY["vocab_size"], (21,), generator=torch.Generator().manual_seed(1)).tolist()
    logits = [step(model, prompt, 0)]
    tokens = list(prompt)
    for _ in range(16):  # greedy decode, one token per step through the paged cache
        tokens.append(int(logits[-1][-1].argmax()))
        logits.append(step(model, tokens[-1:], len(tokens) - 1))
    ours = torch.cat(logits)
    with torch.no_grad():
        theirs = reference(torch.tensor([tokens[:-1] + tokens[-1:]])).logits[0]
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
    assert ours.argmax(-1)[len(prompt) - 1:-1].tolist() == tokens[len(prompt):]


def test_loader_errors_name_the_problem(tmp_path):
    tiny_checkpoint("llama", tmp_path)
    config = ModelConfig.from_pretrained(tmp_path)
    model = model_class(config.architecture)(config, torch.float32)
    with pytest.raises(ValueError, match="'model.layers.0.mlp.up_proj.weight' has shape"):
        model.load_weights([("model.layers.0.mlp.up_proj.weight", torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="'model.vision_tower.weight' is not used"):
        model.load_weights([("model.vision_tower.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match="checkpoint lacks tensors"):
        model.load_weights([])
    with pytest.raises(ValueError, match="supported: Gemma3ForCausalLM, LlamaForCausalLM"):
        model_class("GPT2LMHeadModel")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no safetensors weights"):
        load_model(tmp_path)


def test_dummy_weights_need_no_files(tmp_path):
    tiny_checkpoint("qwen3", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    model = load_model(tmp_path, dtype="bfloat16", load_format="dummy")
    attach_kv_cache(model, num_blocks=4)
    logits = step(model, [1, 2, 3], 0)
    assert logits.dtype == torch.float32 and logits.shape == (3, TINY["vocab_size"]) and torch.isfinite(logits).all()
