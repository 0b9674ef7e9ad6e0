"""Online serving benchmark: requests sent at a given rate (Poisson arrivals) or concurrency to
any OpenAI-compatible /v1/completions endpoint, streamed; reports throughput and the p50 / p90 /
p99 of time to first token (TTFT), inter-token latency (ITL: the gap between streamed chunks),
time per output token (TPOT: (end - first token) / (output tokens - 1), per request) and end-to-end
latency, like vLLM's serving benchmark; and the latency of GET /health polled meanwhile, which
shows whether the server's event loop waits on model steps.

Requests: random token-id prompts of --input-len tokens, --output-len tokens each (ignore_eos),
sent as token ids so both lengths are exact. Without --url it starts `octavo serve` on the
default model (or --model) on a free local port and stops it afterwards. Each --request-rate
(requests/s; inf = all at once) is one run of --num-prompts requests, with prompts of its own:
reused prompts would hit the prefix cache and skip their prefill.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestResult:
    ok: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=None, help="server base URL (default: start octavo serve locally)")
    parser.add_argument("--model", default=None, help="model name for requests (default: the server's first); "
                        "without --url, the model directory octavo serve loads")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--request-rate", type=float, nargs="+", default=[math.inf],
                        help="requests per second, one run each (inf: send all at once)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    parser.add_argument("--vocab-range", type=int, nargs=2, default=(100, 20000),
                        help="prompt token ids are drawn from [LOW, HIGH)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--server-args", default="", help="extra octavo serve options when it is started here")
    parser.add_argument("--offline-baseline", action="store_true",
                        help="afterwards, with the server stopped, time the same requests through LLM.generate "
                             "in this process: the engine's ceiling without HTTP")
    parser.add_argument("--result-json", default=None, help="write every run's figures to this file")


def make_prompts(num: int, length: int, vocab_range: tuple[int, int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return rng.integers(vocab_range[0], vocab_range[1], (num, length)).tolist()


async def send_one(client, url: str, model: str, prompt: list[int], output_len: int) -> RequestResult:
    import httpx

    result = RequestResult()
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0.0,
            "stream": True, "stream_options": {"include_usage": True}}
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    result.error = chunk["error"]["message"]
                    return result
                if chunk.get("usage"):
                    result.output_tokens = chunk["usage"]["completion_tokens"]
                if not any(c.get("text") for c in chunk.get("choices", [])):
                    continue
                now = time.perf_counter()
                if result.ttft == 0.0:
                    result.ttft = now - start
                else:
                    result.itl.append(now - last)
                last = now
        result.latency = time.perf_counter() - start
        result.ok = True
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_rate(url: str, model: str, prompts, output_len: int, rate: float, max_concurrency: int | None,
                   headers: dict, seed: int) -> tuple[list[RequestResult], float, list[float]]:
    """(per-request results, seconds, GET /health latencies sampled every 50 ms meanwhile: the
    server's event loop must answer while model steps run)."""
    import httpx

    rng = np.random.default_rng(seed)
    limit = asyncio.Semaphore(max_concurrency or len(prompts))

    async def limited(client, prompt):
        async with limit:
            return await send_one(client, url, model, prompt, output_len)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits, headers=headers) as client:
        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(client, prompt)))
            if math.isfinite(rate):
                await asyncio.sleep(rng.exponential(1.0 / rate))
        health: list[float] = []
        probe = asyncio.create_task(_probe_health(client, url, tasks, health))
        results = await asyncio.gather(*tasks)
        seconds = time.perf_counter() - start
        await probe
        return results, seconds, health


async def _probe_health(client, url: str, tasks, latencies: list[float]) -> None:
    """At least once, then every 50 ms until the requests are done."""
    while True:
        sent = time.perf_counter()
        await client.get(f"{url}/health")
        latencies.append(time.perf_counter() - sent)
        if all(t.done() for t in tasks):
            return
        await asyncio.sleep(0.05)


