"""Engine configuration: `EngineConfig` (every engine option, validated at the boundary) and
`SpeculativeConfig` (a fixed speculation plan, one of the values `EngineConfig.speculation` takes).

`LoopedSpecEngine(model, **options)` builds an `EngineConfig` from its keyword options; a wrong key or
value is a `ValueError` that names the option.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from typing import Any, Literal

import torch
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    ValidationError,
    field_validator,
    model_validator,
)

from looped_spec.control.controller import DEFAULT_POLICY
from looped_spec.control.settings import ControlSettings
from looped_spec.sampling_params import Integer, Real


class SpeculativeConfig(BaseModel):
    """A fixed speculation plan: draft `k` tokens with the first `d` loops (k = 0: plain decoding). Strict types:
    `k="2"` or `k=True` is an error."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    k: Integer = Field(2, ge=0, le=64, description="Draft tokens per round.")
    d: Integer = Field(1, ge=0, description="Loops used by the draft (1 <= d < full depth; 0 only with k = 0).")
    measure_depths: bool = Field(False, description="Also read out other depths (counterfactual acceptance).")
    stop_margin: Real | None = Field(
        None,
        gt=0.0,
        le=1.0,
        description="Per-token stopping (docs/adaptive.md): a request stops drafting at the first draft whose "
        "depth-d top-two probability margin is below this (that draft is not proposed; a first draft below it "
        "makes the round plain for the request), up to k; under early exit too (a position that exits within d is the "
        "target's own sample and never stops its row). None = always k.",
    )

    @model_validator(mode="before")
    @classmethod
    def _plain_has_no_depth(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("k") == 0 and "d" not in data:
            return {**data, "d": 0}  # SpeculativeConfig(k=0) is plain decoding, written k=0, d=0
        return data

    @model_validator(mode="after")
    def _depth_with_drafts(self) -> SpeculativeConfig:
        if self.k > 0 and self.d < 1:  # plain decoding is written {"k": 0, "d": 0}, as in the presets
            raise ValueError(f"d={self.d} must be >= 1 when k={self.k} (d = 0 only means plain decoding, k = 0)")
        if self.k == 0 and self.d != 0:  # a draft depth with nothing to draft would do nothing
            raise ValueError(f"d={self.d} with k=0: plain decoding drafts nothing (write k=0, d=0, or 'off')")
        if self.k == 0 and self.stop_margin is not None:  # nothing is drafted, so no draft stops
            raise ValueError(f"stop_margin={self.stop_margin} with k=0: plain decoding drafts nothing to stop")
        if self.stop_margin is not None and self.measure_depths:
            raise ValueError("stop_margin: not together with measure_depths (a measured round drafts every k)")
        return self


def parse_speculation(speculation: Any) -> Any:
    """'off' | 'adaptive' | 'K,d' | SpeculativeConfig | dict -> 'off' | 'adaptive' | SpeculativeConfig.

    Errors name the field inside `speculation` that is wrong: ``speculation.K: unknown field (did you mean 'k'?)``,
    ``speculation.k=65: Input should be less than or equal to 64``.
    """
    if speculation is None:
        return "off"
    if isinstance(speculation, SpeculativeConfig):
        return speculation
    if isinstance(speculation, dict):
        return _speculative_config(speculation)
    if isinstance(speculation, str):
        text = speculation.strip().lower()
        if text in ("off", "adaptive"):
            return text
        parts = text.replace(" ", "").split(",")
        if len(parts) == 2 and all(p.isascii() and p.isdigit() for p in parts):  # isdigit() alone takes "²"
            return _speculative_config({"k": int(parts[0]), "d": int(parts[1])})
    raise ValueError("use 'off', 'adaptive', 'K,d' or SpeculativeConfig(k=..., d=...)")


def _speculative_config(data: dict[str, Any]) -> SpeculativeConfig:
    try:
        return SpeculativeConfig(**data)
    except ValidationError as exc:
        fields = list(SpeculativeConfig.model_fields)
        problems = []
        for error in exc.errors():
            name = ".".join(str(part) for part in error["loc"])
            if error["type"] == "extra_forbidden":
                problems.append(_unknown_field("speculation", name, fields))
            elif name:
                problems.append(f"speculation.{name}={data.get(name)!r}: {error['msg'].removeprefix('Value error, ')}")
            else:
                problems.append(f"speculation: {error['msg'].removeprefix('Value error, ')}")
        raise ValueError("; ".join(problems)) from None


class EngineConfig(BaseModel):
    """Every option of `LoopedSpecEngine` but the model. Strict: `max_batch_size="8"` is an error, not 8."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, frozen=True)

    # loading the checkpoint (a ModelAdapter instance is loaded already: setting them then is an error)
    dtype: str | torch.dtype = "auto"
    device: str | torch.device = "auto"
    adapter_options: dict[str, Any] | None = None  # family options, e.g. Huginn's {"num_steps": 32}
    # speculation: "off", "adaptive", "K,d", a SpeculativeConfig or its dict; the preset, policy and trace
    # of "adaptive" (docs/adaptive.md)
    speculation: Any = "adaptive"
    preset: Any = None  # a preset file, a shipped preset name or an AdaptiveSpecConfig; None = matched by model
    policy: Literal["goodput", "ema"] = DEFAULT_POLICY
    trace_path: str | os.PathLike | None = None  # every plan and its feedback as JSONL
    # the adaptive controller's tunables: a ControlSettings or a dict of its fields (docs/adaptive.md "Tunables")
    control: ControlSettings | None = None
    # limits
    max_batch_size: StrictInt = Field(32, ge=1)
    max_model_len: StrictInt | None = Field(None, ge=2)  # None = the model's max positions
    max_num_batched_tokens: StrictInt = Field(1024, ge=1)  # prompt tokens per prefill step
    seed: StrictInt = Field(0, ge=0)  # draws the seeds of requests that set none
    # KV cache sizing: num_kv_blocks, else kv_cache_memory_gb, else half the free GPU memory / 2 GiB on CPU
    block_size: StrictInt = Field(16, ge=1, le=1 << 16)
    num_kv_blocks: StrictInt | None = Field(None, ge=1)
    kv_cache_memory_gb: float | None = None
    # None = on for CUDA devices; "emulate": the graph runner's padded static-buffer path run eagerly on any
    # device, without capture (how the CPU tests cover that path)
    cuda_graphs: StrictBool | Literal["emulate"] | None = None
    # requests whose prompts begin alike share the KV blocks of that beginning (docs/architecture.md, "Prefix
    # caching"); blocks of finished requests stay cached until their space is needed
    prefix_caching: StrictBool = False
    early_exit: Literal["skip", "select"] = "skip"  # how tokens that exit early run (docs/architecture.md)
    # "step": a decode step is a whole token (or speculative round) for the batch; "loop": one pass of the
    # block serves every request at whatever loop it is on (docs/architecture.md, "Loop-level batching")
    batching: Literal["step", "loop"] = "step"
    # batching="loop": the positions one pass may run (decoding and prompt chunks), deepest work first
    # (docs/architecture.md, "Scheduling policy"); None: every running request's work in every pass
    max_pass_positions: StrictInt | None = Field(None, ge=1)
    # which waiting request is admitted next and which running one is preempted when KV blocks run out (vLLM's
    # --scheduling-policy): "fcfs" by arrival; "priority" by each request's priority, lower first, then arrival
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    # a thinking model's reasoning parser (vLLM's LLM(..., reasoning_parser=...)): "deepseek_r1" or "qwen3". A request's
    # grammar (structured_outputs) then starts after the first `</think>` of its output, encoded by the model's
    # tokenizer, unless it sets SamplingParams.reasoning_end_token_ids itself (looped_spec/reasoning.py)
    reasoning_parser: str | None = None

    @model_validator(mode="after")
    def _adaptive_options(self) -> EngineConfig:
        """The preset, policy and tunables steer the adaptive controller; with another plan they would do nothing."""
        if parse_speculation(self.speculation) == "adaptive":
            unused = self.control.set_for_another_policy(self.policy) if self.control is not None else []
            if unused:
                shown = ", ".join(f"control.{name}={getattr(self.control, name)!r}" for name in unused)
                raise ValueError(f"{shown}: only the goodput policy reads {'it' if len(unused) == 1 else 'them'} "
                                 f"(policy={self.policy!r} runs without)")  # fmt: skip
            # rounds of several plans share a loop pass, so no round is timed there: the drift factor and the price
            # probes, which learn from round times, never run (docs/architecture.md, "Plans on loop passes")
            untimed = self.control.set_for_timed_rounds() if self.control is not None and self.batching == "loop" \
                else []  # fmt: skip
            if untimed:
                shown = ", ".join(f"control.{name}={getattr(self.control, name)!r}" for name in untimed)
                raise ValueError(f"{shown}: only timed rounds read {'it' if len(untimed) == 1 else 'them'} "
                                 "(batching='loop' times no round: rounds of several plans share its "
                                 "passes)")  # fmt: skip
            return self
        given = self.adaptive_options_given()
        if given:
            raise ValueError(f"{', '.join(given)}: only with speculation='adaptive' (speculation="
                             f"{self.speculation!r} runs no adaptive controller)")  # fmt: skip
        return self

    def adaptive_options_given(self) -> list[str]:
        """The options that steer the adaptive controller which were given, as `name=value`: even at its default
        (policy="goodput"), an option given where no adaptive controller runs would do nothing and is an error."""
        given = [name for name in ("preset", "policy", "control")
                 if name in self.model_fields_set and getattr(self, name) is not None]  # fmt: skip
        return [f"{name}={_shown(getattr(self, name))!r}" if _shown(getattr(self, name)) != {} else
                f"{name}={{}} (no tunable set away from its default)" for name in given]  # fmt: skip

    @model_validator(mode="after")
    def _kv_sizing(self) -> EngineConfig:
        if self.num_kv_blocks is not None and self.kv_cache_memory_gb is not None:
            raise ValueError(f"num_kv_blocks={self.num_kv_blocks}, kv_cache_memory_gb={self.kv_cache_memory_gb}: "
                             "set at most one (each sizes the KV cache)")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _loop_batching(self) -> EngineConfig:
        if self.batching != "loop":
            if self.max_pass_positions is not None:
                raise ValueError(f"max_pass_positions={self.max_pass_positions}: a loop-pass budget, it needs "
                                 "batching='loop'")  # fmt: skip
        return self

    @field_validator("reasoning_parser")
    @classmethod
    def _reasoning_parser(cls, value: str | None) -> str | None:
        from looped_spec.reasoning import REASONING_PARSERS

        if value is not None and value not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser; known: {', '.join(sorted(REASONING_PARSERS))}")
        return value

    @field_validator("speculation")
    @classmethod
    def _speculation(cls, value: Any) -> Any:
        parse_speculation(value)  # the error names the option; the value is kept as given (for messages)
        return value

    @field_validator("control", mode="before")
    @classmethod
    def _control(cls, value: Any) -> Any:
        if value is None or isinstance(value, ControlSettings):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"must be a ControlSettings or a dict of its fields, got {type(value).__name__}")
        # errors name the field inside `control`, as speculation's do: control.hysteresis=2: must be in [0, 1)
        fields = sorted(ControlSettings.__dataclass_fields__)
        unknown = [name for name in value if name not in fields]
        if unknown:
            raise ValueError("; ".join(_unknown_field("control", name, fields) for name in unknown))
        try:
            return ControlSettings(**value)
        except ValueError as exc:  # ControlSettings names the field: `hysteresis=2 must be in [0, 1)`
            raise ValueError(f"control.{exc}") from None

    @field_validator("preset")
    @classmethod
    def _preset(cls, value: Any) -> Any:
        from looped_spec.presets.schema import AdaptiveSpecConfig

        if value is not None and not isinstance(value, (str, os.PathLike, AdaptiveSpecConfig)):
            raise ValueError(
                f"must be a preset file, a shipped preset name or an AdaptiveSpecConfig, got {type(value).__name__}"
            )
        return value

    @field_validator("kv_cache_memory_gb", mode="before")
    @classmethod
    def _memory(cls, value: Any) -> Any:
        if value is None:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"must be a finite number of GiB > 0, got {value!r}")
        return value

    @classmethod
    def from_options(cls, config: EngineConfig | None = None, **options: Any) -> EngineConfig:
        """`config` (or the defaults) with `options` set; a bad option raises ValueError naming it."""
        # the options `config` was given (not its defaults: set options are checked, e.g. a policy without adaptive)
        given = (
            {name: getattr(config, name) for name in config.model_fields_set} if config is not None else {}
        ) | options
        try:
            return cls(**given)
        except ValidationError as exc:
            raise ValueError("LoopedSpecEngine: " + "; ".join(_problems(exc, given))) from None


def _unknown_field(option: str, name: Any, fields: list[str]) -> str:
    """`option.name: unknown field (did you mean ...? fields: ...)`: a field a dict option does not have."""
    close = difflib.get_close_matches(str(name).lower(), fields, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"{option}.{name}: unknown field ({hint}fields: {', '.join(fields)})"


def _shown(value: Any) -> Any:
    """An option as a message shows it: ControlSettings as the dict of its tunables that differ from their
    defaults (as it was likely given), not all twelve."""
    if isinstance(value, ControlSettings):
        default = ControlSettings()
        return {f: v for f, v in dataclasses.asdict(value).items() if v != getattr(default, f)}
    return value


#: vLLM engine arguments this engine has no option of that name for, and what to use instead
VLLM_OPTIONS = {
    "max_num_seqs": "here max_batch_size (the most requests decoding at once)",
    "enforce_eager": "here cuda_graphs=False (run every step eagerly)",
    "gpu_memory_utilization": "here the KV cache is sized by kv_cache_memory_gb (GiB) or num_kv_blocks (default: half "
    "the free GPU memory)",
    "tensor_parallel_size": "one engine runs on one device here; serve --replicas N scales out with Ray Serve",
    "pipeline_parallel_size": "one engine runs on one device here; serve --replicas N scales out with Ray Serve",
    "logprobs_mode": "here log-probabilities are always vLLM's default raw_logprobs (the log-softmax of the model's "
    "logits before logit bias, penalties, masks and temperature); processed ones are not offered",
    "max_logprobs": "here fixed at vLLM's default 20 (SamplingParams.logprobs and prompt_logprobs; the server's "
    "logprobs and top_logprobs)",
    "trust_remote_code": "never needed here: looped-spec runs no checkpoint code (each family is implemented in "
    "adapters/)",
    # without an entry these got difflib's nearest option, a wrong hint (kv_cache_dtype: kv_cache_memory_gb) or none
    # `dtype=...` is the field as the command line's error names it (--dtype float32, ...)
    "kv_cache_dtype": "here the KV cache is in the model's dtype (dtype=float32, bfloat16 or float16); no other is "
    "offered",
    "num_gpu_blocks_override": "here num_kv_blocks (the KV cache's blocks, on any device)",
    "enable_chunked_prefill": "here always on: a prompt longer than max_num_batched_tokens is prefilled in chunks",
    "tokenizer": "here the checkpoint folder's own tokenizer files (a model without them takes token ids)",
    "quantization": "no quantized weights here: the model runs in its dtype (float32, bfloat16 or float16)",
    "generation_config": "here always the checkpoint's generation_config.json (vLLM's default 'auto')",
    "enable_prefix_caching": "here prefix_caching, off by default (vLLM V1 has it on)",
    # speculation is this engine's own: the model drafts with its first loops, no draft model or n-gram proposer
    "speculative_config": "here speculation='adaptive' (the default: the controller picks K and d every round), "
    "K,d (a fixed plan: K drafts with the model's first d loops) or 'off'; the drafts come from the model's own "
    "loops, not a draft model",
    "num_speculative_tokens": "here speculation='K,d' (K drafts with the model's first d loops; 'adaptive', the "
    "default, picks them every round)",
    # the model is a local checkpoint folder or a shipped name; the Hugging Face hub is never read
    "download_dir": "nothing is downloaded here: the model is a local checkpoint folder (or a shipped name such as "
    "tiny-ouro)",
    "revision": "nothing is downloaded here: the model is a local checkpoint folder (check out the revision into it)",
    "load_format": "here always safetensors (model.safetensors or its shards in the checkpoint folder)",
    "enable_lora": "not offered: no LoRA adapters here (serve a checkpoint with the adapter merged into its weights)",
    "swap_space": "not offered: a preempted request's KV is recomputed when it resumes, never swapped out",
    "cpu_offload_gb": "not offered: the weights stay on the engine's device",
    "async_scheduling": "not offered: each step is scheduled once the previous one has committed (the async front, "
    "AsyncLoopedSpecEngine, runs the steps in a thread of their own)",
}


def _problems(exc: ValidationError, given: dict[str, Any]) -> list[str]:
    """One line per option (a union type reports one error per member: the first is kept)."""
    problems: dict[str, str] = {}
    for error in exc.errors():
        name = str(error["loc"][0]) if error["loc"] else "options"
        if error["type"] == "extra_forbidden":
            if name in VLLM_OPTIONS:
                problems.setdefault(name, f"{name}: vLLM's engine argument; {VLLM_OPTIONS[name]}")
                continue
            known = list(EngineConfig.model_fields)
            close = difflib.get_close_matches(name, known, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            problems.setdefault(name, f"unknown option {name!r}: {hint}(options: {', '.join(known)})")
            continue
        message = error["msg"].removeprefix("Value error, ")
        if not error["loc"]:  # a check across options: its message names them
            problems.setdefault(message, message)
        elif message.startswith(f"{name}.") or message.startswith(f"{name}:"):  # names its own sub-field
            problems.setdefault(name, message)
        else:
            problems.setdefault(name, f"{name}={given.get(name)!r}: {message}")
    return list(problems.values())
