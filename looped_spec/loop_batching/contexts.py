"""The attention contexts of a loop pass's items: of exactly some items' positions, and the one a readout gets."""

from __future__ import annotations

from looped_spec.loop_batching.items import Item


def items_context(runner, items: list[Item]):
    """The context of exactly `items`' positions (each item's positions, after its request's earlier ones)."""
    counts = [it.num_positions for it in items]
    lens = [it.position + n for it, n in zip(items, counts)]
    return runner.context([it.request for it in items], counts, lens)


def readout_context(runner, done: list[Item], ctx, items: list[Item]):
    """The context a readout of `done` (some of the pass's `items`) gets: a readout that attends (Huginn's coda)
    writes KV, so then the context of exactly the items read out; else the pass's."""
    if not runner.adapter.readout_uses_kv or len(done) == len(items):
        return ctx
    return items_context(runner, done)
