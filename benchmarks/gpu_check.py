"""One-shot GPU check: correctness first (graphs vs eager, speculative vs plain), then decode timing.

Random weights at the real sizes of Ouro-1.4B (and Nanbeige4.2-3B when time allows), bf16. Reports,
per batch size 1/8/32: plain decoding eager vs CUDA graphs, and a (K, d) grid with a forced draft
acceptance rate alpha (a benchmark-only draft override: each draft token is the known greedy
continuation with probability alpha, else a wrong token), next to the cost model's prediction and
the memory-bandwidth bound (weight bytes x loop passes / measured copy bandwidth).

    python benchmarks/gpu_check.py                       # on the GPU machine (< 8 minutes on an H200)
    python benchmarks/gpu_check.py --device cpu --tiny   # reduced mode, runs in CI

Needs no network and installs nothing. On the GPU machine (no pydantic there), from the repo root:
    bash benchmarks/fetch_device_wheels.sh          # here, once: wheels into the git-ignored .whl/
    # device run (or simply `bash benchmarks/device_run.sh`), carry [".whl"]:
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && \
      PYTHONPATH=/tmp/site:$PWD python3 benchmarks/gpu_check.py --out $OUT
Runs from a source checkout too (not installed): the mapped subpackages are bound below.
Writes OUT/gpu_check.json and OUT/gpu_check.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).parent))
from costmodel_fit import expected_tokens  # noqa: E402


def _bind_source_subpackages() -> None:
    """Make looped_spec.adapters / looped_spec.presets importable from a checkout that was not pip-installed."""
    import importlib.util

    for name, folder in (("looped_spec.adapters", "adapters"), ("looped_spec.presets", "presets")):
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            spec = importlib.util.spec_from_file_location(
                name, ROOT / folder / "__init__.py", submodule_search_locations=[str(ROOT / folder)]
            )
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)


_bind_source_subpackages()

from looped_spec import LoopedSpecEngine, SamplingParams, SpeculativeConfig  # noqa: E402
from looped_spec.adapter import adapter_class  # noqa: E402
from looped_spec.spec.oracle import OracleDraft  # noqa: E402

REAL_CONFIGS = {
    "ouro-1.4b": {
        "model_type": "ouro",
        "vocab_size": 49152,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 24,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "head_dim": 128,
        "total_ut_steps": 4,
        "rope_theta": 1e6,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 65536,
        "tie_word_embeddings": False,
        "eos_token_id": 0,
    },
    "nanbeige4.2-3b": {
        "model_type": "nanbeige",
        "vocab_size": 166144,
        "hidden_size": 3072,
        "intermediate_size": 10752,
        "num_hidden_layers": 22,
        "num_attention_heads": 48,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_loops": 2,
        "rope_theta": 7e7,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 262144,
        "tie_word_embeddings": False,
        "eos_token_id": 2,
    },
}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 512,
}


def random_adapter(config: dict, dtype: torch.dtype, device: str, seed: int = 0):
    """The family's adapter over random weights of the shapes its own tensor_specs lists (norms = 1)."""
    cls = adapter_class(config["model_type"])
    gen = torch.Generator(device=device).manual_seed(seed)
    weights = {}
    for name, spec in cls.tensor_specs(config).items():
        if spec.optional or spec.ignored:
            continue
        if "norm" in name:
            weights[name] = torch.ones(spec.shape, dtype=dtype, device=device)
        else:
            w = torch.empty(spec.shape, dtype=dtype, device=device)
            weights[name] = w.normal_(0.0, 0.02, generator=gen)
    return cls(config, weights, dtype=dtype, device=device, name=config.get("_name", config["model_type"]))


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes moved per second by a large device-to-device copy (read + write)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    reps = 5
    start = time.perf_counter()
    for _ in range(reps):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * reps / (time.perf_counter() - start)


def weight_bytes(adapter) -> tuple[int, int]:
    """(bytes read per loop pass, bytes of the readout head)."""
    loop = sum(w.numel() * w.element_size() for n, w in adapter.weights.items() if ".layers." in n)
    head = adapter.weights["lm_head.weight"]
    return loop, head.numel() * head.element_size()


def forced_acceptance(prompts, continuations, alpha: float, vocab: int, seed: int = 0) -> OracleDraft:
    """Draft override: the known greedy token with probability alpha, else a wrong token."""
    rng = random.Random(seed)
    return OracleDraft(prompts, continuations, vocab, lambda j: rng.random() >= alpha)


def prompts_for(batch: int, vocab: int, length: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(batch)]


