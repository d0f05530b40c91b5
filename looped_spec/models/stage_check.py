"""What a family declares, checked against what its stages compute (run when an engine starts).

A family's declarations steer the engine without being read from the math: the state width sizes the graph
buffers, the vocabulary the sampler, the KV layout the cache and which planes each loop writes, `uniform_loops`
lets one captured loop serve every loop and one readout serve every depth, `exit_rule_uses_depth = False` one exit
rule call decide rows at different depths, a split readout (`readout_hidden` and `head`) score a sequence a chunk of
positions at a time. A wrong declaration would otherwise show up as an index error deep in
the KV cache, a failure on the graph path only, or — for `uniform_loops` and `exit_rule_uses_depth` — different
tokens without any error. `check_stages` runs two tokens through every stage on the reference path,
with a context that records the planes each stage attends on and the shapes of its keys and values, and raises
a ValueError naming the declaration that does not hold.
"""

from __future__ import annotations

from pathlib import Path

import torch

from looped_spec.models.adapter import ModelAdapter, missing_config_field
from looped_spec.models.checkpoint import CheckpointError
from looped_spec.models.dense import DenseContext

#: how far apart loop(state, i) and loop(state, 0) (or two depths' readouts) may be for loops declared uniform,
#: relative to the largest value: the same computation on the same inputs gives the same numbers (bitwise so today),
#: so this only leaves room for a kernel that reduces in another order; at least a few roundings of the dtype
UNIFORM_TOLERANCE = 1e-4


