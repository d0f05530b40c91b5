"""The goodput policy (`policy="goodput"`, the default): run the option with the most predicted tokens per second,
B · E[committed tokens per request per round] / T(K, d, B, L), with E from the acceptance estimates and T from the
pass costs; switching is held back by `plain_margin` and `hysteresis` (docs/adaptive.md "Goodput policy").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from looped_spec.control.acceptance import AcceptanceEstimator
from looped_spec.control.buckets import CompiledBucket
from looped_spec.control.exits import ExitDepths
from looped_spec.control.passcost import PassCost
from looped_spec.control.plan import RoundFeedback, SpeculationPlan
from looped_spec.control.settings import ControlSettings

#: A speculative option predicted within this share of the option in use has its price read beside it (a price probe)
#: until known: the profile's relative prices of plans can be that far off on another machine state (docs/adaptive.md
#: "Prices on another machine")
RIVAL_RANGE = 0.15


@dataclass(slots=True)
class _Bucket:
    current: int = -1  # option in use; -1 before the first decision
    rounds_left: int = 0  # rounds until the next decision
    batch: int = 0  # batch size of the last decision
    switches: int = 0
    predicted: list[float] | None = None  # [O] tokens/s at the last decision


class GoodputPolicy:
    name = "goodput"

    def __init__(
        self,
        buckets: list[CompiledBucket],
        acceptance: AcceptanceEstimator,
        cost: PassCost,
        exits: ExitDepths,
        settings: ControlSettings,
    ) -> None:
        self.buckets = buckets
        self.acceptance = acceptance
        self.cost = cost
        self.exits = exits
        self.settings = settings
        self.states = [_Bucket() for _ in buckets]
        self.last_event: str | None = None
        # every bucket prices every option any bucket lists: text unlike the tuning text can want another's plan
        options = sorted({o for b in buckets for o in b.options})
        if not any(b.may_run_plain for b in buckets):
            options = [o for o in options if o[0] > 0]  # the preset never switches speculation off
        self.options = options
        self.plain = options.index((0, 0)) if (0, 0) in options else -1
        cost_index = [cost.option_index[o] for o in options]  # each option's line in `cost`
        self.k_max: dict[int, int] = {}  # per draft depth, the longest draft of the options
        # `predict`'s expected tokens per (d, K), and the agreement they were computed at
        self._tokens_at: list[float] | None = None
        self._tokens: dict[int, list[float]] = {}
        for k, d in options:
            if k > 0:
                self.k_max[d] = max(k, self.k_max.get(d, 0))
        # per bucket, and last for bucket -1 (`predict` without one), each option's (K, d, its line in `cost`, its key
        # among the learned prices)
        keys = [*range(len(buckets)), -1]
        self.priced = [[(k, d, i, (b, k, d)) for (k, d), i in zip(options, cost_index)] for b in keys]
        # the candidate index a plan of each option carries in each bucket (-1: not one of its candidates)
        self.candidate = [
            [next((j for j, c in enumerate(zip(b.ks, b.ds)) if c == o), -1) for o in options] for b in buckets
        ]

    def predict(self, batch: int, context: float, bucket: int = -1) -> list[float]:
        """Predicted committed tokens per second of each option (the decision's numbers; a speculative option's
        time times its learned price against plain in `bucket`)."""
        alpha = self.acceptance.batch_alpha()
        if self.exits.seen:
            alpha = self.exits.effective_alpha(alpha)  # tokens that exit within the draft depth pass for free
        intercepts, slopes = self.cost.lines(batch, self.exits)
        if alpha != self._tokens_at:  # the agreement moves at measured and speculative rounds only
            self._tokens_at, self._tokens = alpha, self.acceptance.tokens_upto(alpha, self.k_max)
        tokens = self._tokens
        drift, price = self.cost.drift, self.cost.speculative_factor
        out = []
        for k, d, i, plan in self.priced[bucket]:
            seconds = (intercepts[i] + slopes[i] * context) * drift
            out.append(batch * tokens[d][k] / (seconds * price(plan)) if k else batch / seconds)
        return out

    def select(self, bucket: int, batch: int, context: float, plan_id: int = -1) -> tuple[int, int, int]:
        """(k, d, candidate index) for this round (the plan `plan_id`: the EMA policy's probes follow theirs)."""
        st = self.states[bucket]
        self.last_event = None
        if st.rounds_left <= 0 or batch != st.batch:
            self._decide(st, bucket, batch, context)
        st.rounds_left -= 1
        k, d = self.options[st.current]
        return k, d, self.candidate[bucket][st.current]

    def _decide(self, st: _Bucket, bucket: int, batch: int, context: float) -> None:
        s, may_run_plain = self.settings, self.buckets[bucket].may_run_plain
        rate = self.predict(batch, context, bucket)
        st.predicted, st.batch, st.rounds_left = rate, batch, s.decision_interval
        plain, current = self.plain if may_run_plain else -1, st.current
        # speculation must clear the margin over plain decoding to be taken up (a plan in use under the margin but not
        # under plain stays, as no switch below fires for plain then)
        bar = rate[plain] * (1.0 + s.plain_margin) if plain >= 0 else -math.inf
        eligible = [o for o, (k, _) in enumerate(self.options) if (k == 0 and plain >= 0) or (k > 0 and rate[o] >= bar)]
        best = max(eligible, key=rate.__getitem__)
        if current < 0:
            st.current = best
            self.last_event = f"start {self._label(best)} ({rate[best]:.4g} tok/s)"
            return
        if best == current:
            return
        # a plan predicted slower than plain is left at once: for plain, or for a plan clearing the margin over plain
        # (the hysteresis, which may exceed the margin, does not hold a plan plain beats)
        beaten_by_plain = plain >= 0 and rate[plain] > rate[current]
        from_plain = self.options[current][0] == 0
        if beaten_by_plain or from_plain or rate[best] > rate[current] * (1.0 + s.hysteresis):
            self.last_event = (
                f"{self._label(current)} -> {self._label(best)} "
                f"({rate[current]:.4g} -> {rate[best]:.4g} tok/s predicted at B={batch})"
            )
            st.current = best
            st.switches += 1

    def rival(self, bucket: int, settled: int) -> tuple[int, int] | None:
        """The speculative option to price beside the one in use: the best predicted after it at the bucket's last
        decision, within `RIVAL_RANGE` of it, among those priced here by fewer than `settled` pairs of rounds."""
        st = self.states[bucket]
        if st.predicted is None or st.current < 0:
            return None
        floor, best = st.predicted[st.current] * (1.0 - RIVAL_RANGE), None
        for o, ((k, d), rate) in enumerate(zip(self.options, st.predicted)):
            if k > 0 and o != st.current and rate >= floor and (best is None or rate > st.predicted[best]):
                if self.cost.own_pairs((bucket, k, d)) < settled:
                    best = o
        return None if best is None else self.options[best]

    def outlook(self, bucket: int) -> float:
        """The best speculative option's predicted rate ÷ plain decoding's at the bucket's last decision (1.0 while a
        speculative plan runs, before a decision, or when plain cannot run): how far speculation is from paying."""
        st = self.states[bucket]
        if st.predicted is None or self.plain < 0 or self.options[st.current][0] > 0:
            return 1.0
        best = max((x for (k, _), x in zip(self.options, st.predicted) if k > 0), default=None)
        plain = st.predicted[self.plain]
        return 1.0 if best is None or best <= 0.0 or plain <= 0.0 else min(best / plain, 1.0)

    def _label(self, option: int) -> str:
        k, d = self.options[option]
        return f"(K={k}, d={d})" if k else "plain"

    def observe(self, feedback: RoundFeedback) -> None:
        """Nothing of its own: the estimators it reads learn from every round (the controller feeds them)."""
        self.last_event = None

    def abandon(self, plan: SpeculationPlan) -> None:
        """Nothing waits for a round's feedback here."""

    def enter(self, bucket: int) -> None:
        self.states[bucket].rounds_left = 0  # decide at once in the bucket the batch just entered

    def describe(self) -> list[dict]:
        out = []
        for b, st in zip(self.buckets, self.states):
            k, d = self.options[st.current] if st.current >= 0 else (None, None)
            predicted = None
            if st.predicted is not None:
                predicted = {f"{k},{d}": round(x, 2) for (k, d), x in zip(self.options, st.predicted)}
            out.append(
                {"batch": b.label(), "k": k, "d": d, "switches": st.switches, "predicted_tokens_per_s": predicted}
            )
        return out
