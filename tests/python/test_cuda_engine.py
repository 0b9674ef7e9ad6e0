"""The engine on a GPU: tiny random checkpoints of every architecture give transformers' greedy
tokens on the same GPU (float32; a bfloat16 GQA model agrees with them), and the KV cache is sized
from the GPU's memory. Runs only where a GPU is present and this build carries CUDA kernels; the
CPU-side checks (device selection, the bfloat16 check's CPU run) run everywhere."""

import gc

import numpy as np
import pytest
import torch
from octavo import _C, LLM, SamplingParams
from octavo.device import cpu_only_reason, cuda_unusable_reason, resolve_device
from test_detokenizer import _byte_level_bpe
from test_models import ARCHITECTURES, tiny_checkpoint

needs_cuda_build = pytest.mark.skipif(not _C.cuda_compiled(), reason="this build of Octavo has no CUDA kernels")


def tiny_model_dir(path, kind: str = "llama", **overrides):
    """A tiny random checkpoint with a byte-level tokenizer; head size 64, which CUDA attention has."""
    tokenizer = _byte_level_bpe()
    tokenizer.save_pretrained(path)
    reference = tiny_checkpoint(kind, path, **{"head_dim": 64, "vocab_size": len(tokenizer),
                                               "eos_token_id": tokenizer.eos_token_id, **overrides})
    return tokenizer, reference


def test_device_selection():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cpu" if cuda_unusable_reason() else "cuda")
    with pytest.raises(ValueError, match="'auto', 'cpu' or 'cuda"):
        resolve_device("meta")
    if cuda_unusable_reason():
        with pytest.raises(ValueError, match="cannot be used: "):
            resolve_device("cuda")
    else:  # plain "cuda" is torch's current device, as in torch; an index must exist
        assert resolve_device("cuda") == torch.device("cuda", torch.cuda.current_device())
        with pytest.raises(ValueError, match="does not exist: this machine has"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")


def test_bad_engine_device_arguments_are_refused(tmp_path):
    tiny_model_dir(tmp_path)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\], got 0"):
        LLM(model=str(tmp_path), device="cpu", gpu_memory_utilization=0)
    with pytest.raises(ValueError, match="device must be 'auto', 'cpu' or 'cuda"):
        LLM(model=str(tmp_path), device="tpu")


def test_what_cannot_run_on_a_gpu_is_named(tmp_path):
    tiny_model_dir(tmp_path / "ok")
    tiny_checkpoint("llama", tmp_path / "head32")  # TINY's head size: 32
    assert cpu_only_reason(tmp_path / "ok") is None
    assert "head size 32 has no CUDA attention kernel" in cpu_only_reason(tmp_path / "head32")
    tiny_checkpoint("llama", tmp_path / "group32", head_dim=64, num_attention_heads=32, num_key_value_heads=1,
                    hidden_size=64)
    assert "32 query heads per KV head; the CUDA attention kernels take at most 16" in \
        cpu_only_reason(tmp_path / "group32")


@pytest.mark.cuda
@needs_cuda_build
def test_auto_falls_back_to_the_cpu_and_cuda_refuses_what_it_cannot_run(tmp_path, capsys):
    tiny_checkpoint("llama", tmp_path)  # head size 32
    _byte_level_bpe().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="head size 32 has no CUDA attention kernel"):
        LLM(model=str(tmp_path), device="cuda")
    llm = LLM(model=str(tmp_path), device="auto", kv_cache_memory_bytes=16 << 20)
    assert llm.llm_engine.device.type == "cpu" and "running on the CPU: head size 32" in capsys.readouterr().out


