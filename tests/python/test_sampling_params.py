"""SamplingParams: vLLM's fields, defaults, validation messages and normalization."""

import logging

import pytest

from octavo.sampling_params import RequestOutputKind, SamplingParams, SamplingType

# vLLM's defaults (vllm/sampling_params.py).
VLLM_DEFAULTS = dict(
    n=1, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, temperature=1.0,
    top_p=1.0, top_k=0, min_p=0.0, seed=None, stop=[], stop_token_ids=[], ignore_eos=False,
    max_tokens=16, min_tokens=0, logprobs=None, prompt_logprobs=None, detokenize=True,
    skip_special_tokens=True, spaces_between_special_tokens=True, include_stop_str_in_output=False,
    output_kind=RequestOutputKind.CUMULATIVE, logit_bias=None,
)


def test_defaults_match_vllm():
    params = SamplingParams()
    for name, value in VLLM_DEFAULTS.items():
        assert getattr(params, name) == value, name
    assert params.sampling_type == SamplingType.RANDOM
    assert params.output_text_buffer_length == 0


def test_positional_order_matches_vllm():
    params = SamplingParams(2, 0.1, 0.2, 1.1, 0.7, 0.9, 40, 0.05, 7)
    assert (params.n, params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
            params.temperature, params.top_p, params.top_k, params.min_p, params.seed) == \
        (2, 0.1, 0.2, 1.1, 0.7, 0.9, 40, 0.05, 7)


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "n must be at least 1, got 0."),
    (dict(n=1.5), "n must be an int"),
    (dict(presence_penalty=2.5), r"presence_penalty must be in \[-2, 2\], got 2.5."),
    (dict(presence_penalty=-2.1), r"presence_penalty must be in \[-2, 2\]"),
    (dict(frequency_penalty=-3), r"frequency_penalty must be in \[-2, 2\], got -3."),
    (dict(repetition_penalty=0.0), "repetition_penalty must be greater than zero, got 0.0."),
    (dict(repetition_penalty=float("inf")), "repetition_penalty must be a finite number"),
    (dict(temperature=-0.5), "temperature must be non-negative, got -0.5."),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature="hot"), "temperature must be a number"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\], got 0.0."),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\], got 1.5."),
    (dict(top_k=-2), r"top_k must be 0 \(disable\), or at least 1, got -2."),
    (dict(top_k=2.5), "top_k must be an integer, got float"),
    (dict(min_p=-0.1), r"min_p must be in \[0, 1\], got -0.1."),
    (dict(min_p=1.1), r"min_p must be in \[0, 1\], got 1.1."),
    (dict(seed=1.5), "seed must be an int or None"),
    (dict(seed="42"), "seed must be an int or None"),
    (dict(max_tokens=0), "max_tokens must be at least 1, got 0."),
    (dict(max_tokens=2.0), "max_tokens must be an int or None"),
    (dict(min_tokens=-1), "min_tokens must be greater than or equal to 0, got -1."),
    (dict(max_tokens=4, min_tokens=5), "min_tokens must be less than or equal to max_tokens=4, got 5."),
    (dict(logprobs=-2), "logprobs must be non-negative or -1, got -2."),
    (dict(prompt_logprobs=-5), "prompt_logprobs must be non-negative or -1, got -5."),
    (dict(stop=5), "stop must be a string or a list of strings"),
    (dict(stop=["ok", 3]), "stop must be a string or a list of strings"),
    (dict(stop=["ok", ""]), "stop cannot contain an empty string."),
    (dict(stop=["ok", "a\ud800"]), r"a stop string must be a string of valid Unicode, got 'a\\ud800'\."),
    (dict(stop="x", detokenize=False), "stop strings are only supported when detokenize is True"),
    (dict(stop_token_ids=[1, "2"]), "stop_token_ids must contain only integers"),
    (dict(stop_token_ids=7), "stop_token_ids must be a list of integers"),
    (dict(temperature=0.0, n=2), "n must be 1 when using greedy sampling, got 2."),
    (dict(logit_bias={"a": 1.0}), "logit_bias contains key"),
    (dict(logit_bias={1: "x"}), "logit_bias values must be numbers"),
    (dict(logit_bias=[1.0]), "logit_bias must be a dict"),
    (dict(allowed_token_ids=[]), "allowed_token_ids is not None and empty!"),
    (dict(allowed_token_ids=[3, -1]), "allowed_token_ids contains out-of-vocab token id!"),
    (dict(allowed_token_ids=[3, 1.5]), "allowed_token_ids must be a list of integers"),
    (dict(allowed_token_ids=5), "allowed_token_ids must be a list of integers"),
    (dict(bad_words="word"), "bad_words must be a list of strings"),
    (dict(bad_words=["ok", 3]), "bad_words must be a list of strings"),
    (dict(bad_words=["ok", " "]), "bad_words cannot contain an empty string"),
    (dict(bad_words=["w"] * 1025), "bad_words holds 1025 words, more than the 1024 allowed"),
    (dict(output_kind=1), "output_kind must be a RequestOutputKind"),
])
def test_invalid_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs", [
    dict(top_k=-1), dict(top_k=0), dict(top_k=1), dict(top_p=1.0), dict(min_p=1.0),
    dict(presence_penalty=-2.0, frequency_penalty=2.0), dict(max_tokens=None), dict(logprobs=-1),
    dict(logprobs=0), dict(prompt_logprobs=-1), dict(min_tokens=16, max_tokens=16), dict(seed=0),
    dict(temperature=2.0), dict(temperature=0.0, n=1),
])
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_normalization():
    params = SamplingParams(stop="###", stop_token_ids=(5, 3, 5), seed=-1, logprobs=True,
                            prompt_logprobs=True)
    assert params.stop == ["###"]
    assert params.stop_token_ids == [5, 3]  # deduplicated, order kept
    assert params.seed is None
    assert params.logprobs == 1 and params.prompt_logprobs == 1
    assert params.all_stop_token_ids == {3, 5}
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    # A top_k past any vocabulary keeps every token: held at int32's largest, so that it still
    # crosses to the engine core's process (found by test_field_limits with top_k = 2**64).
    for top_k in (2**31 - 1, 2**31, 2**64, 10**30):
        assert SamplingParams(temperature=1.0, top_k=top_k).top_k == 2**31 - 1
    assert SamplingParams(temperature=1.0, top_k=49152).top_k == 49152


