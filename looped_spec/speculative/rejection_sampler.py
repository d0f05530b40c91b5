"""Acceptance: greedy prefix matching, or rejection sampling that keeps the target distribution."""

from __future__ import annotations

import torch

from looped_spec.execution.sampler import SamplingRows, probabilities, sample_from
from looped_spec.execution.transfers import to_device


def pad_positions(
    values: torch.Tensor, row_index: torch.Tensor, pos_index: torch.Tensor, num_reqs: int, width: int, fill
) -> torch.Tensor:
    """Scatter flat per-position values [N, ...] into a padded [num_reqs, width, ...] grid."""
    out = torch.full((num_reqs, width, *values.shape[1:]), fill, dtype=values.dtype, device=values.device)
    out[row_index, pos_index] = values
    return out


def accept(
    draft_tokens: torch.Tensor,  # [R, K_max] long, -1 past each row's K
    k: torch.Tensor,  # [R] long, K_actual per row
    target_logits: torch.Tensor,  # [sum(K+1), V] full-depth logits
    row_index: torch.Tensor,
    pos_index: torch.Tensor,
    rows: SamplingRows,  # one row per request
    q_probs: torch.Tensor | None,  # [R, K_max, V] draft distributions when any row samples
    decided: torch.Tensor | None = None,  # [R, K_max] bool: draft drawn from the target itself (early exit)
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (num_accepted [R], next_token [R]): accepted draft count and the corrected/bonus token.

    Greedy rows accept the longest prefix where draft == target argmax, then take the target's
    argmax. Sampled rows accept draft y with probability min(1, p(y)/q(y)); at the first rejection
    they draw from normalise(max(0, p - q)), and after K acceptances the bonus comes from p. A `decided`
    draft was drawn from the target distribution itself (q = p: early exit at or before the draft depth), so it
    is accepted outright rather than through a ratio that rounding could put a hair below 1.
    """
    num_reqs, max_k = draft_tokens.shape
    steps = torch.arange(max_k, device=draft_tokens.device)[None, :]
    in_draft = steps < k[:, None]  # [R, K_max]
    flat_rows = None
    if rows.adjusts or not rows.all_greedy:  # per position: its request's settings (and bias, penalties)
        row_list, pos_list = row_index.tolist(), pos_index.tolist()
        drafted = None
        if rows.counts_drafts:  # position j's penalties and min_tokens count the drafts before it
            grid = draft_tokens.tolist()
            drafted = [grid[r][:j] for r, j in zip(row_list, pos_list)]
        flat_rows = SamplingRows.build([rows.requests[i] for i in row_list], target_logits.device, drafted)
    if rows.all_greedy:
        if flat_rows is not None:
            target_logits = flat_rows.adjusted(target_logits)
        target = pad_positions(target_logits.argmax(-1), row_index, pos_index, num_reqs, max_k + 1, -2)
        match = (draft_tokens == target[:, :max_k]) & in_draft
        if decided is not None:
            match |= decided & in_draft
        num_accepted = match.long().cumprod(dim=1).sum(dim=1)
        return num_accepted, target.gather(1, num_accepted[:, None]).squeeze(1)

    p = pad_positions(probabilities(target_logits, flat_rows), row_index, pos_index, num_reqs, max_k + 1, 0.0)
    # K_r + 1 draws per request from its own generator (one per draft, one for the final token): the count
    # must not depend on the other requests in the batch, or seeded sampling would change with batching
    k_list = k.tolist()
    u = torch.ones(num_reqs, max_k, dtype=torch.float32)  # [R, K_max]
    final_u = torch.empty(num_reqs, dtype=torch.float32)  # [R]
    for r, (request, kr) in enumerate(zip(rows.requests, k_list)):
        draws = torch.rand(kr + 1, generator=request.generator)
        u[r, :kr] = draws[:kr]
        final_u[r] = draws[kr]
    u, final_u = to_device(u, p.device), to_device(final_u, p.device)
    safe = draft_tokens.clamp_min(0)[..., None]
    p_y = p[:, :max_k].gather(2, safe).squeeze(2)
    q_y = q_probs.gather(2, safe).squeeze(2) if q_probs is not None else torch.ones_like(p_y)
    accepted = (u * q_y < p_y) & in_draft
    if decided is not None:
        accepted |= decided & in_draft
    num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
    p_at = p.gather(1, num_accepted[:, None, None].expand(-1, 1, p.shape[-1])).squeeze(1)  # [R, V]
    if q_probs is not None:
        q_pad = torch.cat([q_probs, torch.zeros_like(q_probs[:, :1])], dim=1)
        q_at = q_pad.gather(1, num_accepted[:, None, None].expand(-1, 1, p.shape[-1])).squeeze(1)
        rejected = (num_accepted < k)[:, None]
        residual = torch.where(rejected, (p_at - q_at).clamp_min(0), p_at)
        # p == q exactly leaves no residual mass; the draw then comes from p (probability-zero event)
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)
    else:
        residual = p_at
    return num_accepted, sample_from(residual, final_u)
