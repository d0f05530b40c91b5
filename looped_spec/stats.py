"""Engine counters, exported as a plain dict and as Prometheus text (vLLM-style names)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

PHASES = ("schedule", "prefill", "decode", "draft", "verify", "accept", "commit", "control")


@dataclass
class EngineStats:
    """Cumulative counters of one engine."""

    num_requests_finished: int = 0
    num_prompt_tokens: int = 0  # prompt (and recomputed) tokens run through prefill
    num_generation_tokens: int = 0
    num_prefill_steps: int = 0
    num_rounds: int = 0  # decode rounds, plain or speculative
    num_spec_rounds: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_preemptions: int = 0
    batch_size_histogram: Counter = field(default_factory=Counter)  # decode round batch size -> rounds
    plan_histogram: Counter = field(default_factory=Counter)  # "K,d" -> rounds
    phase_seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    # early exit: generated tokens per readout depth, and the loops their own forwards ran / skipped
    exit_depth_histogram: Counter = field(default_factory=Counter)
    num_exit_loops_run: int = 0
    num_exit_loops_saved: int = 0  # skip mode only: select runs every loop

    def count_exits(self, depths: list[int], full_depth: int, skipped: bool) -> None:
        for depth in depths:
            self.exit_depth_histogram[depth] += 1
            run = depth if skipped else full_depth
            self.num_exit_loops_run += run
            self.num_exit_loops_saved += full_depth - run

    @property
    def mean_loops_per_token(self) -> float:
        """Loops run per token read out by the early-exit path (0 when none was)."""
        total = sum(self.exit_depth_histogram.values())
        return self.num_exit_loops_run / total if total else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def to_dict(self) -> dict:
        return {
            "num_requests_finished": self.num_requests_finished,
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_generation_tokens": self.num_generation_tokens,
            "num_prefill_steps": self.num_prefill_steps,
            "num_rounds": self.num_rounds,
            "num_spec_rounds": self.num_spec_rounds,
            "num_draft_tokens": self.num_draft_tokens,
            "num_accepted_tokens": self.num_accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "num_preemptions": self.num_preemptions,
            "batch_size_histogram": dict(sorted(self.batch_size_histogram.items())),
            "plan_histogram": dict(sorted(self.plan_histogram.items())),
            "phase_seconds": dict(self.phase_seconds),
            "exit_depth_histogram": dict(sorted(self.exit_depth_histogram.items())),
            "mean_loops_per_token": self.mean_loops_per_token,
            "num_exit_loops_saved": self.num_exit_loops_saved,
        }

    def to_prometheus(self, model_name: str = "") -> str:
        label = f'model_name="{model_name}"'
        lines: list[str] = []

        def counter(name: str, value, help_text: str) -> None:
            lines.extend(
                [
                    f"# HELP looped_spec:{name} {help_text}",
                    f"# TYPE looped_spec:{name} counter",
                    f"looped_spec:{name}{{{label}}} {value}",
                ]
            )

        counter("request_success_total", self.num_requests_finished, "Finished requests.")
        counter("prompt_tokens_total", self.num_prompt_tokens, "Prefilled tokens (including recomputation).")
        counter("generation_tokens_total", self.num_generation_tokens, "Generated tokens.")
        counter("num_preemptions_total", self.num_preemptions, "Requests preempted for KV space.")
        counter("decode_rounds_total", self.num_rounds, "Decode rounds (plain or speculative).")
        counter("spec_decode_rounds_total", self.num_spec_rounds, "Speculative rounds.")
        counter("spec_decode_num_draft_tokens_total", self.num_draft_tokens, "Draft tokens proposed.")
        counter("spec_decode_num_accepted_tokens_total", self.num_accepted_tokens, "Draft tokens accepted.")
        lines += [
            "# HELP looped_spec:phase_seconds_total Wall time per engine phase.",
            "# TYPE looped_spec:phase_seconds_total counter",
        ]
        for phase, seconds in self.phase_seconds.items():
            lines.append(f'looped_spec:phase_seconds_total{{{label},phase="{phase}"}} {seconds:.6f}')
        lines += ["# HELP looped_spec:batch_size Decode-round batch sizes.", "# TYPE looped_spec:batch_size histogram"]
        for bound in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            total_le = sum(c for b, c in self.batch_size_histogram.items() if b <= bound)
            lines.append(f'looped_spec:batch_size_bucket{{{label},le="{bound}"}} {total_le}')
        total = sum(self.batch_size_histogram.values())
        weighted = sum(b * c for b, c in self.batch_size_histogram.items())
        lines.append(f'looped_spec:batch_size_bucket{{{label},le="+Inf"}} {total}')
        lines.append(f"looped_spec:batch_size_count{{{label}}} {total}")
        lines.append(f"looped_spec:batch_size_sum{{{label}}} {weighted}")
        return "\n".join(lines) + "\n"
