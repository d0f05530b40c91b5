"""LoopBatcher: the items in flight and the pass over them (docs/architecture.md, "Loop-level batching").

A pass embeds the tokens that enter (a request's next token, or its next drafted token), runs one loop of every
item together — each at its own loop index, reading and writing its own KV plane — and finishes the items that
reached their stop depth: a plain token is read out at its depth (D, or its exit depth) and sampled; a draft is read
out at d and its next draft drawn, or, after the K-th, its round's K+1 loop-d states become one verification item;
a verification is read out at D and accepted as the speculative round accepts (the same rejection sampler). The
items of a measured round are also read out at every depth they pass (`_read_out_passing`), and each finished one
reports which depths' greedy predictions agreed with its committed tokens.

`run` computes a pass without changing any item (a failed pass leaves them as they were; its KV writes are redone
alike by the retry); `commit` applies it once the engine has committed the finished tokens.
"""

from __future__ import annotations

import torch

from looped_spec.execution.early_exit import read_out_by_depth
from looped_spec.execution.logprobs import logprobs_of_rows, verified_logprobs
from looped_spec.execution.sampler import SamplingRows, sample
from looped_spec.execution.timing import Stopwatch
from looped_spec.loop_batching.items import DraftRound, Entering, Item, NextDraft, PassResult
from looped_spec.request import Request, TokenLogprob
from looped_spec.speculative.proposer import draw_drafts
from looped_spec.speculative.rejection_sampler import accept
from looped_spec.speculative.verifier import position_index

#: A request that enters without an entry in `rounds`: a plain token, not measured
NOT_MEASURED = Entering(0, 0, False)


