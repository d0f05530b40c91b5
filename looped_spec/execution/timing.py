"""Timing device work without stalling it: wall clock on a CPU, CUDA events on a GPU.

The engine times a round's phases for the controller. On a GPU a host clock read right after a launch says
when the work was queued, not when it ran, and synchronizing to read it would stall the pipeline every round.
So `Stopwatch.mark()` records a CUDA event in the stream, and `seconds(start, end)` reads two events once they
have completed: a round reads its marks only after its results reached the host (`.tolist()` waits for the
stream), so the read never waits.
"""

from __future__ import annotations

import time

import torch


class Stopwatch:
    """Marks on one device's timeline; `seconds(a, b)` between two marks once both have completed."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = torch.device(device).type == "cuda"

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start, end) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()  # already complete when read after the round's results reached the host
        return start.elapsed_time(end) / 1000.0


class Span:
    """Seconds summed over several (start, end) mark pairs of one stopwatch, read lazily (`total()`)."""

    __slots__ = ("watch", "pairs", "_start")

    def __init__(self, watch: Stopwatch) -> None:
        self.watch = watch
        self.pairs: list[tuple] = []
        self._start = None

    def start(self) -> None:
        self._start = self.watch.mark()

    def stop(self) -> None:
        self.pairs.append((self._start, self.watch.mark()))

    def total(self) -> float:
        return sum(self.watch.seconds(a, b) for a, b in self.pairs)
