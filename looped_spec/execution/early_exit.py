"""Early exit: each generated token stops looping at its exit depth (docs/architecture.md, "Early exit").

The family decides *when* a token exits (`ModelAdapter.exit_rule`: Ouro's gate, Huginn's convergence;
any family: a request's fixed `exit_at_step`); this module decides *what that means* for the batch:

* `select`: every loop runs and is cached; only the readout depth follows the exit.
* `skip`: a token's loops after its exit are not run; the KV planes of those loops get the KV of its
  exit loop, so later tokens attending at deeper loops read the exit loop's keys and values.

Prompt tokens are prefilled at full depth in both modes; the exit rule picks the readout depth from the
last prompt position on. A token recomputed after preemption redoes its recorded exit depth.
"""

from __future__ import annotations

from typing import Literal

import torch

from looped_spec.execution.transfers import to_device
from looped_spec.request import Request

ExitMode = Literal["skip", "select"]
EXIT_MODES: tuple[str, ...] = ("skip", "select")


class ExitTracker:
    """The exit decision of a set of rows, loop after loop; `keep` drops rows that left the pass."""

    def __init__(self, adapter, requests: list[Request], device: torch.device) -> None:
        self.adapter = adapter
        self.full_depth = adapter.full_depth
        thresholds = [r.exit_threshold for r in requests]
        self.rule_rows = to_device([t is not None for t in thresholds], device)
        self.threshold = to_device([t if t is not None else float("nan") for t in thresholds], device, torch.float32)
        self.at_step = to_device([r.exit_at_step or self.full_depth for r in requests], device)
        self.any_rule = any(t is not None for t in thresholds)
        self.carry = adapter.exit_carry(len(requests)) if self.any_rule else None
        self.logits: torch.Tensor | None = None  # the last step's rule readout of its rows, when the rule read out

    def step(self, depth: int, state: torch.Tensor, prev_state: torch.Tensor, ctx) -> torch.Tensor:
        """Rows [n] bool that exit after loop `depth` (1-based): rule fired, fixed step reached, or depth D."""
        exits = self.at_step <= depth
        self.logits = None
        if depth >= self.full_depth:
            return torch.ones_like(exits)
        if self.any_rule:
            fired, self.carry, self.logits = self.adapter.exit_rule(state, depth, prev_state, self.carry,
                                                                    self.threshold, ctx)  # fmt: skip
            exits = exits | (fired & self.rule_rows)
        return exits

    def keep(self, rows: torch.Tensor) -> None:
        self.rule_rows, self.threshold, self.at_step = self.rule_rows[rows], self.threshold[rows], self.at_step[rows]
        if self.carry is not None:
            self.carry = self.carry[rows]


def fill_skipped_loops(runner, slots: torch.Tensor, exit_depth: int) -> None:
    """Skip mode: the loop planes after `exit_depth` get the exit loop's KV at `slots` (one copy for all of them)."""
    adapter = runner.adapter
    if exit_depth >= adapter.full_depth:
        return
    src = adapter.loop_planes(exit_depth - 1)
    later = range(exit_depth, adapter.full_depth)
    runner.kv.copy_planes([p for _ in later for p in src], [p for i in later for p in adapter.loop_planes(i)], slots)


