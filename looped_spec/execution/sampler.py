"""Token sampling: logit bias, penalties and the allowed_token_ids, min_tokens, bad_words and grammar masks, then
greedy, or temperature + top-k + top-p + min-p (HF's warpers' order) with per-request generators.

Random draws come from each request's own CPU generator (one uniform per sampled row), and
the token is picked by inverse CDF, so a seeded request draws the same tokens alone or in any
batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from looped_spec.execution.penalties import PenaltyRows
from looped_spec.execution.transfers import to_device
from looped_spec.request import Request
from looped_spec.structured_output import allowed_tokens


@dataclass
class SamplingRows:
    """Per-row sampling settings for a batch of logits rows (rows may repeat a request)."""

    requests: list[Request]  # one per row
    temperature: torch.Tensor  # [num_rows] fp32 (1.0 on greedy rows, unused there)
    top_k: torch.Tensor  # [num_rows] long, 0 = off
    top_p: torch.Tensor  # [num_rows] fp32
    greedy: torch.Tensor  # [num_rows] bool
    all_greedy: bool
    needs_filter: bool
    min_p: torch.Tensor | None = None  # [num_rows] fp32 where some row sets min_p, else None
    # where some row sets a logit bias: (rows, token ids, values), each [num_biases], added to the logits first
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    penalties: PenaltyRows | None = None  # where some row sets a penalty: applied after the bias (penalties.py)
    # where some row's output is still short of its min_tokens: (rows, token ids) of the stop tokens masked there
    banned: tuple[torch.Tensor, torch.Tensor] | None = None
    # where some row follows a grammar: (rows, [G, V] bool the tokens its grammar allows there; structured_output.py)
    grammar: tuple[torch.Tensor, torch.Tensor] | None = None
    # where some row sets allowed_token_ids: (the rows [R], then rows and token ids [num_allowed]): every token of
    # those rows but the allowed ones is masked
    allowed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # where some row's bad_words mask a token at its position: (rows, token ids) of the tokens masked there, one-token
    # words' (masked everywhere) ...
    bad_words: tuple[torch.Tensor, torch.Tensor] | None = None
    # ... and the last tokens of words of several tokens whose prefix the output ends with (these give way where they
    # would mask every token left)
    bad_phrases: tuple[torch.Tensor, torch.Tensor] | None = None
    # whether some row has a bad word of several tokens (its mask depends on the output before the position, whether
    # or not anything is masked at this one)
    follows_words: bool = False

    @property
    def adjusts(self) -> bool:
        """Whether some row's logits are changed before sampling (a logit bias, a penalty, allowed_token_ids, a
        min_tokens mask, bad_words or a grammar): even a greedy row then takes the argmax of `adjusted(logits)`."""
        return (self.bias is not None or self.penalties is not None or self.allowed is not None
                or self.bad_words is not None or self.bad_phrases is not None or self.counts_drafts)  # fmt: skip

    @property
    def counts_drafts(self) -> bool:
        """Whether some row's adjustment depends on the output before its position (a penalty, min_tokens, a
        grammar, a bad word of several tokens): rows at later positions of a speculative round must then be built
        with the drafts before them."""
        return self.penalties is not None or self.banned is not None or self.grammar is not None or self.follows_words

    @classmethod
    def build(
        cls, requests: list[Request], device: torch.device, drafted: Sequence[Sequence[int]] | None = None
    ) -> SamplingRows:
        """One row per request; `drafted[i]`: the drafts before row i's position (the penalties, min_tokens, grammars
        and bad words count them)."""
        all_greedy = all(r.greedy for r in requests)
        penalties = PenaltyRows.build(requests, drafted)
        banned = _min_token_bans(requests, drafted, device)
        grammar = _grammar_masks(requests, drafted, device)
        allowed = _allowed_tokens(requests, device)
        bad_words, bad_phrases, follows_words = _bad_word_masks(requests, drafted, device)
        words = {"bad_words": bad_words, "bad_phrases": bad_phrases, "follows_words": follows_words}
        bias = None
        if any(r.logit_bias for r in requests):
            entries = [(i, token, value) for i, r in enumerate(requests) for token, value in r.logit_bias.items()]
            rows, tokens, values = zip(*entries)
            bias = (to_device(list(rows), device, torch.long), to_device(list(tokens), device, torch.long),
                    to_device(list(values), device))  # fmt: skip
        if all_greedy:
            empty = torch.empty(0, device=device)
            return cls(requests, empty, empty, empty, empty, True, False, None, bias, penalties, banned, grammar,
                       allowed, **words)  # fmt: skip
        temps = to_device([r.temperature if not r.greedy else 1.0 for r in requests], device)
        top_k = to_device([r.top_k for r in requests], device, torch.long)
        top_p = to_device([r.top_p for r in requests], device)
        greedy = to_device([r.greedy for r in requests], device)
        needs_filter = any(r.top_k > 0 or r.top_p < 1.0 for r in requests)
        min_p = to_device([r.min_p for r in requests], device) if any(r.min_p > 0.0 for r in requests) else None
        return cls(requests, temps, top_k, top_p, greedy, False, needs_filter, min_p, bias, penalties, banned, grammar,
                   allowed, **words)  # fmt: skip

    def adjusted(self, logits: torch.Tensor) -> torch.Tensor:
        """`logits` [num_rows, V] with each row's logit bias added, then its penalties applied, then every token outside
        its allowed_token_ids masked, then the stop tokens of rows short of their min_tokens, the tokens its bad_words
        ban at the position (unless they would leave nothing) and the tokens a row's grammar refuses masked (the same
        tensor when no row has any of them)."""
        if self.bias is not None:
            rows, tokens, values = self.bias
            logits = logits.float().index_put((rows, tokens), values, accumulate=True)
        if self.penalties is not None:
            logits = self.penalties.apply(logits)
        if self.allowed is not None:  # before the min_tokens mask: the engine refuses an allowed set of stops only
            masked_rows, rows, tokens = self.allowed
            kept = logits.float()[rows, tokens]
            logits = logits.float().index_fill(0, masked_rows, float("-inf")).index_put((rows, tokens), kept)
        unbanned = logits
        if self.banned is not None:
            rows, tokens = self.banned
            logits = logits.float().index_put((rows, tokens), torch.tensor(float("-inf"), device=logits.device))
        if self.bad_words is not None:  # never all a row has left: the engine refuses such one-token words
            rows, tokens = self.bad_words
            logits = logits.float().index_put((rows, tokens), torch.tensor(float("-inf"), device=logits.device))
        if self.bad_phrases is not None:
            rows, tokens = self.bad_phrases
            before = logits.float()
            logits = before.index_put((rows, tokens), torch.tensor(float("-inf"), device=logits.device))
            # a row whose words of several tokens would mask every token it has left (allowed_token_ids, min_tokens,
            # the one-token words) keeps those: one of them comes rather than a token it may not take (SamplingParams
            # refuses bad_words beside a grammar)
            logits = torch.where(torch.isneginf(logits).all(-1, keepdim=True), before, logits)
        if self.grammar is not None:
            rows, allowed = self.grammar
            logits = logits.float().clone()
            logits[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
            if self.banned is not None:
                # a grammar that allows only stop tokens before min_tokens wins: one of them ends the request (a row
                # with every token masked would otherwise draw token 0)
                masked = unbanned[rows].float().masked_fill(~allowed, float("-inf"))
                nothing = torch.isneginf(logits[rows]).all(-1, keepdim=True)
                logits[rows] = torch.where(nothing, masked, logits[rows])
        return logits

    def uniforms(self, count: int = 1) -> torch.Tensor:
        """[num_rows, count] uniforms, each row from its request's generator."""
        draws = [torch.rand(count, generator=r.generator) for r in self.requests]
        return to_device(torch.stack(draws), self.temperature.device)