def greedy_reference(reference, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tokens.append(int(reference(torch.tensor([tokens], device=reference.device)).logits[0, -1].argmax()))
    return tokens[len(prompt):]


@pytest.mark.cuda
@needs_cuda_build
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("kind", list(ARCHITECTURES))
def test_greedy_tokens_match_transformers_on_the_gpu(kind, enforce_eager, tmp_path):
    tokenizer, reference = tiny_model_dir(tmp_path, kind)
    reference = reference.cuda()
    llm = LLM(model=str(tmp_path), dtype="float32", device="cuda", kv_cache_memory_bytes=64 << 20,
              max_num_seqs=8, enforce_eager=enforce_eager)
    assert llm.apply_model(lambda m: m.embed_tokens.device.type) == ["cuda"]
    assert llm.collective_rpc(lambda worker: worker.runner.cuda_graphs is None) == [enforce_eager]
    prompts = [tokenizer.encode(t) for t in ("Hello world", "Straße und Meer", "x", "a longer prompt " * 6)]
    # Requests end one after another, so decode steps run 4, 3 (padded to the graph of 4), 2 and 1 rows.
    lengths = [16, 11, 6, 3]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for prompt, out, n in zip(prompts, outputs, lengths):
        assert list(out.outputs[0].token_ids) == greedy_reference(reference, prompt, n)
    assert llm.llm_engine.scheduler.block_pool.num_used_blocks == 0


@pytest.mark.cuda
@needs_cuda_build
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_an_fp8_kv_cache_gives_fp8_rounded_logprobs_on_the_gpu(enforce_eager, tmp_path):
    """kv_cache_dtype="fp8" on CUDA (float32 queries: the split-KV kernel reads the cache for
    prompts and decodes; test_cuda_attention.py runs the tensor-core kernels' fp8 forms): the
    logprobs of transformers' float32 model with K and V rounded to fp8 (test_llm.py's reference)."""
    from test_llm import fp8_kv_reference

    tokenizer, reference = tiny_model_dir(tmp_path, num_attention_heads=8, num_key_value_heads=2, hidden_size=256)
    reference = reference.cuda()
    llm = LLM(model=str(tmp_path), dtype="float32", device="cuda", kv_cache_memory_bytes=64 << 20,
              max_num_seqs=8, enforce_eager=enforce_eager, kv_cache_dtype="fp8")
    assert llm.collective_rpc(lambda worker: str(worker.runner.kv_dtype)) == ["torch.float8_e4m3fn"]
    forward = fp8_kv_reference(reference, [(1.0, 1.0)] * len(reference.model.layers))
    prompts = [tokenizer.encode(t) for t in ("Hello world", "Straße und Meer", "a longer prompt " * 12)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    for ids, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        tokens = ids + list(out.outputs[0].token_ids)
        logp = torch.log_softmax(forward(torch.tensor([tokens], device="cuda"))[0].double(), -1)
        for step, entry in enumerate(out.outputs[0].logprobs):
            for token, value in entry.items():
                assert abs(value.logprob - float(logp[len(ids) - 1 + step, token])) < 1e-3
    assert llm.llm_engine.scheduler.block_pool.num_used_blocks == 0


# What bfloat16 rounding may move a near-tie by, in this model whose logits span about 2.5
# (standard deviation 0.3; a token drawn at random lies about 1 below the top). The CPU kernels
# pick transformers' top token at every step of the test below.
BF16_LOGIT_MARGIN = 0.125


@pytest.mark.parametrize("device,enforce_eager", [
    ("cpu", True),
    pytest.param("cuda", False, marks=[pytest.mark.cuda, needs_cuda_build], id="cuda-graphs"),
    pytest.param("cuda", True, marks=[pytest.mark.cuda, needs_cuda_build], id="cuda-eager")])
def test_bfloat16_gqa_model_agrees_with_transformers(device, enforce_eager, tmp_path):
    """bfloat16 with 8 query heads per KV head: on a GPU, the tensor-core prefill and grouped
    decode kernels, in graphs and eagerly. Rounding parts greedy paths at near-ties, so each of
    Octavo's tokens is judged by transformers' bfloat16 logits after the same prefix (teacher
    forcing): the top token's logit exceeds its own by at most BF16_LOGIT_MARGIN, and nine in ten
    are the top token."""
    tokenizer, reference = tiny_model_dir(tmp_path, num_attention_heads=16, num_key_value_heads=2, hidden_size=256)
    reference = reference.to(device=device, dtype=torch.bfloat16)
    llm = LLM(model=str(tmp_path), dtype="bfloat16", device=device, kv_cache_memory_bytes=64 << 20,
              max_num_seqs=8, enforce_eager=enforce_eager)
    prompts = [tokenizer.encode(t) for t in ("Hello world", "Straße und Meer", "x", "a longer prompt " * 12)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (24, 17, 9, 4)]
    gaps = []
    for prompt, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        tokens = list(out.outputs[0].token_ids)
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens], device=device)).logits[0, len(prompt) - 1:-1].float()
        chosen = logits.gather(-1, torch.tensor(tokens, device=device)[:, None])[:, 0]
        gaps += (logits.max(-1).values - chosen).tolist()
    assert max(gaps) <= BF16_LOGIT_MARGIN, f"a token {max(gaps):.3f} below transformers' top logit"
    assert sum(g == 0 for g in gaps) >= 0.9 * len(gaps), gaps


