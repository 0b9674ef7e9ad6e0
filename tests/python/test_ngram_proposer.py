"""octavo._C.propose_ngram (prompt lookup, the ngram speculative proposer) against a Python
reading of vLLM's rule, over random token histories (hypothesis), and its argument checks."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from octavo import _C


def reference(tokens, min_n, max_n, k, max_model_len=0):
    """The longest suffix n-gram (min_n <= n <= max_n) seen earlier; its earliest place."""
    room = k if max_model_len == 0 else min(k, max_model_len - len(tokens))
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for p in range(len(tokens) - n):
            if tokens[p:p + n] == suffix:
                return tokens[p + n:p + n + room] if room > 0 else []
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 5), max_size=60), min_n=st.integers(1, 4), extra=st.integers(0, 4),
       k=st.integers(1, 8), max_model_len=st.integers(0, 80))
def test_matches_the_rule(tokens, min_n, extra, k, max_model_len):
    expected = reference(tokens, min_n, min_n + extra, k, max_model_len)
    assert _C.propose_ngram(tokens, min_n, min_n + extra, k, max_model_len) == expected


def test_a_repeated_passage_is_proposed():
    passage = list(range(100, 120))
    history = passage + [7, 8] + passage[:5]
    assert _C.propose_ngram(history, 2, 4, 5) == passage[5:10]


@pytest.mark.parametrize("args, message", [((0, 3, 5), "prompt_lookup_min"), ((3, 2, 5), "prompt_lookup_max"),
                                           ((1, 3, 0), "num_speculative_tokens")])
def test_bad_arguments(args, message):
    with pytest.raises(ValueError, match=message):
        _C.propose_ngram([1, 2, 3], *args)
