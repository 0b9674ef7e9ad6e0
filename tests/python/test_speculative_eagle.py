"""EAGLE and EAGLE-3 draft heads (speculative decoding's "eagle" and "eagle3"), on tiny random
heads written here in EAGLE's checkpoint layout:

- the drafts the engine holds after each step equal those of a plain-torch reference of the
  head, run from scratch over the target's hidden states (transformers) and the tokens so far:
  the head's KV cache is caught up right after prefill chunks, accepted and rejected drafts,
  prefix-cache hits;
- a "perfect" head on the chain model (whose next token depends on the current one alone) has
  every draft accepted: the head reads token i + 1 with the target's state at i;
- the output is the target's, greedy and seeded, on every tiny architecture.
"""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file
from test_models import ARCHITECTURES, tiny_checkpoint
from test_speculative import CHAIN_VOCAB, chain_checkpoint, counts, draft_always, speculator, token_ids, walk

from octavo import LLM, SamplingParams
from octavo.speculative import SpeculativeConfig

EMBEDDING_STD = 0.02  # transformers' initializer_range: the chain model's embedding rows are this small
ARGS = dict(skip_tokenizer_init=True, max_model_len=256, kv_cache_memory_bytes=16 << 20)


def head_config(target: dict, eagle3: bool, **extra) -> dict:
    """A one-layer head's config.json for a target's (its dimensions and rotary settings)."""
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling")
    config = {k: target[k] for k in keys if target.get(k) is not None}
    arch = "LlamaForCausalLMEagle3" if eagle3 else "EagleLlamaForCausalLM"
    return {**config, "architectures": [arch], "num_hidden_layers": 1, "torch_dtype": "float32", **extra}


def random_head(config: dict, eagle3: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """EAGLE's tensors for ``config``, random: EAGLE-3's under ``midlayer.`` with a draft
    vocabulary that d2t maps onto a random subset of the target's."""
    g = torch.Generator().manual_seed(seed)
    h, d, inter = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]

    def rand(*shape, scale=None):
        return torch.randn(*shape, generator=g) * (scale or shape[-1] ** -0.5)

    p = "midlayer." if eagle3 else "layers.0."
    width = 2 * h if eagle3 else h
    t = {f"{p}self_attn.q_proj.weight": rand(heads * d, width), f"{p}self_attn.k_proj.weight": rand(kv * d, width),
         f"{p}self_attn.v_proj.weight": rand(kv * d, width), f"{p}self_attn.o_proj.weight": rand(h, heads * d),
         f"{p}mlp.gate_proj.weight": rand(inter, h), f"{p}mlp.up_proj.weight": rand(inter, h),
         f"{p}mlp.down_proj.weight": rand(h, inter), f"{p}post_attention_layernorm.weight": 1 + 0.1 * rand(h, scale=1),
         "fc.weight": rand(h, 3 * h if eagle3 else 2 * h)}
    if eagle3:
        vocab, draft_vocab = config["vocab_size"], config.get("draft_vocab_size", config["vocab_size"])
        targets = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
        t.update({f"{p}input_layernorm.weight": 1 + 0.1 * rand(h, scale=1),
                  f"{p}hidden_norm.weight": 1 + 0.1 * rand(h, scale=1), "norm.weight": 1 + 0.1 * rand(h, scale=1),
                  "lm_head.weight": rand(draft_vocab, h, scale=1.0), "d2t": targets - torch.arange(draft_vocab),
                  "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, targets, True)})
    return t


def save_head(path, config: dict, tensors: dict[str, torch.Tensor]) -> str:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "model.safetensors"))
    return str(path)


def spec_config(method: str, head: str, k: int = 3) -> dict:
    return {"method": method, "model": head, "num_speculative_tokens": k}


# ---- a plain-torch reference of the head -----------------------------------------------------


def rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, positions, theta):
    """Llama's rotary embedding (rotate-half), x: [T, heads, d]."""
    d = x.shape[-1]
    angles = positions[:, None].double() * (1.0 / theta ** (torch.arange(0, d, 2).double() / d))
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None].float(), torch.cat([angles.sin()] * 2, -1)[:, None].float()
    half = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + half * sin


