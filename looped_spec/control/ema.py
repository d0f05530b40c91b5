"""The EMA policy (`policy="ema"`): the RFC's thresholds on measured acceptance, with probes while speculation is
off (docs/adaptive.md "EMA policy").
"""

from __future__ import annotations

from dataclasses import dataclass, field

from looped_spec.control.acceptance import AcceptanceEstimator, accept_rate
from looped_spec.control.buckets import CompiledBucket
from looped_spec.control.plan import RoundFeedback, SpeculationPlan
from looped_spec.presets.schema import DisableConfig


@dataclass(slots=True)
class _Bucket:
    index: int  # current candidate
    ema: list[float | None]  # [C] acceptance EMA per candidate
    visit: int = 0  # rounds at `index` since the bucket moved there
    off: bool = False  # speculation switched off: plain rounds, and now and then a probe
    wait: int = 0  # plain rounds left before the next probe ...
    backoff: int = 0  # ... and how many the last wait was (doubled after a failed probe)
    probe_left: int = 0  # probe rounds still to plan ...
    # ... and the plans handed out for it whose feedback has not come yet, and those whose has (the probe ends when
    # none is left to plan or to hear from; on loop passes a plan may report more than once, docs/adaptive.md)
    probe_plans: set[int] = field(default_factory=set)
    probe_heard: set[int] = field(default_factory=set)
    probe_accepted: int = 0  # the probe's rounds so far, pooled
    probe_proposed: int = 0
    probed_at: int = 0  # acceptance positions observed when the last probe started
    ran: bool = False  # for describe(): a round was planned here (a bucket no batch entered has no plan to report)
    moves: int = 0  # for describe(): moves between candidates, probes, the last events
    probes: int = 0
    history: list[str] = field(default_factory=list)