def token_slots(requests: list[Request], positions: list[int], block_size: int, device) -> torch.Tensor:
    return to_device(
        [r.block_table[p // block_size] * block_size + p % block_size for r, p in zip(requests, positions)],
        device,
        torch.long,
    )


def read_out_by_depth(runner, requests, positions, context_lens, states, depths: list[int], ctx) -> torch.Tensor:
    """Logits [n, V] of one token per request, each at its own depth (one readout call per distinct depth, or one
    for all when the readout does not depend on the depth: `uniform_loops`).

    A readout that attends (Huginn's coda) gets a context of just its rows, so it writes only their KV.
    """
    if len(set(depths)) == 1 or runner.adapter.uniform_loops:
        return runner.readout(states, depths[0], ctx)
    logits = None
    for depth in sorted(set(depths)):
        rows = [i for i, d in enumerate(depths) if d == depth]
        sub_ctx = ctx
        if runner.adapter.readout_uses_kv:
            sub_ctx = runner.context([requests[i] for i in rows], [1] * len(rows), [context_lens[i] for i in rows])
        index = to_device(rows, states.device)
        part = runner.readout(states[index], depth, sub_ctx)
        if logits is None:
            logits = part.new_empty(len(depths), part.shape[-1])
        logits[index] = part
    return logits


LoopsResult = tuple[torch.Tensor, list[int], torch.Tensor, "ExitTracker", list[int], dict[int, torch.Tensor]]


def loops_with_exit(
    runner, requests: list[Request], positions: list[int], state: torch.Tensor, ctx, num_loops: int, mode: ExitMode
) -> LoopsResult:
    """Loops 1..num_loops of one token per request (at `positions`) under the exit rule.

    Returns the state after the last loop run (skip mode: of the rows still looping, `live`; select: every
    row), each row's exit depth (0: it did not exit), the exit states [n, S] (rows that exited), the tracker
    (its carry belongs to `live` in skip mode, to every row in select mode), `live`, and per row that exited where the
    rule read out (skip mode) those logits [V]: its readout. Skip mode: a row that exits leaves the pass and its
    deeper loop planes get its exit loop's KV at once.
    """
    num_rows = len(requests)
    tracker = ExitTracker(runner.adapter, requests, runner.device)
    exit_state = torch.empty_like(state)
    exit_depth = [0] * num_rows
    live = list(range(num_rows))  # rows still looping (skip mode); select keeps every row
    decided = torch.zeros(num_rows, dtype=torch.bool, device=runner.device)
    pass_ctx = ctx
    read_out: dict[int, torch.Tensor] = {}
    for i in range(num_loops):
        prev, state = state, runner.adapter.loop(state, i, pass_ctx)
        exits = tracker.step(i + 1, state, prev, pass_ctx)
        if mode == "select":  # every row runs every loop; the first exit fixes the readout depth
            new = exits & ~decided
            decided |= new
            exit_state[new] = state[new]
            for row in new.nonzero().flatten().tolist():
                exit_depth[row] = i + 1
            continue
        if not bool(exits.any()):
            continue
        leaving = [live[j] for j in exits.nonzero().flatten().tolist()]
        exit_state[to_device(leaving, state.device)] = state[exits]
        for row in leaving:
            exit_depth[row] = i + 1
        if tracker.logits is not None:  # the rule read them out: the exit state's logits, its coda KV written
            read_out.update(zip(leaving, tracker.logits[exits]))
        if i + 1 < runner.full_depth:
            slots = token_slots([requests[r] for r in leaving], [positions[r] for r in leaving], runner.kv.block_size,
                                runner.device)  # fmt: skip
            fill_skipped_loops(runner, slots, i + 1)
        stay = ~exits
        live = [r for r, s in zip(live, stay.tolist()) if s]
        if not live:
            break
        state = state[stay]
        tracker.keep(stay)
        # the rows that go on form a smaller pass: that is where skip mode saves compute
        pass_ctx = runner.context([requests[r] for r in live], [1] * len(live), [positions[r] + 1 for r in live])
    return state, exit_depth, exit_state, tracker, live, read_out


@torch.inference_mode()
def decode_with_exit(runner, requests: list[Request], mode: ExitMode) -> tuple[torch.Tensor, list[int]]:
    """Plain decode of each request's last token with early exit -> (logits [R, V], exit depth per request)."""
    positions = [r.num_computed for r in requests]
    context_lens = [p + 1 for p in positions]
    ctx = runner.context(requests, [1] * len(requests), context_lens)
    state = runner.embed(runner.token_tensor([r.token_ids[p] for r, p in zip(requests, positions)]), ctx)
    # every row exits by depth D (the tracker says so at D), so every exit depth is set
    _, exit_depth, exit_state, _, _, read_out = loops_with_exit(
        runner, requests, positions, state, ctx, runner.full_depth, mode
    )
    if not read_out:
        return read_out_by_depth(runner, requests, positions, context_lens, exit_state, exit_depth, ctx), exit_depth
    # the rows the rule read out at their exit keep those logits; the others are read out here
    rest = [i for i in range(len(requests)) if i not in read_out]
    part = None
    if rest:
        reqs, lens = [requests[i] for i in rest], [context_lens[i] for i in rest]
        sub_ctx = runner.context(reqs, [1] * len(rest), lens) if runner.adapter.readout_uses_kv else ctx
        part = read_out_by_depth(runner, reqs, [positions[i] for i in rest], lens,
                                 exit_state[to_device(rest, exit_state.device)], [exit_depth[i] for i in rest],
                                 sub_ctx)  # fmt: skip
    return merge_logits(len(requests), read_out, rest, part), exit_depth


def merge_logits(
    count: int, known: dict[int, torch.Tensor], rest: list[int], part: torch.Tensor | None
) -> torch.Tensor:
    """Logits [count, V]: the rows in `known` ([V] each, read out already by the exit rule), rows `rest` from `part`."""
    if not known:
        return part
    rows = list(known)
    first = known[rows[0]]
    logits = first.new_empty(count, first.shape[-1])
    logits[to_device(rows, logits.device)] = torch.stack([known[i] for i in rows])
    if rest:
        logits[to_device(rest, logits.device)] = part
    return logits


@torch.inference_mode()
def prefill_with_exit(
    runner, requests: list[Request], chunk_lens: list[int], mode: ExitMode
) -> tuple[torch.Tensor, list[int | None]]:
    """Prefill chunks at full depth, except generated tokens being recomputed, which redo their recorded exit.

    Returns logits [R, V] at each chunk's end and, per request whose chunk completes it, the exit depth
    of that last token (None otherwise). The last token's exit comes from the rule, after the pass (a rule
    that reads out, Huginn's coda, must see the chunk's earlier coda KV written first).
    """
    adapter, full_depth, device = runner.adapter, runner.full_depth, runner.device
    tokens: list[int] = []
    forced: list[int] = []  # per token: the loop whose KV its deeper loop planes keep (D: all its own)
    readout_depth: list[int] = []  # per token: the depth whose readout wrote its readout KV (Huginn's coda)
    context_lens, last = [], []
    for request, n in zip(requests, chunk_lens):
        start = request.num_computed
        for p in range(start, start + n):
            tokens.append(request.token_ids[p])
            recorded = p - (request.num_prompt_tokens - 1)  # exit depths are kept from the last prompt token on
            depth = request.exit_depths[recorded] if 0 <= recorded < len(request.exit_depths) else full_depth
            generated = p >= request.num_prompt_tokens  # prompt tokens keep every loop's own KV
            forced.append(depth if mode == "skip" and generated else full_depth)
            readout_depth.append(depth)
        context_lens.append(start + n)
        last.append(len(tokens) - 1)
    ctx = runner.context(requests, chunk_lens, context_lens)
    forced_t = to_device(forced, device)
    readout_t = to_device(readout_depth, device)
    ends = [i for i, (r, n) in enumerate(zip(requests, chunk_lens)) if r.num_computed + n == r.num_tokens]
    live_tokens = to_device([last[i] for i in ends], device, torch.long)
    live_states: list[torch.Tensor] = []  # per depth: states of the completing requests' last tokens
    state = runner.embed(runner.token_tensor(tokens), ctx)
    live_embedded = state[live_tokens]
    exit_state = state.clone()
    for i in range(full_depth):
        if mode == "skip":
            writing = (forced_t > i).nonzero().flatten()
            ctx.write_index = None if len(writing) == len(forced) else writing
        state = adapter.loop(state, i, ctx)
        read_here = readout_t == i + 1
        exit_state[read_here] = state[read_here]
        done = forced_t == i + 1
        if mode == "skip" and i + 1 < full_depth and bool(done.any()):
            fill_skipped_loops(runner, ctx.slot_mapping[done], i + 1)
        live_states.append(state[live_tokens])
    ctx.write_index = None
    if runner.adapter.readout_uses_kv:  # every position's coda KV, from its own exit state
        logits = runner.readout(exit_state, full_depth, ctx)[to_device(last, device)]
    else:
        logits = runner.readout(exit_state[to_device(last, device)], full_depth, ctx)
    depths: list[int | None] = [None] * len(requests)
    if not ends:
        return logits, depths
    live_reqs = [requests[i] for i in ends]
    live_lens = [context_lens[i] for i in ends]
    live_ctx = runner.context(live_reqs, [1] * len(ends), live_lens)
    tracker = ExitTracker(adapter, live_reqs, device)
    live_depth = [full_depth] * len(ends)
    decided = torch.zeros(len(ends), dtype=torch.bool, device=device)
    for i in range(full_depth):
        prev = live_states[i - 1] if i > 0 else live_embedded
        exits = tracker.step(i + 1, live_states[i], prev, live_ctx) & ~decided
        decided |= exits
        for row in exits.nonzero().flatten().tolist():
            live_depth[row] = i + 1
        if bool(decided.all()):
            break
    live_exit_state = torch.stack([live_states[d - 1][j] for j, d in enumerate(live_depth)])
    positions = [n - 1 for n in live_lens]
    logits[to_device(ends, logits.device)] = read_out_by_depth(runner, live_reqs, positions, live_lens, live_exit_state,
                                                               live_depth, live_ctx)  # fmt: skip
    for j, i in enumerate(ends):
        depths[i] = live_depth[j]
        request = requests[i]
        if mode == "skip" and positions[j] >= request.num_prompt_tokens:  # a generated token: skip its loops
            slots = token_slots([request], [positions[j]], runner.kv.block_size, device)
            fill_skipped_loops(runner, slots, live_depth[j])
    return logits, depths
