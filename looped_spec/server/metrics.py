"""Request-latency histograms (vLLM's names) and the /metrics registry of one server."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from looped_spec.engine.stats import PREFIX, EngineCollector
from looped_spec.request import RequestOutput

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   20.0, 40.0, 80.0)  # fmt: skip
#: a request's first token (queued behind others) and its whole answer (thousands of tokens) take minutes: up to
#: vLLM's largest bounds (2560 s for its time to first token, 7680 s end to end)
REQUEST_LATENCY_BUCKETS = (*LATENCY_BUCKETS, 160.0, 320.0, 640.0, 1280.0, 2560.0, 7680.0)


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
                              registry=self.registry, buckets=REQUEST_LATENCY_BUCKETS).labels(model_name)  # fmt: skip
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between streamed outputs.", labels,
                             registry=self.registry, buckets=LATENCY_BUCKETS).labels(model_name)  # fmt: skip
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Arrival to last token.", labels,
                             registry=self.registry, buckets=REQUEST_LATENCY_BUCKETS).labels(model_name)  # fmt: skip

    def exposed(self, extra_labels: dict[str, str] | None) -> CollectorRegistry:
        """The registry /metrics renders: every series of this server's, with `extra_labels` added (a replica's id)."""
        if not extra_labels:
            return self.registry
        exposed = CollectorRegistry()
        exposed.register(_Labelled(self.registry, extra_labels))
        return exposed

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


class _Labelled(Collector):
    """Another registry's metrics with constant labels added to every sample."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry = registry
        self.labels = labels

    def collect(self):
        for metric in self.registry.collect():
            labelled = Metric(metric.name, metric.documentation, metric.type, metric.unit)
            labelled.samples = [s._replace(labels={**s.labels, **self.labels}) for s in metric.samples]
            yield labelled
