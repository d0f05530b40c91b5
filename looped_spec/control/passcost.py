"""Round time from loop passes (docs/adaptive.md "Pricing plans by passes", where the pass, step, readout and
outside terms are written out).

Every price is linear in the coefficients (`theta`, from the preset's `cost` section): `features` writes a round as
counts of each coefficient's unit and `profile_seconds` weighs them; the tuner fits the coefficients to the same
features of what it timed. Online, a drift factor follows the machine's state, `measure_share` learns what
reading out the other depths adds to a round (docs/adaptive.md "Which rounds read out"), and `speculative_factor` what a
speculative round costs next to a plain one here, against the profile's price: one price shared by every plan, and
each plan's own in a bucket once pairs of its rounds were read (docs/adaptive.md "Prices on another machine").
"""

from __future__ import annotations

import math
from collections.abc import Collection

import numpy as np

#: The outside terms are the last five coefficients
OUTSIDE = 5
#: Pairs of rounds the profile's price of speculation against plain counts as (`observe_pair`)
PRICE_PRIOR = 4


def width_weights(grid: np.ndarray, n) -> np.ndarray:
    """[len(n), len(grid)]: w(n) = weights @ w(grid), linear between grid points, the last segment extrapolated."""
    n = np.atleast_1d(np.asarray(n, dtype=float))
    out = np.zeros((len(n), len(grid)))
    if len(grid) == 1:
        out[:, 0] = np.maximum(n, grid[0]) / grid[0]
        return out
    i = np.clip(np.searchsorted(grid, n), 1, len(grid) - 1)
    w = (np.maximum(n, grid[0]) - grid[i - 1]) / (grid[i] - grid[i - 1])
    rows = np.arange(len(n))
    out[rows, i - 1] = 1.0 - w
    out[rows, i] = w
    return out


def _floats(*values) -> list[np.ndarray]:
    """The values as float arrays of one length (broadcast)."""
    return np.broadcast_arrays(*(np.atleast_1d(np.asarray(x, dtype=float)) for x in values))


