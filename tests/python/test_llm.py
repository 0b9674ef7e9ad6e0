"""LLM.generate / LLM.chat end to end on a tiny random Llama with a real (small, offline-trained)
byte-level BPE tokenizer: tokens match transformers' greedy decoding, and the vLLM-facing
behaviour (n, seeds, stop strings, finish reasons, logprobs, chat template, errors) holds."""
import json
import math
import shutil

import pytest
import torch

from octavo import LLM, SamplingParams
from octavo.sampling_params import RequestOutputKind
from octavo.entrypoints.cli import main
from test_detokenizer import _byte_level_bpe
from test_models import tiny_checkpoint

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return tmp_path_factory.mktemp("tiny-llm")


@pytest.fixture(scope="module")
def tiny(tiny_path):
    path = tiny_path
    tokenizer = _byte_level_bpe()
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    reference = tiny_checkpoint("llama", path, vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    llm = LLM(model=str(path), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=128)
    return llm, reference, tokenizer


def hf_greedy(reference, ids: list[int], n: int) -> list[int]:
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(reference(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(ids):]


def test_a_stop_tokens_text_is_left_out_unless_asked_for(tiny):
    """vLLM's rule: the token that stopped the request (here a stop_token_ids entry) stays in
    token_ids, and its text is in the output only with include_stop_str_in_output."""
    llm, _, tokenizer = tiny
    plain = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    stop = plain.token_ids[3]
    first = plain.token_ids.index(stop)
    for include in (False, True):
        out = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                         stop_token_ids=[stop], include_stop_str_in_output=include),
                           use_tqdm=False)[0].outputs[0]
        assert list(out.token_ids) == list(plain.token_ids[:first + 1]) and out.stop_reason == stop
        kept = plain.token_ids[:first + 1] if include else plain.token_ids[:first]
        assert out.text == tokenizer.decode(kept)


def test_a_follow_up_copies_the_partial_block_and_generates_the_same(tiny, tiny_path):
    """A prompt that continues a finished request's tokens copies that request's partial last
    block instead of computing its tokens again; the output is the one without any cache."""
    llm, _, tokenizer = tiny
    first = tokenizer.encode("Hello world, how are you")
    greedy = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    answer = list(llm.generate([first], greedy, use_tqdm=False)[0].outputs[0].token_ids)
    follow_up = first + answer[:-1] + [5, 6]
    scheduler = llm.llm_engine.scheduler
    hits = scheduler.prefix_cache_stats["hits"]
    cached = llm.generate([follow_up], greedy, use_tqdm=False)[0]
    # All the KV the first request computed: its prompt and all but its last output token.
    assert scheduler.prefix_cache_stats["hits"] - hits == len(first) + len(answer) - 1
    plain = LLM(model=str(tiny_path), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=128,
                enable_prefix_caching=False)
    assert cached.outputs[0].token_ids == plain.generate([follow_up], greedy, use_tqdm=False)[0].outputs[0].token_ids


def test_greedy_generate_matches_transformers(tiny):
    llm, reference, tokenizer = tiny
    prompts = ["Hello world", "Emoji time 😀", "Straße", "x"]
    outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    for prompt, out in zip(prompts, outputs):
        ids = tokenizer.encode(prompt)
        assert out.prompt_token_ids == ids and out.finished
        completion = out.outputs[0]
        assert list(completion.token_ids) == hf_greedy(reference, ids, 10)
        assert completion.finish_reason == "length"
        full = tokenizer.decode(ids + list(completion.token_ids))
        # A character still incomplete when the output ends is dropped, as vLLM does.
        assert completion.text == full[len(tokenizer.decode(ids)):].rstrip("\ufffd")


