"""The EMA-threshold policy (docs/adaptive.md "EMA policy") (`policy="ema"`) with Phase 2 switch-off and probe backoff.

Per bucket, `BucketState` keeps one acceptance EMA per candidate. A round's rate is r = ΣA / ΣK_actual
(accepted over proposed draft tokens, summed over the round's requests); rounds with ΣK_actual = 0 are
skipped. E_1 = the candidate's `prior` blended with r (E_1 = (1-β)·prior + β·r) when the preset sets a
prior, else E_1 = r; afterwards E_t = (1-β)E_{t-1} + βr_t.

Decisions are taken only for the bucket's current candidate, after `min_samples` measured rounds there
(counted since the bucket moved to it) and then every `interval` measured rounds. Acceptance drives them
(docs/adaptive.md "EMA policy"):
1. E > θ_up -> one up (if there is one);
2. at the most conservative speculative candidate, E < off threshold -> off (plain decoding);
3. E < θ_down -> one down (never below the most conservative speculative candidate).
The off threshold is θ_down of that candidate when the list starts with K=0 (the list move onto K=0),
and `disable.threshold` when Phase 2 is enabled (the larger of the two when both apply).
With `disable.use_timing` (off by default) a candidate whose committed tokens/s per request is below plain
decoding's *at the same batch size* also moves down / off: timings of different batch sizes are never
compared, since a round of a larger batch is slower per request whatever the plan.

Off: plans are plain (k=0); after `backoff` plain rounds a probe of `probe_rounds` rounds runs the most
conservative speculative candidate. Pooled probe acceptance >= the off threshold (and, with timing, probe
tokens/s >= plain tokens/s at the probe's batch size) switches speculation back on with E = the probe's
rate; otherwise the backoff doubles, capped: base, 2·base, 4·base, ..., cap. A probe whose rounds drafted
nothing is repeated at once; one whose feedback does not arrive within two further plans is decided on the
feedback that did arrive. Rounds whose requests drafted nothing (ΣK_actual = 0, e.g. the scheduler cut K)
count as plain rounds for the timing comparison. A bucket keeps its state (on/off, backoff) when the batch
leaves and re-enters it: acceptance does not change with the batch size, so re-entering is no evidence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from looped_spec.control.buckets import CompiledBucket
from looped_spec.control.plan import RoundFeedback
from looped_spec.control.schema import DisableConfig


class Policy:
    """Interface the controller drives: `select` at plan time, `observe` after commit, `enter` on a bucket change.

    `last_event` holds a short description of the latest decision (for the trace), or None.
    """

    name = "base"
    last_event: str | None = None
    #: A policy learning acceptance from readouts sets this while its estimate rests on few of them.
    acceptance_young: bool = False

    def select(
        self,
        bucket: int,
        batch_size: int,
        plan_id: int,
        context: float | None = None,
        remaining: Sequence[int] | None = None,
    ) -> tuple[int, int, int]:
        """(k, d, candidate index) for this round in `bucket`.

        `context`: the batch's mean context (tokens in the KV per request at the round's start), or None when
        unknown; `remaining`: the running requests' token budgets left when no request waits (a finished
        request's slot will not be refilled), else None. A policy whose predictions do not depend on them
        ignores them.
        """
        raise NotImplementedError

    def observe(self, fb: RoundFeedback) -> None:
        raise NotImplementedError

    def times_round(self, bucket: int, plan_id: int) -> bool:
        """Whether the round `plan_id` just selected is timed against another (a plain probe or the round priced
        against it): it must then run in its plan's full shape, without counterfactual readouts."""
        return False

    def enter(self, bucket: int) -> None:
        """The batch moved into `bucket` from another bucket."""

    def readouts_far(self, bucket: int) -> bool:
        """Whether plain rounds of `bucket` may take readouts at the far budget (control/measurement.py): no plan is
        near a switch, so a readout can only tell that acceptance moved a long way."""
        return False

    def quiet_rounds(self, bucket: int, batch_size: int, choice: tuple[int, int, int]) -> int:
        """How many next `select` calls of `bucket` at `batch_size` are sure to return `choice` (what `select`
        just returned) with no event, whatever the feedback observed meanwhile: the controller may answer them
        with `repeat` (0: none)."""
        return 0

    def repeat(self, bucket: int, context: float | None = None) -> tuple[int, int, int]:
        """What `select` returns and does in a round `quiet_rounds` vouched for (only counters advance)."""
        raise NotImplementedError

    def describe(self) -> list[dict]:
        """Per-bucket state for `stats()` (not on the hot path)."""
        return []


