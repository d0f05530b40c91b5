"""JSONL trace of controller events: one JSON object per line, flushed on `close()`.

Events (field `event`): ``plan`` (the SpeculationPlan fields, ``batch``, the running requests, and
``context``, their mean context in tokens or null when the caller gave none),
``feedback`` (the RoundFeedback fields, named as there), ``abandon`` (``plan_id``: a planned round that ran and
reported nothing) and ``decision`` (bucket, what the policy decided, after which plan_id). Every line carries ``t``,
seconds since the trace was opened.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from looped_spec.control.plan import RoundFeedback, SpeculationPlan


class TraceWriter:
    """Appends controller events to a JSONL file (buffered; `close()` flushes)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("w", encoding="utf-8")
        except OSError as exc:  # a directory, a folder under a file, no permission: name the option, not just errno
            raise ValueError(f"trace_path={str(path)!r}: cannot write the trace there ({exc.strerror})") from None
        self._t0 = time.perf_counter()

    def write(self, event: str, **fields: Any) -> None:
        if self._file.closed:
            return
        record = {"event": event, "t": round(time.perf_counter() - self._t0, 6), **fields}
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def plan(self, plan: SpeculationPlan, batch_size: int, context: float | None = None, decision: str | None = None):
        """A plan, after the decision that chose it (if any)."""
        if decision is not None:
            self.decision(plan.bucket, decision, plan.plan_id)
        self.write("plan", **asdict(plan), batch=batch_size, context=None if context is None else round(context, 2))

    def feedback(self, fb: RoundFeedback, decision: str | None = None) -> None:
        """A round's feedback, before the decision it caused (if any)."""
        self.write("feedback", **asdict(fb))
        if decision is not None:
            self.decision(fb.bucket, decision, fb.plan_id)

    def decision(self, bucket: int, what: str, plan_id: int) -> None:
        self.write("decision", bucket=bucket, what=what, plan_id=plan_id)

    def flush(self) -> None:
        if not self._file.closed:
            self._file.flush()

    def close(self) -> None:
        self.flush()
        self._file.close()
