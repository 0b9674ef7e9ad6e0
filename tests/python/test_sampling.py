"""_C.ops.sample against float64 torch references, on every CPU ISA this machine runs.

Random draws are made in one call by repeating a row with different counters; every draw is a
pure function of (seed, counter, logits, parameters), so these statistical tests are
deterministic and cannot flake.
"""
import pytest
import torch

from octavo import _C

I32, I64, F32 = torch.int32, torch.int64, torch.float32


# Every test runs once per CPU kernel level (the `isa` fixture in conftest.py).
pytestmark = pytest.mark.usefixtures("isa")


def per_row(value, n, dtype):
    return torch.as_tensor(value, dtype=dtype).expand(n).contiguous()


def csr(lists):
    """Token lists -> (offsets [B + 1], ids [N]) as int32."""
    offsets = torch.tensor([0] + [len(x) for x in lists], dtype=I64).cumsum(0).to(I32)
    ids = torch.tensor([t for x in lists for t in x], dtype=I32)
    return offsets, ids


# Where the kernel runs: test_cuda_sampling.py sets "cuda" to run these tests on the CUDA kernel.
DEVICE = "cpu"


def sample(logits, temperature=1.0, *, seed=0, counters=None, num_top=0, logprobs=False,
           prompt=None, output=None, banned=None, biases=None, only_listed=None, drafts=None, **params):
    """Runs the kernel on DEVICE; scalars broadcast over rows. ``banned`` (token lists) and
    ``biases`` ({token: value} per row) become the bias lists, ``only_listed`` a flag per row;
    ``drafts`` (a token or -1 per row) runs rejection_sample. Returns sampled, or a dict with
    logprobs or accepted (on the CPU)."""
    b = logits.shape[0]
    kw = {}
    for name, value in params.items():
        kw[name] = per_row(value, b, I32 if name == "top_k" else F32)
    for name, lists in (("prompt", prompt), ("output", output)):
        if lists is not None:
            kw[f"{name}_offsets"], kw[f"{name}_token_ids"] = csr(lists)
    if banned is not None or biases is not None or only_listed is not None:
        entries = [{**dict.fromkeys((banned or [[]] * b)[r], float("-inf")), **(biases or [{}] * b)[r]}
                   for r in range(b)]
        kw["bias_offsets"], kw["bias_token_ids"] = csr([list(e) for e in entries])
        kw["bias_values"] = torch.tensor([v for e in entries for v in e.values()], dtype=F32)
        kw["only_listed"] = per_row(only_listed or 0, b, I32)
    if counters is None:
        counters = torch.zeros(b, dtype=I64)
    out = {"sampled": torch.empty(b, dtype=I32)}
    if logprobs:
        out["sampled_logprobs"] = torch.empty(b, dtype=F32)
        out["sampled_ranks"] = torch.empty(b, dtype=I32)
    if num_top:
        out["top_token_ids"] = torch.empty(b, num_top, dtype=I32)
        out["top_logprobs"] = torch.empty(b, num_top, dtype=F32)
    if drafts is not None:
        out["accepted"] = torch.empty(b, dtype=I32)
    out = {k: v.to(DEVICE) for k, v in out.items()}
    kw = {k: v.to(DEVICE) for k, v in kw.items()}
    kw.update((k, v) for k, v in out.items() if k not in ("sampled", "accepted"))
    args = (logits.to(DEVICE), per_row(temperature, b, F32).to(DEVICE), per_row(seed, b, I64).to(DEVICE),
            torch.as_tensor(counters, dtype=I64).to(DEVICE), out["sampled"])
    if drafts is None:
        _C.ops.sample(*args, **kw)
    else:
        _C.ops.rejection_sample(*args, torch.as_tensor(drafts, dtype=I32).to(DEVICE), out["accepted"], **kw)
    out = {k: v.cpu() for k, v in out.items()}
    return out if len(out) > 1 else out["sampled"]


def draws(row, n, **params):
    """n draws from one row (counters 0..n-1), as token ids [n]."""
    return sample(row.repeat(n, 1), counters=torch.arange(n), **params).long()


