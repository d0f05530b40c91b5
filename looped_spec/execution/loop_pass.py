"""Loop-level batching: one pass of the shared block serves every request at whatever loop it is on.

A decoding request has one token in flight, an *item*: its position, its state after the loops it has run, and
what its exit rule carries. A pass embeds the tokens that enter (each request's next token), runs one loop of
every item together — each at its own loop index, reading and writing its own KV plane — and reads out the items
that are done (depth D, or their exit depth), whose tokens are sampled. A request whose token left enters its next
token on the next pass, so a pass serves about as many items as there are running requests even while their tokens
exit at different depths (docs/architecture.md, "Loop-level batching").

`LoopBatcher.run` computes a pass without changing any item (a failed pass leaves them as they were; its KV writes
are redone alike by the retry); `commit` applies it once the engine has committed the sampled tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from looped_spec.execution.early_exit import read_out_by_depth
from looped_spec.execution.sampler import SamplingRows, sample
from looped_spec.request import Request, RequestStatus


@dataclass(slots=True)
class Item:
    """One request's token in flight."""

    request: Request
    position: int  # the token's position (its request's num_computed when it entered)
    preemptions: int  # its request's preemption count when it entered: a preempted request's item is stale
    state: torch.Tensor  # [1, S] after `loops` loops
    loops: int = 0
    prev: torch.Tensor | None = None  # [1, S] before the last loop (exit rules comparing successive states)
    carry: torch.Tensor | None = None  # [1, ...] what the exit rule carries from loop to loop
    exit_depth: int = 0  # select mode: the readout depth once decided (the item runs on to D)
    exit_state: torch.Tensor | None = None

    def fresh(self) -> bool:
        r = self.request
        return (
            r.status is RequestStatus.RUNNING
            and r.num_computed == self.position
            and r.metrics.num_preemptions == self.preemptions
        )


@dataclass
class PassResult:
    """A computed pass: per request (in the order given), the tokens to commit (empty while its token loops) and,
    for requests that exit early, the readout depth of each; the items that go on."""

    requests: list[Request]
    tokens: list[list[int]]
    exit_depths: list[list[int]] | None
    items: dict[str, Item]
    positions: int  # positions the pass's loop ran over (its occupancy)
    entered: int  # tokens embedded by the pass
    loops: int  # loops the pass ran back to back (1 unless the engine let it run on while nothing changes)
    done: list[int] = field(default_factory=list)  # readout depth of each token the pass finished


