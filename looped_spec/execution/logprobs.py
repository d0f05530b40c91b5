"""Log-probabilities of committed tokens, read from the logits they were sampled from.

A token's log-probability is the log-softmax of the logits row it was read out from, before temperature,
top-k or top-p (what vLLM returns by default): the full-depth readout in plain decoding, the target's
verify readout for a speculative round's tokens (so speculation never changes them), the exit depth's
readout under early exit. Only the requests that asked for them pay: one log-softmax over their rows and
one transfer to the host.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from looped_spec.execution.transfers import to_device
from looped_spec.request import Request, TokenLogprob


def wants_logprobs(requests: list[Request]) -> bool:
    return any(r.logprobs_top is not None for r in requests)


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, top_n: list[int], token_text: list[Callable[[int], str] | None]
) -> list[TokenLogprob]:
    """One entry per row: `tokens[i]`'s log-probability under `logits[i]` [n, V] and the `top_n[i]` most likely,
    with their texts by `token_text[i]` (None: no texts)."""
    if logits.shape[0] == 0:
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, tokens.to(logprobs.device).long()[:, None])[:, 0]
    ranks = (logprobs >= chosen[:, None]).sum(dim=-1).tolist()  # vLLM's rank: the tokens at least as likely
    width = max(top_n)
    top = logprobs.topk(width, dim=-1) if width > 0 else None
    values = chosen.tolist()
    top_ids = top.indices.tolist() if top is not None else [[]] * len(values)
    top_values = top.values.tolist() if top is not None else [[]] * len(values)
    token_list = tokens.tolist()
    return [
        TokenLogprob(
            token,
            value,
            list(zip(ids[:n], vals[:n])),
            rank,
            None if text is None else (text(token), *map(text, ids[:n])),
        )
        for token, value, ids, vals, n, rank, text in zip(
            token_list, values, top_ids, top_values, top_n, ranks, token_text
        )
    ]


def logprobs_of_rows(
    requests: list[Request], logits: torch.Tensor, tokens: torch.Tensor
) -> list[list[TokenLogprob]] | None:
    """Per request (one row each, a plain step): [its token's entry], or [] when it did not ask; None if none did."""
    if not wants_logprobs(requests):
        return None
    rows = [i for i, r in enumerate(requests) if r.logprobs_top is not None]
    index = to_device(rows, logits.device)
    entries = iter(token_logprobs(logits[index], tokens[index.to(tokens.device)],
                                  [requests[i].logprobs_top for i in rows],
                                  [requests[i].token_text for i in rows]))  # fmt: skip
    return [[next(entries)] if r.logprobs_top is not None else [] for r in requests]


def verified_logprobs(
    requests: list[Request], ks: list[int], committed: list[list[int]], logits: torch.Tensor
) -> list[list[TokenLogprob]] | None:
    """Per request, the entries of its committed tokens from the verify readout of their positions (`logits`:
    [sum(K+1), V], request after request, K + 1 positions each; token j of a request read out at its position j);
    [] for a request that did not ask, None if none did."""
    if not wants_logprobs(requests):
        return None
    rows, tokens, top_n, owners = [], [], [], []
    start = 0
    for i, (request, k) in enumerate(zip(requests, ks)):
        if request.logprobs_top is not None:
            for j, token in enumerate(committed[i]):
                rows.append(start + j)
                tokens.append(token)
                top_n.append(request.logprobs_top)
                owners.append(i)
        start += k + 1
    out: list[list[TokenLogprob]] = [[] for _ in requests]
    index = to_device(rows, logits.device)
    texts = [requests[i].token_text for i in owners]
    for i, entry in zip(owners, token_logprobs(logits[index], to_device(tokens, logits.device), top_n, texts)):
        out[i].append(entry)
    return out