def dequantized_reference(reference, model):
    """transformers' model with each projection replaced by the weights Octavo's quantized one
    stands for (the LM head gets its own, so a tied embedding stays the float table)."""
    from octavo.layers.linear import QuantizedWeight

    with torch.no_grad():
        for name, (weight, start, rows) in model.weight_targets().items():
            if isinstance(weight, QuantizedWeight) and name != "lm_head.weight":
                reference.get_parameter(name).copy_(weight.dequantize()[start:start + rows])
        assert isinstance(model.lm_head, QuantizedWeight)
        reference.lm_head.weight = torch.nn.Parameter(model.lm_head.dequantize(), requires_grad=False)
    return reference


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, needs_cuda_build])])
@pytest.mark.parametrize("method", ["int8", "int4", "fp8"])
def test_quantized_models_give_the_greedy_tokens_of_their_dequantized_weights(method, device, tmp_path):
    """On the GPU, prompts and decode steps of more than 16 rows (20 requests: a graph of 32) take
    torch's GEMM on dequantized weights, and the last steps of up to 16 rows the CUDA kernel; the
    CPU runs the same check with its own kernel."""
    tokenizer, reference = tiny_model_dir(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", device=device, quantization=method,
              kv_cache_memory_bytes=64 << 20, max_num_seqs=32)
    model = llm.apply_model(lambda m: m)[0]  # the in-process worker's
    from octavo.layers.linear import QuantizedWeight

    assert {w.qweight.device.type for w in model.modules() if isinstance(w, QuantizedWeight)} == {device}
    reference = dequantized_reference(reference.to(device), model)
    prompts = [tokenizer.encode(t) for t in ["Hello world", "x", "a longer prompt " * 6] +
               [f"request {i}: {'ab' * i}" for i in range(17)]]
    # Requests end one after another from the 5th token on, so the batch falls from 20 rows to 1.
    params = [SamplingParams(temperature=0, max_tokens=4 + i, ignore_eos=True) for i in range(len(prompts))]
    for prompt, out, p in zip(prompts, llm.generate(prompts, params, use_tqdm=False), params):
        assert list(out.outputs[0].token_ids) == greedy_reference(reference, prompt, p.max_tokens)


@pytest.mark.cuda
@needs_cuda_build
def test_kv_cache_is_sized_from_gpu_memory(tmp_path, capsys):
    tiny_model_dir(tmp_path)
    gc.collect()
    torch.cuda.empty_cache()  # earlier tests' cached blocks would count as used here, not in the engine
    free, total = torch.cuda.mem_get_info()
    llm = LLM(model=str(tmp_path), dtype="float32", device="cuda", gpu_memory_utilization=0.5)
    printed = capsys.readouterr().out
    assert "on cuda:0" in printed
    cache_bytes = llm.apply_model(lambda m: sum(t.numel() * t.element_size() for a in m.attention_layers() for t in a.kv_cache))[0]
    assert 0 < cache_bytes <= 0.5 * total - (total - free)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        LLM(model=str(tmp_path), dtype="float32", device="cuda", gpu_memory_utilization=1.5)