def test_seeded_sampling_is_reproducible_and_n_samples_differ(tiny):
    llm, _, _ = tiny
    params = SamplingParams(n=3, temperature=1.0, top_p=0.95, seed=1234, max_tokens=12, ignore_eos=True)
    first = llm.generate("Numbers 12345", params, use_tqdm=False)[0]
    second = llm.generate(["Numbers 12345", "other"], [params, SamplingParams(seed=5)], use_tqdm=False)[0]
    assert [o.index for o in first.outputs] == [0, 1, 2]
    assert [list(o.token_ids) for o in first.outputs] == [list(o.token_ids) for o in second.outputs]
    assert len({tuple(o.token_ids) for o in first.outputs}) > 1


def test_stop_strings_and_finish_reasons(tiny):
    llm, _, _ = tiny
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    text = llm.generate("Hello world", greedy, use_tqdm=False)[0].outputs[0].text
    stop = text[3:6]
    at = text.find(stop)  # its first occurrence ends the output
    assert len(stop) == 3
    out = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]),
                       use_tqdm=False)[0].outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (text[:at], "stop", stop)
    assert len(out.token_ids) < 20
    kept = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=stop,
                                                      include_stop_str_in_output=True), use_tqdm=False)
    assert kept[0].outputs[0].text == text[:at + 3]


def _run_engine(engine, request_id: str, prompt: list[int], params: SamplingParams) -> list:
    engine.add_request(request_id, prompt, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.request_id == request_id]
    return outputs


@pytest.mark.parametrize("with_stop", [False, True])
def test_output_kinds_cumulative_delta_and_final_only(tiny, with_stop):
    """CUMULATIVE repeats everything so far, DELTA only what is new (the deltas add up to the
    final output, text held back while it could still become a stop string), FINAL_ONLY one output."""
    llm, _, tokenizer = tiny
    engine, prompt = llm.llm_engine, tokenizer.encode("Hello world")
    sampled = dict(n=2, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True, logprobs=1)
    final = llm.generate([prompt], SamplingParams(**sampled), use_tqdm=False)[0]
    if with_stop:  # a stop string from the middle of the text, so holding back matters
        text = final.outputs[0].text
        sampled["stop"] = text[4:7]
        final = llm.generate([prompt], SamplingParams(**sampled), use_tqdm=False)[0]
    cumulative = _run_engine(engine, "c", prompt, SamplingParams(**sampled, output_kind=RequestOutputKind.CUMULATIVE))
    deltas = _run_engine(engine, "d", prompt, SamplingParams(**sampled, output_kind=RequestOutputKind.DELTA))
    only = _run_engine(engine, "f", prompt, SamplingParams(**sampled, output_kind=RequestOutputKind.FINAL_ONLY))
    assert len(only) == 1 and only[0].finished and len(cumulative) > 2
    assert [o.finished for o in cumulative] == [False] * (len(cumulative) - 1) + [True]
    for i, want in enumerate(final.outputs):
        for got in (cumulative[-1].outputs[i], only[0].outputs[i]):
            assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
        lengths = [len(o.outputs[i].token_ids) for o in cumulative]
        assert lengths == sorted(lengths)
        pieces = [o for out in deltas for o in out.outputs if o.index == i]
        assert "".join(p.text for p in pieces) == want.text
        assert [t for p in pieces for t in p.token_ids] == list(want.token_ids)
        assert [lp for p in pieces for lp in p.logprobs] == want.logprobs
        assert [p.finish_reason for p in pieces] == [None] * (len(pieces) - 1) + [want.finish_reason]
        if with_stop:  # nothing shown could have been the start of the stop string
            shown = ""
            for p in pieces:
                shown += p.text
                assert sampled["stop"] not in shown and want.text.startswith(shown)
    assert engine.scheduler.block_pool.num_used_blocks == 0


def test_logprobs_are_raw_log_softmax(tiny):
    llm, reference, tokenizer = tiny
    ids = tokenizer.encode("Hello world")
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=3),
                       use_tqdm=False)[0].outputs[0]
    tokens = ids + list(out.token_ids)
    with torch.no_grad():
        logp = torch.log_softmax(reference(torch.tensor([tokens])).logits[0].double(), -1)
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        expected = logp[len(ids) - 1 + step]
        assert entry[token].rank == 1  # greedy picks the most likely token
        assert math.isclose(entry[token].logprob, float(expected[token]), abs_tol=1e-4)
        assert len(entry) == 3 and set(entry) == set(expected.topk(3).indices.tolist())
    assert math.isclose(out.cumulative_logprob, sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)),
                        rel_tol=1e-6)


