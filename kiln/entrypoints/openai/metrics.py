"""Prometheus metrics of one server, in a registry of its own (never the process-global one).

Engine gauges (running/waiting requests, KV blocks, prefix-cache hit rate) are read from the
engine's latest stats at scrape time; latencies and token counts are recorded by the handlers as
each request finishes, through ``RequestTimer``. Several frontend processes
(``server.api_server_count``) record into prometheus-client's multiprocess files
(``MULTIPROCESS_ENV`` names their directory, set before the frontends start), so any frontend's
``/metrics`` shows the sums over all of them.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Optional

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector

MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # read by prometheus_client when it is first imported

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class _EngineCollector:
    """Gauges read from the engine's stats when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], dict], healthy: Callable[[], bool]):
        self._stats = stats
        self._healthy = healthy

    def collect(self):
        s = self._stats()
        num_blocks = s.get("num_blocks", 0)
        # Block 0 is the pool's null block: never lent, so never free either.
        num_usable = s.get("num_usable_blocks", max(0, num_blocks - 1))
        gauges = [
            ("kiln_num_requests_running", "Requests the engine is running.", s.get("num_running", 0)),
            ("kiln_num_requests_waiting", "Requests waiting to be scheduled.", s.get("num_waiting", 0)),
            ("kiln_kv_blocks_in_use", "KV cache blocks held by requests.",
             num_usable - s.get("num_free_blocks", num_usable)),
            ("kiln_kv_blocks_total", "KV cache blocks that requests can use.", num_usable),
            ("kiln_prefix_cache_hit_rate", "Share of prompt tokens served from the prefix cache.",
             s.get("prefix_cache_hit_rate", 0.0)),
            ("kiln_engine_healthy", "1 while the engine thread runs, 0 once it has died or stopped.",
             1 if self._healthy() else 0),
            ("kiln_compile_building", "1 while kiln's forward is built in the background (compile.startup "
             "fast, or auto on a cold start; steps run eagerly until it is built), else 0.", s.get("compile_building", 0)),
        ]
        for name, doc, value in gauges:
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(value))
            yield g
        yield from _spec_decode_counters(s)
        yield from _replica_metrics(s.get("replicas", []))


def _replica_metrics(replicas: list[dict]):
    """Each data-parallel replica's own (``parallel.data_parallel_size``; none without it); the
    gauges above sum the live ones."""
    if not replicas:
        return
    families = [
        (GaugeMetricFamily, "kiln_dp_replica_healthy", "1 while the replica's engine core runs, else 0.", "healthy"),
        (GaugeMetricFamily, "kiln_dp_replica_num_requests_running", "Requests the replica is running.", "num_running"),
        (GaugeMetricFamily, "kiln_dp_replica_num_requests_waiting", "Requests waiting at the replica.", "num_waiting"),
        (CounterMetricFamily, "kiln_dp_replica_requests_routed", "Requests the frontend sent to the replica.",
         "num_routed"),
    ]
    for family, name, doc, key in families:
        m = family(name, doc, labels=["replica"])
        for i, r in enumerate(replicas):
            m.add_metric([str(i)], float(r.get(key, 0)))
        yield m


def _spec_decode_counters(s: dict):
    """Speculative decoding since start (kiln.runtime.spec_stats); zeros while it is off."""
    counters = [
        ("kiln_spec_decode_num_drafts", "Verifications of a request that had proposed tokens.", "spec_num_drafts"),
        ("kiln_spec_decode_num_draft_tokens", "Tokens proposed.", "spec_num_draft_tokens"),
        ("kiln_spec_decode_num_accepted_tokens", "Proposed tokens the target model kept.", "spec_num_accepted_tokens"),
    ]
    for name, doc, key in counters:
        c = CounterMetricFamily(name, doc)
        c.add_metric([], float(s.get(key, 0)))
        yield c
    per_position = CounterMetricFamily("kiln_spec_decode_num_accepted_tokens_per_pos",
                                       "Proposed tokens kept, by position in the proposal (0: the first).",
                                       labels=["position"])
    for position, count in enumerate(s.get("spec_accepted_per_position", [])):
        per_position.add_metric([str(position)], float(count))
    yield per_position


class ServerMetrics:
    def __init__(self, stats: Callable[[], dict], healthy: Callable[[], bool]):
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(stats, healthy))
        r = self.registry
        if os.environ.get(MULTIPROCESS_ENV):
            # Recorded into the shared files (the metrics below go in a registry nobody reads);
            # scraped as the sums over every frontend's files.
            MultiProcessCollector(self.registry)
            r = CollectorRegistry()
        self.ttft = Histogram("kiln_time_to_first_token_seconds", "Time from arrival to the first token.",
                              buckets=_LATENCY_BUCKETS_S, registry=r)
        self.tpot = Histogram("kiln_time_per_output_token_seconds", "Mean time between output tokens of a request.",
                              buckets=_TPOT_BUCKETS_S, registry=r)
        self.e2e = Histogram("kiln_e2e_request_latency_seconds", "Time from arrival to the last token.",
                             buckets=_LATENCY_BUCKETS_S, registry=r)
        self.prompt_tokens = Counter("kiln_prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter("kiln_generation_tokens", "Tokens generated.", registry=r)
        self.requests = Counter("kiln_requests", "Finished samples (choices) by finish reason; abort counts "
                                "requests dropped by their client.", ["finish_reason"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> "RequestTimer":
        return RequestTimer(self)


class RequestTimer:
    """Times one engine request: call ``token()`` on each output, ``finish()`` once at the end."""

    def __init__(self, metrics: ServerMetrics):
        self._metrics = metrics
        self.arrival = time.monotonic()
        self.first_token: Optional[float] = None

    def token(self, num_output_tokens: int) -> None:
        if self.first_token is None and num_output_tokens > 0:
            self.first_token = time.monotonic()
            self._metrics.ttft.observe(self.first_token - self.arrival)

    def finish(self, num_prompt_tokens: int, num_output_tokens: list[int], finish_reasons: list[str]) -> None:
        now = time.monotonic()
        m = self._metrics
        m.e2e.observe(now - self.arrival)
        longest = max(num_output_tokens, default=0)
        if self.first_token is not None and longest > 1:
            m.tpot.observe((now - self.first_token) / (longest - 1))
        m.prompt_tokens.inc(num_prompt_tokens)
        m.generation_tokens.inc(sum(num_output_tokens))
        for reason in finish_reasons:
            m.requests.labels(finish_reason=reason or "abort").inc()

    def abort(self) -> None:
        """The request ended before it finished (client gone, error)."""
        self._metrics.requests.labels(finish_reason="abort").inc()