@pytest.mark.cuda
@needs_cuda_build
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_no_step_allocates_a_kernel_workspace_after_startup(enforce_eager, tmp_path, capsys):
    """The engine reserves the kernels' workspaces for its largest step before it sizes the KV
    cache: a workload of every kind of step (prompts chunked beside decodes of long contexts,
    the most requests at once, penalties, logprobs, prompt logprobs) allocates none afterwards.
    Eager too: there no graph capture runs the decode shapes before the workload does."""
    tiny_model_dir(tmp_path, max_position_embeddings=1024)
    llm = LLM(model=str(tmp_path), dtype="bfloat16", device="cuda", gpu_memory_utilization=0.5, max_num_seqs=12,
              max_num_batched_tokens=96, enforce_eager=enforce_eager)
    printed = capsys.readouterr().out
    assert "kernel workspaces" in printed and "free after a warm-up step of 96 tokens" in printed
    before = _C.cuda_workspace_stats()
    assert before["bytes"] > 0
    prompts = [[(7 * i + j) % 200 + 3 for j in range(40 + 80 * i)] for i in range(12)]
    params = SamplingParams(temperature=0.8, top_p=0.9, frequency_penalty=0.5, presence_penalty=0.3,
                            repetition_penalty=1.1, max_tokens=30, ignore_eos=True, logprobs=3, prompt_logprobs=2,
                            seed=1)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [30] * len(prompts)
    assert _C.cuda_workspace_stats() == before


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_packed_outputs_come_back_apart_in_one_copy(device):
    from octavo.worker.staging import PackedOutputs

    outputs = PackedOutputs(torch.device(device), ids=((5,), torch.int32), logprobs=((5,), torch.float32),
                            top=((5, 3), torch.int64), empty=((0, 2), torch.float32), flags=((7,), torch.uint8))
    values = {"ids": torch.arange(5, dtype=torch.int32) - 2, "logprobs": torch.linspace(-3, 0, 5),
              "top": torch.arange(15, dtype=torch.int64).view(5, 3) << 33, "empty": torch.empty(0, 2),
              "flags": torch.arange(7, dtype=torch.uint8) * 30}
    for name, t in outputs.tensors.items():
        assert t.device.type == device and t.is_contiguous() and (t.data_ptr() % 16 == 0 or t.numel() == 0)
        t.copy_(values[name])
    host = outputs.to_host()
    assert host.keys() == values.keys()
    for name, expected in values.items():
        assert host[name].shape == tuple(expected.shape) and host[name].dtype == expected.numpy().dtype
        assert (host[name] == expected.numpy()).all(), name


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_staging_moves_mixed_arrays_in_one_buffer_and_keeps_them_apart(device):
    import numpy as np
    from octavo.worker.staging import Staging

    staging = Staging(torch.device(device))
    rng = np.random.default_rng(0)
    for step in range(3):  # the buffers are reused, and grow at step 2
        n = 5 if step < 2 else 3000
        arrays = [rng.integers(-9, 9, n, dtype=np.int32), rng.random((n, 3)).astype(np.float32),
                  rng.integers(0, 1 << 40, 7, dtype=np.int64), np.zeros(0, dtype=np.int32),
                  rng.integers(0, 9, (2, n), dtype=np.int32)[:, ::2]]  # not contiguous
        moved = staging.to_device(*arrays)
        for a, t in zip(arrays, moved):
            assert t.device.type == device and t.shape == a.shape and t.is_contiguous()
            assert t.data_ptr() % 16 == 0 or t.numel() == 0
            np.testing.assert_array_equal(t.cpu().numpy(), a)


def test_graph_sizes_cover_max_num_seqs():
    from octavo.worker.cuda_graphs import graph_sizes

    assert graph_sizes(1) == [1]
    assert graph_sizes(8) == [1, 2, 4, 8]
    assert graph_sizes(20) == [1, 2, 4, 8, 16, 32]
    assert graph_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert graph_sizes(1000) == [1, 2, 4, 8, 16, 32, 64, 128, 256]  # larger batches run eagerly


def test_leading_decodes_counts_the_single_token_requests_a_step_starts_with():
    from octavo.worker.model_runner import leading_decodes

    assert leading_decodes(np.array([0, 1, 2, 3], dtype=np.int32)) == 3  # decodes alone
    assert leading_decodes(np.array([0, 1, 2, 50, 51], dtype=np.int32)) == 2  # then a chunk, then a decode
    assert leading_decodes(np.array([0, 7, 8], dtype=np.int32)) == 0
    assert leading_decodes(np.array([0], dtype=np.int32)) == 0


@pytest.mark.parametrize("device,enforce_eager", [
    ("cpu", True),
    pytest.param("cuda", False, marks=[pytest.mark.cuda, needs_cuda_build], id="cuda-graphs")])
