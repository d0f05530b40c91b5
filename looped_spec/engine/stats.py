"""Engine counters as a plain dict, and their Prometheus export through `prometheus_client`.

The engine keeps plain Python counters on the hot path; `EngineCollector` turns them (and the live
scheduler, KV and controller state) into metric families only when `/metrics` is scraped, so the
exported counters are exactly `engine.stats`. Names follow vLLM's where the meaning is the same,
with the `looped_spec:` prefix.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from copy import copy
from dataclasses import dataclass, field, fields
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

# loop-level batching adds the stages of its passes (within "decode"): embedding the entering tokens, the loops,
# finishing (readouts, draws, acceptance)
PHASES = ("schedule", "prefill", "decode", "draft", "verify", "accept", "commit", "control", "pass_embed",
          "pass_loops", "pass_finish")  # fmt: skip
BATCH_SIZE_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFIX = "looped_spec:"


#: bucket upper bounds (seconds) of the engine's latency histograms
LATENCY_BOUNDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class Latencies:
    """A latency histogram: counts per bucket of `LATENCY_BOUNDS` (the last: above them), their sum and count."""

    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, seconds: float, times: int = 1) -> None:
        index = next((i for i, b in enumerate(LATENCY_BOUNDS) if seconds <= b), len(LATENCY_BOUNDS))
        self.buckets[index] += times
        self.total += seconds * times
        self.count += times

    @property
    def mean(self) -> float:
        return self.total / self.count if self.count else 0.0


@dataclass
class EngineStats:
    """Cumulative counters of one engine."""

    num_requests_finished: int = 0  # by a stop condition or length (not aborted, not failed)
    num_requests_failed: int = 0  # finished with an error of their own (docs/architecture.md "Failure semantics")
    num_prompt_tokens: int = 0  # prompt (and recomputed) tokens run through prefill
    num_generation_tokens: int = 0
    num_prefill_steps: int = 0
    num_rounds: int = 0  # decode rounds, plain or speculative (loop passes: plans taken, record_plan)
    num_spec_rounds: int = 0
    num_drafts: int = 0  # (request, round) pairs that drafted at least one token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_preemptions: int = 0
    # loop-level batching: loop passes, the positions they ran over (occupancy = positions / passes), and the
    # tokens they embedded (entered loop 1)
    num_loop_passes: int = 0
    num_loop_passes_captured: int = 0  # of those, replayed from a captured graph (CUDA by default)
    num_loop_pass_positions: int = 0
    num_loop_pass_embeds: int = 0
    # per request, seconds from admission (add_request) to its first generated token, and between its later tokens
    # (a commit of several tokens, a speculative round, spreads its gap over them), as the engine commits them
    time_to_first_token: Latencies = field(default_factory=Latencies)
    inter_token_latency: Latencies = field(default_factory=Latencies)
    accepted_per_position: Counter = field(default_factory=Counter)  # draft position (0-based) -> accepted
    batch_size_histogram: Counter = field(default_factory=Counter)  # decode round batch size -> rounds
    plan_histogram: Counter = field(default_factory=Counter)  # "K,d" -> rounds
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    # early exit: generated tokens per readout depth, and the loops their own forwards ran / skipped
    exit_depth_histogram: Counter = field(default_factory=Counter)
    num_exit_loops_run: int = 0
    num_exit_loops_saved: int = 0  # skip mode only: select runs every loop
    # speculation with early exit: accepted draft tokens the target itself drew (their position exited within
    # the draft's d loops), so they needed no verification
    num_exit_draft_decided: int = 0

    def count_exits(self, depths: list[int], full_depth: int, skipped: bool) -> None:
        for depth in depths:
            self.exit_depth_histogram[depth] += 1
            run = depth if skipped else full_depth
            self.num_exit_loops_run += run
            self.num_exit_loops_saved += full_depth - run

    @property
    def mean_loops_per_token(self) -> float:
        """Loops run per token read out by the early-exit path (0 when none was)."""
        total = sum(self.exit_depth_histogram.values())
        return self.num_exit_loops_run / total if total else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def record_plan(self, batch_size: int, k: int, d: int) -> None:
        """A decode round's plan (on loop passes: a plan the requests entering a pass run their rounds under)."""
        self.num_rounds += 1
        self.num_spec_rounds += k > 0
        self.batch_size_histogram[batch_size] += 1
        self.plan_histogram[f"{k},{d if k else 0}"] += 1

    def record_drafts(self, draft_lens: list[int], accepted: list[int]) -> None:
        """One round's per-request draft lengths and accepted counts (a prefix of each draft is accepted)."""
        self.num_drafts += sum(1 for k in draft_lens if k > 0)
        self.num_draft_tokens += sum(draft_lens)
        self.num_accepted_tokens += sum(accepted)
        for a in accepted:
            for position in range(a):
                self.accepted_per_position[position] += 1

    def to_dict(self) -> dict:
        """Every counter (histograms as dicts sorted by key), plus `acceptance_rate` and `mean_loops_per_token`."""
        # not dataclasses.asdict: it rebuilds a Counter from its (key, count) pairs, counting the pairs
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        for key, value in out.items():
            if isinstance(value, Latencies):
                value = {"count": value.count, "sum": value.total, "buckets": dict(zip((*LATENCY_BOUNDS, "inf"),
                                                                                       value.buckets))}  # fmt: skip
            out[key] = dict(sorted(value.items())) if isinstance(value, Counter) else copy(value)
        out.update(acceptance_rate=self.acceptance_rate, mean_loops_per_token=self.mean_loops_per_token)
        return out

    def to_prometheus(self, model_name: str = "", full_depth: int | None = None) -> str:
        """Prometheus text exposition of these counters alone (no live engine state); `full_depth` (the model's
        D) gives the exit-depth histogram a bucket per depth 1..D, else per depth up to the deepest seen."""
        registry = CollectorRegistry(auto_describe=False)
        registry.register(StatsCollector(self, model_name, full_depth))
        return generate_latest(registry).decode()


