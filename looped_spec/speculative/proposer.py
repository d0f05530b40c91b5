"""Draft proposer: K tokens per request from the first d loops, one position at a time."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from looped_spec.execution.model_runner import ModelRunner, StepInput
from looped_spec.execution.sampler import SamplingRows, probabilities, sample_from
from looped_spec.execution.transfers import to_device
from looped_spec.request import Request
from looped_spec.speculative.readouts import greedy_ids, not_read, position_rows, read_out_depths


@dataclass
class Draft:
    """Draft of one round. Rows are requests sorted by K descending, so step j's rows are a prefix."""

    tokens: torch.Tensor  # [num_reqs, max_k] long, -1 past each row's K
    q_probs: torch.Tensor | None  # [num_reqs, max_k, V] draft distributions (None when all greedy)
    states: list[torch.Tensor]  # per step j: [rows_j, state_dim] loop-d state of position j
    depth_preds: torch.Tensor | None  # [d, num_reqs, max_k + 1] argmax of readout at depth 1..d, -1 if none
    # per-token stopping: the rows' K as drafted and their new K-descending order (indices into the given rows);
    # None when every row drafted its planned K in the given order
    k: list[int] | None = None
    order: list[int] | None = None


def top_two_margin(logits: torch.Tensor) -> torch.Tensor:
    """[n]: the gap between the two largest probabilities of each row's readout (softmax before temperature)."""
    top2 = logits.float().softmax(-1).topk(2, dim=-1).values
    return top2[:, 0] - top2[:, 1]


def in_drafted_order(
    tokens: list[list[int]], q_rows: list[list[torch.Tensor | None]], ran: list[list[int]], device
) -> tuple[list[int], torch.Tensor, torch.Tensor | None, list[list[int]]]:
    """Per-token stopping leaves rows with ragged K: (the rows sorted by the K they drafted, stable; the draft tokens
    [R, K_max] (-1 past each row's K) and their distributions (None: all greedy) in that order; per draft step j the
    indices, into the rows step j ran (`ran[j]`), of the rows that drafted >= j, in that order). `q_rows[i][j]` is
    row i's draft distribution at step j, None where every row drafting then was greedy (a greedy row drafts beside
    sampled rows at some steps and alone at others; its verification never reads q, which stays zero there)."""
    drafted = [len(t) for t in tokens]
    order = sorted(range(len(tokens)), key=lambda i: -drafted[i])
    max_k = max(drafted)
    grid = torch.full((len(tokens), max_k), -1, dtype=torch.long, device=device)
    q_probs = None
    for row, i in enumerate(order):
        if tokens[i]:
            grid[row, : drafted[i]] = to_device(tokens[i], device)
        known = [(j, q) for j, q in enumerate(q_rows[i]) if q is not None]
        if not known:
            continue
        if q_probs is None:
            q_probs = torch.zeros(len(tokens), max_k, known[0][1].shape[-1], device=device)
        if len(known) == drafted[i]:  # every step of the row had a distribution: one copy
            q_probs[row, : drafted[i]] = torch.stack([q for _, q in known])
        else:
            for j, q in known:
                q_probs[row, j] = q
    steps = []
    for j, rows in enumerate(ran):  # the rows step j ran are those that drafted >= j
        where = {i: n for n, i in enumerate(rows)}
        steps.append([where[i] for i in order if drafted[i] >= j])
    return order, grid, q_probs, steps


