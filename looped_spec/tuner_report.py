"""Tuner output: a text table, heatmaps and compact JSON of the measurements and the preset.

Input is the tuner's per-batch-size measurement dict (see `looped_spec.tuner.tune`): for every measured
batch size ``b`` the screened cells ``{"K,d": {"ratio", "acceptance", ...}}`` and the confirmed top cells
``{"K,d": {"ratio", "acceptance", ...}}`` (ratio = decode tokens/s of (K, d) over plain decoding's).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from looped_spec.tuner_rules import cell_key


def format_table(measurements: dict[int, dict[str, Any]], preset: dict[str, Any] | None = None) -> str:
    """Human-readable screen/confirm results per batch size and the chosen bucket lists."""
    lines = []
    for b in sorted(measurements):
        m = measurements[b]
        confirmed = m["confirm"]["cells"]
        lines.append(f"B={b}: plain {m['screen']['plain_decode_tokens_per_s']:.1f} decode tok/s (screen)")
        lines.append(f"  {'K':>3} {'d':>3} {'screen':>8} {'accept':>7} {'tok/round':>9} {'confirmed':>10}")
        for key, cell in m["screen"]["cells"].items():
            k, d = cell_key(key)
            conf = f"{confirmed[key]['ratio']:.2f}x" if key in confirmed else ""
            lines.append(
                f"  {k:>3} {d:>3} {cell['ratio']:>7.2f}x {cell['acceptance']:>7.2f} "
                f"{cell['tokens_per_round']:>9.2f} {conf:>10}"
            )
    if preset is not None:
        lines.append("preset buckets (candidates conservative -> aggressive; * = initial):")
        for bucket in preset["buckets"]:
            hi = "inf" if bucket["max_batch"] is None else bucket["max_batch"]
            items = []
            for j, c in enumerate(bucket["candidates"]):
                mark = "*" if j == bucket["initial_index"] else ""
                band = f" [{c['theta_down']:.2f},{c['theta_up']:.2f}]" if c["k"] else ""
                items.append(f"{mark}({c['k']},{c['d']}){band}")
            lines.append(
                f"  B {bucket['min_batch']}..{hi}: "
                + " ".join(items)
                + f"  beta={bucket['beta']} min_samples={bucket['min_samples']} "
                f"interval={bucket['interval']}"
            )
    return "\n".join(lines)


def write_heatmap(measurements: dict[int, dict[str, Any]], path: str | Path, title: str = "") -> str | None:
    """PNG of screened speedup and acceptance over K x d, one panel pair per batch size.

    Returns None when written, else the reason it was skipped (matplotlib not importable).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib); heatmap skipped"
    batches = sorted(measurements)
    keys = [cell_key(k) for b in batches for k in measurements[b]["screen"]["cells"]]
    ks, ds = sorted({k for k, _ in keys}), sorted({d for _, d in keys})
    size = (max(3.6, 1.6 + 0.75 * len(ds)) * len(batches), 1.2 + 2.0 * max(2.0, 0.5 * len(ks)))
    fig, axes = plt.subplots(2, len(batches), figsize=size, squeeze=False)
    for col, b in enumerate(batches):
        cells = measurements[b]["screen"]["cells"]
        for row, (field, label) in enumerate([("ratio", "speedup vs plain"), ("acceptance", "acceptance")]):
            ax = axes[row][col]
            vals = [[cells.get(f"{k},{d}", {}).get(field, float("nan")) for d in ds] for k in ks]
            finite = [v for r in vals for v in r if not math.isnan(v)] or [1.0]
            if field == "ratio":  # linear, centred on 1.0 (= plain)
                span = max(0.25, *(abs(v - 1.0) for v in finite))
                lo, hi = max(0.0, 1.0 - span), 1.0 + span
            else:
                lo, hi = 0.0, 1.0
            im = ax.imshow(vals, cmap="RdYlGn", vmin=lo, vmax=hi, origin="lower", aspect="auto")
            for i in range(len(ks)):
                for j in range(len(ds)):
                    if not math.isnan(vals[i][j]):
                        ax.text(j, i, f"{vals[i][j]:.2f}", ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(ds)), [str(d) for d in ds])
            ax.set_yticks(range(len(ks)), [str(k) for k in ks])
            ax.set_xlabel("draft depth d")
            ax.set_ylabel("K")
            ax.set_title(f"B={b}: {label} (screen)", fontsize=9)
            fig.colorbar(im, ax=ax, fraction=0.046)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def preset_data(config: Any) -> dict[str, Any]:
    """A validated `AdaptiveSpecConfig` as plain data without unset optional fields (bounds stay explicit)."""
    data = config.model_dump(mode="json")
    for bucket in data["buckets"]:
        for name in ("theta_up", "theta_down"):
            if bucket[name] is None:
                del bucket[name]
        bucket["candidates"] = [{k: v for k, v in c.items() if v is not None} for c in bucket["candidates"]]
    return data


def dump_json(data: Any, indent: int = 2, width: int = 110) -> str:
    """JSON with every object or list that fits in `width` characters on one line (readable presets)."""

    def render(value: Any, level: int) -> str:
        flat = json.dumps(value)
        if not isinstance(value, (dict, list)) or not value or len(flat) + indent * level <= width:
            return flat
        pad, inner = " " * (indent * level), " " * (indent * (level + 1))
        if isinstance(value, dict):
            items = [f"{inner}{json.dumps(str(k))}: {render(v, level + 1)}" for k, v in value.items()]
            return "{\n" + ",\n".join(items) + "\n" + pad + "}"
        return "[\n" + ",\n".join(inner + render(v, level + 1) for v in value) + "\n" + pad + "]"

    return render(data, 0) + "\n"
