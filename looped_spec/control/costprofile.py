"""Round cost as a property of the hardware: a profile measured offline and stored in the preset.

For a batch of B requests at full depth D, one speculative round with K draft tokens at draft depth d is

    T(K, d, B) = d(K+1)·c_shallow + (D−d)·(v_0 + v_1·(K+1)) + T_other

- d(K+1)·c_shallow: the draft runs d loops over one token per request, K+1 times;
- (D−d)·(v_0 + v_1·(K+1)): the verifier runs the remaining D−d loops once over K+1 tokens per request
  (a loop pass over q tokens per request costs v_0 + v_1·q at this B);
- T_other: per-round overhead (scheduling, sampling, acceptance, bookkeeping). A per-forward-call cost
  o·(K+1) needs no term of its own: K+1 = (d(K+1) + (D−d)(K+1)) / D, so it is absorbed by c_shallow and v_1
  (a fifth regressor would make the fit singular).

The four coefficients are fitted per profiled batch size by least squares to robust (median) round times
of the measured (K, d) cells; a plain round's time T_plain(B) is measured directly. Between profiled batch
sizes both are interpolated linearly in B, beyond the last one extrapolated from the last two (round cost is
close to linear in B there). See docs/adaptive.md "cost profile".
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence

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


class CostProfile:
    """Predicted seconds of plain and speculative rounds at any batch size from a few profiled ones."""

    __slots__ = ("depth", "batch_sizes", "plain_seconds", "coefficients")

    def __init__(
        self,
        depth: int,
        batch_sizes: Sequence[int],
        plain_seconds: Sequence[float],
        coefficients: Sequence[Sequence[float]],
    ) -> None:
        if not batch_sizes or len(batch_sizes) != len(plain_seconds) or len(batch_sizes) != len(coefficients):
            raise ValueError("a cost profile needs one plain time and one coefficient row per batch size")
        if list(batch_sizes) != sorted(set(batch_sizes)):
            raise ValueError(f"profiled batch sizes {list(batch_sizes)} must be strictly increasing")
        self.depth = depth
        self.batch_sizes = list(batch_sizes)
        self.plain_seconds = list(plain_seconds)
        self.coefficients = [list(c) for c in coefficients]

    @classmethod
    def fit(
        cls, depth: int, plain: Mapping[int, float], cells: Mapping[int, Mapping[tuple[int, int], float]]
    ) -> CostProfile:
        """From median round seconds: `plain[B]` and `cells[B][(K, d)]` for every profiled B."""
        sizes = sorted(plain)
        return cls(depth, sizes, [plain[b] for b in sizes], [fit_coefficients(cells[b], depth) for b in sizes])

    def _at(self, values: Sequence[float], batch: int) -> float:
        sizes = self.batch_sizes
        if len(sizes) == 1:
            return values[0] * max(batch, 1) / sizes[0] if batch > sizes[0] else values[0]
        i = bisect_left(sizes, batch)
        if i < len(sizes) and sizes[i] == batch:
            return values[i]
        if i == 0:
            return values[0]
        i = min(i, len(sizes) - 1)
        b0, b1 = sizes[i - 1], sizes[i]
        w = (batch - b0) / (b1 - b0)
        return values[i - 1] + w * (values[i] - values[i - 1])

    def spec_seconds_at_profiled(self, k: int, d: int) -> list[float]:
        """Predicted round seconds of (K, d) at each profiled batch size."""
        x = round_features(k, d, self.depth)
        return [sum(c * f for c, f in zip(coef, x)) for coef in self.coefficients]

    def predict(self, k: int, d: int, batch: int) -> float:
        """Seconds of one round of (K, d) (K = 0: plain) for a batch of `batch` requests (> 0)."""
        if k <= 0:
            return max(self._at(self.plain_seconds, batch), 1e-9)
        return max(self._at(self.spec_seconds_at_profiled(k, d), batch), 1e-9)

    def to_dict(self) -> dict:
        return {
            "batch_sizes": self.batch_sizes,
            "plain_seconds": self.plain_seconds,
            "coefficients": self.coefficients,
        }
