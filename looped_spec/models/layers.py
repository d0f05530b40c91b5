"""Pure tensor math shared by the model families: norms, RoPE, MLPs.

Every function here works on flattened token batches (`[num_tokens, ...]`) and
takes weights as plain tensors, so the same code runs the dense reference path,
the paged decoding path and training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, cast back to the input dtype, then scaled."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """`down(silu(gate(x)) * up(x))` with separate gate/up matrices (Llama style)."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def fused_swiglu(x: torch.Tensor, fc: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """Huginn's GatedMLP: `fc(x)` split in halves (a, b) -> `proj(silu(a) * b)`."""
    a, b = F.linear(x, fc).chunk(2, dim=-1)
    return F.linear(F.silu(a) * b, proj)


def rope_angles(positions: torch.Tensor, head_dim: int, theta: float) -> torch.Tensor:
    """Rotation angles `pos * theta^(-2i/head_dim)` in fp32. Returns [num_tokens, head_dim // 2]."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    return positions.to(torch.float32)[:, None] * inv_freq[None, :]


def half_rope_tables(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) laid out for rotate-half RoPE: [num_tokens, 1, head_dim] each."""
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1)[:, None, :], torch.cat([sin, sin], dim=-1)[:, None, :]


def apply_rope_half(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate-half RoPE (Llama/Ouro/Nanbeige). x: [num_tokens, heads, head_dim]; tables from half_rope_tables."""
    cos, sin = tables
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (x32 * cos + rotated * sin).to(x.dtype)


def apply_rope_interleaved(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Interleaved-pair RoPE (Huginn): rotates (x[2i], x[2i+1]). x: [num_tokens, heads, head_dim]."""
    x32 = x.float().unflatten(-1, (-1, 2))  # [num_tokens, heads, head_dim/2, 2]
    cos = angles.cos()[:, None, :]
    sin = angles.sin()[:, None, :]
    even, odd = x32[..., 0], x32[..., 1]
    out = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1)
    return out.flatten(-2).to(x.dtype)


def self_attention(
    x: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    wv: torch.Tensor,
    wo: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rope_tables: tuple[torch.Tensor, torch.Tensor],
    ctx,
    plane: int,
) -> torch.Tensor:
    """Llama-style attention with separate q/k/v projections and rotate-half RoPE. x: [num_tokens, hidden]."""
    n = x.shape[0]
    q = apply_rope_half(F.linear(x, wq).view(n, num_heads, head_dim), rope_tables)
    k = apply_rope_half(F.linear(x, wk).view(n, num_kv_heads, head_dim), rope_tables)
    v = F.linear(x, wv).view(n, num_kv_heads, head_dim)
    return F.linear(ctx.attention(plane, q, k, v).reshape(n, num_heads * head_dim), wo)


def memo_angles(ctx, head_dim: int, theta: float) -> torch.Tensor:
    """RoPE angles for the context's positions, computed once per context and reused by every layer."""
    key = ("rope", head_dim, theta)
    if key not in ctx.memo:
        ctx.memo[key] = rope_angles(ctx.positions, head_dim, theta)
    return ctx.memo[key]


def memo_half_rope(ctx, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (cos, sin) tables for the context's positions, computed once per context."""
    key = ("rope-half", head_dim, theta)
    if key not in ctx.memo:
        ctx.memo[key] = half_rope_tables(memo_angles(ctx, head_dim, theta))
    return ctx.memo[key]