def head_reference(t: dict, c: dict, eagle3: bool, embed, ids, hidden):
    """The head over a whole sequence (positions 0..T-1) -> (normed, carry) [T, H]."""
    p, eps = ("midlayer." if eagle3 else "layers.0."), c["rms_norm_eps"]
    emb = embed[ids]
    if eagle3:
        x, residual = torch.cat([rms(emb, t[f"{p}input_layernorm.weight"], eps),
                                 rms(hidden, t[f"{p}hidden_norm.weight"], eps)], -1), hidden
    else:
        x = torch.cat([emb, hidden], -1) @ t["fc.weight"].T
        residual = x
    n, heads, kv, d = len(ids), c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    positions = torch.arange(n)
    q = rope((x @ t[f"{p}self_attn.q_proj.weight"].T).view(n, heads, d), positions, c.get("rope_theta", 10000.0))
    k = rope((x @ t[f"{p}self_attn.k_proj.weight"].T).view(n, kv, d), positions, c.get("rope_theta", 10000.0))
    v = (x @ t[f"{p}self_attn.v_proj.weight"].T).view(n, kv, d)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / d**0.5
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * d)
    residual = residual + attn @ t[f"{p}self_attn.o_proj.weight"].T
    y = rms(residual, t[f"{p}post_attention_layernorm.weight"], eps)
    out = residual + (F.silu(y @ t[f"{p}mlp.gate_proj.weight"].T) * (y @ t[f"{p}mlp.up_proj.weight"].T)) \
        @ t[f"{p}mlp.down_proj.weight"].T
    return (rms(out, t["norm.weight"], eps), out) if eagle3 else (out, out)


