"""Preset schema: the validated data an `AdaptiveController` is built from (pydantic, `extra="forbid"`).

A preset lists, per batch-size range ("bucket"), candidate (K, d) settings ordered from most conservative to
most aggressive with the EMA policy's knobs, and two measurements kept apart: acceptance per draft depth
(model + text) and the pass-cost profile (hardware). Everything is checked when the preset is parsed; the
model's depth D is known only once the model is loaded, and `for_depth(D)` fits a preset measured at another
depth to it (see `for_depth`).
"""

from __future__ import annotations

import difflib
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

# strict types (`"full_depth": "4"` or `true` is an error, not 4 or 1); lists may also be given as tuples
_STRICT = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True, strict=True)


def _lax_list() -> Any:
    return Field(strict=False)


class PresetError(ValueError):
    """An invalid or missing preset. Each line names the file (when there is one), the bucket and the field."""


class CandidateConfig(BaseModel):
    """One speculation setting. Also accepted in the compact form ``[k, d]``."""

    model_config = _STRICT

    k: int = Field(ge=0, le=64)
    """Draft tokens per round; 0 means plain full-depth decoding (then `d` must be 0)."""
    d: int = Field(default=0, ge=0)
    """Draft depth: loop iterations the draft runs (1 <= d < D when k > 0)."""
    theta_up: float | None = Field(default=None, ge=0.0, le=1.0)
    """Move one candidate up (more aggressive) when the acceptance EMA exceeds this; unset: the bucket's."""
    theta_down: float | None = Field(default=None, ge=0.0, le=1.0)
    """Move one candidate down when the acceptance EMA falls below this; unset: the bucket's."""
    prior: float | None = Field(default=None, ge=0.0, le=1.0)
    """Initial acceptance EMA E_0; unset: E_1 is the first measured round's rate."""

    @model_validator(mode="before")
    @classmethod
    def _compact(cls, data: Any) -> Any:
        if isinstance(data, (list, tuple)):
            if len(data) != 2:
                raise ValueError(f"a compact candidate is [k, d], got {list(data)!r}")
            return {"k": data[0], "d": data[1]}
        return data


class BucketConfig(BaseModel):
    """Candidates and EMA-policy knobs for batch sizes `min_batch..max_batch` (inclusive)."""

    model_config = _STRICT

    min_batch: int = Field(ge=1)
    """Smallest batch size (number of running requests) of the bucket."""
    max_batch: int | None = Field(default=None, ge=1)
    """Largest batch size; null only on the last bucket (unbounded)."""
    candidates: list[CandidateConfig] = _lax_list()
    """Ordered from most conservative to most aggressive; K=0 is allowed only first."""
    initial_index: int = 0
    """Candidate the bucket starts at."""
    beta: float = Field(default=0.2, gt=0.0, le=1.0)
    """EMA weight of the newest round: E_t = (1 - beta) E_{t-1} + beta r_t."""
    theta_up: float | None = Field(default=None, ge=0.0, le=1.0)
    """Default up-threshold for candidates that do not set their own."""
    theta_down: float | None = Field(default=None, ge=0.0, le=1.0)
    """Default down-threshold for candidates that do not set their own."""
    min_samples: int = Field(default=8, ge=1)
    """Measured rounds at a candidate before the first decision there."""
    interval: int = Field(default=4, ge=1)
    """Measured rounds between later decisions."""


class DisableConfig(BaseModel):
    """Phase 2: switch speculation off in a bucket when it does not pay, and probe it again with backoff."""

    model_config = _STRICT

    enabled: bool = True
    """Allow switching off even when the bucket's list has no K=0 candidate."""
    threshold: float = Field(default=0.25, ge=0.0, le=1.0)
    """Off when the most conservative speculative candidate's acceptance EMA is below this."""
    probe_base: int = Field(default=32, ge=1)
    """The first probe runs in this round after switching off (after one fewer plain rounds); doubled after every
    failed probe ..."""
    probe_cap: int = Field(default=1024, ge=1)
    """... up to this many rounds."""
    probe_rounds: int = Field(default=2, ge=1)
    """Speculative rounds one probe runs; their pooled acceptance decides."""
    probe_evidence: int = Field(default=32, ge=1)
    """Acceptance positions (readouts, and the probe's own drafts) since the last probe started before the agreement
    estimate may call the next one early (docs/adaptive.md "EMA policy")."""