@pytest.mark.parametrize("kv_cache_dtype", ["bfloat16", "float16"])
def test_a_16_bit_kv_cache_holds_twice_the_tokens_at_float32s_logprobs(tiny, tiny_path, kv_cache_dtype):
    """kv_cache_dtype as vLLM's: the same memory holds twice the blocks of a float32 model's cache,
    and the logprobs stay those of transformers' float32 model up to K and V's 16-bit rounding."""
    llm, reference, tokenizer = tiny
    half = LLM(model=str(tiny_path), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=128,
               kv_cache_dtype=kv_cache_dtype)
    assert half.llm_engine.info.num_blocks >= 2 * llm.llm_engine.info.num_blocks - 1
    assert half.collective_rpc(lambda worker: str(worker.runner.kv_dtype)) == [f"torch.{kv_cache_dtype}"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)

    def check(ids, out):
        tokens = ids + list(out.outputs[0].token_ids)
        with torch.no_grad():
            logp = torch.log_softmax(reference(torch.tensor([tokens])).logits[0].double(), -1)
        for step, entry in enumerate(out.outputs[0].logprobs):
            for token, value in entry.items():
                assert math.isclose(value.logprob, float(logp[len(ids) - 1 + step, token]), abs_tol=2e-3)

    prompts = [tokenizer.encode(p) for p in ("Hello world", "Straße " * 12)]
    outs = half.generate(prompts, params, use_tqdm=False)
    for ids, out in zip(prompts, outs):
        check(ids, out)
    # A follow-up reads the first request's 16-bit blocks from the prefix cache.
    follow_up = prompts[1] + list(outs[1].outputs[0].token_ids[:-1]) + [5, 6]
    hits = half.llm_engine.scheduler.prefix_cache_stats["hits"]
    check(follow_up, half.generate([follow_up], params, use_tqdm=False)[0])
    assert half.llm_engine.scheduler.prefix_cache_stats["hits"] - hits == len(follow_up) - 2  # all but [5, 6]


def fp8_kv_reference(reference, kv_scales):
    """transformers' model with each layer's K (after RoPE) and V rounded as an fp8 KV cache holds
    them: x / scale to E4M3, saturated at +-448, times scale (kv_scales: (k, v) per layer)."""
    from transformers.models.llama import modeling_llama

    def fp8(x, scale):
        return (x / torch.full_like(x, scale)).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale

    rope, layer = modeling_llama.apply_rotary_pos_emb, iter([])

    def rounded_rope(q, k, cos, sin, *args, **kwargs):
        q, k = rope(q, k, cos, sin, *args, **kwargs)
        return q, fp8(k, kv_scales[next(layer)][0])

    def forward(ids):
        nonlocal layer
        layer = iter(range(len(kv_scales)))
        hooks = [attn.self_attn.v_proj.register_forward_hook(lambda m, args, out, i=i: fp8(out, kv_scales[i][1]))
                 for i, attn in enumerate(reference.model.layers)]
        modeling_llama.apply_rotary_pos_emb = rounded_rope
        try:
            with torch.no_grad():
                return reference(ids).logits
        finally:
            modeling_llama.apply_rotary_pos_emb = rope
            for hook in hooks:
                hook.remove()
    return forward


