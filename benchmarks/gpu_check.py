"""One-shot GPU check: correctness first, then decode timing at the design's reference shape, results to a file.

Random bf16 weights at the real sizes of Ouro-1.4B, then Nanbeige4.2-3B and Huginn-0125 while the time budget
lasts (`--models` picks; `device_run.sh huginn` runs Huginn's correctness and loop passes alone).
Per model, in sections (each saved as it ends; a failing one, say out of memory, is recorded and the
next runs):

1. correctness: eager with the paged kernel vs the SDPA reference path, CUDA-graph replay vs eager,
   greedy speculative (K=2,d=1 and K=3,d=D/2) vs plain: token-identical request counts; the number,
   capture time and memory of the captured graphs;
2. loop-level batching against the step engine, both captured: identity; then speed at full depth (B = 8 and 32), a
   fixed exit and the exit gate at τ = 0.5 (B = 32), interleaved repeats with an A/A line;
3. plain decoding, 512-token prompts + 2048 new tokens at B = 1/8/32, graphs vs eager;
4. speculation (K=2, d=1) with a forced draft acceptance alpha = 0.8 (a benchmark-only draft override:
   each draft token is the known greedy continuation with probability alpha) vs plain graphs, next to
   the weights-only bandwidth model's ratio;
5. the changing workload 1 -> 8 -> 32 -> 8 -> 1 (256 new tokens per phase): adaptive vs plain;
6. one long context (16k-token prompt, B=1): graphs with the kernel vs the eager SDPA reference;
7. more (K, d) while time remains;
8. last, the profiles device_run.sh asks for by name: "loop profile" (decode time and the profiler's top operations
   of captured loop passes against the captured step engine at full depth) and "spec profile" (where a K = 2, d = 1
   round's time goes at the largest batch: phases, graph and eager runner steps, top operations).

Every timing row carries plain decoding's HBM bound at its batch and mean context: weight bytes per
loop pass x D + head + every request's KV bytes once per step, over the measured copy bandwidth.

    python benchmarks/gpu_check.py                       # on the GPU machine (< 8 minutes on an H200)
    python benchmarks/gpu_check.py --device cpu --tiny   # reduced shapes, runs in CI

Needs no network and installs nothing. On the GPU machine (no pydantic there), from the repo root:
    bash benchmarks/fetch_device_wheels.sh          # here, once: wheels into the git-ignored .whl/
    # device run: `bash benchmarks/device_run.sh`, carry [".whl"]
From a source checkout that is not installed: `PYTHONPATH=. python benchmarks/gpu_check.py ...` (adapters/ and
presets/ are linked into looped_spec/, so looped_spec.adapters resolves as in the install).
Writes OUT/gpu_check.json and OUT/gpu_check.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import statistics
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path

import torch
from costmodel_fit import expected_tokens

from looped_spec import LoopedSpecEngine, SamplingParams, SpeculativeConfig
from looped_spec.models.adapter import adapter_class

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # OracleDraft, the tests' draft override, forces an acceptance rate
from oracle import OracleDraft  # noqa: E402

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
    # Huginn-0125's shapes (prelude 2, core 4, coda 2; 96-wide heads, padded in the paged kernel) at 8 loops, the depth
    # the shipped preset is tuned at (its default is 32, changeable at test time; 8 keeps a device check within its
    # minutes): its coda attends, so loop passes capture its readouts and its KL exit rule too
    "huginn-0125": {
        "model_type": "huginn_raven",
        "n_embd": 5280,
        "n_heads": 55,
        "num_key_value_heads": 55,
        "n_layers_in_prelude": 2,
        "n_layers_in_recurrent_block": 4,
        "n_layers_in_coda": 2,
        "intermediate_size": 17920,
        "vocab_size": 65536,
        "padded_vocab_size": 65536,
        "mean_recurrence": 8,
        "block_size": 4096,
        "rope_base": 50000.0,
        "norm_eps": 1e-6,
        "qk_bias": True,
        "tie_embeddings": True,
        "eos_token_id": 65505,
    },
}
#: the reduced shapes of the CPU smoke mode, by family (Huginn names its fields its own way)
TINY_HUGINN = {
    "n_embd": 64,
    "n_heads": 4,
    "num_key_value_heads": 4,
    "n_layers_in_prelude": 1,
    "n_layers_in_recurrent_block": 1,
    "n_layers_in_coda": 1,
    "intermediate_size": 128,
    "vocab_size": 256,
    "padded_vocab_size": 256,
    "mean_recurrence": 4,
    "block_size": 512,
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


def profiled(engine, prompts, params: SamplingParams, device: str, rows: int = 14) -> tuple[float, dict]:
    """One `generate` under torch's profiler: its seconds, and the top operations by device and by host time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=activities) as prof:
        sync(device)
        start = time.perf_counter()
        engine.generate(prompts, params)
        sync(device)
        wall = time.perf_counter() - start
    averages = prof.key_averages()
    by_device = "self_device_time_total" if device.startswith("cuda") else "self_cpu_time_total"
    return wall, {
        "top_by_device_time": averages.table(sort_by=by_device, row_limit=rows, max_name_column_width=50),
        "top_by_host_time": averages.table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=50),
    }


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


