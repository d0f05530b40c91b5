"""A draft proposer for tests (and benchmarks/gpu_check.py): propose a known continuation to force an
acceptance pattern."""

from __future__ import annotations

from collections.abc import Callable

import torch

from looped_spec.speculative.proposer import DraftProposer


class OracleDraft:
    """Drafts each request's known continuation (e.g. its plain greedy output), replaced by a wrong token
    wherever `miss(j)` is true for draft index j. `attach(engine)` gives the engine a proposer that drafts so;
    greedy requests only (sampled rows keep their own draft distribution)."""

    def __init__(
        self, prompts: list[list[int]], continuations: list[list[int]], vocab_size: int, miss: Callable[[int], bool]
    ) -> None:
        self.sequences = {tuple(p): list(p) + list(c) for p, c in zip(prompts, continuations)}
        self.vocab_size = vocab_size
        self.miss = miss

    def attach(self, engine):
        """Draft `engine`'s tokens with this oracle from now on; returns the engine."""
        engine.spec_round.proposer = OracleProposer(engine.runner, self)
        return engine

    def tokens(self, requests, j: int) -> torch.Tensor:
        out = []
        for request in requests:
            seq = self.sequences[tuple(request.token_ids[: request.num_prompt_tokens])]
            pos = request.num_computed + j + 1  # position of draft token j + 1
            token = seq[pos] if pos < len(seq) else 0
            out.append((token + 1) % self.vocab_size if self.miss(j) else token)
        return torch.tensor(out)


class OracleProposer(DraftProposer):
    """The engine's proposer, drafting greedy rows' tokens from an `OracleDraft` instead of their readout (before
    the token is embedded, so the cached draft KV always matches the tokens verified)."""

    def __init__(self, runner, oracle: OracleDraft) -> None:
        super().__init__(runner)
        self.oracle = oracle

    def draw(self, logits, rows, requests, j, drafted=None):
        drafted, q = super().draw(logits, rows, requests, j, drafted)
        if q is not None:
            return drafted, q
        return self.oracle.tokens(requests, j).to(drafted.device), None