@dataclass(slots=True)
class BucketState:
    """Mutable adaptation state of one bucket; lists are indexed by candidate."""

    index: int  # current candidate
    ema: list[float | None]  # [C] acceptance EMA E
    samples: list[int]  # [C] measured rounds folded into `ema`
    rate: list[dict[int, float]]  # [C] batch size -> EMA of committed tokens/s per request (timed rounds)
    visit: int = 0  # measured rounds at `index` since the bucket moved there
    plain_rate: dict[int, float] = field(default_factory=dict)  # batch size -> EMA of plain tokens/s per request
    plain_seen: dict[int, int] = field(default_factory=dict)  # batch size -> plain rounds observed
    last_batch: int = 0  # batch size of the latest feedback
    off: bool = False
    off_by_preset: bool = False
    backoff: int = 0  # current plain-rounds wait between probes
    wait_left: int = 0
    probe_issued: int = 0  # 0: no probe running
    probe_seen: int = 0
    probe_first_id: int = -1
    probe_last_id: int = -1
    probe_accepted: int = 0
    probe_proposed: int = 0
    probe_tokens: float = 0.0
    probe_time: float = 0.0  # Σ batch·round_time over the probe
    probe_batch: int = 0  # the probe rounds' batch size, -1 when they differed
    moves: int = 0
    probes: int = 0
    history: list[str] = field(default_factory=list)  # last decisions (bounded)


#: Rounds of each kind (per candidate, and plain) whose timing is ignored: the first rounds of a shape pay
#: one-off costs (allocator growth, lazy kernel set-up, graph capture) that would make the timing rule switch
#: a good candidate off.
TIMING_WARMUP = 2