def kv_bytes_per_token(adapter) -> int:
    """KV bytes one cached token occupies over all planes (read once per decode step that attends to it)."""
    layout = adapter.kv_layout
    return (
        2
        * layout.num_planes
        * layout.num_kv_heads
        * layout.head_dim
        * torch.empty((), dtype=adapter.dtype).element_size()
    )


def bound_step_seconds(adapter, loop_bytes: int, head_bytes: int, batch: int, mean_context: float, bw: float) -> float:
    """HBM bound of one plain decode step: weights once per loop pass, readout head, each request's KV once."""
    depth = adapter.full_depth
    return (depth * loop_bytes + head_bytes + batch * mean_context * kv_bytes_per_token(adapter)) / bw


def shapes(tiny: bool) -> dict:
    """The reference shape on a GPU (512-token prompts, 2048 new tokens); a reduced one for the CPU smoke mode."""
    if tiny:
        return {"prompt": 8, "new": 8, "long_prompt": 96, "long_new": 4, "batches": [1, 4], "workload": [1, 4, 1],
                "phase_new": 4, "eager_new": 4, "check_new": 6, "check_batch": 4, "loop_repeats": 2}  # fmt: skip
    return {"prompt": 512, "new": 2048, "long_prompt": 16384, "long_new": 128, "batches": [1, 8, 32],
            "workload": [1, 8, 32, 8, 1], "phase_new": 256, "eager_new": 128, "check_new": 64,
            "check_batch": 8, "loop_repeats": 4}  # fmt: skip