def _min_token_bans(
    requests: Sequence[Request], drafted: Sequence[Sequence[int]] | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, token ids) of the stop tokens masked at each row's position: those of requests whose output before the
    position (drafts included) is shorter than their min_tokens; None when no row has any."""
    entries = [
        (i, token)
        for i, r in enumerate(requests)
        if r.num_output_tokens + (len(drafted[i]) if drafted is not None else 0) < r.min_tokens
        for token in r.stop_id_list
    ]
    if not entries:
        return None
    rows, tokens = zip(*entries)
    return to_device(list(rows), device, torch.long), to_device(list(tokens), device, torch.long)


def _allowed_tokens(
    requests: Sequence[Request], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(the rows with allowed_token_ids, then (rows, token ids) of the tokens each may take); None when no row sets
    them. Built on the host, so masking needs no device-side unique."""
    masked = [i for i, r in enumerate(requests) if r.allowed_ids is not None]
    if not masked:
        return None
    rows, tokens = zip(*((i, token) for i in masked for token in requests[i].allowed_ids))
    return (to_device(masked, device, torch.long), to_device(list(rows), device, torch.long),
            to_device(list(tokens), device, torch.long))  # fmt: skip


def _bad_word_masks(
    requests: Sequence[Request], drafted: Sequence[Sequence[int]] | None, device: torch.device
) -> tuple[tuple[torch.Tensor, torch.Tensor] | None, tuple[torch.Tensor, torch.Tensor] | None, bool]:
    """(rows, token ids) of the one-token bad words each row masks, and of the last tokens of its words of several
    tokens whose prefix the output before its position ends with (the drafts before it counted; None where no row
    masks any), and whether some row has a word of several tokens."""
    single: list[tuple[int, int]] = []
    completing: list[tuple[int, int]] = []
    follows = False
    for i, r in enumerate(requests):
        words = r.bad_words
        if words is None:
            continue
        single.extend((i, token) for token in words.single)
        if not words.phrases:
            continue
        follows = True
        n = words.longest  # only the output's last n tokens can hold a word's prefix (never the prompt: vLLM's rule)
        output = r.token_ids[max(r.num_prompt_tokens, len(r.token_ids) - n) :]
        completing.extend((i, token) for token in words.completing(output, drafted[i] if drafted is not None else ()))
    return _entries(single, device), _entries(completing, device), follows


