"""Least-squares fit of the DESIGN.md round-cost model to measured phase times.

Per loop-step costs: a draft step runs one token per request, `a0 + a1*B`; a verify loop runs
B(K+1) tokens, `b0 + b1*B(K+1)`. So per round: draft = d(K+1)(a0 + a1 B), verify =
(D-d)(b0 + b1 B(K+1)), plain = D(a0 + a1 B). With acceptance alpha a round commits
(1 - alpha^(K+1)) / (1 - alpha) tokens per request.
"""

from __future__ import annotations

import torch


def expected_tokens(alpha: float, k: int) -> float:
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def fit_cost_model(samples: list, depth: int) -> dict:
    """samples: (kind, B, K, d, run) with run["phase_seconds"] and run["rounds"]. Returns coefficients."""
    rows, targets = [], []
    for kind, b, k, d, run in samples:
        rounds = max(run["rounds"], 1)
        if kind == "plain":
            rows.append([depth, depth * b, 0.0, 0.0])
            targets.append(run["phase_seconds"]["decode"] / rounds)
        else:
            rows.append([d * (k + 1), d * (k + 1) * b, 0.0, 0.0])
            targets.append(run["phase_seconds"]["draft"] / rounds)
            rows.append([0.0, 0.0, depth - d, (depth - d) * b * (k + 1)])
            targets.append((run["phase_seconds"]["verify"] + run["phase_seconds"]["accept"]) / rounds)
    a = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor(targets, dtype=torch.float64)
    coef = torch.linalg.lstsq(a, y[:, None]).solution[:, 0].tolist()
    pred = (a @ torch.tensor(coef, dtype=torch.float64)).tolist()
    rel = [abs(p - t) / t for p, t in zip(pred, targets) if t > 0]
    return {
        "coefficients": {"a0": coef[0], "a1": coef[1], "b0": coef[2], "b1": coef[3]},
        "mean_relative_error": sum(rel) / max(len(rel), 1),
    }


def predicted_ratio(fit: dict, b: int, k: int, d: int, depth: int, alpha: float) -> float:
    """Predicted spec tokens/s divided by plain tokens/s at batch b."""
    c = fit["coefficients"]
    step = c["a0"] + c["a1"] * b
    plain = depth * step
    spec = d * (k + 1) * step + (depth - d) * (c["b0"] + c["b1"] * b * (k + 1))
    if spec <= 0 or plain <= 0:
        return float("nan")
    return expected_tokens(alpha, k) * plain / spec
