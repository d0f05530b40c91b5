"""Pearson's chi-square goodness-of-fit check for sampled outputs (shared by the sampling tests)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Hashable, Iterable

Z_999 = 3.0902  # standard normal quantile at 1 - 0.001


def chi2_critical(df: int, z: float = Z_999) -> float:
    """Upper-tail point of chi-square with `df` degrees of freedom at the normal quantile `z` (Wilson-Hilferty:
    within 2 % of the exact value for df >= 3; 16.55 vs 16.27 at df = 3, p = 0.001)."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def assert_distribution(samples: Iterable[Hashable], probs: dict[Hashable, float]) -> None:
    """The samples look drawn from `probs` (p = 0.001): no sample outside its support, and Pearson's statistic
    below the critical value, with the cells expected fewer than 5 times merged into one."""
    counts = Counter(samples)
    n = sum(counts.values())
    assert set(counts) <= set(probs), f"drawn outside the support: {sorted(set(counts) - set(probs))}"
    stat, df, rare_expected, rare_observed = 0.0, -1, 0.0, 0
    for cell, p in probs.items():
        expected = p * n
        if expected < 5:
            rare_expected += expected
            rare_observed += counts[cell]
            continue
        stat += (counts[cell] - expected) ** 2 / expected
        df += 1
    if rare_expected > 0:
        stat += (rare_observed - rare_expected) ** 2 / rare_expected
        df += 1
    assert df >= 1, "too few cells to test"
    assert stat < chi2_critical(df), f"chi-square {stat:.2f} >= {chi2_critical(df):.2f} at {df} degrees of freedom"


def three_token_distribution(
    next_tokens: Callable[[list[int]], Iterable[tuple[int, float]]],
) -> dict[tuple[int, int, int], float]:
    """P(t1, t2, t3) of a request's first three tokens, from `next_tokens(output so far)` -> (token, probability)."""
    return {
        (t1, t2, t3): q1 * q2 * q3
        for t1, q1 in next_tokens([])
        for t2, q2 in next_tokens([t1])
        for t3, q3 in next_tokens([t1, t2])
    }
