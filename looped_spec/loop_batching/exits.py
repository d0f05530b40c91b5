"""Early exit on loop passes (docs/architecture.md, "Loop-level batching", "Early exit" and "Speculation under early
exit on loop passes"): which rows exit after a pass's loop, the KV the pass writes and fills for them, the rows a
recomputing prompt chunk forces, a first token's exit, and a speculative round's verification and target logits
when its request exits early.
"""

from __future__ import annotations

import torch

from looped_spec.execution.early_exit import ExitTracker, read_out_by_depth
from looped_spec.execution.transfers import to_device
from looped_spec.loop_batching.contexts import readout_context
from looped_spec.loop_batching.items import DraftRound, Item
from looped_spec.request import Request


class PassExits:
    """The exit decisions of a loop pass's items, and what they mean for their KV and readouts."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.adapter = runner.adapter
        self.depth = runner.full_depth
        self.reads_kv = self.adapter.exit_rule_reads_kv
        self.loop_planes = [list(self.adapter.loop_planes(i)) for i in range(self.depth)]

    def decide(self, items, loops, state, prev, rows, ctx) -> tuple[list[list[bool]], list, list]:
        """Per item and row, whether its position exits after its loop (rule fired, exit_at_step reached; depth D is
        the caller's), the item's new carry, and its rows' logits when its rule read them out (else None). Rules apply
        to the items they rule (`Item.ruled`); a rule runs once per depth over the rows that have one, or once for all
        when it does not depend on the depth (`exit_rule_uses_depth`); items that carry nothing yet apart."""
        fired = [
            [it.ruled and it.request.exit_at_step is not None and n >= it.request.exit_at_step] * it.num_positions
            for it, n in zip(items, loops)
        ]
        carries = [it.carry for it in items]
        read_out: list[torch.Tensor | None] = [None] * len(items)
        groups: dict[tuple, list[int]] = {}
        for i, (it, n) in enumerate(zip(items, loops)):
            if it.ruled and it.request.exit_threshold is not None and n < self.depth:
                key = (n if self.adapter.exit_rule_uses_depth else 0, carries[i] is None)
                groups.setdefault(key, []).append(i)
        for chosen in groups.values():
            index = to_device(torch.cat([torch.arange(rows[i].start, rows[i].stop) for i in chosen]), state.device)
            counts = [items[i].num_positions for i in chosen]
            threshold = to_device(
                [items[i].request.exit_threshold for i, count in zip(chosen, counts) for _ in range(count)],
                state.device,
            )
            carry = None if carries[chosen[0]] is None else torch.cat([carries[i] for i in chosen])
            # a rule that reads out through attention (Huginn's KL: its coda writes KV) gets the context of its rows
            rule_ctx = readout_context(self.runner, [items[i] for i in chosen], ctx, items) if self.reads_kv else ctx
            hits, carry, logits = self.runner.exit_rule(state[index], loops[chosen[0]], prev[index], carry, threshold,
                                                        rule_ctx)  # fmt: skip
            hits, start = hits.tolist(), 0
            for i, count in zip(chosen, counts):
                fired[i] = [a or b for a, b in zip(fired[i], hits[start : start + count])]
                carries[i] = None if carry is None else carry[start : start + count]
                read_out[i] = None if logits is None else logits[start : start + count]
                start += count
        return fired, carries, read_out

    def writing(self, items: list[Item]) -> torch.Tensor | None:
        """Skip mode: the rows whose KV the pass writes when an item holds rows past their exit (`Item.kept_rows`: their
        deeper planes keep their exit loop's KV while the other rows go on); None: every row."""
        if self.runner.exit_mode != "skip":
            return None
        kept = [it.kept_rows() for it in items]
        if all(rows is None or all(rows) for rows in kept):
            return None
        keep = [x for it, rows in zip(items, kept) for x in (rows if rows is not None else [True] * it.num_positions)]
        return to_device(keep, self.runner.device)

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
            self.runner.kv.copy_entries(*(to_device(x, device, torch.long) for x in (src, dst, slots)))

    def verification(self, it: Item, r: DraftRound) -> Item:
        """The verification of a round whose request exits early: its rows carry their exit so far; skip mode starts at
        the first position the draft did not decide (the decided ones are final, their deeper planes filled), and
        when there is none nothing is left to run."""
        decided = r.decided(self.adapter.readout_uses_kv)
        first = 0
        if self.runner.exit_mode == "skip":
            first = decided.index(False) if False in decided else len(decided)
        if first == len(decided):  # every position decided: a verification of no rows, with no loops left
            state = it.state[:0]
            return Item(it.request, r.start, it.preemptions, r.start + len(decided), state, self.depth, self.depth,
                        round=r, verify=True, row_exits=[], row_exit_states=state)  # fmt: skip
        states = torch.cat(r.states[first:])
        exit_states = torch.cat([s if s is not None else states[j : j + 1]
                                 for j, s in enumerate(r.exit_states[first:])])  # fmt: skip
        carry = None
        carries = r.carries[first:]
        like = next((c for c in carries if c is not None), None)
        if like is not None:
            carry = torch.cat([c if c is not None else torch.zeros_like(like) for c in carries])
        return Item(it.request, r.start, it.preemptions, r.start + first, states, self.depth, r.d, carry=carry,
                    round=r, verify=True, row_exits=list(r.exits[first:]), row_exit_states=exit_states)  # fmt: skip

    def target_logits(self, done: list[Item]) -> list[torch.Tensor]:
        """Per verification of a round whose request exits early, [K+1, V]: a position the draft decided keeps the
        draft's readout; the others are read out at their exit (a readout that attends, Huginn's coda, once over
        each round's span of them at D, so its KV is written causally; in select mode over every verified row, whose
        readout KV the exit rule's readouts may have overwritten)."""
        runner = self.runner
        uses_kv = self.adapter.readout_uses_kv
        spans = []  # per exit round: (item, its first row's round position, first position read out, decided ones)
        for it in done:
            r = it.round
            decided = r.decided(uses_kv)
            first = decided.index(False) if False in decided else len(decided)
            lo = it.position - r.start
            spans.append((it, lo, lo if uses_kv and runner.exit_mode == "select" else first, decided))
        states, reqs, positions, depths, counts = [], [], [], [], []
        for it, lo, start, _ in spans:
            for j in range(start, it.round.k + 1):
                states.append(it.row_exit_states[j - lo : j - lo + 1])
                reqs.append(it.request)
                positions.append(it.round.start + j)
                depths.append(it.row_exits[j - lo])
            counts.append(it.round.k + 1 - start)
        verified = None
        if states:
            state = torch.cat(states)
            if uses_kv:
                span_reqs = [it.request for (it, *_), n in zip(spans, counts) if n]
                lens = [it.round.start + it.round.k + 1 for (it, *_), n in zip(spans, counts) if n]
                span_ctx = runner.context(span_reqs, [n for n in counts if n], lens)
                verified = runner.readout(state, self.depth, span_ctx)
            else:
                verified = read_out_by_depth(runner, reqs, positions, [p + 1 for p in positions], state, depths, None)
        out, verified_at = [], 0
        for it, _, start, decided in spans:
            width = it.round.k + 1
            rows = [it.round.logits[j][None] if decided[j] else verified[verified_at + j - start][None]
                    for j in range(width)]  # fmt: skip
            out.append(torch.cat(rows))
            verified_at += width - start
        return out
