"""What loop-level batching keeps between passes: the items in flight and a request's speculative round.

An item is one request's work in flight: one position for a token decoded plainly or drafted, the K+1 positions
of a speculative round's verification, the positions of a prompt chunk. It advances one loop per pass until its
stop depth: D for a plain token, a verification or a prompt chunk, the draft depth d for a drafted token (a draft
is a token whose exit is forced at d).

A measured round (the controller's counterfactual readouts) also reads out every depth its positions pass on the way
that the runner reads out (`ModelRunner.readout_depths`) and keeps each depth's greedy prediction (-1 at the others):
the agreement of depth j with the committed tokens is what the acceptance estimator learns from (docs/adaptive.md
"Acceptance").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from looped_spec.request import Request, RequestStatus, TokenLogprob


class Entering(NamedTuple):
    """How a request's next round runs: K drafts with the first d loops (K = 0: a plain token), measured or not, and
    the plan's per-token stopping margin (None: it drafts all K)."""

    k: int
    d: int
    measured: bool
    stop_margin: float | None = None


class PlainToken(NamedTuple):
    """A plain token a pass finished, to be read out (unless its exit rule already did) and sampled."""

    item: Item
    row: int  # its row in the pass
    exit_depth: int  # 0: it ran to depth D
    exit_state: torch.Tensor | None  # None: the pass's row (it exited here, or ran to D)
    preds: list | None  # a measured token's greedy predictions at depths 1..D-1 (-1 where not read out)
    logits: torch.Tensor | None  # [1, V]: its exit rule's readout of its exit state here (skip mode), else None


@dataclass(slots=True)
class DraftRound:
    """A request's speculative round in flight: K drafts from loops 1..d of positions start..start+K-1, the loop-d
    state of every position start..start+K, then one verification of them at loops d+1..D.

    Under early exit (`exits_early`) the draft runs under the exit rule: a position that exits at e <= d was read out
    where the target reads it out (`logits`, the target's own), and the verification continues the others from loop
    d under the rule (docs/architecture.md, "Early exit", "With speculation").
    """

    start: int  # the round's first position (its request's num_computed while the round runs)
    k: int
    d: int
    tokens: list[int] = field(default_factory=list)  # drafts drawn so far
    q: list[torch.Tensor | None] = field(default_factory=list)  # [V] each draft's distribution (None: greedy)
    states: list[torch.Tensor] = field(default_factory=list)  # [1, S] loop-d state of each position so far
    measured: bool = False
    preds: list[torch.Tensor] = field(default_factory=list)  # measured, per position: [d] greedy of depths 1..d
    exits_early: bool = False
    # per-token stopping: the round stops drafting at its first draft whose depth-d top-two margin is below this
    stop_margin: float | None = None
    # exits_early, per position so far: its exit depth within the draft (0: none), its state there (None: none),
    # the exit rule's carry after its last loop, and its readout at the exit (the target's logits; None: none)
    exits: list[int] = field(default_factory=list)
    exit_states: list[torch.Tensor | None] = field(default_factory=list)
    carries: list[torch.Tensor | None] = field(default_factory=list)
    logits: list[torch.Tensor | None] = field(default_factory=list)

    def grown(
        self, state: torch.Tensor, exit_depth: int = 0, exit_state: torch.Tensor | None = None, carry=None
    ) -> DraftRound:
        """A copy with one more position's loop-d state (skip mode: its exit state when it exited) and exit (a pass
        builds new rounds, leaving its inputs as they were)."""
        return DraftRound(self.start, self.k, self.d, list(self.tokens), list(self.q), [*self.states, state],
                          self.measured, list(self.preds), self.exits_early, self.stop_margin,
                          [*self.exits, exit_depth], [*self.exit_states, exit_state], [*self.carries, carry],
                          list(self.logits))  # fmt: skip

    def decided(self, readout_uses_kv: bool) -> list[bool]:
        """Per position 0..K: whether the draft's readout is already the target's (it exited within the draft; with a
        readout that attends, Huginn's coda, only when every earlier position of the round was decided too)."""
        out: list[bool] = []
        for exit_depth in self.exits:
            out.append(exit_depth > 0 and (not readout_uses_kv or all(out)))
        return out


