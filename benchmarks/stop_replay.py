"""Does the acceptance model price per-token stopping plans right? (issue 36, item 2) Deterministic, no timing.

For held-out prompts the plain engine decodes greedily; the dense reference path reads out depth d at every generated
position (its margin m and whether its argmax is the committed token). Each request's sequence is then replayed
exactly under a plan (K, d, θ) (θ = none: it drafts every K): a round starting at position t drafts while m ≥ θ, up to
K, accepts the run of right drafts, commits it and one more token, and the next round starts after them; the last
rounds are cut to the tokens left. Per plan it prints committed tokens and drafts per request round, replayed and as
the controller prices them (control/acceptance.py with the α, ρ of all positions; a stopping plan with the
agreement s_θ·a_θ and drafts Σ_j s_θ^j, s_θ and a_θ counted on the same positions; control/margins.py).

    python benchmarks/stop_replay.py --model tiny-ouro --prompts code --count 32 --max-tokens 64
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from looped_spec.control.acceptance import markov_tokens

sys.path.insert(0, str(Path(__file__).resolve().parent))
from draft_confidence_auc import arguments, depth_signals, greedy_outputs  # noqa: E402


def replay(rows: list[list[tuple[float, bool]]], k: int, theta: float | None) -> tuple[float, float]:
    """Committed tokens and drafts per request round of (K, θ) along each request's (margin, right) positions."""
    rounds = tokens = drafts = 0
    for row in rows:
        t = 0
        while t < len(row):
            left = len(row) - t
            drafted = accepted = 0
            right = True
            for j in range(min(k, left - 1)):
                m, ok = row[t + j]
                if theta is not None and m < theta:
                    break
                drafted += 1
                right = right and ok
                accepted += right
            rounds, tokens, drafts = rounds + 1, tokens + accepted + 1, drafts + drafted
            t += accepted + 1
    return tokens / rounds, drafts / rounds


def statistics(rows: list[list[tuple[float, bool]]], theta: float | None) -> dict[str, float]:
    """α and ρ of all positions (ρ: lag-1 correlation of the right bits), and s_θ, a_θ."""
    bits = [ok for row in rows for _, ok in row]
    alpha = sum(bits) / len(bits)
    pairs = [(a[1], b[1]) for row in rows for a, b in zip(row, row[1:])]
    var = alpha * (1 - alpha)
    rho = sum((x - alpha) * (y - alpha) for x, y in pairs) / len(pairs) / var if var > 0 else 0.0
    out = {"alpha": alpha, "rho": max(rho, 0.0)}
    if theta is not None:
        sure = [ok for row in rows for m, ok in row if m >= theta]
        out["keep"] = len(sure) / len(bits)
        out["sure_alpha"] = sum(sure) / len(sure) if sure else 0.0
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = arguments(__doc__, "code")
    parser.add_argument("--ks", default="1,2,3,5,8")
    parser.add_argument("--margins", default="0.003,0.01,0.03,0.1")
    args = parser.parse_args(argv)
    adapter, outputs, described = greedy_outputs(args)
    depths = range(1, adapter.full_depth)
    rows: dict[int, list[list[tuple[float, bool]]]] = {d: [] for d in depths}
    for seed, out in enumerate(outputs):
        ids = list(out.prompt_token_ids) + list(out.token_ids)
        logits, _ = depth_signals(adapter, ids, seed)
        start = len(out.prompt_token_ids) - 1  # position t predicts token t + 1
        targets = torch.tensor(ids[start + 1 :])
        for d in depths:
            readout = logits[d - 1][start : len(ids) - 1]
            top2 = readout.softmax(-1).topk(2, dim=-1).values
            right = (readout.argmax(-1).cpu() == targets).tolist()
            rows[d].append(list(zip((top2[:, 0] - top2[:, 1]).tolist(), right)))
    ks = [int(k) for k in args.ks.split(",")]
    thetas: list[float | None] = [None] + [float(m) for m in args.margins.split(",")]
    print(f"{adapter.name} (D={adapter.full_depth}), {described}, {args.max_tokens} greedy tokens each")
    print(f"{'d':>2} {'K':>2} {'theta':>6} {'tokens':>7} {'priced':>7} {'err':>6} {'drafts':>7} {'priced':>7}")
    table = []
    for d in depths:
        for theta in thetas:
            st = statistics(rows[d], theta)
            for k in ks:
                tokens, drafts = replay(rows[d], k, theta)
                if theta is None:
                    priced, priced_drafts = markov_tokens(st["alpha"], st["rho"], k), float(k)
                else:
                    keep = st["keep"]
                    priced = markov_tokens(keep * st["sure_alpha"], st["rho"], k)
                    priced_drafts = sum(keep**j for j in range(1, k + 1))
                table.append({"d": d, "k": k, "theta": theta, "tokens": tokens, "priced": priced, "drafts": drafts,
                              "priced_drafts": priced_drafts, **st})  # fmt: skip
                shown = "none" if theta is None else f"{theta:g}"
                print(f"{d:>2} {k:>2} {shown:>6} {tokens:7.3f} {priced:7.3f} {priced / tokens - 1:+6.1%} "
                      f"{drafts:7.3f} {priced_drafts:7.3f}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "table": table}, indent=1))
    return {"table": table}


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
