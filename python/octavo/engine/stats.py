"""Engine metrics in Prometheus format, with vLLM's metric names under the ``octavo:`` prefix.

Only the engine thread writes them (after each step, add and abort); ``/metrics`` reads the
registry from the event loop. Gauges are snapshots, so a scrape never reads the native
scheduler while the engine thread is changing it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..outputs import RequestOutput
from ..speculative import SpecDecodingCounts

# Bucket bounds (seconds) as in vLLM's metrics, so dashboards built for it read these the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)


@dataclass
class _Timing:
    arrival: float
    last_token: float | None = None


class EngineStats:
    """The server's Prometheus registry and the bookkeeping that feeds it."""

    def __init__(self, engine, model_name: str = "octavo"):
        self._engine = engine
        self.registry = CollectorRegistry()
        labels = {"labelnames": ["model_name"], "registry": self.registry}

        def gauge(name, doc):
            return Gauge(f"octavo:{name}", doc, **labels).labels(model_name)

        def counter(name, doc):
            return Counter(f"octavo:{name}", doc, **labels).labels(model_name)

        def histogram(name, doc, buckets):
            return Histogram(f"octavo:{name}", doc, buckets=buckets, **labels).labels(model_name)

        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).")
        self.kv_used_blocks = gauge("kv_cache_used_blocks", "KV cache blocks referenced by requests.")
        self.prefix_hit_rate = gauge("prefix_cache_hit_rate", "Prompt tokens found in the prefix cache / looked up.")
        self.prefix_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.preemptions = counter("num_preemptions", "Requests preempted to free KV blocks.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of the requests that started.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens.")
        self.finished = Counter("octavo:request_success", "Finished requests, by finish reason.",
                                labelnames=["model_name", "finished_reason"], registry=self.registry)
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to last token.", E2E_BUCKETS)
        self.spec = _SpecDecodingMetrics(self.registry, model_name) if engine.speculative_config else None
        self._model_name = model_name
        self._timings: dict[str, _Timing] = {}
        self._native_seen = {"queries": 0, "hits": 0, "preemptions": 0}
        self.num_waiting = self.num_running = 0
        self.snapshot()

    # Called by the engine thread.

    def record_arrival(self, request_id: str, num_prompt_tokens: int, arrival: float) -> None:
        self._timings[request_id] = _Timing(arrival)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.snapshot()

    def record_abort(self, request_id: str) -> None:
        if self._timings.pop(request_id, None) is not None:
            self.finished.labels(self._model_name, "abort").inc()
        self.snapshot()

    def record_output(self, output: RequestOutput) -> None:
        """Counts a DELTA output (as AsyncLLM asks the engine for)."""
        timing = self._timings.get(output.request_id)
        if timing is None:
            return
        now = time.time()
        generated = sum(len(o.token_ids) for o in output.outputs)  # a delta: the new tokens
        if generated:
            self.generation_tokens.inc(generated)
            if timing.last_token is None:
                self.ttft.observe(now - timing.arrival)
            else:
                self.itl.observe(now - timing.last_token)
            timing.last_token = now
        if output.finished:
            del self._timings[output.request_id]
            self.e2e.observe(now - timing.arrival)
            reasons = {o.finish_reason for o in output.outputs}
            self.finished.labels(self._model_name, "stop" if "stop" in reasons else reasons.pop()).inc()

    def snapshot(self) -> None:
        """Copies the scheduler's and block pool's state (as the core's last step reported it)
        into the gauges and counters."""
        s = self._engine.stats
        self.num_waiting, self.num_running = s.num_waiting, s.num_running
        self.running.set(self.num_running)
        self.waiting.set(self.num_waiting)
        self.kv_usage.set(s.kv_cache_usage)
        self.kv_used_blocks.set(s.num_used_blocks)
        self._advance(self.prefix_queries, "queries", s.prefix_cache_queries)
        self._advance(self.prefix_hits, "hits", s.prefix_cache_hits)
        self._advance(self.preemptions, "preemptions", s.num_preemptions)
        self.prefix_hit_rate.set(s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0)
        if self.spec is not None and s.spec_decoding is not None:
            self.spec.advance(s.spec_decoding)

    def _advance(self, counter, key: str, total: int) -> None:
        """Native counters are running totals; Prometheus counters only increase."""
        if total > self._native_seen[key]:
            counter.inc(total - self._native_seen[key])
            self._native_seen[key] = total

    # Called by the event loop.

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _SpecDecodingMetrics:
    """vLLM's speculative decoding counters: drafts (requests' steps that verified some), draft
    tokens, accepted tokens, and accepted tokens by draft position."""

    def __init__(self, registry: CollectorRegistry, model_name: str):
        def counter(name, doc, *labels):
            return Counter(f"octavo:spec_decode_{name}", doc, labelnames=["model_name", *labels], registry=registry)

        self._model_name = model_name
        self.drafts = counter("num_drafts", "Requests' steps that verified draft tokens.").labels(model_name)
        self.draft_tokens = counter("num_draft_tokens", "Draft tokens verified.").labels(model_name)
        self.accepted = counter("num_accepted_tokens", "Draft tokens accepted.").labels(model_name)
        self.per_position = counter("num_accepted_tokens_per_pos", "Draft tokens accepted, by position in the draft.",
                                    "position")
        self._seen = SpecDecodingCounts()

    def advance(self, totals: SpecDecodingCounts) -> None:
        """The core's running totals -> increments since the last snapshot."""
        seen = self._seen
        self.drafts.inc(totals.num_drafts - seen.num_drafts)
        self.draft_tokens.inc(totals.num_draft_tokens - seen.num_draft_tokens)
        self.accepted.inc(totals.num_accepted_tokens - seen.num_accepted_tokens)
        now_counts = totals.accepted_per_position
        before = seen.accepted_per_position + [0] * (len(now_counts) - len(seen.accepted_per_position))
        for position, (now, then) in enumerate(zip(now_counts, before)):
            self.per_position.labels(self._model_name, str(position)).inc(now - then)
        self._seen = totals.snapshot()
