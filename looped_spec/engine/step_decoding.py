"""The step engine's run stage (`batching="step"`): a prefill step, or one decode round for the whole batch.

A decode round is the controller's plan for the batch: K drafts with the first d loops and one verification
(speculative/round.py), plain decoding being the K = 0 round. Each function takes the engine, whose `_commit` is
the one place request state changes; the round's feedback goes to the controller after that commit.
"""

from __future__ import annotations

import time

from looped_spec.control.plan import SpeculationPlan, round_feedback
from looped_spec.execution.logprobs import logprobs_of_rows
from looped_spec.execution.sampler import SamplingRows, sample
from looped_spec.execution.transfers import to_device
from looped_spec.request import Request, ScheduledBatch, TokenLogprob, mean_context
from looped_spec.speculative.round import RoundResult


def step(engine, suspect: Request | None) -> None:
    """Schedule, run and commit one prefill step or decode round (only `suspect`'s, while one runs alone)."""
    t0 = time.perf_counter()
    scheduler, stats = engine.scheduler, engine.stats
    batch = scheduler.schedule(only=suspect)
    stats.phase_seconds["schedule"] += time.perf_counter() - t0
    scheduler.count_into(stats)
    if batch is None:
        return
    if batch.is_prefill:
        prefill_step(engine, suspect, batch)
        return
    t1 = time.perf_counter()
    context = mean_context(batch.requests)
    plan = engine.controller.plan(len(batch.requests), context, [r.request_id for r in batch.requests])
    # a request whose exit rule reads out through attention (Huginn's "kl") cannot be verified position by
    # position inside one pass (exit_round.py): it decodes plainly (K = 0) within the round
    wants = [0 if engine.exit_rule_reads_kv(r) else plan.k for r in batch.requests]
    requests, k = scheduler.reserve_decode(batch.requests, wants)
    stats.phase_seconds["control"] += time.perf_counter() - t1
    scheduler.count_into(stats)
    if not requests:  # preempted before their round: it reports nothing
        engine.controller.abandon(plan)
        return
    # one decode path: plain decoding is the K = 0 round
    try:
        result = engine.failures.run(
            suspect,
            requests,
            lambda: engine.spec_round.run(requests, k, plan.d, plan.measure_depths, plan.stop_margin),
            engine._finish_with_error,
        )
    except BaseException:  # a transaction: the round failed and committed nothing (failures.py), nor reports
        engine.controller.abandon(plan)
        raise
    if result is None:  # its suspect was blamed: nothing committed, nothing to report
        engine.controller.abandon(plan)
    else:
        finish_round(engine, requests, k, plan, result, t0, context)


def prefill_step(engine, suspect: Request | None, batch: ScheduledBatch) -> None:
    """Run and commit a batch of prompt chunks (a request whose prompt completes gets its first token)."""
    t0 = time.perf_counter()
    done = engine.failures.run(suspect, batch.requests, lambda: run_prefill(engine, batch), engine._finish_with_error)
    if done is None:
        return
    tokens, exit_depths, logprobs = done
    depths = None if all(e is None for e in exit_depths) else [[] if e is None else [e] for e in exit_depths]
    engine._commit(batch.requests, tokens, chunk_lens=batch.chunk_lens, exit_depths=depths, logprobs=logprobs)
    stats = engine.stats
    stats.num_prefill_steps += 1
    stats.num_prompt_tokens += sum(batch.chunk_lens)
    stats.phase_seconds["prefill"] += time.perf_counter() - t0


def run_prefill(
    engine, batch: ScheduledBatch
) -> tuple[list[list[int]], list[int | None], list[list[TokenLogprob]] | None]:
    """Prompt chunks at full depth; the first generated token of each request whose prompt completes
    (read out at its exit depth under early exit, which is also returned). Changes no request."""
    requests, chunk_lens = batch.requests, batch.chunk_lens
    logits, exit_depths = engine.runner.prefill_with_depths(requests, chunk_lens)
    ends = [i for i, (r, n) in enumerate(zip(requests, chunk_lens)) if r.num_computed + n == r.num_tokens]
    tokens: list[list[int]] = [[] for _ in requests]
    logprobs: list[list[TokenLogprob]] | None = None
    if ends:
        finishing = [requests[i] for i in ends]
        finished_logits = logits[to_device(ends, logits.device)]
        sampled = sample(finished_logits, SamplingRows.build(finishing, engine.adapter.device))
        for i, token in zip(ends, sampled.tolist()):
            tokens[i] = [token]
        entries = logprobs_of_rows(finishing, finished_logits, sampled)
        if entries is not None:
            logprobs = [[] for _ in requests]
            for i, entry in zip(ends, entries):
                logprobs[i] = entry
    return tokens, exit_depths, logprobs


def finish_round(
    engine, requests: list[Request], k: list[int], plan: SpeculationPlan, result: RoundResult, start: float,
    context: float,
) -> None:  # fmt: skip
    """Commit a decode round, then tell the controller (feedback goes out only after the commit)."""
    t0 = time.perf_counter()
    # the drafts each request proposed: the plan's K, or fewer where per-token stopping ended its draft
    proposed = result.proposed if result.proposed is not None else k
    engine._commit(
        requests, result.committed, num_proposed=proposed, num_accepted=result.num_accepted,
        exit_depths=result.exit_depths, logprobs=result.logprobs,
    )  # fmt: skip
    t1 = time.perf_counter()
    stats = engine.stats
    if max(k) == 0:
        stats.phase_seconds["decode"] += result.decode_time
    else:
        stats.phase_seconds["draft"] += result.draft_time
        stats.phase_seconds["verify"] += result.verify_time
        stats.phase_seconds["accept"] += result.accept_time
    stats.record_plan(len(requests), max(k), plan.d)
    stats.record_drafts(proposed, result.num_accepted)
    if result.verified_accepted is not None:
        stats.num_exit_draft_decided += sum(result.num_accepted) - sum(result.verified_accepted)
    stats.phase_seconds["commit"] += t1 - t0
    exit_depths = []
    if result.exit_depths is not None:
        exit_depths = [e for ds, toks in zip(result.exit_depths, result.committed) for e in ds[: len(toks)]]
    feedback = round_feedback(
        plan,
        batch_size=len(requests),
        context=context,
        num_proposed=proposed if result.verified_proposed is None else result.verified_proposed,
        num_accepted=result.num_accepted if result.verified_accepted is None else result.verified_accepted,
        seconds=t1 - start,
        draft_seconds=result.draft_time,
        depth_matches=result.depth_matches,
        depth_trials=result.depth_trials,
        request_ids=[r.request_id for r in requests],
        request_matches=result.request_matches,
        request_trials=result.request_trials,
        exit_depths=exit_depths,
        exit_skips=engine.runner.exit_mode == "skip",
    )
    engine.controller.observe(feedback)
    stats.phase_seconds["control"] += time.perf_counter() - t1
