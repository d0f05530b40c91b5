"""Timing the pass-cost profile (control/passcost.py) on the machine the engine will run on.

1. Steps (`measure_steps`): requests are prefilled to two contexts (lower where the model has few positions);
   runner steps of every shape of the grid (r requests × q positions each) are timed in four kinds — tokens with
   one loop, tokens with up to three loops, tokens with one loop and a readout, a state with one loop — each the
   fastest of `BURST` runs back to back (decoding runs steps of one shape after another, its weights warm), in a
   shuffled order per repeat, the first repeat dropped, the median kept. They cover widths and contexts the rounds
   below do not reach.
2. Rounds (`measure_rounds`): plain decoding and a few (K, d) plans decode batches of tuning prompts at the
   profiled batch sizes, one persistent engine per plan and batch size, all taking turns of one round in a
   shuffled order, so every cell is timed in the same machine state; a round's time inside the runner and
   outside it are kept apart.
3. Fit (`fit_profile`): the pass, step and readout coefficients by one non-negative least-squares fit of relative
   errors over the rounds' time inside the runner and, weighted `STEP_WEIGHT`, the steps (timed apart from the
   rounds, so with a scale factor of their own); the outside terms over the rounds' time outside the runner.
   The rounds weigh the shapes decoding really runs; the steps keep the curve sane where no round went.
4. `validate`: the profile's predicted round seconds against the timed rounds, per (K, d, B), also relative to
   plain decoding's at the same B (what decides between plans).
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from looped_spec.control.controller import FixedController
from looped_spec.control.passcost import OUTSIDE, PassCost
from looped_spec.control.plan import RoundFeedback
from looped_spec.engine import step_decoding
from looped_spec.engine.config import SpeculativeConfig
from looped_spec.engine.engine import LoopedSpecEngine
from looped_spec.execution.kv_cache import KVCache
from looped_spec.execution.model_runner import StepInput
from looped_spec.execution.timing import Span, Stopwatch
from looped_spec.models.adapter import ModelAdapter
from looped_spec.presets.schema import CostConfig
from looped_spec.sampling_params import SamplingParams

#: The grid of timed steps: requests per step (draft and plain steps: one position each) ...
REQUESTS = (1, 2, 4, 8, 16, 32, 64)
#: ... and positions per request (verify steps: K + 1 each)
QUERIES = (1, 2, 4, 8)
#: Grid of pass widths the curve w(n) is fitted on
WIDTHS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
#: Weight of a timed step against a timed round in the fit
STEP_WEIGHT = 0.3
#: Most alternations of the fit and the steps' machine-state factor (it settles within a few dozen; stopped after a few,
#: round prices stay ~1 % off with steps timed 1.3x slower: tests/test_tuner.py)
SCALE_ITERATIONS = 100
#: Mean contexts (tokens in the KV per request) the steps are timed at
CONTEXTS = (16, 200)
#: Runs of one step back to back, of which the fastest is kept
BURST = 3
#: A plan's price relative to plain decoding off by more than this in the profile's own check says the machine's
#: speed moved while it was timed (docs/benchmarking.md, "Re-timing on a moody machine"): the tuner warns
TRUSTED_ERROR = 0.10


def _nonnegative_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (active set: drop the most negative, refit, until none is)."""
    free = np.ones(a.shape[1], dtype=bool)
    coef = np.zeros(a.shape[1])
    while free.any():
        sol, *_ = np.linalg.lstsq(a[:, free], y, rcond=None)
        if (sol >= 0.0).all():
            coef[free] = sol
            break
        free[np.flatnonzero(free)[int(np.argmin(sol))]] = False
    return coef


