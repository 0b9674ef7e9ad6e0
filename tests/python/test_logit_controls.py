"""logit_bias, allowed_token_ids and bad_words end to end (LLM.generate on a tiny random Llama with
a real byte-level BPE tokenizer): each steers only its own request, logprobs stay those of the raw
logits (vLLM's default), and no KV block is left in use."""
import pytest

from octavo import LLM, SamplingParams

GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_path):
    return LLM(model=str(tiny_path), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=128)


def tokens(llm, prompt, **params):
    return list(llm.generate(prompt, SamplingParams(**{**GREEDY, **params}), use_tqdm=False)[0].outputs[0].token_ids)


def test_logit_bias_forces_and_forbids_tokens(llm):
    plain = tokens(llm, "Hello there")
    forced = plain[0] + 1
    assert tokens(llm, "Hello there", logit_bias={forced: 100.0}) == [forced] * 12
    avoided = tokens(llm, "Hello there", logit_bias={t: -100.0 for t in set(plain)})
    assert not set(avoided) & set(plain)


def test_allowed_token_ids_keep_to_their_list_with_their_biases(llm):
    plain = tokens(llm, "Once upon", temperature=1.0, seed=3, max_tokens=30)
    allowed = sorted(set(range(40, 50)) - set(plain[:1]))
    out = tokens(llm, "Once upon", temperature=1.0, seed=3, max_tokens=30, allowed_token_ids=allowed)
    assert set(out) <= set(allowed)
    # logit_bias on a token outside the list does not let it in; on one inside, it steers.
    assert tokens(llm, "Once upon", allowed_token_ids=[41, 42], logit_bias={7: 100.0, 42: 100.0}) == [42] * 12


def test_bad_words_never_appear_in_the_output(llm):
    plain = tokens(llm, "The cat sat", max_tokens=16)
    text = llm.get_tokenizer().decode(plain[2:4])
    out = llm.generate("The cat sat", SamplingParams(**{**GREEDY, "max_tokens": 16}, bad_words=[text]),
                       use_tqdm=False)[0].outputs[0]
    words = llm.llm_engine.check_request([1], SamplingParams(bad_words=[text])).bad_words_token_ids
    assert words and out.token_ids != plain
    ids = list(out.token_ids)
    for word in words:
        assert all(ids[i:i + len(word)] != word for i in range(len(ids))), (word, ids)


def test_controls_steer_only_their_own_request_in_a_batch(llm):
    prompts = ["Hello there", "The cat sat", "Once upon"]
    alone = [tokens(llm, p) for p in prompts]
    steered = SamplingParams(**GREEDY, logit_bias={alone[1][0] + 1: 100.0}, allowed_token_ids=[alone[1][0] + 1, 9])
    outs = llm.generate(prompts, [SamplingParams(**GREEDY), steered, SamplingParams(**GREEDY, bad_words=["zq"])],
                        use_tqdm=False)
    assert list(outs[0].outputs[0].token_ids) == alone[0]
    assert list(outs[1].outputs[0].token_ids) == [alone[1][0] + 1] * 12
    assert llm.llm_engine.scheduler.block_pool.num_used_blocks == 0


def test_logprobs_are_of_the_raw_logits(llm):
    """The forced token's logprob is what the unbiased run gives that token at the same place."""
    plain = llm.generate("Hello there", SamplingParams(**GREEDY, logprobs=5), use_tqdm=False)[0].outputs[0]
    forced = next(t for t in plain.logprobs[0] if t != plain.token_ids[0])
    biased = llm.generate("Hello there", SamplingParams(**GREEDY, logprobs=0, logit_bias={forced: 100.0}),
                          use_tqdm=False)[0].outputs[0]
    assert biased.token_ids[0] == forced
    assert biased.logprobs[0][forced].logprob == pytest.approx(plain.logprobs[0][forced].logprob, abs=1e-5)


def test_out_of_vocabulary_ids_are_refused_and_lose_nothing(llm):
    vocab = llm.llm_engine.model_config.vocab_size
    with pytest.raises(ValueError, match=f"Vocabulary size: {vocab}"):
        llm.generate("Hi", SamplingParams(logit_bias={vocab: 1.0}), use_tqdm=False)
    with pytest.raises(ValueError, match="allowed_token_ids contains out-of-vocab token id!"):
        llm.generate("Hi", SamplingParams(allowed_token_ids=[vocab]), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.scheduler.block_pool.num_used_blocks == 0
