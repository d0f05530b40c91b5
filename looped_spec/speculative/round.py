"""One decode round: draft, verify, accept — and the counterfactual depth measurements.

Plain decoding is the K = 0 round: one full-depth forward and a sample per request, with no draft,
verify or acceptance bookkeeping. Nothing here changes request state; the scheduler commits the result.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from looped_spec.model_runner import ModelRunner
from looped_spec.request import Request
from looped_spec.sampler import SamplingRows, sample
from looped_spec.speculative.exit_round import propose_with_exit, verify_with_exit
from looped_spec.speculative.proposer import DraftProposer
from looped_spec.speculative.readouts import read_out_depths
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
    depth_trials: list[int] = field(default_factory=list)
    # early exit: per request, the exit depth of each position from the round's first on (its committed
    # tokens' readout depths); None without early exit
    exit_depths: list[list[int]] | None = None
    # the acceptance the controller learns from (early exit: drafts the target itself drew are left out);
    # None: `num_accepted` out of K
    verified_proposed: list[int] | None = None
    verified_accepted: list[int] | None = None


class SpeculativeRound:
    """Drives proposer -> verifier -> rejection sampler over a batch with ragged K (K >= 0 per request)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.proposer = DraftProposer(runner)
        self.verifier = Verifier(runner)

    def _sync(self) -> None:
        if self.runner.device.type == "cuda":
            torch.cuda.synchronize()

    def run(self, requests: list[Request], k: list[int], d: int, measure_depths: bool = False) -> RoundResult:
        if max(k) == 0:
            return self._plain(requests, measure_depths)
        if any(r.exits_early for r in requests):
            return self._run_with_exit(requests, k, d)
        order = sorted(range(len(requests)), key=lambda i: -k[i])
        reqs = [requests[i] for i in order]
        ks = [k[i] for i in order]
        device = self.runner.device
        rows = SamplingRows.build(reqs, device)

        t0 = time.perf_counter()
        draft = self.proposer.propose(reqs, ks, d, rows, measure_depths)
        self._sync()
        t1 = time.perf_counter()
        verification = self.verifier.verify(reqs, ks, d, draft, measure_depths)
        self._sync()
        t2 = time.perf_counter()
        k_t = torch.tensor(ks, device=device)
        num_accepted, next_token = accept(
            draft.tokens, k_t, verification.logits, verification.row_index, verification.pos_index, rows, draft.q_probs
        )
        committed_grid = torch.cat([draft.tokens, torch.zeros_like(draft.tokens[:, :1])], dim=1)
        committed_grid.scatter_(1, num_accepted[:, None], next_token[:, None])  # [R, K_max + 1]
        acc = num_accepted.tolist()
        grid = committed_grid.tolist()
        committed_sorted = [grid[r][: acc[r] + 1] for r in range(len(reqs))]
        matches: list[int] = []
        trials: list[int] = []
        if measure_depths:
            matches, trials = self._depth_agreement(draft, verification, committed_grid, num_accepted, d)
        t3 = time.perf_counter()

        committed: list[list[int]] = [[] for _ in requests]
        accepted: list[int] = [0] * len(requests)
        for pos, i in enumerate(order):
            committed[i] = committed_sorted[pos]
            accepted[i] = acc[pos]
        return RoundResult(committed, accepted, t1 - t0, t2 - t1, t3 - t2, 0.0, matches, trials)

    def _run_with_exit(self, requests: list[Request], k: list[int], d: int) -> RoundResult:
        """A round whose target is the early-exit model (exit_round.py); no counterfactual depth readouts
        (under early exit a token's depth is the rule's)."""
        order = sorted(range(len(requests)), key=lambda i: -k[i])
        reqs = [requests[i] for i in order]
        ks = [k[i] for i in order]
        device, mode = self.runner.device, self.runner.exit_mode
        rows = SamplingRows.build(reqs, device)
        t0 = time.perf_counter()
        draft, steps = propose_with_exit(self.runner, reqs, ks, d, rows, mode)
        self._sync()
        t1 = time.perf_counter()
        verification = verify_with_exit(self.runner, reqs, ks, d, steps, mode)
        self._sync()
        t2 = time.perf_counter()
        k_t = torch.tensor(ks, device=device)
        row_index = torch.repeat_interleave(torch.arange(len(reqs)), torch.tensor(ks) + 1).to(device)
        pos_index = torch.cat([torch.arange(kr + 1) for kr in ks]).to(device)
        decided = verification.decided[:, : max(ks)]
        num_accepted, next_token = accept(
            draft.tokens, k_t, verification.logits, row_index, pos_index, rows, draft.q_probs, decided=decided
        )
        committed_grid = torch.cat([draft.tokens, torch.zeros_like(draft.tokens[:, :1])], dim=1)
        committed_grid.scatter_(1, num_accepted[:, None], next_token[:, None])  # [R, K_max + 1]
        acc = num_accepted.tolist()
        grid = committed_grid.tolist()
        decided_list = decided.tolist()
        t3 = time.perf_counter()
        committed: list[list[int]] = [[] for _ in requests]
        accepted = [0] * len(requests)
        exit_depths: list[list[int]] = [[] for _ in requests]
        proposed_v = [0] * len(requests)
        accepted_v = [0] * len(requests)
        for pos, i in enumerate(order):
            a, kr = acc[pos], ks[pos]
            committed[i] = grid[pos][: a + 1]
            accepted[i] = a
            exit_depths[i] = verification.exit_depths[pos][: a + 1]
            verified = [not x for x in decided_list[pos][:kr]]  # draft token j+1 was checked against the target
            proposed_v[i] = sum(verified)
            accepted_v[i] = sum(verified[:a])
        return RoundResult(
            committed, accepted, t1 - t0, t2 - t1, t3 - t2, exit_depths=exit_depths,
            verified_proposed=proposed_v, verified_accepted=accepted_v,
        )  # fmt: skip

    @torch.inference_mode()
    def _plain(self, requests: list[Request], measure_depths: bool) -> RoundResult:
        """K = 0: plain full-depth decoding and a sample per request."""
        t0 = time.perf_counter()
        full_depth = self.runner.full_depth
        depth_preds = None
        exit_depths = None
        # counterfactual depths are measured on full-depth rounds only (under early exit the depth is the rule's)
        if measure_depths and full_depth > 1 and not any(r.exits_early for r in requests):
            inp = self.runner.decode_input(requests, keep_states=True)
            preds, logits = read_out_depths(self.runner, inp, self.runner.run(inp))
            depth_preds = torch.stack(preds)  # [D - 1, R]: depths 1..D-1
        else:
            logits, exit_depths = self.runner.decode_with_depths(requests)
        sampled = sample(logits, SamplingRows.build(requests, self.runner.device))
        matches: list[int] = []
        trials: list[int] = []
        if depth_preds is not None:  # how often each shallower depth would have drafted the committed token
            # depth D: the greedy full-depth readout, which a sampled request's committed token need not be
            full = (logits.argmax(-1) == sampled).sum()
            matches = torch.cat([(depth_preds == sampled[None]).sum(dim=1), full[None]]).tolist()
            trials = [len(requests)] * full_depth
        committed = [[t] for t in sampled.tolist()]
        decode_time = time.perf_counter() - t0
        accepted = [0] * len(requests)
        return RoundResult(
            committed,
            accepted,
            decode_time=decode_time,
            depth_matches=matches,
            depth_trials=trials,
            exit_depths=[[e] for e in exit_depths] if exit_depths is not None else None,
        )

    def _depth_agreement(self, draft, verification, committed_grid, num_accepted, d):
        """Greedy agreement of each depth's readout with the committed token, on committed positions."""
        num_reqs, width = committed_grid.shape
        full_depth = self.runner.full_depth
        preds = [draft.depth_preds[i] for i in range(d)]  # depths 1..d: [R, width]
        if verification.depth_preds is not None:
            for row in verification.depth_preds:  # depths d+1..D-1
                preds.append(pad_positions(row, verification.row_index, verification.pos_index, num_reqs, width, -1))
        target = verification.logits.argmax(-1)
        preds.append(pad_positions(target, verification.row_index, verification.pos_index, num_reqs, width, -1))
        valid = torch.arange(width, device=committed_grid.device)[None, :] <= num_accepted[:, None]
        stacked = torch.stack(preds)  # [D, R, width]
        hits = ((stacked == committed_grid[None]) & valid[None]).sum(dim=(1, 2))
        trials = int(valid.sum())
        assert stacked.shape[0] == full_depth
        return hits.tolist(), [trials] * full_depth