def check_model(name: str, config: dict, args, report: dict, deadline: float, save) -> None:
    device, tiny = args.device, args.tiny
    dtype = torch.float32 if tiny else getattr(torch, args.dtype)
    graphs = True if device.startswith("cuda") else "emulate"
    adapter = random_adapter(config, dtype, device)
    depth = adapter.full_depth
    shape = shapes(tiny)
    if args.new is not None:
        shape.update(
            new=args.new, phase_new=min(shape["phase_new"], args.new), eager_new=min(shape["eager_new"], args.new)
        )
    batches = shape["batches"]
    max_len = shape["prompt"] + shape["new"] + 16

    def blocks_for(batch: int, tokens: int) -> int:
        return batch * ((tokens + 16) // 16 + 3)

    engine_kw = {
        "max_batch_size": max(batches),
        "max_model_len": max_len,
        "num_kv_blocks": max(blocks_for(shape["check_batch"], shape["prompt"] + shape["check_new"]), max_len // 16 + 2),
        "seed": 0,
    }
    loop_bytes, head_bytes = weight_bytes(adapter)
    bw = report["copy_bandwidth_bytes_per_s"]
    entry = {
        "config": config,
        "dtype": str(dtype),
        "full_depth": depth,
        "shape": shape,
        "loop_weight_bytes": loop_bytes,
        "head_weight_bytes": head_bytes,
        "kv_bytes_per_token": kv_bytes_per_token(adapter),
        "correctness": {},
        "timing": [],
    }
    report["models"][name] = entry

    def make(spec="off", graphs_mode=graphs, kernel=None, **kw):
        engine = LoopedSpecEngine(adapter, speculation=spec, cuda_graphs=graphs_mode, **{**engine_kw, **kw})
        if kernel is not None:
            engine.runner.paged_kernel = kernel
        return engine

    def record(row: dict, batch: int, mean_context: float, seconds_per: float) -> None:
        """`seconds_per`: per decode step (plain) or per round (speculative). The bound is plain decoding's at
        HBM speed (weights per loop pass + every request's KV once per step); speculation may exceed it."""
        bound = bound_step_seconds(adapter, loop_bytes, head_bytes, batch, mean_context, bw)
        bound_tps = batch / bound
        row.update(batch=batch, seconds_per_step_or_round=seconds_per, mean_context=mean_context)
        row.update(hbm_bound_plain_tokens_per_s=bound_tps, fraction_of_plain_bound=row["tokens_per_s"] / bound_tps)
        entry["timing"].append(row)
        print(f"[{name}] {json.dumps({k: round(v, 5) if isinstance(v, float) else v for k, v in row.items()})}",
              flush=True)  # fmt: skip

    # one engine at a time: each holds a KV cache sized for its batch (Ouro-1.4B: 0.8 MB per token)
    run_blocks = blocks_for(max(batches), shape["prompt"] + shape["new"])
    alpha = 0.8
    batch_prompts = {b: prompts_for(b, adapter.vocab_size, shape["prompt"], seed=b) for b in batches}
    plain_out, plain_tps = {}, {}
    mean_ctx = shape["prompt"] + shape["new"] / 2
    new = shape["new"]

    # ----- correctness first: graphs == eager == reference path; greedy speculative == plain -----
    def correctness() -> None:
        check_prompts = prompts_for(shape["check_batch"], adapter.vocab_size, shape["prompt"])
        reference = make(graphs_mode=False, kernel=False)
        _, ref_tokens, _ = timed_generate(reference, check_prompts, shape["check_new"], device)
        del reference
        eager = make(graphs_mode=False)
        _, eager_tokens, _ = timed_generate(eager, check_prompts, shape["check_new"], device)
        del eager
        graphed = make()
        _, graph_tokens, _ = timed_generate(graphed, check_prompts, shape["check_new"], device)
        c = entry["correctness"]
        c["requests"] = len(check_prompts)
        c["paged_kernel"] = graphed.runner.paged_kernel
        c["eager_vs_reference_identical_requests"] = sum(a == b for a, b in zip(eager_tokens, ref_tokens))
        c["graphs_vs_eager_identical_requests"] = sum(a == b for a, b in zip(eager_tokens, graph_tokens))
        entry["graphs"] = {
            "count": graphed.runner.graphs.num_graphs,
            "capture_seconds": graphed.runner.graphs.capture_seconds,
            "capture_bytes": graphed.runner.graphs.capture_bytes,
            "contexts": graphed.runner.graphs.contexts,
        }
        del graphed
        spec_same = {}
        for k, d in [(2, 1), (3, depth // 2)]:
            if 1 <= d < depth:
                engine = make(SpeculativeConfig(k=k, d=d))
                _, spec_tokens, _ = timed_generate(engine, check_prompts, shape["check_new"], device)
                spec_same[f"{k},{d}"] = sum(a == b for a, b in zip(eager_tokens, spec_tokens))
                del engine
        c["speculative_vs_plain_identical_requests"] = spec_same
        # early exit (skip mode, a fixed depth: no gate needed on random weights), plain vs speculative
        exit_params = SamplingParams(max_tokens=shape["check_new"], ignore_eos=True, exit_at_step=max(1, depth // 2))
        exit_same = {}
        plain_exit = [o.token_ids for o in make().generate(check_prompts, exit_params)]
        for k, d in [(2, 1), (3, depth - 1)]:
            if 1 <= d < depth:
                outs = make(SpeculativeConfig(k=k, d=d)).generate(check_prompts, exit_params)
                exit_same[f"{k},{d}"] = sum(a == b.token_ids for a, b in zip(plain_exit, outs))
        c["early_exit_speculative_vs_plain_identical_requests"] = exit_same
        print(f"[{name}] correctness: {c}; graphs: {entry['graphs']}", flush=True)

    # ----- decode at the reference shape: plain graphs vs eager, speculation (forced acceptance) vs plain -----
    def plain_timing() -> None:
        engine = make(num_kv_blocks=run_blocks)
        for batch in batches:
            seconds, plain_out[batch], _ = timed_generate(engine, batch_prompts[batch], new, device)
            plain_tps[batch] = batch * (new - 1) / seconds
            record({"config": "plain-graphs", "tokens_per_s": plain_tps[batch]}, batch, mean_ctx, seconds / (new - 1))
        del engine
        free_memory(device)
        engine = make(graphs_mode=False, num_kv_blocks=run_blocks)
        eager_new = shape["eager_new"]
        for batch in batches:
            seconds, _, _ = timed_generate(engine, batch_prompts[batch], eager_new, device)
            row = {"config": "plain-eager", "tokens_per_s": batch * (eager_new - 1) / seconds}
            record(row, batch, shape["prompt"] + eager_new / 2, seconds / (eager_new - 1))
        del engine
        free_memory(device)

    def spec_timing(k: int, d: int) -> None:
        engine = make(SpeculativeConfig(k=k, d=d), num_kv_blocks=run_blocks + blocks_for(max(batches), k))
        for batch in batches:
            if batch not in plain_out:
                continue
            prompts = batch_prompts[batch]
            forced_acceptance(prompts, plain_out[batch], alpha, adapter.vocab_size).attach(engine)
            seconds, spec_tokens, run = timed_generate(engine, prompts, new, device)
            tps = batch * (new - 1) / seconds
            passes = d * (k + 1) * loop_bytes + (depth - d) * loop_bytes + (k + 2) * head_bytes
            model_ratio = expected_tokens(alpha, k) * (depth * loop_bytes + head_bytes) / passes
            row = {"config": f"K={k},d={d}", "alpha_forced": alpha, "acceptance_measured": run["acceptance"]}
            row.update(tokens_per_s=tps, ratio_vs_plain_graphs=tps / plain_tps[batch])
            row.update(weights_only_model_ratio=model_ratio, same_tokens_as_plain=spec_tokens == plain_out[batch])
            record(row, batch, mean_ctx, seconds / max(run["rounds"], 1))

    # ----- one long context: per-token cost follows the context (kernel) vs copying it (reference) -----
    def long_context() -> None:
        if shape["long_prompt"] + shape["long_new"] + 16 > adapter.max_positions:
            entry["long_context"] = f"skipped: {shape['long_prompt']} tokens exceed the model's {adapter.max_positions}"
            return
        long_prompt = prompts_for(1, adapter.vocab_size, shape["long_prompt"], seed=7)
        new = shape["long_new"]
        long_len = shape["long_prompt"] + new + 16
        long_kw = {"max_batch_size": 1, "max_model_len": long_len, "num_kv_blocks": blocks_for(1, long_len)}
        for label, graphs_mode, kernel in (("graphs", graphs, None), ("eager-reference", False, False)):
            engine = make(graphs_mode=graphs_mode, kernel=kernel, **long_kw)
            seconds, _, _ = timed_generate(engine, long_prompt, new, device)
            del engine
            free_memory(device)
            row = {"config": f"long-context plain {label}", "context": shape["long_prompt"]}
            row["tokens_per_s"] = (new - 1) / seconds
            record(row, 1, shape["long_prompt"] + new / 2, seconds / (new - 1))

    # ----- the changing workload 1 -> 8 -> 32 -> 8 -> 1: plain vs adaptive speculation (forced alpha) -----
    def workload() -> None:
        phase_blocks = blocks_for(max(shape["workload"]), shape["prompt"] + shape["phase_new"] + 8)
        plain = make(num_kv_blocks=phase_blocks)
        adaptive = make("adaptive", num_kv_blocks=phase_blocks)
        totals = {"plain": 0.0, "adaptive": 0.0}
        tokens = 0
        same = True
        for i, batch in enumerate(shape["workload"]):
            prompts = prompts_for(batch, adapter.vocab_size, shape["prompt"], seed=100 + i)
            seconds, plain_tokens, _ = timed_generate(plain, prompts, shape["phase_new"], device)
            totals["plain"] += seconds
            forced_acceptance(prompts, plain_tokens, alpha, adapter.vocab_size).attach(adaptive)
            seconds, spec_tokens, _ = timed_generate(adaptive, prompts, shape["phase_new"], device)
            totals["adaptive"] += seconds
            tokens += batch * (shape["phase_new"] - 1)
            same &= spec_tokens == plain_tokens
        entry["workload"] = {
            "batches": shape["workload"],
            "alpha_forced": alpha,
            "plain_tokens_per_s": tokens / totals["plain"],
            "adaptive_tokens_per_s": tokens / totals["adaptive"],
            "adaptive_vs_plain": totals["plain"] / totals["adaptive"],
            "same_tokens": same,
        }
        print(f"[{name}] workload: {entry['workload']}", flush=True)
        del plain, adaptive

    # ----- loop-level batching against the step engine, both captured: identity, then speed -----
    def loop_batching() -> None:
        """Captured loop passes against the captured step engine (eager passes: the cuda tests): identity on the check
        prompts, then speed by the project's method: one persistent engine each plus a second step engine (the A/A
        line), turns in shuffled order, repeated, the first repeat dropped, the median ratio with its range; at every
        batch above 1 at full depth (the open question), at the largest under a fixed exit. KV for the whole batch."""
        check_prompts = prompts_for(shape["check_batch"], adapter.vocab_size, shape["prompt"])
        timed_new, repeats = shape["check_new"], shape["loop_repeats"]
        timed_blocks = blocks_for(max(batches), shape["prompt"] + timed_new)
        order_rng = random.Random(0)
        captured_loops = graphs  # the CPU smoke mode: the captured path uncaptured, the kernel's contract in torch
        rows = {}
        for label, extra, timed_batches in [
            ("full depth", {}, batches[1:]),
            (f"exit_at_step {max(1, depth // 2)}", {"exit_at_step": max(1, depth // 2)}, batches[-1:]),
            # the exit gate on random weights: tokens exit at mixed depths, where loop passes should gain the most
            *([("exit_threshold 0.5", {"exit_threshold": 0.5}, batches[-1:])] if adapter.has_exit_rule else []),
        ]:
            check = SamplingParams(max_tokens=shape["check_new"], ignore_eos=True, **extra)
            params = SamplingParams(max_tokens=timed_new, ignore_eos=True, **extra)
            engines = {"step": make(num_kv_blocks=timed_blocks),
                       "loop": make(graphs_mode=captured_loops, batching="loop", num_kv_blocks=timed_blocks),
                       "step A/A": make(num_kv_blocks=timed_blocks)}  # fmt: skip
            if adapter.readout_uses_kv and captured_loops:  # the A/B of the captured coda stages (Huginn)
                engines[EAGER_CODA] = eager_coda(make(graphs_mode=captured_loops, batching="loop",
                                                      num_kv_blocks=timed_blocks))  # fmt: skip
            outs = zip(*(engines[label].generate(check_prompts, check) for label in engines if label != "step A/A"))
            row = {"identical_requests": sum(all(o.token_ids == out[0].token_ids for o in out) for out in outs),
                   "of": len(check_prompts)}  # fmt: skip
            for batch in timed_batches:
                row[f"B={batch}"] = timed_pair(engines, batch_prompts[batch], params, repeats, order_rng)
            captured = engines["loop"].loop_batcher.graphs
            row.update(loops_per_token=engines["loop"].stats.mean_loops_per_token or depth,  # 0: none exited early
                       captured_pass_replays=captured.num_replays if captured else 0,
                       captured_readout_replays=captured.num_readout_replays if captured else 0,
                       captured_rule_replays=captured.num_rule_replays if captured else 0,
                       captured_pass_shapes=captured.num_graphs if captured else 0,
                       capture_seconds=captured.capture_seconds if captured else 0.0)  # fmt: skip
            rows[label] = row
            print(f"[{name}] loop batching {label}: {row}", flush=True)
            del engines
            free_memory(device)
        entry["loop_batching"] = rows

    def timed_pair(engines: dict, prompts, params, repeats: int, order_rng: random.Random) -> dict:
        """Seconds per run of each engine, interleaved; ratios step/loop and step/step-A/A per repeat (and the loop
        engine with its coda eager ÷ captured, where there is one)."""
        for engine in engines.values():  # warm: captures every shape this batch needs before timing
            engine.generate(prompts, params)
        seconds = {label: [] for label in engines}
        loop_stats = engines["loop"].stats
        for _ in range(repeats):
            for label in order_rng.sample(list(engines), len(engines)):
                before = loop_stats.num_loop_passes, loop_stats.num_loop_pass_positions
                sync(device)
                start = time.perf_counter()
                engines[label].generate(prompts, params)
                sync(device)
                seconds[label].append(time.perf_counter() - start)
                if label == "loop":
                    passes = loop_stats.num_loop_passes - before[0]
                    positions = loop_stats.num_loop_pass_positions - before[1]
        kept = {label: values[1:] for label, values in seconds.items()}  # the first repeat dropped
        loop_ratios = sorted(s / lo for s, lo in zip(kept["step"], kept["loop"]))
        aa_ratios = sorted(s / a for s, a in zip(kept["step"], kept["step A/A"]))
        median = statistics.median
        stages = {}
        if EAGER_CODA in kept:  # above 1: the captured coda stages pay
            ratios = sorted(e / lo for e, lo in zip(kept[EAGER_CODA], kept["loop"]))
            stages = {"captured_coda_vs_eager_median": median(ratios), "captured_coda_vs_eager_range": [ratios[0],
                      ratios[-1]]}  # fmt: skip
        return {**stages,
            "loop_vs_step_median": median(loop_ratios), "loop_vs_step_range": [loop_ratios[0], loop_ratios[-1]],
            "aa_median": median(aa_ratios), "aa_range": [aa_ratios[0], aa_ratios[-1]],
            "step_seconds_median": median(kept["step"]), "loop_seconds_median": median(kept["loop"]),
            "loop_passes_per_run": passes, "positions_per_pass": positions / max(passes, 1),
            "tokens_per_run": len(prompts) * params.max_tokens, "repeats_kept": len(loop_ratios),
        }  # fmt: skip

    # ----- where a plain step's time goes (graphs): host phases and the profiler's top operations -----
    def profile() -> None:
        engine = make(num_kv_blocks=run_blocks)
        steps = shape["check_new"]
        rows = {}
        for batch in (1, 8):
            prompts = batch_prompts.get(batch) or prompts_for(batch, adapter.vocab_size, shape["prompt"], seed=batch)
            engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))  # warm
            before = dict(engine.stats.phase_seconds)
            wall, tables = profiled(engine, prompts, SamplingParams(max_tokens=steps, ignore_eos=True), device, rows=12)
            phases = {k: round((v - before.get(k, 0.0)) / steps * 1e3, 3)
                      for k, v in engine.stats.phase_seconds.items()}  # fmt: skip
            rows[batch] = {"ms_per_token_step": wall / steps * 1e3, "phase_ms_per_step": phases, **tables}
            print(f"[{name}] profile B={batch}: {wall / steps * 1e3:.2f} ms/step, phases {phases}", flush=True)
            print(rows[batch]["top_by_device_time"], flush=True)
            print(rows[batch]["top_by_host_time"], flush=True)
        entry["profile"] = rows
        del engine

    # ----- where a speculative round's time goes at the largest batch (step engine, graphs) -----
    def spec_profile() -> None:
        """K = 2, d = 1 with forced acceptance at the largest batch: per round, the phases, how many runner steps
        replayed a graph and how many ran eagerly (with their shapes), and the profiler's top operations."""
        batch, steps = max(batches), shape["check_new"]
        prompts = batch_prompts[batch]
        blocks = blocks_for(batch, shape["prompt"] + steps + 8)
        plain = make(num_kv_blocks=blocks)
        continuation = [o.token_ids for o in plain.generate(prompts, SamplingParams(max_tokens=steps, ignore_eos=True))]
        del plain
        engine = make(SpeculativeConfig(k=2, d=1), num_kv_blocks=blocks)
        forced_acceptance(prompts, continuation, alpha, adapter.vocab_size).attach(engine)
        engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))  # warm: captures
        runner = engine.runner
        shapes_run: dict[str, int] = {}
        graph_step, eager_step = runner.graphs.step, runner.eager.step

        def counted(kind, step):
            def run(inp):
                out = step(inp)
                if out is not None:
                    key = f"{kind} B={len(inp.requests)} q={inp.query_len} loops {inp.start}-{inp.end}"
                    shapes_run[key] = shapes_run.get(key, 0) + 1
                return out

            return run

        runner.graphs.step, runner.eager.step = counted("graph", graph_step), counted("eager", eager_step)
        before, rounds0 = dict(engine.stats.phase_seconds), engine.stats.num_rounds
        wall, tables = profiled(engine, prompts, SamplingParams(max_tokens=steps, ignore_eos=True), device)
        runner.graphs.step, runner.eager.step = graph_step, eager_step
        rounds = max(engine.stats.num_rounds - rounds0, 1)
        entry["spec_profile"] = row = {
            "batch": batch, "rounds": rounds, "ms_per_round_profiled": wall / rounds * 1e3,
            "phase_ms_per_round": {k: round((v - before.get(k, 0.0)) / rounds * 1e3, 3)
                                   for k, v in engine.stats.phase_seconds.items() if v - before.get(k, 0.0)},
            "runner_steps": dict(sorted(shapes_run.items(), key=lambda kv: -kv[1])), **tables,
        }  # fmt: skip
        print(f"[{name}] spec profile: " + json.dumps({k: v for k, v in row.items() if not k.startswith("top")}),
              flush=True)  # fmt: skip
        print(row["top_by_device_time"], flush=True)
        print(row["top_by_host_time"], flush=True)
        del engine

    # ----- where a captured loop pass's time goes at full depth, against the captured step engine -----
    def loop_profile() -> None:
        """Captured step and loop engines at full depth: prefill-only (1 token) and whole (1 + `check_new` tokens) runs
        interleaved, so decode time is their difference; each engine's phase seconds over its whole runs; then the
        profiler's top operations (host and device) over one whole run of each."""

        steps, repeats = shape["check_new"], shape["loop_repeats"]
        order_rng = random.Random(1)
        rows = {}
        for batch in batches[1:]:
            prompts = batch_prompts[batch]
            blocks = blocks_for(batch, shape["prompt"] + steps + 1)
            engines = {"step": make(num_kv_blocks=blocks), "loop": make(batching="loop", num_kv_blocks=blocks)}
            lengths = {"prefill": 1, "whole": steps + 1}
            runs = [(label, part) for label in engines for part in lengths]
            for label, part in runs:  # warm: captures every shape first
                engines[label].generate(prompts, SamplingParams(max_tokens=lengths[part], ignore_eos=True))
            seconds = {run: [] for run in runs}
            phases = {label: {} for label in engines}
            for _ in range(repeats):
                for label, part in order_rng.sample(runs, len(runs)):
                    engine = engines[label]
                    before = dict(engine.stats.phase_seconds)
                    sync(device)
                    start = time.perf_counter()
                    engine.generate(prompts, SamplingParams(max_tokens=lengths[part], ignore_eos=True))
                    sync(device)
                    seconds[(label, part)].append(time.perf_counter() - start)
                    if part == "whole":
                        for key, value in engine.stats.phase_seconds.items():
                            phases[label][key] = phases[label].get(key, 0.0) + value - before.get(key, 0.0)
            median = {run: statistics.median(values[1:]) for run, values in seconds.items()}
            row = {}
            for label in engines:
                decode = median[(label, "whole")] - median[(label, "prefill")]
                row[label] = {
                    "prefill_seconds": median[(label, "prefill")], "whole_seconds": median[(label, "whole")],
                    "decode_ms_per_token_step": decode / steps * 1e3,
                    "phase_ms_per_token_step": {k: round(v / repeats / steps * 1e3, 3) for k, v in phases[label].items()
                                                if v},
                }  # fmt: skip
            decode_ms = {label: row[label]["decode_ms_per_token_step"] for label in engines}
            row["loop_vs_step_decode"] = decode_ms["step"] / decode_ms["loop"]
            row["loop_vs_step_prefill"] = row["step"]["prefill_seconds"] / row["loop"]["prefill_seconds"]
            for label, engine in engines.items():
                row[label].update(profiled(engine, prompts, SamplingParams(max_tokens=steps + 1, ignore_eos=True),
                                           device)[1])  # fmt: skip
            rows[f"B={batch}"] = row
            print(f"[{name}] loop profile B={batch}: " + json.dumps(
                {k: v if not isinstance(v, dict) else {m: n for m, n in v.items() if not m.startswith("top")}
                 for k, v in row.items()}, default=str), flush=True)  # fmt: skip
            for label in engines:
                print(f"--- {label} B={batch} by device time\n{row[label]['top_by_device_time']}", flush=True)
                print(f"--- {label} B={batch} by host time\n{row[label]['top_by_host_time']}", flush=True)
            entry["loop_profile"] = rows
            del engines
            free_memory(device)

    grid = sorted({(k, d) for k, d in [(3, 1), (3, depth // 2)] if 1 <= d < depth and (k, d) != (2, 1)})
    # cheapest and least-measured first: the budget stops the later sections, not these
    sections = [("correctness", correctness), ("loop batching", loop_batching), ("plain", plain_timing),
                ("K=2,d=1", lambda: spec_timing(2, 1)), ("workload", workload),
                ("long context", long_context), ("profile", profile), ("loop profile", loop_profile),
                ("spec profile", spec_profile)]  # fmt: skip
    if args.sections:
        chosen = args.sections.split(";")
        unknown = set(chosen) - {label for label, _ in sections} - {"more plans"}
        if unknown:
            raise SystemExit(f"--sections: unknown {sorted(unknown)}; choose from {[label for label, _ in sections]}")
        sections = [(label, dict(sections)[label]) for label in chosen if label != "more plans"]  # in the order given
    if not tiny and (not args.sections or "more plans" in args.sections.split(";")):
        sections += [(f"K={k},d={d}", lambda k=k, d=d: spec_timing(k, d)) for k, d in grid]
    for label, section in sections:
        if label != "correctness" and time.perf_counter() > deadline:
            entry.setdefault("skipped_sections", []).append(label)
            continue
        section_start = time.perf_counter()
        try:
            section()
        except Exception as error:  # one failing section (say, out of memory) must not lose the others
            entry.setdefault("errors", {})[label] = "".join(traceback.format_exception(error))[-2000:]
            print(f"[{name}] {label} failed: {error!r}", flush=True)
        entry.setdefault("section_seconds", {})[label] = round(time.perf_counter() - section_start, 1)
        free_memory(device)
        save(report)


EAGER_CODA = "loop, coda eager"


def eager_coda(engine: LoopedSpecEngine) -> LoopedSpecEngine:
    """The loop engine with its loop stage captured but its coda readouts and exit rule eager (the runner its captured
    stages wrap): the other side of the captured coda stages' A/B."""
    batcher = engine.loop_batcher
    batcher.runner = batcher.finisher.runner = batcher.exits.runner = engine.runner
    return engine


def free_memory(device: str) -> None:
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
        if "skipped" in entry:
            lines += [f"## {name}: skipped ({entry['skipped']})", ""]
            continue
        c, g = entry["correctness"], entry.get("graphs", {})
        lines += [
            f"## {name} ({entry['dtype']}, D={entry['full_depth']}, shape {entry['shape']})",
            "",
            f"- paged kernel: {c.get('paged_kernel')}; eager (kernel) vs reference (SDPA): "
            f"{c.get('eager_vs_reference_identical_requests')}/{c.get('requests')} requests token-identical",
            f"- graphs vs eager: {c.get('graphs_vs_eager_identical_requests')}/{c.get('requests')} token-identical",
            f"- speculative vs plain: {c.get('speculative_vs_plain_identical_requests')}",
            f"- early exit (skip, fixed depth), speculative vs plain: "
            f"{c.get('early_exit_speculative_vs_plain_identical_requests')}",
            f"- graphs: {g.get('count')} captured in {g.get('capture_seconds', 0):.1f} s, "
            f"{g.get('capture_bytes', 0) / 2**20:.0f} MiB; contexts {g.get('contexts')}",
            f"- workload: {entry.get('workload')}",
            f"- loop batching (loop vs step engine; timings captured, interleaved, with an A/A line): "
            f"{entry.get('loop_batching')}",
            f"- section seconds: {entry.get('section_seconds')}; skipped: {entry.get('skipped_sections')}; "
            f"errors in: {sorted(entry.get('errors', {}))}",
            "",
            "| B | config | accept | tok/s | vs plain-graphs | weights-only model | plain HBM bound tok/s | fraction |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for t in entry["timing"]:
            lines.append(
                f"| {t['batch']} | {t['config']} | {t.get('acceptance_measured', float('nan')):.2f} | "
                f"{t['tokens_per_s']:.1f} | {t.get('ratio_vs_plain_graphs', float('nan')):.2f} | "
                f"{t.get('weights_only_model_ratio', float('nan')):.2f} | {t['hbm_bound_plain_tokens_per_s']:.0f} | "
                f"{t['fraction_of_plain_bound']:.2f} |"
            )
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 shapes (CPU/CI smoke mode)")
    parser.add_argument("--models", default="ouro-1.4b,nanbeige4.2-3b,huginn-0125")
    parser.add_argument("--budget-seconds", type=float, default=300.0, help="start no new section after this")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="weights (not --tiny)")
    parser.add_argument("--sections", default=None, help="sections to run, separated by ';' (default: all)")
    parser.add_argument("--new", type=int, default=None, help="new tokens per timed request (default: the shape's)")
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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(report: dict) -> None:  # after every section, so a run stopped by its time limit keeps its results
        report["wall_seconds"] = time.perf_counter() - start
        (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "gpu_check.md").write_text(markdown(report))

    for name in args.models.split(","):
        config = dict(REAL_CONFIGS[name], _name=name)
        if args.tiny:
            config.update(TINY_HUGINN if config["model_type"] == "huginn_raven" else TINY)
        if time.perf_counter() > deadline:
            report["models"][name] = {"skipped": "time budget spent"}
            continue
        check_model(name, config, args, report, deadline, save)
    save(report)
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'} in {report['wall_seconds']:.0f} s")
    if args.tiny and args.device == "cpu":  # CI's mode: fp32 on the CPU, where every path gives the same tokens (on a
        # GPU a kernel and its reference, or bf16 rounding, may part near-tied logits: there the counts are reported)
        differ = mismatches(report)
        if differ:
            sys.exit("not token-identical on the CPU: " + "; ".join(differ))


def mismatches(report: dict) -> list[str]:
    """The correctness counts of `report` below their number of requests (model: what differed, n of m)."""
    out = []
    for name, entry in report["models"].items():
        c = entry.get("correctness") or {}
        n = c.get("requests")
        counts = {
            key: c.get(key) for key in ("eager_vs_reference_identical_requests", "graphs_vs_eager_identical_requests")
        }
        for key in ("speculative_vs_plain_identical_requests", "early_exit_speculative_vs_plain_identical_requests"):
            counts.update({f"{key} {plan}": same for plan, same in (c.get(key) or {}).items()})
        out += [f"{name}: {key} {same} of {n}" for key, same in counts.items() if same is not None and same != n]
        for label, row in (entry.get("loop_batching") or {}).items():
            if isinstance(row, dict) and row.get("identical_requests") != row.get("of"):
                out.append(f"{name}: loop batching {label} {row.get('identical_requests')} of {row.get('of')}")
    return out


if __name__ == "__main__":
    main()