def draw_drafts(
    logits: torch.Tensor, requests: list[Request], drafted: list[list[int]] | None = None,
    batch_rows: SamplingRows | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """Draft tokens [n] from the readout `logits` [n, V] of `requests`, the n rows that still draft, and their draft
    distributions q [n, V] (None when those rows are all greedy). Decided per step, not per batch: the sampled
    rows may all have dropped out (smaller K). `drafted[i]`: row i's drafts so far (penalties and min_tokens count
    them). `batch_rows`: the round's rows, a superset; when they are all greedy and unadjusted, nothing is built."""
    if batch_rows is not None and batch_rows.all_greedy and not batch_rows.adjusts:
        return logits.argmax(-1), None
    sub = SamplingRows.build(requests, logits.device, drafted)
    if sub.all_greedy:
        return sub.adjusted(logits).argmax(-1), None
    q = probabilities(logits, sub)
    return sample_from(q, sub.uniforms(1)[:, 0]), q


class DraftProposer:
    """Runs loops 1..d for position j of every request with K >= j; reads out draft token j+1 at depth d."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def draw(
        self, logits: torch.Tensor, rows: SamplingRows, requests: list[Request], j: int,
        drafted: list[list[int]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
        """Draft token j+1 of the first `len(requests)` rows from their depth-d readout, and its distribution
        (`drafted`: each row's j drafts so far, where a penalty or min_tokens counts them)."""
        return draw_drafts(logits, requests, drafted, rows)

    @torch.inference_mode()
    def propose(
        self, requests: list[Request], k: list[int], d: int, rows: SamplingRows, measure: bool = False,
        stop_margin: float | None = None,
    ) -> Draft:  # fmt: skip
        """K tokens per request (rows sorted by K descending); with `measure`, the depths 1..d the runner reads out are
        read out too; with `stop_margin`, a row stops at its first draft whose margin is below it
        (`propose_until_unsure`)."""
        if stop_margin is not None and not measure:
            return self.propose_until_unsure(requests, k, d, stop_margin)
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
                step_rows = position_rows(active, tokens[:num_rows, :j].tolist(), device) if rows.adjusts else None
                # the last position's depth-d readout serves the measurement only
                read = d in runner.readout_depths
                preds, logits = read_out_depths(runner, inp, out, step_rows, num_next > 0 or read)
                own = greedy_ids(logits, step_rows) if read else not_read(num_rows, state)
                for depth, pred in enumerate([*preds, own], start=1):
                    depth_preds[depth - 1, :num_rows, j] = pred
            states.append(state)
            if num_next == 0:
                break
            so_far = tokens[:num_next, :j].tolist() if rows.counts_drafts else None
            drafted, q = self.draw(logits[:num_next], rows, active[:num_next], j, so_far)
            if q is not None:
                if q_probs is None:
                    q_probs = torch.zeros(num_reqs, max_k, q.shape[-1], device=device)
                q_probs[:num_next, j] = q
            tokens[:num_next, j] = drafted
            step_tokens = drafted
        return Draft(tokens=tokens, q_probs=q_probs, states=states, depth_preds=depth_preds)

    @torch.inference_mode()
    def propose_until_unsure(self, requests: list[Request], k: list[int], d: int, stop_margin: float) -> Draft:
        """Up to K tokens per request, each row stopping at its first draft whose depth-d top-two probability margin
        (softmax of the readout, before temperature) is below `stop_margin`: that draft is not proposed, the row's
        K is the drafts before it. The rule reads the draft's own distribution only, never the target, so verifying
        what was proposed keeps the target distribution (docs/adaptive.md). Rows are then re-sorted by the K they
        drafted, so each step's rows are again a prefix."""
        runner, device = self.runner, self.runner.device
        num_reqs = len(requests)
        tokens: list[list[int]] = [[] for _ in range(num_reqs)]
        q_rows: list[list[torch.Tensor | None]] = [[] for _ in range(num_reqs)]
        steps: list[tuple[list[int], torch.Tensor]] = []  # per step j: (rows it ran, their loop-d states)
        alive = list(range(num_reqs))  # rows still drafting, in the given (K-descending) order
        step_tokens = runner.token_tensor([r.token_ids[r.num_computed] for r in requests])
        j = 0
        while alive:
            active = [requests[i] for i in alive]
            needs_next = [i for i in alive if k[i] > j]  # a prefix of `alive`
            inp = StepInput(active, [1] * len(alive), [r.num_computed + j + 1 for r in active], 0, d,
                            tokens=step_tokens, readout=bool(needs_next))  # fmt: skip
            out = runner.run(inp)
            steps.append((alive, out.state))
            if not needs_next:
                break
            logits = out.logits[: len(needs_next)]
            sure = [m >= stop_margin for m in top_two_margin(logits).tolist()]
            going = [i for i, ok in zip(needs_next, sure) if ok]
            if going:
                keep = to_device([n for n, ok in enumerate(sure) if ok], device)
                reqs, so_far = [requests[i] for i in going], [tokens[i] for i in going]
                drawn, q = draw_drafts(logits[keep], reqs, so_far)
                for n, (i, token) in enumerate(zip(going, drawn.tolist())):
                    tokens[i].append(token)
                    q_rows[i].append(None if q is None else q[n])
                step_tokens = drawn
            alive, j = going, j + 1
        order, grid, q_probs, kept = in_drafted_order(tokens, q_rows, [ran for ran, _ in steps], device)
        states = [state[to_device(index, state.device)] for (_, state), index in zip(steps, kept)]
        return Draft(
            tokens=grid, q_probs=q_probs, states=states, depth_preds=None, k=[len(t) for t in tokens], order=order
        )