class LoopBatcher:
    """The items in flight and the pass over them (see the module docstring)."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.adapter = runner.adapter
        self.depth = runner.full_depth
        self.items: dict[str, Item] = {}
        # the last pass's context, reused while the same tokens loop (at full depth: D passes in a row)
        self._ctx_key: tuple = ()
        self._ctx = None
        self._loop_plane_lists = [list(self.adapter.loop_planes(i)) for i in range(self.depth)]
        self._planes_per_loop = len(self._loop_plane_lists[0])

    @torch.inference_mode()
    def run(self, requests: list[Request], max_loops: int = 1) -> PassResult:
        """One pass over the requests' tokens in flight (entering their next tokens first). With `max_loops` > 1 the
        pass runs up to that many loops back to back while no token can leave: the same items would make up each
        of those passes, so running them together changes nothing but the per-pass overhead (the engine allows it
        while no other work waits to join)."""
        runner, depth = self.runner, self.depth
        items = [self._item(r) for r in requests]
        positions = [r.num_computed if it is None else it.position for r, it in zip(requests, items)]
        ctx = self._pass_context(requests, positions)
        entering = [i for i, item in enumerate(items) if item is None]
        if entering:
            self._embed(requests, items, entering, positions, ctx)
        new_state = torch.cat([it.state for it in items])
        loops = [it.loops for it in items]
        num_loops = min(max_loops, self._loops_before_a_change(items))
        for _ in range(num_loops):
            state, new_state = new_state, self._loop(new_state, loops, ctx, items)
            loops = [n + 1 for n in loops]
        exits, carries = self._exits(items, loops, new_state, state, ctx)
        skip = runner.exit_mode == "skip"
        done_rows, done_depths, next_items = [], [], {}
        for row, (it, n, leaves) in enumerate(zip(items, loops, exits)):
            exit_depth, exit_state = it.exit_depth, it.exit_state
            if leaves and not exit_depth:
                exit_depth, exit_state = n, new_state[row : row + 1]
            if n >= depth or (skip and exit_depth):
                done_rows.append(row)
                done_depths.append(exit_depth or depth)
                continue
            next_items[it.request.request_id] = Item(
                it.request, it.position, it.preemptions, new_state[row : row + 1], n, state[row : row + 1],
                carries[row], exit_depth, exit_state,
            )  # fmt: skip
        tokens: list[list[int]] = [[] for _ in requests]
        exit_depths = [[] for _ in requests] if any(r.exits_early for r in requests) else None
        if done_rows:
            done = [requests[i] for i in done_rows]
            positions = [items[i].position for i in done_rows]
            exit_states = torch.cat(
                [items[i].exit_state if items[i].exit_depth else new_state[i : i + 1] for i in done_rows]
            )
            if skip:
                self._fill_skipped_loops(done, positions, done_depths)
            lens = [p + 1 for p in positions]
            done_ctx = ctx  # a readout that attends (Huginn's coda) writes KV: then only the done tokens' context
            if self.adapter.readout_uses_kv and len(done) < len(requests):
                done_ctx = runner.context(done, [1] * len(done), lens)
            logits = read_out_by_depth(runner, done, positions, lens, exit_states, done_depths, done_ctx)
            drawn = sample(logits, SamplingRows.build(done, runner.device)).tolist()
            for i, token, d in zip(done_rows, drawn, done_depths):
                tokens[i] = [token]
                if exit_depths is not None:
                    exit_depths[i] = [d]
        return PassResult(
            requests, tokens, exit_depths, next_items, len(requests), len(entering), num_loops, done_depths
        )

    def commit(self, result: PassResult) -> None:
        """Apply a pass whose tokens the engine has committed: its requests' items become the ones that go on."""
        for request in result.requests:
            self.items.pop(request.request_id, None)
        self.items.update(result.items)
        for request_id in [i for i, item in self.items.items() if not item.fresh()]:
            del self.items[request_id]  # finished, aborted or preempted meanwhile

    # ----- the parts of a pass -----
    def _pass_context(self, requests: list[Request], positions: list[int]):
        """The context of one token per request at `positions`; only the planes change between passes."""
        key = tuple((id(r), r.metrics.num_preemptions, p) for r, p in zip(requests, positions))
        if key != self._ctx_key or self._ctx is None:
            self._ctx = self.runner.context(requests, [1] * len(requests), [p + 1 for p in positions])
            self._ctx_key = key
        return self._ctx

    def _fill_skipped_loops(self, requests: list[Request], positions: list[int], depths: list[int]) -> None:
        """Skip mode: the loop planes after each token's exit depth get its exit loop's KV (early_exit.py), all
        tokens in one copy."""
        src, dst, slots = [], [], []
        block_size, planes = self.runner.kv.block_size, self._loop_plane_lists
        for request, position, exit_depth in zip(requests, positions, depths):
            if exit_depth >= self.depth:
                continue
            slot = request.block_table[position // block_size] * block_size + position % block_size
            for loop_index in range(exit_depth, self.depth):
                src += planes[exit_depth - 1]
                dst += planes[loop_index]
            slots += [slot] * (len(planes[0]) * (self.depth - exit_depth))
        if slots:
            device = self.runner.device
            as_tensor = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)  # noqa: E731
            self.runner.kv.copy_entries(as_tensor(src), as_tensor(dst), as_tensor(slots))

    def _loops_before_a_change(self, items: list[Item]) -> int:
        """Loops every item runs before one may leave: its exit rule may fire after any loop, a fixed exit or depth D
        ends it after a known number."""
        out = self.depth
        for it in items:
            request = it.request
            if request.exit_threshold is not None:
                return 1
            out = min(out, (request.exit_at_step or self.depth) - it.loops)
        return max(out, 1)

    def in_flight(self, request: Request) -> bool:
        """Whether the request has a token in flight (it then holds the KV slot of its position)."""
        return self._item(request) is not None

    def _item(self, request: Request) -> Item | None:
        item = self.items.get(request.request_id)
        return item if item is not None and item.fresh() else None

    def _embed(self, requests: list[Request], items: list[Item | None], rows: list[int], positions, ctx) -> None:
        """New items for the entering requests' next tokens, at loop 0 (their embedding, Huginn's prelude, runs
        here: in a context of their own unless every token of the pass enters or the embedding reads none)."""
        runner = self.runner
        entering = [requests[i] for i in rows]
        at = [positions[i] for i in rows]
        if self.adapter.embed_uses_context and len(rows) < len(requests):
            ctx = runner.context(entering, [1] * len(rows), [p + 1 for p in at])
        state = runner.embed(runner.token_tensor([r.token_ids[p] for r, p in zip(entering, at)]), ctx)
        ruled = any(r.exit_threshold is not None for r in entering)
        carry = self.adapter.exit_carry(len(rows)) if ruled else None
        for j, (row, request) in enumerate(zip(rows, entering)):
            items[row] = Item(
                request, at[j], request.metrics.num_preemptions, state[j : j + 1],
                carry=None if carry is None else carry[j : j + 1],
            )  # fmt: skip

    def _loop(self, state: torch.Tensor, loops: list[int], ctx, items: list[Item]) -> torch.Tensor:
        """One loop of every row, row i at loop `loops[i]` (0-based): one call when the family's loops are loop 0 on
        moved planes (`uniform_loops`), else one call per distinct loop index."""
        adapter = self.adapter
        if len(set(loops)) == 1:  # every row at one loop (lockstep, full depth): the step engine's call
            return adapter.loop(state, loops[0], ctx)
        if adapter.uniform_loops:
            per_request = torch.tensor(loops, dtype=torch.long, device=state.device) * self._planes_per_loop
            ctx.request_planes = ctx.token_planes = per_request  # one token per request
            ctx.kernel, ctx.contiguous_from = None, None  # the paged kernel and in-place reads take one plane
            try:
                return adapter.loop(state, 0, ctx)
            finally:  # the readouts after the pass (Huginn's coda attends) use their own planes
                ctx.request_planes = ctx.token_planes = None
        out = torch.empty_like(state)
        for loop_index in sorted(set(loops)):
            rows = [i for i, n in enumerate(loops) if n == loop_index]
            sub = self._sub_context(items, rows)
            out[rows] = adapter.loop(state[rows], loop_index, sub)
        return out

    def _exits(self, items: list[Item], loops: list[int], state, prev, ctx) -> tuple[list[bool], list]:
        """Per row: whether its token exits after its loop (rule fired, exit_at_step reached; depth D is handled by
        the caller), and its new carry. The rule runs once per distinct depth over the rows that have one."""
        fired_rows: list[bool]
        exits = [
            bool(it.request.exit_at_step is not None and n >= it.request.exit_at_step) for it, n in zip(items, loops)
        ]
        carries = [it.carry for it in items]
        ruled = [
            i for i, (it, n) in enumerate(zip(items, loops)) if it.request.exit_threshold is not None and n < self.depth
        ]
        # one call per depth, or for every ruled row when the rule ignores the depth (it then gets the first row's);
        # rows that carry nothing yet apart from those that do
        by_depth = self.adapter.exit_rule_uses_depth
        groups: dict[tuple, list[int]] = {}
        for i in ruled:
            groups.setdefault((loops[i] if by_depth else 0, carries[i] is None), []).append(i)
        for rows in groups.values():
            d = loops[rows[0]]
            threshold = torch.tensor([items[i].request.exit_threshold for i in rows], device=state.device)
            carry = None if carries[rows[0]] is None else torch.cat([carries[i] for i in rows])
            # the pass's context: a rule that reads through it (exit_rule_reads_kv) is refused with loop batching
            fired, carry = self.adapter.exit_rule(state[rows], d, prev[rows], carry, threshold, ctx)
            fired_rows = fired.tolist()
            for j, i in enumerate(rows):
                exits[i] = exits[i] or fired_rows[j]
                carries[i] = None if carry is None else carry[j : j + 1]
        return exits, carries

    def _sub_context(self, items: list[Item], rows: list[int]):
        """The context of some rows' tokens alone (a call that serves only them)."""
        chosen = [items[i] for i in rows]
        return self.runner.context([it.request for it in chosen], [1] * len(rows), [it.position + 1 for it in chosen])
