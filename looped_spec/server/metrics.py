"""Request-latency histograms (vLLM's names) and the /metrics registry of one server."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Histogram

from looped_spec.engine.stats import PREFIX, EngineCollector
from looped_spec.request import RequestOutput

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   20.0, 40.0, 80.0)  # fmt: skip


class ServerMetrics:
    """One registry per server: the engine's counters and gauges, plus latencies seen by clients.

    Inter-token latency is observed once per streamed output; a speculative round that commits
    several tokens at once counts as one gap, as vLLM does for multi-token steps.
    """

    def __init__(self, engine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name))
        labels = ["model_name"]
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Time to first token.", labels,
                              registry=self.registry, buckets=LATENCY_BUCKETS).labels(model_name)  # fmt: skip
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between streamed outputs.", labels,
                             registry=self.registry, buckets=LATENCY_BUCKETS).labels(model_name)  # fmt: skip
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token.", labels,
                             registry=self.registry, buckets=LATENCY_BUCKETS).labels(model_name)  # fmt: skip

    async def timed(self, outputs: AsyncIterator[RequestOutput], arrival: float) -> AsyncIterator[RequestOutput]:
        """Pass outputs through, observing TTFT, inter-token and end-to-end latency."""
        last = None
        async for out in outputs:
            if out.new_token_ids:
                t = time.perf_counter()
                (self.ttft if last is None else self.itl).observe(t - (arrival if last is None else last))
                last = t
            if out.finished and out.finish_reason in ("stop", "length"):
                self.e2e.observe(time.perf_counter() - arrival)
            yield out
