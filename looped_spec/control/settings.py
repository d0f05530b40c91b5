"""The controller's tunables, in one place (docs/adaptive.md "Tunables" says why each has its value).

Everything else the controller runs on is measured (the preset's acceptance and pass costs, the online
estimates) or is preset data (buckets, candidates, and the EMA policy's β, θ, probe backoff).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ControlSettings:
    #: goodput: rounds between two decisions of a bucket (a new batch size or bucket decides at once)
    decision_interval: int = 16
    #: goodput: a speculative plan replaces another only when predicted this much faster (relative)
    hysteresis: float = 0.03
    #: goodput: speculation starts only when predicted this much faster than plain decoding (relative)
    plain_margin: float = 0.05
    #: acceptance: positions per depth the online estimate remembers
    acceptance_memory: float = 128.0
    #: acceptance: positions the preset's agreement counts as before any online readout
    prior_weight: float = 16.0
    #: positions per round the counterfactual readouts aim for (a measured round reads out about one per request) ...
    readout_positions: float = 4.0
    #: ... and the share of decode time they may cost at most
    readout_budget: float = 0.03
    #: cost: rounds the drift factor (measured ÷ predicted round time) remembers
    drift_rounds: float = 64.0
    #: a batch stays in its bucket while its size is within this factor of the bucket's range
    bucket_stickiness: float = 1.25
    #: early exit: committed tokens the exit-depth histogram remembers
    exit_memory: float = 256.0
    #: ema: positions read out since its last probe before the readouts may call the next one
    probe_evidence: int = 32

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name}={value!r} must be a number")
        for name in ("decision_interval", "probe_evidence"):
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"{name}={getattr(self, name)!r} must be an integer")
        if self.decision_interval < 1:
            raise ValueError(f"decision_interval={self.decision_interval} must be >= 1")
        for name in ("hysteresis", "plain_margin"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1)")
        for name in ("acceptance_memory", "drift_rounds", "exit_memory"):
            if getattr(self, name) <= 0.0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        if self.prior_weight < 0.0:
            raise ValueError(f"prior_weight={self.prior_weight} must be >= 0")
        if self.readout_positions <= 0.0:
            raise ValueError(f"readout_positions={self.readout_positions} must be > 0")
        if not 0.0 < self.readout_budget <= 1.0:
            raise ValueError(f"readout_budget={self.readout_budget} must be in (0, 1]")
        if self.bucket_stickiness < 1.0:
            raise ValueError(f"bucket_stickiness={self.bucket_stickiness} must be >= 1")
        if self.probe_evidence < 1:
            raise ValueError(f"probe_evidence={self.probe_evidence} must be >= 1")
