"""Markdown tables from bench_speculative.py result files (the tables of docs/benchmarking.md).

    python benchmarks/results_table.py benchmarks/results/tiny-ouro.json [more.json ...]

One table per file: per batch size the plain decode tokens/s, the A/A line, the best fixed (K, d), adaptive
against plain, against the best fixed (same-round choice and held-out choice) and adaptive's plans; then a
table of the confirmation rounds when the file has them (`--confirm-repeats`), and a line for the changing
workload when the file has one. Values are median ±half the width of the median's ~95 % confidence interval
(result files written since that was recorded) [min-max] of per-round ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def fmt(stat: dict[str, Any] | None) -> str:
    """median, ± half the width of its ~95 % confidence interval (files that have one), [min–max]."""
    if not stat:
        return "-"
    ci = stat.get("ci")
    half = f" ±{(ci[1] - ci[0]) / 2:.2f}" if ci else ""
    return f"{stat['median']:.2f}x{half} [{stat['min']:.2f}–{stat['max']:.2f}]"


def plans(counts: dict[str, int]) -> str:
    return ", ".join(f"{k}: {n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def table(result: dict[str, Any], name: str = "adaptive") -> str:
    lines = [
        f"**{result['model']} (D={result['depth']})** — measured {result['date'][:16].replace('T', ' ')} UTC",
        "",
        "| B | plain tok/s | A/A | best fixed (K,d) | adaptive ÷ plain | adaptive ÷ best fixed | ÷ best fixed, "
        "held-out choice | adaptive's plans (rounds) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for b, row in result["batch_sizes"].items():
        s = row["summary"]
        entry = s["adaptive"].get(name, {})
        best = f"{s['best_fixed']}: {fmt(s['best_fixed_ratio'])}" if "best_fixed" in s else "-"
        lines.append(
            f"| {b} | {row['plain_tokens_per_s']:.0f} | {fmt(row['aa'])} | {best} | {fmt(entry.get('vs_plain'))} "
            f"| {fmt(entry.get('vs_best_fixed'))} | {fmt(entry.get('vs_best_fixed_held_out'))} "
            f"| {plans(entry.get('plans', {}))} |"
        )
    confirmed = {b: row["confirm"] for b, row in result["batch_sizes"].items() if "confirm" in row}
    if confirmed:
        lines += [
            "",
            "Confirmation rounds (plain, plain-B, the screen's top fixed cells and adaptive only):",
            "",
            "| B | rounds | A/A | screen's best fixed (K,d) | adaptive ÷ plain | adaptive ÷ best fixed | ÷ best of the "
            "top cells, held-out choice | adaptive's plans (rounds) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for b, c in confirmed.items():
            entry = c["adaptive"].get(name, {})
            best = c["best_fixed"]
            lines.append(
                f"| {b} | {len(c['rounds'])} | {fmt(c['aa'])} | {best}: {fmt(c['ratio'][best])} "
                f"| {fmt(entry.get('vs_plain'))} | {fmt(entry.get('vs_best_fixed'))} "
                f"| {fmt(entry.get('vs_best_fixed_held_out'))} | {plans(entry.get('plans', {}))} |"
            )
    wl = result.get("workload")
    if wl:
        entry = wl["adaptive"].get(name, {})
        groups = wl.get("phase_groups")  # since B:GROUP phases: the prompt group of each phase
        labels = [f"{b}:{g}" for b, g in zip(wl["phases"], groups)] if groups and len(set(groups)) > 1 else None
        phases = "→".join(labels or map(str, wl["phases"]))
        oracle = ", ".join(wl["oracle_phases"])
        lines += [
            "",
            f"Changing workload {phases} (A/A {fmt(wl['aa'])}): adaptive ÷ per-phase oracle ({oracle}) "
            f"{fmt(entry.get('vs_oracle'))} (held-out choice {fmt(entry.get('vs_oracle_held_out'))}), "
            f"÷ best single fixed ({wl['best_single_fixed']}) {fmt(entry.get('vs_best_single_fixed'))}, "
            f"÷ plain {fmt(entry.get('vs_plain'))}.",
        ]
        c = wl.get("confirm")
        if c is not None:
            entry = c["adaptive"].get(name, {})
            lines += [
                "",
                f"Workload confirmation ({len(c['rounds'])} rounds, A/A {fmt(c['aa'])}): adaptive ÷ the screen's "
                f"oracle {fmt(entry.get('vs_oracle'))}, ÷ the screen's best single fixed ({c['best_single_fixed']}) "
                f"{fmt(entry.get('vs_best_single_fixed'))}, ÷ plain {fmt(entry.get('vs_plain'))}.",
            ]
    lines += ab_lines(result, name)
    return "\n".join(lines)


def per_round_quotient(variant: dict[str, Any] | None, base: dict[str, Any] | None) -> str:
    """The per-round ratio of two engines' ratios to plain of the same rounds (median [min–max]), or '-'."""
    if not variant or not base or "per_round" not in variant or "per_round" not in base:
        return "-"
    values = [v / b for v, b in zip(variant["per_round"], base["per_round"])]
    return fmt({"median": statistics.median(values), "min": min(values), "max": max(values)})


def ab_lines(result: dict[str, Any], name: str) -> list[str]:
    """A/B lines for the adaptive engines run with a policy switch off against `name` (bench_speculative.py
    --policies NAME:SWITCH=off): per batch size, screen and confirmation, and the workload."""
    variants = [v for v, spec in result["configs"].items() if spec.get("base") == name]
    out = []
    for variant in variants:
        cells = []
        for b, row in result["batch_sizes"].items():
            s = row["summary"]["adaptive"]
            screen = per_round_quotient(s.get(variant, {}).get("vs_plain"), s.get(name, {}).get("vs_plain"))
            c = row.get("confirm", {}).get("adaptive", {})
            confirm = per_round_quotient(c.get(variant, {}).get("vs_plain"), c.get(name, {}).get("vs_plain"))
            cells.append(f"B = {b}: {screen}, confirmed {confirm}")
        wl = result.get("workload")
        if wl:
            w = per_round_quotient(
                wl["adaptive"].get(variant, {}).get("vs_plain"), wl["adaptive"].get(name, {}).get("vs_plain")
            )
            c = wl.get("confirm", {}).get("adaptive", {})
            confirm = per_round_quotient(c.get(variant, {}).get("vs_plain"), c.get(name, {}).get("vs_plain"))
            cells.append(f"workload: {w}, confirmed {confirm}")
        out += ["", f"A/B, {variant} ÷ {name} per round: " + "; ".join(cells) + "."]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", nargs="+", type=Path, help="bench_speculative.py --out FILE.json results")
    parser.add_argument("--config", default="adaptive", help="the adaptive configuration's name in the results")
    args = parser.parse_args(argv)
    for path in args.results:
        try:
            result = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            parser.error(f"{path}: {exc}")
        print(table(result, args.config) + "\n")


if __name__ == "__main__":
    main()