def penalized(logits, prompt=(), output=(), repetition=1.0, frequency=0.0, presence=0.0, banned=(), biases=None,
              only_listed=False):
    """vLLM v1's biases, bans and penalties on one row, in float64 (the biases added in float32,
    as the kernels add them)."""
    x = torch.full_like(logits, float("-inf"), dtype=torch.float64) if only_listed else logits.double().clone()
    for t, v in (biases or {}).items():
        x[t] = (logits[t] + torch.tensor(v, dtype=F32)).double()
    x[list(banned)] = float("-inf")
    seen = torch.zeros_like(x, dtype=torch.bool)
    seen[list(prompt) + list(output)] = True
    x[seen] = torch.where(x[seen] > 0, x[seen] / repetition, x[seen] * repetition)
    counts = torch.bincount(torch.tensor(list(output), dtype=I64), minlength=x.numel()).double()
    return x - frequency * counts - presence * (counts > 0).double()


def allowed(row, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, slack=1e-5):
    """float64 reference of the kept set and its renormalized probabilities: min_p, top_k, top_p
    in vLLM's order. `slack` widens the top_p cut to absorb float32 rounding at the boundary."""
    p = torch.softmax(row.double() / temperature, 0)
    keep = p >= min_p * p.max() * (1 - slack)
    order = torch.sort(-p, stable=True).indices  # likeliest first, lower id on ties
    order = order[keep[order]]
    if 0 < top_k < p.numel():
        order = order[:top_k]
    q = p[order]
    order = order[q.cumsum(0) - q < top_p * q.sum() * (1 + slack)]
    probs = torch.zeros_like(p)
    probs[order] = p[order] / p[order].sum()
    return set(order.tolist()), probs


def total_variation(tokens, probs):
    freq = torch.bincount(tokens, minlength=probs.numel()).double() / tokens.numel()
    return 0.5 * (freq - probs).abs().sum().item()


# ---------------------------------------------------------------------------------------------
# Greedy and penalties


@pytest.mark.parametrize("vocab", [1, 7, 1000, 4099])
def test_greedy_is_argmax(vocab):
    torch.manual_seed(vocab)
    wide = torch.randn(9, vocab + 5)
    logits = wide[:, :vocab]  # a row stride that is not the vocabulary size
    temperature = torch.tensor([0, 1e-6, 0, 0, 0, 0, 0, 0, 9e-6])
    assert torch.equal(sample(logits, temperature).long(), logits.argmax(1))


def test_greedy_ties_take_lowest_id():
    logits = torch.zeros(3, 300)
    logits[0, [7, 250]] = 2.0
    logits[1, [0, 299]] = 1.0
    logits[2] = float("-inf")  # everything masked: a valid token all the same
    assert sample(logits, 0.0).tolist() == [7, 0, 0]


def test_greedy_with_penalties_matches_reference():
    torch.manual_seed(1)
    b, vocab = 24, 3000
    logits = torch.randn(b, vocab) * 3
    # Penalize the likeliest tokens so the penalties decide the argmax.
    top = logits.topk(40, dim=1).indices
    prompt = [top[r, torch.randperm(40)[:10]].tolist() + [r] for r in range(b)]
    output = [top[r, torch.randint(0, 40, (12,))].tolist() for r in range(b)]
    banned = [top[r, :2].tolist() if r % 3 == 0 else [] for r in range(b)]
    rep = torch.rand(b) + 0.5
    freq, pres = torch.rand(b) - 0.2, torch.rand(b) - 0.2
    got = sample(logits, 0.0, prompt=prompt, output=output, banned=banned, repetition_penalty=rep,
                 frequency_penalty=freq, presence_penalty=pres)
    for r in range(b):
        ref = penalized(logits[r], prompt[r], output[r], rep[r].item(), freq[r].item(), pres[r].item(), banned[r])
        assert ref[got[r]] >= ref.max() - 1e-5, f"row {r}"


