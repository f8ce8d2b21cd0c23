"""Prometheus metrics of one server: its own counters plus whatever ``engine.stats()`` reports.

A private ``CollectorRegistry`` per app, so two apps in one process (tests, Ray replicas) never share
counters. The server counts what it sees (requests by outcome, answers, TTFT and latency, cache hits
per tier from each answer, streams open now); the engine's own gauges (queue depth, active rows,
bytes per tier...) are read from ``engine.stats()`` at scrape time and exported as ``ctx_engine_*``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


def _flatten(prefix: str, value: Any, out: dict[str, float]) -> None:
    if isinstance(value, bool):
        out[prefix] = float(value)
    elif isinstance(value, (int, float)):
        out[prefix] = float(value)
    elif isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}_{key}" if prefix else str(key), inner, out)


class _EngineStatsCollector:
    """Turns the numeric leaves of ``stats()`` into gauges named ``ctx_engine_<path>``."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self._stats = stats

    def collect(self):  # noqa: ANN201 (prometheus_client's collector protocol)
        flat: dict[str, float] = {}
        _flatten("", self._stats(), flat)
        for key, value in sorted(flat.items()):
            name = "ctx_engine_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)
            family = GaugeMetricFamily(name, f"engine.stats()[{key!r}]")
            family.add_metric([], value)
            yield family


class ServerMetrics:
    """The server's counters; ``render()`` is the ``/metrics`` body."""

    content_type = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self, engine_stats: Callable[[], dict[str, Any]]):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("ctx_serve_requests", "HTTP requests by endpoint and outcome",
                                ["endpoint", "outcome"], registry=r)
        self.answers = Counter("ctx_serve_answers", "answers produced, by decoding mode", ["mode"], registry=r)
        self.tokens = Counter("ctx_serve_generated_tokens", "tokens generated in finished answers", registry=r)
        self.ttft = Histogram("ctx_serve_ttft_seconds", "time to first token of each answer (engine timing)",
                              buckets=_BUCKETS, registry=r)
        self.latency = Histogram("ctx_serve_request_seconds", "wall time of each request in the server",
                                 ["endpoint"], buckets=_BUCKETS, registry=r)
        self.cache_hits = Counter("ctx_serve_cache_hits", "document KV caches reused, by tier", ["tier"], registry=r)
        self.cache_misses = Counter("ctx_serve_cache_misses", "document KV caches computed", registry=r)
        self.in_flight = Gauge("ctx_serve_in_flight_requests", "requests accepted and not finished", registry=r)
        self.waiting = Gauge("ctx_serve_waiting_requests",
                             "requests accepted that have no first token yet (the server's view of queue depth)",
                             registry=r)
        self.active_streams = Gauge("ctx_serve_active_streams", "server-sent-event streams open now", registry=r)
        r.register(_EngineStatsCollector(engine_stats))

    def observe_answer(self, answer: dict[str, Any]) -> None:
        """Count one finished answer (an ``Answer.to_dict()``)."""
        self.answers.labels(answer.get("mode", "?")).inc()
        timings = answer.get("timings", {})
        self.tokens.inc(float(timings.get("new_tokens", len(answer.get("token_ids", [])))))
        if "ttft_s" in timings:
            self.ttft.observe(float(timings["ttft_s"]))
        cache = answer.get("cache", {})
        by_tier = cache.get("hits_by_tier")
        if by_tier:
            for tier, hits in by_tier.items():
                self.cache_hits.labels(str(tier)).inc(float(hits))
        elif cache.get("hits"):
            self.cache_hits.labels("any").inc(float(cache["hits"]))
        self.cache_misses.inc(float(cache.get("misses", 0)))

    def render(self) -> bytes:
        return generate_latest(self.registry)
