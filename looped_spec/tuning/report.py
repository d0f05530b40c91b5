"""Tuner output: a text report, heatmaps and compact JSON of the preset.

Input is the tuner's report (`looped_spec.tuning.tuner.tune`'s provenance): acceptance per depth and per grid cell
(replayed on the tuning trajectories vs the Markov model), the pass-cost profile's check against the timed
rounds, and the decisions per bucket (predicted ratio to plain of every cell).
"""

from __future__ import annotations

import json
import math
from typing import Any


def cell_key(key: str) -> tuple[int, int]:
    """ "K,d" -> (K, d)."""
    k, d = key.split(",")
    return int(k), int(d)


def format_report(report: dict[str, Any], preset: dict[str, Any] | None = None) -> str:
    """Human-readable acceptance, cost profile and predicted ratios, and the chosen bucket lists."""
    accept = report["acceptance"]
    lines = [
        f"acceptance over {accept['positions']} generated positions (counterfactual readouts, greedy):",
        "  alpha by depth: " + " ".join(f"d{i + 1}={a:.3f}" for i, a in enumerate(accept["alpha"])),
        "  rho by depth:   " + " ".join(f"d{i + 1}={r:.3f}" for i, r in enumerate(accept["rho"])),
        f"  {'K,d':>5} {'tokens/round replayed':>22} {'markov':>7}",
    ]
    for key, cell in accept["cells"].items():
        lines.append(f"  {key:>5} {cell['replayed_tokens_per_round']:>22.3f} {cell['markov_tokens_per_round']:>7.3f}")
    validation = report.get("cost", {}).get("validation", {})
    if validation:
        lines.append(
            f"pass-cost profile against {report['cost']['rounds_timed']} timed rounds (median measured / predicted "
            "round seconds; relative to plain decoding at the same batch size):"
        )
        for key, cell in validation.items():
            lines.append(
                f"  {key:>8} {cell['measured_over_predicted']:6.3f} {cell['relative_to_plain']:6.3f}"
                f"  ({cell['rounds']} rounds)"
            )
        summary = report["cost"].get("validation_summary")
        if summary:
            lines.append(
                f"  plans against plain: {100 * summary['median_error']:.1f}% off the timed rounds (median), "
                f"{100 * summary['max_error']:.1f}% at worst ({summary['worst_cell']})"
                + ("" if summary["trusted"] else ": the machine's speed moved while it was timed; time it again")
            )
        else:
            lines.append("  plans against plain: not checked (no speculative plan ran 3 timed rounds of its shape)")
    for bucket, note in report.get("decisions", {}).items():
        best = sorted(note["predicted_ratio"].items(), key=lambda kv: -kv[1])[:4]
        lines.append(
            f"bucket {bucket} (from B={note['from_batch']}): predicted best "
            + ", ".join(f"{k}: {r:.2f}x" for k, r in best)
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
            lines.append(f"  B {bucket['min_batch']}..{hi}: " + " ".join(items))
    return "\n".join(lines)


def heatmap_cells(report: dict[str, Any]) -> dict[int, dict[str, dict[str, float]]]:
    """Per bucket batch size: predicted ratio and replayed acceptance (ΣA/ΣK) of every grid cell."""
    accept = report["acceptance"]["cells"]
    out: dict[int, dict[str, dict[str, float]]] = {}
    for note in report.get("decisions", {}).values():
        cells = {}
        for key, ratio in note["predicted_ratio"].items():
            k, _ = cell_key(key)
            tokens = accept.get(key, {}).get("replayed_tokens_per_round", 1.0)
            cells[key] = {"ratio": ratio, "acceptance": (tokens - 1.0) / k}
        out[int(note["from_batch"])] = cells
    return out


def write_heatmap(cells_by_batch: dict[int, dict[str, dict[str, float]]] | dict[str, Any], path, title: str = ""):
    """PNG of speedup and acceptance over K x d, one panel pair per batch size.

    `cells_by_batch`: {B: {"K,d": {"ratio": .., "acceptance": ..}}}, or a tuner report (predicted ratios).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "acceptance" in cells_by_batch and "decisions" in cells_by_batch:
        cells_by_batch = heatmap_cells(cells_by_batch)  # type: ignore[arg-type]
    batches = sorted(cells_by_batch)
    keys = [cell_key(k) for b in batches for k in cells_by_batch[b]]
    ks, ds = sorted({k for k, _ in keys}), sorted({d for _, d in keys})
    size = (max(3.6, 1.6 + 0.75 * len(ds)) * len(batches), 1.2 + 2.0 * max(2.0, 0.5 * len(ks)))
    fig, axes = plt.subplots(2, len(batches), figsize=size, squeeze=False)
    for col, b in enumerate(batches):
        cells = cells_by_batch[b]
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
            ax.set_title(f"B={b}: {label}", fontsize=9)
            fig.colorbar(im, ax=ax, fraction=0.046)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