def test_penalties_move_the_argmax():
    row = torch.tensor([[2.0, 1.5, 0.5, -1.0, -0.2]])
    assert sample(row, 0.0).item() == 0
    # repetition: 2.0 / 2 = 1.0 < 1.5
    assert sample(row, 0.0, prompt=[[0]], repetition_penalty=2.0).item() == 1
    # negative logits are multiplied: -0.2 * 10 = -2 falls below -1.0
    neg = torch.tensor([[-1.0, -0.2, -3.0]])
    assert sample(neg, 0.0, output=[[1]], repetition_penalty=10.0).item() == 0
    # frequency counts every occurrence: 2.0 - 0.2 * 3 = 1.4 < 1.5; once: 1.8 > 1.5
    assert sample(row, 0.0, output=[[0, 0, 0]], frequency_penalty=0.2).item() == 1
    assert sample(row, 0.0, output=[[0]], frequency_penalty=0.2).item() == 0
    # presence counts once: 2.0 - 0.6 = 1.4
    assert sample(row, 0.0, output=[[0, 0, 0, 0]], presence_penalty=0.6).item() == 1
    # negative penalties reward: 0.5 + 2 = 2.5
    assert sample(row, 0.0, output=[[2]], presence_penalty=-2.0).item() == 2
    # prompt tokens get only the repetition penalty
    assert sample(row, 0.0, prompt=[[0]], output=[[]], frequency_penalty=5.0, presence_penalty=5.0).item() == 0


def test_penalty_counters_reset_between_requests():
    # Row 0 counts token 0 five times; the same token in later rows must start from zero again.
    row = torch.tensor([2.0, 1.5, 0.0])
    logits = row.expand(40, 3).contiguous()
    output = [[0] * 5] + [[0]] * 39
    got = sample(logits, 0.0, output=output, frequency_penalty=0.2)
    assert got.tolist() == [1] + [0] * 39


def test_banned_tokens_are_never_sampled():
    torch.manual_seed(2)
    row = torch.randn(64) * 2
    banned = row.topk(5).indices.tolist() + [3, 17]
    n = 4000
    got = sample(row.repeat(n, 1), 1.0, counters=torch.arange(n), banned=[banned] * n)
    assert not set(got.tolist()) & set(banned)
    assert sample(row[None], 0.0, banned=[banned]).item() == row.topk(6).indices[5].item()
    only = [t for t in range(64) if t != 40]
    assert set(sample(row.repeat(50, 1), 1.0, counters=torch.arange(50), banned=[only] * 50).tolist()) == {40}


def test_biases_move_tokens_and_only_listed_keeps_the_list():
    torch.manual_seed(3)
    row = torch.randn(80) * 2
    low, top = row.argmin().item(), row.argmax().item()
    up = [{low: 100.0, top: -100.0}]
    assert sample(row[None], 0.0, biases=up).item() == low
    n = 20000
    tokens = sample(row.repeat(n, 1), 1.0, counters=torch.arange(n), biases=[{low: 3.0, 7: -2.5}] * n).long()
    assert total_variation(tokens, torch.softmax(penalized(row, biases={low: 3.0, 7: -2.5}), 0)) < 0.02
    listed = {5: 0.0, 17: 1.0, 60: float("-inf")}
    tokens = sample(row.repeat(500, 1), 1.0, counters=torch.arange(500), biases=[listed] * 500, only_listed=1)
    assert set(tokens.tolist()) <= {5, 17}
    ref = penalized(row, biases=listed, only_listed=True)
    assert sample(row[None], 0.0, biases=[listed], only_listed=1).item() == ref.argmax().item()
    # A row with only_listed and no entries bans everything: the kernels' fallback, token 0.
    assert sample(row[None], 0.0, only_listed=1).item() == 0


def test_penalties_apply_to_the_biased_logits():
    """vLLM's order (biases, then penalties); greedy rows against the float64 reference."""
    torch.manual_seed(4)
    b, vocab = 64, 50
    logits = torch.randn(b, vocab)
    prompt = [torch.randint(0, vocab, (8,)).tolist() for _ in range(b)]
    output = [torch.randint(0, vocab, (6,)).tolist() for _ in range(b)]
    biases = [{t: float(torch.randn(()) * 3) for t in torch.randperm(vocab)[:4].tolist()} for _ in range(b)]
    rep = torch.rand(b) + 0.8
    got = sample(logits, 0.0, prompt=prompt, output=output, biases=biases, repetition_penalty=rep,
                 frequency_penalty=0.2, presence_penalty=0.1)
    for r in range(b):
        ref = penalized(logits[r], prompt[r], output[r], rep[r].item(), 0.2, 0.1, biases=biases[r])
        assert ref[got[r]] == ref.max(), r


