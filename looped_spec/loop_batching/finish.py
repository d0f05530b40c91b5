"""Finishing a loop pass's items that reached their stop depth (`Finisher`), and gathering what the pass finished
(`Finished`, which becomes the `PassResult`).

A prompt chunk ending its prompt samples the first token; a plain token is read out at its depth (D, or its exit
depth: skip mode fills the loop planes after it) and sampled; a draft is read out at d and its next draft drawn, or,
after the K-th, its round's K+1 loop-d states become one verification item; a verification is read out at D and
accepted as the speculative round accepts (the same rejection sampler). A measured item also reports which depths'
greedy predictions agreed with its committed tokens.
"""

from __future__ import annotations

import torch

from looped_spec.execution.early_exit import merge_logits, read_out_by_depth
from looped_spec.execution.logprobs import logprobs_of_rows, verified_logprobs
from looped_spec.execution.sampler import SamplingRows, sample
from looped_spec.execution.transfers import to_device
from looped_spec.loop_batching.contexts import readout_context
from looped_spec.loop_batching.exits import PassExits
from looped_spec.loop_batching.items import DraftRound, Item, NextDraft, PassResult, PlainToken
from looped_spec.request import Request, TokenLogprob
from looped_spec.speculative.proposer import draw_drafts, top_two_margin
from looped_spec.speculative.readouts import greedy_ids, not_read, position_rows
from looped_spec.speculative.rejection_sampler import accept
from looped_spec.speculative.verifier import position_index


