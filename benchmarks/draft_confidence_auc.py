"""How well does a draft's own confidence tell an accepted draft from a rejected one? (issue 36, item 1)

Deterministic, no timing. For held-out prompts the plain engine decodes greedily (request i seeded i); the dense
reference path then reruns every sequence and reads out each depth d < D. At each generated position the depth-d
draft (the readout's argmax, given the committed prefix) is accepted when it equals the committed token. Per depth
it reports the agreement α_d and the AUC (the probability that a random accepted draft scores above a random
rejected one; 0.5 = no signal) of each signal the draft has before the target runs:

- `top prob`: the depth-d readout's largest probability;
- `margin`: its top-two probability gap;
- `exit signal`: the family's own exit signal at depth d, oriented so that larger means "more sure": Ouro's gate as
  the cumulative exit probability up to d, Huginn's latent change with its sign flipped (small change: converged);
  absent for a family without one (Nanbeige).

    python benchmarks/draft_confidence_auc.py --model tiny-ouro --prompts eval --count 32 --max-tokens 64
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from looped_spec import LoopedSpecEngine, SamplingParams, load_adapter
from looped_spec.models.dense import DenseContext
from looped_spec.tuning.grid import prompt_source_flag
from looped_spec.tuning.prompt_sets import load_prompts


def auc(positive: list[float], negative: list[float]) -> float | None:
    """Mann-Whitney AUC: P(score of a positive > score of a negative), ties counted half; None without both."""
    if not positive or not negative:
        return None
    scores = torch.tensor(positive + negative, dtype=torch.float64)
    ranks = torch.empty_like(scores)
    order = scores.argsort()
    ranks[order] = torch.arange(1, len(scores) + 1, dtype=torch.float64)
    for value in scores.unique():  # average ranks over ties
        tied = scores == value
        ranks[tied] = ranks[tied].mean()
    n_pos, n_neg = len(positive), len(negative)
    return float((ranks[:n_pos].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


@torch.inference_mode()
def depth_signals(adapter, ids: list[int], seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    """Per depth d = 1..D-1: readout logits [T, V] of every position, and the family's exit signal [T] (or None)."""
    seq = torch.tensor(ids, device=adapter.device)
    ctx = DenseContext(1, len(ids), torch.arange(len(ids), device=adapter.device), seeds=[seed])
    state = adapter.embed(seq, ctx)
    logits, signals = [], []
    for i in range(adapter.full_depth - 1):
        prev, state = state, adapter.loop(state, i, ctx)
        logits.append(adapter.readout(state, i + 1, ctx).float())
        signal = adapter.exit_signal(state, i + 1, prev)
        signals.append(None if signal is None else signal.float())
    return logits, signals


def exit_scores(model_type: str, signals: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The exit signal per depth oriented as confidence: Ouro's cumulative exit probability, minus Huginn's change."""
    if model_type == "ouro":
        out, survive = [], None
        for gate in signals:
            lam = torch.sigmoid(gate)
            survive = (1 - lam) if survive is None else survive * (1 - lam)
            out.append(1 - survive)
        return out
    return [None if s is None else -s for s in signals]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-ouro")
    parser.add_argument("--prompts", default="eval", type=prompt_source_flag)
    parser.add_argument("--count", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", default=None, help="write the table as JSON here")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    adapter = load_adapter(args.model)
    if adapter.full_depth < 2:
        raise SystemExit(f"{args.model}: depth {adapter.full_depth} has no draft depth")
    prompts, described = load_prompts(args.prompts, args.count, adapter, seed=0)
    engine = LoopedSpecEngine(adapter, speculation="off")
    params = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0, seed=i)
              for i in range(len(prompts))]  # fmt: skip
    outputs = engine.generate(prompts, params)
    engine.close()
    names = ("top prob", "margin", "exit signal")
    scores = {d: {name: ([], []) for name in names} for d in range(1, adapter.full_depth)}
    agree = {d: [0, 0] for d in scores}
    for seed, out in enumerate(outputs):
        ids = list(out.prompt_token_ids) + list(out.token_ids)
        logits, signals = depth_signals(adapter, ids, seed)
        exits = exit_scores(adapter.model_type, signals)
        start = len(out.prompt_token_ids) - 1  # position t predicts token t + 1
        targets = torch.tensor(ids[start + 1 :])
        for d in scores:
            rows = logits[d - 1][start : len(ids) - 1]
            probs = rows.softmax(-1)
            top2 = probs.topk(2, dim=-1).values
            accepted = (rows.argmax(-1).cpu() == targets).tolist()
            agree[d][0] += sum(accepted)
            agree[d][1] += len(accepted)
            columns = {"top prob": top2[:, 0], "margin": top2[:, 0] - top2[:, 1]}
            if exits[d - 1] is not None:
                columns["exit signal"] = exits[d - 1][start : len(ids) - 1]
            for name, values in columns.items():
                for value, ok in zip(values.tolist(), accepted):
                    scores[d][name][0 if ok else 1].append(value)
    print(f"{adapter.name} (D={adapter.full_depth}), {described}, {args.max_tokens} greedy tokens each")
    print(f"{'d':>3} {'alpha_d':>8} " + " ".join(f"{'AUC ' + n:>16}" for n in names))
    table = {}
    for d, by_name in scores.items():
        row = {"alpha": agree[d][0] / agree[d][1], "positions": agree[d][1]}
        row.update({name: auc(*by_name[name]) for name in names})
        table[d] = row
        cells = " ".join(f"{'-' if row[n] is None else format(row[n], '.3f'):>16}" for n in names)
        print(f"{d:>3} {row['alpha']:>8.3f} {cells}")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "table": table}, indent=1))
    return table


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