def test_greedy_resets_truncation_like_vllm():
    params = SamplingParams(temperature=0.0, top_p=0.5, top_k=10, min_p=0.2)
    assert (params.top_p, params.top_k, params.min_p) == (1.0, 0, 0.0)
    assert params.sampling_type == SamplingType.GREEDY


def test_tiny_temperature_is_raised_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, logger="octavo.sampling_params"):
        params = SamplingParams(temperature=1e-4)
    assert params.temperature == 0.01
    assert "temperature" in caplog.text
    assert params.sampling_type == SamplingType.RANDOM


def test_sampling_type_seeded():
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(seed=3, temperature=0).sampling_type == SamplingType.GREEDY


def test_stop_buffer_length():
    assert SamplingParams(stop=["a", "abcd"]).output_text_buffer_length == 3
    assert SamplingParams(stop=["abcd"], include_stop_str_in_output=True).output_text_buffer_length == 0


def test_logit_bias_keys_and_clamping():
    params = SamplingParams(logit_bias={"5": 3.0, 7: -500, 9: 250.5})
    assert params.logit_bias == {5: 3.0, 7: -100.0, 9: 100.0}


def test_bad_words_tokenize_with_and_without_a_leading_space():
    """vLLM's rule: the spaced form is kept where it is another sequence of the same length."""
    class Words:  # a tokenizer of whole words, where " cat" is its own token
        ids = {"cat": [10], " cat": [11], "big dog": [12, 13], " big dog": [14, 13], "x y": [15, 16], " x y": [17]}

        def encode(self, text, add_special_tokens=False):
            return self.ids[text]

    params = SamplingParams(bad_words=["cat", "  big dog", "x y"])
    params.update_from_tokenizer(Words())
    assert params.bad_words_token_ids == [[10], [11], [12, 13], [14, 13], [15, 16]]


