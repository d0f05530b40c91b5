"""Verifier: loops d+1..D once over the K+1 positions of every request, full-depth logits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from looped_spec.execution.model_runner import ModelRunner, StepInput
from looped_spec.execution.sampler import SamplingRows
from looped_spec.execution.transfers import to_device
from looped_spec.request import Request
from looped_spec.speculative.proposer import Draft
from looped_spec.speculative.readouts import position_rows, read_out_depths


@dataclass
class Verification:
    logits: torch.Tensor  # [sum(K+1), V] full-depth logits, request after request
    row_index: torch.Tensor  # [sum(K+1)] request row of each position
    pos_index: torch.Tensor  # [sum(K+1)] position j (0..K) of each position within its request
    depth_preds: torch.Tensor | None  # [D - d - 1, sum(K+1)] greedy choice at depths d+1..D-1
    # measured, where a request adjusts its logits: each position's adjustments (readouts.py `position_rows`)
    rows: SamplingRows | None = None


def position_index(k: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(request row, position j) of every verified position [sum(K+1)], request after request (CPU)."""
    row_index = torch.repeat_interleave(torch.arange(len(k)), torch.tensor(k) + 1)
    return row_index, torch.cat([torch.arange(kr + 1) for kr in k])


class Verifier:
    """Continues the draft's own loop-d states (its KV for loops 1..d is already cached)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    @torch.inference_mode()
    def verify(
        self, requests: list[Request], k: list[int], d: int, draft: Draft, measure: bool = False
    ) -> Verification:
        """Full-depth logits of every drafted position; with `measure`, depths d+1..D-1 are read out too."""
        runner = self.runner
        device = runner.device
        row_index, pos_index = position_index(k)
        # draft.states[j] holds rows 0..rows_j-1; flatten to pick (row, j) pairs in request order
        offsets = [0]
        for s in draft.states[:-1]:
            offsets.append(offsets[-1] + s.shape[0])
        flat_states = torch.cat(draft.states, dim=0)
        gather = torch.tensor(offsets, dtype=torch.long)[pos_index] + row_index
        state = flat_states[to_device(gather, device)]  # [sum(K+1), state_dim]
        context_lens = [r.num_computed + kr + 1 for r, kr in zip(requests, k)]
        keep = measure and any(d < j for j in runner.readout_depths)  # depths d+1..D-1 to read out
        inp = StepInput(
            requests, [kr + 1 for kr in k], context_lens, d, runner.full_depth, state=state,
            readout=not keep, keep_states=keep,
        )  # fmt: skip
        out = runner.run(inp)
        logits, depth_preds, rows = out.logits, None, None
        if measure and any(r.adjusts_logits for r in requests):  # each position's adjustments, drafts before it
            grid, positions = draft.tokens.tolist(), list(zip(row_index.tolist(), pos_index.tolist()))
            rows = position_rows([requests[r] for r, _ in positions], [grid[r][:j] for r, j in positions], device)
        if keep:
            preds, logits = read_out_depths(runner, inp, out, rows)
            depth_preds = torch.stack(preds)
        return Verification(logits, to_device(row_index, device), to_device(pos_index, device), depth_preds, rows)