def test_a_failed_step_ends_its_requests_and_the_engine_runs_on(device, enforce_eager, tmp_path, monkeypatch):
    """A forward pass that raises fails the requests of its step (finish_reason "error"), drops
    the KV it was to write from the prefix cache, and later requests, including one with the same
    prompt, get the greedy tokens they get on a fresh engine. Sampling values at their type's
    limits run on the device's sampler."""
    tokenizer, _ = tiny_model_dir(tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", device=device, kv_cache_memory_bytes=64 << 20, max_num_seqs=8,
              enforce_eager=enforce_eager)
    engine = llm.llm_engine
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    prompts = ["poison: " + "a fairly long prompt " * 3, "an innocent prompt " * 3]

    def tokens_and_logprobs(outputs):  # logprobs show KV damage that leaves the argmax alone
        return [[(t, round(e[t].logprob, 4)) for t, e in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
                for o in outputs]

    expected = tokens_and_logprobs(llm.generate(prompts, greedy, use_tqdm=False))
    engine.scheduler.reset_prefix_cache()
    core = engine.core.engine_core  # the in-process core and executor: the failure is injected there
    worker = core.executor.driver_worker
    execute = worker.runner.execute

    def failing_execute(out, rows):
        requests = [engine._by_core_id[core._live[h].request_id][0] for h in out.req_handles.tolist()]
        if any((r.prompt or "").startswith("poison") for r in requests):
            for attn in worker.model.attention_layers():  # a step that dies having written garbage
                for cache in attn.kv_cache:
                    cache.normal_(0.0, 3.0)
            raise RuntimeError("injected")
        return execute(out, rows)

    monkeypatch.setattr(worker.runner, "execute", failing_execute)
    failed = llm.generate(prompts, greedy, use_tqdm=False)
    assert [o.outputs[0].finish_reason for o in failed] == ["error", "error"]  # one step held both
    assert engine.scheduler.block_pool.num_used_blocks == 0
    monkeypatch.setattr(worker.runner, "execute", execute)
    assert tokens_and_logprobs(llm.generate(prompts, greedy, use_tqdm=False)) == expected
    extremes = [SamplingParams(max_tokens=4, **f) for f in (
        dict(top_p=1e-300), dict(repetition_penalty=1e-300), dict(repetition_penalty=1e300), dict(top_k=2**31),
        dict(temperature=1e300), dict(seed=2**63 - 1, n=2), dict(min_p=1.0, seed=-2**63))]
    for out in llm.generate([prompts[1]] * len(extremes), extremes, use_tqdm=False):
        assert all(o.finish_reason == "length" and len(o.token_ids) == 4 for o in out.outputs)


@pytest.mark.cuda
@needs_cuda_build
@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle3"])
def test_speculative_decoding_changes_no_token_on_the_gpu(method, tmp_path):
    """Verification steps (several rows of a request sampled by the CUDA rejection sampler), the
    startup's timed steps, a draft model's own KV cache and passes, an EAGLE-3 head reading the
    target's hidden states (those steps run eagerly): greedy and seeded tokens equal the same GPU
    engine's without drafts."""
    import json

    from test_speculative import counts, draft_always, token_ids
    from test_speculative_eagle import head_config, random_head, save_head

    tiny_model_dir(tmp_path / "target")
    target = str(tmp_path / "target")
    if method == "ngram":
        config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    elif method == "draft_model":
        config = {"model": target, "num_speculative_tokens": 3}  # itself: its greedy drafts are the target's
    else:
        head = head_config(json.loads((tmp_path / "target" / "config.json").read_text()), True,
                           eagle_aux_hidden_state_layer_ids=[0, 1, 1])
        config = {"method": "eagle3", "model": save_head(tmp_path / "head", head, random_head(head, True)),
                  "num_speculative_tokens": 3}
    args = dict(dtype="float32", device="cuda", kv_cache_memory_bytes=64 << 20, max_num_seqs=8, max_model_len=256)
    plain = LLM(target, **args)
    spec = draft_always(LLM(target, speculative_config=config, **args))
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, size=n).tolist() for n in (5, 17, 40)] + [[7, 8, 9] * 6]
    greedy, seeded = (SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                      SamplingParams(temperature=0.8, seed=3, max_tokens=24, ignore_eos=True))
    assert token_ids(spec, prompts, greedy) == token_ids(plain, prompts, greedy)
    drafted = counts(spec)
    assert drafted.num_draft_tokens > 0
    if method == "draft_model":  # up to the kernels' rounding in other batch shapes
        assert drafted.num_accepted_tokens > 0.8 * drafted.num_draft_tokens
    assert token_ids(spec, prompts, seeded) == token_ids(plain, prompts, seeded)
    assert spec.llm_engine.scheduler.block_pool.num_used_blocks == 0