class CandidatePolicy(Policy):
    """EMA of acceptance per (bucket, candidate); move ±1 on thresholds; Phase 2 off with probe backoff."""

    name = "ema"

    def __init__(self, buckets: list[CompiledBucket], disable: DisableConfig) -> None:
        self.buckets = buckets
        self.disable = disable
        self.states = [self._fresh(b) for b in buckets]

    def _fresh(self, b: CompiledBucket) -> BucketState:
        n = len(b.ks)
        initial = b.config.initial_index
        st = BucketState(index=initial, ema=list(b.prior), samples=[0] * n, rate=[{} for _ in range(n)])
        if b.ks[initial] == 0:
            st.off = st.off_by_preset = True
            st.backoff = st.wait_left = self.disable.probe_base
        return st

    # ------------------------------------------------------------------ plan time
    def select(
        self,
        bucket: int,
        batch_size: int,
        plan_id: int,
        context: float | None = None,
        remaining: Sequence[int] | None = None,
    ) -> tuple[int, int, int]:
        # acceptance thresholds depend on neither the context nor the budgets left: both are ignored
        b = self.buckets[bucket]
        st = self.states[bucket]
        self.last_event = None
        if not st.off:
            i = st.index
            return b.ks[i], b.ds[i], i
        lo = b.lowest_spec
        if lo >= 0:
            if st.probe_issued:
                if st.probe_issued < self.disable.probe_rounds:
                    st.probe_issued += 1
                    st.probe_last_id = plan_id
                    return b.ks[lo], b.ds[lo], lo
                if plan_id - st.probe_last_id > 2:  # some probe feedback never came: decide on what did
                    self._end_probe(st, b)
                    return self.select(bucket, batch_size, plan_id)
            elif st.wait_left > 0:
                st.wait_left -= 1
            else:
                st.probe_issued, st.probe_seen, st.probe_first_id, st.probe_last_id = 1, 0, plan_id, plan_id
                st.probe_accepted = st.probe_proposed = 0
                st.probe_tokens = st.probe_time = 0.0
                st.probe_batch = 0
                st.probes += 1
                self.last_event = f"probe k={b.ks[lo]} d={b.ds[lo]}"
                return b.ks[lo], b.ds[lo], lo
        return 0, 0, b.plain_candidate

    # ------------------------------------------------------------------ feedback
    def observe(self, fb: RoundFeedback) -> None:
        self.last_event = None
        if not 0 <= fb.bucket < len(self.buckets):
            return
        b = self.buckets[fb.bucket]
        beta = b.config.beta
        st = self.states[fb.bucket]
        batch = fb.batch_size
        seconds = fb.draft_time + fb.full_depth_time + fb.commit_time
        proposed = sum(fb.num_proposed)
        st.last_batch = batch
        if (fb.k == 0 or proposed == 0) and seconds > 0.0 and batch > 0:  # ran as plain decoding
            seen = st.plain_seen[batch] = st.plain_seen.get(batch, 0) + 1
            if seen > TIMING_WARMUP:
                _ema_into(st.plain_rate, batch, 1.0 / seconds, beta)  # one token per request
        c = fb.candidate
        if fb.k == 0 or not 0 <= c < len(b.ks):
            return
        accepted = sum(fb.num_accepted)
        if proposed > 0 and seconds > 0.0 and batch > 0 and st.samples[c] >= TIMING_WARMUP:
            _ema_into(st.rate[c], batch, (accepted + len(fb.num_accepted)) / (batch * seconds), beta)
        if proposed > 0:
            r = accepted / proposed
            old = st.ema[c]
            st.ema[c] = r if old is None else (1.0 - beta) * old + beta * r
            st.samples[c] += 1
        if st.off:
            if st.probe_issued and c == b.lowest_spec and fb.plan_id >= st.probe_first_id:
                st.probe_seen += 1
                st.probe_accepted += accepted
                st.probe_proposed += proposed
                st.probe_tokens += accepted + len(fb.num_accepted)
                st.probe_time += batch * seconds
                st.probe_batch = batch if st.probe_batch in (0, batch) else -1
                if st.probe_seen >= self.disable.probe_rounds:
                    self._end_probe(st, b)
            return
        if proposed == 0 or c != st.index:
            return
        st.visit += 1
        due = st.visit - b.config.min_samples
        if due >= 0 and due % b.config.interval == 0:
            self._decide(st, b)

    def _decide(self, st: BucketState, b: CompiledBucket) -> None:
        i = st.index
        e = st.ema[i]
        assert e is not None
        lo = b.lowest_spec
        can_off = b.off_threshold >= 0.0
        rate = st.rate[i].get(st.last_batch)
        plain = st.plain_rate.get(st.last_batch)
        if self.disable.use_timing and plain is not None and rate is not None and rate < plain:
            if i > lo:
                return self._move(st, i - 1, "down (slower than plain)")
            if can_off:
                return self._switch_off(st, b, "off (slower than plain)")
        if e > b.theta_up[i] and i + 1 < len(b.ks):
            return self._move(st, i + 1, f"up (E={e:.3f} > {b.theta_up[i]})")
        if i == lo and can_off and e < b.off_threshold:
            return self._switch_off(st, b, f"off (E={e:.3f} < {b.off_threshold})")
        if e < b.theta_down[i] and i > lo:
            return self._move(st, i - 1, f"down (E={e:.3f} < {b.theta_down[i]})")

    def _move(self, st: BucketState, to: int, why: str) -> None:
        st.index, st.visit = to, 0
        st.moves += 1
        self._note(st, f"{why} -> candidate {to}")

    def _switch_off(self, st: BucketState, b: CompiledBucket, why: str) -> None:
        st.off, st.off_by_preset, st.visit = True, False, 0
        st.index = b.plain_candidate if b.has_plain else st.index
        st.backoff = st.wait_left = self.disable.probe_base
        st.probe_issued = 0
        self._note(st, why)

    def _switch_on(self, st: BucketState, b: CompiledBucket, ema: float | None) -> None:
        st.off, st.off_by_preset = False, False
        st.index, st.visit = b.lowest_spec, 0
        st.ema[b.lowest_spec] = ema
        st.backoff = st.wait_left = st.probe_issued = 0

    def _end_probe(self, st: BucketState, b: CompiledBucket) -> None:
        st.probe_issued = 0
        if st.probe_proposed == 0:  # inconclusive (nothing drafted): probe again at once
            st.wait_left = 0
            return self._note(st, "probe empty")
        ratio = st.probe_accepted / st.probe_proposed
        good = ratio >= b.off_threshold
        plain = st.plain_rate.get(st.probe_batch)
        if good and self.disable.use_timing and plain is not None and st.probe_time > 0.0:
            good = st.probe_tokens / st.probe_time >= plain
        if good:
            self._switch_on(st, b, ratio)
            return self._note(st, f"on (probe r={ratio:.3f})")
        st.backoff = st.wait_left = min(2 * st.backoff, self.disable.probe_cap)
        self._note(st, f"probe failed (r={ratio:.3f}); next in {st.backoff} rounds")

    def _note(self, st: BucketState, event: str) -> None:
        self.last_event = event
        st.history.append(event)
        if len(st.history) > 32:
            del st.history[:16]

    def describe(self) -> list[dict]:
        out = []
        for b, st in zip(self.buckets, self.states):
            out.append(
                {
                    "batch": b.label(),
                    "candidate": b.plain_candidate if st.off else st.index,
                    "k": 0 if st.off else b.ks[st.index],
                    "d": 0 if st.off else b.ds[st.index],
                    "off": st.off,
                    "ema": list(st.ema),
                    "samples": list(st.samples),
                    "moves": st.moves,
                    "probes": st.probes,
                    "backoff": st.backoff,
                    "history": list(st.history[-8:]),
                }
            )
        return out


def _ema_into(rates: dict[int, float], batch: int, value: float, beta: float) -> None:
    old = rates.get(batch)
    rates[batch] = value if old is None else (1.0 - beta) * old + beta * value
