"""The goodput policy (`policy="goodput"`, the default): run the option with the most predicted tokens per second.

For every (K, d) the preset lists as a candidate of any bucket, and plain decoding, it predicts, at the live
batch size B and mean context L,

    goodput(K, d) = E[committed tokens per request per round | α_d, ρ_d, K] / T(K, d, B, L)

with E from the acceptance estimator (control/acceptance.py; under early exit the draft-exited share passes
for free, control/exits.py) and T from the pass-cost model (control/passcost.py). Both are shared by all
buckets, so a bucket the batch has never visited is priced from the first round. Every bucket prices every
listed option: the tuner lists a bucket's plans for the tuning text, and text of another kind can want a plan
the tuner listed for another batch size (easier text, longer drafts). A bucket keeps its own plan in use.

A decision is taken every `decision_interval` rounds of a bucket and whenever the batch size changes. It moves:
- from plain decoding to a speculative option only when that option is predicted `plain_margin` faster
  (a wrong speculative plan costs more than a missed small gain);
- from a speculative plan to another only when that one is predicted `hysteresis` faster;
- from a speculative plan back to plain decoding as soon as plain is predicted faster.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from looped_spec.control.acceptance import AcceptanceEstimator
from looped_spec.control.buckets import CompiledBucket
from looped_spec.control.exits import ExitDepths
from looped_spec.control.passcost import PassCost
from looped_spec.control.plan import RoundFeedback
from looped_spec.control.settings import ControlSettings


@dataclass(slots=True)
class _Bucket:
    current: int = -1  # option in use; -1 before the first decision
    rounds_left: int = 0  # rounds until the next decision
    batch: int = 0  # batch size of the last decision
    switches: int = 0
    predicted: np.ndarray | None = None  # [O] tokens/s at the last decision


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
        options = sorted({(int(k), int(d)) for b in buckets for k, d in zip(b.option_k, b.option_d)})
        if not any(b.plain_option >= 0 for b in buckets):
            options = [o for o in options if o[0] > 0]  # the preset never switches speculation off
        self.option_k = np.array([k for k, _ in options])
        self.option_d = np.array([d for _, d in options])
        self.cost_index = np.array([cost.option_index[o] for o in options])  # each option's line in `cost`
        self.plain = options.index((0, 0)) if (0, 0) in options else -1
        # the candidate index a plan of each option carries in each bucket (-1: not one of its candidates)
        self.candidate = [
            [next((j for j, (k, d) in enumerate(zip(b.ks, b.ds)) if (k, d if k else 0) == o), -1) for o in options]
            for b in buckets
        ]

    def predict(self, batch: int, context: float) -> np.ndarray:
        """Predicted committed tokens per second of each option (the decision's numbers)."""
        alpha = self.acceptance.alpha
        if self.exits.seen:
            alpha = self.exits.effective_alpha(alpha)
        tokens = self.acceptance.tokens(self.option_k, self.option_d, alpha)
        return batch * tokens / (self.seconds(batch, context) * self.cost.drift)

    def seconds(self, batch: int, context: float) -> np.ndarray:
        """Profile seconds of one round of each option."""
        exits = self.exits if self.exits.survival() is not None else None
        intercept, slope = self.cost.lines(batch, exits)
        return (intercept + slope * context)[self.cost_index]

    def select(self, bucket: int, batch: int, context: float) -> tuple[int, int, int]:
        """(k, d, candidate index) for this round."""
        st = self.states[bucket]
        self.last_event = None
        if st.rounds_left <= 0 or batch != st.batch:
            self._decide(st, batch, context)
        st.rounds_left -= 1
        o = st.current
        return int(self.option_k[o]), int(self.option_d[o]), self.candidate[bucket][o]

    def _decide(self, st: _Bucket, batch: int, context: float) -> None:
        s = self.settings
        rate = self.predict(batch, context)
        st.predicted, st.batch, st.rounds_left = rate, batch, s.decision_interval
        plain = self.plain
        speculative = self.option_k > 0
        if plain >= 0:  # speculation must clear the margin over plain decoding to be taken up
            eligible = ~speculative | (rate >= rate[plain] * (1.0 + s.plain_margin))
        else:
            eligible = np.ones(len(rate), dtype=bool)
        current = st.current
        if current >= 0:
            eligible[current] = True
        best = int(np.argmax(np.where(eligible, rate, -np.inf)))
        if current < 0:
            st.current = best
            self.last_event = f"start {self._label(best)} ({rate[best]:.4g} tok/s)"
            return
        if best == current:
            return
        leave_for_plain = best == plain and rate[plain] > rate[current]
        if leave_for_plain or not speculative[current] or rate[best] > rate[current] * (1.0 + s.hysteresis):
            self.last_event = (
                f"{self._label(current)} -> {self._label(best)} "
                f"({rate[current]:.4g} -> {rate[best]:.4g} tok/s predicted at B={batch})"
            )
            st.current = best
            st.switches += 1

    def _label(self, option: int) -> str:
        k = int(self.option_k[option])
        return f"(K={k}, d={int(self.option_d[option])})" if k else "plain"

    def observe(self, feedback: RoundFeedback) -> None:
        """Nothing of its own: the estimators it reads learn from every round (the controller feeds them)."""

    def enter(self, bucket: int) -> None:
        self.states[bucket].rounds_left = 0  # decide at once in the bucket the batch just entered

    def describe(self) -> list[dict]:
        out = []
        for b, st in zip(self.buckets, self.states):
            k = int(self.option_k[st.current]) if st.current >= 0 else None
            d = int(self.option_d[st.current]) if st.current >= 0 else None
            predicted = None if st.predicted is None else {
                f"{k},{d}": round(float(x), 2) for k, d, x in zip(self.option_k, self.option_d, st.predicted)
            }  # fmt: skip
            out.append(
                {"batch": b.label(), "k": k, "d": d, "switches": st.switches, "predicted_tokens_per_s": predicted}
            )
        return out