@dataclass(slots=True)
class Item:
    """One request's work in flight: positions `position .. position + n - 1` (n = the state's rows)."""

    request: Request
    base: int  # the request's num_computed when its work began: an item is stale once that changed
    preemptions: int  # its request's preemption count then: a preempted request's item is stale
    position: int
    state: torch.Tensor  # [n, S] after `loops` loops
    stop: int  # the depth at which the item is done
    loops: int = 0
    prev: torch.Tensor | None = None  # [n, S] before the last loop (exit rules comparing successive states)
    carry: torch.Tensor | None = None  # [n, ...] what the exit rule carries from loop to loop
    # a plain token's or a draft's exit depth once its rule fired, and its state there (select mode: the item runs on
    # to its stop depth and is read out at the exit; skip mode: it stops at the exit)
    exit_depth: int = 0
    exit_state: torch.Tensor | None = None
    round: DraftRound | None = None  # a draft or verification of this speculative round
    verify: bool = False
    measured: bool = False  # read out at the depths it passes (a plain token or a measured round's positions)
    chunk: bool = False  # a prompt chunk (full depth, no exit rule; a first token sampled when it ends the prompt)
    preds: list[torch.Tensor] = field(default_factory=list)  # measured: [n] greedy prediction per depth run so far
    # a verification under early exit: per row, its exit depth (0: still looping) and its state there ([n, S])
    row_exits: list[int] | None = None
    row_exit_states: torch.Tensor | None = None
    # the prompt's last chunk of a request that exits early: its last position's state when embedded and after every
    # loop so far ([1, S] each), on which its first token's exit rule runs once the chunk is done
    last_states: list[torch.Tensor] | None = None
    # a prompt chunk recomputing a preempted request's tokens with recorded exit depths: per row, the loop whose KV its
    # deeper planes keep (skip mode, generated tokens; D: its own) and its readout depth; `row_exit_states` holds each
    # row's state at its readout depth
    forced: list[int] | None = None
    readout_depths: list[int] | None = None

    @property
    def plain(self) -> bool:
        """A token decoded plainly (not a draft, a verification or a prompt chunk)."""
        return self.round is None and not self.chunk

    @property
    def ruled(self) -> bool:
        """Exit rules apply to its positions: a plain token, or a speculative round of a request that exits early."""
        return self.plain or (self.round is not None and self.round.exits_early)

    def kept_rows(self) -> list[bool] | None:
        """Per row, whether the pass writes its KV: not a verification's row that exited, nor a recomputed token's past
        its forced exit (skip mode: their deeper planes keep their exit loop's KV); None: every row."""
        if self.row_exits is not None:
            return [not e for e in self.row_exits]
        if self.forced is not None:
            return [f > self.loops for f in self.forced]
        return None

    @property
    def num_positions(self) -> int:
        return self.state.shape[0]

    def drafts_before(self) -> list[list[int]]:
        """Per position, the drafts of its round before it (what its logit adjustments count as output)."""
        r = self.round
        if r is None:
            return [[] for _ in range(self.num_positions)]
        return [r.tokens[: p - r.start] for p in range(self.position, self.position + self.num_positions)]

    def fresh(self) -> bool:
        return is_fresh(self.request, self.base, self.preemptions)


@dataclass(slots=True)
class NextDraft:
    """The drafted token a request enters on its next pass (position `round.start + len(round.tokens)`)."""

    request: Request
    preemptions: int
    token: int
    round: DraftRound

    def fresh(self) -> bool:
        return is_fresh(self.request, self.round.start, self.preemptions)


def is_fresh(request: Request, base: int, preemptions: int) -> bool:
    return (
        request.status is RequestStatus.RUNNING
        and request.num_computed == base
        and request.metrics.num_preemptions == preemptions
    )


@dataclass
class PassResult:
    """A computed pass. `finished` are the requests whose token or round the pass finished, with the tokens each
    commits, its drafts proposed and accepted (0 for a plain token) and, when some request exits early, each one's
    readout depths; `items` and `next_drafts` are the work that goes on."""

    requests: list[Request]
    finished: list[Request]
    tokens: list[list[int]]
    proposed: list[int]
    accepted: list[int]
    exit_depths: list[list[int]] | None
    items: dict[str, Item]
    next_drafts: dict[str, NextDraft]
    positions: int  # positions one loop of the pass ran over (its occupancy)
    entered: int  # tokens embedded by the pass
    loops: int  # loops the pass ran back to back (1 unless the engine let it run on while nothing changes)
    captured: int  # of those, the loops replayed from a captured graph (graphs.py)
    stage_seconds: dict[str, float]  # "embed" (entering tokens), "loops", "finish" (readouts, draws, acceptance)
    # per finished request, its committed tokens' log-probability entries ([] if it did not ask); None if none did
    logprobs: list[list[TokenLogprob]] | None = None
    # per finished request of a measured round, [D, committed] whether each depth's greedy readout agreed with each
    # committed token (None: not measured)
    agreement: list[torch.Tensor | None] = field(default_factory=list)
    # prompt chunks the pass finished: their requests, the chunk lengths, each one's first token ([] unless the chunk
    # ends the prompt) and its log-probability entries (None if no request asked)
    prefilled: list[Request] = field(default_factory=list)
    chunk_lens: list[int] = field(default_factory=list)
    first_tokens: list[list[int]] = field(default_factory=list)
    first_logprobs: list[list[TokenLogprob]] | None = None
    first_exit_depths: list[list[int]] | None = None  # per prefilled request, its first token's exit ([] none)
    # per finished request, the drafts the target checked, proposed and accepted (under early exit a draft that
    # exited within the draft depth is the target's own sample: it is neither); the controller learns from these
    verified_proposed: list[int] = field(default_factory=list)
    verified_accepted: list[int] = field(default_factory=list)
