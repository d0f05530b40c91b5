"""The goodput policy (`policy="goodput"`, the default): pick the plan with the highest predicted tokens/s.

For every option of a bucket (its preset candidates, plus plain decoding when Phase 2 is enabled and the
list has no K=0 candidate) it predicts, at the round's actual batch size B,

    goodput(K, d, B) = B · E[committed tokens per request per round] / T(K, d, B)

(docs/adaptive.md "goodput policy"). The two factors come from different kinds of knowledge:
- E, the acceptance side, is a property of the model and the text. It is the Markov-chain expectation of
  `acceptance.markov_tokens` with α_d learned online from counterfactual depth agreement (`depth_matches /
  depth_trials`, all depths at once, measured in the rounds `MeasureSchedule` picks, plain rounds included), starting
  from the preset's offline α_d as a prior worth `prior_trials` positions, and the preset's persistence ρ_d,
  corrected by what the plans committed on this text (control/realized.py): per depth, the chain's error on the
  accepted tokens of every plan that ran at that depth (pooled over depths for a depth not run); per plan that
  has run, its own committed tokens against that expectation as a prior.
- T, the cost side, is a property of the hardware: the preset's measured `CostProfile` when it has one,
  at the round's batch size and, when the profile has context terms, at the batch's mean context (passed
  by the engine through `select`; round cost grows with the context, plain and speculative rounds at
  different rates). Then no exploration is needed: every option is predicted from the start and the first
  plan is already the best predicted one. Online timing refines the profile only where it is robust: once
  an option has run `CORRECTION_MIN_ROUNDS` full-shape rounds (no counterfactual readouts, every request
  drafting K), its predicted round time is scaled by the median of measured ÷ predicted over its last
  `CORRECTION_WINDOW` such rounds — a ratio at the round's own batch size, so timings of different batch
  sizes are never compared, and per bucket; options not run yet are scaled like plain decoding (the
  fallback, so the reference of how fast this machine runs now against the profile), or by the median of
  the known factors before plain has run. An option never measured in a bucket whose corrected prediction
  reaches `TRIAL_WITHIN` of the best gets one trial of `CORRECTION_MIN_ROUNDS` + 2 rounds, so a plan
  the profile over-prices is found as well as one it under-prices is left. This refinement is off by
  default (`refine_cost=True` turns it on): measured on this project's shared 2-core machine, timing noise
  between rounds of different options (±10–30 %) moved plans more often than profile errors did.
  Without a profile (e.g. the generic preset) T is a `RoundCostModel` fitted online per bucket from
  measured phase times, which needs each option to be tried: each bucket first runs every option
  `explore_rounds` times round-robin and re-runs the others predicted within `REEXPLORE_WITHIN` of the best
  once every `reexplore_every` rounds — a gap
  that doubles (up to `REEXPLORE_BACKOFF` times) each time a re-exploration leaves the plan as it was, so a
  bucket where nothing beats plain decoding (the random-weight fixture) stops paying for re-runs.

With a profile, plans near plain decoding are also checked against it side by side: every 16th round starts a
plain probe (two plain rounds, the first an untimed lead-in), and the plan's next round prices its cost error
against plain at one moment (control/probes.py: the median of its pairs, under a prior that trusts the profile
within a few %).
Beyond that band a plan's rivals (speculative options predicted near it) are priced against it the same way: a
round of the rival in place of the plan's, paired with the plan's next round (rival probes).
A speculative option predicted near the best eligible one but without such evidence of its own (its tokens,
its probe pairs) is put on an evidence trial, spaced so trials take at most ~5 % of a bucket's rounds; with
evidence its margin over plain is EVIDENCE_MARGIN instead of `plain_margin` (docs/adaptive.md "Evidence trials").

When no request waits (the engine passes the running requests' budgets left) and the preset measured the
text-to-text spread of acceptance, every option's price is scaled by the time to drain the batch
(control/drain.py): speculation spreads requests of one batch apart, and a batch nobody refills runs short.

Without counterfactual measurements (``measure_depths=False``) the planned depth's α is estimated from the
rounds themselves (successes ΣA over trials ΣA + #(requests rejected before K_actual)).
Acceptance is shared by all buckets (it does not depend on the batch size). A switch needs the best option
to beat the current one by more than `hysteresis` (relative), or by `plain_margin` to leave plain decoding
(a wrong speculative plan costs more than a missed small gain): a speculative option is eligible only while its
prediction beats plain decoding's by `plain_margin`, whichever plan runs. Checked every max(`interval`,
`MIN_DECISION_GAP`) rounds of a bucket once `DECISION_POSITIONS` positions were committed since (not waiting
for them while acceptance is young) and, where a decision is dear (drain pricing), no more often than it costs
`DECISION_BUDGET` of the round time, and at once when the batch size moves by an eighth of the last decided
one (at least 1): acceptance estimates move slowly (they remember ~400 positions), and deciding every round
cost tiny models 2–3 % of a round — as did re-deciding on every request that finished in a static batch's
tail, where each decision prices every option's drain.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from looped_spec.control.acceptance import markov_tokens
from looped_spec.control.buckets import CompiledBucket
from looped_spec.control.costmodel import RoundCostModel
from looped_spec.control.costprofile import CostProfile
from looped_spec.control.drain import drain_factor, request_rates, slices
from looped_spec.control.exits import ExitDepths
from looped_spec.control.plan import RoundFeedback
from looped_spec.control.policy import Policy
from looped_spec.control.probes import (
    PROBE_BAND,
    PROBE_MIN,
    PROBE_WINDOW,
    PROBE_Z,
    RIVAL_FROM,
    CostProbes,
    rival_every,
)
from looped_spec.control.realized import RealizedTokens
from looped_spec.control.schema import AcceptanceConfig, CostConfig, DisableConfig


def ran_k(fb: RoundFeedback) -> int:
    """The K a round ran with: 0 when nothing was drafted (it ran as plain decoding)."""
    return fb.k if sum(fb.num_proposed) else 0


def expected_tokens(alpha: float, k: int) -> float:
    """Expected committed tokens per request per round: (1 − α^{K+1}) / (1 − α) (geometric acceptance)."""
    if k <= 0:
        return 1.0
    if alpha >= 1.0 - 1e-12:
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_accept_rate(alpha: float, k: int) -> float:
    """Expected ΣA/ΣK of a round (what the EMA policy measures): (E[tokens] − 1) / K."""
    return (expected_tokens(alpha, k) - 1.0) / k if k > 0 else 0.0


class DepthAcceptance:
    """Acceptance α_d per draft depth d = 1..D from discounted match/trial counts.

    Counts are discounted per observation by memory / (memory + new trials), so the estimate remembers
    roughly the last `memory` trials of each depth whatever the batch size.
    """

    __slots__ = ("matches", "trials", "memory", "from_rounds", "positions")

    def __init__(
        self,
        full_depth: int,
        memory: float = 1000.0,
        prior: list[float] | None = None,
        prior_trials: float = 0.0,
        from_rounds: bool = True,
    ) -> None:
        prior = prior or [0.0] * full_depth
        self.matches = [a * prior_trials for a in prior]  # [D]
        self.trials = [prior_trials] * full_depth  # [D]
        self.memory = memory
        self.from_rounds = from_rounds  # estimate the planned depth from rounds without counterfactuals
        self.positions = 0  # positions measured so far (not discounted, prior excluded)

    def _add(self, j: int, matches: float, trials: float) -> None:
        g = self.memory / (self.memory + trials)
        self.matches[j] = g * self.matches[j] + matches
        self.trials[j] = g * self.trials[j] + trials

    def observe(self, fb: RoundFeedback) -> None:
        if fb.depth_trials:
            self.positions += max(fb.depth_trials)
            for j in range(min(len(self.trials), len(fb.depth_trials))):
                if fb.depth_trials[j]:
                    self._add(j, fb.depth_matches[j], fb.depth_trials[j])
        # rounds with early exit take no counterfactual readouts: their verified drafts are the measurement
        elif (self.from_rounds or fb.exit_depths) and fb.k > 0 and 1 <= fb.d <= len(self.trials):
            accepted = sum(fb.num_accepted)
            rejected = sum(1 for a, k in zip(fb.num_accepted, fb.num_proposed) if a < k)
            if accepted + rejected:
                self.positions += accepted + rejected
                self._add(fb.d - 1, accepted, accepted + rejected)

    def alpha(self, d: int) -> float | None:
        """Estimated α at depth d, or None without data."""
        t = self.trials[d - 1]
        return self.matches[d - 1] / t if t > 0.0 else None


@dataclass(slots=True)
class GoodputState:
    """One bucket of the goodput policy."""

    index: int  # bucket index
    options: list[tuple[int, int, int]]  # [O] (k, d, preset candidate index or -1 for Phase 2 plain)
    current: int  # option index in use; -1 until the first decision (profiled presets)
    queue: list[int]  # options still to explore (popped from the end)
    cost: RoundCostModel | None  # online fit; None when the preset's cost profile is used
    rounds: int = 0
    next_decision: int = 0
    decided_batch: int = 0  # batch size of the last decision
    paid_round: int = 0  # `rounds` from which the last decision has cost at most DECISION_BUDGET of the rounds since
    decided_positions: float = 0.0  # the policy's `committed` at the last decision
    next_reexplore: int = 0
    reexplore_gap: int = 0  # rounds until the next re-exploration (doubles while re-runs change nothing)
    reexplored_from: int = -1  # the plan in use when the last re-exploration started
    switches: int = 0
    predicted: list[float] | None = None  # [O] tokens/s at the last decision
    trial: int = -1  # option on trial (profiled presets: its cost, or evidence of a near plan), -1: none
    trial_left: int = 0  # rounds of the trial still to run at most
    trial_evidence: bool = False  # the trial ends as soon as the option has evidence (`_has_evidence`)
    tried: set[int] = field(default_factory=set)  # options whose cost trial has run
    evidence_tried: dict[int, float] = field(default_factory=dict)  # option -> `committed` when its trial ended
    trial_started: int = 0  # `rounds` when the evidence trial began
    next_trial: int = 0  # no evidence trial before this many rounds of the bucket
    decide_now: bool = False  # decide at the next round whatever the schedule (an evidence trial just ended)
    exits: ExitDepths | None = None  # early exit: exit depths of this bucket's committed tokens (control/exits.py)
    drained: bool = False  # the last decision priced the options by draining the running requests
    decide_seconds: float = 0.0  # wall time of the bucket's last decision (its own cost: DECISION_BUDGET)
    round_seconds: float = 0.0  # wall time of the bucket's last round that reported one
    plain: int = -1  # index of the (first) plain option, -1 without one (Phase 2 off)
    far: bool = False  # at the last decision: plain in use, every speculative option under READOUTS_FAR_FROM of it


#: Rounds between two decisions of a bucket at least (a preset's `interval` may ask for more) ...
MIN_DECISION_GAP = 8
#: ... and, once acceptance is no longer young, positions committed (all buckets) since its last decision: the
#: estimates remember ~400 positions, so a single plain stream re-deciding every 8 rounds priced every option
#: again for 8 new positions (~5 µs a round on the fixture, 0.3 % of its round).
DECISION_POSITIONS = 32
#: ... and at least so many rounds that deciding costs at most this share of the bucket's round time (up to
#: MAX_DECISION_GAP rounds): pricing eight options by draining a static batch took ~0.7 ms on tiny-ouro at B = 8,
#: 2.4 % of its 5 ms rounds when deciding every 8th.
DECISION_BUDGET = 0.005
MAX_DECISION_GAP = 64
#: A bucket's re-exploration gap grows to at most this multiple of `reexplore_every`.
REEXPLORE_BACKOFF = 16
#: A re-exploration re-runs only the options predicted at least this fraction of the best at the last decision
#: (at B = 8 the random-weight fixture re-ran (2, 2), priced at 0.55-0.58x plain, every 256-4096 rounds; at B = 1
#: it re-ran (3, 1) at 0.45-0.47x beside two plans within a few % of plain: `GoodputState.predicted`).
REEXPLORE_WITHIN = 0.8
#: Full-shape rounds an option must have run before its measured cost corrects the profile's prediction.
CORRECTION_MIN_ROUNDS = 8
#: Rounds per option whose measured ÷ predicted cost ratios are kept (the median of these scales T).
CORRECTION_WINDOW = 32
#: Acceptance is young (rounds measure at `MeasureSchedule`'s young budget, 5 % instead of 1 %) for the first
#: YOUNG_ROUNDS rounds the policy sees, or until YOUNG_POSITIONS positions were read out if that comes first:
#: the prior is the tuning text's, ~0.1 off on other texts (tiny-ouro α₁: 0.61 tuned, 0.70 on the eval group).
YOUNG_ROUNDS = 64
YOUNG_POSITIONS = 256
#: An option whose cost was never measured but whose predicted tokens/s is at least this fraction of the best
#: gets one trial of CORRECTION_MIN_ROUNDS + 2 rounds, so a plan the profile over-prices is found too.
TRIAL_WITHIN = 0.75
#: Evidence trials (profiled presets, docs/adaptive.md "Evidence trials"): a speculative option without evidence
#: of its own predicted at least EVIDENCE_TRIAL_FROM of the best eligible option runs until it has evidence -
#: its tokens measured (`RealizedTokens.measured`) and, while within the probes' band of plain, EVIDENCE_PAIRS pairs -
#: or EVIDENCE_TRIAL_ROUNDS rounds; not again before EVIDENCE_TRIAL_GAP positions were committed since, and a
#: bucket's next trial of any option waits EVIDENCE_TRIAL_SPACING times the rounds the last one ran (≤ 5 % of
#: its rounds in trials: tiny-ouro at B = 8 has eight options within 3 % of plain, and tried them one after another).
EVIDENCE_TRIAL_FROM = 0.95
EVIDENCE_TRIAL_ROUNDS = 64
EVIDENCE_TRIAL_GAP = 2000.0
EVIDENCE_TRIAL_SPACING = 20
EVIDENCE_PAIRS = 8
#: An option with evidence is eligible once predicted this much over plain decoding (without: `plain_margin`).
EVIDENCE_MARGIN = 0.02
#: With plain decoding in use and every speculative option predicted under this fraction of it, plain rounds take
#: readouts at the far budget (control/measurement.py: nothing is near a switch). 1.0: no option is even predicted
#: over plain, so none is within the margin it would need to run. Readouts at the 1 % budget cost an adaptive
#: engine running plain 1.3-2 % (2026-12-02, B = 1, rotating prompts, 60-80 interleaved rounds: tiny-nanbeige 0.970x
#: plain with the earlier 0.9 here, 0.986x with 1.0, 0.994x without readouts; tiny-ouro 0.979x, 0.982x, 0.994x).
READOUTS_FAR_FROM = 1.0


class GoodputPolicy(Policy):
    """Model-based choice of (K, d) per bucket maximising predicted committed tokens per second."""

    name = "goodput"

    def __init__(
        self,
        buckets: list[CompiledBucket],
        disable: DisableConfig,
        full_depth: int,
        *,
        acceptance: AcceptanceConfig | None = None,
        cost: CostConfig | None = None,
        measured_depths: bool = True,
        explore_rounds: int = 2,
        hysteresis: float = 0.03,
        plain_margin: float = 0.05,
        refine_cost: bool = False,
        probe_costs: bool = True,
        rival_probes: bool = True,
        undecided_rivals: bool = True,
        reexplore_every: int = 256,
        acceptance_memory: float = 400.0,
        prior_trials: float = 16.0,
        cost_decay: float = 0.995,
        prior_alpha: float = 0.5,
    ) -> None:
        self.buckets = buckets
        self.full_depth = full_depth
        self.hysteresis = hysteresis
        self.plain_margin = plain_margin
        self.refine_cost = refine_cost
        self.prior_alpha = prior_alpha
        prior = list(acceptance.alpha) if acceptance is not None else None
        self.acceptance = DepthAcceptance(
            full_depth, acceptance_memory, prior, prior_trials if prior else 0.0, from_rounds=not measured_depths
        )
        self.rho = list(acceptance.rho) if acceptance is not None else [0.0] * full_depth  # [D]
        # [D] text-to-text spread of agreement; with a cost profile it prices plans by draining (control/drain.py)
        self.spread = list(acceptance.spread) if acceptance is not None and acceptance.spread is not None else None
        self._cost_tables: dict[tuple[int, int], np.ndarray] = {}  # (k, d) -> [n] profile seconds, n = 0..
        self.realized = RealizedTokens()  # what the plans that ran committed on this text (control/realized.py)
        self.profile = CostProfile(full_depth, **cost.model_dump()) if cost else None
        self.context: float | None = None  # mean context of the round last planned (prices its feedback)
        self.rounds_seen = 0  # rounds observed (the young phase: `acceptance_young`)
        self.committed = 0.0  # positions committed in the rounds observed (decision spacing)
        self.reexplore_every = 0 if self.profile is not None else reexplore_every
        self.cost_ratios: dict[tuple[int, int, int], deque[float]] = {}  # (bucket, k, d) -> measured / profile
        # plain probes: a plan's cost against plain decoding's, side by side (control/probes.py)
        self.probes = CostProbes(len(buckets)) if self.profile is not None and probe_costs else None
        self.rival_probes = rival_probes  # beyond the probes' band, rivals priced against the plan in use
        self.undecided_rivals = undecided_rivals  # a rival priced over the plan in use is probed until it is decided
        self.readouts_far_from = READOUTS_FAR_FROM  # plain in use, every option under this share of it: far readouts
        self.states: list[GoodputState] = []
        for b in buckets:
            options = [(k, d, j) for j, (k, d) in enumerate(zip(b.ks, b.ds))]
            if disable.enabled and not b.has_plain:
                options.insert(0, (0, 0, -1))
            if self.profile is not None:  # predicted from the start: no exploration, first plan = best predicted
                st = GoodputState(len(self.states), options, -1, [], None)
            else:
                current = next(o for o, opt in enumerate(options) if opt[2] == b.config.initial_index)
                queue = list(range(len(options))) * explore_rounds
                queue.reverse()
                st = GoodputState(len(self.states), options, current, queue, RoundCostModel(full_depth, cost_decay))
                st.next_reexplore = st.reexplore_gap = reexplore_every
            st.exits = ExitDepths(full_depth)
            st.plain = next((o for o, opt in enumerate(options) if opt[0] == 0), -1)
            self.states.append(st)

    @property
    def acceptance_young(self) -> bool:
        """Whether acceptance is young: fewer than `YOUNG_ROUNDS` rounds seen and `YOUNG_POSITIONS` positions
        read out (measure more)."""
        return self.rounds_seen < YOUNG_ROUNDS and self.acceptance.positions < YOUNG_POSITIONS

    @property
    def prices_draining(self) -> bool:
        """Whether budgets left change prices: a measured acceptance spread and a cost profile."""
        return self.spread is not None and self.profile is not None

    def select(
        self,
        bucket: int,
        batch_size: int,
        plan_id: int,
        context: float | None = None,
        remaining: Sequence[int] | None = None,
    ) -> tuple[int, int, int]:
        st = self.states[bucket]
        self.last_event = None
        self.context = context
        st.rounds += 1
        if st.queue:
            return st.options[st.queue.pop()]
        if st.trial >= 0:
            if st.trial_left > 0 and not (st.trial_evidence and self._has_evidence(st, st.trial, own=True)):
                st.trial_left -= 1  # a cost trial times the option itself; an evidence trial probes it eagerly
                return self._probe_or(st, st.trial, plan_id, True) if st.trial_evidence else st.options[st.trial]
            self._end_trial(st)
        if st.decide_now or self._decision_due(st, batch_size):
            st.decide_now = False
            st.decided_batch = batch_size
            st.decided_positions = self.committed
            start = perf_counter()
            self._decide(st, max(batch_size, 1), context, remaining)
            st.decide_seconds = perf_counter() - start
            paying = 1
            if st.round_seconds > 0.0:  # rounds whose time the decision may cost DECISION_BUDGET of
                paying = min(
                    MAX_DECISION_GAP, max(1, math.ceil(st.decide_seconds / (DECISION_BUDGET * st.round_seconds) - 1e-9))
                )
            st.paid_round = st.rounds + paying
            st.next_decision = st.rounds + max(self.buckets[bucket].config.interval, MIN_DECISION_GAP, paying)
        if self.reexplore_every and st.rounds >= st.next_reexplore:
            unchanged = st.reexplored_from == st.current
            base = self.reexplore_every
            st.reexplore_gap = min(2 * st.reexplore_gap, REEXPLORE_BACKOFF * base) if unchanged else base
            st.reexplored_from = st.current
            st.next_reexplore = st.rounds + st.reexplore_gap
            st.queue = self._rerun_options(st)
        return self._probe_or(st, st.current, plan_id)  # a trial the decision started runs from the next round

    def quiet_rounds(self, bucket: int, batch_size: int, choice: tuple[int, int, int]) -> int:
        """Rounds `select` is sure to answer with `choice`, the option in use, and only its counters (`repeat`).

        None after another option (a probe, an exploration's last run), while exploring, on trial, young
        (observed rounds move the young bar) or refining costs (observe reads the round's context); else until
        the earliest round a decision, re-exploration or probe may fall due. A decision waits for
        DECISION_POSITIONS committed positions, and a round of B requests commits at most B·(K+1), so the
        positions bound how soon it can come whatever the feedback (docs/adaptive.md "Quiet rounds").
        """
        st = self.states[bucket]
        if st.queue or st.trial >= 0 or st.decide_now or st.current < 0 or self.acceptance_young or self.refine_cost:
            return 0
        if choice != st.options[st.current]:
            return 0
        probes = self.probes
        if probes is not None and not probes.idle(bucket):
            return 0
        k, d, _ = choice
        quiet = st.next_decision - 1 - st.rounds
        deficit = DECISION_POSITIONS - (self.committed - st.decided_positions)
        if deficit > 0:
            quiet = max(quiet, math.ceil(deficit / (max(batch_size, 1) * (k + 1))) - 1)
        if abs(batch_size - st.decided_batch) >= max(1, st.decided_batch // 8):
            quiet = min(quiet, st.paid_round - 1 - st.rounds)
        if self.reexplore_every:
            quiet = min(quiet, st.next_reexplore - 1 - st.rounds)
        if self._probed(st, choice):
            rates = st.predicted
            rival = self._rival(st, st.current)
            if rival >= 0:
                quiet = min(quiet, probes.rival_quiet_rounds(bucket, self._rival_every(st, st.current, rival)))
            else:
                quiet = min(quiet, probes.quiet_rounds(bucket, k, d, rates[st.current], rates[st.plain]))
        return max(quiet, 0)

    def repeat(self, bucket: int, context: float | None = None) -> tuple[int, int, int]:
        st = self.states[bucket]
        self.context = context
        st.rounds += 1
        choice = st.options[st.current]
        if self._probed(st, choice):
            self.probes.since[bucket] += 1  # what `CostProbes.due` counts when no probe is due
        return choice

    def _rerun_options(self, st: GoodputState) -> list[int]:
        """The options a re-exploration re-runs: all but the current one whose prediction at the last decision
        reaches REEXPLORE_WITHIN of the best. An option's cost was timed in the exploration, and its acceptance
        is read out every measured round whichever plan runs, so an option priced far below the best is not one
        a fresher timing would pick; a text on which it pays raises its prediction into the band first."""
        rates = st.predicted
        floor = REEXPLORE_WITHIN * max(rates) if rates is not None else -math.inf
        return [o for o in range(len(st.options)) if o != st.current and (rates is None or rates[o] >= floor)]

    def _decision_due(self, st: GoodputState, batch_size: int) -> bool:
        """The bucket's periodic decision is due (rounds, and positions once acceptance is no longer young), or
        the batch moved by an eighth of the last decided size (at least 1) and the last decision is paid for
        (DECISION_BUDGET): a static batch of 8 loses a request every few rounds in its tail, and re-pricing
        every option's drain at each loss took ~60 µs a round of tiny-nanbeige's 5 ms (1 %)."""
        if st.rounds >= st.paid_round and abs(batch_size - st.decided_batch) >= max(1, st.decided_batch // 8):
            return True
        if st.rounds < st.next_decision:
            return False
        return self.committed - st.decided_positions >= DECISION_POSITIONS or self.acceptance_young

    def _end_trial(self, st: GoodputState) -> None:
        """The trial ran its rounds (or an evidence trial has its evidence): an evidence trial is stamped, spaces
        the bucket's next one and has the bucket decide at once, on the evidence."""
        if st.trial_evidence:
            st.evidence_tried[st.trial] = self.committed
            st.next_trial = st.rounds + EVIDENCE_TRIAL_SPACING * (st.rounds - st.trial_started)
            st.decide_now = True
        st.trial = -1

    def _probed(self, st: GoodputState, choice: tuple[int, int, int]) -> bool:
        """Whether running `choice` counts towards a plain probe (`CostProbes.due`): a speculative plan, priced,
        in a bucket with a plain option."""
        return self.probes is not None and choice[0] > 0 and st.predicted is not None and st.plain >= 0

    def _probe_or(self, st: GoodputState, option: int, plan_id: int, eager: bool = False) -> tuple[int, int, int]:
        """The option to run, or plain decoding when a probe of it is due, or a rival of the plan in use when a
        rival probe is due (control/probes.py; `eager`: every PROBE_EVERY_NEW rounds until the plan has evidence). A
        round no probe counts drops a probe waiting for its next round (`CostProbes.interrupt`)."""
        choice = st.options[option]
        if not self._probed(st, choice):
            if self.probes is not None:
                self.probes.interrupt(st.index)
            return choice
        rates = st.predicted
        k, d, _ = choice
        rival = self._rival(st, option) if not eager else -1
        if rival >= 0:
            if self.probes.due_rival(st.index, plan_id, self._rival_every(st, option, rival)):
                return st.options[rival]
        elif self.probes.due(st.index, plan_id, k, d, rates[option], rates[st.plain], eager):
            return st.options[st.plain]
        return choice

    def _rival(self, st: GoodputState, option: int) -> int:
        """The rival a rival probe of the plan in use `option` would run, or -1 (control/probes.py): with the plan
        beyond PROBE_BAND over plain, the speculative options beyond it too, predicted at RIVAL_FROM of the plan or
        more; the fastest predicted with fewer than PROBE_MIN pairs or undecided (`_undecided`), else the one with
        the fewest pairs. None while acceptance is young: readouts come first, and the prices that pick a rival
        rest on the prior."""
        rates = st.predicted
        if not self.rival_probes or option != st.current or rates is None or st.plain < 0 or self.acceptance_young:
            return -1
        band = rates[st.plain] * (1.0 + PROBE_BAND)
        if rates[option] <= band:
            return -1
        floor = max(band, RIVAL_FROM * rates[option])
        best, best_key = -1, None
        for o, (k, d, _) in enumerate(st.options):
            if k <= 0 or o == option or rates[o] < floor:
                continue
            pairs = self.probes.rival_pairs(st.index, k, d)
            wants = pairs < PROBE_MIN or self._undecided(st, option, o, pairs)
            key = (not wants, 0 if wants else pairs, -rates[o])
            if best_key is None or key < best_key:
                best, best_key = o, key
        return best

    def _rival_every(self, st: GoodputState, option: int, rival: int) -> int:
        """Rounds between rival probes of `rival` while `option` runs (`probes.rival_every`)."""
        rates = st.predicted
        k, d, _ = st.options[rival]
        pairs = self.probes.rival_pairs(st.index, k, d)
        return rival_every(1.0 - rates[rival] / rates[option], pairs, self._undecided(st, option, rival, pairs))

    def _undecided(self, st: GoodputState, option: int, rival: int, pairs: int) -> bool:
        """A rival its pairs price over the plan in use `option` that has not replaced it (the decisions' error bar,
        `_bar`, was too wide for its pairs) and has fewer than PROBE_WINDOW rival pairs: more pairs decide it. On
        tiny-huginn at B = 1 (2026-12-02) (5, 2) was priced 7 % over (4, 2) in use with four pairs, a bar of 9 %, and
        measured 1.82x plain against (4, 2)'s 1.73x, while one more pair came every RIVAL_EVERY rounds."""
        return self.undecided_rivals and st.predicted[rival] > st.predicted[option] and pairs < PROBE_WINDOW

    @property
    def probe_prior(self) -> bool:
        """Whether probe factors are pulled towards the profile (control/probes.py `shrunk`); an A/B switch."""
        return self.probes is not None and self.probes.prior

    @probe_prior.setter
    def probe_prior(self, on: bool) -> None:
        if self.probes is not None:
            self.probes.prior = on

    def times_round(self, bucket: int, plan_id: int) -> bool:
        return self.probes is not None and self.probes.wants(bucket, plan_id)

    def readouts_far(self, bucket: int) -> bool:
        return self.states[bucket].far

    def _has_evidence(self, st: GoodputState, option: int, own: bool = False) -> bool:
        """Whether a speculative option's tokens are measured (its own REALIZED_MIN full-K request-rounds, or - unless
        `own` - its depth's error on BIAS_PRIOR expected tokens: `RealizedTokens.measured`) and, where plain probes
        price it (within their band of plain), it has EVIDENCE_PAIRS probe pairs."""
        k, d, _ = st.options[option]
        if k <= 0 or not self.realized.measured(k, d, own):
            return False
        probes, rates = self.probes, st.predicted
        if probes is None or rates is None or st.plain < 0 or rates[option] > rates[st.plain] * (1.0 + PROBE_BAND):
            return True
        return probes.pairs(st.index, k, d) >= EVIDENCE_PAIRS

    def _decide(
        self, st: GoodputState, batch_size: int, context: float | None = None, remaining: Sequence[int] | None = None
    ) -> None:
        rates = self.rates(st, batch_size, context, remaining)
        st.predicted = rates
        eligible = self._eligible(st, rates)
        best = max(eligible, key=rates.__getitem__)
        if st.current < 0:
            st.current = best
            k, d, _ = st.options[best]
            self.last_event = f"start at k={k} d={d} ({rates[best]:.4g} tok/s predicted)"
        elif best != st.current and (
            st.current not in eligible or rates[best] > rates[st.current] * self._bar(st, best)
        ):
            k, d, _ = st.options[best]
            self.last_event = f"switch to k={k} d={d} ({rates[best]:.4g} tok/s vs {rates[st.current]:.4g})"
            st.current = best
            st.switches += 1
        st.far = st.options[st.current][0] == 0 and all(
            rates[o] < self.readouts_far_from * rates[st.current] for o, (k, _, _) in enumerate(st.options) if k > 0
        )
        if st.cost is None and self.refine_cost:
            self._maybe_trial(st, rates)
        if st.cost is None and st.trial < 0 and st.rounds >= st.next_trial and not self.acceptance_young:
            self._maybe_evidence_trial(st, rates, eligible)

    def _bar(self, st: GoodputState, option: int) -> float:
        """How many times the plan in use's price `option` must reach to replace it: 1 + `hysteresis`, or more where
        its probes priced it, by PROBE_Z standard errors of their median (a rival's few pairs on a noisy machine)."""
        margin = self.hysteresis
        if self.probes is not None:
            k, d, _ = st.options[option]
            margin = max(margin, PROBE_Z * self.probes.error(st.index, k, d))
        return 1.0 + margin

    def _maybe_evidence_trial(self, st: GoodputState, rates: list[float], eligible: list[int]) -> None:
        """Put the most promising speculative option without evidence on trial if it is predicted near the best
        eligible option: a prediction within the margin cannot tell a plan 4 % faster than plain from one 2 %
        slower, and only the plan's own rounds and probes can (docs/adaptive.md "Evidence trials"). While plain
        decoding runs, evidence means the option's own tokens: its depth's error was learned from other plans, and
        plain rounds add none (tiny-ouro at B = 1: every plan priced 1.02-1.07x plain on such evidence and the
        bucket ran plain for eight generations, where (2, 2) measures 1.09-1.13x)."""
        top = max(rates[o] for o in eligible)
        own = st.options[st.current][0] == 0
        for o in sorted(range(len(rates)), key=rates.__getitem__, reverse=True):
            if rates[o] < EVIDENCE_TRIAL_FROM * top:
                return
            k, d, _ = st.options[o]
            if k <= 0 or o == st.current or self._has_evidence(st, o, own):
                continue
            if self.committed - st.evidence_tried.get(o, -EVIDENCE_TRIAL_GAP) < EVIDENCE_TRIAL_GAP:
                continue
            st.trial, st.trial_left, st.trial_evidence = o, EVIDENCE_TRIAL_ROUNDS, True
            st.trial_started = st.rounds
            self.last_event = f"evidence trial of k={k} d={d} ({rates[o]:.4g} tok/s predicted vs best {top:.4g})"
            return

    def _eligible(self, st: GoodputState, rates: list[float]) -> list[int]:
        """Options that may run: plain, and speculative ones predicted to beat plain by `plain_margin`
        (`EVIDENCE_MARGIN` for an option with evidence of its own, `_has_evidence`).

        A wrong speculative plan costs more than a missed small gain, so every speculative option - not just
        the first step away from plain - must clear the margin over plain decoding, and a plan its probes price
        (control/probes.py) PROBE_Z standard errors of their median if that is more; the option in use keeps
        its place down to the margin less `hysteresis`, so a prediction hovering at the bar does not flip.
        Without a plain option (Phase 2 off) every option is eligible.
        """
        if st.plain < 0:
            return list(range(len(rates)))
        plain = rates[st.plain]
        probes = self.probes
        out = []
        for o, (k, d, _) in enumerate(st.options):
            if k == 0:
                out.append(o)
                continue
            margin = EVIDENCE_MARGIN if self._has_evidence(st, o) else self.plain_margin
            if probes is not None:  # a price its probes moved is only as good as their median
                margin = max(margin, PROBE_Z * probes.error(st.index, k, d))
            bar = plain * (1.0 + margin) * (1.0 - (self.hysteresis if o == st.current else 0.0))
            if rates[o] > max(bar, plain):  # a plan in use keeps its place only while predicted over plain
                out.append(o)
        return out

    def _maybe_trial(self, st: GoodputState, rates: list[float]) -> None:
        """Run the most promising option whose cost was never measured here, if it is near the best."""
        measured = self.cost_factors(st.index)
        top = max(rates)
        for o in sorted(range(len(rates)), key=rates.__getitem__, reverse=True):
            k, d, _ = st.options[o]
            if rates[o] < TRIAL_WITHIN * top:
                return
            if o == st.current or o in st.tried or (k, d if k else 0) in measured:
                continue
            st.tried.add(o)
            st.trial, st.trial_left, st.trial_evidence = o, CORRECTION_MIN_ROUNDS + 2, False
            self.last_event = f"cost trial of k={k} d={d} ({rates[o]:.4g} tok/s predicted vs best {top:.4g})"
            return

    def tokens(self, k: int, d: int, exits: ExitDepths | None = None) -> float:
        """Expected committed tokens per request per round of (K, d) under the current acceptance estimate,
        corrected by what the plans committed on this text (control/realized.py; with early exit, drafts that
        exit within d always pass: `ExitDepths.effective_alpha`, and the Markov expectation is used as is)."""
        if k <= 0:
            return 1.0
        expected = markov_tokens(self._alpha(d, exits), self.rho[d - 1], k)
        return expected if exits is not None else self.realized.tokens(k, d, expected)

    def realized_of(self, k: int, d: int) -> tuple[float, float] | None:
        """(committed tokens, request-rounds) of (K, d)'s full-K rounds, discounted; None if it never ran."""
        return self.realized.of(k, d)

    def _alpha(self, d: int, exits: ExitDepths | None) -> float:
        alpha = self.acceptance.alpha(d)
        alpha = self.prior_alpha if alpha is None else alpha
        if exits is not None and exits.seen:
            alpha = exits.effective_alpha(alpha, d)
        return alpha

    def _drain_factor(self, k: int, d: int, tokens: float, remaining: Sequence[int], exits: ExitDepths | None) -> float:
        """Drain-priced ÷ per-round-priced tokens/s of (K, d) for requests with `remaining` budgets."""
        assert self.spread is not None and self.profile is not None
        if k > 0:
            alpha = self._alpha(d, exits)
            rates = request_rates(alpha, self.spread[d - 1], self.rho[d - 1], k, slices(len(remaining)))
            scale = tokens / markov_tokens(alpha, self.rho[d - 1], k)  # realized tokens move every slice alike
            rates = np.minimum(rates * scale, k + 1.0)
        else:
            rates = request_rates(1.0, 0.0, 0.0, 0)
        return drain_factor(remaining, rates, tokens, self._cost_table(k, d, len(remaining)))

    def _cost_table(self, k: int, d: int, batch: int) -> np.ndarray:
        """[≥ batch+1] profile seconds of one (K, d) round with n = 0.. requests (context-free; cached)."""
        key = (k, d if k else 0)
        table = self._cost_tables.get(key)
        if table is None or table.shape[0] <= batch:
            assert self.profile is not None
            size = max(batch + 1, 2 * (table.shape[0] if table is not None else 0))
            table = np.array([0.0] + [self.profile.predict(k, key[1], n) for n in range(1, size)])
            self._cost_tables[key] = table
        return table

    def cost_factors(self, bucket: int) -> dict[tuple[int, int], float]:
        """Median measured ÷ profile round time of every option of `bucket` with enough full-shape rounds."""
        return {
            (k, d): statistics.median(ratios)
            for (b, k, d), ratios in self.cost_ratios.items()
            if b == bucket and len(ratios) >= CORRECTION_MIN_ROUNDS
        }

    def rates(
        self,
        st: GoodputState,
        batch_size: int,
        context: float | None = None,
        remaining: Sequence[int] | None = None,
    ) -> list[float]:
        """Predicted committed tokens/s of every option of a bucket at `batch_size` and mean `context`.

        The context matters only with a context-aware profile; None prices at the tuning runs' contexts.
        `remaining` (the running requests' budgets left, given when nothing waits) prices every option by the
        time to drain them (control/drain.py) when the preset measured the acceptance spread.
        """
        out = []
        if st.cost is None:
            assert self.profile is not None
            factors = self.cost_factors(st.index)
            default = factors.get((0, 0), statistics.median(factors.values()) if factors else 1.0)
            exits = st.exits if st.exits is not None and st.exits.seen else None
            drain = self.prices_draining and remaining is not None and len(remaining) > 1
            st.drained = drain
            tokens = []
            probes = self.probes
            for k, d, _ in st.options:
                seconds = self.profile.predict(k, d, batch_size, context) * factors.get((k, d), default)
                if probes is not None:
                    seconds *= probes.factor(st.index, k, d)
                if exits is not None:  # skip mode: the loops early exit saves
                    seconds *= exits.cost_factor(self.profile, k, d, batch_size, context)
                tokens.append(self.tokens(k, d, exits))
                out.append(batch_size * tokens[-1] / seconds)
            if drain:
                assert remaining is not None
                plain = []
                for o, (k, _, _) in enumerate(st.options):
                    if k == 0:
                        out[o] *= self._drain_factor(0, 0, 1.0, remaining, None)
                        plain.append(out[o])
                # draining does not make a plan cheaper than in lockstep (a round costs no less than its share of a
                # full one): a speculative option under EVIDENCE_TRIAL_FROM of plain's price per round stays under
                # it drained, where it can be neither eligible nor tried, so it is left unpriced. One above it is
                # priced even under the eligibility bar, for a trial's ranking: left at its lockstep price,
                # tiny-ouro's (4, 3) at B = 8 ranked at 1.01x plain for trials where draining it measures 0.89x
                floor = plain[0] * EVIDENCE_TRIAL_FROM if plain else 0.0
                for o, (k, d, _) in enumerate(st.options):
                    if k > 0 and out[o] > floor:
                        out[o] *= self._drain_factor(k, d, tokens[o], remaining, exits)
            return out
        for k, d, _ in st.options:  # the online cost model measures rounds as they run, exits included
            out.append(batch_size * self.tokens(k, d, st.exits) / st.cost.predict(k, d, batch_size))
        return out

    def observe(self, fb: RoundFeedback) -> None:
        self.last_event = None
        self.rounds_seen += 1
        committed = sum(fb.num_accepted) + len(fb.num_accepted)  # positions the round committed
        self.committed += committed
        self.acceptance.observe(fb)
        # the chain's expectation prices the round's full-K tokens; rounds with early exit are not counted
        counted = fb.k > 0 and not fb.exit_depths and 1 <= fb.d <= self.full_depth
        chain = markov_tokens(self._alpha(fb.d, None), self.rho[fb.d - 1], fb.k) if counted else 1.0
        self.realized.observe(fb, committed, chain)
        if self.profile is not None and self.refine_cost:
            self._observe_cost(fb)
        if not 0 <= fb.bucket < len(self.states):
            return
        probes = self.probes
        if probes is not None and probes.wants(fb.bucket, fb.plan_id):
            self._observe_probe(fb)
        st = self.states[fb.bucket]
        if fb.round_time > 0.0:
            st.round_seconds = fb.round_time
        if fb.exit_depths and st.exits is not None:
            st.exits.observe(fb.exit_depths, fb.exit_skips)
        if st.cost is not None:
            st.cost.observe(ran_k(fb), fb.d, fb.batch_size, fb.draft_time, fb.full_depth_time, fb.commit_time)

    def _observe_probe(self, fb: RoundFeedback) -> None:
        """Measured ÷ profile seconds of the round, for the plain probes (control/probes.py)."""
        assert self.probes is not None and self.profile is not None
        k = ran_k(fb)
        d = fb.d if k else 0
        full_shape = fb.round_time > 0.0 and not fb.depth_trials and not fb.exit_depths
        full_shape = full_shape and all(p == k for p in fb.num_proposed)
        # the engine runs one round at a time, so the feedback is of the round planned last, at `self.context`
        predicted = self.profile.predict(k, d, fb.batch_size, self.context)
        self.probes.observe(fb.bucket, fb.plan_id, k, d, fb.batch_size, fb.round_time / predicted, full_shape)

    def _observe_cost(self, fb: RoundFeedback) -> None:
        """Keep measured ÷ predicted round time of full-shape rounds without counterfactual readouts."""
        assert self.profile is not None
        seconds = fb.draft_time + fb.full_depth_time + fb.commit_time
        if fb.depth_trials or seconds <= 0.0 or fb.batch_size <= 0:
            return
        k = fb.k if all(p == fb.k for p in fb.num_proposed) else -1
        if k < 0:
            return  # some requests drafted fewer tokens (near max_tokens): not the plan's shape
        if not 0 <= fb.bucket < len(self.states):
            return
        key = (fb.bucket, k, fb.d if k else 0)
        ratios = self.cost_ratios.get(key)
        if ratios is None:
            ratios = self.cost_ratios[key] = deque(maxlen=CORRECTION_WINDOW)
        # the engine runs one round at a time, so the feedback is of the round planned last, at `self.context`
        ratios.append(seconds / self.profile.predict(k, key[2], fb.batch_size, self.context))

    def describe(self) -> list[dict]:
        out = []
        for b, st in zip(self.buckets, self.states):
            k, d, cand = st.options[st.current] if st.current >= 0 else (0, 0, -1)
            out.append(
                {
                    "batch": b.label(),
                    "candidate": cand,
                    "k": k,
                    "d": d,
                    "off": k == 0,
                    "exploring": bool(st.queue),
                    "switches": st.switches,
                    "options": [list(o) for o in st.options],
                    "predicted_tokens_per_s": st.predicted,
                    "drain_priced": st.drained,
                    "alpha": [self.acceptance.alpha(j) for j in range(1, self.full_depth + 1)],
                    "cost": "profile" if st.cost is None else "online",
                    "cost_factors": {f"{k},{d}": round(v, 3) for (k, d), v in self.cost_factors(st.index).items()},
                    # per plan with probe pairs: [factor, its relative standard error, plain pairs, rival pairs]
                    # (control/probes.py)
                    "probe_factors": {
                        f"{k},{d}": [
                            round(self.probes.factor(st.index, k, d), 4),
                            round(self.probes.error(st.index, k, d), 4),
                            self.probes.pairs(st.index, k, d),
                            self.probes.rival_pairs(st.index, k, d),
                        ]
                        for k, d, _ in st.options
                        if self.probes is not None
                        and (self.probes.pairs(st.index, k, d) or self.probes.rival_pairs(st.index, k, d))
                    },
                }
            )
        return out