def reference_drafts(target, t: dict, c: dict, eagle3: bool, aux: list[int], tokens: list[int], k: int) -> list[int]:
    """The head's k greedy drafts after ``tokens`` (the newest last), from scratch."""
    with torch.no_grad():
        states = target(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        hidden = (torch.cat([states[i][0] for i in aux], -1) @ t["fc.weight"].T) if eagle3 else states[-1][0]
        embed, lm_head = target.model.embed_tokens.weight, t["lm_head.weight"] if eagle3 else target.lm_head.weight
        ids, drafts = list(tokens[1:]), []
        for _ in range(k):
            normed, carry = head_reference(t, c, eagle3, embed, torch.tensor(ids), hidden)
            best = int((normed[-1] @ lm_head.T).argmax())
            drafts.append(best + int(t["d2t"][best]) if eagle3 else best)
            ids.append(drafts[-1])
            hidden = torch.cat([hidden, carry[-1:]])
    return drafts


# ---- the drafts are the reference's ----------------------------------------------------------


def chain_head(config: dict, eagle3: bool, target, successor: list[int], noise: float = 0.5):
    """A head that drafts the chain model's tokens, plus random noise in every weight (so that
    its attention, and with it its KV cache, counts).

    EAGLE: fc passes the embedding of token i + 1 on and the layer adds little, so the target's
    LM head reads the token after it: every draft right. EAGLE-3: fc passes the target's stream
    at i (the embedding of token i, as the chain's layers add nothing) on, and its own LM head's
    row for successor(successor(t)) points along embedding t: the first draft right, the later
    ones (made from the same stream) seldom."""
    t = random_head(config, eagle3)
    h, scale = config["hidden_size"], noise * EMBEDDING_STD  # noise against the embeddings' size
    for name in t:
        if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            t[name] *= scale
    t["fc.weight"] = scale * t["fc.weight"]
    t["fc.weight"][:, :h] += torch.eye(h)
    if eagle3:
        embed = target.model.embed_tokens.weight.detach()
        unit = embed / embed.norm(dim=1, keepdim=True)
        after_next = {successor[successor[token]]: token for token in range(len(successor))}
        drafted = torch.arange(len(t["d2t"])) + t["d2t"]  # the target token of each draft token
        t["lm_head.weight"] = 0.1 * t["lm_head.weight"] + 0.6 * unit[[after_next[int(x)] for x in drafted]]
    return t


@pytest.fixture(scope="module", params=["eagle", "eagle3"])
def chain_eagle(request, tmp_path_factory):
    """The chain model (3 layers) with its head (EAGLE-3: 24 draft tokens of 32), and an engine
    with chunked prefill drafting at any batch size."""
    eagle3 = request.param == "eagle3"
    path = tmp_path_factory.mktemp("chain3")
    successor = chain_checkpoint(path, layers=3)
    target = transformers.LlamaForCausalLM.from_pretrained(path).eval()
    config = head_config(json.loads((path / "config.json").read_text()), eagle3, draft_vocab_size=24,
                         eagle_aux_hidden_state_layer_ids=[0, 1, 2])
    tensors = chain_head(config, eagle3, target, successor)
    head = save_head(tmp_path_factory.mktemp("head"), config, tensors)
    llm = LLM(str(path), speculative_config=spec_config(request.param, head), max_num_batched_tokens=24,
              enable_chunked_prefill=True, **ARGS)
    draft_always(llm)
    return llm, target, tensors, config, eagle3, successor, str(path), head


@pytest.fixture(scope="module")
def chain_plain(chain_eagle):
    return LLM(chain_eagle[6], **ARGS)


def held_drafts(llm: LLM, request_id: str, prompt: list[int]) -> tuple[list[int], list[int]] | None:
    """(the request's tokens so far, the drafts the scheduler holds for its next step), or None
    once it finished."""
    engine = llm.llm_engine
    scheduler = engine.core.engine_core.scheduler
    request = engine._requests.get(request_id)
    handle = request and scheduler.handle_of(request.samples[0].core_id)
    if handle is None:
        return None
    state = scheduler.request_state(handle)
    return prompt + list(state["output_token_ids"]), list(state["spec_token_ids"])


def test_drafts_equal_a_reference_head_after_every_step(chain_eagle):
    """Two requests, one prompt longer than a step's token budget (its prefill comes in chunks),
    then a second round whose prompts extend the first's whole sequences (prefix-cache hits on
    whole blocks and on a partial one, whose KV is copied): after each step, each request's
    drafts are the reference's for its tokens so far."""
    llm, target, tensors, config, eagle3, successor, _, _ = chain_eagle
    engine, rng = llm.llm_engine, np.random.default_rng(3)
    prompts = [walk(successor, 3, 30) + rng.integers(2, CHAIN_VOCAB, size=10).tolist(), [5, 9, 4, 30, 2, 2, 7]]
    before = counts(llm)
    for round in range(2):
        ids = [f"r{round}-{i}" for i in range(len(prompts))]
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        checked, outputs = 0, {}
        while engine.has_unfinished_requests():
            outputs.update({o.request_id: list(o.outputs[0].token_ids) for o in engine.step()})
            for rid, prompt in zip(ids, prompts):
                held = held_drafts(llm, rid, prompt)
                if held and held[1]:
                    tokens, drafts = held
                    expected = reference_drafts(target, tensors, config, eagle3, [0, 1, 2], tokens, 3)
                    assert drafts == expected[:len(drafts)], (rid, len(tokens))
                    checked += 1
        assert checked >= 4
        prompts = [p + outputs[rid] + rng.integers(2, CHAIN_VOCAB, size=5).tolist() for rid, p in zip(ids, prompts)]
    after = counts(llm)
    assert after.num_accepted_tokens - before.num_accepted_tokens >= 10  # accepted drafts' rows caught up too


def test_preempted_requests_draft_as_the_reference_when_they_resume(chain_eagle):
    """A cache of 6 blocks for 3 requests of up to 62 tokens (4 blocks each): requests are
    preempted, and without the prefix cache their KV, the head's included, is computed again
    when they resume."""
    _, target, tensors, config, eagle3, successor, path, head = chain_eagle
    block_bytes = 2 * (3 + 1) * 2 * 16 * 32 * 4  # K and V of 3 target layers and the head's, float32
    llm = LLM(path, speculative_config=spec_config("eagle3" if eagle3 else "eagle", head),
              **{**ARGS, "kv_cache_memory_bytes": 6 * block_bytes, "max_model_len": 96, "enable_prefix_caching": False})
    assert llm.llm_engine.info.num_blocks == 6
    draft_always(llm)
    engine = llm.llm_engine
    prompts = [walk(successor, s, 20 + 6 * s) for s in range(3)]
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        for i, prompt in enumerate(prompts):
            held = held_drafts(llm, str(i), prompt)
            if held and held[1]:
                expected = reference_drafts(target, tensors, config, eagle3, [0, 1, 2], held[0], 3)
                assert held[1] == expected[:len(held[1])]
                checked += 1
    assert checked >= 10
    assert engine.stats.num_preemptions > 0


# ---- the target's tokens -----------------------------------------------------------------------


def test_greedy_and_seeded_output_is_the_targets(chain_eagle, chain_plain):
    """The same tokens as without speculation, greedy and seeded (penalties, top-p, a stop token,
    logprobs), alone and in a batch; the EAGLE head's drafts are all accepted when greedy."""
    llm, _, _, _, eagle3, successor, _, _ = chain_eagle
    prompts = [walk(successor, s, 10 + 3 * s) for s in range(4)] + [[2, 7, 11]]
    for params in (SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                   SamplingParams(temperature=0.8, seed=3, max_tokens=30, ignore_eos=True, logprobs=2),
                   SamplingParams(temperature=1.0, top_p=0.9, seed=5, max_tokens=25, presence_penalty=0.5,
                                  stop_token_ids=[9], min_tokens=2)):
        before = counts(llm)
        expected = token_ids(chain_plain, prompts, params)
        assert token_ids(llm, prompts, params) == expected
        assert token_ids(llm, prompts[1:2], params) == expected[1:2]
        after = counts(llm)
        accepted, drafted = (after.num_accepted_tokens - before.num_accepted_tokens,
                             after.num_draft_tokens - before.num_draft_tokens)
        if params.temperature == 0:
            assert accepted == drafted > 100 if not eagle3 else accepted > drafted / 4


@pytest.mark.parametrize("kind", list(ARCHITECTURES))
def test_random_eagle3_heads_change_no_token_of_tiny_architectures(kind, tmp_path):
    tiny_checkpoint(kind, tmp_path / "target")
    config = head_config(json.loads((tmp_path / "target" / "config.json").read_text()), True,
                         eagle_aux_hidden_state_layer_ids=[0, 1, 1])
    head = save_head(tmp_path / "head", config, random_head(config, True))
    plain = LLM(str(tmp_path / "target"), **ARGS)
    spec = LLM(str(tmp_path / "target"), speculative_config=spec_config("eagle3", head, 2), **ARGS)
    draft_always(spec)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(2, 300, size=n).tolist() for n in (5, 17, 33)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    assert token_ids(spec, prompts, params) == token_ids(plain, prompts, params)
    assert counts(spec).num_draft_tokens > 0


# ---- configuration and checkpoints -----------------------------------------------------------


def test_eagle_configs():
    c = SpeculativeConfig.from_dict({"method": "eagle3", "model": "/heads/h", "num_speculative_tokens": 4})
    assert c.num_lookahead_tokens == 3  # its last draft's row is never run
    for config, match in (({"method": "eagle", "num_speculative_tokens": 2}, "needs the EAGLE head's directory"),
                          ({"method": "eagle3", "model": "/h", "num_speculative_tokens": 2, "quantization": "int8"},
                           "quantization applies to a draft model")):
        with pytest.raises(ValueError, match=match):
            SpeculativeConfig.from_dict(config)


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-target")
    tiny_checkpoint("llama", path, num_hidden_layers=6)
    return path, json.loads((path / "config.json").read_text())


def test_eagle3_reads_vllms_default_layers_and_eagles_own_bin_files(tiny_target, tmp_path):
    """A head without aux layer ids reads layers (2, L // 2, L - 3) of an L-layer target; EAGLE's
    original checkpoints are pytorch_model.bin files."""
    path, target = tiny_target
    config = head_config(target, True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    torch.save(random_head(config, True), tmp_path / "pytorch_model.bin")
    llm = LLM(str(path), speculative_config=spec_config("eagle3", str(tmp_path)), **ARGS)
    worker = llm.llm_engine.core.engine_core.executor.driver_worker
    assert worker.model.aux_hidden_layers == (2, 3, 3)
    assert speculator(llm).draft_time.rows(1) > 0  # timed at startup, before any step
    assert len(token_ids(llm, [[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0))[0]) == 8


@pytest.mark.parametrize("change,match", [
    (lambda c, t: t.pop("fc.weight"), "lacks fc.weight"),
    (lambda c, t: t.update({"fc.weight": torch.zeros(4, 4)}), "'fc.weight' has shape"),
    (lambda c, t: t.update({"extra.weight": torch.zeros(4)}), "'extra.weight' is not used"),
    (lambda c, t: c.update(vocab_size=301), "vocabulary .301 tokens. is not the target's"),
    (lambda c, t: c.update(eagle_aux_hidden_state_layer_ids=[0, 6, 1]), "reads the inputs of 3 of the target's 6"),
    (lambda c, t: t.update({"embed_tokens.weight": torch.zeros(3, 3)}), "'embed_tokens.weight' has shape"),
    (lambda c, t: c.update(max_position_embeddings=64), r"max_position_embeddings \(64\) is below max_model_len"),
])
def test_bad_heads_are_refused(tiny_target, tmp_path, change, match):
    path, target = tiny_target
    config = head_config(target, True)
    tensors = random_head(config, True)
    change(config, tensors)
    head = save_head(tmp_path, config, tensors)
    with pytest.raises(ValueError, match=match):
        LLM(str(path), speculative_config=spec_config("eagle3", head), **ARGS)


def test_tensor_parallel_is_refused(tiny_target):
    with pytest.raises(ValueError, match="not supported with tensor parallelism"):
        LLM(str(tiny_target[0]), speculative_config=spec_config("eagle", "/h"), tensor_parallel_size=2, **ARGS)


def test_a_failing_drafter_costs_drafts_not_requests(chain_eagle, chain_plain, monkeypatch, caplog):
    """Drafts are optional: a step whose drafting raises proposes none, and its requests go on
    with the target's tokens."""
    llm, successor = chain_eagle[0], chain_eagle[5]
    drafter = llm.llm_engine.core.engine_core.executor.driver_worker.drafter
    propose, calls = drafter.propose, []

    def every_third_fails(*args):
        calls.append(1)
        if len(calls) % 3 == 0:
            raise RuntimeError("the head broke")
        return propose(*args)

    monkeypatch.setattr(drafter, "propose", every_third_fails)
    prompts = [walk(successor, s, 12) for s in range(3)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    assert token_ids(llm, prompts, params) == token_ids(chain_plain, prompts, params)
    assert len(calls) >= 6 and "drafting failed" in caplog.text
