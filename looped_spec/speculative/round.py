"""One decode round: draft, verify, accept — and the counterfactual depth measurements.

Plain decoding is the K = 0 round: one full-depth forward and a sample per request, with no draft,
verify or acceptance bookkeeping. Nothing here changes request state; the scheduler commits the result.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from looped_spec.execution.logprobs import logprobs_of_rows, verified_logprobs
from looped_spec.execution.model_runner import ModelRunner
from looped_spec.execution.sampler import SamplingRows, sample
from looped_spec.execution.timing import Stopwatch
from looped_spec.execution.transfers import to_device
from looped_spec.request import Request, TokenLogprob
from looped_spec.speculative.exit_round import propose_with_exit, propose_with_exit_until_unsure, verify_with_exit
from looped_spec.speculative.proposer import DraftProposer
from looped_spec.speculative.readouts import depth_trials, greedy_ids, read_out_depths
from looped_spec.speculative.rejection_sampler import accept, pad_positions
from looped_spec.speculative.verifier import Verifier


@dataclass
class RoundResult:
    """Per request (in the caller's order): tokens to commit and accepted draft count; the round's seconds
    per phase (a speculative round drafts, verifies and accepts; a plain round only decodes)."""

    committed: list[list[int]]
    num_accepted: list[int]
    draft_time: float = 0.0
    verify_time: float = 0.0
    accept_time: float = 0.0
    decode_time: float = 0.0  # plain rounds: the full-depth decode and the sample
    depth_matches: list[int] = field(default_factory=list)  # per depth 1..D
    depth_trials: list[int] = field(default_factory=list)  # 0 at a depth the runner does not read out
    # per request, [D] matches over its committed positions, and how many it committed
    request_matches: list[list[int]] = field(default_factory=list)
    request_trials: list[int] = field(default_factory=list)
    # early exit: per request, the exit depth of each position from the round's first on (its committed
    # tokens' readout depths); None without early exit
    exit_depths: list[list[int]] | None = None
    # the acceptance the controller learns from (early exit: drafts the target itself drew are left out);
    # None: `num_accepted` out of K
    verified_proposed: list[int] | None = None
    verified_accepted: list[int] | None = None
    # per request, the drafts it proposed when per-token stopping drafted fewer than the plan's K; None otherwise
    proposed: list[int] | None = None
    # per request, the entries of its committed tokens when it asked for log-probabilities ([] when it did not);
    # None when no request of the round did
    logprobs: list[list[TokenLogprob]] | None = None


class SpeculativeRound:
    """Drives proposer -> verifier -> rejection sampler over a batch with ragged K (K >= 0 per request)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.proposer = DraftProposer(runner)
        self.verifier = Verifier(runner)
        self.watch = Stopwatch(runner.device)

    def run(
        self, requests: list[Request], k: list[int], d: int, measure_depths: bool = False,
        stop_margin: float | None = None,
    ) -> RoundResult:  # fmt: skip
        """One round: plain decoding when every K is 0, else draft -> verify -> accept; with `measure_depths`
        the committed positions' counterfactual readouts too; with `stop_margin`, per-token stopping (under early
        exit too). Phase times are read once the round's tokens reached the host (timing.py:
        no synchronization for telemetry)."""
        if max(k) == 0:
            return self._plain(requests, measure_depths)
        return self._speculative(requests, k, d, measure_depths, stop_margin)

    def _speculative(
        self, requests: list[Request], k: list[int], d: int, measure_depths: bool, stop_margin: float | None = None
    ) -> RoundResult:
        # early exit: the target is the early-exit model (exit_round.py); no counterfactual depth readouts then
        # (a token's depth is the rule's)
        exits = any(r.exits_early for r in requests)
        measure_depths = measure_depths and not exits
        order = sorted(range(len(requests)), key=lambda i: -k[i])
        reqs = [requests[i] for i in order]
        ks = [k[i] for i in order]
        device, mode = self.runner.device, self.runner.exit_mode
        rows = SamplingRows.build(reqs, device)

        watch = self.watch
        t0 = watch.mark()
        if exits and stop_margin is not None:
            draft, steps = propose_with_exit_until_unsure(self.runner, reqs, ks, d, mode, stop_margin)
        elif exits:
            draft, steps = propose_with_exit(self.runner, reqs, ks, d, rows, mode)
        else:
            draft = self.proposer.propose(reqs, ks, d, rows, measure_depths, stop_margin)
        if draft.order is not None:  # per-token stopping: the rows in the order of the K they drafted
            order = [order[i] for i in draft.order]
            reqs = [reqs[i] for i in draft.order]
            ks = [draft.k[i] for i in draft.order]
            rows = SamplingRows.build(reqs, device)
        t1 = watch.mark()
        if exits:
            verification = verify_with_exit(self.runner, reqs, ks, d, steps, mode)
        else:
            verification = self.verifier.verify(reqs, ks, d, draft, measure_depths)
        t2 = watch.mark()
        k_t = to_device(ks, device)
        decided = verification.decided[:, : max(ks)] if exits else None  # [R, K_max]: drafts the target drew
        num_accepted, next_token = accept(
            draft.tokens, k_t, verification.logits, verification.row_index, verification.pos_index, rows,
            draft.q_probs, decided=decided,
        )  # fmt: skip
        committed_grid = torch.cat([draft.tokens, draft.tokens.new_zeros(len(reqs), 1)], dim=1)
        committed_grid.scatter_(1, num_accepted[:, None], next_token[:, None])  # [R, K_max + 1]
        # one transfer to the host: the accepted counts beside the committed tokens
        both = torch.cat([num_accepted[:, None].to(committed_grid.dtype), committed_grid], dim=1).tolist()
        acc, grid = [row[0] for row in both], [row[1:] for row in both]
        agree = None
        if measure_depths:
            agree = self._depth_agreement(draft, verification, committed_grid, d)
        t3 = watch.mark()

        seconds = watch.seconds
        result = RoundResult(
            [[] for _ in requests], [0] * len(requests), seconds(t0, t1), seconds(t1, t2), seconds(t2, t3), 0.0
        )
        for pos, i in enumerate(order):
            result.committed[i] = grid[pos][: acc[pos] + 1]
            result.num_accepted[i] = acc[pos]
        if draft.order is not None:
            result.proposed = [0] * len(requests)
            for pos, i in enumerate(order):
                result.proposed[i] = ks[pos]
        if agree is not None:  # per depth and request, matches over the committed positions 0..accepted
            inverse = to_device(torch.tensor(order).argsort(), agree.device)  # the caller's request order
            matches = agree.cumsum(2).gather(2, num_accepted[None, :, None].expand(len(agree), -1, 1))[:, inverse, 0]
            _agreement_counts(result, matches, [n + 1 for n in result.num_accepted], self.runner.readout_depths)
        if exits:
            self._exit_counts(result, order, ks, acc, verification)
        entries = verified_logprobs(reqs, ks, [grid[pos][: acc[pos] + 1] for pos in range(len(reqs))],
                                    verification.logits)  # fmt: skip
        if entries is not None:  # back to the caller's request order
            result.logprobs = [[] for _ in requests]
            for pos, i in enumerate(order):
                result.logprobs[i] = entries[pos]
        return result

    @staticmethod
    def _exit_counts(result: RoundResult, order: list[int], ks: list[int], acc: list[int], verification) -> None:
        """Early exit: each request's committed positions' exit depths, and its verified drafts (those the
        target did not draw itself), proposed and accepted, for the controller."""
        n = len(order)
        result.exit_depths = [[] for _ in range(n)]
        result.verified_proposed, result.verified_accepted = [0] * n, [0] * n
        decided = verification.decided.tolist()
        for pos, i in enumerate(order):
            verified = [not x for x in decided[pos][: ks[pos]]]  # draft token j+1 was checked against the target
            result.exit_depths[i] = verification.exit_depths[pos][: acc[pos] + 1]
            result.verified_proposed[i] = sum(verified)
            result.verified_accepted[i] = sum(verified[: acc[pos]])

    @torch.inference_mode()
    def _plain(self, requests: list[Request], measure_depths: bool) -> RoundResult:
        """K = 0: plain full-depth decoding and a sample per request."""
        t0 = self.watch.mark()
        depth_preds = None
        exit_depths = None
        # counterfactual depths are measured on full-depth rounds only (under early exit the depth is the rule's)
        rows = SamplingRows.build(requests, self.runner.device)  # the readouts' greedy choices are adjusted too
        if measure_depths and self.runner.readout_depths and not any(r.exits_early for r in requests):
            inp = self.runner.decode_input(requests, keep_states=True)
            preds, logits = read_out_depths(self.runner, inp, self.runner.run(inp), rows)
            depth_preds = torch.stack(preds)  # [D - 1, R]: depths 1..D-1 (-1 where not read out)
        else:
            logits, exit_depths = self.runner.decode_with_depths(requests)
        sampled = sample(logits, rows)
        committed = [[t] for t in sampled.tolist()]
        logprobs = logprobs_of_rows(requests, logits, sampled)
        decode_time = self.watch.seconds(t0, self.watch.mark())
        result = RoundResult(
            committed,
            [0] * len(requests),
            decode_time=decode_time,
            exit_depths=[[e] for e in exit_depths] if exit_depths is not None else None,
            logprobs=logprobs,
        )
        if depth_preds is not None:  # how often each shallower depth would have drafted the committed token
            # depth D: the greedy full-depth readout, which a sampled request's committed token need not be
            agree = torch.cat([depth_preds, greedy_ids(logits, rows)[None]]) == sampled[None]  # [D, R]
            _agreement_counts(result, agree, [1] * len(requests), self.runner.readout_depths)
        return result

    def _depth_agreement(self, draft, verification, committed_grid, d) -> torch.Tensor:
        """[D, R, K_max + 1]: whether each depth's greedy readout agreed with the committed token (any position;
        the caller keeps the committed ones)."""
        num_reqs, width = committed_grid.shape
        preds = [draft.depth_preds[i] for i in range(d)]  # depths 1..d: [R, width]
        if verification.depth_preds is not None:
            for row in verification.depth_preds:  # depths d+1..D-1
                preds.append(pad_positions(row, verification.row_index, verification.pos_index, num_reqs, width, -1))
        else:  # none of depths d+1..D-1 read out
            preds.extend(committed_grid.new_full((num_reqs, width), -1) for _ in range(d + 1, self.runner.full_depth))
        target = greedy_ids(verification.logits, verification.rows)
        preds.append(pad_positions(target, verification.row_index, verification.pos_index, num_reqs, width, -1))
        stacked = torch.stack(preds)  # [D, R, width]
        assert stacked.shape[0] == self.runner.full_depth
        return stacked == committed_grid[None]


def _agreement_counts(result: RoundResult, matches: torch.Tensor, trials: list[int], read: Collection[int]) -> None:
    """Fill the result's depth agreement from `matches` [D, R] (per depth, each request's committed positions its
    readout agreed on, the caller's request order; bool where a request committed one) and `trials` (per request,
    its committed positions; none at a depth below full that is not in `read`), with one copy to the host."""
    result.request_matches = matches.T.to(torch.int64).tolist()
    result.request_trials = trials
    result.depth_matches = [sum(column) for column in zip(*result.request_matches)]
    result.depth_trials = depth_trials(sum(trials), len(matches), read)