def _counter(name: str, doc: str, value: float, labels: dict[str, str]) -> CounterMetricFamily:
    family = CounterMetricFamily(PREFIX + name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def _gauge(name: str, doc: str, value: float, labels: dict[str, str]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(PREFIX + name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def _histogram(name: str, doc: str, counts: dict[int, int], bounds, labels: dict[str, str]) -> HistogramMetricFamily:
    """A histogram of integer observations kept as value -> count, with the given bucket upper bounds."""
    counts = dict(counts)
    buckets = [(str(b), sum(c for value, c in counts.items() if value <= b)) for b in bounds]
    buckets.append(("+Inf", sum(counts.values())))
    family = HistogramMetricFamily(PREFIX + name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), buckets, sum(value * c for value, c in counts.items()))
    return family


def _latency(name: str, doc: str, latencies: Latencies, labels: dict[str, str]) -> HistogramMetricFamily:
    cumulative, buckets = 0, []
    for bound, count in zip((*LATENCY_BOUNDS, "+Inf"), latencies.buckets):
        cumulative += count
        buckets.append((str(bound), cumulative))
    family = HistogramMetricFamily(PREFIX + name, doc, labels=list(labels))
    family.add_metric(list(labels.values()), buckets, latencies.total)
    return family


class StatsCollector(Collector):
    """`EngineStats` counters; read at scrape time (prometheus_client escapes label values)."""

    def __init__(self, stats: EngineStats, model_name: str, full_depth: int | None = None) -> None:
        self.stats = stats
        self.model_name = model_name
        self.full_depth = full_depth

    def collect(self) -> Iterator[Metric]:
        s, labels = self.stats, {"model_name": self.model_name}
        yield _counter("request_success", "Requests finished by a stop condition or length.",
                       s.num_requests_finished, labels)  # fmt: skip
        yield _counter("request_failure", "Requests finished with an error of their own.", s.num_requests_failed,
                       labels)  # fmt: skip
        yield _counter("prompt_tokens", "Prefilled tokens (including recomputation).", s.num_prompt_tokens, labels)
        yield _counter("generation_tokens", "Generated tokens.", s.num_generation_tokens, labels)
        yield _counter("num_preemptions", "Requests preempted for KV space.", s.num_preemptions, labels)
        yield _counter("decode_rounds", "Decode rounds (plain or speculative).", s.num_rounds, labels)
        yield _counter("spec_decode_rounds", "Speculative decode rounds.", s.num_spec_rounds, labels)
        yield _counter("spec_decode_num_drafts", "Drafts proposed (one per request and round).", s.num_drafts, labels)
        yield _counter("spec_decode_num_draft_tokens", "Draft tokens proposed.", s.num_draft_tokens, labels)
        yield _counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.", s.num_accepted_tokens, labels)
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Accepted draft tokens per draft position (0-based).",
            labels=["model_name", "position"],
        )
        for position, count in sorted(dict(s.accepted_per_position).items()):
            per_pos.add_metric([self.model_name, str(position)], count)
        yield per_pos
        phases = CounterMetricFamily(
            PREFIX + "phase_seconds", "Wall time per engine phase.", labels=["model_name", "phase"]
        )
        for phase, seconds in dict(s.phase_seconds).items():
            phases.add_metric([self.model_name, phase], seconds)
        yield phases
        yield _histogram("batch_size", "Decode-round batch sizes.", s.batch_size_histogram, BATCH_SIZE_BOUNDS, labels)
        yield _latency("engine_time_to_first_token_seconds", "Admission to first generated token, in the engine.",
                       s.time_to_first_token, labels)  # fmt: skip
        yield _latency("engine_inter_token_latency_seconds", "Between a request's generated tokens, in the engine.",
                       s.inter_token_latency, labels)  # fmt: skip
        yield _counter("loop_passes", "Loop passes (loop-level batching).", s.num_loop_passes, labels)
        yield _counter("loop_pass_positions", "Positions the loop passes ran over (occupancy = positions / passes).",
                       s.num_loop_pass_positions, labels)  # fmt: skip
        yield _counter("loop_passes_captured", "Loop passes replayed from a captured CUDA graph.",
                       s.num_loop_passes_captured, labels)  # fmt: skip
        yield _counter("loop_pass_embeds", "Tokens entering loop 1 in a loop pass.", s.num_loop_pass_embeds, labels)
        yield from self._exits()

    def _exits(self) -> Iterator[Metric]:
        """Early exit: readout depths as a histogram (a bucket per depth), loops run and saved.

        Mean loops per token = exit_loops_run_total / exit_depth_count (select mode runs every loop, so
        there it is D while the histogram shows the readout depths)."""
        s, labels = self.stats, {"model_name": self.model_name}
        depths = dict(s.exit_depth_histogram)  # one copy: the engine's thread may add a depth meanwhile
        bounds = range(1, max([self.full_depth or 0, *depths]) + 1)
        yield _histogram("exit_depth", "Readout depth (loops) of tokens generated with early exit.", depths, bounds,
                         labels)  # fmt: skip
        yield _counter("exit_loops_run", "Loops run by the forwards of tokens generated with early exit.",
                       s.num_exit_loops_run, labels)  # fmt: skip
        yield _counter("exit_loops_saved", "Loops skipped by early exit (skip mode).", s.num_exit_loops_saved, labels)
        yield _counter("exit_draft_decided", "Draft tokens drawn by the target itself (exit within the draft "
                       "depth): accepted without verification.", s.num_exit_draft_decided, labels)  # fmt: skip


class EngineCollector(StatsCollector):
    """`engine.stats` plus live state: running / waiting requests, KV usage and the plan per bucket."""

    def __init__(self, engine: Any, model_name: str) -> None:
        super().__init__(engine.stats, model_name, engine.adapter.full_depth)
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        yield from super().collect()
        engine, labels = self.engine, {"model_name": self.model_name}
        scheduler, kv = engine.scheduler, engine.kv
        yield _gauge("num_requests_running", "Requests in the running batch.", len(scheduler.running), labels)
        yield _gauge("num_requests_waiting", "Requests waiting for admission.", len(scheduler.waiting), labels)
        used = 1.0 - kv.num_free_blocks / kv.num_blocks if kv.num_blocks else 0.0
        yield _gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (1 = full).", used, labels)
        yield from self._plans()

    def _plans(self) -> Iterator[Metric]:
        """The plan each batch-size bucket runs now: K (0 = speculation off) and d (buckets that ran)."""
        k_family = GaugeMetricFamily(PREFIX + "spec_plan_k", "Current draft length K per batch-size bucket "
                                     "(0 = speculation off).", labels=["model_name", "bucket"])  # fmt: skip
        d_family = GaugeMetricFamily(
            PREFIX + "spec_plan_d", "Current draft depth d per batch-size bucket.", labels=["model_name", "bucket"]
        )
        controller = self.engine.controller
        buckets = controller.stats().get("buckets")
        if buckets is None and hasattr(controller, "k"):  # a fixed plan: one bucket for every batch size
            buckets = [{"batch": "all", "k": controller.k, "d": controller.d}]
        for bucket in buckets or []:
            if bucket["k"] is None:  # no batch of this size has run yet: no plan to report
                continue
            k_family.add_metric([self.model_name, str(bucket["batch"])], bucket["k"])
            d_family.add_metric([self.model_name, str(bucket["batch"])], bucket["d"])
        yield k_family
        yield d_family
