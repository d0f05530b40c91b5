"""Repetition, presence and frequency penalties: logits that depend on the tokens before the position sampled.

As vLLM defines them (and HF its repetition penalty), on the logits after the logit bias, before temperature:

- repetition_penalty r (1 = off): a token of the prompt or of the output so far has its logit divided by r when
  positive, multiplied by r when negative;
- presence_penalty p: subtracted once from the logit of every token the output so far holds;
- frequency_penalty f: subtracted from a token's logit once per time the output so far holds it.

"The output so far" at a speculative position is the request's committed output and the drafts before that
position: the draft at step j and the verifier at position j see the same tokens, so rejection sampling keeps the
penalised target distribution, and greedy speculation still equals plain decoding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from looped_spec.execution.transfers import to_device
from looped_spec.request import Request


@dataclass
class PenaltyRows:
    """The rows of a batch whose requests set a penalty, with the tokens each penalty counts."""

    rows: list[int]  # row index in the batch
    prompts: list[list[int]]  # per penalised row: the prompt (repetition only)
    outputs: list[list[int]]  # per penalised row: the output so far, drafts before the row's position included
    repetition: list[float]
    presence: list[float]
    frequency: list[float]

    @classmethod
    def build(cls, requests: Sequence[Request], drafted: Sequence[Sequence[int]] | None) -> PenaltyRows | None:
        """The penalised rows of `requests` (one per row); `drafted[i]`: row i's drafts before its position."""
        rows = [i for i, r in enumerate(requests) if r.penalized]
        if not rows:
            return None
        out = cls(rows, [], [], [], [], [])
        for i in rows:
            request = requests[i]
            extra = list(drafted[i]) if drafted is not None else []
            out.prompts.append(request.token_ids[: request.num_prompt_tokens])
            out.outputs.append(request.token_ids[request.num_prompt_tokens :] + extra)
            out.repetition.append(request.repetition_penalty)
            out.presence.append(request.presence_penalty)
            out.frequency.append(request.frequency_penalty)
        return out

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [num_rows, V] with the penalties applied to the penalised rows (a new tensor)."""
        device, vocab = logits.device, logits.shape[-1]
        logits = logits.float().clone()
        rows = to_device(self.rows, device, torch.long)
        picked = logits[rows]  # [P, V]
        counts = torch.zeros_like(picked)
        flat_rows = [n for n, tokens in enumerate(self.outputs) for _ in tokens]
        if flat_rows:
            tokens = to_device([t for tokens in self.outputs for t in tokens], device, torch.long)
            counts.index_put_((to_device(flat_rows, device, torch.long), tokens), torch.ones(len(flat_rows),
                              device=device), accumulate=True)  # fmt: skip
        seen = counts > 0
        prompt_rows = [n for n, tokens in enumerate(self.prompts) for _ in tokens]
        if prompt_rows:
            tokens = to_device([t for tokens in self.prompts for t in tokens], device, torch.long)
            seen[to_device(prompt_rows, device, torch.long), tokens.clamp(0, vocab - 1)] = True
        repetition = to_device(self.repetition, device)[:, None]
        picked = torch.where(seen, torch.where(picked > 0, picked / repetition, picked * repetition), picked)
        picked = picked - to_device(self.presence, device)[:, None] * (counts > 0)
        picked = picked - to_device(self.frequency, device)[:, None] * counts
        logits[rows] = picked
        return logits