# ---------------------------------------------------------------------------------------------
# Random sampling: distributions and kept sets


@pytest.mark.parametrize("vocab,temperature", [(16, 1.0), (37, 0.7), (37, 2.5)])
def test_temperature_sampling_matches_softmax(vocab, temperature):
    torch.manual_seed(vocab)
    row = torch.randn(vocab) * 1.5
    n = 40000
    tokens = draws(row, n, temperature=temperature)
    probs = torch.softmax(row.double() / temperature, 0)
    assert total_variation(tokens, probs) < 0.02
    counts = torch.bincount(tokens, minlength=vocab).double()
    expected = probs * n
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    df = vocab - 1
    assert chi2 < df + 6 * (2 * df) ** 0.5


def test_random_sampling_follows_the_penalized_distribution():
    torch.manual_seed(7)
    row = torch.randn(20)
    lists = dict(prompt=[3, 4, 5], output=[5, 5, 6, 7, 7, 7], banned=[0])
    n = 30000
    tokens = sample(row.repeat(n, 1), 0.8, counters=torch.arange(n), repetition_penalty=1.5, frequency_penalty=0.3,
                    presence_penalty=0.2, **{k: [v] * n for k, v in lists.items()}).long()
    ref = penalized(row, lists["prompt"], lists["output"], 1.5, 0.3, 0.2, lists["banned"])
    assert total_variation(tokens, torch.softmax(ref / 0.8, 0)) < 0.02


@pytest.mark.parametrize("params", [
    dict(top_k=5),
    dict(top_p=0.6),
    dict(min_p=0.1),
    dict(top_k=10, top_p=0.5, temperature=0.8),
    dict(min_p=0.05, top_k=20, top_p=0.9, temperature=1.5),
    dict(top_k=1),
    dict(top_p=1e-6),
])
def test_filters_keep_the_reference_set_and_its_distribution(params):
    torch.manual_seed(3)
    row = torch.randn(100) * 2
    kept, probs = allowed(row, **params)
    tokens = draws(row, 20000, **params)
    assert set(tokens.tolist()) <= kept
    assert total_variation(tokens, probs) < 0.03


@pytest.mark.parametrize("vocab,scale,params", [
    (50000, 3.0, dict(top_p=0.9)),                 # peaked: a few candidates
    (50000, 3.0, dict(top_k=50, top_p=0.95)),
    (6000, 0.3, dict(top_p=0.5)),                  # flat: thousands of candidates
    (6000, 0.3, dict(top_k=3000, min_p=0.2)),
])
def test_filters_on_large_vocabularies(vocab, scale, params):
    torch.manual_seed(4)
    row = torch.randn(vocab) * scale
    kept, _ = allowed(row, **params)
    tokens = draws(row, 300, **params)
    assert set(tokens.tolist()) <= kept
    assert len(set(tokens.tolist())) > 1


def test_top_k_ties_keep_lower_ids():
    row = torch.zeros(40)
    assert set(draws(row, 2000, top_k=3).tolist()) == {0, 1, 2}
    # top_p over equal probabilities: the lowest ids form the prefix (0.11 of 40 tokens: 5)
    assert set(draws(row, 2000, top_p=0.11).tolist()) == {0, 1, 2, 3, 4}


def test_nan_logits_weigh_nothing():
    """A NaN logit is never drawn, with or without filters, and never counted in a rank; greedy
    over a row of only -inf and NaN takes the first of them (NaN ranks as -inf). NaNs sit in
    whole vectors and in the tail of every ISA's loops."""
    nan = [3, 40, 69]
    row = torch.randn(70, generator=torch.Generator().manual_seed(4))
    row[nan] = float("nan")
    logits = row.expand(300, 70).contiguous()
    for params in ({}, {"top_k": 20}, {"top_p": 0.9}, {"min_p": 0.05}):
        sampled = sample(logits, 1.0, counters=torch.arange(300), **params)
        assert not torch.isin(sampled, torch.tensor(nan)).any(), params
        assert len(sampled.unique()) > 10, params
    out = sample(logits[:40], 1.0, counters=torch.arange(40), logprobs=True)
    finite = row[~row.isnan()]
    expected = torch.stack([(finite >= row[t]).sum() for t in out["sampled"]]).to(I32)
    assert torch.equal(out["sampled_ranks"], expected)
    inf = float("inf")
    greedy = sample(torch.tensor([[float("nan"), -inf, -inf], [-inf, float("nan"), -inf]]), 0.0)
    assert greedy.tolist() == [0, 0]


