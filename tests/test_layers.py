"""The shared tensor math (looped_spec/models/layers.py) against the formulas written out, bit for bit.

The layers are written for few kernels on a GPU (no casts around RMSNorm, RoPE without negating or stacking halves);
these tests hold them to the textbook formulas the checkpoints' own code uses: HF-style RMSNorm (fp32 math, rounded
to the input dtype, then scaled), rotate-half RoPE (x * cos + (-x2, x1) * sin in fp32) and interleaved-pair RoPE
(each pair (e, o) to (e cos - o sin, e sin + o cos) in fp32), on the CPU and, marked cuda, on a GPU.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from looped_spec.models.layers import (
    apply_rope_half,
    apply_rope_interleaved,
    half_rope_tables,
    interleaved_rope_tables,
    rms_norm,
    rope_angles,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def textbook_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype) * weight


def textbook_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    cos, sin = angles.cos(), angles.sin()
    cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    return (x32 * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


def textbook_interleaved_rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    x32 = x.float().unflatten(-1, (-1, 2))
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    even, odd = x32[..., 0], x32[..., 1]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2).to(x.dtype)


def check_layers(device: str, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(0)
    # small rows too, where eps weighs in (torch before 2.7 rounded eps to a half-precision input's dtype)
    for width, scale, eps in ((8, 3.0, 1e-6), (64, 3.0, 1e-6), (2048, 3.0, 1e-6), (256, 0.03, 1e-5), (256, 0.1, 1e-6)):
        x = (torch.randn(33, width, generator=generator) * scale).to(device, dtype)
        weight = torch.randn(width, generator=generator).to(device, dtype)
        assert torch.equal(rms_norm(x, weight, eps), textbook_rms_norm(x, weight, eps)), (device, dtype, width, scale)
    angles = rope_angles(torch.arange(40, device=device) * 37, 64, 10000.0)
    x = torch.randn(40, 5, 64, generator=generator).to(device, dtype)
    assert torch.equal(apply_rope_half(x, half_rope_tables(angles)), textbook_rope(x, angles)), (device, dtype)
    rotated = apply_rope_interleaved(x, interleaved_rope_tables(angles))
    assert torch.equal(rotated, textbook_interleaved_rope(x, angles)), (device, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_layers_equal_the_textbook_formulas(dtype):
    check_layers("cpu", dtype)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_layers_equal_the_textbook_formulas_on_cuda(dtype):
    check_layers("cuda", dtype)