class Finisher:
    """Reads out, samples and accepts the items a pass finished; builds the items and drafts that go on."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.adapter = runner.adapter
        self.depth = runner.full_depth
        self.exits = PassExits(runner)

    def readout_context(self, done: list[Item], ctx, items: list[Item]):
        return readout_context(self.runner, done, ctx, items)

    def chunks(self, done: list[tuple[Item, torch.Tensor, list | None]], ctx, items: list[Item], out: Finished) -> None:
        """Prompt chunks at depth D (item, its rows' states, its last position's states at every depth or None): a
        chunk that ends its prompt reads out its last position and samples the first token (a readout that attends,
        Huginn's coda, runs over every position: each one's coda KV is cached). A request that exits early reads
        it out at its rule's exit depth, decided afterwards on the last position's states (`PassExits.first_tokens`)."""
        runner = self.runner
        finals = [j for j, (it, _, _) in enumerate(done) if it.position + it.num_positions == it.request.num_tokens]
        logits = None
        if self.adapter.readout_uses_kv:
            read_ctx = self.readout_context([it for it, _, _ in done], ctx, items)
            every = runner.readout(torch.cat([s for _, s, _ in done]), self.depth, read_ctx)
            if finals:
                ends = to_device([it.num_positions for it, _, _ in done], every.device).cumsum(0) - 1
                logits = every[ends[to_device(finals, every.device)]]
        elif finals:
            logits = runner.readout(torch.cat([done[j][1][-1:] for j in finals]), self.depth, ctx)
        first: dict[int, tuple[int, list[TokenLogprob] | None]] = {}
        depths: dict[int, int] = {}
        if logits is not None:
            ruled = [n for n, j in enumerate(finals) if done[j][2] is not None]
            if ruled:
                exit_depths, exit_logits = self.exits.first_tokens([done[finals[n]] for n in ruled])
                logits = logits.clone()
                logits[to_device(ruled, logits.device)] = exit_logits
                depths = {finals[n]: depth for n, depth in zip(ruled, exit_depths)}
            requests = [done[j][0].request for j in finals]
            sampled = sample(logits, SamplingRows.build(requests, runner.device))
            entries = logprobs_of_rows(requests, logits, sampled) or [None] * len(finals)
            first = {j: (token, entry) for j, token, entry in zip(finals, sampled.tolist(), entries)}
        for j, (it, _, _) in enumerate(done):
            token, entry = first.get(j, (None, None))
            out.prefill(it.request, it.num_positions, [] if token is None else [token], entry,
                        [depths[j]] if j in depths else [])  # fmt: skip

    def plain(self, done: list[PlainToken], state: torch.Tensor, ctx, items: list[Item], out: Finished) -> None:
        """Plain tokens: those whose exit rule did not read them out at their exit are read out at their exit depth
        (skip mode: the loop planes after it get the exit loop's KV), then all are sampled."""
        runner = self.runner
        finished = [t.item for t in done]
        depths = [t.exit_depth or self.depth for t in done]
        if runner.exit_mode == "skip":
            self.exits.fill([(it.request, it.position, depth) for it, depth in zip(finished, depths)])
        requests = [it.request for it in finished]
        positions = [it.position for it in finished]
        lens = [p + 1 for p in positions]
        read = {j: t.logits[0] for j, t in enumerate(done) if t.logits is not None}
        unread = [j for j in range(len(done)) if j not in read]
        part = None
        if unread:
            rows = [done[j].row for j in unread]
            if all(done[j].exit_state is None for j in unread):  # every exit state is this pass's row
                exit_states = state if len(rows) == state.shape[0] else state[to_device(rows, state.device)]
            else:
                exit_states = torch.cat([state[t.row : t.row + 1] if t.exit_state is None else t.exit_state
                                         for t in (done[j] for j in unread)])  # fmt: skip
            read_ctx = self.readout_context([finished[j] for j in unread], ctx, items)
            part = read_out_by_depth(runner, [requests[j] for j in unread], [positions[j] for j in unread],
                                     [lens[j] for j in unread], exit_states, [depths[j] for j in unread],
                                     read_ctx)  # fmt: skip
        logits = merge_logits(len(done), read, unread, part)
        rows = SamplingRows.build(requests, runner.device)
        sampled = sample(logits, rows)
        full = None
        if any(t.preds is not None for t in done):  # measured: the greedy choice at full depth, adjusted
            full = greedy_ids(logits, rows)
        entries = logprobs_of_rows(requests, logits, sampled) or [None] * len(finished)
        for j, (it, token, depth, entry) in enumerate(zip(finished, sampled.tolist(), depths, entries)):
            agreement = None
            if done[j].preds is not None:  # measured (at full depth): depths 1..D-1 on the way, D here
                agreement = torch.stack([*done[j].preds, full[j : j + 1]]) == sampled[j]  # [D, 1]
            out.finish(it.request, [token], 0, 0, [depth] if it.request.exits_early else [], entry, agreement)

    def drafts(self, done: list[Item], ctx, items: list[Item], out: Finished) -> list[Item]:
        """Drafts at depth d (or at their exit, under early exit): keep the loop-d state; draw the next draft, or hand
        the round to its verification. One readout per readout depth over the drafts there (a measured round's K-th
        draft position too: its depth-d prediction; an exited K-th position: its target logits). Returns the
        verifications with nothing left to run (every position exited within the draft, skip mode)."""
        by_depth: dict[int, list[tuple[Item, DraftRound, bool]]] = {}
        complete: list[Item] = []
        for it in done:
            exit_depth = it.exit_depth if it.round.exits_early else 0
            # a new round: the pass changes nothing it was given
            r = it.round.grown(it.state, exit_depth, it.exit_state, it.carry if it.round.exits_early else None)
            draws = len(r.tokens) < r.k
            measured = r.measured and r.d in self.runner.readout_depths  # the K-th position read out for itself
            if draws or measured or exit_depth:
                depth = exit_depth or r.d
                if self.runner.adapter.uniform_loops:  # the readout ignores the depth: one call, the first group's
                    depth = next(iter(by_depth), depth)
                by_depth.setdefault(depth, []).append((it, r, draws))
            else:
                r.logits.append(None)  # read out nowhere: one entry per position, as the read-out ones get below
                if r.measured:
                    r.preds.append(torch.cat([*it.preds, not_read(1, it.state)]))
            if draws:
                continue
            # the K-th draft's own position: all K+1 loop-d states are there
            verification = self._verification(it, r)
            if verification.loops >= self.depth:
                complete.append(verification)
            else:
                out.items[it.request.request_id] = verification
        for depth, group in by_depth.items():
            state = torch.cat([it.exit_state if r.exits[-1] else it.state for it, r, _ in group])
            logits = self.runner.readout(state, depth, self.readout_context([it for it, _, _ in group], ctx, items))
            greedy = None
            if any(r.measured for _, r, _ in group):
                greedy = greedy_ids(logits, readout_rows([it for it, _, _ in group], logits.device))
            for j, (it, r, _) in enumerate(group):
                if greedy is not None and r.measured:  # [d]: depths 1..d of this position
                    own = greedy[j : j + 1] if r.d in self.runner.readout_depths else not_read(1, greedy)
                    r.preds.append(torch.cat([*it.preds, own]))
                r.logits.append(logits[j] if r.exits[-1] else None)
            drawing = [j for j, (_, _, draws) in enumerate(group) if draws]
            # per-token stopping: an unsure draft is not drawn, its round is verified as it stands (a position that
            # exited within the draft was read out at its exit: the target's own sample, never unsure)
            stopping = [j for j in drawing if group[j][1].stop_margin is not None and not group[j][1].exits[-1]]
            if stopping:
                margins = top_two_margin(logits[to_device(stopping, logits.device)]).tolist()
                unsure = {j for j, m in zip(stopping, margins) if m < group[j][1].stop_margin}
                for j in sorted(unsure):
                    it, r, _ = group[j]
                    r.k = len(r.tokens)
                    out.items[it.request.request_id] = self._verification(it, r)
                drawing = [j for j in drawing if j not in unsure]
            if not drawing:
                continue
            requests = [group[j][0].request for j in drawing]
            # each round's drafts so far, where a penalty or min_tokens counts them
            so_far = [list(group[j][1].tokens) for j in drawing] if any(r.depends_on_output for r in requests) else None
            rows = logits if len(drawing) == len(group) else logits[to_device(drawing, logits.device)]
            tokens, q = draw_drafts(rows, requests, so_far)
            for n, (j, token) in enumerate(zip(drawing, tokens.tolist())):
                it, r, _ = group[j]
                r.tokens.append(token)
                r.q.append(None if q is None else q[n])
                out.next_drafts[it.request.request_id] = NextDraft(it.request, it.preemptions, token, r)
        return complete

    def _verification(self, it: Item, r: DraftRound) -> Item:
        """The verification of a round whose K+1 draft positions are there: loops d+1..D of its positions (under early
        exit `PassExits.verification`)."""
        if not r.exits_early:
            return Item(it.request, r.start, it.preemptions, r.start, torch.cat(r.states), self.depth, r.d,
                        round=r, verify=True, measured=r.measured)  # fmt: skip
        return self.exits.verification(it, r)

    def verifies(self, done: list[Item], ctx, items: list[Item], out: Finished) -> None:
        """Verifications at depth D (under early exit: once every row exited): accept as the speculative round does
        (greedy prefix or rejection sampling; a position the draft decided is accepted outright)."""
        device = self.runner.device
        requests = [it.request for it in done]
        ks = [it.round.k for it in done]
        logits = self._target_logits(done, ctx, items)
        draft_tokens = torch.full((len(done), max(ks)), -1, dtype=torch.long, device=device)
        q_probs = None
        decided: list[list[bool]] = [it.round.decided(self.adapter.readout_uses_kv) for it in done]
        for i, it in enumerate(done):
            draft_tokens[i, : it.round.k] = to_device(it.round.tokens, device)
            for j, q in enumerate(it.round.q):
                if q is not None:
                    if q_probs is None:
                        q_probs = torch.zeros(len(done), max(ks), q.shape[-1], device=device)
                    q_probs[i, j] = q
        decided_grid = None
        if any(any(row) for row in decided):
            decided_grid = torch.zeros(len(done), max(ks), dtype=torch.bool)
            for i, row in enumerate(decided):
                decided_grid[i, : len(row) - 1] = torch.tensor(row[:-1], dtype=torch.bool)
            decided_grid = to_device(decided_grid, device)
        row_index, pos_index = position_index(ks)
        rows = SamplingRows.build(requests, device)
        k_t = to_device(ks, device)
        accepted, next_token = accept(
            draft_tokens,
            k_t,
            logits,
            to_device(row_index, device),
            to_device(pos_index, device),
            rows,
            q_probs,
            decided=decided_grid,
        )
        accepted_host, next_host = torch.stack([accepted, next_token.to(accepted.dtype)]).tolist()  # one transfer
        committed = [[*it.round.tokens[:a], token] for it, a, token in zip(done, accepted_host, next_host)]
        entries = verified_logprobs(requests, ks, committed, logits) or [None] * len(done)
        greedy = greedy_ids(logits, readout_rows(done, device)) if any(it.round.measured for it in done) else None
        offset = 0
        for it, tokens, entry, row in zip(done, committed, entries, decided):
            agreement, width, r = None, it.round.k + 1, it.round
            if greedy is not None and r.measured:
                # depths 1..d from the drafts, d+1..D-1 on the way here, D now; each over the round's K+1 positions
                verified = torch.stack([*it.preds, greedy[offset : offset + width]])
                guesses = torch.cat([torch.stack(r.preds, 1), verified])
                agreement = guesses[:, : len(tokens)] == to_device(tokens, guesses.device)  # [D, committed]
            offset += width
            depths: list[int] = []
            if r.exits_early:  # each committed position's exit depth: the draft's, or the verification's
                lo = it.position - r.start
                depths = [r.exits[j] if j < lo else it.row_exits[j - lo] for j in range(len(tokens))]
            checked = [not x for x in row[: r.k]]  # drafts the target checked (not drawn from its own readout)
            out.finish(it.request, tokens, r.k, len(tokens) - 1, depths, entry, agreement,
                       sum(checked), sum(checked[: len(tokens) - 1]))  # fmt: skip

    def _target_logits(self, done: list[Item], ctx, items: list[Item]) -> torch.Tensor:
        """[sum(K+1), V]: the target's logits of every round position, round after round: the verification's readout
        at D, or under early exit `PassExits.target_logits`."""
        runner = self.runner
        plain = [it for it in done if not it.round.exits_early]
        plain_logits = None
        if plain:
            read_ctx = self.readout_context(plain, ctx, items)
            plain_logits = runner.readout(torch.cat([it.state for it in plain]), self.depth, read_ctx)
        if len(plain) == len(done):
            return plain_logits
        exit_logits = iter(self.exits.target_logits([it for it in done if it.round.exits_early]))
        out, plain_at = [], 0
        for it in done:
            width = it.round.k + 1
            if it.round.exits_early:
                out.append(next(exit_logits))
            else:
                out.append(plain_logits[plain_at : plain_at + width])
                plain_at += width
        return torch.cat(out)


class Finished:
    """What a pass finished, gathered while it finishes its items."""

    def __init__(self, requests: list[Request]) -> None:
        self.requests = requests
        self.finished: list[Request] = []
        self.tokens: list[list[int]] = []
        self.proposed: list[int] = []
        self.accepted: list[int] = []
        self.exit_depths: list[list[int]] = []
        self.logprobs: list[list[TokenLogprob]] = []
        self.agreement: list[torch.Tensor | None] = []
        self.prefilled: list[Request] = []
        self.chunk_lens: list[int] = []
        self.first_tokens: list[list[int]] = []
        self.first_logprobs: list[list[TokenLogprob]] = []
        self.first_exit_depths: list[list[int]] = []
        self.verified_proposed: list[int] = []
        self.verified_accepted: list[int] = []
        self.items: dict[str, Item] = {}
        self.next_drafts: dict[str, NextDraft] = {}

    def finish(
        self, request: Request, tokens: list[int], proposed: int, accepted: int, depths: list[int],
        logprobs: list[TokenLogprob] | None, agreement: torch.Tensor | None,
        verified_proposed: int | None = None, verified_accepted: int | None = None,
    ) -> None:  # fmt: skip
        """A finished token or round; `verified_*`: the drafts the target checked (None: every draft)."""
        self.verified_proposed.append(proposed if verified_proposed is None else verified_proposed)
        self.verified_accepted.append(accepted if verified_accepted is None else verified_accepted)
        self.logprobs.append(logprobs or [])
        self.agreement.append(agreement)
        self.finished.append(request)
        self.tokens.append(tokens)
        self.proposed.append(proposed)
        self.accepted.append(accepted)
        self.exit_depths.append(depths)

    def prefill(
        self, request: Request, chunk_len: int, tokens: list[int], logprobs: list[TokenLogprob] | None,
        exit_depths: list[int],
    ) -> None:  # fmt: skip
        self.first_exit_depths.append(exit_depths)
        self.prefilled.append(request)
        self.chunk_lens.append(chunk_len)
        self.first_tokens.append(tokens)
        self.first_logprobs.append(logprobs or [])

    def result(self, positions: int, entered: int, loops: int, captured: int, stages: dict[str, float]) -> PassResult:
        exit_depths = self.exit_depths if any(r.exits_early for r in self.finished) else None
        logprobs = self.logprobs if any(r.logprobs_top is not None for r in self.finished) else None
        first_logprobs = self.first_logprobs if any(r.logprobs_top is not None for r in self.prefilled) else None
        first_exits = self.first_exit_depths if any(self.first_exit_depths) else None
        return PassResult(self.requests, self.finished, self.tokens, self.proposed, self.accepted, exit_depths,
                          self.items, self.next_drafts, positions, entered, loops, captured, stages, logprobs,
                          self.agreement, self.prefilled, self.chunk_lens, self.first_tokens,
                          first_logprobs, first_exits, self.verified_proposed, self.verified_accepted)  # fmt: skip


def readout_rows(items: list[Item], device: torch.device) -> SamplingRows | None:
    """The logit adjustments of every position of `items`, item after item (None: no request adjusts its logits), so
    a measured readout's greedy choice is the one a draft there would make."""
    requests = [it.request for it in items for _ in range(it.num_positions)]
    return position_rows(requests, [d for it in items for d in it.drafts_before()], device)
