"""Shared benchmark plumbing for bench_plain.py and bench_early_exit.py: timing of one engine configuration.

Prompts (the groups, random token ids, files: `load_prompts`, `random_prompts`) live in
`looped_spec.tuning.prompt_sets`, and batch sizes and the (K, d) grid are parsed by `looped_spec.tuning.grid`, for
every benchmark and the tuner alike; bench_speculative.py times configurations interleaved on its own.
"""

from __future__ import annotations

import statistics
import time

from looped_spec import LoopedSpecEngine, SamplingParams, load_adapter


class Bench:
    """Times engine configurations on one adapter in one process, so ratios compare like with like."""

    def __init__(self, model: str, dtype: str = "float32", device: str = "cpu", **adapter_options) -> None:
        self.adapter = load_adapter(model, dtype=dtype, device=device, **adapter_options)

    def engine(self, speculation, **kwargs) -> LoopedSpecEngine:
        kwargs.setdefault("max_batch_size", 64)
        return LoopedSpecEngine(self.adapter, speculation=speculation, **kwargs)

    def run(self, engine: LoopedSpecEngine, prompts: list, max_tokens: int, repeats: int = 1) -> dict:
        """Decode tokens/s (wall time minus prefill time; median of `repeats`) and speculation counters."""
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up at the full batch shape
        decode_times, outputs = [], None
        s0 = engine.stats.to_dict()
        for _ in range(repeats):
            prefill0 = engine.stats.phase_seconds["prefill"]
            start = time.perf_counter()
            outputs = engine.generate(prompts, params)
            wall = time.perf_counter() - start
            decode_times.append(wall - (engine.stats.phase_seconds["prefill"] - prefill0))
        s1 = engine.stats.to_dict()
        tokens = sum(len(o.token_ids) for o in outputs)
        decoded = tokens - len(prompts)  # the first token of each request comes from prefill
        proposed = s1["num_draft_tokens"] - s0["num_draft_tokens"]
        accepted = s1["num_accepted_tokens"] - s0["num_accepted_tokens"]
        rounds = (s1["num_rounds"] - s0["num_rounds"]) / repeats
        phase = {k: (s1["phase_seconds"][k] - s0["phase_seconds"][k]) / repeats for k in s1["phase_seconds"]}
        seconds = statistics.median(decode_times)
        return {
            "seconds": seconds,
            "tokens": tokens,
            "tokens_per_s": decoded / seconds,
            "acceptance": accepted / proposed if proposed else 0.0,
            "rounds": rounds,
            "tokens_per_round": decoded / rounds / len(prompts) if rounds else 0.0,  # per request
            "phase_seconds": phase,
            "outputs": [o.token_ids for o in outputs],
        }