def with_kv_scales(src, dst, layers, kv_scales):
    """A copy of checkpoint ``src`` at ``dst`` with per-layer k_scale / v_scale tensors (llm-compressor's names)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    for i in range(layers):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(kv_scales[i][0])
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor([kv_scales[i][1]])
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("from_checkpoint", [False, True])
def test_an_fp8_kv_cache_holds_four_times_the_tokens_at_fp8_rounded_logprobs(tiny, tiny_path, tmp_path,
                                                                          from_checkpoint):
    """kv_cache_dtype="fp8" (vLLM's, E4M3): the same memory holds four times the blocks of a float32
    model's cache, and the logprobs are transformers' float32 model's with K and V rounded to fp8 by
    each layer's scales: 1.0, or the checkpoint's k_scale / v_scale."""
    llm, reference, tokenizer = tiny
    layers = len(reference.model.layers)
    kv_scales = [(0.01 * (i + 1), 0.02 * (i + 2)) for i in range(layers)] if from_checkpoint else [(1.0, 1.0)] * layers
    path = with_kv_scales(tiny_path, tmp_path / "scaled", layers, kv_scales) if from_checkpoint else tiny_path
    fp8 = LLM(model=str(path), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=128,
              kv_cache_dtype="fp8")
    assert fp8.llm_engine.info.num_blocks >= 4 * llm.llm_engine.info.num_blocks - 3
    scales = fp8.collective_rpc(lambda worker: [a.kv_scales for a in worker.model.attention_layers()])[0]
    assert [pytest.approx(s) for s in scales] == kv_scales
    forward = fp8_kv_reference(reference, kv_scales)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = [tokenizer.encode(p) for p in ("Hello world", "Straße " * 12)]
    for ids, out in zip(prompts, fp8.generate(prompts, params, use_tqdm=False)):
        tokens = ids + list(out.outputs[0].token_ids)
        logp = torch.log_softmax(forward(torch.tensor([tokens]))[0].double(), -1)
        for step, entry in enumerate(out.outputs[0].logprobs):
            for token, value in entry.items():  # (without the rounding the reference is ~1e-2 away)
                assert math.isclose(value.logprob, float(logp[len(ids) - 1 + step, token]), abs_tol=1e-4)


def test_a_bad_kv_scale_in_a_checkpoint_is_refused(tiny, tiny_path, tmp_path):
    layers = len(tiny[1].model.layers)
    path = with_kv_scales(tiny_path, tmp_path / "bad", layers, [(1.0, -2.0)] * layers)
    with pytest.raises(ValueError, match=r"'model.layers.0.self_attn.v_scale' must be one positive, finite KV cache "
                                         r"scale, got -2.0"):
        LLM(model=str(path), dtype="float32", kv_cache_memory_bytes=8 << 20, kv_cache_dtype="fp8")


@pytest.mark.parametrize("bad", ["fp8_e5m2", "int8", "float64", None])
def test_an_unknown_kv_cache_dtype_is_refused(tiny_path, bad):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of") as info:
        LLM(model=str(tiny_path), dtype="float32", kv_cache_memory_bytes=8 << 20, kv_cache_dtype=bad)
    assert ("E4M3 is supported" in str(info.value)) == (bad == "fp8_e5m2")


# Everything in one step; chunked prefill; logits made 5 prompt rows at a time.
@pytest.mark.parametrize("budget,logits_rows", [(None, None), (16, None), (None, 5)])
def test_prompt_logprobs_are_raw_log_softmax_of_every_prompt_token(tiny, tiny_path, budget, logits_rows, monkeypatch):
    llm, reference, tokenizer = tiny
    if logits_rows:
        monkeypatch.setattr("octavo.worker.model_runner.PROMPT_LOGITS_ROWS", logits_rows)
    if budget:
        llm = LLM(model=str(tiny_path), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=128,
                  max_num_batched_tokens=budget)
    ids = tokenizer.encode("Hello world, this prompt is long enough to span several blocks of sixteen tokens.")
    assert len(ids) > 2 * 16
    with torch.no_grad():
        logp = torch.log_softmax(reference(torch.tensor([ids])).logits[0].double(), -1)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=2, prompt_logprobs=2, n=2)
    # Prompt logprobs are raw: temperature does not touch them. Twice: the second run would hit the
    # prefix cache, which prompt logprobs must not read.
    for out in llm.generate([ids, ids], params, use_tqdm=False):
        entries = out.prompt_logprobs
        assert len(entries) == len(ids) and entries[0] is None
        for j in range(1, len(ids)):
            expected = logp[j - 1]
            entry = entries[j]
            assert math.isclose(entry[ids[j]].logprob, float(expected[ids[j]]), abs_tol=1e-4)
            assert entry[ids[j]].rank == int((expected >= expected[ids[j]] - 1e-6).sum())
            top = expected.topk(2).indices.tolist()
            assert set(entry) == set(top) | {ids[j]}
            assert [entry[t].rank for t in top] == [1, 2] or ids[j] in top
            assert entry[ids[j]].decoded_token == tokenizer.decode([ids[j]])
    assert llm.llm_engine.scheduler.block_pool.num_used_blocks == 0


def test_n_samples_share_the_prompt_blocks(tiny):
    llm, _, _ = tiny
    engine, block = llm.llm_engine, llm.llm_engine.scheduler.block_pool
    prompt = list(range(5, 5 + 4 * 16 + 6))  # four full blocks and a partial one
    engine.add_request("shared", prompt, SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=3, ignore_eos=True))
    engine.step()  # every sample is prefilled in this first step
    # Unshared, four samples would hold 4 x 5 blocks; shared, the four full blocks are held once
    # (the first sample computes them, the others hit them within the same step) and each sample
    # keeps its own partial block.
    assert block.num_used_blocks == 4 + 4
    while engine.has_unfinished_requests():
        engine.step()
    assert block.num_used_blocks == 0


def test_chat_uses_the_template(tiny):
    llm, _, tokenizer = tiny
    conversation = [{"role": "user", "content": "hi"}]
    out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)[0]
    expected = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=True,
                                             return_dict=False)
    assert out.prompt_token_ids == list(expected)
    assert len(llm.chat([conversation, conversation], use_tqdm=False)) == 2


def test_bad_requests_raise_and_leave_the_engine_clean(tiny):
    llm, _, _ = tiny
    with pytest.raises(ValueError, match="Requested sample logprobs of 21, which is greater than max allowed: 20"):
        llm.generate(["Hello", "World"], [SamplingParams(), SamplingParams(logprobs=21)], use_tqdm=False)
    with pytest.raises(ValueError, match="Requested prompt logprobs of"):
        llm.generate("Hello", SamplingParams(prompt_logprobs=-1), use_tqdm=False)
    with pytest.raises(ValueError, match="out of vocabulary"):
        llm.generate("Hello", SamplingParams(stop_token_ids=[2**31]), use_tqdm=False)
    with pytest.raises(ValueError, match="Token id 100000 is out of vocabulary"):
        llm.generate([[1, 100000]], use_tqdm=False)
    with pytest.raises(ValueError, match="The decoder prompt cannot be empty"):
        llm.generate([[]], use_tqdm=False)
    with pytest.raises(ValueError, match="min_tokens"):
        llm.generate("Hello", SamplingParams(min_tokens=2**31, max_tokens=None), use_tqdm=False)
    with pytest.raises(ValueError, match="Priority scheduling is not enabled"):
        llm.generate("Hello", use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="seed must be in"):
        SamplingParams(seed=2**63)
    with pytest.raises(ValueError, match="best_of is not supported"):
        SamplingParams(n=1, best_of=2)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match=r"token_id\(s\) \[100000\] in logit_bias contain out-of-vocab"):
        llm.generate("Hello", SamplingParams(logit_bias={1: 2.0, 100000: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids contains out-of-vocab token id!"):
        llm.generate("Hello", SamplingParams(allowed_token_ids=[1, 100000]), use_tqdm=False)
    with pytest.raises(TypeError, match="prompt"):
        llm.generate([3.5], use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.scheduler.block_pool.num_used_blocks == 0


def test_output_that_would_pass_max_model_len_ends_there(tiny):
    """As vLLM's offline LLM: max_tokens beyond what max_model_len leaves is capped ("length")."""
    llm, _, _ = tiny
    out = llm.generate("Hello", SamplingParams(max_tokens=500, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert len(out.prompt_token_ids) + len(out.outputs[0].token_ids) == 128
    assert out.outputs[0].finish_reason == "length"


def test_detokenize_false_returns_token_ids_only(tiny):
    llm, _, _ = tiny
    greedy = dict(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    plain = llm.generate("Hello", SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    raw = llm.generate("Hello", SamplingParams(**greedy, detokenize=False), use_tqdm=False)[0].outputs[0]
    assert raw.token_ids == plain.token_ids and plain.text and raw.text == ""
    assert all(lp.decoded_token is None for entry in raw.logprobs for lp in entry.values())
    assert [{t: lp.logprob for t, lp in e.items()} for e in raw.logprobs] == \
        [{t: lp.logprob for t, lp in e.items()} for e in plain.logprobs]


def test_priority_orders_the_requests(tiny_path):
    llm = LLM(model=str(tiny_path), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=128,
              max_num_seqs=1, scheduling_policy="priority")
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outputs = llm.generate(["a", "b", "c"], params, use_tqdm=False, priority=[2, 0, 1])
    order = sorted(range(3), key=lambda i: outputs[i].metrics.first_token_time)
    assert order == [1, 2, 0]


def test_logprobs_minus_one_is_the_whole_vocabulary(tiny_path):
    llm = LLM(model=str(tiny_path), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=128,
              max_logprobs=-1)
    out = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=2, logprobs=-1), use_tqdm=False)[0]
    vocab = llm.llm_engine.model_config.vocab_size
    assert all(len(entry) == vocab for entry in out.outputs[0].logprobs)


def test_generation_config_sets_defaults_and_eos_ids(tiny, tiny_path, tmp_path):
    """generate() without SamplingParams samples with the generation config's defaults ("auto":
    the model's, "vllm": none, a folder: its file), and the model's EOS ids end the output."""
    llm, _, _ = tiny
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first_token = llm.generate("Hello", greedy, use_tqdm=False)[0].outputs[0].token_ids[0]
    model = tmp_path / "model"
    shutil.copytree(tiny_path, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [first_token],
                                                              "temperature": 0.0, "max_new_tokens": 50}))
    settings = tmp_path / "settings"
    settings.mkdir()
    (settings / "generation_config.json").write_text(json.dumps({"temperature": 0.7, "max_new_tokens": 3}))

    def make(option):
        return LLM(model=str(model), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=128,
                   generation_config=option)

    auto = make("auto")
    defaults = auto.get_default_sampling_params()
    assert (defaults.temperature, defaults.max_tokens) == (0.0, 50)
    out = auto.generate("Hello", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [first_token]
    assert (out.finish_reason, out.stop_reason) == ("stop", first_token)
    assert make("vllm").get_default_sampling_params().temperature == 1.0
    from_folder = make(str(settings))
    assert from_folder.get_default_sampling_params().temperature == 0.7
    assert len(from_folder.generate("Hello", use_tqdm=False)[0].outputs[0].token_ids) <= 3
    with pytest.raises(ValueError, match="generation_config"):
        make(str(tmp_path / "nowhere"))


def test_cli_generate_streams_the_greedy_text(tiny, tiny_path, capsys):
    llm, _, _ = tiny
    expected = llm.generate("Hello world", SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    code = main(["generate", "--model", str(tiny_path), "--dtype", "float32", "--max-tokens", "6",
                 "--kv-cache-memory-bytes", str(8 << 20), "Hello world"])
    assert code == 0
    assert capsys.readouterr().out.endswith(expected[0].outputs[0].text + "\n")


def test_skip_tokenizer_init_takes_token_ids_and_returns_no_text(tiny_path, tiny):
    llm = LLM(model=str(tiny_path), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=128,
              skip_tokenizer_init=True)
    assert llm.get_tokenizer() is None
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    reference = tiny[0].generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                                 use_tqdm=False)[0]
    assert out.outputs[0].token_ids == reference.outputs[0].token_ids and out.outputs[0].text == ""
    with pytest.raises(ValueError, match="needs a tokenizer; this LLM was made with skip_tokenizer_init=True"):
        llm.generate("text", use_tqdm=False)
