"""A step is a transaction over its requests (docs/architecture.md, "Failure semantics").

Its computation changes no request state but the random generators. If it raises, the generators are restored
(the retried step draws the same tokens; KV blocks the step reserved stay with their requests) and the error is
raised once. The failed step's requests become suspects and run alone, one per step; a suspect that fails alone
twice in a row is the cause (a one-shot engine fault does not strike twice): it is blamed — finished with the
error — and the others go on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from looped_spec.request import Request, RequestStatus


class StepFailures:
    """The suspects of failed steps and how often each failed alone; runs a step's computation as a transaction."""

    #: a request whose step fails this many times in a row while it runs alone finishes with "error"
    FAILURES_TO_BLAME = 2

    def __init__(self) -> None:
        self.suspects: list[Request] = []  # requests of a failed step, to be run one at a time
        self.failed_alone: dict[str, int] = {}  # suspect id -> consecutive failures running alone

    def next_suspect(self) -> Request | None:
        """A running request from a failed step that has not stepped by itself since (the next step runs it alone)."""
        for request in [r for r in self.suspects if r.status is not RequestStatus.RUNNING]:
            self._clear(request)  # finished, or preempted: its recompute starts afresh
        return self.suspects[0] if self.suspects else None

    def run(
        self, suspect: Request | None, requests: list[Request], compute: Callable[[], Any],
        blame: Callable[[Request, Exception], None], settled: Callable[[Any], bool] | None = None,
    ) -> Any:  # fmt: skip
        """`compute()` for a step of `requests` (`suspect`: the one running alone, or None). Its result; on failure
        the generators are restored and the error raised, or `blame(suspect, error)` (which finishes the suspect with
        the error) and None. `settled(result)`: whether the suspect's work is done (a loop pass can end mid-token;
        until its token is done the suspect keeps running alone, so the stage that failed is reached alone); None:
        every step finishes its requests' work."""
        # a step whose requests are all greedy draws nothing (every sampler takes the argmax of an all-greedy batch)
        saved = [r.generator.get_state() for r in requests] if not all(r.greedy for r in requests) else []
        try:
            result = compute()
        except BaseException as exc:
            for request, state in zip(requests, saved):
                request.generator.set_state(state)
            if not isinstance(exc, Exception):
                raise
            if suspect is None:
                self.suspects += [r for r in requests if r not in self.suspects]
                raise
            failures = self.failed_alone.get(suspect.request_id, 0) + 1
            if failures < self.FAILURES_TO_BLAME:
                self.failed_alone[suspect.request_id] = failures
                raise
            self._clear(suspect)
            blame(suspect, exc)
            return None
        if suspect is not None:
            if settled is None or settled(result):
                self._clear(suspect)
            else:  # it stepped alone without failing: a failure alone later is not "in a row"
                self.failed_alone.pop(suspect.request_id, None)
        return result

    def drop(self, request: Request) -> None:
        """Forget a request (its caller dropped it): it is no longer a suspect."""
        if request in self.suspects:
            self._clear(request)

    def clear(self) -> None:
        self.suspects.clear()
        self.failed_alone.clear()

    def _clear(self, request: Request) -> None:
        self.suspects.remove(request)
        self.failed_alone.pop(request.request_id, None)