def _entries(entries: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
    if not entries:
        return None
    rows, tokens = zip(*entries)
    return to_device(list(rows), device, torch.long), to_device(list(tokens), device, torch.long)


def _grammar_masks(
    requests: Sequence[Request], drafted: Sequence[Sequence[int]] | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, [G, V] allowed tokens) of the rows whose request follows a grammar, at each row's position (after the
    drafts before it); None when no row does."""
    rows = [i for i, r in enumerate(requests) if r.grammar is not None]
    if not rows:
        return None
    before = [drafted[i] if drafted is not None else () for i in rows]
    allowed = allowed_tokens([requests[i].grammar for i in rows], before)
    return to_device(rows, device, torch.long), to_device(allowed, device)


def probabilities(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """Sampling distribution per row after temperature, top-k, top-p and min-p. logits: [num_rows, V] fp32.

    Greedy rows get a one-hot distribution on their argmax, so rejection sampling on them
    reduces to exact greedy matching. A row's logit bias and penalties are applied first.
    """
    return _filtered(rows.adjusted(logits), rows)


def _filtered(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """`probabilities` of logits the rows' bias and penalties are already applied to."""
    scaled = logits.float() / rows.temperature[:, None]
    if rows.needs_filter:
        # top-k first, then top-p on what top-k kept, renormalised (the order of HF's warpers and vLLM's sampler)
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        vocab = scaled.shape[-1]
        k = torch.where(rows.top_k > 0, rows.top_k.clamp_max(vocab), torch.full_like(rows.top_k, vocab))
        # every token tied with the k-th stays, as HF's TopKLogitsWarper and vLLM keep them: cutting at rank k would
        # keep an arbitrary few of the tied (the sort's order), and ties are common in bf16 logits
        kth = sorted_logits.gather(-1, (k - 1)[:, None])
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        sorted_probs = sorted_logits.softmax(dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # keeps the smallest prefix whose mass reaches top_p; a row at top_p 1 keeps all, though the fp32 running mass
        # rounds to 1 before the vocabulary's tail (HF adds no top-p warper there, vLLM's ascending sum cuts nothing)
        cut = (mass_before >= rows.top_p[:, None]) & (rows.top_p < 1.0)[:, None]
        sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
        scaled = torch.empty_like(scaled).scatter_(-1, order, sorted_logits)
    probs = scaled.softmax(dim=-1)
    if rows.min_p is not None:  # on what top-k and top-p kept; the most likely token always stays
        below = probs < rows.min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        probs = scaled.masked_fill(below, float("-inf")).softmax(dim=-1)
    if rows.greedy.any():
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(rows.greedy[:, None], one_hot, probs)
    return probs


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw per row. probs: [num_rows, V] (unnormalised ok), uniforms: [num_rows]."""
    cdf = probs.cumsum(dim=-1)
    target = uniforms.to(cdf.dtype) * cdf[:, -1]
    idx = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)
    # a zero-probability token can never be picked: clamp, then step back over trailing zeros
    idx = idx.clamp_max(probs.shape[-1] - 1)
    return torch.where(probs.gather(-1, idx[:, None]).squeeze(-1) > 0, idx, probs.argmax(-1))


def sample(logits: torch.Tensor, rows: SamplingRows) -> torch.Tensor:
    """One token per row: argmax for greedy rows, a seeded draw otherwise. Returns [num_rows] long."""
    logits = rows.adjusted(logits)
    if rows.all_greedy:
        return logits.argmax(dim=-1)
    probs = _filtered(logits, rows)
    drawn = sample_from(probs, rows.uniforms(1)[:, 0])
    return torch.where(rows.greedy, logits.argmax(dim=-1), drawn)
