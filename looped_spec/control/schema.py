"""Preset schema: the validated data an `AdaptiveController` is built from (pydantic, `extra="forbid"`).

A preset lists, per batch-size range ("bucket"), the candidate (K, d) settings ordered from most
conservative to most aggressive, and the knobs of the EMA policy. Everything is checked when the preset
is parsed; the model's full depth D is only known once the model is loaded, so `validate_for_depth(D)` /
`for_depth(D)` check the depths later.

Depth rule (`depth_rule`):
- ``"exact"``: every `d` is an absolute loop count and must be < D of the model it is used with.
- ``"scale"``: the `d` values were written for `full_depth` and are rescaled to the model's D:
  ``d' = clamp(floor(d * D / full_depth + 0.5), 1, D - 1)``. Candidates that become identical to an
  earlier one of the same bucket are dropped (the earlier, more conservative position wins, its
  thresholds are kept), and `initial_index` follows its candidate. For D < 2 every speculative candidate
  is dropped; a bucket left empty becomes ``[K=0]`` (plain decoding).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from looped_spec.control.costprofile import CONTEXT_FIELDS

_STRICT = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


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
    candidates: list[CandidateConfig]
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
    """Plain rounds before the first probe; doubled after every failed probe ..."""
    probe_cap: int = Field(default=1024, ge=1)
    """... up to this many rounds."""
    probe_rounds: int = Field(default=2, ge=1)
    """Speculative rounds one probe runs; their pooled acceptance (and speed) decide."""
    use_timing: bool = False
    """EMA policy: also compare measured tokens/s of speculative and plain rounds of the same batch size."""


class AcceptanceConfig(BaseModel):
    """Offline acceptance per draft depth (docs/adaptive.md "acceptance model"), measured by the tuner."""

    model_config = _STRICT

    alpha: list[Annotated[float, Field(ge=0.0, le=1.0)]]
    """[D] greedy agreement of the depth-d readout with full depth along greedy trajectories, d = 1..D."""
    rho: list[Annotated[float, Field(ge=0.0, le=1.0)]]
    """[D] lag-1 persistence of those agreements (0: independent positions)."""
    positions: int = Field(default=0, ge=0)
    """Generated positions the numbers were measured on (0: assumed, not measured)."""
    spread: list[Annotated[float, Field(ge=0.0, le=0.5)]] | None = None
    """[D] standard deviation over the tuning prompts of each prompt's own agreement at depth d: how far apart
    texts pull requests under speculation (control/drain.py); None: not measured, no drain pricing."""

    @model_validator(mode="after")
    def _lengths(self) -> AcceptanceConfig:
        if len(self.alpha) != len(self.rho):
            raise ValueError(f"alpha has {len(self.alpha)} depths but rho has {len(self.rho)}")
        if self.spread is not None and len(self.spread) != len(self.alpha):
            raise ValueError(f"spread has {len(self.spread)} depths but alpha has {len(self.alpha)}")
        if not self.alpha:
            raise ValueError("alpha: at least one depth is required")
        return self


class CostConfig(BaseModel):
    """Round-cost profile of the hardware (docs/adaptive.md "cost profile"), measured by the tuner."""

    model_config = _STRICT

    batch_sizes: list[Annotated[int, Field(ge=1)]]
    """Profiled batch sizes, strictly increasing."""
    plain_seconds: list[Annotated[float, Field(gt=0.0)]]
    """Median seconds of one plain round at each profiled batch size."""
    coefficients: list[list[float]]
    """Per profiled batch size: seconds per d(K+1), per (D-d), per (D-d)(K+1), and per round."""
    # Context terms (optional, all or none; presets tuned before them have none and predict as before)
    reference_context: list[Annotated[float, Field(ge=0.0)]] | None = None
    """Per profiled batch size: mean context (tokens in the KV per request at a round's start) of the timed
    rounds, i.e. the contexts `plain_seconds` and `coefficients` are averaged over."""
    plain_intercept: list[float] | None = None
    """Per profiled batch size: seconds of a plain round extrapolated to an empty context."""
    plain_slope: list[Annotated[float, Field(ge=0.0)]] | None = None
    """Per profiled batch size: seconds a plain round adds per token of mean context."""
    intercept_coefficients: list[list[float]] | None = None
    """Per profiled batch size: the four coefficients (as `coefficients`) of a speculative round's intercept."""
    slope_coefficients: list[list[float]] | None = None
    """Per profiled batch size: the four coefficients of a speculative round's seconds per token of context."""

    @model_validator(mode="after")
    def _shape(self) -> CostConfig:
        n = len(self.batch_sizes)
        if n == 0:
            raise ValueError("batch_sizes: at least one profiled batch size is required")
        if self.batch_sizes != sorted(set(self.batch_sizes)):
            raise ValueError(f"batch_sizes {self.batch_sizes} must be strictly increasing")
        if len(self.plain_seconds) != n or len(self.coefficients) != n:
            raise ValueError(
                f"{n} batch sizes need {n} plain_seconds (got {len(self.plain_seconds)}) and {n} coefficient "
                f"rows (got {len(self.coefficients)})"
            )
        _check_rows("coefficients", self.coefficients)
        self._check_context(n)
        return self

    def _check_context(self, n: int) -> None:
        """The context terms come together, one value (or coefficient row) per profiled batch size."""
        terms = {name: getattr(self, name) for name in CONTEXT_FIELDS}
        missing = [name for name, value in terms.items() if value is None]
        if len(missing) == len(terms):
            return
        if missing:
            raise ValueError(f"context terms come together: {', '.join(missing)} missing")
        for name, value in terms.items():
            if len(value) != n:
                raise ValueError(f"{name}: {n} batch sizes need {n} entries, got {len(value)}")
        _check_rows("intercept_coefficients", terms["intercept_coefficients"])
        _check_rows("slope_coefficients", terms["slope_coefficients"])

    @property
    def has_context(self) -> bool:
        """True when the profile carries context terms."""
        return self.slope_coefficients is not None


def _check_rows(name: str, rows: list[list[float]]) -> None:
    for i, row in enumerate(rows):
        if len(row) != 4:
            raise ValueError(f"{name}[{i}]: expected 4 numbers, got {len(row)}")


class AdaptiveSpecConfig(BaseModel):
    """A validated adaptive-speculation preset for one model (family) on one kind of hardware."""

    model_config = _STRICT

    model: str
    """Model (checkpoint folder) name the preset is for."""
    hardware: str = "any"
    """Hardware tag the numbers are for, e.g. "h100-80g", "cpu"."""
    full_depth: int | None = Field(default=None, ge=1)
    """Loop depth D the numbers were derived for; required by depth_rule "scale"."""
    depth_rule: Literal["exact", "scale"] = "exact"
    """How `d` values meet a model's D (see the module docstring)."""
    buckets: list[BucketConfig]
    """Ordered, non-overlapping batch-size ranges covering 1..unbounded."""
    disable: DisableConfig = DisableConfig()
    """Phase 2 settings."""
    acceptance: AcceptanceConfig | None = None
    """Measured acceptance per draft depth (the goodput policy's prior); None: learned online only."""
    cost: CostConfig | None = None
    """Measured round-cost profile (the goodput policy's cost model); None: fitted online from timings."""
    provenance: str | dict[str, Any] = ""
    """How and on what the numbers were measured or derived."""

    @model_validator(mode="after")
    def _check(self) -> AdaptiveSpecConfig:
        errors = _structure_errors(self)
        if errors:
            raise ValueError("\n".join(errors))
        return self

    # ------------------------------------------------------------------ depth
    def depth_errors(self, full_depth: int) -> list[str]:
        """Problems of using this preset with a model of depth `full_depth` (empty: fine)."""
        if full_depth < 1:
            return [f"full depth {full_depth} must be >= 1"]
        errors = []
        if self.acceptance is not None and len(self.acceptance.alpha) != full_depth:
            errors.append(
                f"acceptance.alpha: measured for {len(self.acceptance.alpha)} depths, the model has D={full_depth}"
            )
        if self.depth_rule == "scale":
            return errors
        for i, bucket in enumerate(self.buckets):
            for j, cand in enumerate(bucket.candidates):
                if cand.k > 0 and cand.d >= full_depth:
                    errors.append(f"buckets[{i}].candidates[{j}]: d={cand.d} must be < full depth {full_depth}")
        return errors

    def validate_for_depth(self, full_depth: int) -> None:
        """Raise `PresetError` naming every candidate that cannot run on a model of depth `full_depth`."""
        errors = self.depth_errors(full_depth)
        if errors:
            raise PresetError("\n".join(errors))

    def for_depth(self, full_depth: int) -> AdaptiveSpecConfig:
        """This preset as it applies to depth `full_depth`: validated ("exact") or rescaled ("scale")."""
        self.validate_for_depth(full_depth)
        if self.depth_rule == "exact":
            return self
        buckets = [_scale_bucket(b, self.full_depth or full_depth, full_depth) for b in self.buckets]
        data = self.model_dump()
        data.update(full_depth=full_depth, depth_rule="exact", buckets=buckets)
        return AdaptiveSpecConfig.model_validate(data)

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
        if e["type"] not in ("value_error", "missing") and isinstance(value, (int, float, str, bool)):
            msg += f" (got {value!r})"
        for line in msg.split("\n"):
            lines.append(f"{path}: {line}" if path else line)
    return lines


def _structure_errors(cfg: AdaptiveSpecConfig) -> list[str]:
    errors: list[str] = []
    if not cfg.buckets:
        return ["buckets: at least one bucket is required"]
    if cfg.depth_rule == "scale" and cfg.full_depth is None:
        errors.append("full_depth: required when depth_rule is 'scale'")
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
            if j != 0:
                errors.append(f"{where}: k=0 (plain decoding) is only allowed as the first candidate")
        else:
            if c.d < 1:
                errors.append(f"{where}: d={c.d} must be >= 1 when k={c.k}")
            if cfg.full_depth is not None and c.d >= cfg.full_depth:
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
