"""Draft and verify with early exit: the target is the early-exit model (docs/architecture.md, "Early exit",
"With speculation").

Each position's forward stops at its exit depth e (the adapter's rule, the request's exit_at_step, or D).
The draft runs loops 1..d with the same rule, so a position that exits at e <= d has computed exactly what
the target computes: its readout *is* the target's, the token drawn from it needs no verification
(`decided`), and in skip mode its deeper KV planes are filled right away. The verifier continues the other
positions from loop d, applying the rule after every loop; in skip mode a position that exits leaves the
pass and its deeper planes get its exit loop's KV before the next loop runs, so later positions of the pass
attend to what plain decoding would have cached.

A readout that attends (Huginn's coda) makes a position's logits depend on the coda KV of the positions
before it, which is final only once they exited. So for such adapters a draft-exited position counts as
decided only when every earlier position of its round was; the others are read out again by the verifier
(their exit depth and core KV stand). An exit rule that itself reads out through attention (Huginn's "kl")
would see non-final coda KV inside a multi-position pass: the engine gives such requests K = 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from looped_spec.execution.early_exit import (
    ExitMode,
    ExitTracker,
    fill_skipped_loops,
    loops_with_exit,
    read_out_by_depth,
)
from looped_spec.execution.model_runner import ModelRunner
from looped_spec.execution.sampler import SamplingRows
from looped_spec.execution.transfers import to_device
from looped_spec.request import Request
from looped_spec.speculative.proposer import Draft, draw_drafts, in_drafted_order, top_two_margin
from looped_spec.speculative.verifier import position_index


@dataclass
class ExitDraftStep:
    """Draft position j of the rows with K >= j (a prefix of the K-descending request order)."""

    state: torch.Tensor  # [rows, S] after loop d (skip mode: rows that exited hold their exit state)
    exit_depth: list[int]  # per row: the loop (<= d) it exited after, 0 when it goes on to verification
    exit_state: torch.Tensor  # [rows, S] state at the exit loop (rows with exit_depth > 0)
    logits: torch.Tensor | None  # [rows, V] readout at the exit depth (exited rows) or d (rows drafting on)
    carry: torch.Tensor | None  # [rows, ...] the exit rule's carry after loop d (rows that did not exit)


@dataclass
class ExitVerification:
    logits: torch.Tensor  # [sum(K+1), V] target logits, request after request (decided rows: the draft's)
    row_index: torch.Tensor  # [sum(K+1)] request row of each position
    pos_index: torch.Tensor  # [sum(K+1)] position j (0..K) of each position within its request
    decided: torch.Tensor  # [R, K_max + 1] bool: position j's target readout came from the draft
    exit_depths: list[list[int]]  # per request, per position 0..K: its exit depth


def _read_out_step(runner, active, positions, state, exit_depth, exit_state, num_next: int, d: int):
    """[rows, V] readouts of one draft step (zeros where not read out): the rows that draft on (the first `num_next`)
    at d, and exited rows at their exit (the target's readout, even past a row's last draft); None if neither."""
    need = [n for n in range(len(active)) if n < num_next or exit_depth[n] > 0]
    if not need:
        return None
    exited = to_device([exit_depth[n] > 0 for n in need], runner.device)[:, None]
    need_index = to_device(need, runner.device)
    states = torch.where(exited, exit_state[need_index], state[need_index])
    picked, at = [active[n] for n in need], [positions[n] for n in need]
    lens = [p + 1 for p in at]
    # a readout that attends gets a context of exactly these rows (it writes their readout KV)
    ctx = runner.context(picked, [1] * len(need), lens) if runner.adapter.readout_uses_kv else None
    part = read_out_by_depth(runner, picked, at, lens, states, [exit_depth[n] or d for n in need], ctx)
    logits = part.new_zeros(len(active), part.shape[-1])
    logits[need_index] = part
    return logits


def _draft_position(
    runner: ModelRunner, requests: list[Request], positions: list[int], tokens: torch.Tensor, d: int, mode: ExitMode
) -> tuple[torch.Tensor, list[int], torch.Tensor, torch.Tensor | None]:
    """Loops 1..d of one position per request under the exit rule -> (state after d (skip mode: rows that
    exited hold their exit state), exit depth per row (0: none), exit states, the rule's carry after d)."""
    ctx = runner.context(requests, [1] * len(requests), [p + 1 for p in positions])
    state = runner.embed(tokens, ctx)
    state, exit_depth, exit_state, tracker, live, _ = loops_with_exit(runner, requests, positions, state, ctx, d, mode)
    if mode == "select":
        return state, exit_depth, exit_state, tracker.carry
    final = exit_state.clone()
    if not live:
        return final, exit_depth, exit_state, None
    final[to_device(live, state.device)] = state
    carry = None
    if tracker.carry is not None:
        carry = tracker.carry.new_zeros(len(requests), *tracker.carry.shape[1:])
        carry[live] = tracker.carry
    return final, exit_depth, exit_state, carry


@torch.inference_mode()
def propose_with_exit(
    runner: ModelRunner, requests: list[Request], k: list[int], d: int, rows: SamplingRows, mode: ExitMode
) -> tuple[Draft, list[ExitDraftStep]]:
    """The draft of a round with early exit: position j of every request with K >= j runs loops 1..d under
    the exit rule; draft token j+1 is read out at the exit depth (a target sample) or at d."""
    num_reqs, max_k = len(requests), max(k)
    device = runner.device
    tokens = torch.full((num_reqs, max_k), -1, dtype=torch.long, device=device)
    q_probs = None
    steps: list[ExitDraftStep] = []
    step_tokens = runner.token_tensor([r.token_ids[r.num_computed] for r in requests])
    for j in range(max_k + 1):
        num_rows = sum(1 for kr in k if kr >= j)
        num_next = sum(1 for kr in k if kr > j)  # rows that still need draft token j+1
        active = requests[:num_rows]
        positions = [r.num_computed + j for r in active]
        state, exit_depth, exit_state, carry = _draft_position(
            runner, active, positions, step_tokens[:num_rows], d, mode
        )
        logits = _read_out_step(runner, active, positions, state, exit_depth, exit_state, num_next, d)
        steps.append(ExitDraftStep(state, exit_depth, exit_state, logits, carry))
        if num_next == 0:
            break
        assert logits is not None
        so_far = tokens[:num_next, :j].tolist() if rows.counts_drafts else None
        drafted, q = draw_drafts(logits[:num_next], active[:num_next], so_far, rows)
        if q is not None:
            if q_probs is None:
                q_probs = torch.zeros(num_reqs, max_k, q.shape[-1], device=device)
            q_probs[:num_next, j] = q
        tokens[:num_next, j] = drafted
        step_tokens = drafted
    return Draft(tokens=tokens, q_probs=q_probs, states=[s.state for s in steps], depth_preds=None), steps


@torch.inference_mode()
def propose_with_exit_until_unsure(
    runner: ModelRunner, requests: list[Request], k: list[int], d: int, mode: ExitMode, stop_margin: float
) -> tuple[Draft, list[ExitDraftStep]]:
    """`propose_with_exit` with per-token stopping (proposer.py, `propose_until_unsure`): a row stops at its first
    draft read out at depth d whose top-two margin is below `stop_margin` (a position that exited within the draft is
    the target's own sample, never unsure). Rows and steps are then re-sorted by the K they drafted, so each step's
    rows are again a prefix."""
    num_reqs, device = len(requests), runner.device
    tokens: list[list[int]] = [[] for _ in range(num_reqs)]
    q_rows: list[list[torch.Tensor | None]] = [[] for _ in range(num_reqs)]
    ran: list[tuple[list[int], ExitDraftStep]] = []  # per step j: (rows it ran, in the given order; the step)
    alive = list(range(num_reqs))
    step_tokens = runner.token_tensor([r.token_ids[r.num_computed] for r in requests])
    j = 0
    while alive:
        active = [requests[i] for i in alive]
        positions = [r.num_computed + j for r in active]
        state, exit_depth, exit_state, carry = _draft_position(runner, active, positions, step_tokens, d, mode)
        needs_next = [n for n, i in enumerate(alive) if k[i] > j]  # a prefix of `alive`
        logits = _read_out_step(runner, active, positions, state, exit_depth, exit_state, len(needs_next), d)
        ran.append((alive, ExitDraftStep(state, exit_depth, exit_state, logits, carry)))
        judged = [n for n in needs_next if exit_depth[n] == 0]  # read out at d: a draft, maybe unsure
        unsure = set()
        if judged:
            unsure = {n for n, m in zip(judged, top_two_margin(logits[judged]).tolist()) if m < stop_margin}
        going = [n for n in needs_next if n not in unsure]
        if not going:
            break
        reqs, so_far = [active[n] for n in going], [tokens[alive[n]] for n in going]
        drawn, q = draw_drafts(logits[going], reqs, so_far)
        for m, (n, token) in enumerate(zip(going, drawn.tolist())):
            i = alive[n]
            tokens[i].append(token)
            q_rows[i].append(None if q is None else q[m])
        alive, step_tokens, j = [alive[n] for n in going], drawn, j + 1
    order, grid, q_probs, kept = in_drafted_order(tokens, q_rows, [rows for rows, _ in ran], device)
    steps = []
    for (_, step), index in zip(ran, kept):  # step j: the rows that drafted >= j, in the new order
        at = to_device(index, device)
        steps.append(ExitDraftStep(
            step.state[at], [step.exit_depth[n] for n in index], step.exit_state[at],
            None if step.logits is None else step.logits[at], None if step.carry is None else step.carry[at],
        ))  # fmt: skip
    states = [s.state for s in steps]
    return Draft(grid, q_probs, states, depth_preds=None, k=[len(t) for t in tokens], order=order), steps


def decided_positions(steps: list[ExitDraftStep], k: list[int], readout_uses_kv: bool) -> list[list[bool]]:
    """Per request, per position 0..K: whether the draft's readout is already the target's."""
    out = []
    for r, kr in enumerate(k):
        row: list[bool] = []
        for j in range(kr + 1):
            exited = steps[j].exit_depth[r] > 0
            row.append(exited and (not readout_uses_kv or all(row)))
        out.append(row)
    return out


@torch.inference_mode()
def verify_with_exit(
    runner: ModelRunner, requests: list[Request], k: list[int], d: int, steps: list[ExitDraftStep], mode: ExitMode
) -> ExitVerification:
    """Loops d+1..D of the positions the draft did not decide, under the exit rule; target logits of all."""
    adapter, device, full_depth = runner.adapter, runner.device, runner.full_depth
    num_reqs, max_k = len(requests), max(k)
    decided = decided_positions(steps, k, adapter.readout_uses_kv)
    depth = [[steps[j].exit_depth[r] for j in range(kr + 1)] for r, kr in enumerate(k)]
    # the positions read out here: per request, from its first undecided position on (contiguous)
    first = [row.index(False) if False in row else len(row) for row in decided]
    # the positions that loop on: select mode runs every position's loops (all are cached); skip mode only
    # those from the first undecided one (a decided prefix is final, its deeper planes filled)
    lo = [0 if mode == "select" else f for f in first]
    pass_rows = [(r, j) for r, kr in enumerate(k) for j in range(lo[r], kr + 1)]  # (request, position)
    # read out from the first undecided position on; in select mode a readout that attends reads out every
    # position of the pass, since the exit rule's own readouts (Huginn's "kl") overwrote their readout KV
    start = lo if mode == "select" and adapter.readout_uses_kv else first
    readout_rows = [(r, j) for r, kr in enumerate(k) for j in range(start[r], kr + 1)]
    final_states: dict[tuple[int, int], torch.Tensor] = {}
    if pass_rows:
        state = torch.stack([steps[j].state[r] for r, j in pass_rows])  # [n, S]
        exit_state = torch.stack([steps[j].exit_state[r] for r, j in pass_rows])
        done = to_device([depth[r][j] > 0 for r, j in pass_rows], device)  # exit already known
        tracker = ExitTracker(adapter, [requests[r] for r, _ in pass_rows], device)
        if tracker.any_rule:
            tracker.carry = _gather_carry(steps, pass_rows, tracker.carry)
        rows = pass_rows
        for n, (r, j) in enumerate(rows):  # exits the draft already decided
            if depth[r][j] > 0:
                final_states[(r, j)] = exit_state[n]
        ctx = _pass_context(runner, requests, rows)
        for i in range(d, full_depth):
            # skip mode: exited positions keep their filled planes
            ctx.write_index = (~done).nonzero().flatten() if mode == "skip" and bool(done.any()) else None
            prev, state = state, adapter.loop(state, i, ctx)
            new = tracker.step(i + 1, state, prev, ctx) & ~done
            if bool(new.any()):
                exit_state[new] = state[new]
                for n in new.nonzero().flatten().tolist():
                    r, j = rows[n]
                    depth[r][j] = i + 1
                    final_states[(r, j)] = exit_state[n]
                if mode == "skip" and i + 1 < full_depth:
                    fill_skipped_loops(runner, ctx.slot_mapping[new], i + 1)
                done = done | new
            if mode == "select":  # every loop runs and is cached, whatever the exits
                continue
            if bool(done.all()):
                break
            if mode == "skip":  # the pass narrows to each request's span of positions still looping
                keep = _span_of_live(rows, done)
                if not bool(keep.all()):
                    rows = [row for row, kept in zip(rows, keep.tolist()) if kept]
                    state, exit_state, done = state[keep], exit_state[keep], done[keep]
                    tracker.keep(keep)
                    ctx = _pass_context(runner, requests, rows)
    logits = _target_logits(runner, requests, steps, decided, depth, readout_rows, final_states)
    decided_grid = torch.zeros(num_reqs, max_k + 1, dtype=torch.bool)
    for r, row in enumerate(decided):
        decided_grid[r, : len(row)] = torch.tensor(row)
    decided_grid = to_device(decided_grid, device)
    row_index, pos_index = position_index(k)
    return ExitVerification(logits, to_device(row_index, device), to_device(pos_index, device), decided_grid, depth)


def _gather_carry(steps: list[ExitDraftStep], rows, like: torch.Tensor | None) -> torch.Tensor | None:
    """The draft's carry of each pass row (zeros for rows whose exit is already known)."""
    sample = next((s.carry for s in steps if s.carry is not None), None)
    if sample is None:
        return like
    out = sample.new_zeros(len(rows), *sample.shape[1:])
    for n, (r, j) in enumerate(rows):
        carry = steps[j].carry
        if carry is not None:
            out[n] = carry[r]
    return out


def _pass_context(runner: ModelRunner, requests: list[Request], rows: list[tuple[int, int]]):
    """Context of a pass over contiguous positions per request (`rows` request-major, positions ascending)."""
    spans: dict[int, list[int]] = {}
    for r, j in rows:
        spans.setdefault(r, []).append(j)
    reqs = [requests[r] for r in spans]
    return runner.context(
        reqs, [len(js) for js in spans.values()], [requests[r].num_computed + js[-1] + 1 for r, js in spans.items()]
    )


def _span_of_live(rows: list[tuple[int, int]], done: torch.Tensor) -> torch.Tensor:
    """Rows [n] bool to keep: per request, its positions from the first to the last one still looping."""
    live = (~done).tolist()
    keep = [False] * len(rows)
    by_request: dict[int, list[int]] = {}
    for n, (r, _) in enumerate(rows):
        by_request.setdefault(r, []).append(n)
    for ns in by_request.values():
        looping = [n for n in ns if live[n]]
        if looping:
            for n in range(looping[0], looping[-1] + 1):
                keep[n] = True
    return to_device(keep, done.device)


def _target_logits(runner, requests, steps, decided, depth, readout_rows, final_states) -> torch.Tensor:
    """[sum(K+1), V]: decided positions keep the draft's readout; the others are read out at their exit
    state (a readout that attends runs once over each request's span, so its KV is written causally)."""
    verified = None
    if readout_rows:
        states = torch.stack([final_states[row] for row in readout_rows])  # every pass row exits by D
        if runner.adapter.readout_uses_kv:  # depth-independent readouts that attend (prefill_with_exit does the same)
            verified = runner.readout(states, runner.full_depth, _pass_context(runner, requests, readout_rows))
        else:
            reqs = [requests[r] for r, _ in readout_rows]
            positions = [requests[r].num_computed + j for r, j in readout_rows]
            depths = [depth[r][j] for r, j in readout_rows]
            verified = read_out_by_depth(runner, reqs, positions, [p + 1 for p in positions], states, depths, None)
    out = []
    index = {row: n for n, row in enumerate(readout_rows)}
    for r, row in enumerate(decided):
        for j, is_decided in enumerate(row):
            out.append(steps[j].logits[r] if is_decided else verified[index[(r, j)]])
    return torch.stack(out)
