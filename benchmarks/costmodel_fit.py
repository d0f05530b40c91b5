"""Expected tokens per speculative round under the geometric acceptance model (used by gpu_check.py).

The least-squares round-cost fit that lived here is gone: bench_speculative.py measures end to end and no
longer fits a cost model; the round-cost profile is the tuner's (`looped_spec.control`).
"""

from __future__ import annotations


def expected_tokens(alpha: float, k: int) -> float:
    """Tokens a round commits per request when each draft token is accepted with probability alpha."""
    if alpha >= 1.0:
        return k + 1.0
    return (1 - alpha ** (k + 1)) / (1 - alpha)
