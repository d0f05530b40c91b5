"""Round cost as a property of the hardware: a profile measured offline and stored in the preset.

For a batch of B requests at full depth D, one speculative round with K draft tokens at draft depth d is

    T(K, d, B) = d(K+1)·c_shallow + (D−d)·(v_0 + v_1·(K+1)) + T_other

- d(K+1)·c_shallow: the draft runs d loops over one token per request, K+1 times;
- (D−d)·(v_0 + v_1·(K+1)): the verifier runs the remaining D−d loops once over K+1 tokens per request
  (a loop pass over q tokens per request costs v_0 + v_1·q at this B);
- T_other: per-round overhead (scheduling, sampling, acceptance, bookkeeping). A per-forward-call cost
  o·(K+1) needs no term of its own: K+1 = (d(K+1) + (D−d)(K+1)) / D, so it is absorbed by c_shallow and v_1
  (a fifth regressor would make the fit singular).

The four coefficients are fitted per profiled batch size by least squares to robust round times (the
tuner's best-run trimmed means) of the measured (K, d) cells; a plain round's time T_plain(B) is measured
directly. Between profiled batch sizes both are interpolated linearly in B, beyond the last one
extrapolated from the last two (round cost is close to linear in B there). See docs/adaptive.md "cost
profile".

Context. A round's cost grows with the context (every loop pass reads every request's whole KV), and plain
and speculative rounds grow at different rates (a verify pass runs K+1 queries over it). A profile tuned
with context terms also stores, per profiled B, a line in the batch's mean context c (tokens already in the
KV per request at the round's start):

    T_plain(B, c) = a_plain(B) + b_plain(B)·c
    T(K, d, B, c) = x(K, d)·A(B) + max(x(K, d)·S(B), 0)·c

with x the four `round_features`, S(B) = (a + b, a, b, 0) the pass model's slope row (`fit_pass_slopes`:
a per loop pass, b per query-pass, both >= 0, one pair per B for every cell and plain) and A the coefficients
fitted to the cells' intercepts once each line is moved to that slope through its value at the reference
context (docs/adaptive.md, "Cost profile").
`predict(..., context=c)` uses these; without a context, or on a profile without them (older presets), the
averaged terms above are used exactly as before: they describe the tuning runs' own contexts, whose mean
per batch size is stored as `reference_context`.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence

FEATURES = ("d(K+1)", "D-d", "(D-d)(K+1)", "1")


def round_features(k: int, d: int, depth: int) -> list[float]:
    """The regressors of one speculative round, in the order of `FEATURES`."""
    q = k + 1
    return [float(d * q), float(depth - d), float((depth - d) * q), 1.0]


def fit_coefficients(times: Mapping[tuple[int, int], float], depth: int) -> list[float]:
    """Least-squares coefficients of one batch size's cells.

    A tiny ridge term (1e-9 of the normal matrix's trace) makes the solve well defined when the cells do not
    pin all four coefficients (e.g. D = 2, where every cell has d = 1): the predictions at the measured cells
    are unaffected, the split between collinear terms is the smallest-norm one.
    """
    if not times:
        raise ValueError("no measured (K, d) cells to fit the round cost to")
    rows = [round_features(k, d, depth) for k, d in times]
    ys = list(times.values())
    n = len(FEATURES)
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(n)]
    ridge = 1e-9 * sum(a[i][i] for i in range(n)) + 1e-300
    for i in range(n):
        a[i][i] += ridge
    return _solve(a, b)


def passes(k: int, d: int, depth: int) -> tuple[int, int]:
    """(loop passes, query-loop passes) of one round: plain runs D passes of one query per request; a (K, d)
    round d·(K+1) draft passes of one query and D − d verify passes of K + 1 queries."""
    if k <= 0:
        return depth, depth
    return d * (k + 1) + (depth - d), depth * (k + 1)


def fit_pass_slopes(slopes: Mapping[tuple[int, int], float], depth: int) -> tuple[float, float]:
    """Per-pass and per-query-pass context cost (seconds per context token), both >= 0, from measured slopes.

    The pass model: every loop pass reads the whole context of every request once (the KV gather) and every
    query attends over it, so a round's slope is a·passes + b·query_passes. Two coefficients for all cells of
    a batch size, where the four-feature model would take four per B from slopes that one 64-token horizon
    pins only loosely (on tiny-ouro B = 1 that fit gave (4,3) a slope of 0; the pass model gives it about 4x
    plain's, as measured). Least absolute deviations (iteratively reweighted least squares), so one cell's
    bad slope does not drag the others; a, b >= 0 (the best one-coefficient fit when the free one goes
    negative).
    """
    rows = [(*passes(k, d, depth), s) for (k, d), s in slopes.items()]
    if not rows:
        return 0.0, 0.0
    floor = 1e-3 * (sum(abs(s) for _, _, s in rows) / len(rows)) + 1e-300
    weights = [1.0] * len(rows)
    best = (0.0, 0.0)
    for _ in range(30):
        best = _nonnegative_fit(rows, weights)
        weights = [1.0 / max(abs(best[0] * p + best[1] * q - s), floor) for p, q, s in rows]
    return best


def _nonnegative_fit(rows: list[tuple[int, int, float]], weights: list[float]) -> tuple[float, float]:
    """Weighted least squares of s = a·p + b·q with a, b >= 0."""

    def residual(a: float, b: float) -> float:
        return sum(w * (a * p + b * q - s) ** 2 for (p, q, s), w in zip(rows, weights))

    spp = sum(w * p * p for (p, _, _), w in zip(rows, weights))
    sqq = sum(w * q * q for (_, q, _), w in zip(rows, weights))
    spq = sum(w * p * q for (p, q, _), w in zip(rows, weights))
    sps = sum(w * p * s for (p, _, s), w in zip(rows, weights))
    sqs = sum(w * q * s for (_, q, s), w in zip(rows, weights))
    candidates = [(0.0, 0.0), (max(sps / spp, 0.0), 0.0), (0.0, max(sqs / sqq, 0.0))]
    det = spp * sqq - spq * spq
    if abs(det) > 1e-12 * spp * sqq:
        a, b = (sps * sqq - sqs * spq) / det, (sqs * spp - sps * spq) / det
        if a >= 0.0 and b >= 0.0:
            candidates.append((a, b))
    return min(candidates, key=lambda ab: residual(*ab))


def pass_slope(row: Sequence[float], cell: tuple[int, int], depth: int) -> float:
    """A cell's slope from a slope-coefficient row in the `FEATURES` basis ((0, 0): plain)."""
    k, d = cell
    x = round_features(k, d, depth) if k > 0 else round_features(0, depth, depth)
    return sum(c * f for c, f in zip(row, x))


def nondecreasing(values: list[float]) -> list[float]:
    """Least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [s / c for s, c in blocks for _ in range(int(c))]


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a is symmetric positive definite here)."""
    n = len(b)
    m = [row[:] + [rhs] for row, rhs in zip(a, b)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(col + 1, n):
            f = m[r][col] / m[col][col]
            for c in range(col, n + 1):
                m[r][c] -= f * m[col][c]
    x = [0.0] * n
    for r in range(n - 1, -1, -1):
        x[r] = (m[r][n] - sum(m[r][c] * x[c] for c in range(r + 1, n))) / m[r][r]
    return x


#: The optional context terms of a profile (`CostConfig` fields of the same names), all set or none.
CONTEXT_FIELDS = ("reference_context", "plain_intercept", "plain_slope", "intercept_coefficients", "slope_coefficients")


class CostProfile:
    """Predicted seconds of plain and speculative rounds at any batch size from a few profiled ones.

    Optionally context-aware (the keyword arguments, all or none; see the module docstring): per profiled
    batch size, the mean context of the tuning rounds, plain's intercept and slope (seconds, seconds per
    context token), and the four-feature coefficients of the speculative rounds' intercepts and slopes.
    """

    __slots__ = ("depth", "batch_sizes", "plain_seconds", "coefficients", *CONTEXT_FIELDS)

    def __init__(
        self,
        depth: int,
        batch_sizes: Sequence[int],
        plain_seconds: Sequence[float],
        coefficients: Sequence[Sequence[float]],
        *,
        reference_context: Sequence[float] | None = None,
        plain_intercept: Sequence[float] | None = None,
        plain_slope: Sequence[float] | None = None,
        intercept_coefficients: Sequence[Sequence[float]] | None = None,
        slope_coefficients: Sequence[Sequence[float]] | None = None,
    ) -> None:
        if not batch_sizes or len(batch_sizes) != len(plain_seconds) or len(batch_sizes) != len(coefficients):
            raise ValueError("a cost profile needs one plain time and one coefficient row per batch size")
        if list(batch_sizes) != sorted(set(batch_sizes)):
            raise ValueError(f"profiled batch sizes {list(batch_sizes)} must be strictly increasing")
        self.depth = depth
        self.batch_sizes = list(batch_sizes)
        self.plain_seconds = list(plain_seconds)
        self.coefficients = [list(c) for c in coefficients]
        terms = (reference_context, plain_intercept, plain_slope, intercept_coefficients, slope_coefficients)
        given = [t is not None for t in terms]
        if any(given) and not all(given):
            missing = [name for name, g in zip(CONTEXT_FIELDS, given) if not g]
            raise ValueError(f"context terms come together: {', '.join(missing)} missing")
        if any(t is not None and len(t) != len(self.batch_sizes) for t in terms):
            raise ValueError("a context-aware profile needs every context term once per profiled batch size")
        self.reference_context = _copy(reference_context)
        self.plain_intercept = _copy(plain_intercept)
        self.plain_slope = _copy(plain_slope)
        self.intercept_coefficients = _copy_rows(intercept_coefficients)
        self.slope_coefficients = _copy_rows(slope_coefficients)

    @property
    def has_context(self) -> bool:
        """True when the profile carries context terms (`predict` then honours a context)."""
        return self.slope_coefficients is not None

    @classmethod
    def fit(
        cls,
        depth: int,
        plain: Mapping[int, float],
        cells: Mapping[int, Mapping[tuple[int, int], float]],
        lines: Mapping[int, Mapping[tuple[int, int], tuple[float, float]]] | None = None,
        reference_context: Mapping[int, float] | None = None,
    ) -> CostProfile:
        """From robust round seconds: `plain[B]` and `cells[B][(K, d)]` for every profiled B.

        With `lines[B][(K, d)] = (intercept, slope)` of round seconds against the mean context ((0, 0): plain)
        and the tuning rounds' mean context per B, the profile gets context terms. The slopes follow the pass
        model (`fit_pass_slopes`: two non-negative coefficients for all cells and plain, not four free ones per
        B: a cell's slope alone is loosely pinned by one short horizon); each line then keeps its value at the
        reference context (its intercept moves by the slope's change times that context), and the four-feature
        model is fitted to the speculative cells' intercepts.
        """
        sizes = sorted(plain)
        profile = cls(depth, sizes, [plain[b] for b in sizes], [fit_coefficients(cells[b], depth) for b in sizes])
        if lines is None:
            return profile
        if reference_context is None:
            raise ValueError("context lines need the reference (mean) context of the tuning rounds")
        passes = [fit_pass_slopes({c: s for c, (_, s) in lines[b].items()}, depth) for b in sizes]
        per_pass = nondecreasing([a for a, _ in passes])  # cost never falls as the batch grows
        per_query_pass = nondecreasing([q for _, q in passes])
        slope_rows = [[a + q, a, q, 0.0] for a, q in zip(per_pass, per_query_pass)]
        refs = [reference_context[b] for b in sizes]
        moved: list[dict[tuple[int, int], float]] = []  # intercepts of lines kept at the reference context
        for b, row, ref in zip(sizes, slope_rows, refs):
            # a line moved to a steeper slope must not go below zero at context 0 (a short, noisy horizon can
            # measure a cell's slope far below the model's); it then prices contexts below `ref` a little high
            moved.append(
                {c: max(a + (s - pass_slope(row, c, depth)) * ref, 0.0) for c, (a, s) in lines[b].items()}
            )  # fmt: skip
        return cls(
            depth,
            profile.batch_sizes,
            profile.plain_seconds,
            profile.coefficients,
            reference_context=refs,
            plain_intercept=[m[(0, 0)] for m in moved],
            plain_slope=[pass_slope(row, (0, 0), depth) for row in slope_rows],
            intercept_coefficients=[fit_coefficients({c: a for c, a in m.items() if c[0] > 0}, depth) for m in moved],
            slope_coefficients=slope_rows,
        )

    def _at(self, values: Sequence[float], batch: int) -> float:
        return self._interpolate(values.__getitem__, batch)

    def _interpolate(self, value_at: Callable[[int], float], batch: int) -> float:
        """The value at `batch` from `value_at(i)` at profiled batch size i: linear between the two profiled
        sizes around it, extrapolated from the last two beyond them (evaluates at most two indices)."""
        sizes = self.batch_sizes
        if len(sizes) == 1:
            return value_at(0) * max(batch, 1) / sizes[0] if batch > sizes[0] else value_at(0)
        i = bisect_left(sizes, batch)
        if i < len(sizes) and sizes[i] == batch:
            return value_at(i)
        if i == 0:
            return value_at(0)
        i = min(i, len(sizes) - 1)
        b0, b1 = sizes[i - 1], sizes[i]
        w = (batch - b0) / (b1 - b0)
        v0 = value_at(i - 1)
        return v0 + w * (value_at(i) - v0)

    def terms(self, k: int, d: int, batch: int, context: float | None = None) -> list[float]:
        """The round's predicted seconds split by `FEATURES` (draft loops, verify loops' fixed part, verify
        loops' per-query part, other) at `batch` (and `context` when the profile has context terms). Their
        sum is the fitted model's prediction, which may differ a little from a measured plain time."""
        x = round_features(k, d, self.depth)
        out = []
        for i, f in enumerate(x):
            if context is not None and self.has_context:
                assert self.intercept_coefficients is not None and self.slope_coefficients is not None
                c = max(context, 0.0)
                per_b = [
                    a[i] + max(s[i], 0.0) * c for a, s in zip(self.intercept_coefficients, self.slope_coefficients)
                ]
            else:
                per_b = [row[i] for row in self.coefficients]
            out.append(self._at(per_b, batch) * f)
        return out

    def spec_seconds_at_profiled(self, k: int, d: int) -> list[float]:
        """Predicted round seconds of (K, d) at each profiled batch size (averaged over the tuning contexts)."""
        x = round_features(k, d, self.depth)
        return [sum(c * f for c, f in zip(coef, x)) for coef in self.coefficients]

    def _seconds_at_context(self, k: int, d: int, context: float, i: int) -> float:
        """`seconds_at_context(k, d, context)[i]` alone."""
        a_plain, b_plain = self.plain_intercept, self.plain_slope
        a_rows, b_rows = self.intercept_coefficients, self.slope_coefficients
        assert a_plain is not None and b_plain is not None and a_rows is not None and b_rows is not None
        c = max(context, 0.0)
        if k <= 0:
            return a_plain[i] + max(b_plain[i], 0.0) * c
        x = round_features(k, d, self.depth)
        a = sum(coef * f for coef, f in zip(a_rows[i], x))
        b = sum(coef * f for coef, f in zip(b_rows[i], x))
        return a + max(b, 0.0) * c

    def seconds_at_context(self, k: int, d: int, context: float) -> list[float]:
        """Predicted round seconds of (K, d) (K = 0: plain) at mean context `context`, per profiled batch size.

        Slopes are clamped at 0: a longer context never makes a round cheaper, whatever the fit's noise.
        """
        return [self._seconds_at_context(k, d, context, i) for i in range(len(self.batch_sizes))]

    def predict(self, k: int, d: int, batch: int, context: float | None = None) -> float:
        """Seconds of one round of (K, d) (K = 0: plain) for a batch of `batch` requests (> 0).

        `context`: the batch's mean context (tokens in the KV per request at the round's start). None, or a
        profile without context terms, gives the prediction averaged over the tuning runs' contexts.
        """
        if context is not None and self.has_context:  # per round on the hot path: only the sizes it needs
            return max(self._interpolate(lambda i: self._seconds_at_context(k, d, context, i), batch), 1e-9)
        if k <= 0:
            return max(self._at(self.plain_seconds, batch), 1e-9)
        return max(self._at(self.spec_seconds_at_profiled(k, d), batch), 1e-9)

    def to_dict(self) -> dict:
        """The `CostConfig` fields; context terms only when the profile has them (old presets stay as they were)."""
        out: dict = {
            "batch_sizes": self.batch_sizes,
            "plain_seconds": self.plain_seconds,
            "coefficients": self.coefficients,
        }
        if self.has_context:
            out.update({name: getattr(self, name) for name in CONTEXT_FIELDS})
        return out


def _copy(values: Sequence[float] | None) -> list[float] | None:
    return None if values is None else list(values)


def _copy_rows(rows: Sequence[Sequence[float]] | None) -> list[list[float]] | None:
    return None if rows is None else [list(r) for r in rows]