def _robust_fit(rows: np.ndarray, seconds: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """Non-negative fit of seconds ≈ rows @ coef minimising (weighted) relative error, reweighted so a few
    outlying timings (a stalled step) do not drag it."""
    weight = (1.0 if weights is None else weights) / seconds
    coef = _nonnegative_lstsq(rows * weight[:, None], seconds * weight)
    for _ in range(8):
        rel = np.abs(rows @ coef - seconds) / seconds
        w = weight / np.sqrt(np.maximum(rel, 0.02))
        coef = _nonnegative_lstsq(rows * w[:, None], seconds * w)
    return coef


class _Steps:
    """Requests prefilled to each context, and a runner to time steps over them."""

    def __init__(self, adapter: ModelAdapter, contexts: Sequence[int], seed: int) -> None:
        requests, longest = max(REQUESTS), max(QUERIES)
        blocks = (max(contexts) + longest) // 16 + 2
        self.engine = engine = LoopedSpecEngine(
            adapter, speculation="off", max_batch_size=requests * len(contexts),
            num_kv_blocks=blocks * requests * len(contexts) + 8, max_num_batched_tokens=4096,
        )  # fmt: skip
        rng = random.Random(seed)
        vocab = adapter.vocab_size
        params = SamplingParams(max_tokens=1 << 16, ignore_eos=True)
        # contexts spread around each mean, as a real batch's are (a batch of equal contexts skips the mask)
        ids = {
            c: [engine.add_request([rng.randrange(3, vocab) for _ in range(c + (i % 5 - 2) * c // 8)], params)
                for i in range(requests)]
            for c in contexts
        }  # fmt: skip
        scheduler = engine.scheduler
        while (batch := scheduler.schedule()) is not None and batch.is_prefill:
            step_decoding.prefill_step(engine, None, batch)
        self.requests = {c: [engine._requests[i] for i in ids[c]] for c in contexts}
        for group in self.requests.values():
            for r in group:
                engine.kv.grow(r.block_table, r.num_computed + longest)
        self.runner = engine.runner
        self.vocab = vocab
        self.states: dict[tuple[int, int, int], torch.Tensor] = {}

    def state(self, context: int, r: int, q: int) -> torch.Tensor:
        """A loop state of the step's shape (from a real embedding) for the state-continuing steps."""
        key = (context, r, q)
        if key not in self.states:
            group = self.requests[context][:r]
            tokens = torch.randint(3, self.vocab, (r * q,), device=self.runner.device)
            ctx = self.runner.context(group, [q] * r, [x.num_computed + q for x in group])
            with torch.inference_mode():
                self.states[key] = self.runner.embed(tokens, ctx)
        return self.states[key]

    def time(self, context: int, r: int, q: int, loops: int, readout: bool, tokens: bool) -> tuple[float, float]:
        """(seconds, mean context) of one step, the fastest of `BURST` run back to back."""
        group = self.requests[context][:r]
        n = r * q
        lens = [x.num_computed + q for x in group]
        if tokens:
            ids = torch.randint(3, self.vocab, (n,), device=self.runner.device)
            inp = StepInput(group, [q] * r, lens, 0, loops, tokens=ids, readout=readout)
        else:
            inp = StepInput(group, [q] * r, lens, 0, loops, state=self.state(context, r, q), readout=readout)
        sync = torch.cuda.synchronize if self.runner.device.type == "cuda" else (lambda: None)
        best = float("inf")
        with torch.inference_mode():
            for _ in range(BURST):
                sync()
                t0 = time.perf_counter()
                self.runner.run(inp)
                sync()
                best = min(best, time.perf_counter() - t0)
        return best, sum(x.num_computed for x in group) / r


def step_contexts(max_positions: int) -> list[int]:
    """`CONTEXTS`, each lowered where the model has too few positions for it: a request's context (spread up to a
    quarter above its mean, `_Steps`) and a step's positions after it must fit its max_positions."""
    fits = (max_positions - max(QUERIES) - 1) * 4 // 5
    return sorted({max(min(c, fits), 8) for c in CONTEXTS})


def measure_steps(adapter: ModelAdapter, repeats: int, seed: int = 0, bar=None) -> list[dict[str, Any]]:
    """The timed medians of every step shape and kind (see the module docstring)."""
    loops = min(3, adapter.full_depth)
    means = step_contexts(adapter.max_positions)
    steps = _Steps(adapter, means, seed)
    kinds = {
        "one": (1, False, True),
        "many": (loops, False, True),
        "readout": (1, True, True),
        "state": (1, False, False),
    }
    cases = [(c, r, q, kind) for c in means for r in REQUESTS for q in QUERIES for kind in kinds]
    rng = random.Random(seed)
    times: dict[tuple, list[float]] = {}
    contexts: dict[tuple, float] = {}
    for repeat in range(repeats + 1):
        rng.shuffle(cases)
        for case in cases:
            seconds, mean = steps.time(case[0], case[1], case[2], *kinds[case[3]])
            if repeat:  # the first repeat warms caches and allocators
                times.setdefault(case, []).append(seconds)
                contexts[case] = mean
        if bar is not None:
            bar.update(1)
    steps.engine.close()
    out = []
    for case, values in times.items():
        _, r, q, kind = case
        n_loops, readout, tokens = kinds[kind]
        out.append({"requests": r, "positions": q, "loops": n_loops, "readout": readout, "embeds": tokens,
                    "context": round(contexts[case], 1), "seconds": statistics.median(values)})  # fmt: skip
    return out


def _step_rows(cost: PassCost, steps: Sequence[dict[str, Any]]) -> np.ndarray:
    rows = []
    for s in steps:
        r, n = s["requests"], s["requests"] * s["positions"]
        row = s["loops"] * cost.pass_features(r, n, s["context"])[0] + cost.step_features(r, n, float(s["embeds"]))[0]
        rows.append(row + (cost.readout_features(n)[0] if s["readout"] else 0.0))
    return np.array(rows)


def _rounded(values) -> list[float]:
    return [float(f"{max(float(v), 0.0):.4g}") for v in values]


class RecordingController(FixedController):
    """A fixed plan that keeps every round's feedback (the tuner's and the benchmarks' view of the rounds)."""

    def __init__(self, k: int, d: int, measure_depths: bool = False) -> None:
        super().__init__(k, d, measure_depths=measure_depths)
        self.rounds: list[RoundFeedback] = []

    def observe(self, feedback: RoundFeedback) -> None:
        super().observe(feedback)
        self.rounds.append(feedback)


def round_plans(depth: int) -> list[tuple[int, int]]:
    """The plans whose rounds calibrate the per-round terms: plain, short and long drafts at shallow and deep d."""
    if depth < 2:
        return [(0, 0)]
    return sorted({(0, 0), (1, 1), (3, 1), (2, max(depth // 2, 1)), (5, max(depth // 2, 1)), (3, depth - 1)})


def rounds_model_len(adapter: ModelAdapter, longest: int, tokens: int, plans: Sequence[tuple[int, int]]) -> int:
    """The max_model_len of the timed rounds' engines: the longest prompt, the tokens, the longest draft, a margin."""
    return min(adapter.max_positions, longest + tokens + max(k for k, _ in plans) + 16)


def rounds_kv_blocks(batch_size: int, model_len: int) -> int:
    """The KV blocks (of 16 tokens) of one timed rounds' engine: `batch_size` requests of up to `model_len`."""
    return batch_size * (model_len // 16 + 2) + 4


def rounds_kv_bytes(adapter: ModelAdapter, batch_size: int, model_len: int) -> int:
    """The bytes of one timed rounds' engine's KV cache (with the scratch block `KVCache` adds)."""
    return (rounds_kv_blocks(batch_size, model_len) + 1) * KVCache.bytes_per_block(adapter.kv_layout, 16, adapter.dtype)


def measure_rounds(
    adapter: ModelAdapter,
    prompts: Sequence[Any],
    batch_sizes: Sequence[int],
    plans: Sequence[tuple[int, int]],
    tokens: int,
    repeats: int,
    seed: int = 0,
    bar=None,
) -> list[tuple[RoundFeedback, float]]:
    """(feedback, seconds inside the runner) of every decode round of greedy runs of each plan at each batch size.

    One persistent engine per (plan, batch size); in each of `repeats + 1` passes (the first dropped: warm-up)
    every engine decodes a batch of the same prompts, all of them taking turns of one round in a shuffled order,
    so every cell is timed in the same machine state."""
    watch = Stopwatch(adapter.device)
    longest = max(len(p) if not isinstance(p, str) else len(p) // 2 + 1 for p in prompts)
    model_len = rounds_model_len(adapter, longest, tokens, plans)
    engines = {}
    for k, d in plans:
        for b in batch_sizes:
            engine = LoopedSpecEngine(
                adapter, speculation=SpeculativeConfig(k=k, d=d) if k else "off", max_batch_size=b,
                max_model_len=model_len, num_kv_blocks=rounds_kv_blocks(b, model_len),
            )  # fmt: skip
            engine.controller = RecordingController(k, d)
            engine.runner.run_span = Span(watch)
            engines[(k, d, b)] = engine
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    rng = random.Random(seed)
    out: list[tuple[RoundFeedback, float]] = []
    for repeat in range(repeats + 1):
        for (_, _, b), engine in engines.items():
            offset = (7 * repeat + b) % len(prompts)
            for i in range(b):
                engine.add_request(prompts[(offset + i) % len(prompts)], params)
        running = list(engines.values())
        while running:
            rng.shuffle(running)
            for engine in running:
                span, seen = engine.runner.run_span, len(engine.controller.rounds)
                span.pairs.clear()
                engine.step()
                if repeat and len(engine.controller.rounds) > seen:
                    out.append((engine.controller.rounds[-1], span.total()))
            running = [e for e in running if e.has_unfinished_requests()]
        if bar is not None:
            bar.update(1)
    for engine in engines.values():
        engine.close()
    return out


def _round_shape(fb: RoundFeedback) -> tuple[int, int]:
    k = fb.k if fb.total_proposed else 0  # a round whose requests drafted nothing ran as plain decoding
    return k, fb.d if k else 0


def full_shape(rounds: Sequence[tuple[RoundFeedback, float]]) -> list[tuple[RoundFeedback, float]]:
    """The rounds in which every request drafted the plan's K (near the end of a request the scheduler drafts
    fewer, and such a round is cheaper than its plan's price: it would bias the fit and the check)."""
    return [(fb, s) for fb, s in rounds if all(k == fb.k for k in fb.num_proposed)]


def fit_profile(
    depth: int, steps: Sequence[dict[str, Any]], rounds: Sequence[tuple[RoundFeedback, float]]
) -> dict[str, Any]:
    """The `CostConfig` data fitted to timed steps and full-shape rounds (see the module docstring)."""
    rounds = full_shape(rounds)
    cost = PassCost(CostConfig.model_validate(_cost_data(np.zeros(len(WIDTHS) + 15))), depth)
    inside_at = len(cost.theta) - OUTSIDE
    step_rows = _step_rows(cost, steps)[:, :inside_at]
    step_seconds = np.array([s["seconds"] for s in steps])
    round_rows, inside, outside = [], [], []
    for fb, inside_seconds in rounds:
        k, d = _round_shape(fb)
        round_rows.append(cost.features([k], [d], fb.batch_size, fb.context)[0])
        inside.append(inside_seconds)
        outside.append(max(fb.seconds - inside_seconds, 1e-7))
    # the curve as non-negative increments, so the fit keeps it non-decreasing (a wider pass never costs less)
    step_rows = _increments(step_rows)
    theta = np.zeros(len(cost.theta))
    if not round_rows:
        theta[:inside_at] = _robust_fit(step_rows, step_seconds)
        return _cost_data(_cumulative(theta))
    rows = np.array(round_rows)
    inside_rows, inside = _increments(rows[:, :inside_at]), np.array(inside)
    scale = 1.0  # the steps were timed minutes apart from the rounds: one factor between the two machine states
    weights = np.concatenate([np.ones(len(inside)), np.full(len(step_seconds), STEP_WEIGHT)])
    for _ in range(SCALE_ITERATIONS):  # alternate the fit and the factor until the factor settles
        a = np.vstack([inside_rows, step_rows * scale])
        theta[:inside_at] = _robust_fit(a, np.concatenate([inside, step_seconds]), weights)
        previous, scale = scale, float(np.median(step_seconds / np.maximum(step_rows @ theta[:inside_at], 1e-12)))
        if abs(scale - previous) <= 1e-6 * scale:
            break
    theta[inside_at:] = _robust_fit(rows[:, inside_at:], np.array(outside))
    return _cost_data(_cumulative(theta))


def _increments(rows: np.ndarray) -> np.ndarray:
    """Rows over the curve's grid values w_1..w_G rewritten over increments δ_j = w_j − w_{j−1} (w_0 = 0)."""
    out = rows.copy()
    g = len(WIDTHS)
    out[:, :g] = np.cumsum(rows[:, :g][:, ::-1], axis=1)[:, ::-1]
    return out


def _cumulative(theta: np.ndarray) -> np.ndarray:
    """Coefficients over increments back to the curve's grid values."""
    out = theta.copy()
    out[: len(WIDTHS)] = np.cumsum(theta[: len(WIDTHS)])
    return out


def _cost_data(theta: np.ndarray) -> dict[str, Any]:
    w = len(WIDTHS)
    values = _rounded(theta)
    return {
        "positions": list(WIDTHS),
        "pass_seconds": values[:w],
        "request_seconds": values[w],
        "request_context_seconds": values[w + 1],
        "query_context_seconds": values[w + 2],
        "step_seconds": values[w + 3 : w + 6],
        "embed_seconds": values[w + 6 : w + 8],
        "readout_seconds": values[w + 8 : w + 10],
        "round_seconds": values[w + 10 : w + 12],
        "speculative_seconds": values[w + 12 : w + 15],
    }


def validate(cost_data: dict[str, Any], rounds: Sequence[tuple[RoundFeedback, float]], depth: int) -> dict[str, Any]:
    """Per "K,d@B" (full-shape rounds at the profiled batch sizes): the median of measured ÷ predicted round seconds,
    the same relative to plain decoding's at that B (what decides between plans), and how many rounds."""
    cost = PassCost(CostConfig.model_validate(cost_data), depth)
    ratios: dict[tuple[int, int, int], list[float]] = {}
    for fb, _ in full_shape(rounds):
        k, d = _round_shape(fb)
        predicted = float(cost.profile_seconds([k], [d], fb.batch_size, fb.context)[0])
        key = (k, d, fb.batch_size)
        ratios.setdefault(key, []).append(fb.seconds / predicted)
    out = {}
    for (k, d, b), values in sorted(ratios.items(), key=lambda item: (item[0][2], item[0][0], item[0][1])):
        plain = ratios.get((0, 0, b))
        if len(values) < 3 or not plain:
            continue  # a batch size a draining batch passed through
        median = statistics.median(values)
        out[f"{k},{d}@{b}"] = {
            "measured_over_predicted": round(median, 4),
            "relative_to_plain": round(median / statistics.median(plain), 4),
            "rounds": len(values),
        }
    return out


def validation_summary(validation: dict[str, Any]) -> dict[str, Any] | None:
    """How far the profile's price of each speculative plan relative to plain is from the timed rounds' (`validate`'s
    cells, K > 0): the median and the largest |measured ÷ predicted − 1|, the cell of the largest, and whether it
    is within `TRUSTED_ERROR`. None without a speculative cell."""
    errors = {key: abs(cell["relative_to_plain"] - 1.0) for key, cell in validation.items() if not key.startswith("0,")}
    if not errors:
        return None
    worst = max(errors, key=errors.__getitem__)
    return {
        "median_error": round(statistics.median(errors.values()), 4),
        "max_error": round(errors[worst], 4),
        "worst_cell": worst,
        "trusted": errors[worst] <= TRUSTED_ERROR,
    }
