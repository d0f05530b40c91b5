"""Acceptance from data: how many draft tokens a depth-d draft gets accepted, without timing anything.

Greedy acceptance is a property of the model and the text. Along a greedy trajectory x_1, x_2, ... of the
full-depth model, let m_t(d) = 1 when the depth-d readout at position t-1 predicts x_t (the counterfactual
readouts of `measure_depths` give these bits). A depth-d draft that starts after the committed token x_s
proposes exactly the depth-d readouts as long as its prefix is right, so a round of K draft tokens accepts
a = the number of consecutive ones in m_{s+1}, m_{s+2}, ... capped at K, commits a + 1 tokens, and the next
round starts at s + a + 1. `simulate_tokens` replays that exactly on recorded bits.

Online we only keep two numbers per depth (docs/adaptive.md "acceptance model"):
- alpha_d, the fraction of ones (stationary agreement rate), and
- rho_d, the lag-1 persistence: P(m_{t+1}=1 | m_t=1) − P(m_{t+1}=1 | m_t=0).
Matches come in runs (a repetitive stretch of text is easy at every position), so rho > 0 and the
independent-tokens (geometric) expectation (1 − α^{K+1}) / (1 − α) is wrong for long drafts. With a
two-state Markov chain of the bits, p11 = ρ + α(1 − ρ), p01 = α(1 − ρ), and a round starting in state s (the
last committed position's bit) accepts a ≥ j with probability p_s·p11^{j−1}; the next round starts in
state 1 only when all K were accepted and the bonus token also matched (p_s·p11^K). `markov_tokens` is the
stationary expectation of committed tokens per round of that chain; with rho = 0 it is the geometric one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def markov_tokens(alpha: float, rho: float, k: int) -> float:
    """Expected committed tokens per request per round of a K-token draft (1 for K = 0)."""
    if k <= 0:
        return 1.0
    alpha = min(max(alpha, 0.0), 1.0)
    rho = min(max(rho, 0.0), 1.0)
    p01 = alpha * (1.0 - rho)
    p11 = rho + p01
    # E[a | start state s] = p_s · (1 + p11 + ... + p11^{K-1})
    run = float(k) if p11 >= 1.0 else (1.0 - p11**k) / (1.0 - p11)
    to_one_from_0 = p01 * p11**k  # P(next round starts in state 1 | this one started in state 0)
    to_one_from_1 = p11 * p11**k
    denom = 1.0 - to_one_from_1 + to_one_from_0
    pi1 = 1.0 if denom <= 0.0 else to_one_from_0 / denom
    return 1.0 + run * ((1.0 - pi1) * p01 + pi1 * p11)


def markov_tokens_array(alpha: np.ndarray, rho: float, k: int) -> np.ndarray:
    """`markov_tokens` of every agreement in `alpha` at once (the same chain, elementwise; K ≥ 1)."""
    alpha = np.clip(alpha, 0.0, 1.0)
    rho = min(max(rho, 0.0), 1.0)
    p01 = alpha * (1.0 - rho)
    p11 = rho + p01
    with np.errstate(divide="ignore", invalid="ignore"):
        run = np.where(p11 >= 1.0, float(k), (1.0 - p11**k) / (1.0 - p11))
        to_one_from_0 = p01 * p11**k
        denom = 1.0 - p11 * p11**k + to_one_from_0
        pi1 = np.where(denom <= 0.0, 1.0, to_one_from_0 / np.where(denom <= 0.0, 1.0, denom))
    return 1.0 + run * ((1.0 - pi1) * p01 + pi1 * p11)


def markov_accept_rate(alpha: float, rho: float, k: int) -> float:
    """Expected ΣA/ΣK of rounds with K draft tokens (what the EMA policy measures)."""
    return (markov_tokens(alpha, rho, k) - 1.0) / k if k > 0 else 0.0


def simulate_tokens(bits: Sequence[Sequence[int]], k: int) -> tuple[int, int]:
    """Replay K-token rounds on recorded match bits; returns (committed tokens, rounds) over all sequences.

    `bits[r][t]` is m_{t+1} of request r: whether the draft depth's readout at generated position t
    predicted generated token t+1 (so len(bits[r]) = generated tokens − 1). Near the end of a sequence the
    draft is cut to the tokens left, as the scheduler does (K_actual = min(K, remaining − 1)).
    """
    tokens = rounds = 0
    for seq in bits:
        n = len(seq) + 1  # generated tokens; the first comes from prefill
        s = 0  # index (0-based) of the last committed generated token
        while s < n - 1:
            left = n - 1 - s
            k_actual = max(0, min(k, left - 1))
            a = 0
            while a < k_actual and seq[s + a]:
                a += 1
            s += a + 1
            tokens += a + 1
            rounds += 1
    return tokens, rounds


def bit_statistics(bits: Sequence[Sequence[int]]) -> tuple[float, float, int]:
    """(alpha, rho, positions) of recorded match bits; rho from lag-1 transitions inside each sequence."""
    ones = total = 0
    n1 = n11 = n0 = n01 = 0
    for seq in bits:
        ones += sum(seq)
        total += len(seq)
        for prev, cur in zip(seq, seq[1:]):
            if prev:
                n1 += 1
                n11 += cur
            else:
                n0 += 1
                n01 += cur
    alpha = ones / total if total else 0.0
    if n1 == 0 or n0 == 0:
        return alpha, 0.0, total
    rho = n11 / n1 - n01 / n0
    return alpha, min(max(rho, 0.0), 1.0), total


def prompt_spread(bits: Sequence[Sequence[int]]) -> float:
    """Standard deviation over sequences of each sequence's own agreement (sequences without positions skipped):
    the text-to-text spread the drain pricing of `control/drain.py` spreads requests by."""
    means = [sum(seq) / len(seq) for seq in bits if seq]
    if len(means) < 2:
        return 0.0
    mean = sum(means) / len(means)
    return (sum((m - mean) ** 2 for m in means) / len(means)) ** 0.5


class AcceptanceModel:
    """alpha and rho per draft depth 1..D; `tokens(k, d)` is the expected committed tokens per round."""

    __slots__ = ("alpha", "rho")

    def __init__(self, alpha: Sequence[float], rho: Sequence[float]) -> None:
        if len(alpha) != len(rho):
            raise ValueError(f"alpha has {len(alpha)} depths, rho {len(rho)}")
        self.alpha = list(alpha)  # [D]
        self.rho = list(rho)  # [D]

    def tokens(self, k: int, d: int) -> float:
        if k <= 0:
            return 1.0
        return markov_tokens(self.alpha[d - 1], self.rho[d - 1], k)