class AcceptanceConfig(BaseModel):
    """Offline acceptance per draft depth (docs/adaptive.md "Acceptance"), measured by the tuner."""

    model_config = _STRICT

    alpha: list[Annotated[float, Field(ge=0.0, le=1.0)]] = _lax_list()
    """[D] greedy agreement of the depth-d readout with full depth along greedy trajectories, d = 1..D."""
    rho: list[Annotated[float, Field(ge=0.0, le=1.0)]] = _lax_list()
    """[D] lag-1 persistence of those agreements (0: independent positions)."""
    positions: int = Field(default=0, ge=0)
    """Generated positions the numbers were measured on (0: assumed, not measured)."""

    @model_validator(mode="after")
    def _lengths(self) -> AcceptanceConfig:
        if len(self.alpha) != len(self.rho):
            raise ValueError(f"alpha has {len(self.alpha)} depths but rho has {len(self.rho)}")
        if not self.alpha:
            raise ValueError("alpha: at least one depth is required")
        return self


Seconds = Annotated[float, Field(ge=0.0, allow_inf_nan=False)]


class CostConfig(BaseModel):
    """Pass-cost profile of the hardware (control/passcost.py; docs/adaptive.md "Pricing plans by passes")."""

    model_config = _STRICT

    positions: list[Annotated[int, Field(ge=1)]] = _lax_list()
    """Grid of pass widths n (positions in one loop pass), strictly increasing."""
    pass_seconds: list[Seconds] = _lax_list()
    """w(n) at each grid width: the part of one loop pass that grows with its positions."""
    request_seconds: Seconds
    """g: seconds a loop pass adds per request."""
    request_context_seconds: Seconds
    """h: seconds a loop pass adds per request and token of its context (reading that request's keys/values)."""
    query_context_seconds: Seconds = 0.0
    """a: seconds a loop pass adds per position and token of context (its attention scores)."""
    step_seconds: tuple[Seconds, Seconds, Seconds] = _lax_list()
    """A runner step's own cost (building its context): s0 + s_r per request + s_n per position."""
    embed_seconds: tuple[Seconds, Seconds] = _lax_list()
    """Embedding a step's tokens (Huginn: its prelude): e0 + e_n per position."""
    readout_seconds: tuple[Seconds, Seconds] = _lax_list()
    """One depth's readout: ro0 + ro_n per position."""
    round_seconds: tuple[Seconds, Seconds] = _lax_list()
    """A decode round's work outside the runner (schedule, sample, commit, control): o0 + o_B per request."""
    speculative_seconds: tuple[Seconds, Seconds, Seconds] = _lax_list()
    """A speculative round's extra work outside the runner: v0 + v_K per draft step + v_n per verified position."""

    @model_validator(mode="after")
    def _shape(self) -> CostConfig:
        if not self.positions or self.positions != sorted(set(self.positions)):
            raise ValueError(f"positions: {self.positions} must be non-empty and strictly increasing")
        if len(self.pass_seconds) != len(self.positions):
            raise ValueError(
                f"pass_seconds: {len(self.positions)} pass widths need {len(self.positions)} entries, "
                f"got {len(self.pass_seconds)}"
            )
        return self


class AdaptiveSpecConfig(BaseModel):
    """A validated adaptive-speculation preset for one model (family) on one kind of hardware."""

    model_config = _STRICT

    model: str
    """Model (checkpoint folder) name the preset is for."""
    model_type: str | None = None
    """config.json `model_type` of the family it was tuned or derived for (None: any family, as the generic preset):
    a preset matched to a checkpoint by name only serves that family (lookup.py `find_preset`)."""
    hardware: str = "any"
    """Hardware tag the numbers are for, e.g. "h100-80g", "cpu"."""
    full_depth: int = Field(ge=1)
    """Loop depth D the preset was measured or derived at."""
    buckets: list[BucketConfig] = _lax_list()
    """Ordered, non-overlapping batch-size ranges covering 1..unbounded."""
    disable: DisableConfig = DisableConfig()
    """Switching speculation off and probing it again (EMA policy); `enabled` also lets the goodput policy run
    plain decoding in a bucket whose candidates have no K = 0."""
    acceptance: AcceptanceConfig | None = None
    """Measured acceptance per draft depth (the online estimate's prior); None: learned online only."""
    cost: CostConfig
    """The pass-cost profile every plan is priced by."""
    provenance: str | dict[str, Any] = ""
    """How and on what the numbers were measured or derived."""

    @model_validator(mode="after")
    def _check(self) -> AdaptiveSpecConfig:
        errors = _structure_errors(self)
        if errors:
            raise ValueError("\n".join(errors))
        return self

    # ------------------------------------------------------------------ depth
    def for_depth(self, full_depth: int) -> tuple[AdaptiveSpecConfig, str | None]:
        """This preset fitted to a model of depth `full_depth`, and what was changed (None: nothing).

        At another depth than the preset's: every candidate's d is rescaled, d' = clamp(⌊d·D'/D + ½⌋, 1, D'-1)
        (halves round up; a candidate that becomes equal to an earlier one of its bucket is dropped; plain only below
        D' = 2), and the acceptance per depth is interpolated at the same relative depth d'/D' (linear between the
        measured depths; α below the first measured depth falls linearly to 0 at depth 0); the persistence alike.
        The pass costs do not depend on the depth. The online estimates correct the rest within rounds.
        """
        if full_depth < 1:
            raise PresetError(f"full depth {full_depth} must be >= 1")
        if full_depth == self.full_depth:
            return self, None
        data = self.model_dump()
        data["full_depth"] = full_depth
        data["buckets"] = [_scale_bucket(b, self.full_depth, full_depth) for b in self.buckets]
        if self.acceptance is not None:
            alpha = _rescale_depths(self.acceptance.alpha, full_depth)
            alpha[-1] = 1.0
            data["acceptance"] = dict(
                data["acceptance"], alpha=alpha, rho=_rescale_depths(self.acceptance.rho, full_depth)
            )
        # what was changed: a preset without acceptance (the generic default.json) has none to interpolate
        interpolated = ", acceptance interpolated at the same relative depth" if self.acceptance is not None else ""
        note = (
            f"measured at depth {self.full_depth}, the model runs {full_depth}: candidates' d rescaled by "
            f"{full_depth}/{self.full_depth}{interpolated}"
        )
        return AdaptiveSpecConfig.model_validate(data), note

    # ------------------------------------------------------------------ parsing
    @classmethod
    def parse(cls, data: Any, source: str | None = None) -> AdaptiveSpecConfig:
        """Validate plain data (e.g. parsed JSON); errors become `PresetError` lines "path: message"."""
        try:
            return cls.model_validate(data)
        except ValidationError as err:
            prefix = f"{source}: " if source else ""
            raise PresetError("\n".join(prefix + line for line in format_validation_error(err))) from None


