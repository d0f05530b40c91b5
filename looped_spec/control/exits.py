"""What early exit does to a plan's tokens and passes (docs/adaptive.md "Early exit"): a faded histogram of the
committed tokens' exit depths gives the acceptance a depth-d draft sees (`effective_alpha`) and, in skip mode, the
share of tokens still looping at every loop (`survival`), which narrows the passes the pass costs price.
"""

from __future__ import annotations

import numpy as np

#: Rounds between two refreshes of the pass prices that depend on the exit depths (they move slowly)
REFRESH = 16


class ExitDepths:
    """Faded counts of committed tokens per exit depth 1..D (about `memory` tokens remembered)."""

    def __init__(self, depth: int, memory: float) -> None:
        self.counts = np.zeros(depth)
        self.memory = memory
        self.skips = False
        self.seen = False  # any committed token's exit depth observed yet
        # bumped every `REFRESH` observed rounds: what prices passes by the survival may cache on it meanwhile
        self.version = 0
        self._since = 0

    def observe(self, depths: list[int], skips: bool) -> None:
        if not depths:
            return
        new = np.bincount(np.clip(np.asarray(depths), 1, len(self.counts)) - 1, minlength=len(self.counts))
        self.skips = skips
        self._fade_in(new, len(depths))

    def observe_full_depth(self, tokens: int) -> None:
        """A round none of whose requests exits early (early exit is a request's option): its `tokens` committed
        tokens ran every loop. Only once exits were seen; before, no exits is what the histogram stands for."""
        if self.seen and tokens > 0:
            new = np.zeros(len(self.counts))
            new[-1] = tokens
            self._fade_in(new, tokens)

    def _fade_in(self, new: np.ndarray, tokens: int) -> None:
        self.counts = self.counts * (self.memory / (self.memory + tokens)) + new
        self.seen = True
        self._since += 1
        if self._since >= REFRESH or self.version == 0:
            self.version, self._since = self.version + 1, 0

    @property
    def prices_passes(self) -> bool:
        """Whether the exit depths narrow the passes (skip mode, once an exit was seen): `survival()` is not None."""
        return self.skips and self.seen

    def exit_within(self) -> np.ndarray:
        """[D]: P(e <= d) for d = 1..D (zeros before any token was seen)."""
        total = self.counts.sum()
        return np.cumsum(self.counts) / total if total > 0.0 else np.zeros(len(self.counts))

    def effective_alpha(self, alpha: list[float]) -> list[float]:
        """[D]: what a depth-d draft sees accepted when exits within d always pass."""
        within = self.exit_within().tolist()
        return [w + (1.0 - w) * a for w, a in zip(within, alpha)]

    def survival(self) -> np.ndarray | None:
        """[D]: P(a token still loops at loop i+1) in skip mode; None in select mode or before any exit was seen."""
        if not self.prices_passes:
            return None
        within = self.exit_within()
        return np.concatenate([[1.0], 1.0 - within[:-1]])