def summarize(results: list[RequestResult], seconds: float, input_len: int, health: list[float]) -> dict:
    done = [r for r in results if r.ok]
    output = sum(r.output_tokens for r in done)

    def pct(values, unit=1e3):
        values = np.asarray(values) * unit
        if not len(values):
            return {"mean": float("nan"), "p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
        return {"mean": float(values.mean()), "p50": float(np.percentile(values, 50)),
                "p90": float(np.percentile(values, 90)), "p99": float(np.percentile(values, 99))}

    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {"completed": len(done), "failed": len(results) - len(done), "seconds": seconds,
            "request_throughput": len(done) / seconds, "output_throughput": output / seconds,
            "total_throughput": (output + input_len * len(done)) / seconds,
            "ttft_ms": pct([r.ttft for r in done]), "tpot_ms": pct(tpot),
            "itl_ms": pct([x for r in done for x in r.itl]), "e2e_s": pct([r.latency for r in done], unit=1.0),
            "health_ms": pct(health),
            "errors": sorted({r.error for r in results if not r.ok})[:5]}


def print_table(rows: list[tuple[float, dict]]) -> None:
    head = (f"{'rate':>6} {'done':>5} {'req/s':>6} {'out tok/s':>9} | {'TTFT p50':>8} {'p90':>7} {'p99':>7} ms | "
            f"{'ITL p50':>7} {'p90':>6} {'p99':>6} ms | {'TPOT p50':>8} ms | {'E2E p50':>7} {'p90':>6} {'p99':>6} s | "
            f"{'/health p50':>11} {'p99':>5} ms")
    print(head)
    print("-" * len(head))
    for rate, s in rows:
        t, i, p, e, h = s["ttft_ms"], s["itl_ms"], s["tpot_ms"], s["e2e_s"], s["health_ms"]
        print(f"{rate:>6} {s['completed']:>5} {s['request_throughput']:>6.2f} {s['output_throughput']:>9.1f} | "
              f"{t['p50']:>8.0f} {t['p90']:>7.0f} {t['p99']:>7.0f}    | {i['p50']:>7.1f} {i['p90']:>6.1f} "
              f"{i['p99']:>6.1f}    | {p['p50']:>8.1f}    | {e['p50']:>7.2f} {e['p90']:>6.2f} {e['p99']:>6.2f}   | "
              f"{h['p50']:>11.1f} {h['p99']:>5.1f}")


@contextlib.contextmanager
def local_server(model: str | None, server_args: str):
    """`octavo serve` on a free port; yields its URL."""
    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "octavo.entrypoints.cli", "serve", *([model] if model else []),
               "--port", str(port), "--uvicorn-log-level", "warning", *server_args.split()]
    process = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"octavo serve exited with {process.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("octavo serve did not start")
            time.sleep(0.3)
        yield url
    finally:
        process.terminate()
        process.wait(60)


def run(args: argparse.Namespace) -> list[dict]:
    import httpx

    with contextlib.ExitStack() as stack:
        url = args.url.rstrip("/") if args.url else stack.enter_context(local_server(args.model, args.server_args))
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = args.model if args.url and args.model else \
            httpx.get(f"{url}/v1/models", headers=headers).json()["data"][0]["id"]
        print(f"{url} model={model}: {args.num_prompts} requests of {args.input_len} prompt + "
              f"{args.output_len} output tokens, max concurrency {args.max_concurrency or 'unlimited'}")
        warm_up = make_prompts(2, args.input_len, tuple(args.vocab_range), args.seed + len(args.request_rate) + 1)
        asyncio.run(run_rate(url, model, warm_up, 4, math.inf, None, headers, args.seed))
        rows = []
        for k, rate in enumerate(args.request_rate):
            prompts = make_prompts(args.num_prompts, args.input_len, tuple(args.vocab_range), args.seed + k)
            results, seconds, health = asyncio.run(run_rate(url, model, prompts, args.output_len, rate,
                                                            args.max_concurrency, headers, args.seed))
            rows.append((rate, summarize(results, seconds, args.input_len, health)))
            print(f"rate {rate}: {rows[-1][1]['completed']} done, {rows[-1][1]['failed']} failed in {seconds:.1f} s")
        print_table(rows)
    results = [{"request_rate": r, **s} for r, s in rows]
    if args.offline_baseline:
        results.append(offline_baseline(args.model, prompts, args.output_len))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(results, f, indent=2)
    return results


def offline_baseline(model: str | None, prompts: list[list[int]], output_len: int) -> dict:
    """The last run's requests through ``LLM.generate`` (all at once, no HTTP) in a new engine,
    whose prefix cache has not seen them."""
    from octavo import LLM, SamplingParams

    llm = LLM(model=model)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([p[::-1] for p in prompts[:2]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    output = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"offline LLM.generate, same requests: {len(prompts) / seconds:.2f} req/s, {output / seconds:.1f} output tok/s")
    return {"offline_baseline": True, "seconds": seconds, "request_throughput": len(prompts) / seconds,
            "output_throughput": output / seconds}