def test_temperature_zero_ignores_filters():
    row = torch.tensor([[0.0, 3.0, 1.0]])
    assert sample(row, 0.0, top_k=1, top_p=0.1, min_p=0.9).item() == 1


# ---------------------------------------------------------------------------------------------
# Seeds and batches


def test_same_seed_and_counter_give_the_same_token():
    torch.manual_seed(5)
    row = torch.randn(1000)
    first = draws(row, 200, top_p=0.95, seed=1234)
    assert torch.equal(first, draws(row, 200, top_p=0.95, seed=1234))
    assert len(set(first.tolist())) > 50  # different counters: different draws
    other = draws(row, 200, top_p=0.95, seed=1235)
    assert (first != other).float().mean() > 0.5  # different seed: another stream


def request_batch():
    """Eight requests with different parameters, penalties and lists."""
    torch.manual_seed(6)
    vocab = 2053
    logits = torch.randn(8, vocab) * 2
    params = dict(
        temperature=torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0, 0.0, 0.9, 1.1]),
        top_k=torch.tensor([0, 5, 40, 0, 7, 0, 1000, 0], dtype=I32),
        top_p=torch.tensor([0.9, 1.0, 1.0, 0.5, 1.0, 0.3, 0.95, 1.0]),
        min_p=torch.tensor([0.0, 0.1, 0.0, 0.0, 0.05, 0.0, 0.0, 0.2]),
        repetition_penalty=torch.tensor([1.2, 1.0, 1.1, 1.0, 0.8, 1.5, 1.0, 1.0]),
        frequency_penalty=torch.tensor([0.0, 0.3, 0.0, 0.5, 0.0, 0.0, 0.1, 0.0]),
        presence_penalty=torch.tensor([0.1, 0.0, 0.0, 0.5, 0.0, 0.2, 0.0, 0.0]),
    )
    lists = dict(
        prompt=[torch.randint(0, vocab, (int(torch.randint(0, 30, ())),)).tolist() for _ in range(8)],
        output=[torch.randint(0, vocab, (int(torch.randint(0, 30, ())),)).tolist() for _ in range(8)],
        banned=[torch.randperm(vocab)[:3 * (r % 2)].tolist() for r in range(8)],  # each token once per row
    )
    return logits, params, lists


def select(params, lists, rows):
    return ({k: v[rows] for k, v in params.items()}, {k: [v[r] for r in rows] for k, v in lists.items()})


@pytest.mark.parametrize("request_row", [0, 3, 4, 6])
def test_a_request_gets_the_same_result_alone_or_in_a_batch(request_row):
    logits, params, lists = request_batch()
    counters = torch.arange(8) * 7 + 3
    batch = sample(logits, seed=99, counters=counters, logprobs=True, num_top=4, **params, **lists)
    for rows in ([request_row], [request_row, 2, 5], [1, 7, request_row]):
        p, l = select(params, lists, rows)
        alone = sample(logits[rows], seed=99, counters=counters[rows], logprobs=True, num_top=4, **p, **l)
        pos = rows.index(request_row)
        for key, value in alone.items():
            assert torch.equal(value[pos], batch[key][request_row]), key


# ---------------------------------------------------------------------------------------------
# rejection_sample: speculative decoding's verification


def test_rejection_sample_draws_as_sample_and_accepts_the_rows_that_draw_their_draft():
    """Each row is drawn as sample() draws it (so speculation changes no token); a row is
    accepted exactly where its token is its draft, and a row without a draft (-1) never is."""
    logits, params, lists = request_batch()
    counters = torch.arange(8) * 7 + 3
    plain = sample(logits, seed=99, counters=counters, logprobs=True, num_top=4, **params, **lists)
    drafts = [int(t) if r % 3 == 0 else -1 if r % 3 == 2 else (int(t) + 1) % logits.shape[1]
              for r, t in enumerate(plain["sampled"])]
    verified = sample(logits, seed=99, counters=counters, logprobs=True, num_top=4, drafts=drafts, **params, **lists)
    for key, value in plain.items():
        assert torch.equal(verified[key], value), key
    assert verified["accepted"].tolist() == [int(r % 3 == 0) for r in range(8)]


