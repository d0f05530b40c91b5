"""The tuner's acceptance pass: how often each depth's readout agrees with full depth, along real trajectories.

Every tuning prompt is decoded greedily alone with plain decoding while every round reads out every shallower
depth (counterfactual readouts). That gives, per depth d and generated position t, the bit m_t(d): did the
depth-d readout at position t-1 predict the token full depth committed (control/acceptance.py). From the bits:
α_d and ρ_d, the exact committed tokens per round of every (K, d) replayed on the trajectories
(`simulate_tokens`), printed beside the Markov model's prediction, and the acceptance of random batches of
prompts (`acceptance_variants`), whose fastest plans join the candidate lists.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from looped_spec.control.acceptance import markov_tokens
from looped_spec.engine.engine import LoopedSpecEngine
from looped_spec.models.adapter import ModelAdapter
from looped_spec.sampling_params import SamplingParams
from looped_spec.tuning.profile import RecordingController

#: Random batches of tuning prompts per bucket whose acceptance offers its fastest plan as a candidate.
VARIANTS = 32


def measure_match_bits(adapter: ModelAdapter, prompts: Sequence[Any], tokens: int, bar=None) -> list[list[list[int]]]:
    """bits[d-1][prompt][t]: did depth d's readout predict generated token t+1 (greedy, full-depth trajectory)."""
    depth = adapter.full_depth
    engine = LoopedSpecEngine(adapter, speculation="off", max_batch_size=1)
    engine.controller = recorder = RecordingController(0, 0, measure_depths=True)
    bits: list[list[list[int]]] = [[] for _ in range(depth)]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0.0)  # greedy, whatever the checkpoint says
    for prompt in prompts:
        recorder.rounds.clear()
        engine.generate([prompt], params)
        rounds = [fb.depth_matches for fb in recorder.rounds if fb.depth_trials]
        for d in range(depth):
            bits[d].append([r[d] for r in rounds])
        if bar is not None:
            bar.update(1)
    engine.close()
    return bits


def simulate_tokens(bits: Sequence[Sequence[int]], k: int) -> tuple[int, int]:
    """Replay K-token rounds on recorded match bits; returns (committed tokens, rounds) over all sequences.

    `bits[r][t]` is m_{t+1} of request r (so len(bits[r]) = generated tokens − 1). Near the end of a sequence the
    draft is cut to the tokens left, as the scheduler does (K_actual = min(K, remaining − 1)).
    """
    tokens = rounds = 0
    for seq in bits:
        n = len(seq) + 1  # generated tokens; the first comes from prefill
        s = 0  # index (0-based) of the last committed generated token
        while s < n - 1:
            k_actual = max(0, min(k, n - 2 - s))
            a = 0
            while a < k_actual and seq[s + a]:
                a += 1
            s += a + 1
            tokens += a + 1
            rounds += 1
    return tokens, rounds


def bit_statistics(bits: Sequence[Sequence[int]]) -> tuple[float, float, int]:
    """(alpha, rho, positions) of recorded match bits; rho from lag-1 transitions inside each sequence."""
    ones = total = n1 = n11 = n0 = n01 = 0
    for seq in bits:
        ones += sum(seq)
        total += len(seq)
        for prev, cur in zip(seq, seq[1:]):
            if prev:
                n1, n11 = n1 + 1, n11 + cur
            else:
                n0, n01 = n0 + 1, n01 + cur
    alpha = ones / total if total else 0.0
    if n1 == 0 or n0 == 0:
        return alpha, 0.0, total
    return alpha, min(max(n11 / n1 - n01 / n0, 0.0), 1.0), total


def acceptance_report(bits: list[list[list[int]]], grid: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """α, ρ per depth and, per grid cell, committed tokens per round replayed on the bits vs the Markov model."""
    stats = [bit_statistics(b) for b in bits]
    cells = {}
    for k, d in grid:
        tokens, rounds = simulate_tokens(bits[d - 1], k)
        alpha, rho, _ = stats[d - 1]
        cells[f"{k},{d}"] = {
            "replayed_tokens_per_round": round(tokens / rounds, 4) if rounds else 0.0,
            "markov_tokens_per_round": round(float(markov_tokens(alpha, rho, k)), 4),
        }
    return {
        "alpha": [round(s[0], 4) for s in stats],
        "rho": [round(s[1], 4) for s in stats],
        "positions": stats[0][2] if stats else 0,
        "cells": cells,
    }


def acceptance_variants(
    bits: list[list[list[int]]], batch: int, count: int = VARIANTS, seed: int = 0
) -> list[tuple[list[float], list[float]]]:
    """(alpha, rho per depth) of `count` random batches of `batch` tuning prompts (seeded; none when the batch
    would hold them all): texts differ, and a batch of a few of them can want another plan than their mean."""
    num = len(bits[0]) if bits else 0
    if batch >= num:
        return []
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        chosen = rng.sample(range(num), batch)
        stats = [bit_statistics([depth_bits[i] for i in chosen]) for depth_bits in bits]
        out.append(([s[0] for s in stats], [s[1] for s in stats]))
    return out