def format_validation_error(err: ValidationError) -> list[str]:
    """Pydantic errors as lines like "buckets[0].beta: Input should be greater than 0 (got 0.0)"."""
    lines = []
    for e in err.errors():
        path = ""
        for part in e["loc"]:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        msg = e["msg"].removeprefix("Value error, ")
        value = e.get("input")
        if e["type"] == "extra_forbidden" and e["loc"]:  # a misspelt key: the known key it is closest to, if any
            close = difflib.get_close_matches(str(e["loc"][-1]), _preset_keys(), n=1)
            msg += f" (did you mean {close[0]!r}?)" if close else ""
        elif e["type"] not in ("value_error", "missing") and isinstance(value, (int, float, str, bool)):
            msg += f" (got {value!r})"
        for line in msg.split("\n"):
            lines.append(f"{path}: {line}" if path else line)
    return lines


def _preset_keys() -> list[str]:
    """Every key a preset file's sections take (the sections' fields, all levels)."""
    models = (AdaptiveSpecConfig, BucketConfig, CandidateConfig, DisableConfig, AcceptanceConfig, CostConfig)
    return sorted({name for model in models for name in model.model_fields})


def _structure_errors(cfg: AdaptiveSpecConfig) -> list[str]:
    errors: list[str] = []
    c = cfg.cost
    terms = [*c.pass_seconds, c.request_seconds, c.request_context_seconds, c.query_context_seconds, *c.step_seconds,
             *c.embed_seconds, *c.readout_seconds, *c.round_seconds]  # fmt: skip
    if not any(terms):
        errors.append(
            "cost: every term of a plain round's cost is zero (speculative_seconds, which only speculative "
            "rounds add, does not count); a plain round must cost something (plans are priced by their time)"
        )
    if cfg.acceptance is not None and len(cfg.acceptance.alpha) != cfg.full_depth:
        errors.append(f"acceptance.alpha: {len(cfg.acceptance.alpha)} depths, but full_depth is {cfg.full_depth} "
                      "(one agreement per draft depth 1..D)")  # fmt: skip
    if not cfg.buckets:
        return [*errors, "buckets: at least one bucket is required"]
    last = len(cfg.buckets) - 1
    for i, b in enumerate(cfg.buckets):
        where = f"buckets[{i}]"
        hi = "inf" if b.max_batch is None else str(b.max_batch)
        if b.max_batch is not None and b.max_batch < b.min_batch:
            errors.append(f"{where}: max_batch={b.max_batch} must be >= min_batch={b.min_batch}")
        if i == 0 and b.min_batch != 1:
            errors.append(f"{where}: min_batch={b.min_batch} must be 1 (batch sizes 1..{b.min_batch - 1} uncovered)")
        if i > 0:
            prev = cfg.buckets[i - 1]
            if prev.max_batch is not None and b.min_batch <= prev.max_batch:
                errors.append(
                    f"{where}: range {b.min_batch}..{hi} overlaps buckets[{i - 1}] ({prev.min_batch}..{prev.max_batch})"
                )
            elif prev.max_batch is not None and b.min_batch > prev.max_batch + 1:
                errors.append(
                    f"{where}: min_batch={b.min_batch} leaves a gap after buckets[{i - 1}] "
                    f"(max_batch={prev.max_batch}): batch sizes {prev.max_batch + 1}..{b.min_batch - 1} uncovered"
                )
        if i < last and b.max_batch is None:
            errors.append(f"{where}: max_batch=null (unbounded) is only allowed on the last bucket")
        if i == last and b.max_batch is not None:
            errors.append(f"{where}: max_batch={b.max_batch} must be null on the last bucket (cover all batch sizes)")
        if b.theta_up is not None and b.theta_down is not None and b.theta_down > b.theta_up:
            errors.append(f"{where}: theta_down={b.theta_down} must be <= theta_up={b.theta_up}")
        if not b.candidates:
            errors.append(f"{where}.candidates: must not be empty")
            continue
        if not 0 <= b.initial_index < len(b.candidates):
            errors.append(
                f"{where}.initial_index: {b.initial_index} out of range for {len(b.candidates)} candidates "
                f"(0..{len(b.candidates) - 1})"
            )
        errors.extend(_candidate_errors(cfg, i, b))
    if cfg.disable.probe_cap < cfg.disable.probe_base:
        errors.append(f"disable: probe_cap={cfg.disable.probe_cap} must be >= probe_base={cfg.disable.probe_base}")
    return errors