class PassCost:
    """Predicted seconds of rounds from a preset's `cost` section (see the module docstring)."""

    def __init__(
        self, cost, depth: int, drift_rounds: float = 64.0, options: list[tuple[int, int]] | None = None,
        readout_depths: Collection[int] | None = None,
    ) -> None:  # fmt: skip
        self.depth = depth
        # the depths below full a measured round reads out (None: every one)
        self.readout_depths = frozenset(range(1, depth) if readout_depths is None else readout_depths)
        # the plans a controller prices: their round seconds are kept as lines in the context per batch size
        self.options = sorted(set(options or [(0, 0)]) | {(0, 0)})
        self.option_index = {o: i for i, o in enumerate(self.options)}
        self._ks = np.array([k for k, _ in self.options])
        self._ds = np.array([d for _, d in self.options])
        self.grid = np.asarray(cost.positions, dtype=float)
        self._pass_terms = len(self.grid)  # first column of each group of terms (see "features" below)
        self._step_terms, self._readout_terms = self._pass_terms + 3, self._pass_terms + 8
        # the coefficients in `features` order: the pass curve's grid values, then the other terms
        self.theta = np.concatenate([
            cost.pass_seconds, [cost.request_seconds, cost.request_context_seconds, cost.query_context_seconds],
            cost.step_seconds, cost.embed_seconds, cost.readout_seconds, cost.round_seconds, cost.speculative_seconds,
        ]).astype(float)  # fmt: skip
        self.drift = 1.0
        self._log_drift = 0.0
        self._drift_weight = 1.0 / max(drift_rounds, 1.0)
        # a measured round's time over its prediction unmeasured (log), learned from pairs of a measured and an
        # ordinary round (`observe_measured_pair`): it holds what the profile's readouts miss (the agreement
        # bookkeeping, a fixed cost a round)
        self._log_measured = 0.0
        self.measure_pairs = self.ordinary_rounds = 0
        # a speculative round's time over its price, relative to a plain round's (log), from pairs of adjacent rounds
        # (`observe_pair`): the machine state's relative prices, which the one drift factor cannot carry
        self._log_speculative = 0.0
        self.price_pairs = 0
        # per plan in a bucket (the caller's key): [its price's log deviation from the shared one, its pairs]
        self.own_prices: dict[tuple, list[float]] = {}
        self._factors: dict[tuple | None, float] = {}  # `speculative_factor` per key, until the prices move
        self._lines: dict[tuple, tuple] = {}  # `lines` per (batch size, exits version): no exits, or the latest
        self._exits_version = None

    # ------------------------------------------------------------------ features
    # Columns of `theta`: the pass curve w on the grid [G], then g, h, a (the pass's per-request, per-request-context
    # and per-position-context terms), s0, s_r, s_n, e0, e_n (a step's own), ro0, ro_n (a readout), then the
    # `OUTSIDE` terms o0, o_B, v0, v_K, v_n
    def _columns(self, start: int, *values) -> np.ndarray:
        """[len, P]: `values` (arrays broadcast) in the columns from `start` on, zeros elsewhere."""
        values = _floats(*values)
        out = np.zeros((len(values[0]), len(self.theta)))
        out[:, start : start + len(values)] = np.stack(values, axis=1)
        return out

    def pass_features(self, requests, positions, context) -> np.ndarray:
        """[len, P]: one loop pass each (arrays broadcast)."""
        r, n, c = _floats(requests, positions, context)
        out = self._columns(self._pass_terms, r, r * c, n * c)
        out[:, : self._pass_terms] = width_weights(self.grid, n)
        return out

    def step_features(self, requests, positions, embeds) -> np.ndarray:
        """[len, P]: one runner step's own cost each (its loops and readout not included)."""
        r, n, e = _floats(requests, positions, embeds)
        return self._columns(self._step_terms, 1.0, r, n, e, e * n)

    def readout_features(self, positions) -> np.ndarray:
        return self._columns(self._readout_terms, 1.0, positions)

    def outside_features(self, ks, batch: float) -> np.ndarray:
        ks = np.atleast_1d(np.asarray(ks, dtype=float))
        spec = (ks > 0).astype(float)
        return self._columns(len(self.theta) - OUTSIDE, 1.0, batch, spec, spec * (ks + 1.0), spec * batch * (ks + 1.0))

    def features(self, ks, ds, batch: int, context: float, survival: np.ndarray | None = None) -> np.ndarray:
        """[O, P]: one round of each option (K = 0: plain) at batch `batch` and mean context `context`, as counts
        of each coefficient's unit.

        `survival[i]` = P(a token is still looping at loop i+1) under early exit in skip mode (None: every token
        runs every loop): a synchronous pass narrows to the tokens still looping and runs while any does.
        """
        ks = np.asarray(ks, dtype=float)
        ds = np.asarray(ds, dtype=int)
        b = float(max(batch, 1))
        depth = self.depth
        context = float(max(context, 0.0))
        alive = np.ones(depth) if survival is None else np.asarray(survival, dtype=float)
        live = np.maximum(b * alive, 1.0)  # loop i over one position per request: the requests still looping
        per_loop = (1.0 - (1.0 - alive) ** b)[:, None] * self.pass_features(live, live, context)  # [D, P]
        loops = np.vstack([np.zeros((1, len(self.theta))), np.cumsum(per_loop, axis=0)])  # loops[d]: loops 1..d
        one_step = self.step_features(b, b, 1.0)[0]
        readout_b = self.readout_features(b)[0]
        plain = one_step + loops[depth] + readout_b
        # K+1 draft steps, the context one token longer at each: 0 + 1 + ... + K more tokens per pass
        grow = np.zeros(len(self.theta))
        grow[self._pass_terms + 1] = grow[self._pass_terms + 2] = b
        # the passes of loops 1..d that run, weighed by the share of the batch still in them
        running = np.concatenate([[0.0], np.cumsum((1.0 - (1.0 - alive) ** b) * alive)])
        triangle = ks * (ks + 1.0) / 2.0
        draft = (ks + 1.0)[:, None] * (one_step + loops[ds]) + (running[ds] * triangle)[:, None] * grow
        draft = draft + ks[:, None] * readout_b
        wide = b * (ks + 1.0)
        verify = self.step_features(b, wide, 0.0) + self.readout_features(wide)
        for i in range(depth):  # loop i+1 of the verify step, for the options whose draft stopped before it
            runs = (1.0 - (1.0 - alive[i]) ** wide) * (ds <= i)
            positions = np.maximum(wide * alive[i], 1.0)
            requests = np.maximum(b * (1.0 - (1.0 - alive[i]) ** (ks + 1.0)), 1.0)
            verify = verify + runs[:, None] * self.pass_features(requests, positions, context + ks)
        rounds = np.where((ks > 0)[:, None], draft + verify, plain[None, :])
        return rounds + self.outside_features(ks, b)

    # ------------------------------------------------------------------ seconds
    def profile_seconds(self, ks, ds, batch: int, context: float, survival: np.ndarray | None = None) -> np.ndarray:
        """Seconds of one round of each option as the profile prices them (without the drift factor)."""
        return self.features(ks, ds, batch, context, survival) @ self.theta

    def lines(self, batch: int, exits=None) -> tuple[list[float], list[float]]:
        """(intercepts, slopes) per option of `options`: a round's profile seconds at mean context L are
        intercept + slope·L (a round is linear in the context). Cached per batch size and `exits` (an `ExitDepths`,
        keyed by its version; None, or exits that do not narrow the passes: every loop runs), so the per-round path
        evaluates no passes; as Python floats, the per-round path's arithmetic being on a handful of them."""
        if exits is not None and not exits.prices_passes:
            exits = None  # exits that do not narrow the passes price a round as no exits do
        key = (batch, None if exits is None else exits.version)
        out = self._lines.get(key)
        if out is None:
            if key[1] is not None and key[1] != self._exits_version:  # the exit depths moved on: drop the old prices
                self._lines = {k: v for k, v in self._lines.items() if k[1] is None}
                self._exits_version = key[1]
            survival = None if exits is None else exits.survival()
            at0 = self.profile_seconds(self._ks, self._ds, batch, 0.0, survival)
            slope = (self.profile_seconds(self._ks, self._ds, batch, 1024.0, survival) - at0) / 1024.0
            out = (at0.tolist(), slope.tolist())
            if len(self._lines) > 512:
                self._lines.clear()
            self._lines[key] = out
        return out

    def seconds(self, k: int, d: int, batch: int, context: float, exits=None) -> float:
        """Profile seconds of one (K, d) round (K = 0: plain), without the drift factor."""
        i = self.option_index.get((k, d if k else 0))
        if i is None:  # not a plan of the options: priced directly
            survival = None if exits is None else exits.survival()
            return float(self.profile_seconds([k], [d], batch, context, survival)[0])
        intercepts, slopes = self.lines(batch, exits)
        return intercepts[i] + slopes[i] * context

    def predict(self, k: int, d: int, batch: int, context: float) -> float:
        """Predicted seconds of one (K, d) round (K = 0: plain) now: the profile times the drift factor."""
        return self.seconds(k, d, batch, context) * self.drift

    def measure_seconds(self, k: int, d: int, batch: int, read: Collection[int] | None = None) -> float:
        """The extra readouts of a round that also reads out the other depths (`read`, else `readout_depths`:
        counterfactual acceptance)."""
        ro0, ro_n = self.theta[self._readout_terms : self._readout_terms + 2].tolist()
        b = float(max(batch, 1))
        read = self.readout_depths if read is None else read
        if k <= 0:
            return len(read) * (ro0 + ro_n * b) * self.drift
        # the draft reads out its depths below d at each of its K+1 steps and depth d at the last one; the verifier
        # its depths above d at all K+1 positions of each request
        below, above = sum(j < d for j in read), sum(j > d for j in read)
        draft = (below * (k + 1) + (d in read)) * (ro0 + ro_n * b)
        verify = above * (ro0 + ro_n * b * (k + 1))
        return (draft + verify) * self.drift

    def measure_share(self, k: int, d: int, batch: int, context: float) -> float:
        """What reading out the other depths adds to a (K, d) round, relative to the round: learned from measured rounds
        once some ran (never below what the profile's readouts add), the profile's readouts before."""
        round_seconds = self.predict(k, d, batch, context) * (self.speculative_factor() if k > 0 else 1.0)
        profile = self.measure_seconds(k, d, batch) / round_seconds
        if not self.measure_pairs:
            return profile
        return max(profile, math.exp(self._log_measured) - 1.0)

    def speculative_factor(self, key: tuple | None = None) -> float:
        """A speculative round's time here ÷ the profile's price, relative to a plain round's (1.0 until pairs of
        rounds were seen): the shared price, times `key`'s own deviation from it once pairs of its rounds were read."""
        factor = self._factors.get(key)
        if factor is None:  # kept until a pair moves the prices: a decision reads every option's
            factor = self._factors[key] = math.exp(self._log_price(key))
        return factor

    def _log_price(self, key: tuple | None) -> float:
        """log `speculative_factor(key)`."""
        own = self.own_prices.get(key) if key is not None else None
        return self._log_speculative + (own[0] if own is not None else 0.0)

    def own_pairs(self, key: tuple) -> int:
        """Pairs of rounds that priced `key` itself."""
        own = self.own_prices.get(key)
        return 0 if own is None else int(own[1])

    def observe_pair(
        self, speculative_log_ratio: float, plain_log_ratio: float, memory: float, key: tuple | None = None
    ) -> None:
        """A speculative and a plain round that ran next to each other (each as log(measured ÷ profile seconds)):
        their difference is the relative price free of the machine's drift. A running mean over the first pairs,
        then remembering `memory` pairs, each step clipped; the profile's price counts as `PRICE_PRIOR` pairs, so
        that one noisy pair cannot flip a plan. The shared price learns from every pair, `key` (the speculative
        round's plan in its bucket) its own deviation from it."""
        self.price_pairs += 1
        log_price = speculative_log_ratio - plain_log_ratio
        x = log_price - self._log_speculative
        weight = 1.0 / min(self.price_pairs + PRICE_PRIOR, max(memory, 1.0))
        self._log_speculative += weight * min(max(x, -0.25), 0.25)
        self._factors.clear()
        if key is not None:
            self._learn_own(key, log_price, memory)

    def observe_rival(
        self, rival_log_ratio: float, current_log_ratio: float, memory: float, rival: tuple, current: tuple
    ) -> None:
        """A round of another speculative plan (`rival`) right after one of the plan in use (`current`): the rival's
        price against plain is the current's plus their difference."""
        log_price = rival_log_ratio - current_log_ratio + self._log_price(current)
        self._learn_own(rival, log_price, memory)

    def _learn_own(self, key: tuple, log_price: float, memory: float) -> None:
        """`key`'s deviation from the shared price, a running mean as the shared price's, starting at none: the
        shared price counts as 2 × `PRICE_PRIOR` of its pairs (a plan's own pairs are fewer and as noisy;
        docs/adaptive.md "Each plan's own price" says why twice)."""
        own = self.own_prices.setdefault(key, [0.0, 0])
        own[1] += 1
        x = log_price - self._log_speculative - own[0]
        own[0] += min(max(x, -0.25), 0.25) / min(own[1] + 2 * PRICE_PRIOR, max(memory, 1.0))
        self._factors.clear()

    def observe(
        self, measured: float, predicted_by_profile: float, speculative: bool = False, key: tuple | None = None
    ) -> None:
        """An ordinary round that ran (`predicted_by_profile`: the profile's seconds of that round; `speculative`: a
        speculative round, whose prediction is also times `speculative_factor(key)`): the drift factor moves towards
        measured ÷ predicted, in log space, a step clipped so one stalled round cannot move it far."""
        if measured <= 0.0 or predicted_by_profile <= 0.0:
            return
        x = math.log(measured / predicted_by_profile) - (self._log_price(key) if speculative else 0.0)
        self.ordinary_rounds += 1
        self._log_drift += self._drift_weight * min(max(x - self._log_drift, -0.5), 0.5)
        self.drift = math.exp(self._log_drift)

    def observe_measured_pair(self, measured_log_ratio: float, ordinary_log_ratio: float) -> None:
        """A measured round and an ordinary one of the same plan just before it (each as log(measured ÷ profile
        seconds unmeasured)): their difference is what measuring added, free of the
        machine's drift, which a drift factor learning over tens of rounds would leave in it (it lags a machine
        that moves, or one far from the profile's, for as long). A running mean over the first pairs, then
        remembering `drift_rounds` pairs, each step clipped."""
        self.measure_pairs += 1
        x = measured_log_ratio - ordinary_log_ratio - self._log_measured
        weight = max(1.0 / self.measure_pairs, self._drift_weight)
        self._log_measured += weight * min(max(x, -0.5), 0.5)
