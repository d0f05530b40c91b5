"""JSONL trace of controller events: one JSON object per line, flushed on `close()`.

Events (field `event`): ``plan`` (plan_id, batch, bucket, candidate, k, d, measure_depths), ``feedback``
(the RoundFeedback fields) and ``decision`` (bucket, what the policy decided, after which plan_id). Every
line carries ``t``, seconds since the trace was opened.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from looped_spec.plan import RoundFeedback, SpeculationPlan


class TraceWriter:
    """Appends controller events to a JSONL file (buffered; `close()` flushes)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("w", encoding="utf-8")
        self._t0 = time.perf_counter()

    def write(self, event: str, **fields: Any) -> None:
        if self._file.closed:
            return
        record = {"event": event, "t": round(time.perf_counter() - self._t0, 6), **fields}
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def plan(self, plan: SpeculationPlan, batch_size: int) -> None:
        self.write(
            "plan",
            plan_id=plan.plan_id,
            batch=batch_size,
            bucket=plan.bucket,
            candidate=plan.candidate,
            k=plan.k,
            d=plan.d,
            measure_depths=plan.measure_depths,
        )

    def feedback(self, fb: RoundFeedback) -> None:
        self.write(
            "feedback",
            plan_id=fb.plan_id,
            bucket=fb.bucket,
            candidate=fb.candidate,
            k=fb.k,
            d=fb.d,
            batch=fb.batch_size,
            proposed=fb.num_proposed,
            accepted=fb.num_accepted,
            draft_time=fb.draft_time,
            verify_time=fb.verify_time,
            commit_time=fb.commit_time,
            depth_matches=fb.depth_matches,
            depth_trials=fb.depth_trials,
        )

    def decision(self, bucket: int, what: str, plan_id: int) -> None:
        self.write("decision", bucket=bucket, what=what, plan_id=plan_id)

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()
