"""LoopBatcher: the items in flight and the pass over them (docs/architecture.md, "Loop-level batching").

A pass embeds the tokens that enter (a prompt chunk, a request's next token, or its next drafted token), runs one
loop of every item together — each at its own loop index, reading and writing its own KV plane — and finishes the
items that reached their stop depth (finish.py). The items of a measured round are also read out at every depth they
pass that the runner reads out (`_read_out_passing`).

`run` computes a pass without changing any item (a failed pass leaves them as they were; its KV writes are redone
alike by the retry); `commit` applies it once the engine has committed the finished tokens.
"""

from __future__ import annotations

import torch

from looped_spec.execution.timing import Stopwatch
from looped_spec.execution.transfers import to_device
from looped_spec.loop_batching.contexts import items_context
from looped_spec.loop_batching.finish import Finished, Finisher, readout_rows
from looped_spec.loop_batching.graphs import CapturedStages, LoopPassGraphs
from looped_spec.loop_batching.items import DraftRound, Entering, Item, NextDraft, PassResult, PlainToken
from looped_spec.request import Request
from looped_spec.speculative.readouts import greedy_ids, not_read

#: A request that enters without an entry in `rounds`: a plain token, not measured
NOT_MEASURED = Entering(0, 0, False)


class LoopBatcher:
    """Runs loop passes; every request entering a new round comes with its (K, d) and whether it is measured."""

    def __init__(self, runner, graphs: LoopPassGraphs | None = None) -> None:
        if graphs is not None and (graphs.readouts is not None or graphs.rules is not None):  # stages that attend
            runner = CapturedStages(runner, graphs)
        self.runner = runner
        self.graphs = graphs  # captured loop passes (graphs.py); None: every pass runs eagerly
        self.adapter = runner.adapter
        self.depth = runner.full_depth
        self.items: dict[str, Item] = {}
        self.next_drafts: dict[str, NextDraft] = {}
        self._passes = 0  # passes committed
        self._last_ran: dict[str, int] = {}  # request id -> the last committed pass that ran its work
        # the last pass's context, reused while the same positions loop (at full depth: D passes in a row)
        self._ctx_key: tuple = ()
        self._ctx = None
        self.finisher = Finisher(runner)
        self.exits = self.finisher.exits
        self.watch = Stopwatch(runner.device)

    def in_flight(self, request: Request) -> bool:
        """Whether the request has work in flight (it then holds the KV slots of its positions)."""
        item, draft = self.items.get(request.request_id), self.next_drafts.get(request.request_id)
        return (item is not None and item.fresh()) or (draft is not None and draft.fresh())

    @property
    def is_empty(self) -> bool:
        """No work in flight and nothing remembered for any request (what a finished request leaves: nothing)."""
        return not self.items and not self.next_drafts and not self._last_ran

    def drop(self, request_id: str) -> None:
        """Forget a request's work in flight (it was aborted or failed; its KV blocks are freed)."""
        self.items.pop(request_id, None)
        self.next_drafts.pop(request_id, None)
        self._last_ran.pop(request_id, None)

    def select(self, requests: list[Request], chunks: dict[str, int], budget: int) -> list[Request]:
        """The requests whose work the next pass runs under a budget of `budget` positions: deepest work first (the
        loops it has run), then the request that ran longest ago, then the batch's order; taken in that order until
        the next one does not fit (at least one always runs). Taking none past the first that does not fit keeps a
        large item (a prompt chunk, a verification) from waiting behind smaller ones for ever: work only gets
        deeper, so the deeper work finishes and the waiting item becomes the first in line."""
        ranked = []
        for order, request in enumerate(requests):
            item = self.items.get(request.request_id)
            loops, positions = (item.loops, item.num_positions) if item is not None and item.fresh() else (0, 1)
            positions = chunks.get(request.request_id, positions)
            ranked.append((-loops, self._last_ran.get(request.request_id, -1), order, positions))
        taken, used = set(), 0
        for _, _, order, positions in sorted(ranked):
            if taken and used + positions > budget:
                break
            taken.add(order)
            used += positions
        return [r for order, r in enumerate(requests) if order in taken]

    @torch.inference_mode()
    def run(
        self, requests: list[Request], rounds: dict[str, Entering] | None = None, max_loops: int = 1,
        chunks: dict[str, int] | None = None,
    ) -> PassResult:  # fmt: skip
        """One pass over the requests' work in flight. A request with none enters its prompt chunk of
        `chunks[request_id]` tokens when it has one, else its next token: a speculative round as
        `rounds[request_id]` says when its K is > 0, else a plain token (measured or not as it says; a request
        without an entry: a plain token, not measured). With `max_loops` > 1 the pass
        runs up to that many loops back to back while no item can stop: the same items would make up each of those
        passes, so only the per-pass overhead changes (the engine allows it while no other work waits to join)."""
        watch = self.watch
        t0 = watch.mark()
        items = self._enter(requests, rounds or {}, chunks or {})
        entered = sum(it.num_positions for it in items if it.loops == 0)  # tokens embedded (a prompt chunk: all of it)
        t1 = watch.mark()
        ctx = self._pass_context(items)
        state = torch.cat([it.state for it in items])
        loops = [it.loops for it in items]
        num_loops = min(max_loops, self._loops_before_a_stop(items))
        rows = self._rows(items)
        preds = [list(it.preds) if it.measured else None for it in items]  # copies: the items stay as they were
        measuring = any(p is not None for p in preds)
        lasts = [None if it.last_states is None else list(it.last_states) for it in items]
        prev = state
        write = self.exits.writing(items)
        replays = self.graphs.num_replays if self.graphs is not None else 0
        counts = [it.num_positions for it in items]
        shape = self.graphs.pass_shape(counts) if self.graphs is not None else None
        if shape is not None:  # the pass's inputs, once for all its loops (only the planes move)
            self.graphs.load(shape, ctx, counts)
        ragged = shape is not None or (self.adapter.uniform_loops and len(set(loops)) > 1)
        first = self._first_planes(loops, counts, state.device) if ragged else None
        per_loop = len(self.exits.loop_planes[0])
        # the rows that write KV, read once for all the pass's loops (a read of the device)
        one_call = shape is None and (len(set(loops)) == 1 or self.adapter.uniform_loops)
        write_rows = write.nonzero().flatten() if write is not None and one_call else None
        for j in range(num_loops):
            # each later loop's planes move on the device: no host-device copy between loops
            planes = first if j == 0 or first is None else (first[0] + j * per_loop, first[1] + j * per_loop)
            prev, state = state, self._loop(state, loops, ctx, items, (write, write_rows), shape, planes)
            loops = [n + 1 for n in loops]
            if measuring:
                self._read_out_passing(items, loops, state, rows, ctx, preds)
            for i, last in enumerate(lasts):
                if last is not None:
                    last.append(state[rows[i].stop - 1 : rows[i].stop])
        t2 = watch.mark()
        out = Finished(requests)
        fired, carries, read_out = self.exits.decide(items, loops, state, prev, rows, ctx)
        skip = self.runner.exit_mode == "skip"
        plain: list[PlainToken] = []
        drafts, verifies, prompts = [], [], []
        fills: list[tuple[Request, int, int]] = []  # skip mode: (request, position, exit depth) whose planes to fill
        for i, (it, n) in enumerate(zip(items, loops)):
            rs = rows[i]
            if it.chunk and it.forced is not None:  # a recompute with recorded exits: rows exit at known depths
                it = self._moved(it, state[rs], n, prev[rs], carries[i], preds[i])
                self.exits.recorded_rows(it, n, skip, fills)
            if it.chunk and n >= self.depth:  # read out from each row's readout state (a recompute: its recorded depth)
                prompts.append((it, state[rs] if it.forced is None else it.row_exit_states, lasts[i]))
                continue
            if it.row_exits is not None:  # a verification under early exit: its rows exit one by one
                new = self._moved(it, state[rs], n, prev[rs], carries[i], preds[i])
                self.exits.verification_rows(new, fired[i], n, skip, fills)
                if n >= self.depth or (skip and all(new.row_exits)):
                    verifies.append(new)
                else:
                    out.items[it.request.request_id] = new
                continue
            exit_depth, exit_state = 0, None
            if it.ruled:
                exit_depth, exit_state = it.exit_depth, it.exit_state
                if fired[i][0] and not exit_depth:
                    exit_depth, exit_state = n, None  # None: this pass's row
                stops = n >= (self.depth if it.plain else it.stop) or (skip and exit_depth)
                if it.plain and stops:
                    # skip mode, exited here where its rule read it out: those are its logits (its readout KV written)
                    logits = read_out[i] if skip and exit_state is None else None
                    plain.append(PlainToken(it, rs.start, exit_depth, exit_state, preds[i], logits))
                    continue
                if exit_depth and exit_state is None:
                    exit_state = state[rs]
                if stops:  # a draft, at d or at its exit
                    if skip and exit_depth and exit_depth < self.depth:
                        fills.append((it.request, it.position, exit_depth))
                    moved = self._moved(it, state[rs], n, prev[rs], carries[i], preds[i])
                    moved.exit_depth, moved.exit_state = exit_depth, exit_state
                    drafts.append(moved)
                    continue
            elif n >= it.stop:
                moved = self._moved(it, state[rs], n, prev[rs], carries[i], preds[i])
                (verifies if it.verify else drafts).append(moved)
                continue
            new = self._moved(it, state[rs], n, prev[rs], carries[i], preds[i])
            new.exit_depth, new.exit_state, new.last_states = exit_depth, exit_state, lasts[i]
            out.items[it.request.request_id] = new
        if fills:
            self.exits.fill(fills)
        if prompts:
            self.finisher.chunks(prompts, ctx, items, out)
        if plain:
            self.finisher.plain(plain, state, ctx, items, out)
        if drafts:
            verifies += self.finisher.drafts(drafts, ctx, items, out)
        if verifies:
            self.finisher.verifies(verifies, ctx, items, out)
        t3 = watch.mark()  # read after the finished tokens reached the host (timing.py)
        stages = {"embed": watch.seconds(t0, t1), "loops": watch.seconds(t1, t2), "finish": watch.seconds(t2, t3)}
        captured = self.graphs.num_replays - replays if self.graphs is not None else 0
        return out.result(sum(it.num_positions for it in items), entered, num_loops, captured, stages)

    @staticmethod
    def _moved(it: Item, state: torch.Tensor, loops: int, prev: torch.Tensor, carry, preds) -> Item:
        """The item after this pass's loops (a new object: the pass leaves its inputs as they were)."""
        return Item(it.request, it.base, it.preemptions, it.position, state, it.stop, loops, prev, carry,
                    it.exit_depth, it.exit_state, it.round, it.verify, it.measured, it.chunk, preds or [],
                    None if it.row_exits is None else list(it.row_exits), it.row_exit_states, it.last_states,
                    it.forced, it.readout_depths)  # fmt: skip

    def commit(self, result: PassResult) -> None:
        """Apply a pass whose tokens the engine has committed: its requests' work becomes the work that goes on."""
        self._passes += 1
        for request in result.requests:
            self.items.pop(request.request_id, None)
            self.next_drafts.pop(request.request_id, None)
            if request.finished:  # its turn order is not needed again (a long-running server would keep them all)
                self._last_ran.pop(request.request_id, None)
            else:
                self._last_ran[request.request_id] = self._passes
        self.items.update(result.items)
        self.next_drafts.update(result.next_drafts)
        for pending in (self.items, self.next_drafts):
            for request_id in [i for i, work in pending.items() if not work.fresh()]:
                del pending[request_id]  # finished, aborted or preempted meanwhile

    # ----- entering -----
    def _enter(self, requests: list[Request], rounds: dict[str, Entering], chunks: dict[str, int]) -> list[Item]:
        """Every request's item; requests without one enter their prompt chunk or next token, embedded here (in a
        context of its own unless every token of the pass enters or the family's embedding reads none)."""
        items: list[Item | None] = []
        # row, request, position, tokens, round, whether a plain token is measured, whether a prompt chunk
        entering: list[tuple[int, Request, int, list[int], DraftRound | None, bool, bool]] = []
        for row, request in enumerate(requests):
            item = self.items.get(request.request_id)
            if item is not None and item.fresh():
                items.append(item)
                continue
            items.append(None)
            draft = self.next_drafts.get(request.request_id)
            if draft is not None and draft.fresh():
                position = draft.round.start + len(draft.round.tokens)
                entering.append((row, request, position, [draft.token], draft.round, False, False))
                continue
            position = request.num_computed
            chunk = chunks.get(request.request_id, 0)
            if chunk:
                entering.append((row, request, position, request.token_ids[position : position + chunk], None, False,
                                 True))  # fmt: skip
                continue
            k, d, measured, stop_margin = rounds.get(request.request_id, NOT_MEASURED)
            round_ = None
            if k > 0:  # per-token stopping as in a step round (not in measured rounds)
                stop = None if measured else stop_margin
                round_ = DraftRound(
                    position, k, d, measured=measured, exits_early=request.exits_early, stop_margin=stop
                )
            entering.append((row, request, position, [request.token_ids[position]], round_, measured and k == 0, False))
        if entering:
            runner = self.runner
            reqs = [e[1] for e in entering]
            positions = [e[2] for e in entering]
            counts = [len(e[3]) for e in entering]
            ctx = None
            if self.adapter.embed_uses_context or len(entering) == len(requests):
                ctx = runner.context(reqs, counts, [p + n for p, n in zip(positions, counts)])
                if len(entering) == len(requests):  # the pass's context too (same positions)
                    self._ctx_key, self._ctx = self._key(reqs, positions, counts), ctx
            state = runner.embed(runner.token_tensor([t for e in entering for t in e[3]]), ctx)
            ruled = any(r.exit_threshold is not None for r in reqs)
            carry = self.adapter.exit_carry(len(reqs)) if ruled else None
            start = 0
            for j, (row, request, position, tokens, round_, measured, chunk) in enumerate(entering):
                base = position if round_ is None else round_.start
                stop = self.depth if round_ is None else round_.d
                measured = measured if round_ is None else round_.measured
                rows = state[start : start + len(tokens)]
                start += len(tokens)
                # the prompt's last chunk of a request that exits early: its first token's exit rule needs the last
                # position's state at every depth (run once the chunk is done, as a prefill step runs it)
                last = [rows[-1:]] if chunk and request.exits_early and position + len(tokens) == request.num_tokens \
                    else None  # fmt: skip
                item = Item(request, base, request.metrics.num_preemptions, position, rows, stop,
                            carry=None if carry is None or chunk else carry[j : j + 1], round=round_,
                            measured=measured, chunk=chunk, last_states=last)  # fmt: skip
                if chunk and request.exit_depths:
                    self.exits.recorded(item, len(tokens))
                items[row] = item
        return items  # type: ignore[return-value]

    # ----- the pass -----
    @staticmethod
    def _key(requests: list[Request], positions: list[int], counts: list[int]) -> tuple:
        # a request by its admission number (unique in the engine; an object id can be reused once a finished
        # request is freed), and its preemption count: a recomputed request holds other blocks
        return tuple((r.arrival, r.metrics.num_preemptions, p, n) for r, p, n in zip(requests, positions, counts))

    def _pass_context(self, items: list[Item]):
        """The context of the items' positions; only the planes change from pass to pass."""
        requests = [it.request for it in items]
        positions, counts = [it.position for it in items], [it.num_positions for it in items]
        key = self._key(requests, positions, counts)
        if key != self._ctx_key or self._ctx is None:
            self._ctx = items_context(self.runner, items)
            self._ctx_key = key
        return self._ctx

    @staticmethod
    def _rows(items: list[Item]) -> list[slice]:
        rows, start = [], 0
        for it in items:
            rows.append(slice(start, start + it.num_positions))
            start += it.num_positions
        return rows

    def _loops_before_a_stop(self, items: list[Item]) -> int:
        """Loops every item runs before one may stop: an exit rule may fire after any loop, a fixed exit, the draft
        depth or depth D stop an item after a known number."""
        out = self.depth
        for it in items:
            request = it.request
            stop = it.stop
            if it.ruled:
                if request.exit_threshold is not None:
                    return 1
                if request.exit_at_step is not None and request.exit_at_step > it.loops:  # else reached already
                    stop = min(stop, request.exit_at_step)
            if it.forced is not None:  # a recomputing chunk: every forced exit and readout depth is a stop
                stop = min([stop] + [x for x in (*it.forced, *it.readout_depths) if x > it.loops])
            out = min(out, stop - it.loops)
        return max(out, 1)

    def _first_planes(self, loops: list[int], counts: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
        """The planes added per item and per row at the pass's first loop (its loop's), in one copy to the device."""
        per_loop = len(self.exits.loop_planes[0])
        per_item = [n * per_loop for n in loops]
        per_row = [p for p, n in zip(per_item, counts) for _ in range(n)]
        both = to_device(per_item + per_row, device, torch.long)
        return both[: len(loops)], both[len(loops) :]

    def _loop(self, state: torch.Tensor, loops: list[int], ctx, items: list[Item], writes, shape, planes
              ) -> torch.Tensor:  # fmt: skip
        """One loop of every item, item i at loop `loops[i]` (0-based): a captured pass when the pass fits one
        (`shape`; graphs.py, loaded by `run`), else one call when the family's loops are loop 0 on moved planes
        (`uniform_loops`), else one call per distinct loop index. `writes`: ([rows] bool, the indices of its True
        rows), the rows whose KV is written (None: all). `planes`: the planes added per item and per row (this
        loop's; None where no item's differs)."""
        adapter = self.adapter
        write, write_rows = writes
        if shape is not None:
            return self.graphs.run(shape, state, *planes, write)
        if len(set(loops)) == 1 or adapter.uniform_loops:
            ctx.write_index = write_rows
            try:
                if len(set(loops)) == 1:  # every item at one loop (lockstep): the step engine's call
                    return adapter.loop(state, loops[0], ctx)
                ctx.request_planes, ctx.token_planes = planes
                ctx.contiguous_from = None  # an in-place read takes one plane (the paged kernel takes each request's)
                return adapter.loop(state, 0, ctx)
            finally:  # the readouts after the pass (Huginn's coda attends) use their own planes
                ctx.request_planes = ctx.token_planes = ctx.write_index = None
        out = torch.empty_like(state)
        rows = self._rows(items)
        for loop_index in sorted(set(loops)):
            chosen = [i for i, n in enumerate(loops) if n == loop_index]
            index = to_device(torch.cat([torch.arange(rows[i].start, rows[i].stop) for i in chosen]), state.device)
            sub_ctx = items_context(self.runner, [items[i] for i in chosen])
            if write is not None:
                sub_ctx.write_index = write[index].nonzero().flatten()
            out[index] = adapter.loop(state[index], loop_index, sub_ctx)
        return out

    def _read_out_passing(self, items, loops, state, rows, ctx, preds) -> None:
        """Measured items: the greedy prediction of the depth each just reached, short of its stop depth (read out
        when it finishes), appended to `preds` (`not_read` at a depth the runner does not read out); one readout per
        depth over the items there."""
        at_depth: dict[int, list[int]] = {}
        for i, (it, n) in enumerate(zip(items, loops)):
            if preds[i] is not None and n < it.stop:
                if n in self.runner.readout_depths:
                    at_depth.setdefault(n, []).append(i)
                else:
                    preds[i].append(not_read(it.num_positions, state))
        for depth, chosen in at_depth.items():
            index = to_device(torch.cat([torch.arange(rows[i].start, rows[i].stop) for i in chosen]), state.device)
            read_ctx = self.finisher.readout_context([items[i] for i in chosen], ctx, items)
            adjustments = readout_rows([items[i] for i in chosen], state.device)
            guesses = greedy_ids(self.runner.readout(state[index], depth, read_ctx), adjustments)
            for i, guess in zip(chosen, guesses.split([items[i].num_positions for i in chosen])):
                preds[i].append(guess)
