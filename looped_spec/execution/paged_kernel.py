"""Paged decode attention as a Triton kernel: each query token reads its own keys in place.

The reference path (`PagedContext.gather` + SDPA) copies every request's blocks up to the batch's
longest context before attending. This kernel instead walks each request's block table up to its
own context, in place, so the bytes read per request follow its real context, the copy
disappears, and inside a CUDA graph the same capture serves every context length: block tables,
key counts, the plane shift and per-request planes are device inputs, never shapes.

Work split ("flash-decoding"): program (request, kv head, split) covers one contiguous share of the
request's blocks for all its query tokens and the query heads sharing that kv head (so a verify of
K+1 tokens reads the keys once; causality inside the request is a mask on the scores), and writes
an unnormalised partial (running max, sum, weighted values); a few torch ops combine the splits.
The number of splits is fixed per batch shape (`num_splits_for`), so graph replays keep one grid
while long contexts still spread over many programs.

Used for batches of at most `MAX_KERNEL_QUERY` tokens per request (decode, draft, verify), on CUDA
when Triton imports (`kernel_available`); prefill keeps the reference path. Under
`TRITON_INTERPRET=1` the kernel also runs on CPU tensors, which is how the CPU tests check it.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

MAX_KERNEL_QUERY = 16  # tokens per request up to which the kernel replaces the reference path
_MAX_TILE = 4096  # score-tile elements (rows x keys) per step of one program


def kernel_available(device: torch.device | str, head_dim: int) -> bool:
    """True where the paged kernel can run: CUDA (or Triton's CPU interpreter) and a head_dim of at least 16 (one
    that is not a power of two, Huginn-0125's 96, runs padded to the next one: `HEAD_DIM`, masked past `head_dim`)."""
    return kernel_unavailable_reason(device, head_dim) is None


def kernel_unavailable_reason(device: torch.device | str, head_dim: int) -> str | None:
    """Why the paged kernel cannot run for `device` and `head_dim` (None: it can), in words for a log line."""
    if os.environ.get("LOOPED_SPEC_PAGED_KERNEL") == "0":
        return "LOOPED_SPEC_PAGED_KERNEL=0 turns it off"
    if head_dim < 16:
        return f"the model's head_dim is {head_dim}, under the kernel's 16"
    device = torch.device(device)
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"it runs on CUDA only, the model is on {device.type}"
    if _kernel() is None:
        return "Triton does not import"
    return None


def num_splits_for(max_blocks: int) -> int:
    """Splits per token: enough programs for long contexts, one for short ones (about 32 blocks each)."""
    return max(1, min(16, max_blocks // 32))


@functools.cache
def _kernel():
    """The jitted kernel, or None without Triton. Built on first use, so TRITON_INTERPRET is read then."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit(do_not_specialize=["plane"])
    def paged_attention_partial(
        m_ptr,  # [tokens, heads, splits] fp32 out: running max of the scores
        l_ptr,  # [tokens, heads, splits] fp32 out: sum of exp(score - max)
        acc_ptr,  # [tokens, heads, splits, head_dim] fp32 out: sum of exp(score - max) * value
        q_ptr,  # [tokens, heads, head_dim]
        k_ptr,  # [planes, slots, kv_heads, head_dim]
        v_ptr,
        block_table_ptr,  # [reqs, max_blocks] int64
        query_start_ptr,  # [reqs] int32: first query token of each request
        query_len_ptr,  # [reqs] int32: its query tokens (consecutive positions)
        key_limit_ptr,  # [tokens] int32: keys each token sees (its position + 1)
        shift_ptr,  # [1] int64 planes added to `plane` (when HAS_SHIFT)
        request_plane_ptr,  # [reqs] int64 planes added per request (when HAS_REQUEST_PLANES: loop-level batching)
        plane,
        plane_stride,
        slot_stride,
        kv_head_stride,
        q_token_stride,
        q_head_stride,
        table_stride,
        scale,
        num_heads,
        group,  # query heads per kv head
        num_splits,
        head_dim,  # the real one; HEAD_DIM is the next power of two (tl.arange and tl.dot want one)
        HAS_SHIFT: tl.constexpr,
        HAS_REQUEST_PLANES: tl.constexpr,
        FP32_DOT: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        KEYS: tl.constexpr,  # keys per step (each key looks up its own block: a step may span blocks or part of one)
        GROUP_PAD: tl.constexpr,
        ROWS: tl.constexpr,  # >= query tokens x GROUP_PAD, >= 16 (tl.dot)
        HEAD_DIM: tl.constexpr,
    ):
        # one program: every query token of one request x the query heads of one kv head x one split of
        # the keys, so a verify of K+1 tokens reads the request's keys once
        req = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        first_token = tl.load(query_start_ptr + req)
        num_tokens = tl.load(query_len_ptr + req)
        plane_index = plane
        if HAS_SHIFT:
            plane_index = plane_index + tl.load(shift_ptr)
        if HAS_REQUEST_PLANES:  # each request at its own loop in one pass
            plane_index = plane_index + tl.load(request_plane_ptr + req)
        base = plane_index.to(tl.int64) * plane_stride + kv_head * kv_head_stride

        r = tl.arange(0, ROWS)
        t = r // GROUP_PAD  # query token of each row (within the request)
        g = r % GROUP_PAD
        row_ok = (t < num_tokens) & (g < group)
        token = first_token + t
        head = kv_head * group + g
        limit = tl.load(key_limit_ptr + token, row_ok, 0)  # [ROWS] keys each row sees
        d = tl.arange(0, HEAD_DIM)
        d_ok = d < head_dim  # padded dimensions load as zeros: they add nothing to a score or an output
        q = tl.load(q_ptr + token[:, None] * q_token_stride + head[:, None] * q_head_stride + d[None, :],
                    row_ok[:, None] & d_ok[None, :], 0.0)  # fmt: skip
        q = (q.to(tl.float32) * scale).to(k_ptr.dtype.element_ty)  # [ROWS, HEAD_DIM]

        req_limit = tl.max(limit, axis=0)  # the last token sees the most keys
        num_blocks = tl.cdiv(req_limit, BLOCK_SIZE)
        per_split = tl.cdiv(num_blocks, num_splits)
        first = split * per_split
        last = tl.minimum(first + per_split, num_blocks)
        m = tl.full([ROWS], float("-inf"), tl.float32)
        s_sum = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        k_in = tl.arange(0, KEYS)
        for start in tl.range(first * BLOCK_SIZE, last * BLOCK_SIZE, KEYS):
            key_pos = start + k_in  # [KEYS] positions in the request
            key_ok = key_pos < tl.minimum(req_limit, last * BLOCK_SIZE)
            block = tl.load(block_table_ptr + req * table_stride + key_pos // BLOCK_SIZE, key_ok, 0)
            slot = block * BLOCK_SIZE + key_pos % BLOCK_SIZE
            offs = base + slot[:, None] * slot_stride + d[None, :]
            k = tl.load(k_ptr + offs, key_ok[:, None] & d_ok[None, :], 0.0)  # [KEYS, HEAD_DIM]
            v = tl.load(v_ptr + offs, key_ok[:, None] & d_ok[None, :], 0.0)
            if FP32_DOT:
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")  # [ROWS, KEYS]
            else:
                scores = tl.dot(q, tl.trans(k))
            visible = key_ok[None, :] & (key_pos[None, :] < limit[:, None])  # causal inside the request
            scores = tl.where(visible, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(scores - m_safe[:, None])
            rescale = tl.exp(m - m_safe)
            s_sum = s_sum * rescale + tl.sum(p, axis=1)
            if FP32_DOT:
                acc = acc * rescale[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * rescale[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new

        out = (token * num_heads + head) * num_splits + split  # [ROWS] row of each (token, head) partial
        tl.store(m_ptr + out, m, row_ok)
        tl.store(l_ptr + out, s_sum, row_ok)
        tl.store(acc_ptr + out[:, None] * head_dim + d[None, :], acc, row_ok[:, None] & d_ok[None, :])

    return paged_attention_partial


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass
class KernelBatch:
    """The paged kernel's per-batch inputs (device tensors, graph-capturable) and its launch."""

    block_table: torch.Tensor  # [num_reqs, max_blocks] long
    query_start: torch.Tensor  # [num_reqs] int32: first query token of each request
    query_len: torch.Tensor  # [num_reqs] int32
    key_limit: torch.Tensor  # [num_tokens] int32: keys each query token attends to (position + 1)
    block_size: int
    max_query: int  # the most query tokens of any request (sizes the program's rows)
    num_splits: int

    def attend(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        plane: int,
        plane_shift: torch.Tensor | None,
        request_planes: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [num_tokens, heads, head_dim] -> [num_tokens, heads, head_dim], causal over each token's keys.

        The plane read is `plane`, plus `plane_shift` (one device scalar, shared loop graphs), plus
        `request_planes[r]` for request r (loop-level batching: each request at its own loop)."""
        num_tokens, num_heads, head_dim = q.shape
        kv_heads = key_cache.shape[2]
        group = num_heads // kv_heads
        group_pad = _next_pow2(group)
        rows = max(16, _next_pow2(self.max_query) * group_pad)
        # not sized by the block: a block of thousands of tokens would make a [KEYS, HEAD_DIM] tile past what Triton
        # allows (2^20 elements) and a GPU's shared memory holds
        keys = _next_pow2(max(16, min(64, _MAX_TILE // rows)))
        splits = self.num_splits
        m = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=q.device)
        s = torch.empty_like(m)
        acc = torch.empty(num_tokens, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        q = q.contiguous()
        _kernel()[(self.block_table.shape[0], kv_heads, splits)](
            m,
            s,
            acc,
            q,
            key_cache,
            value_cache,
            self.block_table,
            self.query_start,
            self.query_len,
            self.key_limit,
            plane_shift if plane_shift is not None else self.query_start,  # unread without a shift
            request_planes if request_planes is not None else self.query_start,  # likewise
            plane,
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            q.stride(0),
            q.stride(1),
            self.block_table.stride(0),
            head_dim**-0.5,
            num_heads,
            group,
            splits,
            head_dim,
            HAS_SHIFT=plane_shift is not None,
            HAS_REQUEST_PLANES=request_planes is not None,
            FP32_DOT=key_cache.dtype == torch.float32,
            BLOCK_SIZE=self.block_size,
            KEYS=keys,
            GROUP_PAD=group_pad,
            ROWS=rows,
            HEAD_DIM=_next_pow2(head_dim),
        )
        # combine the splits: a split with no keys has max -inf and contributes exp(-inf) = 0
        top = m.amax(dim=-1, keepdim=True)  # [tokens, heads, 1]; split 0 always holds key 0
        weight = torch.exp(m - top)
        total = (s * weight).sum(-1)  # [tokens, heads]
        out = (acc * weight[..., None]).sum(-2) / total[..., None]
        return out.to(q.dtype)


class TorchKernelBatch(KernelBatch):
    """The kernel's contract in plain torch, one request at a time: the same inputs (block tables, query starts and
    lengths, key limits, per-request planes), the same output. It reads its inputs on the host, so it runs where
    nothing is captured: the captured loop-pass path run uncaptured (`cuda_graphs="emulate"`) on a machine without
    Triton, which is how the CPU tests drive that path at full speed."""

    def attend(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, plane: int,
               plane_shift: torch.Tensor | None, request_planes: torch.Tensor | None = None
               ) -> torch.Tensor:  # fmt: skip
        out = torch.zeros_like(q)
        base = plane + (int(plane_shift) if plane_shift is not None else 0)
        starts, lens, limits = self.query_start.tolist(), self.query_len.tolist(), self.key_limit.tolist()
        planes = request_planes.tolist() if request_planes is not None else [0] * len(starts)
        group = q.shape[1] // key_cache.shape[2]
        offsets = torch.arange(self.block_size, device=q.device)
        for r, (start, n) in enumerate(zip(starts, lens)):
            if n == 0:  # a padding request
                continue
            row_limits = limits[start : start + n]
            num_keys = max(row_limits)
            blocks = self.block_table[r, : -(-num_keys // self.block_size)]
            slots = (blocks[:, None] * self.block_size + offsets).flatten()[:num_keys]
            keys = key_cache[base + planes[r], slots].transpose(0, 1)  # [kv_heads, keys, head_dim]
            values = value_cache[base + planes[r], slots].transpose(0, 1)
            key_positions = torch.arange(num_keys, device=q.device)
            visible = key_positions[None, :] < torch.tensor(row_limits, device=q.device)[:, None]
            attended = F.scaled_dot_product_attention(
                q[start : start + n].transpose(0, 1), keys, values, attn_mask=visible, enable_gqa=group > 1
            )
            out[start : start + n] = attended.transpose(0, 1)
        return out
