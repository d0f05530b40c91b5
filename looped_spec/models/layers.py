"""Pure tensor math shared by the model families: norms, RoPE, MLPs.

Every function here works on flattened token batches (`[num_tokens, ...]`) and
takes weights as plain tensors, so the same code runs the dense reference path,
the paged decoding path and training.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32, rounded to the input dtype, then scaled. torch's kernel computes a half-precision
    input in fp32 and rounds its output once, so it takes the input as it is: no casts around it (on a GPU each cast
    is a kernel of its own, and four norms run per layer and loop)."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return F.rms_norm(x, (x.shape[-1],), None, eps) * weight


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
    """(cos, signed sin) laid out for rotate-half RoPE: [num_tokens, 1, head_dim] each; the sin table carries the
    rotation's sign (-sin on the first half), so `apply_rope_half` swaps the halves without negating one."""
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1)[:, None, :], torch.cat([-sin, sin], dim=-1)[:, None, :]


def apply_rope_half(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate-half RoPE (Llama/Ouro/Nanbeige): x * cos + (-x2, x1) * sin, in fp32. x: [num_tokens, heads, head_dim];
    tables from half_rope_tables. (x2, x1) * (-sin, sin) is (-x2, x1) * (sin, sin) exactly (a sign is exact), in one
    kernel fewer than negating a half and concatenating."""
    cos, signed_sin = tables
    x32 = x.float()
    swapped = x32.roll(x32.shape[-1] // 2, dims=-1)  # (x2, x1)
    return (x32 * cos + swapped * signed_sin).to(x.dtype)


def interleaved_rope_tables(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed sin) laid out for interleaved-pair RoPE: [num_tokens, 1, head_dim] each, both values of a pair
    side by side; the sin table carries the rotation's sign (-sin at the even index)."""
    cos, sin = angles.cos(), angles.sin()
    return torch.stack([cos, cos], -1).flatten(-2)[:, None, :], torch.stack([-sin, sin], -1).flatten(-2)[:, None, :]


def apply_rope_interleaved(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Interleaved-pair RoPE (Huginn): each pair (e, o) becomes (e cos - o sin, e sin + o cos), in fp32.
    x: [num_tokens, heads, head_dim]; tables from interleaved_rope_tables. Written as x * cos + (o, e) * (-sin, sin),
    which is the same arithmetic (a sign is exact, a sum commutes) in half the kernels."""
    cos, signed_sin = tables
    x32 = x.float()
    swapped = x32.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (o, e) in each pair
    return (x32 * cos + swapped * signed_sin).to(x.dtype)


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


def memo_interleaved_rope(ctx, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved-pair (cos, signed sin) tables for the context's positions, computed once per context."""
    key = ("rope-interleaved", head_dim, theta)
    if key not in ctx.memo:
        ctx.memo[key] = interleaved_rope_tables(memo_angles(ctx, head_dim, theta))
    return ctx.memo[key]


def memo_half_rope(ctx, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (cos, sin) tables for the context's positions, computed once per context."""
    key = ("rope-half", head_dim, theta)
    if key not in ctx.memo:
        ctx.memo[key] = half_rope_tables(memo_angles(ctx, head_dim, theta))
    return ctx.memo[key]