def test_rejection_sample_accepts_a_draft_as_often_as_the_target_draws_it():
    """The acceptance rule min(1, p(d) / q(d)) for a one-hot drafter: a draft is accepted with
    its target probability p(d), and a rejected row's token follows p without d."""
    row = torch.randn(1, 50) * 1.5
    p = torch.softmax(row[0].double(), dim=0)
    draft = int(p.argsort()[-3])  # a fairly likely token, not the likeliest
    n = 20000
    out = sample(row.expand(n, 50).contiguous(), counters=torch.arange(n), drafts=[draft] * n, seed=5)
    accepted = out["accepted"].bool()
    rate = accepted.double().mean()
    assert abs(rate - p[draft]) < 4 * (p[draft] * (1 - p[draft]) / n) ** 0.5
    residual = p.clone()
    residual[draft] = 0
    assert total_variation(out["sampled"][~accepted], residual / residual.sum()) < 0.03


# ---------------------------------------------------------------------------------------------
# Logprobs of the raw logits


@pytest.mark.parametrize("vocab", [5, 1000, 30011])
def test_logprobs_ranks_and_top_n_match_log_softmax(vocab):
    torch.manual_seed(vocab)
    b, n_top = 6, 5
    logits = torch.randn(b, vocab) * 4
    # Penalties and temperature must not change the logprobs, which are of the raw logits.
    out = sample(logits, torch.tensor([0.0, 1.0, 0.5, 2.0, 1.0, 0.0]), counters=torch.arange(b), logprobs=True,
                 num_top=min(n_top, vocab), output=[[0, 1, 2]] * b, repetition_penalty=1.5, presence_penalty=1.0,
                 top_k=3)
    ref = torch.log_softmax(logits.double(), 1)
    tok = out["sampled"].long()
    expected = ref.gather(1, tok[:, None])[:, 0]
    torch.testing.assert_close(out["sampled_logprobs"].double(), expected, atol=1e-5, rtol=1e-5)
    ranks = (logits >= logits.gather(1, tok[:, None])).sum(1)
    assert torch.equal(out["sampled_ranks"].long(), ranks)
    top = ref.topk(min(n_top, vocab), dim=1)
    assert torch.equal(out["top_token_ids"].long(), top.indices)
    torch.testing.assert_close(out["top_logprobs"].double(), top.values, atol=1e-5, rtol=1e-5)


def test_greedy_token_has_rank_one_and_top_n_ties_by_id():
    logits = torch.tensor([[1.0, 3.0, 2.0, 3.0, 2.0, 0.0]])
    out = sample(logits, 0.0, logprobs=True, num_top=6)
    assert out["sampled"].item() == 1 and out["sampled_ranks"].item() == 2  # both 3.0 count
    assert out["top_token_ids"][0].tolist() == [1, 3, 2, 4, 0, 5]
    torch.testing.assert_close(out["sampled_logprobs"], torch.log_softmax(logits, 1)[:, 1])
    plain = sample(torch.tensor([[0.0, 5.0, 1.0]]), 0.0, logprobs=True)
    assert plain["sampled_ranks"].item() == 1


# ---------------------------------------------------------------------------------------------
# Bad arguments


def call(**overrides):
    b, vocab = 2, 10
    args = dict(logits=torch.randn(b, vocab), temperature=torch.ones(b), seeds=torch.zeros(b, dtype=I64),
                counters=torch.zeros(b, dtype=I64), sampled=torch.empty(b, dtype=I32))
    args.update(overrides)
    positional = [args.pop(k) for k in ("logits", "temperature", "seeds", "counters", "sampled")]
    _C.ops.sample(*positional, **args)


