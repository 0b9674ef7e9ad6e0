"""quantization="gguf_a8": a GGUF file's quantized weights multiply int8-rounded inputs (llama.cpp's
way on the CPU). Every weight kept in its blocks takes int8 inputs, the LM head too; the model's
log-probabilities move by the inputs' rounding and no more; float checkpoints are refused."""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from octavo import LLM, SamplingParams  # noqa: E402
from octavo.device import cpu_only_reason  # noqa: E402
from octavo.layers.linear import MixedWeight, QuantizedWeight  # noqa: E402
from octavo.layers.quantize import GGUF_FORMATS  # noqa: E402
from octavo.loader import load_model  # noqa: E402
from test_gguf_kquants import MIXES, SIZES, write_mix  # noqa: E402
from test_models import tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="module", params=list(MIXES))
def gguf_path(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"a8-{request.param}")
    write_mix(tiny_checkpoint("llama", path / "hf", **SIZES), MIXES[request.param], path / "model.gguf")
    return path / "model.gguf"


def block_weights(model) -> list[QuantizedWeight]:
    return [m for m in model.modules() if isinstance(m, QuantizedWeight) and not isinstance(m, MixedWeight)]


def test_every_block_weight_takes_int8_inputs(gguf_path):
    plain, a8 = load_model(gguf_path), load_model(gguf_path, quantization="gguf_a8")
    weights = block_weights(a8)
    assert weights and all(w.weight_format in GGUF_FORMATS for w in weights)
    assert all(w.int8_inputs and w.bound[-1] for w in weights)
    assert a8.lm_head.int8_inputs
    assert not any(w.int8_inputs for w in block_weights(plain))
    # The weights themselves are the file's, unchanged.
    for ours, theirs in zip(weights, block_weights(plain)):
        assert torch.equal(ours.qweight, theirs.qweight)


def prompt_logprobs(llm: LLM, prompts: list[list[int]]) -> torch.Tensor:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return torch.tensor([next(iter(lp.values())).logprob for o in outputs for lp in o.prompt_logprobs[1:]])


def test_log_probabilities_move_by_the_inputs_rounding(gguf_path):
    prompts = [list(range(30, 90)), [5, 9, 13, 200, 7, 7, 7, 1]]
    kwargs = dict(skip_tokenizer_init=True, max_model_len=128, kv_cache_memory_bytes=16 << 20)
    plain = prompt_logprobs(LLM(str(gguf_path), **kwargs), prompts)
    a8 = prompt_logprobs(LLM(str(gguf_path), quantization="gguf_a8", **kwargs), prompts)
    diff = (a8 - plain).abs()
    assert diff.max() > 0  # the inputs were rounded
    assert diff.max() < 0.015 * plain.abs().max(), f"log-probabilities moved by up to {diff.max():.3g}"


def test_a_quantized_lm_head_writes_its_logits_into_one_buffer(gguf_path):
    """On the CPU a quantized LM head's logits go to one buffer that every step reuses (fresh, Gemma 3's
    67 MB a step cost a third of its LM head in page faults): requests in a batch get the tokens and
    logprobs they get alone (up to float32 rounding: attention splits its work by the batch), and the
    buffer only grows."""
    llm = LLM(str(gguf_path), skip_tokenizer_init=True, max_model_len=128, kv_cache_memory_bytes=16 << 20)
    params = SamplingParams(temperature=0, max_tokens=6, logprobs=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([3, 70, 12], list(range(40, 60)), [9] * 7)]
    together = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out in zip(prompts, together):
        alone = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert alone.token_ids == out.outputs[0].token_ids
        for ours, theirs in zip(out.outputs[0].logprobs, alone.logprobs):
            assert ours.keys() == theirs.keys()
            assert all(abs(ours[t].logprob - theirs[t].logprob) < 1e-5 for t in ours)

    def buffers(worker):
        small, large = worker.runner.logits_out(2), worker.runner.logits_out(3)
        return small.data_ptr() == large.data_ptr(), tuple(worker.runner._logits.shape), worker.model.lm_head.shape[0]

    same, shape, vocab = llm.collective_rpc(buffers)[0]
    assert same and shape == (3, vocab)


def test_a_float_checkpoint_is_refused(tmp_path):
    tiny_checkpoint("llama", tmp_path, **SIZES)
    with pytest.raises(ValueError, match="GGUF file's quantized weights by int8 inputs, but this model's weights "
                                         "are floats"):
        load_model(tmp_path, quantization="gguf_a8")


def test_gguf_a8_is_for_the_cpu():
    assert "CPU only" in cpu_only_reason("any.gguf", "gguf_a8")
