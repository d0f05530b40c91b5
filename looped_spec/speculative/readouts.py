"""Counterfactual depth readouts: what a step's shallower loop states would have predicted."""

from __future__ import annotations

import torch

from looped_spec.execution.model_runner import ModelRunner, StepInput, StepOutput


def read_out_depths(runner: ModelRunner, inp: StepInput, out: StepOutput) -> tuple[list[torch.Tensor], torch.Tensor]:
    """For a step run with `keep_states`: the greedy prediction at every depth start+1..end-1 ([num_tokens]
    each, from the kept states), then the logits at depth `end`. In that order: a readout that writes KV
    (Huginn's coda) must leave the step's own depth in the cache, as a step without measurements does."""
    preds = [runner.readout(state, inp.start + 1 + i, out.ctx).argmax(-1) for i, state in enumerate(out.states)]
    return preds, runner.readout(out.state, inp.end, out.ctx)
