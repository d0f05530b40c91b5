"""What the plans committed on this text: the goodput policy's measurement of E (docs/adaptive.md "Realized tokens").

The goodput policy's acceptance side is the Markov expectation `markov_tokens(α_d, ρ_d, K)`, with α_d learned
online and ρ_d the tuning text's persistence. Two measurements correct it where the text differs:

- Per plan (K, d): the committed tokens of its full-K request-rounds (every request drafted K), discounted by
  the positions committed since (any plan's, `REALIZED_MEMORY`: the stretch of text α_d remembers too), so a
  plan that ran on other text does not carry that text's tokens into the next batch for long. Used once the plan
  has `REALIZED_MIN` request-rounds, with the expectation as a prior worth `REALIZED_PRIOR` request-rounds.
- Per draft depth d (and pooled over all depths): the ratio of the accepted draft tokens the plans committed to
  the accepted tokens the Markov expectation predicted for them at the α_d of their round. α_d tracks the text;
  what the ratio keeps is how the chain's shape (ρ_d) misjudges this text, which changes slowly, so it is
  remembered over `BIAS_MEMORY` positions and carries to every K at that depth — plans that never ran included.
  Measured on tiny-ouro's evaluation prompts (16 of them, exact replay of their recorded match bits, full-K
  rounds only): ρ is 0.10 / 0.04 at d = 1 / 2 where the tuning text's is 0.37 / 0.30, and plans with K = 1..5
  commit 5–13 % more accepted tokens than the chain with the tuned ρ predicts at d = 1, 3–7 % at d = 2, within
  2 % at d = 3 (the tuning text's own replay agrees with its chain within 2 %); (1, 2), which adaptive never ran
  at B = 8, was priced from a chain 7 % short on its accepted tokens.
  The depth's ratio shrinks to the pooled one, and that to 1, with `BIAS_PRIOR` expected accepted tokens of prior.
"""

from __future__ import annotations

from looped_spec.control.plan import RoundFeedback

#: Committed positions (any plan's) over which the plans' own committed tokens are remembered (discounted).
REALIZED_MEMORY = 400.0
#: The corrected Markov expectation counts as this many request-rounds against a plan's own tokens per round.
REALIZED_PRIOR = 32.0
#: A plan's own tokens count once it has run this many full-K request-rounds: fewer are a few neighbouring
#: positions of one text (tiny-ouro, B = 1: (3, 1) dropped after 5 rounds of a hard stretch committing 1.6
#: tokens per round, where the whole text commits 2.5).
REALIZED_MIN = 32.0
#: Committed positions over which the chain's error per depth is remembered: ten times α_d's memory, as the
#: error is a property of the text's shape, not of the stretch being decoded.
BIAS_MEMORY = 4000.0
#: Expected accepted tokens of prior (ratio 1) the error ratios shrink with: a K = 1 request-round accepts a
#: Bernoulli(α) token, so ~200 of them pin the ratio to ±5 %.
BIAS_PRIOR = 200.0
#: A scale below this is folded into the stored values before it underflows.
_FOLD_BELOW = 1e-100


class _Faded:
    """Sums that all fade by memory / (memory + committed) per round through one shared scale (one
    multiplication per round, whatever the number of sums); the true values are the stored ones × `scale`."""

    __slots__ = ("memory", "scale", "sums")

    def __init__(self, memory: float) -> None:
        self.memory = memory
        self.scale = 1.0
        self.sums: dict = {}  # key -> [x, y]

    def fade(self, committed: int) -> None:
        scale = self.scale * self.memory / (self.memory + committed)
        if scale < _FOLD_BELOW:
            for pair in self.sums.values():
                pair[0] *= scale
                pair[1] *= scale
            scale = 1.0
        self.scale = scale

    def add(self, key, x: float, y: float) -> None:
        pair = self.sums.setdefault(key, [0.0, 0.0])
        pair[0] += x / self.scale
        pair[1] += y / self.scale

    def get(self, key) -> tuple[float, float] | None:
        pair = self.sums.get(key)
        return None if pair is None else (pair[0] * self.scale, pair[1] * self.scale)


class RealizedTokens:
    """Committed tokens of the plans that ran, per plan and as the Markov expectation's error per depth."""

    __slots__ = ("plans", "errors")

    def __init__(self) -> None:
        self.plans = _Faded(REALIZED_MEMORY)  # (k, d) -> (committed tokens, full-K request-rounds)
        self.errors = _Faded(BIAS_MEMORY)  # d (0: all depths) -> (accepted tokens, expected accepted tokens)

    def observe(self, fb: RoundFeedback, committed: int, expected: float) -> None:
        """Fold in a round: its `committed` positions fade everything; a speculative round without early exit adds
        the tokens of its requests that drafted the plan's full K, and `expected` (the Markov tokens per
        request-round of (fb.k, fb.d) at this round's α_d; ignored for plain rounds) prices them."""
        self.plans.fade(committed)
        self.errors.fade(committed)
        if fb.k <= 0 or fb.exit_depths:  # with early exit, drafts that exit within d pass unverified (ExitDepths)
            return
        rounds = fb.num_proposed.count(fb.k)
        if not rounds:
            return
        if rounds == len(fb.num_proposed):  # the usual round: every request drafted K (counted in C, no loop)
            tokens = committed
        else:
            tokens = sum(a + 1 for a, p in zip(fb.num_accepted, fb.num_proposed) if p == fb.k)
        self.plans.add((fb.k, fb.d), tokens, rounds)
        accepted, predicted = tokens - rounds, rounds * (expected - 1.0)
        self.errors.add(fb.d, accepted, predicted)
        self.errors.add(0, accepted, predicted)

    def of(self, k: int, d: int) -> tuple[float, float] | None:
        """(committed tokens, full-K request-rounds) of (K, d), discounted; None if it never ran."""
        return self.plans.get((k, d))

    def measured(self, k: int, d: int, own: bool = False) -> bool:
        """Whether (K, d)'s tokens are a measurement: REALIZED_MIN request-rounds of its own, or (unless `own`) its
        depth's error resting on BIAS_PRIOR expected accepted tokens (the plan's own rounds fade within
        ~REALIZED_MEMORY positions, the depth's error over BIAS_MEMORY)."""
        seen = self.of(k, d)
        if seen is not None and seen[1] >= REALIZED_MIN:
            return True
        if own:
            return False
        depth = self.errors.get(d)
        return depth is not None and depth[1] >= BIAS_PRIOR

    def error(self, d: int) -> float:
        """Accepted tokens committed ÷ predicted by the chain at depth d, shrunk to the pooled ratio (and that
        to 1) with BIAS_PRIOR expected tokens of prior."""
        pooled = self.errors.get(0) or (0.0, 0.0)
        ratio = (pooled[0] + BIAS_PRIOR) / (pooled[1] + BIAS_PRIOR)
        own = self.errors.get(d) or (0.0, 0.0)
        return (own[0] + BIAS_PRIOR * ratio) / (own[1] + BIAS_PRIOR)

    def tokens(self, k: int, d: int, expected: float) -> float:
        """Committed tokens per request-round of (K, d): the Markov `expected` with the depth's accepted tokens
        corrected by `error(d)`, then the plan's own tokens once it has REALIZED_MIN request-rounds."""
        if k <= 0:
            return 1.0
        corrected = min(max(1.0 + (expected - 1.0) * self.error(d), 1.0), k + 1.0)
        seen = self.of(k, d)
        if seen is None or seen[1] < REALIZED_MIN:
            return corrected
        return (corrected * REALIZED_PRIOR + seen[0]) / (REALIZED_PRIOR + seen[1])
