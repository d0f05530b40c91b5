"""The controller's tunables, in one place (docs/adaptive.md "Tunables" says why each has its value).

Everything else the controller runs on is measured (the preset's acceptance and pass costs, the online
estimates) or is preset data (buckets, candidates, and the EMA policy's β, θ, probes).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields


def _tunable(default: float, allowed: str, policy: str | None = None, timed: bool = False):
    """A field with its default, its allowed interval, "[lo, hi)" style ("inf" for no bound), the one policy it
    steers (None: both), and whether only rounds with a measured time read it (loop passes time no round)."""
    return field(default=default, metadata={"allowed": allowed, "policy": policy, "timed": timed})


def _within(value: float, allowed: str) -> bool:
    lo, hi = (float(x) for x in allowed[1:-1].split(","))
    above = lo <= value if allowed[0] == "[" else lo < value
    below = value <= hi if allowed[-1] == "]" else value < hi
    return above and below


@dataclass(frozen=True)
class ControlSettings:
    #: goodput: rounds between two decisions of a bucket (a new batch size or bucket decides at once)
    decision_interval: int = _tunable(4, "[1, inf)", "goodput")
    #: goodput: a speculative plan replaces another only when predicted this much faster (relative)
    hysteresis: float = _tunable(0.03, "[0, 1)", "goodput")
    #: goodput: speculation starts only when predicted this much faster than plain decoding (relative)
    plain_margin: float = _tunable(0.05, "[0, 1)", "goodput")
    #: positions per depth the online agreement estimate remembers, and committed tokens the exit-depth histogram does
    acceptance_memory: float = _tunable(128.0, "(0, inf)")
    #: goodput: positions per depth a request's own agreement estimate remembers (the batch's agreement, which only
    #: the goodput policy prices plans with; the EMA policy's probes read the overall estimate)
    request_memory: float = _tunable(16.0, "(0, inf)", "goodput")
    #: what a prior counts as, a share of the memory it starts: the preset's agreement in the online estimate
    #: (× `acceptance_memory` positions), the online estimate in a request's own (× `request_memory`)
    prior_share: float = _tunable(0.125, "[0, inf)")
    #: positions per round the counterfactual readouts aim for (a measured round reads out about one per request) ...
    readout_positions: float = _tunable(4.0, "(0, inf)")
    #: ... and the share of decode time they may cost at most
    readout_budget: float = _tunable(0.03, "(0, 1]")
    #: cost: rounds the drift factor (measured ÷ predicted round time) remembers, and pairs what measuring adds
    drift_rounds: float = _tunable(64.0, "[1, inf)", timed=True)
    #: goodput: rounds between two plain rounds run beside a speculative plan, to price speculation against plain ...
    price_probe_interval: int = _tunable(32, "[2, inf)", "goodput", timed=True)
    #: ... and the pairs of rounds the relative price remembers
    price_memory: float = _tunable(16.0, "[1, inf)", "goodput", timed=True)
    #: a batch stays in its bucket while its size is within this factor of the bucket's range
    bucket_stickiness: float = _tunable(1.25, "[1, inf)")

    def set_for_another_policy(self, policy: str) -> list[str]:
        """The tunables set away from their defaults that only another policy than `policy` reads (they would do
        nothing)."""
        return [
            f.name
            for f in fields(self)
            if f.metadata["policy"] not in (None, policy) and getattr(self, f.name) != f.default
        ]

    def set_for_timed_rounds(self) -> list[str]:
        """The tunables set away from their defaults that only timed rounds read (the drift factor, the price probes):
        on loop passes, which time no round, they would do nothing."""
        return [f.name for f in fields(self) if f.metadata["timed"] and getattr(self, f.name) != f.default]

    def __post_init__(self) -> None:
        for f in fields(self):
            value, integer = getattr(self, f.name), f.type == "int"
            if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
                raise ValueError(f"{f.name}={value!r} must be {'an integer' if integer else 'a number'}")
            if not _within(value, f.metadata["allowed"]):
                raise ValueError(f"{f.name}={value!r} must be in {f.metadata['allowed']}")
