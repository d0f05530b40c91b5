"""A draft override for tests (and benchmarks/gpu_check.py): propose a known continuation to force an
acceptance pattern."""

from __future__ import annotations

from collections.abc import Callable

import torch


class OracleDraft:
    """Drafts each request's known continuation (e.g. its plain greedy output), replaced by a wrong token
    wherever `miss(j)` is true for draft index j. `attach(engine)` makes the engine's proposer use it;
    greedy requests only (sampled rows keep their own draft distribution)."""

    def __init__(
        self, prompts: list[list[int]], continuations: list[list[int]], vocab_size: int, miss: Callable[[int], bool]
    ) -> None:
        self.sequences = {tuple(p): list(p) + list(c) for p, c in zip(prompts, continuations)}
        self.vocab_size = vocab_size
        self.miss = miss

    def attach(self, engine):
        """Use this oracle for `engine`'s drafts (the proposer's `draft_override` hook); returns the engine."""
        engine.spec_round.proposer.draft_override = self
        return engine

    def __call__(self, requests, j: int, drafted: torch.Tensor) -> torch.Tensor:
        out = []
        for request in requests:
            seq = self.sequences[tuple(request.token_ids[: request.num_prompt_tokens])]
            pos = request.num_computed + j + 1  # position of draft token j + 1
            token = seq[pos] if pos < len(seq) else 0
            out.append((token + 1) % self.vocab_size if self.miss(j) else token)
        return torch.tensor(out)