def test_clone_is_deep():
    params = SamplingParams(stop=["x"], stop_token_ids=[1], logit_bias={1: 1.0})
    copy = params.clone()
    assert copy == params and copy is not params
    copy.stop.append("y")
    copy.stop_token_ids.append(2)
    copy.logit_bias[2] = 2.0
    assert params.stop == ["x"] and params.stop_token_ids == [1] and params.logit_bias == {1: 1.0}


def test_update_from_generation_config():
    params = SamplingParams(stop_token_ids=[9])
    params.update_from_generation_config({"eos_token_id": [2, 7]}, eos_token_id=2)
    assert params.eos_token_id == 2
    assert params.stop_token_ids == [9, 7]
    assert params.all_stop_token_ids == {2, 7, 9}

    ignoring = SamplingParams(ignore_eos=True)
    ignoring.update_from_generation_config({"eos_token_id": 7}, eos_token_id=2)
    assert ignoring.eos_token_id is None
    assert ignoring.stop_token_ids == []
    assert ignoring.all_stop_token_ids == {2, 7}  # min_tokens still suppresses them


def test_repr_lists_the_main_fields():
    text = repr(SamplingParams(temperature=0.5, stop="END"))
    assert text.startswith("SamplingParams(n=1, ")
    for piece in ("temperature=0.5", "stop=['END']", "max_tokens=16", "top_k=0"):
        assert piece in text


# ---- the output types returned next to SamplingParams (octavo.outputs) ----

from octavo.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput  # noqa: E402


def test_logprob_fields_match_vllm():
    assert Logprob(-0.5) == Logprob(logprob=-0.5, rank=None, decoded_token=None)
    assert Logprob(-1.0, 2, "a").decoded_token == "a"


def test_completion_output_finished_and_repr():
    out = CompletionOutput(index=0, text="hi", token_ids=[1, 2], cumulative_logprob=None, logprobs=None)
    assert not out.finished() and out.stop_reason is None
    out.finish_reason, out.stop_reason = "stop", "###"
    assert out.finished()
    assert repr(out) == ("CompletionOutput(index=0, text='hi', token_ids=[1, 2], cumulative_logprob=None, "
                         "logprobs=None, finish_reason=stop, stop_reason=###)")


def test_request_output_add_merges_deltas_and_replaces_cumulative():
    metrics = RequestMetrics(arrival_time=1.0, last_token_time=1.0, first_scheduled_time=None,
                             first_token_time=None, time_in_queue=None)
    first = RequestOutput("r", "p", [5], None, [CompletionOutput(0, "a", [1], -0.1, [{1: Logprob(-0.1)}])],
                          False, metrics=metrics)
    delta = RequestOutput("r", "p", [5], None, [CompletionOutput(0, "b", [2], -0.3, [{2: Logprob(-0.2)}], "length"),
                                                CompletionOutput(1, "z", [9], None, None)], True)
    first.add(delta, aggregate=True)
    merged = first.outputs[0]
    assert (merged.text, list(merged.token_ids), merged.cumulative_logprob, merged.finish_reason) == \
        ("ab", [1, 2], -0.3, "length")
    assert len(merged.logprobs) == 2 and first.finished and [o.index for o in first.outputs] == [0, 1]

    cumulative = RequestOutput("r", "p", [5], None, [CompletionOutput(0, "abc", [1, 2, 3], None, None)], True)
    first.add(cumulative, aggregate=False)
    assert first.outputs[0].text == "abc"
    assert "RequestOutput(request_id=r, prompt='p', prompt_token_ids=[5]" in repr(first)
    assert metrics.finished_time is None and metrics.model_execute_time is None
