"""Draft proposer: K tokens per request from the first d loops, one position at a time."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from looped_spec.execution.model_runner import ModelRunner, StepInput
from looped_spec.execution.sampler import SamplingRows, probabilities, sample_from
from looped_spec.request import Request
from looped_spec.speculative.readouts import read_out_depths


@dataclass
class Draft:
    """Draft of one round. Rows are requests sorted by K descending, so step j's rows are a prefix."""

    tokens: torch.Tensor  # [num_reqs, max_k] long, -1 past each row's K
    q_probs: torch.Tensor | None  # [num_reqs, max_k, V] draft distributions (None when all greedy)
    states: list[torch.Tensor]  # per step j: [rows_j, state_dim] loop-d state of position j
    depth_preds: torch.Tensor | None  # [d, num_reqs, max_k + 1] argmax of readout at depth 1..d, -1 if none


def draw_drafts(
    logits: torch.Tensor, rows: SamplingRows, requests: list[Request]
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft tokens [n] from the readout `logits` [n, V] of the first n rows that still draft, and their draft
    distributions q [n, V] (None when those rows are all greedy). Decided per step, not per batch: the sampled
    rows may all have dropped out (smaller K)."""
    sub = rows if rows.all_greedy else SamplingRows.build(requests, logits.device)
    if sub.all_greedy:
        return logits.argmax(-1), None
    q = probabilities(logits, sub)
    return sample_from(q, sub.uniforms(1)[:, 0]), q


class DraftProposer:
    """Runs loops 1..d for position j of every request with K >= j; reads out draft token j+1 at depth d."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def draw(
        self, logits: torch.Tensor, rows: SamplingRows, requests: list[Request], j: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Draft token j+1 of the first `len(requests)` rows from their depth-d readout, and its distribution."""
        return draw_drafts(logits, rows, requests)

    @torch.inference_mode()
    def propose(
        self, requests: list[Request], k: list[int], d: int, rows: SamplingRows, measure: bool = False
    ) -> Draft:
        """K tokens per request (rows sorted by K descending); with `measure`, every depth 1..d is read out too."""
        runner = self.runner
        num_reqs, max_k = len(requests), max(k)
        device = runner.device
        tokens = torch.full((num_reqs, max_k), -1, dtype=torch.long, device=device)
        q_probs = None
        depth_preds = None
        if measure:
            depth_preds = torch.full((d, num_reqs, max_k + 1), -1, dtype=torch.long, device=device)
        states: list[torch.Tensor] = []
        step_tokens = runner.token_tensor([r.token_ids[r.num_computed] for r in requests])
        for j in range(max_k + 1):
            num_rows = sum(1 for kr in k if kr >= j)
            num_next = sum(1 for kr in k if kr > j)  # rows that still need draft token j+1
            active = requests[:num_rows]
            context_lens = [r.num_computed + j + 1 for r in active]
            inp = StepInput(
                active, [1] * num_rows, context_lens, 0, d, tokens=step_tokens[:num_rows],
                readout=num_next > 0 and not measure, keep_states=measure,
            )  # fmt: skip
            out = runner.run(inp)
            state, logits = out.state, out.logits
            if measure:  # depths 1..d-1 from the kept states, then the draft's own depth d
                preds, logits = read_out_depths(runner, inp, out)
                for depth, pred in enumerate([*preds, logits.argmax(-1)], start=1):
                    depth_preds[depth - 1, :num_rows, j] = pred
            states.append(state)
            if num_next == 0:
                break
            drafted, q = self.draw(logits[:num_next], rows, active[:num_next], j)
            if q is not None:
                if q_probs is None:
                    q_probs = torch.zeros(num_reqs, max_k, q.shape[-1], device=device)
                q_probs[:num_next, j] = q
            tokens[:num_next, j] = drafted
            step_tokens = drafted
        return Draft(tokens=tokens, q_probs=q_probs, states=states, depth_preds=depth_preds)