@pytest.mark.parametrize("overrides,error,match", [
    (dict(logits=torch.randn(2, 10, dtype=torch.float64)), TypeError, "'logits' must have dtype float32"),
    (dict(sampled=torch.empty(2, dtype=I64)), TypeError, "'sampled' must have dtype int32"),
    (dict(top_k=torch.ones(2)), TypeError, "'top_k' must have dtype int32"),
    (dict(seeds=[1, 2]), TypeError, "'seeds'"),
    (dict(temperature=torch.ones(3)), ValueError, "'temperature' must have size 2"),
    (dict(logits=torch.randn(2, 0)), ValueError, "non-empty vocabulary"),
    (dict(temperature=torch.tensor([1.0, -0.5])), ValueError, r"temperature\[1\] must be >= 0"),
    (dict(top_p=torch.tensor([0.0, 1.0])), ValueError, r"top_p\[0\] must be in \(0, 1\]"),
    (dict(min_p=torch.tensor([0.0, 1.5])), ValueError, r"min_p\[1\] must be in \[0, 1\]"),
    (dict(bias_offsets=torch.tensor([0, 1, 2], dtype=I32), bias_token_ids=torch.tensor([3, 10], dtype=I32),
          bias_values=torch.zeros(2)), ValueError, "is not a token id"),
    (dict(bias_offsets=torch.tensor([0, 2, 2], dtype=I32), bias_token_ids=torch.tensor([3, 3], dtype=I32),
          bias_values=torch.zeros(2)), ValueError, "lists token 3 twice for request 0"),
    (dict(bias_offsets=torch.tensor([0, 1, 1], dtype=I32), bias_token_ids=torch.tensor([3], dtype=I32),
          bias_values=torch.tensor([float("nan")])), ValueError, "must be finite or -inf"),
    (dict(bias_offsets=torch.tensor([0, 1, 1], dtype=I32), bias_token_ids=torch.tensor([3], dtype=I32)),
     ValueError, "'bias_values' must be given"),
    (dict(only_listed=torch.ones(3, dtype=I32)), ValueError, "'only_listed' must have size 2"),
    (dict(prompt_offsets=torch.tensor([0, 1, 1], dtype=I32), prompt_token_ids=torch.tensor([-1], dtype=I32),
          repetition_penalty=torch.ones(2)), ValueError, "is not a token id"),
    (dict(output_offsets=torch.tensor([0, 1, 2], dtype=I32)), ValueError, "must be given together"),
    (dict(output_offsets=torch.tensor([0, 2, 1], dtype=I32), output_token_ids=torch.tensor([1], dtype=I32)),
     ValueError, "must be non-decreasing"),
    (dict(repetition_penalty=torch.tensor([0.0, 1.0]), prompt_offsets=torch.tensor([0, 0, 0], dtype=I32),
          prompt_token_ids=torch.zeros(0, dtype=I32)), ValueError, "repetition_penalty"),
    (dict(frequency_penalty=torch.ones(2)), ValueError, "frequency_penalty and presence_penalty need"),
    (dict(repetition_penalty=torch.tensor([1.0, 1.2])), ValueError, "repetition_penalty needs"),
    (dict(top_token_ids=torch.empty(2, 3, dtype=I32)), ValueError, "must be given together"),
    (dict(top_kk=torch.ones(2, dtype=I32)), TypeError, "unexpected keyword argument 'top_kk'"),
])
def test_bad_arguments_raise_clear_errors(overrides, error, match):
    with pytest.raises(error, match=match):
        call(**overrides)


@pytest.mark.parametrize("drafts,accepted,match", [
    (torch.tensor([0, 10], dtype=I32), torch.empty(2, dtype=I32), r"draft_token_ids\[1\] = 10 is neither -1 nor"),
    (torch.tensor([0, -2], dtype=I32), torch.empty(2, dtype=I32), r"draft_token_ids\[1\] = -2"),
    (torch.tensor([0], dtype=I32), torch.empty(2, dtype=I32), "'draft_token_ids' must have size 2"),
    (torch.tensor([0, 1], dtype=I32), torch.empty(2, dtype=I64), "'accepted' must have dtype int32"),
])
def test_rejection_sample_checks_its_drafts(drafts, accepted, match):
    b, vocab = 2, 10
    with pytest.raises((ValueError, TypeError), match=match):
        _C.ops.rejection_sample(torch.randn(b, vocab), torch.ones(b), torch.zeros(b, dtype=I64),
                                torch.zeros(b, dtype=I64), torch.empty(b, dtype=I32), drafts, accepted)


def test_neutral_penalties_need_no_token_lists():
    call(repetition_penalty=torch.ones(2), frequency_penalty=torch.zeros(2), presence_penalty=torch.zeros(2))