class LoopBatcher:
    """Runs loop passes; every request entering a new round comes with its (K, d) and whether it is measured."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.adapter = runner.adapter
        self.depth = runner.full_depth
        self.reads_kv = self.adapter.exit_rule_reads_kv
        self.items: dict[str, Item] = {}
        self.next_drafts: dict[str, NextDraft] = {}
        # the last pass's context, reused while the same positions loop (at full depth: D passes in a row)
        self._ctx_key: tuple = ()
        self._ctx = None
        self._loop_planes = [list(self.adapter.loop_planes(i)) for i in range(self.depth)]
        self.watch = Stopwatch(runner.device)

    def in_flight(self, request: Request) -> bool:
        """Whether the request has work in flight (it then holds the KV slots of its positions)."""
        item, draft = self.items.get(request.request_id), self.next_drafts.get(request.request_id)
        return (item is not None and item.fresh()) or (draft is not None and draft.fresh())

    def drop(self, request_id: str) -> None:
        """Forget a request's work in flight (it was aborted or failed; its KV blocks are freed)."""
        self.items.pop(request_id, None)
        self.next_drafts.pop(request_id, None)

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
        entered = sum(1 for it in items if it.loops == 0)
        t1 = watch.mark()
        ctx = self._pass_context(items)
        state = torch.cat([it.state for it in items])
        loops = [it.loops for it in items]
        num_loops = min(max_loops, self._loops_before_a_stop(items))
        rows = self._rows(items)
        preds = [list(it.preds) if it.measured else None for it in items]  # copies: the items stay as they were
        measuring = any(p is not None for p in preds)
        prev = state
        for _ in range(num_loops):
            prev, state = state, self._loop(state, loops, ctx, items)
            loops = [n + 1 for n in loops]
            if measuring:
                self._read_out_passing(items, loops, state, rows, ctx, preds)
        t2 = watch.mark()
        out = _Finished(requests)
        exits, carries = self._exits(items, loops, state, prev, rows, ctx)
        skip = self.runner.exit_mode == "skip"
        plain, drafts, verifies, prompts = [], [], [], []
        for i, (it, n) in enumerate(zip(items, loops)):
            rs = rows[i]
            if it.chunk and n >= self.depth:
                prompts.append((it, state[rs]))
                continue
            if it.round is None and not it.chunk:
                exit_depth, exit_state = it.exit_depth, it.exit_state
                if exits[i] and not exit_depth:
                    exit_depth, exit_state = n, None  # None: this pass's row
                if n >= self.depth or (skip and exit_depth):
                    plain.append((it, rs.start, exit_depth, exit_state, preds[i]))
                    continue
                if exit_depth and exit_state is None:
                    exit_state = state[rs]
            elif n >= it.stop:
                moved = self._moved(it, state[rs], n, prev[rs], carries[i], preds[i])
                (verifies if it.verify else drafts).append(moved)
                continue
            else:
                exit_depth, exit_state = 0, None
            new = self._moved(it, state[rs], n, prev[rs], carries[i], preds[i])
            new.exit_depth, new.exit_state = exit_depth, exit_state
            out.items[it.request.request_id] = new
        if prompts:
            self._finish_chunks(prompts, ctx, items, out)
        if plain:
            self._finish_plain(plain, state, ctx, items, out)
        if drafts:
            self._finish_drafts(drafts, ctx, items, out)
        if verifies:
            self._finish_verifies(verifies, ctx, items, out)
        t3 = watch.mark()  # read after the finished tokens reached the host (timing.py)
        stages = {"embed": watch.seconds(t0, t1), "loops": watch.seconds(t1, t2), "finish": watch.seconds(t2, t3)}
        return out.result(sum(it.num_positions for it in items), entered, num_loops, stages)

    @staticmethod
    def _moved(it: Item, state: torch.Tensor, loops: int, prev: torch.Tensor, carry, preds) -> Item:
        """The item after this pass's loops (a new object: the pass leaves its inputs as they were)."""
        return Item(it.request, it.base, it.preemptions, it.position, state, it.stop, loops, prev, carry,
                    it.exit_depth, it.exit_state, it.round, it.verify, it.measured, it.chunk, preds or [])  # fmt: skip

    def commit(self, result: PassResult) -> None:
        """Apply a pass whose tokens the engine has committed: its requests' work becomes the work that goes on."""
        for request in result.requests:
            self.items.pop(request.request_id, None)
            self.next_drafts.pop(request.request_id, None)
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
            k, d, measured = rounds.get(request.request_id, NOT_MEASURED)
            round_ = DraftRound(position, k, d, measured=measured) if k > 0 else None
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
                items[row] = Item(request, base, request.metrics.num_preemptions, position, rows, stop,
                                  carry=None if carry is None or chunk else carry[j : j + 1], round=round_,
                                  measured=measured, chunk=chunk)  # fmt: skip
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
            self._ctx = self._context(items)
            self._ctx_key = key
        return self._ctx

    def _context(self, items: list[Item]):
        counts = [it.num_positions for it in items]
        lens = [it.position + n for it, n in zip(items, counts)]
        return self.runner.context([it.request for it in items], counts, lens)

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
            if it.chunk:
                out = min(out, it.stop - it.loops)
                continue
            if it.round is None and request.exit_threshold is not None:
                return 1
            stop = it.stop if it.round is not None else (request.exit_at_step or self.depth)
            out = min(out, stop - it.loops)
        return max(out, 1)

    def _loop(self, state: torch.Tensor, loops: list[int], ctx, items: list[Item]) -> torch.Tensor:
        """One loop of every item, item i at loop `loops[i]` (0-based): one call when the family's loops are loop 0 on
        moved planes (`uniform_loops`), else one call per distinct loop index."""
        adapter = self.adapter
        if len(set(loops)) == 1:  # every item at one loop (lockstep): the step engine's call
            return adapter.loop(state, loops[0], ctx)
        if adapter.uniform_loops:
            device = state.device
            per_request = torch.tensor(loops, dtype=torch.long, device=device) * len(self._loop_planes[0])
            counts = torch.tensor([it.num_positions for it in items], device=device)
            ctx.request_planes, ctx.token_planes = per_request, per_request.repeat_interleave(counts)
            ctx.kernel, ctx.contiguous_from = None, None  # the paged kernel and in-place reads take one plane
            try:
                return adapter.loop(state, 0, ctx)
            finally:  # the readouts after the pass (Huginn's coda attends) use their own planes
                ctx.request_planes = ctx.token_planes = None
        out = torch.empty_like(state)
        rows = self._rows(items)
        for loop_index in sorted(set(loops)):
            chosen = [i for i, n in enumerate(loops) if n == loop_index]
            index = torch.cat([torch.arange(rows[i].start, rows[i].stop) for i in chosen]).to(state.device)
            out[index] = adapter.loop(state[index], loop_index, self._context([items[i] for i in chosen]))
        return out

    def _exits(self, items, loops, state, prev, rows, ctx) -> tuple[list[bool], list]:
        """Per plain item: whether its token exits after its loop (rule fired, exit_at_step reached; depth D is the
        caller's), and its new carry. The rule runs once per depth over the items that have one, or once for all
        when it does not depend on the depth (`exit_rule_uses_depth`); items that carry nothing yet apart."""
        exits = [
            it.round is None and not it.chunk and it.request.exit_at_step is not None and n >= it.request.exit_at_step
            for it, n in zip(items, loops)
        ]
        carries = [it.carry for it in items]
        groups: dict[tuple, list[int]] = {}
        for i, (it, n) in enumerate(zip(items, loops)):
            if it.round is None and not it.chunk and it.request.exit_threshold is not None and n < self.depth:
                key = (n if self.adapter.exit_rule_uses_depth else 0, carries[i] is None)
                groups.setdefault(key, []).append(i)
        for chosen in groups.values():
            index = [rows[i].start for i in chosen]  # plain items hold one position
            threshold = torch.tensor([items[i].request.exit_threshold for i in chosen], device=state.device)
            carry = None if carries[chosen[0]] is None else torch.cat([carries[i] for i in chosen])
            # a rule that reads out through attention (Huginn's KL: its coda writes KV) gets the context of its rows
            rule_ctx = self._readout_context([items[i] for i in chosen], ctx, items) if self.reads_kv else ctx
            fired, carry = self.adapter.exit_rule(state[index], loops[chosen[0]], prev[index], carry, threshold,
                                                  rule_ctx)  # fmt: skip
            for j, (i, hit) in enumerate(zip(chosen, fired.tolist())):
                exits[i] = exits[i] or hit
                carries[i] = None if carry is None else carry[j : j + 1]
        return exits, carries

    def _read_out_passing(self, items, loops, state, rows, ctx, preds) -> None:
        """Measured items: the greedy prediction of the depth each just reached, short of its stop depth (read out
        when it finishes), appended to `preds`; one readout per depth over the items there."""
        at_depth: dict[int, list[int]] = {}
        for i, (it, n) in enumerate(zip(items, loops)):
            if preds[i] is not None and n < it.stop:
                at_depth.setdefault(n, []).append(i)
        for depth, chosen in at_depth.items():
            index = torch.cat([torch.arange(rows[i].start, rows[i].stop) for i in chosen]).to(state.device)
            read_ctx = self._readout_context([items[i] for i in chosen], ctx, items)
            guesses = self.runner.readout(state[index], depth, read_ctx).argmax(-1)
            for i, guess in zip(chosen, guesses.split([items[i].num_positions for i in chosen])):
                preds[i].append(guess)

    # ----- finishing -----
    def _readout_context(self, done: list[Item], ctx, items: list[Item]):
        """A readout that attends (Huginn's coda) writes KV: then the context of exactly the items read out."""
        if not self.adapter.readout_uses_kv or len(done) == len(items):
            return ctx
        return self._context(done)

    def _finish_chunks(self, done: list[tuple[Item, torch.Tensor]], ctx, items: list[Item], out: _Finished) -> None:
        """Prompt chunks at depth D: a chunk that ends its prompt reads out its last position and samples the first
        token (a readout that attends, Huginn's coda, runs over every position: each one's coda KV is cached)."""
        runner = self.runner
        finals = [j for j, (it, _) in enumerate(done) if it.position + it.num_positions == it.request.num_tokens]
        logits = None
        if self.adapter.readout_uses_kv:
            read_ctx = self._readout_context([it for it, _ in done], ctx, items)
            every = runner.readout(torch.cat([s for _, s in done]), self.depth, read_ctx)
            if finals:
                ends = torch.tensor([it.num_positions for it, _ in done], device=every.device).cumsum(0) - 1
                logits = every[ends[torch.tensor(finals, device=every.device)]]
        elif finals:
            logits = runner.readout(torch.cat([done[j][1][-1:] for j in finals]), self.depth, ctx)
        first: dict[int, tuple[int, list[TokenLogprob] | None]] = {}
        if logits is not None:
            requests = [done[j][0].request for j in finals]
            sampled = sample(logits, SamplingRows.build(requests, runner.device))
            entries = logprobs_of_rows(requests, logits, sampled) or [None] * len(finals)
            first = {j: (token, entry) for j, token, entry in zip(finals, sampled.tolist(), entries)}
        for j, (it, _) in enumerate(done):
            token, entry = first.get(j, (None, None))
            out.prefill(it.request, it.num_positions, [] if token is None else [token], entry)

    def _finish_plain(self, done: list[tuple], state: torch.Tensor, ctx, items: list[Item], out: _Finished) -> None:
        """Plain tokens (item, its row in this pass, exit depth, exit state or None for this pass's row, its
        measured predictions or None): read out at their exit depth (skip mode: the loop planes after it get the exit
        loop's KV) and sampled."""
        runner = self.runner
        finished = [it for it, _, _, _, _ in done]
        depths = [depth or self.depth for _, _, depth, _, _ in done]
        if runner.exit_mode == "skip":
            self._fill_skipped_loops(finished, depths)
        requests = [it.request for it in finished]
        positions = [it.position for it in finished]
        lens = [p + 1 for p in positions]
        rows = [row for _, row, _, _, _ in done]
        if all(kept is None for _, _, _, kept, _ in done):  # every exit state is this pass's row
            exit_states = state if len(rows) == state.shape[0] else state[torch.tensor(rows, device=state.device)]
        else:
            exit_states = torch.cat([state[row : row + 1] if kept is None else kept for _, row, _, kept, _ in done])
        read_ctx = self._readout_context(finished, ctx, items)
        logits = read_out_by_depth(runner, requests, positions, lens, exit_states, depths, read_ctx)
        sampled = sample(logits, SamplingRows.build(requests, runner.device))
        entries = logprobs_of_rows(requests, logits, sampled) or [None] * len(finished)
        for j, (it, token, depth, entry) in enumerate(zip(finished, sampled.tolist(), depths, entries)):
            agreement = None
            if done[j][4] is not None:  # measured (at full depth): depths 1..D-1 on the way, D here
                agreement = torch.stack([*done[j][4], logits[j : j + 1].argmax(-1)]) == sampled[j]  # [D, 1]
            out.finish(it.request, [token], 0, 0, [depth] if it.request.exits_early else [], entry, it.position,
                       agreement)  # fmt: skip

    def _finish_drafts(self, done: list[Item], ctx, items: list[Item], out: _Finished) -> None:
        """Drafts at depth d: keep the loop-d state; draw the next draft, or hand the round to its verification. One
        readout per draft depth over the drafts there (a measured round's K-th draft position too: its depth-d
        prediction)."""
        by_depth: dict[int, list[tuple[Item, DraftRound, bool]]] = {}
        for it in done:
            r = it.round.grown(it.state)  # a new round: the pass changes nothing it was given
            draws = len(r.tokens) < r.k
            if draws or r.measured:
                by_depth.setdefault(r.d, []).append((it, r, draws))
            if not draws:  # the K-th draft's own position: all K+1 loop-d states are there
                out.items[it.request.request_id] = Item(
                    it.request, r.start, it.preemptions, r.start, torch.cat(r.states), self.depth, r.d,
                    round=r, verify=True, measured=r.measured,
                )  # fmt: skip
        for depth, group in by_depth.items():
            state = torch.cat([it.state for it, _, _ in group])
            logits = self.runner.readout(state, depth, self._readout_context([it for it, _, _ in group], ctx, items))
            greedy = logits.argmax(-1) if any(r.measured for _, r, _ in group) else None
            for j, (it, r, _) in enumerate(group):
                if greedy is not None and r.measured:
                    r.preds.append(torch.cat([*it.preds, greedy[j : j + 1]]))  # [d]: depths 1..d of this position
            drawing = [j for j, (_, _, draws) in enumerate(group) if draws]
            if not drawing:
                continue
            requests = [group[j][0].request for j in drawing]
            rows = logits if len(drawing) == len(group) else logits[torch.tensor(drawing, device=logits.device)]
            tokens, q = draw_drafts(rows, SamplingRows.build(requests, self.runner.device), requests)
            for n, (j, token) in enumerate(zip(drawing, tokens.tolist())):
                it, r, _ = group[j]
                r.tokens.append(token)
                r.q.append(None if q is None else q[n])
                out.next_drafts[it.request.request_id] = NextDraft(it.request, it.preemptions, token, r)

    def _finish_verifies(self, done: list[Item], ctx, items: list[Item], out: _Finished) -> None:
        """Verifications at depth D: accept as the speculative round does (greedy prefix or rejection sampling)."""
        runner, device = self.runner, self.runner.device
        requests = [it.request for it in done]
        ks = [it.round.k for it in done]
        logits = runner.readout(
            torch.cat([it.state for it in done]), self.depth, self._readout_context(done, ctx, items)
        )
        draft_tokens = torch.full((len(done), max(ks)), -1, dtype=torch.long, device=device)
        q_probs = None
        for i, it in enumerate(done):
            draft_tokens[i, : it.round.k] = torch.tensor(it.round.tokens, device=device)
            for j, q in enumerate(it.round.q):
                if q is not None:
                    if q_probs is None:
                        q_probs = torch.zeros(len(done), max(ks), q.shape[-1], device=device)
                    q_probs[i, j] = q
        row_index, pos_index = position_index(ks)
        rows = SamplingRows.build(requests, device)
        k_t = torch.tensor(ks, device=device)
        accepted, next_token = accept(
            draft_tokens, k_t, logits, row_index.to(device), pos_index.to(device), rows, q_probs
        )
        committed = [
            [*it.round.tokens[:a], token] for it, a, token in zip(done, accepted.tolist(), next_token.tolist())
        ]
        entries = verified_logprobs(requests, ks, committed, logits) or [None] * len(done)
        greedy = logits.argmax(-1) if any(it.round.measured for it in done) else None
        offset = 0
        for it, tokens, entry in zip(done, committed, entries):
            agreement, width = None, it.round.k + 1
            if greedy is not None and it.round.measured:
                # depths 1..d from the drafts, d+1..D-1 on the way here, D now; each over the round's K+1 positions
                verified = torch.stack([*it.preds, greedy[offset : offset + width]])
                guesses = torch.cat([torch.stack(it.round.preds, 1), verified])
                agreement = guesses[:, : len(tokens)] == torch.tensor(tokens, device=guesses.device)  # [D, committed]
            offset += width
            out.finish(it.request, tokens, it.round.k, len(tokens) - 1, [], entry, it.round.start, agreement)

    def _fill_skipped_loops(self, done: list[Item], depths: list[int]) -> None:
        """Skip mode: the loop planes after each token's exit depth get its exit loop's KV (early_exit.py), all
        tokens in one copy."""
        src, dst, slots = [], [], []
        block_size, planes = self.runner.kv.block_size, self._loop_planes
        for it, exit_depth in zip(done, depths):
            if exit_depth >= self.depth:
                continue
            table, position = it.request.block_table, it.position
            slot = table[position // block_size] * block_size + position % block_size
            for loop_index in range(exit_depth, self.depth):
                src += planes[exit_depth - 1]
                dst += planes[loop_index]
            slots += [slot] * (len(planes[0]) * (self.depth - exit_depth))
        if slots:
            device = self.runner.device
            self.runner.kv.copy_entries(*(torch.tensor(x, dtype=torch.long, device=device) for x in (src, dst, slots)))


class _Finished:
    """What a pass finished, gathered while it finishes its items."""

    def __init__(self, requests: list[Request]) -> None:
        self.requests = requests
        self.finished: list[Request] = []
        self.tokens: list[list[int]] = []
        self.proposed: list[int] = []
        self.accepted: list[int] = []
        self.exit_depths: list[list[int]] = []
        self.logprobs: list[list[TokenLogprob]] = []
        self.starts: list[int] = []
        self.agreement: list[torch.Tensor | None] = []
        self.prefilled: list[Request] = []
        self.chunk_lens: list[int] = []
        self.first_tokens: list[list[int]] = []
        self.first_logprobs: list[list[TokenLogprob]] = []
        self.items: dict[str, Item] = {}
        self.next_drafts: dict[str, NextDraft] = {}

    def finish(
        self, request: Request, tokens: list[int], proposed: int, accepted: int, depths: list[int],
        logprobs: list[TokenLogprob] | None, start: int, agreement: torch.Tensor | None,
    ) -> None:  # fmt: skip
        self.logprobs.append(logprobs or [])
        self.starts.append(start)
        self.agreement.append(agreement)
        self.finished.append(request)
        self.tokens.append(tokens)
        self.proposed.append(proposed)
        self.accepted.append(accepted)
        self.exit_depths.append(depths)

    def prefill(self, request: Request, chunk_len: int, tokens: list[int], logprobs: list[TokenLogprob] | None) -> None:
        self.prefilled.append(request)
        self.chunk_lens.append(chunk_len)
        self.first_tokens.append(tokens)
        self.first_logprobs.append(logprobs or [])

    def result(self, positions: int, entered: int, loops: int, stages: dict[str, float]) -> PassResult:
        exit_depths = self.exit_depths if any(r.exits_early for r in self.finished) else None
        logprobs = self.logprobs if any(r.logprobs_top is not None for r in self.finished) else None
        first_logprobs = self.first_logprobs if any(r.logprobs_top is not None for r in self.prefilled) else None
        return PassResult(self.requests, self.finished, self.tokens, self.proposed, self.accepted, exit_depths,
                          self.items, self.next_drafts, positions, entered, loops, stages, logprobs, self.starts,
                          self.agreement, self.prefilled, self.chunk_lens, self.first_tokens,
                          first_logprobs)  # fmt: skip
