"""Continuous batching with chunked prefill, KV-block admission and recompute preemption, first come first served or
by request priority."""

from __future__ import annotations

from bisect import insort
from collections import deque
from collections.abc import Collection

from looped_spec.engine.prefix_cache import PrefixCache
from looped_spec.execution.kv_cache import KVCache
from looped_spec.request import Request, RequestStatus, ScheduledBatch, TokenLogprob


class Scheduler:
    """Owns the waiting queue and the running set, and every KV block a request holds.

    A step is either a prefill step (chunks of prompts — or of preempted requests being
    recomputed — under `max_num_batched_tokens`) or a decode round over every running request; with loop-level
    batching, a loop pass in which prompt chunks join the running requests' work (`schedule_pass`).
    When blocks run out the newest running request (latest arrival) is preempted: its blocks are
    freed and it goes back to the front of the queue to be recomputed, keeping the tokens it already
    has. Under `policy="priority"` the queue and the preemption order go by (priority, arrival) instead: the waiting
    request of the lowest priority value is admitted first, the running one of the highest is preempted first (a
    running request is never preempted to admit a waiting one, as in vLLM's). Scheduling (admission, KV growth,
    preemption) happens before a step runs; `postprocess` is the only place the step's results change request state.
    With a `prefix_cache`, an admitted request starts from the cached blocks its tokens begin with, and its blocks
    are registered once their KV is final.
    """

    def __init__(
        self, kv_cache: KVCache, max_batch_size: int, max_num_batched_tokens: int,
        prefix_cache: PrefixCache | None = None, policy: str = "fcfs",
    ) -> None:  # fmt: skip
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy={policy!r} must be 'fcfs' or 'priority'")
        self.policy = policy
        self.kv = kv_cache
        self.prefix_cache = prefix_cache
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self._enqueue(request, front=False)

    @staticmethod
    def _rank(request: Request) -> tuple[int, int]:
        """Who goes first: admitted before, preempted after (priority is 0 for every request under "fcfs")."""
        return request.priority, request.arrival

    def _enqueue(self, request: Request, front: bool) -> None:
        """Into the waiting queue, which stays ordered by `_rank`. Under "fcfs" a new request is the latest arrival
        and a preempted one arrived before every waiting one (requests are admitted in arrival order and the newest
        running one is preempted), so the ends of the queue are their places."""
        if self.policy == "fcfs":
            (self.waiting.appendleft if front else self.waiting.append)(request)
        else:
            insort(self.waiting, request, key=self._rank)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----- step planning -----
    def schedule(self, only: Request | None = None) -> ScheduledBatch | None:
        """The next step's work; with `only` (a running request), that request's next step by itself."""
        if only is not None:
            return self._schedule_alone(only)
        batch = self._schedule_prefill()
        if batch is not None:
            return batch
        if self.running:
            return ScheduledBatch(is_prefill=False, requests=list(self.running))
        return None

    def schedule_pass(self, chunks_in_flight: dict[str, int], only: Request | None = None) -> ScheduledBatch | None:
        """Loop-level batching: every running request the next loop pass serves, with the prompt chunk each starts
        in it (`chunk_lens[i]`, 0: none), admitted and reserved as for prefill steps. `chunks_in_flight`: request id
        -> positions of its chunk in flight; such a request starts none, and the chunks in flight count against
        `max_num_batched_tokens` (so prompts run in waves of D passes, as prefill steps would). With `only`, that
        request by itself."""
        if only is not None:
            if only.prefilled or only.request_id in chunks_in_flight:
                return ScheduledBatch(is_prefill=False, requests=[only], chunk_lens=[0])
            alone = self._schedule_alone(only)
            return None if alone is None else ScheduledBatch(False, alone.requests, alone.chunk_lens)
        budget = self.max_num_batched_tokens - sum(chunks_in_flight.values())
        starting = self._schedule_prefill(skip=chunks_in_flight, budget=budget) if budget > 0 else None
        chunks = {} if starting is None else dict(zip(map(id, starting.requests), starting.chunk_lens))
        requests = [r for r in self.running if r.prefilled or r.request_id in chunks_in_flight or id(r) in chunks]
        if not requests:
            return None
        return ScheduledBatch(is_prefill=False, requests=requests, chunk_lens=[chunks.get(id(r), 0) for r in requests])

    def _schedule_prefill(self, skip: Collection[str] = (), budget: int | None = None) -> ScheduledBatch | None:
        budget = self.max_num_batched_tokens if budget is None else budget
        requests: list[Request] = []
        chunks: list[int] = []
        for request in [r for r in self.running if not r.prefilled and r.request_id not in skip]:
            if request.status is not RequestStatus.RUNNING:  # preempted by an earlier request of this loop
                continue
            chunk = min(request.num_tokens - request.num_computed, budget)
            if chunk <= 0 or not self._grow_or_preempt(request, request.num_computed + chunk):
                break
            requests.append(request)
            chunks.append(chunk)
            budget -= chunk
        if any(r.status is not RequestStatus.RUNNING for r in requests):
            # a later request preempted one scheduled before it (under "priority" the running requests are in
            # admission order, not rank): its chunk does not run and its tokens go back to the budget, as in vLLM
            budget += sum(c for r, c in zip(requests, chunks) if r.status is not RequestStatus.RUNNING)
            chunks = [c for r, c in zip(requests, chunks) if r.status is RequestStatus.RUNNING]
            requests = [r for r in requests if r.status is RequestStatus.RUNNING]
        while self.waiting and budget > 0 and len(self.running) < self.max_batch_size:
            request = self.waiting[0]
            cached = self.prefix_cache.lookup(request) if self.prefix_cache is not None else []
            # admit only when the whole remaining prompt fits now, so admission never forces preemption (cached
            # blocks no request holds count among the free ones: taking them leaves fewer)
            need = self.kv.extra_blocks(request.block_table, request.num_tokens + 1) - len(cached)
            if need > self.kv.num_free_blocks - self.kv.num_free_among(cached):
                break
            if self.prefix_cache is not None:
                self.prefix_cache.take(request, cached)
            chunk = min(request.num_tokens - request.num_computed, budget)
            self.kv.grow(request.block_table, request.num_computed + chunk)
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            requests.append(request)
            chunks.append(chunk)
            budget -= chunk
        if not requests:
            return None
        return ScheduledBatch(is_prefill=True, requests=requests, chunk_lens=chunks)

    def _schedule_alone(self, request: Request) -> ScheduledBatch | None:
        if request.prefilled:
            return ScheduledBatch(is_prefill=False, requests=[request])
        chunk = min(request.num_tokens - request.num_computed, self.max_num_batched_tokens)
        if not self._grow_or_preempt(request, request.num_computed + chunk):
            return None
        return ScheduledBatch(is_prefill=True, requests=[request], chunk_lens=[chunk])

    def count_into(self, stats) -> None:
        """Copy the scheduler's counters into the engine's `EngineStats`."""
        stats.num_preemptions = self.num_preemptions
        if self.prefix_cache is not None:
            stats.num_prefix_cache_queries = self.prefix_cache.queries
            stats.num_prefix_cache_hits = self.prefix_cache.hits

    # ----- KV budget -----
    def _grow_or_preempt(self, request: Request, num_tokens: int) -> bool:
        """Make `request` hold `num_tokens`, preempting the requests ranked after it (the newest; under "priority" the
        lowest priority first) if needed. False if it got preempted."""
        while not self.kv.can_grow(request.block_table, num_tokens):
            victim = max(self.running, key=self._rank)
            self.preempt(victim)
            if victim is request:
                return False
        self.kv.grow(request.block_table, num_tokens)
        return True

    def reserve_decode(self, requests: list[Request], wanted_k: list[int]) -> tuple[list[Request], list[int]]:
        """Reserve KV for a decode round: 1 token each first (preempting if needed), then drafts.

        Returns the requests still running and each one's K_actual (draft tokens it can take).
        """
        # most rounds every request's tokens and drafts fit in the free blocks: nobody is preempted and no draft is
        # cut, so the checks below would change nothing (blocks are handed out request by request instead)
        kv = self.kv
        k_actual = [max(0, min(k, r.remaining_budget - 1)) for r, k in zip(requests, wanted_k)]
        tokens = [r.num_computed + 1 + k for r, k in zip(requests, k_actual)]
        extra = [kv.extra_blocks(r.block_table, n) for r, n in zip(requests, tokens)]
        running = all(r.status is RequestStatus.RUNNING for r in requests)
        if running and sum(extra) <= kv.num_free_blocks:
            for request, n, x in zip(requests, tokens, extra):
                if x > 0:
                    kv.grow(request.block_table, n)
            return list(requests), k_actual
        for request in sorted(requests, key=self._rank):
            if request.status is RequestStatus.RUNNING:
                self._grow_or_preempt(request, request.num_computed + 1)
        kept = [r for r in requests if r.status is RequestStatus.RUNNING]
        k_by_id = {id(r): k for r, k in zip(requests, wanted_k)}
        for request in sorted(kept, key=self._rank):  # drafts too go to who goes first, while blocks last
            k = max(0, min(k_by_id[id(request)], request.remaining_budget - 1))
            while k > 0 and not self.kv.can_grow(request.block_table, request.num_computed + 1 + k):
                k -= 1
            self.kv.grow(request.block_table, request.num_computed + 1 + k)
            k_by_id[id(request)] = k
        return kept, [k_by_id[id(r)] for r in kept]

    def preempt(self, request: Request) -> None:
        self.kv.free(request.block_table)
        request.num_computed = 0
        request.num_registered_blocks = 0
        request.prefilled = False
        request.status = RequestStatus.WAITING
        request.metrics.num_preemptions += 1
        self.running.remove(request)
        self._enqueue(request, front=True)
        self.num_preemptions += 1

    # ----- after a step -----
    def postprocess(
        self,
        requests: list[Request],
        tokens: list[list[int]],
        chunk_lens: list[int] | None = None,
        num_proposed: list[int] | None = None,
        num_accepted: list[int] | None = None,
        exit_depths: list[list[int]] | None = None,
        logprobs: list[list[TokenLogprob]] | None = None,
    ) -> tuple[list[int], list[tuple[Request, Exception]]]:
        """The one place a step changes request state, once everything it computed is known.

        `tokens[i]` are request i's tokens to commit (empty for a prompt chunk that does not end the
        prompt: its KV now covers `chunk_lens[i]` more tokens). Tokens are appended up to a stop token or
        limit; KV then covers every committed token but the last, blocks past it are released, and a
        finished request gives back all its blocks. `exit_depths[i]` (early exit) are the exit depths of the
        positions request i computed in this step from its last committed token on: the readout depth of each
        token it commits. `logprobs[i]` (requests that asked for them) are the entries of request i's tokens; those
        of the tokens it appended are kept.

        Returns how many tokens each request appended, and the requests whose commit failed with their errors (a
        request's own tokenizer failing on a token it decodes to look for stop strings): each keeps the tokens before
        the one that failed, and the caller finishes it with the error (which frees its blocks); the others commit as
        usual. Any other error here is the engine's own and is raised.
        """
        appended: list[int] = []
        failed: list[tuple[Request, Exception]] = []
        for i, (request, new) in enumerate(zip(requests, tokens)):
            if num_proposed is not None:
                request.metrics.rounds += 1
                request.metrics.num_draft_tokens += num_proposed[i]
                request.metrics.num_accepted_tokens += num_accepted[i] if num_accepted is not None else 0
            if not new:
                request.num_computed += chunk_lens[i] if chunk_lens is not None else 0
                if self.prefix_cache is not None:
                    self.prefix_cache.register(request, request.num_computed)
                appended.append(0)
                continue
            depths = exit_depths[i] if exit_depths is not None else []
            entries = logprobs[i] if logprobs is not None else None
            count = 0
            error = None
            for token in new:
                try:
                    finished = request.append(token)  # its tokenizer may fail: nothing of this token is committed
                except Exception as exc:
                    error = exc
                    break
                if count < len(depths):
                    record_exit_depth(request, depths[count])
                if entries:
                    request.logprobs.append(entries[count])
                count += 1
                if finished:
                    break
            appended.append(count)
            if error is not None:
                failed.append((request, error))
                continue
            if self.prefix_cache is not None:  # KV is final for every token but the last (before a finish frees it)
                self.prefix_cache.register(request, request.num_tokens - 1)
            request.prefilled = True
            if request.finish_reason is not None:
                self.finish(request)
            else:
                request.num_computed = request.num_tokens - 1
                self.release_unused(request)
        return appended, failed

    # ----- lifecycle -----
    def finish(self, request: Request, reason: str | None = None) -> None:
        if reason is not None:
            request.finish_reason = reason
        self.kv.free(request.block_table)
        request.status = RequestStatus.FINISHED
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)

    def release_unused(self, request: Request) -> None:
        """After a commit: give back blocks past the computed length (rejected draft positions)."""
        self.kv.truncate(request.block_table, request.num_computed + 1)


def record_exit_depth(request: Request, depth: int) -> None:
    """The token just committed was read out at `depth` (the forward of the token before it); kept for recompute."""
    histogram = request.metrics.exit_depth_histogram
    histogram[depth] = histogram.get(depth, 0) + 1
    index = request.num_tokens - 1 - request.num_prompt_tokens  # position num_tokens - 2, from the last prompt token
    if index == len(request.exit_depths):  # (never below: output tokens are never taken back, a recompute commits none)
        request.exit_depths.append(depth)