def _candidate_errors(cfg: AdaptiveSpecConfig, i: int, b: BucketConfig) -> list[str]:
    errors: list[str] = []
    seen: dict[tuple[int, int], int] = {}
    for j, c in enumerate(b.candidates):
        where = f"buckets[{i}].candidates[{j}]"
        if c.k == 0:
            if c.d != 0:
                errors.append(f"{where}: d={c.d} must be 0 when k=0 (plain decoding)")
            # the EMA policy moves on the acceptance of drafts, which plain rounds have none of
            unused = [name for name in ("theta_up", "theta_down", "prior") if getattr(c, name) is not None]
            if unused:
                errors.append(f"{where}: {', '.join(unused)} on k=0 (plain decoding) would do nothing (plain rounds "
                              "draft nothing to measure); leave them out")  # fmt: skip
            if j != 0:
                errors.append(f"{where}: k=0 (plain decoding) is only allowed as the first candidate")
        else:
            if c.d < 1:
                errors.append(f"{where}: d={c.d} must be >= 1 when k={c.k}")
            if c.d >= cfg.full_depth:
                errors.append(f"{where}: d={c.d} must be < full depth {cfg.full_depth}")
            up = c.theta_up if c.theta_up is not None else b.theta_up
            down = c.theta_down if c.theta_down is not None else b.theta_down
            if up is None:
                errors.append(f"{where}: theta_up missing (set it on the candidate or the bucket)")
            if down is None:
                errors.append(f"{where}: theta_down missing (set it on the candidate or the bucket)")
            if up is not None and down is not None and down > up:
                errors.append(f"{where}: theta_down={down} must be <= theta_up={up}")
        if (c.k, c.d) in seen:
            errors.append(f"{where}: duplicate of candidates[{seen[(c.k, c.d)]}] (k={c.k}, d={c.d})")
        seen.setdefault((c.k, c.d), j)
    return errors


def _scale_bucket(b: BucketConfig, from_depth: int, to_depth: int) -> dict[str, Any]:
    """Rescale a bucket's draft depths (the documented "scale" rule); returns plain data."""
    kept: list[dict[str, Any]] = []
    position: dict[tuple[int, int], int] = {}
    initial = 0
    for j, c in enumerate(b.candidates):
        data = c.model_dump()
        if c.k > 0:
            if to_depth < 2:
                continue
            data["d"] = min(max(int(c.d * to_depth / from_depth + 0.5), 1), to_depth - 1)
        key = (data["k"], data["d"])
        if key not in position:
            position[key] = len(kept)
            kept.append(data)
        if j <= b.initial_index:
            initial = position[key]
    if not kept:
        kept.append({"k": 0, "d": 0})
    out = b.model_dump()
    out.update(candidates=kept, initial_index=min(initial, len(kept) - 1))
    return out


def _rescale_depths(values: list[float], to_depth: int) -> list[float]:
    """Per-depth values measured at depths 1..D, read at the same relative depths of 1..to_depth."""
    depth = len(values)
    xs = [0.0] + [j / depth for j in range(1, depth + 1)]
    ys = [0.0] + list(values)
    out = []
    for j in range(1, to_depth + 1):
        x = j / to_depth
        i = next(i for i in range(1, len(xs)) if xs[i] >= x - 1e-12)
        w = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        out.append(round(min(max(ys[i - 1] + w * (ys[i] - ys[i - 1]), 0.0), 1.0), 6))
    return out