class EmaPolicy:
    name = "ema"

    def __init__(
        self,
        buckets: list[CompiledBucket],
        disable: DisableConfig,
        acceptance: AcceptanceEstimator,
    ) -> None:
        self.buckets = buckets
        self.disable = disable
        self.acceptance = acceptance
        self.states = []
        for b in buckets:
            st = _Bucket(index=b.config.initial_index, ema=list(b.prior))
            if b.ks[st.index] == 0:
                self._switch_off(st, b, "")
            self.states.append(st)
        self.last_event: str | None = None

    def select(self, bucket: int, batch: int, context: float, plan_id: int = -1) -> tuple[int, int, int]:
        b, st = self.buckets[bucket], self.states[bucket]
        self.last_event = None
        st.ran = True
        if not st.off:
            return b.ks[st.index], b.ds[st.index], st.index
        lo = b.lowest_spec
        if lo < 0:
            return 0, 0, b.plain_candidate
        if st.probe_left == 0 and not st.probe_plans:
            st.wait -= 1
            if st.wait <= 0 or self._readouts_say_on(b, lo, st):
                st.probe_left = self.disable.probe_rounds
                st.probed_at = self.acceptance.positions
                st.probe_accepted = st.probe_proposed = 0
                st.probe_heard.clear()
                st.probes += 1
                self.last_event = f"probe K={b.ks[lo]} d={b.ds[lo]}"
        if st.probe_left > 0:
            st.probe_left -= 1
            st.probe_plans.add(plan_id)
            return b.ks[lo], b.ds[lo], lo
        return 0, 0, b.plain_candidate

    def _readouts_say_on(self, b: CompiledBucket, lo: int, st: _Bucket) -> bool:
        """The counterfactual readouts taken since the last probe (at least `disable.probe_evidence` positions)
        predict the probe candidate's acceptance over the off threshold."""
        if self.acceptance.positions < st.probed_at + self.disable.probe_evidence:
            return False
        d = b.ds[lo]
        return accept_rate(self.acceptance.alpha[d - 1], self.acceptance.rho[d - 1], b.ks[lo]) >= b.off_threshold

    def observe(self, fb: RoundFeedback) -> None:
        self.last_event = None
        buckets = self.buckets
        if fb.k == 0 or not 0 <= fb.bucket < len(buckets) or not 0 <= fb.candidate < len(buckets[fb.bucket].ks):
            return
        b, st, c = self.buckets[fb.bucket], self.states[fb.bucket], fb.candidate
        proposed, accepted = fb.total_proposed, fb.total_accepted
        if st.off:
            # a probe plan's rounds while the probe runs (a plan heard already may report later rounds of its own)
            running = st.probe_left > 0 or st.probe_plans
            if c == b.lowest_spec and running and (fb.plan_id in st.probe_plans or fb.plan_id in st.probe_heard):
                st.probe_plans.discard(fb.plan_id)
                st.probe_heard.add(fb.plan_id)
                st.probe_accepted += accepted
                st.probe_proposed += proposed
                if not st.probe_plans and st.probe_left == 0:
                    self._end_probe(st, b)
            return
        if proposed == 0:
            return
        beta = b.config.beta
        old = st.ema[c]
        st.ema[c] = accepted / proposed if old is None else (1.0 - beta) * old + beta * accepted / proposed
        if c != st.index:
            return
        st.visit += 1
        due = st.visit - b.config.min_samples
        if due >= 0 and due % b.config.interval == 0:
            self._decide(st, b)

    def abandon(self, plan: SpeculationPlan) -> None:
        """A planned round that will report nothing: a probe round among them is planned again (else the probe would
        wait for its feedback forever, and the bucket never probe again)."""
        if plan.k == 0 or not 0 <= plan.bucket < len(self.buckets):
            return
        st = self.states[plan.bucket]
        if plan.plan_id in st.probe_plans:  # (one that reported some rounds already is heard)
            st.probe_plans.discard(plan.plan_id)
            st.probe_left += 1

    def outlook(self, bucket: int) -> float:
        """1.0 while the bucket is off, where the readouts call its probes (their budget is never cut); 0.0 while it
        speculates: it moves on its rounds' own acceptance, which readouts do not change."""
        return 1.0 if self.states[bucket].off else 0.0

    def _decide(self, st: _Bucket, b: CompiledBucket) -> None:
        i, e = st.index, st.ema[st.index]
        assert e is not None
        if e > b.theta_up[i] and i + 1 < len(b.ks):
            self._move(st, i + 1, f"up (E={e:.3f} > {b.theta_up[i]})")
        elif i == b.lowest_spec and b.off_threshold >= 0.0 and e < b.off_threshold:
            self._switch_off(st, b, f"off (E={e:.3f} < {b.off_threshold})")
        elif e < b.theta_down[i] and i > b.lowest_spec:
            self._move(st, i - 1, f"down (E={e:.3f} < {b.theta_down[i]})")

    def _move(self, st: _Bucket, to: int, why: str) -> None:
        st.index, st.visit = to, 0
        st.moves += 1
        self._note(st, f"{why} -> candidate {to}")

    def _switch_off(self, st: _Bucket, b: CompiledBucket, why: str) -> None:
        st.off, st.visit = True, 0
        st.index = b.plain_candidate if b.ks[0] == 0 else st.index
        st.backoff = st.wait = self.disable.probe_base
        if why:
            self._note(st, why)

    def _end_probe(self, st: _Bucket, b: CompiledBucket) -> None:
        if st.probe_proposed == 0:  # nothing drafted: inconclusive, probe again at once
            st.wait = 0
            return
        rate = st.probe_accepted / st.probe_proposed
        if rate >= b.off_threshold:
            st.off, st.index, st.visit = False, b.lowest_spec, 0
            st.ema[b.lowest_spec] = rate
            self._note(st, f"on (probe r={rate:.3f})")
            return
        st.backoff = st.wait = min(2 * st.backoff, self.disable.probe_cap)
        self._note(st, f"probe failed (r={rate:.3f}); next in {st.backoff} rounds")

    def _note(self, st: _Bucket, event: str) -> None:
        self.last_event = event
        st.history = [*st.history[-7:], event]  # the last 8 events, which describe() shows

    def enter(self, bucket: int) -> None:
        st = self.states[bucket]
        if st.off:
            st.wait = 0  # a workload change: probe at once

    def describe(self) -> list[dict]:
        return [
            {
                "batch": b.label(),
                "candidate": b.plain_candidate if st.off else st.index,
                # as the goodput policy's: no plan (None) in a bucket no batch has entered yet
                "k": None if not st.ran else 0 if st.off else b.ks[st.index],
                "d": None if not st.ran else 0 if st.off else b.ds[st.index],
                "off": st.off,
                "ema": list(st.ema),
                "moves": st.moves,
                "probes": st.probes,
                "backoff": st.backoff,
                "history": list(st.history),
            }
            for b, st in zip(self.buckets, self.states)
        ]
