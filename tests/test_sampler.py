"""The sampling distribution after temperature, top-k and top-p, against transformers' logits warpers (HF's
meaning, which generation_config.json and the server's fields follow; vLLM filters in the same order)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from looped_spec.execution.sampler import SamplingRows, probabilities


def rows_of(temperature: float, top_k: int, top_p: float, count: int) -> SamplingRows:
    return SamplingRows(
        requests=[None] * count,
        temperature=torch.full((count,), temperature),
        top_k=torch.full((count,), top_k, dtype=torch.long),
        top_p=torch.full((count,), top_p),
        greedy=torch.zeros(count, dtype=torch.bool),
        all_greedy=False,
        needs_filter=top_k > 0 or top_p < 1.0,
    )


def reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    scores = TemperatureLogitsWarper(temperature)(None, logits.double())
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(-1)


def test_top_p_measures_what_top_k_kept():
    """[.4, .3, .2, .1] with top_k=2: [4/7, 3/7]; its first token alone reaches top_p=0.5, so it alone is kept."""
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    probs = probabilities(logits, rows_of(1.0, 2, 0.5, 1))
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0]]


@pytest.mark.parametrize(
    "temperature, top_k, top_p",
    [(1.0, 0, 0.9), (0.7, 20, 1.0), (0.6, 50, 0.9), (1.3, 8, 0.5), (0.9, 3, 0.95), (1.0, 1, 0.3), (2.0, 100, 0.2)],
)
def test_the_distribution_is_hfs(temperature, top_k, top_p):
    generator = torch.Generator().manual_seed(top_k)
    logits = torch.randn(16, 257, generator=generator) * 3.0
    got = probabilities(logits, rows_of(temperature, top_k, top_p, 16)).double()
    want = reference(logits, temperature, top_k, top_p)
    assert ((got > 0) == (want > 0)).all(), "a different set of tokens kept"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
