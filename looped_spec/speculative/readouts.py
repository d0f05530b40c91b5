"""Counterfactual depth readouts: what a step's shallower loop states would have predicted.

A readout's prediction is the greedy choice a draft at that depth would make: the argmax of the logits as the
request adjusts them (logit bias, penalties, the min_tokens and grammar masks, at the position, the drafts before it
counted as output), so the agreement the controller learns is the acceptance a draft sees.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from looped_spec.execution.model_runner import ModelRunner, StepInput, StepOutput
from looped_spec.execution.sampler import SamplingRows
from looped_spec.request import Request


def position_rows(
    requests: Sequence[Request], drafted: Sequence[Sequence[int]] | None, device: torch.device
) -> SamplingRows | None:
    """The adjustments of positions (one request each, `drafted[i]` the drafts before position i), or None when no
    request adjusts its logits (the raw argmax is then the greedy choice)."""
    if not any(r.adjusts_logits for r in requests):
        return None
    return SamplingRows.build(list(requests), device, drafted)


def greedy_ids(logits: torch.Tensor, rows: SamplingRows | None) -> torch.Tensor:
    """[n] the greedy choice of each row of `logits` [n, V] under its adjustments (`position_rows`)."""
    return (rows.adjusted(logits) if rows is not None else logits).argmax(-1)


def read_out_depths(
    runner: ModelRunner, inp: StepInput, out: StepOutput, rows: SamplingRows | None = None, last: bool = True
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """For a step run with `keep_states`: the greedy prediction at every depth start+1..end-1 ([num_tokens]
    each, from the kept states, under the positions' adjustments `rows`; `not_read` at a depth the runner does not
    read out), then the logits at depth `end` (None with `last` False). In that order: a readout that writes KV
    (Huginn's coda) must leave the step's own depth in the cache, as a step without measurements does."""
    preds = []
    for depth, state in enumerate(out.states, start=inp.start + 1):
        read = depth in runner.readout_depths
        preds.append(greedy_ids(runner.readout(state, depth, out.ctx), rows) if read else not_read(len(state), state))
    return preds, runner.readout(out.state, inp.end, out.ctx) if last else None


def depth_trials(positions: int, full_depth: int, read: Collection[int]) -> list[int]:
    """[D] a measured round's trials per depth over its `positions` committed positions: none at a depth below full
    that was not read out (not in `read`)."""
    return [positions if depth in read or depth == full_depth else 0 for depth in range(1, full_depth + 1)]


def not_read(n: int, like: torch.Tensor) -> torch.Tensor:
    """[n] the prediction of a depth that was not read out: -1, which no token equals (it reports no trials)."""
    return torch.full((n,), -1, dtype=torch.long, device=like.device)