def timed_generate(engine, prompts, max_tokens: int, device: str) -> tuple[float, list[list[int]], dict]:
    """Decode seconds (wall minus prefill), outputs, and the run's speculation counters."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    engine.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up at this batch shape
    sync(device)
    stats = engine.stats
    before = (stats.phase_seconds["prefill"], stats.num_rounds, stats.num_draft_tokens, stats.num_accepted_tokens)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    sync(device)
    wall = time.perf_counter() - start
    proposed = stats.num_draft_tokens - before[2]
    run = {
        "rounds": stats.num_rounds - before[1],
        "acceptance": (stats.num_accepted_tokens - before[3]) / proposed if proposed else 0.0,
    }
    return wall - (stats.phase_seconds["prefill"] - before[0]), [o.token_ids for o in outs], run


def check_model(name: str, config: dict, args, report: dict, deadline: float) -> None:
    device, tiny = args.device, args.tiny
    dtype = torch.float32 if tiny else torch.bfloat16
    graphs = True if device.startswith("cuda") else "emulate"
    adapter = random_adapter(config, dtype, device)
    depth = adapter.full_depth
    batches = [1, 4] if tiny else [1, 8, 32]
    max_tokens = 8 if tiny else 48
    prompt_len = 8 if tiny else 32
    engine_kw = {
        "max_batch_size": max(batches),
        "max_model_len": prompt_len + max_tokens + 16,
        "num_kv_blocks": max(batches) * ((prompt_len + max_tokens + 16) // 16 + 3),
        "seed": 0,
    }
    loop_bytes, head_bytes = weight_bytes(adapter)
    entry = {
        "config": config,
        "dtype": str(dtype),
        "full_depth": depth,
        "loop_weight_bytes": loop_bytes,
        "head_weight_bytes": head_bytes,
        "correctness": {},
        "timing": [],
    }
    report["models"][name] = entry

    # ----- correctness first -----
    prompts = prompts_for(max(batches), adapter.vocab_size, prompt_len)
    eager = LoopedSpecEngine(adapter, speculation="off", cuda_graphs=False, **engine_kw)
    _, plain_tokens, _ = timed_generate(eager, prompts, max_tokens, device)
    del eager
    graphed = LoopedSpecEngine(adapter, speculation="off", cuda_graphs=graphs, **engine_kw)
    _, graph_tokens, _ = timed_generate(graphed, prompts, max_tokens, device)
    entry["correctness"]["graphs_vs_eager_identical_requests"] = sum(a == b for a, b in zip(plain_tokens, graph_tokens))
    entry["correctness"]["requests"] = len(prompts)
    entry["graph_capture_seconds"] = graphed.runner.graphs.capture_seconds
    entry["graph_capture_bytes"] = graphed.runner.graphs.capture_bytes
    del graphed
    spec_same = {}
    for k, d in [(2, 1), (3, depth // 2)]:
        if not 1 <= d < depth:
            continue
        engine = LoopedSpecEngine(adapter, speculation=SpeculativeConfig(k=k, d=d), cuda_graphs=graphs, **engine_kw)
        _, spec_tokens, _ = timed_generate(engine, prompts, max_tokens, device)
        spec_same[f"{k},{d}"] = sum(a == b for a, b in zip(plain_tokens, spec_tokens))
        del engine
    entry["correctness"]["speculative_vs_plain_identical_requests"] = spec_same
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    print(f"[{name}] correctness: {entry['correctness']}", flush=True)

    # ----- timing -----
    bandwidth = report["copy_bandwidth_bytes_per_s"]
    grid = [(1, 1), (2, 1), (3, 1), (2, depth // 2), (3, depth - 1)] if depth > 2 else [(1, 1), (2, 1), (3, 1)]
    grid = sorted({(k, d) for k, d in grid if 1 <= d < depth})
    alphas = [0.5, 0.8, 1.0]
    if tiny:  # smoke mode: every code path once
        grid, alphas = grid[:1], [0.8]
    engines = {
        ("plain", "eager"): LoopedSpecEngine(adapter, speculation="off", cuda_graphs=False, **engine_kw),
        ("plain", "graphs"): LoopedSpecEngine(adapter, speculation="off", cuda_graphs=graphs, **engine_kw),
    }
    spec_engines: dict[tuple[int, int], LoopedSpecEngine] = {}
    for batch in batches:
        if time.perf_counter() > deadline:
            entry["timing_truncated"] = True
            break
        bp = prompts[:batch]
        base = {}
        for mode in ("eager", "graphs"):
            seconds, _, _ = timed_generate(engines[("plain", mode)], bp, max_tokens, device)
            step = seconds / (max_tokens - 1)
            bound = (depth * loop_bytes + head_bytes) / bandwidth
            base[mode] = batch * (max_tokens - 1) / seconds
            entry["timing"].append(
                {
                    "batch": batch,
                    "config": f"plain-{mode}",
                    "tokens_per_s": base[mode],
                    "step_seconds": step,
                    "bandwidth_bound_step_seconds": bound,
                    "fraction_of_bound": bound / step,
                }
            )
            print(
                f"[{name}] B={batch} plain {mode}: {base[mode]:.1f} tok/s, {1e3 * step:.2f} ms/step, "
                f"bound {1e3 * bound:.2f} ms",
                flush=True,
            )
        for k, d in grid:
            if time.perf_counter() > deadline:
                entry["timing_truncated"] = True
                break
            if (k, d) not in spec_engines:  # one engine (one capture) per plan, reused across B and alpha
                spec_engines[(k, d)] = LoopedSpecEngine(
                    adapter, speculation=SpeculativeConfig(k=k, d=d), cuda_graphs=graphs, **engine_kw
                )
            engine = spec_engines[(k, d)]
            for alpha in alphas:
                engine.spec_round.proposer.draft_override = forced_acceptance(
                    prompts, plain_tokens, alpha, adapter.vocab_size
                )
                seconds, _, run = timed_generate(engine, bp, max_tokens, device)
                acc = run["acceptance"]
                rounds = max(run["rounds"], 1)
                tps = batch * (max_tokens - 1) / seconds
                passes = d * (k + 1) * loop_bytes + (depth - d) * loop_bytes + (k + 2) * head_bytes
                bound_ratio = expected_tokens(alpha, k) * (depth * loop_bytes + head_bytes) / passes
                entry["timing"].append(
                    {
                        "batch": batch,
                        "config": f"K={k},d={d}",
                        "alpha_forced": alpha,
                        "acceptance_measured": acc,
                        "tokens_per_s": tps,
                        "ratio_vs_plain_graphs": tps / base["graphs"],
                        "bandwidth_model_ratio": bound_ratio,
                        "round_seconds": seconds / rounds,
                    }
                )
                print(
                    f"[{name}] B={batch} K={k} d={d} alpha={alpha}: {tps / base['graphs']:.2f}x plain-graphs "
                    f"(accept {acc:.2f}; bandwidth model {bound_ratio:.2f}x)",
                    flush=True,
                )
    engines.clear()
    spec_engines.clear()
    del adapter
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def markdown(report: dict) -> str:
    lines = [
        f"# GPU check — {report['date']}",
        "",
        f"- device: {report['device_name']}",
        f"- torch {report['torch']}, copy bandwidth {report['copy_bandwidth_bytes_per_s'] / 1e9:.0f} GB/s",
        f"- command: `{report['command']}`",
        "",
    ]
    for name, entry in report["models"].items():
        c = entry["correctness"]
        lines += [
            f"## {name} ({entry['dtype']}, D={entry['full_depth']})",
            "",
            f"- graphs vs eager: {c.get('graphs_vs_eager_identical_requests')}/{c.get('requests')} requests "
            "token-identical",
            f"- speculative vs plain: {c.get('speculative_vs_plain_identical_requests')}",
            f"- graph capture: {entry.get('graph_capture_seconds', 0):.1f} s, "
            f"{entry.get('graph_capture_bytes', 0) / 2**20:.0f} MiB",
            "",
            "| B | config | alpha | accept | tok/s | vs plain-graphs | bandwidth model | step/bound |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for t in entry["timing"]:
            lines.append(
                f"| {t['batch']} | {t['config']} | {t.get('alpha_forced', '-')} | "
                f"{t.get('acceptance_measured', float('nan')):.2f} | {t['tokens_per_s']:.1f} | "
                f"{t.get('ratio_vs_plain_graphs', float('nan')):.2f} | "
                f"{t.get('bandwidth_model_ratio', float('nan')):.2f} | "
                f"{t.get('fraction_of_bound', float('nan')):.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 shapes (CPU/CI smoke mode)")
    parser.add_argument("--models", default="ouro-1.4b,nanbeige4.2-3b")
    parser.add_argument("--budget-seconds", type=float, default=420.0, help="stop timing new configs after this")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available (use --device cpu --tiny)")
    if args.device == "cpu":
        torch.set_num_threads(1)  # tiny shapes: extra threads only contend
    start = time.perf_counter()
    deadline = start + args.budget_seconds
    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "tiny": args.tiny,
        "device_name": torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else platform.processor() or "cpu",
        "models": {},
    }
    report["copy_bandwidth_bytes_per_s"] = copy_bandwidth(args.device, 64 << 20 if args.tiny else 4 << 30)
    for name in args.models.split(","):
        config = dict(REAL_CONFIGS[name], _name=name)
        if args.tiny:
            config.update(TINY)
        if time.perf_counter() > deadline:
            report["models"][name] = {"skipped": "time budget spent"}
            continue
        check_model(name, config, args, report, deadline)
    report["wall_seconds"] = time.perf_counter() - start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    (out / "gpu_check.md").write_text(markdown(report))
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'} in {report['wall_seconds']:.0f} s")


if __name__ == "__main__":
    main()