class _ProbeContext(DenseContext):
    """The reference context, recording the planes attended on and checking keys and values against the layout."""

    def __init__(self, adapter, seq_len: int) -> None:
        positions = torch.arange(seq_len, device=adapter.device)
        super().__init__(1, seq_len, positions, seeds=[0])
        self.layout = adapter.kv_layout
        self.model_type = adapter.model_type
        self.planes: list[int] = []
        self.seeded = False  # whether `token_seeds` was read

    def token_seeds(self) -> list[tuple[int, int]]:
        self.seeded = True
        return super().token_seeds()

    def attention(self, plane: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        layout = self.layout
        if not 0 <= plane < layout.num_planes:
            raise ValueError(f"{self.model_type}: attends on KV plane {plane}, kv_layout has {layout.num_planes}")
        want = (layout.num_kv_heads, layout.head_dim)
        for name, x in (("keys", k), ("values", v)):
            if tuple(x.shape[1:]) != want:
                raise ValueError(
                    f"{self.model_type}: {name} of shape {list(x.shape)} on plane {plane}; kv_layout declares "
                    f"[tokens, num_kv_heads={want[0]}, head_dim={want[1]}]"
                )
        self.planes.append(plane)
        return super().attention(plane, q, k, v)


def _check_shape(adapter, what: str, x: torch.Tensor, width: int, declared: str) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != width:
        shape = list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{adapter.model_type}: {what} returned {shape}; expected [tokens, {declared}={width}]")


def check_stages(adapter) -> None:
    """Raise ValueError naming the declaration of `adapter` (a ModelAdapter) that its stages contradict, or the
    config.json field its stages read and the checkpoint lacks."""
    try:
        _check_stages(adapter)
    except KeyError as exc:
        try:
            tensors = type(adapter).tensor_specs(adapter.config)
        except Exception:  # noqa: BLE001 - no tensor names to tell apart: every key not in the config counts
            tensors = {}
        field = missing_config_field(exc, adapter.config, tensors, adapter.option_names)
        if field is None:
            raise
        # the stages run here first: a field read in embed, loop or readout (examples/custom_family.py indexes
        # self.config[...] there) was a bare KeyError when the engine started, naming neither the file nor the field
        where = f"{Path(adapter.path) / 'config.json'}" if adapter.path else f"{adapter.model_type} config"
        raise CheckpointError(f"{where}: missing field {field} (read by the family's stages)") from exc


@torch.inference_mode()
def _check_stages(adapter) -> None:
    name, depth, layout = adapter.model_type, adapter.full_depth, adapter.kv_layout
    if layout.num_loop_planes % depth:
        raise ValueError(
            f"{name}: kv_layout.num_loop_planes={layout.num_loop_planes} is not a multiple of full_depth={depth} "
            "(every loop writes the same number of planes)"
        )
    loop_planes = set(range(layout.first_loop_plane, layout.first_loop_plane + layout.num_loop_planes))
    ctx = _ProbeContext(adapter, seq_len=2)
    tokens = torch.tensor([1, 2], device=adapter.device) % adapter.vocab_size
    state = adapter.embed(tokens, ctx)
    _check_shape(adapter, "embed", state, adapter.state_dim, "state_dim")
    if any(p in loop_planes for p in ctx.planes):
        raise ValueError(f"{name}: embed attends on loop planes {sorted(set(ctx.planes) & loop_planes)}")
    if (ctx.planes or ctx.seeded) and not adapter.embed_uses_context:
        what = "attends" if ctx.planes else "draws per-token seeds"
        raise ValueError(f"{name}: declares embed_uses_context=False, but embed {what}: set embed_uses_context = True")
    if ctx.seeded and not adapter.needs_token_seeds:
        raise ValueError(f"{name}: embed reads ctx.token_seeds(), but needs_token_seeds is False")
    embedded = state
    tolerance = max(UNIFORM_TOLERANCE, 4 * torch.finfo(state.dtype).eps) if state.is_floating_point() else 0.0
    per_loop = layout.num_loop_planes // depth
    first_loop_planes: list[int] = []
    readouts = []  # (state after loop d, its readout at depth d)
    for i in range(depth):
        ctx.planes = []
        nxt = adapter.loop(state, i, ctx)
        _check_shape(adapter, f"loop {i}", nxt, adapter.state_dim, "state_dim")
        planes_i = list(ctx.planes)
        wrong = sorted(set(planes_i) - set(adapter.loop_planes(i)))
        if wrong:
            raise ValueError(
                f"{name}: loop {i} attends on KV planes {wrong}, outside its planes {list(adapter.loop_planes(i))} "
                f"(kv_layout: first_loop_plane={layout.first_loop_plane}, {per_loop} planes a loop)"
            )
        if i == 0:
            first_loop_planes = planes_i
        elif adapter.uniform_loops:  # loop i must be loop 0 (same math, same layer order) on planes moved by i loops
            as_loop0 = adapter.loop(state, 0, ctx)
            if planes_i != [p + i * per_loop for p in first_loop_planes] or not _close(as_loop0, nxt, tolerance):
                raise ValueError(
                    f"{name}: declares uniform_loops=True, but loop {i} is not loop 0 on moved planes (it computes "
                    "something else): set uniform_loops = False"
                )
        state = nxt
        ctx.planes = []
        out = adapter.readout(state, i + 1, ctx)
        _check_shape(adapter, f"readout at depth {i + 1}", out, adapter.vocab_size, "vocab_size")
        if out.dtype != torch.float32:
            raise ValueError(f"{name}: readout returned {out.dtype} logits; the engine samples from float32")
        if any(p in loop_planes for p in ctx.planes):
            raise ValueError(f"{name}: readout attends on loop planes {sorted(set(ctx.planes) & loop_planes)}")
        if ctx.planes and not adapter.readout_uses_kv:
            raise ValueError(f"{name}: declares readout_uses_kv=False, but readout attends: set readout_uses_kv = True")
        hidden = adapter.readout_hidden(state, i + 1, ctx)
        if hidden is not None and type(adapter).head is ModelAdapter.head:  # the base's head only raises
            raise ValueError(
                f"{name}: readout_hidden splits the readout, but the family defines no head to project its rows to "
                "logits (scoring calls head(readout_hidden(...))): define head(hidden), or leave readout_hidden None"
            )
        if hidden is not None and not _close(adapter.head(hidden), out, tolerance):
            raise ValueError(
                f"{name}: head(readout_hidden(state, {i + 1})) differs from readout(state, {i + 1}): scoring reads "
                "logits through head(readout_hidden(...)); make readout return exactly that, or readout_hidden None"
            )
        readouts.append((state, out))
    if adapter.has_exit_rule:
        _check_exit_rule_results(adapter, *readouts[0], embedded, ctx, tolerance)
    if adapter.has_exit_rule and not adapter.exit_rule_uses_depth:
        _check_exit_rule_ignores_depth(adapter, readouts[0][0], embedded, ctx, tolerance)
    if adapter.uniform_loops:  # the readout must not depend on the depth: one call reads out tokens of any depth
        for d, (s, out) in enumerate(readouts, start=1):
            if d < depth and not _close(adapter.readout(s, depth, ctx), out, tolerance):
                raise ValueError(
                    f"{name}: declares uniform_loops=True, but readout(state, {d}) differs from readout(state, "
                    f"{depth}) for the same state: set uniform_loops = False"
                )


#: thresholds the exit rule is probed at (capped at the family's max_exit_threshold): its units are the family's, so a
#: spread, where some decision likely differs between depths if the rule reads its depth
PROBE_EXIT_THRESHOLDS = (1e-6, 1e-3, 0.1, 0.5, 0.9, 1.0, 10.0, 1e6)


def _probe_thresholds(adapter) -> list[float]:
    top = adapter.max_exit_threshold
    thresholds = [t for t in PROBE_EXIT_THRESHOLDS if top is None or t <= top] + [adapter.default_exit_threshold]
    return list(dict.fromkeys(float(t) for t in thresholds if t is not None))


def _check_exit_rule_results(adapter, state, readout, prev_state, ctx, tolerance: float) -> None:
    """What `exit_rule` returns after loop 1 has the form the engine reads: a bool mask of one entry per row, a carry
    shaped as `exit_carry`'s, and logits that are `readout(state, depth)`'s. Logits of another width or content were
    taken as the exited rows' readout, so plain and speculative decoding gave different tokens without an error; a
    float or [rows, 1] mask failed deep in the engine, on a bare torch error."""
    name, rows = adapter.model_type, state.shape[0]
    for threshold in _probe_thresholds(adapter):
        carry = adapter.exit_carry(rows)
        per_row = torch.full((rows,), threshold, device=state.device)
        exits, new_carry, logits = adapter.exit_rule(state, 1, prev_state, carry, per_row, ctx)
        if not isinstance(exits, torch.Tensor) or exits.dtype != torch.bool or tuple(exits.shape) != (rows,):
            got = f"{exits.dtype} {list(exits.shape)}" if isinstance(exits, torch.Tensor) else type(exits).__name__
            raise ValueError(
                f"{name}: exit_rule returned exits {got}; expected a torch.bool tensor [rows={rows}] (a decision a row)"
            )
        if carry is not None and (not isinstance(new_carry, torch.Tensor) or new_carry.shape != carry.shape):
            got = list(new_carry.shape) if isinstance(new_carry, torch.Tensor) else type(new_carry).__name__
            raise ValueError(
                f"{name}: exit_rule returned a carry of shape {got}; exit_carry({rows}) gives {list(carry.shape)} (the "
                "carry keeps its shape from loop to loop)"
            )
        if logits is None:
            continue
        if (
            not isinstance(logits, torch.Tensor)
            or logits.dtype != torch.float32
            or not _close(logits, readout, tolerance)
        ):
            got = f"{logits.dtype} {list(logits.shape)}" if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise ValueError(
                f"{name}: exit_rule(state, 1, ...) returned logits ({got}) other than readout(state, 1)'s (float32 "
                f"[rows, vocab_size={adapter.vocab_size}]): the engine takes them as the exited rows' readout; return "
                "readout's logits, or None"
            )


def _check_exit_rule_ignores_depth(adapter, state, prev_state, ctx, tolerance: float) -> None:
    """`exit_rule_uses_depth = False` lets a loop pass decide rows at different depths in one call: the rule must give
    the same exits, carry and logits at depth 1 and at depth D - 1 for the same inputs (otherwise loop-level batching
    exits other tokens than the step engine, without an error)."""
    depth = adapter.full_depth
    if depth < 3:  # a rule runs after loops 1..D-1: one depth only
        return
    rows = state.shape[0]
    for threshold in _probe_thresholds(adapter):
        per_row = torch.full((rows,), threshold, device=state.device)
        first, last = (
            adapter.exit_rule(state, d, prev_state, adapter.exit_carry(rows), per_row, ctx) for d in (1, depth - 1)
        )
        same = torch.equal(first[0].bool(), last[0].bool()) and all(
            (a is None) == (b is None) and (a is None or _close(a.float(), b.float(), tolerance))
            for a, b in zip(first[1:], last[1:])
        )
        if not same:
            raise ValueError(
                f"{adapter.model_type}: declares exit_rule_uses_depth=False, but exit_rule(state, 1, ...) differs "
                f"from exit_rule(state, {depth - 1}, ...) for the same inputs (threshold {threshold}): set "
                "exit_rule_uses_depth = True"
            )


def _close(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> bool:
    scale = float(b.abs().max()) if b.numel() else 0.0
    return a.shape == b.shape and bool(((a - b).abs() <= tolerance * (1.0 + scale)).all())
