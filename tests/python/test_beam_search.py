"""Beam search: LLM.beam_search against transformers' num_beams on a tiny random Llama, the
search's rules on hand-made logprobs (EOS completes a beam, length_penalty ranks, the stop
token's text), beams sharing their KV blocks through the prefix cache, and the server's
use_beam_search."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from octavo import LLM, BeamSearchParams
from octavo.beam_search import BeamSearch, beam_score
from octavo.outputs import Logprob


@pytest.fixture(scope="module")
def llm(tiny_path):
    return LLM(model=str(tiny_path), dtype="float32", kv_cache_memory_bytes=16 << 20, max_model_len=128)


@pytest.mark.parametrize("width", [1, 2, 4])
def test_matches_transformers_num_beams(llm, tiny_path, width):
    tokenizer = llm.get_tokenizer()
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32).eval()
    prompts = [tokenizer.encode(p) for p in ("Hello world", "abc", "The cat sat on")]
    outs = llm.beam_search([{"prompt_token_ids": ids} for ids in prompts],
                           BeamSearchParams(beam_width=width, max_tokens=8, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            hf = model.generate(torch.tensor([ids]), num_beams=width, num_return_sequences=width, max_new_tokens=8,
                                do_sample=False, early_stopping=False, length_penalty=1.0, eos_token_id=None,
                                pad_token_id=0, output_scores=True, return_dict_in_generate=True)
        assert [b.tokens[len(ids):] for b in out.sequences] == [s[len(ids):].tolist() for s in hf.sequences]
        for beam in out.sequences:
            assert beam.text == tokenizer.decode(beam.tokens[len(ids):])
        if width > 1:  # (one beam is greedy search there, without scores) a logprob per generated token
            for beam, score in zip(out.sequences, hf.sequences_scores.tolist()):
                assert math.isclose(beam.cum_logprob / 8, score, rel_tol=1e-4)


def test_beams_compute_only_their_new_token(llm):
    """Each beam's request after the first step finds all but its last token in the cache: the
    full blocks shared, the partial last block copied from its parent's (copy on write)."""
    scheduler = llm.llm_engine.scheduler
    prompt = llm.get_tokenizer().encode("a prompt no other test uses, long enough for a block or two: zq")
    before = dict(scheduler.prefix_cache_stats)
    llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True))
    stats = {k: scheduler.prefix_cache_stats[k] - before[k] for k in before}
    # Every request computes its last token; the first (the prompt alone) computes it all.
    assert stats["hits"] == stats["queries"] - stats["requests"] - (len(prompt) - 1)
    assert scheduler.block_pool.num_used_blocks == 0


def entry(*pairs: tuple[int, float]) -> dict[int, Logprob]:
    return {t: Logprob(lp, rank, None) for rank, (t, lp) in enumerate(pairs, 1)}


def test_eos_completes_a_beam_and_length_penalty_ranks():
    eos = 9
    search = BeamSearch([1, 2], BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=1.0), eos)
    search.advance([entry((eos, -0.1), (5, -0.5), (6, -3.0))])
    assert [b.tokens for b in search.complete] == [[1, 2, eos]] and [b.tokens for b in search.live] == [[1, 2, 5]]
    search.advance([entry((7, -0.2), (8, -0.3))])
    search.advance([entry((4, -0.1), (3, -0.2)), entry((4, -0.4), (3, -0.5))])
    assert search.done
    out = search.output(None).sequences
    # Lengths count the prompt, not a final EOS: -0.1 / 2 = -0.05 beats -0.8 / 5 = -0.16.
    assert [b.tokens for b in out] == [[1, 2, eos], [1, 2, 5, 7, 4]]
    assert out[0].finish_reason == "stop" and out[1].finish_reason == "length"
    assert math.isclose(beam_score(out[1], eos, 1.0), (-0.5 - 0.2 - 0.1) / 5)
    # A larger length_penalty favours the long beam: -0.8 / 5**3 beats -0.1 / 2**3.
    longer = BeamSearch([1, 2], BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=3.0), eos)
    longer.complete, longer.live = search.complete, search.live
    assert [b.tokens for b in longer.output(None).sequences][0] == [1, 2, 5, 7, 4]


def test_stop_token_text_and_params(llm):
    tokenizer = llm.get_tokenizer()
    eos = tokenizer.eos_token_id
    for include in (False, True):
        search = BeamSearch([5], BeamSearchParams(beam_width=1, max_tokens=2, include_stop_str_in_output=include),
                            eos)
        search.advance([entry((40, -0.1))])
        search.advance([entry((eos, -0.1))])
        beam = search.output(tokenizer).sequences[0]
        assert beam.text == tokenizer.decode([40, eos] if include else [40], skip_special_tokens=True)
    with pytest.raises(ValueError, match="beam_width must be a positive integer"):
        BeamSearchParams(beam_width=0, max_tokens=4)
    with pytest.raises(ValueError, match="pass max_model_len"):
        llm.beam_search(["x"], BeamSearchParams(beam_width=2, max_tokens=500))


def test_use_beam_search_on_the_server(llm, tiny_path, tmp_path):
    pytest.importorskip("openai")
    import httpx
    from live_server import LiveServer

    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("Hello world")
    expected = llm.beam_search([{"prompt_token_ids": ids}], BeamSearchParams(beam_width=3, max_tokens=6,
                                                                              ignore_eos=True))[0]
    server = LiveServer(str(tiny_path), "--max-model-len", "128", log=tmp_path / "serve.log")
    try:
        for stream in (False, True):
            r = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
                "prompt": ids, "max_tokens": 6, "n": 3, "use_beam_search": True, "ignore_eos": True,
                "return_token_ids": True, "stream": stream})
            assert r.status_code == 200, r.text
            if stream:
                import json

                chunks = [json.loads(line[6:]) for line in r.text.splitlines()
                          if line.startswith("data: {")]
                choices = sorted((c for chunk in chunks for c in chunk["choices"]), key=lambda c: c["index"])
            else:
                choices = r.json()["choices"]
            assert [c["token_ids"] for c in choices] == [b.tokens[len(ids):] for b in expected.sequences]
    finally:
        server.stop_cleanly()
