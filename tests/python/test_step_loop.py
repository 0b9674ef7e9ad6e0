"""The step loop (scheduler -> model runner -> sampler -> update) on a tiny random Llama:
greedy outputs equal transformers' for every prompt, whatever the batch, the token budget
(chunked prefill), prefix-cache hits or preemption on a small KV pool."""

import pytest
import torch

import octavo
from octavo.loader import load_model
from octavo.sampling_params import SamplingParams
from octavo.worker.model_runner import ModelRunner
from octavo.worker.sampler import SamplingState, sample
from test_models import tiny_checkpoint

GREEDY = SamplingParams(temperature=0.0)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    reference = tiny_checkpoint("llama", path)
    return path, reference


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 300, (32,), generator=gen).tolist()  # two full blocks: prefix-cache hits
    out = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (5, 17, 40, 1)]
    return out + [shared + [7, 8, 9], shared + [10]]


def hf_greedy(reference, prompt: list[int]) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(MAX_TOKENS):
            tokens.append(int(reference(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def run(path, batch: list[list[int]], num_blocks: int, budget: int) -> tuple[list[list[int]], octavo.Scheduler]:
    runner = ModelRunner(load_model(path, dtype="float32"), num_blocks=num_blocks, block_size=16)
    sched = octavo.Scheduler(octavo.SchedulerConfig(num_blocks=num_blocks, block_size=16, max_model_len=128,
                                                    max_num_seqs=8, max_num_batched_tokens=budget))
    states = {}
    for i, prompt in enumerate(batch):
        handle = sched.add_request(f"r{i}", prompt, max_tokens=MAX_TOKENS, ignore_eos=True)
        states[handle] = SamplingState(params=GREEDY, prompt_token_ids=prompt, seed=i)
    order = list(states)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        logits, _ = runner.execute(out)
        sampled = sample(logits, [states[h] for h in out.req_handles])
        update = sched.update_from_output(sampled.token_ids)
        offsets = update.new_token_offsets
        for i, handle in enumerate(update.req_handles):
            states[handle].output_token_ids += update.new_token_ids[offsets[i]:offsets[i + 1]].tolist()
    return [states[h].output_token_ids for h in order], sched


POOLS_AND_BUDGETS = [
    (64, 256),  # everything at once, prefix-cache hits on the shared prompts
    (64, 16),   # chunked prefill on a small token budget
    (12, 64),   # a pool too small for the batch: preemption and recompute
]


def assert_greedy_matches(path, reference, num_blocks: int, budget: int) -> None:
    batch = prompts()
    outputs, sched = run(path, batch, num_blocks, budget)
    assert outputs == [hf_greedy(reference, p) for p in batch]
    if num_blocks == 12:
        assert sched.num_preemptions > 0
    assert sched.block_pool.num_used_blocks == 0  # every block back in the pool (cached or free)


@pytest.mark.parametrize("num_blocks,budget", POOLS_AND_BUDGETS)
def test_greedy_outputs_match_transformers(checkpoint, num_blocks, budget):
    assert_greedy_matches(*checkpoint, num_blocks, budget)


def assert_batch_invariant(path) -> None:
    batch = prompts()
    together, _ = run(path, batch, 64, 64)
    assert [run(path, [p], 64, 64)[0][0] for p in batch] == together


def test_output_is_the_same_alone_and_in_a_batch(checkpoint):
    assert_batch_invariant(checkpoint[0])
