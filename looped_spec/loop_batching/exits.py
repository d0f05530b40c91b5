"""Early exit on loop passes (docs/architecture.md, "Loop-level batching", "Early exit" and "Speculation under early
exit on loop passes"): which rows exit after a pass's loop, the KV the pass writes and fills for them, the rows a
recomputing prompt chunk forces, a first token's exit, and a speculative round's verification and target logits
when its request exits early.
"""

from __future__ import annotations

import torch

from looped_spec.execution.early_exit import ExitTracker, read_out_by_depth
from looped_spec.loop_batching.items import Item
from looped_spec.request import Request


class PassExits:
    """The exit decisions of a loop pass's items, and what they mean for their KV and readouts."""

    def __init__(self, runner, readout_context) -> None:
        self.runner = runner
        self.adapter = runner.adapter
        self.depth = runner.full_depth
        self.reads_kv = self.adapter.exit_rule_reads_kv
        self.loop_planes = [list(self.adapter.loop_planes(i)) for i in range(self.depth)]
        self.readout_context = readout_context  # Finisher.readout_context

    def decide(self, items, loops, state, prev, rows, ctx) -> tuple[list[list[bool]], list]:
        """Per item and row, whether its position exits after its loop (rule fired, exit_at_step reached; depth D is
        the caller's), and the item's new carry. Rules apply to the items they rule (`Item.ruled`); a rule runs once
        per depth over the rows that have one, or once for all when it does not depend on the depth
        (`exit_rule_uses_depth`); items that carry nothing yet apart."""
        fired = [
            [it.ruled and it.request.exit_at_step is not None and n >= it.request.exit_at_step] * it.num_positions
            for it, n in zip(items, loops)
        ]
        carries = [it.carry for it in items]
        groups: dict[tuple, list[int]] = {}
        for i, (it, n) in enumerate(zip(items, loops)):
            if it.ruled and it.request.exit_threshold is not None and n < self.depth:
                key = (n if self.adapter.exit_rule_uses_depth else 0, carries[i] is None)
                groups.setdefault(key, []).append(i)
        for chosen in groups.values():
            index = torch.cat([torch.arange(rows[i].start, rows[i].stop) for i in chosen]).to(state.device)
            counts = [items[i].num_positions for i in chosen]
            threshold = torch.tensor(
                [items[i].request.exit_threshold for i, count in zip(chosen, counts) for _ in range(count)],
                device=state.device,
            )
            carry = None if carries[chosen[0]] is None else torch.cat([carries[i] for i in chosen])
            # a rule that reads out through attention (Huginn's KL: its coda writes KV) gets the context of its rows
            rule_ctx = self.readout_context([items[i] for i in chosen], ctx, items) if self.reads_kv else ctx
            hits, carry = self.adapter.exit_rule(state[index], loops[chosen[0]], prev[index], carry, threshold,
                                                 rule_ctx)  # fmt: skip
            hits, start = hits.tolist(), 0
            for i, count in zip(chosen, counts):
                fired[i] = [a or b for a, b in zip(fired[i], hits[start : start + count])]
                carries[i] = None if carry is None else carry[start : start + count]
                start += count
        return fired, carries

    def writing(self, items: list[Item]) -> torch.Tensor | None:
        """Skip mode: the rows whose KV the pass writes when an item holds rows past their exit (`Item.kept_rows`: their
        deeper planes keep their exit loop's KV while the other rows go on); None: every row."""
        if self.runner.exit_mode != "skip":
            return None
        kept = [it.kept_rows() for it in items]
        if all(rows is None or all(rows) for rows in kept):
            return None
        keep = [x for it, rows in zip(items, kept) for x in (rows if rows is not None else [True] * it.num_positions)]
        return torch.tensor(keep, device=self.runner.device)

    def verification_rows(self, item: Item, fired: list[bool], loops: int, skip: bool, fills: list) -> None:
        """A verification's rows that exit after its loop `loops` (every row left exits at depth D): their exit depth
        and state; skip mode: their deeper planes are filled before the next loop runs."""
        new = [r for r, hit in enumerate(fired) if not item.row_exits[r] and (hit or loops >= self.depth)]
        if not new:
            return
        item.row_exit_states = item.row_exit_states.clone()
        for r in new:
            item.row_exits[r] = loops
            item.row_exit_states[r] = item.state[r]
            if skip and loops < self.depth:
                fills.append((item.request, item.position + r, loops))

    def recorded(self, item: Item, count: int) -> None:
        """A chunk recomputing a preempted request's tokens redoes their recorded exits (`prefill_with_exit`): a token's
        readout depth is the exit recorded for it (kept from the last prompt token on), and in skip mode a generated
        token's deeper planes keep its exit loop's KV; the others run and keep every loop."""
        request, skip = item.request, self.runner.exit_mode == "skip"
        forced, readout = [], []
        for position in range(item.position, item.position + count):
            recorded = position - (request.num_prompt_tokens - 1)
            depth = request.exit_depths[recorded] if 0 <= recorded < len(request.exit_depths) else self.depth
            forced.append(depth if skip and position >= request.num_prompt_tokens else self.depth)
            readout.append(depth)
        item.forced, item.readout_depths, item.row_exit_states = forced, readout, item.state.clone()

    def recorded_rows(self, item: Item, loops: int, skip: bool, fills: list) -> None:
        """A recomputing chunk after its loop `loops`: the rows read out at this depth keep their state; skip mode: the
        rows whose forced exit this is get their deeper planes filled before the next loop runs."""
        reading = [r for r, depth in enumerate(item.readout_depths) if depth == loops]
        if reading:
            item.row_exit_states = item.row_exit_states.clone()
            item.row_exit_states[reading] = item.state[reading]
        if skip and loops < self.depth:
            fills += [(item.request, item.position + r, loops) for r, f in enumerate(item.forced) if f == loops]

    def first_tokens(self, done: list[tuple[Item, torch.Tensor, list]]) -> tuple[list[int], torch.Tensor]:
        """The first tokens of requests that exit early: the rule runs over their last prompt position's states loop
        after loop (after the chunk's own readout, so a rule that reads out through the coda sees the earlier
        positions' coda KV), and each is read out at its exit depth (early_exit.py `prefill_with_exit`)."""
        runner = self.runner
        requests = [it.request for it, _, _ in done]
        lens = [it.position + it.num_positions for it, _, _ in done]
        live_ctx = runner.context(requests, [1] * len(done), lens)
        tracker = ExitTracker(self.adapter, requests, runner.device)
        depths = [self.depth] * len(done)
        decided = torch.zeros(len(done), dtype=torch.bool, device=runner.device)
        for i in range(self.depth):
            state = torch.cat([last[i + 1] for _, _, last in done])
            prev = torch.cat([last[i] for _, _, last in done])
            exits = tracker.step(i + 1, state, prev, live_ctx) & ~decided
            decided |= exits
            for row in exits.nonzero().flatten().tolist():
                depths[row] = i + 1
            if bool(decided.all()):
                break
        exit_state = torch.cat([last[depth] for (_, _, last), depth in zip(done, depths)])
        positions = [n - 1 for n in lens]
        logits = read_out_by_depth(runner, requests, positions, lens, exit_state, depths, live_ctx)
        if runner.exit_mode == "skip":  # a recomputed generated token skips the loops after its exit, as decoding did
            self.fill([(r, p, depth) for r, p, depth in zip(requests, positions, depths)
                                     if p >= r.num_prompt_tokens])  # fmt: skip
        return depths, logits

    def fill(self, fills: list[tuple[Request, int, int]]) -> None:
        """Skip mode: the loop planes after each (request, position, exit depth)'s exit depth get its exit loop's KV
        (early_exit.py), all positions in one copy."""
        src, dst, slots = [], [], []
        block_size, planes = self.runner.kv.block_size, self.loop_planes
        for request, position, exit_depth in fills:
            if exit_depth >= self.depth:
                continue
            table = request.block_table
            slot = table[position // block_size] * block_size + position % block_size
            for loop_index in range(exit_depth, self.depth):
                src += planes[exit_depth - 1]
                dst += planes[loop_index]
            slots += [slot] * (len(planes[0]) * (self.depth - exit_depth))
        if slots:
            device = self.runner.device
            self.runner.kv.copy_entries(*(torch.tensor(x, dtype=torch.long, device=device) for x in (src, dst, slots)))
