"""The loop engine's run stage (`batching="loop"`): one loop pass over every running request's work in flight.

Prompt chunks join the decoding requests' work in the same pass; a request entering its next token (or
speculative round) takes the plan the controller gave the pass (loop_batching/rounds.py). Each function takes
the engine, whose `_commit` is the one place request state changes; rounds that finished in the pass send their
feedback after that commit.
"""

from __future__ import annotations

import time

from looped_spec.control.controller import FixedController
from looped_spec.control.plan import RoundFeedback, SpeculationPlan
from looped_spec.loop_batching import Entering, PassResult
from looped_spec.request import Request, RequestStatus, ScheduledBatch


def step(engine, suspect: Request | None) -> None:
    """Schedule, run and commit one loop pass (only `suspect`'s work, while one runs alone)."""
    t0 = time.perf_counter()
    batcher, scheduler = engine.loop_batcher, engine.scheduler
    chunks_in_flight = {i: it.num_positions for i, it in batcher.items.items() if it.chunk and it.fresh()}
    batch = scheduler.schedule_pass(chunks_in_flight, only=suspect)
    engine.stats.phase_seconds["schedule"] += time.perf_counter() - t0
    scheduler.count_into(engine.stats)
    if batch is None:
        return
    run_pass(engine, suspect, batch, {r.request_id: n for r, n in zip(batch.requests, batch.chunk_lens) if n})


def run_pass(engine, suspect: Request | None, batch: ScheduledBatch, chunks: dict[str, int]) -> None:
    """One loop pass over every running request's work in flight and the prompt chunks that start in it; the
    tokens it finished are committed."""
    t0 = time.perf_counter()
    batcher, scheduler, stats = engine.loop_batcher, engine.scheduler, engine.stats
    scheduled = batch.requests
    budget = engine.config.max_pass_positions
    if budget is not None:  # deepest work first (LoopBatcher.select); the rest waits for a later pass
        scheduled = batcher.select(scheduled, chunks, budget)
        chunks = {i: n for i, n in chunks.items() if i in {r.request_id for r in scheduled}}
    # work in flight holds its KV slots already: only the requests entering their next token (or speculative
    # round: K drafts) reserve theirs, under the plan in use
    entering = [r for r in scheduled if r.prefilled and not batcher.in_flight(r)]
    rounds: dict[str, Entering] = {}
    kept: list[Request] = []
    if entering:
        t1 = time.perf_counter()
        # the batch the plan is for is the requests decoding, as a step round's: one still prefilling (its prompt chunk
        # in flight or starting) runs no round under it
        decoding = [r for r in batch.requests if r.prefilled]
        plan, _ = engine.loop_rounds.plan(decoding, engine.controller.plan)
        # as in a step round, a request whose exit rule reads out through attention decodes plainly (K = 0)
        wants = [0 if engine.exit_rule_reads_kv(r) else plan.k for r in entering]
        kept, k = scheduler.reserve_decode(entering, wants)
        # counterfactual readouts at full depth only (under early exit a token's depth is the rule's)
        rounds = {
            r.request_id: Entering(kr, plan.d, plan.measure_depths and not r.exits_early, plan.stop_margin)
            for r, kr in zip(kept, k)
        }
        scheduler.count_into(stats)
        stats.phase_seconds["control"] += time.perf_counter() - t1
    requests = [r for r in scheduled if r.status is RequestStatus.RUNNING]
    if not requests:
        return
    # while nothing waits to join the passes (a queued request the batch has room for, a prompt's next chunk, work
    # the pass budget left out), loops in which no item can stop run back to back; nothing joins a suspect alone
    joining = suspect is None and (
        (scheduler.waiting and len(scheduler.running) < engine.max_batch_size)
        or len(scheduled) < len(batch.requests)
        or any(not r.prefilled and not batcher.in_flight(r) and r.request_id not in chunks for r in scheduler.running)
    )
    max_loops = 1 if joining else engine.adapter.full_depth

    def settled(result: PassResult) -> bool:  # the suspect's token, round or prompt chunk is done
        return suspect.request_id not in result.items and suspect.request_id not in result.next_drafts

    result = engine.failures.run(
        suspect, requests, lambda: batcher.run(requests, rounds, max_loops, chunks), engine._finish_with_error,
        settled,
    )  # fmt: skip
    if result is None:
        return
    if result.prefilled:
        engine._commit(result.prefilled, result.first_tokens, chunk_lens=result.chunk_lens,
                       exit_depths=result.first_exit_depths, logprobs=result.first_logprobs)  # fmt: skip
        stats.num_prompt_tokens += sum(result.chunk_lens)
    engine.loop_rounds.start(kept)
    if kept:  # counted once a round ran under the plan (a failed pass ran none), at the K its rounds drew, as a step
        # round is counted
        counted = engine.loop_rounds.drew(k)
        if counted == -1:  # the plan's first rounds
            stats.record_plan(len(decoding), max(k), plan.d)
        elif counted is not None:  # a later round under the plan drew more than those counted before
            stats.regrade_plan(counted, max(k), plan.d)
    if result.finished:
        engine._commit(
            result.finished, result.tokens, num_proposed=result.proposed, num_accepted=result.accepted,
            exit_depths=result.exit_depths, logprobs=result.logprobs,
        )  # fmt: skip
        stats.record_drafts(result.proposed, result.accepted)
        stats.num_exit_draft_decided += sum(result.accepted) - sum(result.verified_accepted)
    batcher.commit(result)
    # counted with the commit: an error in the controller below is raised with the pass committed
    stats.num_loop_passes += result.loops
    stats.num_loop_passes_captured += result.captured
    stats.num_loop_pass_positions += result.positions * result.loops
    stats.num_loop_pass_embeds += result.entered
    for stage, seconds in result.stage_seconds.items():
        stats.phase_seconds["pass_" + stage] += seconds
    t2 = time.perf_counter()
    feedbacks = engine.loop_rounds.finish(result, batcher.items.keys() | batcher.next_drafts.keys())
    error = _tell_controller(engine.controller, feedbacks, engine.loop_rounds.take_abandoned())
    stats.phase_seconds["control"] += time.perf_counter() - t2
    stats.phase_seconds["decode"] += time.perf_counter() - t0
    if error is not None:
        raise error


def _tell_controller(
    controller: FixedController, feedbacks: list[RoundFeedback], abandoned: list[SpeculationPlan]
) -> Exception | None:
    """Every plan a pass finished or abandoned, each told on its own: an error in one call does not keep the others'
    from the controller (an EMA probe among them would wait for its feedback for good), and the first error is
    returned to be raised once the pass is counted."""
    first: Exception | None = None
    for call, plan in [*((controller.observe, f) for f in feedbacks), *((controller.abandon, p) for p in abandoned)]:
        try:
            call(plan)
        except Exception as exc:  # raised after the others were told
            first = first or exc
    return first
