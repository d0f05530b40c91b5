"""Loop-level batching: one pass of the shared block serves every request at whatever loop it is on
(docs/architecture.md, "Loop-level batching")."""

from looped_spec.loop_batching.batcher import LoopBatcher
from looped_spec.loop_batching.graphs import LoopPassGraphs
from looped_spec.loop_batching.items import DraftRound, Entering, Item, PassResult
from looped_spec.loop_batching.rounds import LoopRounds

__all__ = ["DraftRound", "Entering", "Item", "LoopBatcher", "LoopPassGraphs", "LoopRounds", "PassResult"]
