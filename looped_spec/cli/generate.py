"""`looped-spec generate`: continue prompts, print speculation stats, optionally time against plain decoding."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

from looped_spec.cli.common import (
    UsageError,
    add_engine_flags,
    at_least,
    engine_options,
    one_line,
    output_file,
    set_threads,
)  # fmt: skip
from looped_spec.logs import configure_logging

#: Sampling flags passed only when given (a checkpoint's generation_config.json may set them)
SAMPLING_FLAGS = ("temperature", "top_k", "top_p", "min_p", "repetition_penalty")


def add_parser(sub: argparse._SubParsersAction, fmt: type[argparse.HelpFormatter]) -> None:
    gen = sub.add_parser(
        "generate",
        help="generate continuations and print speculation stats",
        formatter_class=fmt,
        description="Generate a continuation of every prompt and print speculation stats.",
    )
    gen.add_argument("--model", default="tiny-ouro", help="checkpoint folder or shipped model name")
    gen.add_argument(
        "--prompt",
        action="append",
        help="prompt text (repeatable; default: none, then --prompts-file gives the prompts)",
    )
    gen.add_argument(
        "--prompts-file",
        default=None,
        metavar="FILE",
        help="more prompts, one a line (.jsonl: a 'prompt' field a line, text or token ids, the only prompts a model "
        "without tokenizer files takes; '-': stdin) (default: only --prompt's)",
    )
    gen.add_argument("--max-tokens", type=int, default=None,
                     help="most tokens generated per prompt (default: the checkpoint's generation_config.json "
                          "max_new_tokens, else 64)")  # fmt: skip
    gen.add_argument("--min-tokens", type=int, default=0,
                     help="fewest tokens before eos, a stop token or a stop string may end an output")  # fmt: skip
    # the sampling flags a checkpoint's generation_config.json may set: unset unless given, so the file's values
    # (else the engine's defaults) stand, and a filter given while decoding greedily is an error, as offline
    from_file = "the checkpoint's generation_config.json, else"
    gen.add_argument("--temperature", type=float, default=None,
                     help=f"0 = greedy (default: {from_file} 0, greedy)")  # fmt: skip
    gen.add_argument("--top-k", type=int, default=None,
                     help=f"0 or -1 = no top-k filtering (default: {from_file} 0)")  # fmt: skip
    gen.add_argument("--top-p", type=float, default=None, help=f"nucleus sampling mass (default: {from_file} 1)")
    gen.add_argument("--min-p", type=float, default=None,
                     help=f"keep tokens at least this times as likely as the top (default: {from_file} 0)")  # fmt: skip
    gen.add_argument("--repetition-penalty", type=float, default=None,
                     help="divide positive logits of tokens seen (prompt or output) by this; 1 = off (default: "
                     f"{from_file} 1)")  # fmt: skip
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="subtracted once per token the output holds")
    gen.add_argument("--frequency-penalty", type=float, default=0.0,
                     help="subtracted per time the output holds a token")  # fmt: skip
    gen.add_argument("--stop", action="append", help="stop string (repeatable; cut from the output) (default: none)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the eos token")
    gen.add_argument("--structured-outputs", default=None, metavar="JSON",
                     help="a grammar the output follows, as the server's field: a JSON object with one of json (a "
                     "schema), json_object (true), regex, choice (a list), grammar (Lark) (default: none, free "
                     "text)")  # fmt: skip
    gen.add_argument(
        "--exit-threshold",
        type=float,
        default=None,
        help="early exit: the family rule's threshold (default: the checkpoint's own where its config sets one, "
        "else every token runs all loops)",
    )
    gen.add_argument(
        "--exit-at-step",
        type=int,
        default=None,
        help="early exit: fixed loop depth per token, not with --exit-threshold (default: none)",
    )
    gen.add_argument("--early-exit", default=None, choices=["skip", "select"],
                     help="how tokens that exit early run, only where one does (--exit-threshold, --exit-at-step, or "
                     "the checkpoint's own threshold) (default: skip)")  # fmt: skip
    gen.add_argument("--batch-size", type=int, default=1, metavar="N",
                     help="queue N copies of the prompts (2 prompts, N=8: 16 requests and outputs, printed one by "
                     "one), decoded together up to --max-batch-size; with one --seed the copies are the same text: "
                     "it measures batched decoding. With --stream the copies run one after another like any "
                     "prompt")  # fmt: skip
    gen.add_argument("--stream", action="store_true",
                     help="print tokens as they come; prompts (and --batch-size copies) then run one at a time, "
                     "each alone in the batch")  # fmt: skip
    gen.add_argument(
        "--compare-plain",
        action="store_true",
        help="also time the prompts with and without speculation side by side and print the ratio (not with "
        "--speculation off: there is no speculation to time)",
    )
    gen.add_argument("--compare-repeats", type=int, default=None,
                     help="side-by-side pairs --compare-plain times (default: 5)")  # fmt: skip
    add_engine_flags(gen, "generate")
    gen.set_defaults(func=generate, command_parser=gen)


def read_prompts(args: argparse.Namespace) -> list[str | list[int]]:
    """--prompt values, then the lines of --prompts-file (`-` = stdin; .jsonl: a "prompt" field per line, text or
    token ids)."""
    from looped_spec.tuning.prompt_sets import fields_beside_prompt

    prompts: list[str | list[int]] = list(args.prompt or [])
    if args.prompts_file:
        if args.prompts_file == "-":
            name, lines = "<stdin>", sys.stdin.read().splitlines()
        else:
            name = args.prompts_file
            try:
                lines = Path(name).read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                raise UsageError(f"--prompts-file {name}: {getattr(exc, 'strerror', None) or exc}") from None
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            if name.endswith(".jsonl"):
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise UsageError(f"{name}:{n}: not valid JSON ({exc.msg} at column {exc.colno})") from None
                if not isinstance(record, dict) or "prompt" not in record:
                    raise UsageError(f"{name}:{n}: expected a JSON object with a 'prompt' field")
                beside = fields_beside_prompt(record)
                if beside:
                    raise UsageError(f"{name}:{n}: {beside}")
                line = record["prompt"]
                ids = isinstance(line, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in line)
                if not isinstance(line, str) and not ids:
                    raise UsageError(f"{name}:{n}: 'prompt' must be text or a list of token ids, got {line!r:.60}")
            prompts.append(line)
    if not prompts:
        raise UsageError("no prompt: give --prompt TEXT or --prompts-file FILE (- for stdin)")
    return prompts * args.batch_size


def checkpoint_max_tokens(model: str) -> int | None:
    """The checkpoint's generation_config.json max_new_tokens (None: none, or no checkpoint there)."""
    from looped_spec.models.adapter import resolve_model_path
    from looped_spec.models.checkpoint import CheckpointError
    from looped_spec.models.generation_config import read_generation_config

    try:
        return read_generation_config(resolve_model_path(model)).max_new_tokens
    except CheckpointError:  # the engine names what is wrong with the checkpoint when it loads it
        return None


def generate(args: argparse.Namespace) -> int:
    from looped_spec import LoopedSpecEngine, SamplingParams

    if args.trace is not None:
        output_file(args.trace, "--trace")
    at_least(args.batch_size, 1, "--batch-size")
    if args.max_tokens is None:  # the checkpoint's cap (a model that does not load is named by the engine below)
        args.max_tokens = checkpoint_max_tokens(args.model) or 64
    at_least(args.max_tokens, 1, "--max-tokens")
    if args.compare_repeats is not None and not args.compare_plain:
        raise UsageError("--compare-repeats: only with --compare-plain")
    if args.compare_plain and plain_decoding(args.speculation):
        raise UsageError(f"--compare-plain: times speculation against plain decoding, and --speculation "
                         f"{args.speculation} is plain decoding (use adaptive or K,d)")  # fmt: skip
    args.compare_repeats = 5 if args.compare_repeats is None else args.compare_repeats
    at_least(args.compare_repeats, 1, "--compare-repeats")
    at_least(args.threads, 0, "--threads", " (0: torch's default)")
    set_threads(args.threads)
    prompts = read_prompts(args)
    grammar = None
    if args.structured_outputs is not None:
        from pydantic import ValidationError

        from looped_spec import StructuredOutputs

        try:
            grammar = StructuredOutputs.model_validate_json(args.structured_outputs)
        except ValidationError as exc:
            raise UsageError(f"--structured-outputs: {one_line(exc)}") from None
    sampling = {name: getattr(args, name) for name in SAMPLING_FLAGS if getattr(args, name) is not None}
    params = SamplingParams(max_tokens=args.max_tokens, min_tokens=args.min_tokens, **sampling,
                            presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, seed=args.seed, ignore_eos=args.ignore_eos,
                            stop=args.stop or [], exit_threshold=args.exit_threshold,
                            exit_at_step=args.exit_at_step, structured_outputs=grammar)  # fmt: skip
    configure_logging(args.log_level)
    engine = LoopedSpecEngine(args.model, **engine_options(args))
    try:
        if engine.tokenizer is None:
            _check_text_without_tokenizer(args, prompts)
        if args.compare_plain and engine.adapter.full_depth < 2:
            # adaptive decodes plainly at D = 1 (a fixed plan is refused there): it would time plain against plain
            options = f" ({', '.join('--adapter-option ' + item for item in args.adapter_option)})"
            raise UsageError(f"--compare-plain: times speculation against plain decoding, and the model runs "
                             f"D={engine.adapter.full_depth} loop{options if args.adapter_option else ''}, where "
                             f"--speculation {args.speculation} decodes plainly (nothing to draft with)")  # fmt: skip
        if args.early_exit is not None and engine.resolve_exit(params) == (None, None):
            # every token runs all loops, so how an exit runs would change nothing
            depth = engine.adapter.full_depth
            if args.exit_at_step is not None:  # no more than D (resolve_exit refuses more): D itself, no early exit
                why = f"--exit-at-step {args.exit_at_step} is the model's full depth D={depth}"
            elif args.exit_threshold is not None:
                why = f"--exit-threshold {args.exit_threshold} never exits before the model's D={depth} loops"
            else:
                why = "no --exit-threshold or --exit-at-step, and the model sets no default one"
            raise UsageError(f"--early-exit {args.early_exit}: no token exits early, so it would change nothing "
                             f"({why})")  # fmt: skip
        if args.stream:
            outputs = _stream(engine, prompts, params)
        else:
            outputs = engine.generate(prompts, params)
            for i, (prompt, out) in enumerate(zip(prompts, outputs)):
                if len(outputs) > 1:
                    print(f"--- output {i} ---")
                print(_as_text(prompt) + (out.text if out.text is not None else _as_text(out.token_ids)))
        _print_stats(engine, args, outputs)
    finally:
        engine.close()
    if args.compare_plain:
        _compare_plain(args, prompts, params, outputs)
    return 0


def _check_text_without_tokenizer(args: argparse.Namespace, prompts: list[str | list[int]]) -> None:
    """A model without tokenizer files reads and writes token ids only. The engine's errors name what its API takes
    (`prompts[0]`, `stop_token_ids`); a command says which flag gave text and how to give token ids instead."""
    how = 'give token ids in a .jsonl --prompts-file, a line such as {"prompt": [1, 2, 3]}'
    if args.prompt:
        raise UsageError(f"--prompt {args.prompt[0]!r}: the model has no tokenizer files, so a prompt is token ids: "
                         f"{how}")  # fmt: skip
    line = next((n for n, prompt in enumerate(prompts, start=1) if isinstance(prompt, str)), None)
    if line is not None:
        raise UsageError(f"--prompts-file {args.prompts_file}: prompt {line} is text, but the model has no tokenizer "
                         f"files: {how}")  # fmt: skip
    if args.stop:
        raise UsageError(f"--stop {args.stop[0]!r}: stop strings need the model's tokenizer files, and it has none")


def plain_decoding(speculation: str) -> bool:
    """Whether --speculation's value is plain decoding (off, or K=0); a bad value is left to the engine's error."""
    from looped_spec.engine.config import SpeculativeConfig, parse_speculation

    try:
        plan = parse_speculation(speculation)
    except ValueError:
        return False
    return plan == "off" or (isinstance(plan, SpeculativeConfig) and plan.k == 0)


def _as_text(tokens: str | list[int]) -> str:
    """Text as it is; token ids (a model without a tokenizer, or ids given) as a space-separated list."""
    return tokens if isinstance(tokens, str) else " ".join(map(str, tokens)) + " "


def _stream(engine, prompts: list[str | list[int]], params) -> list:
    """Print each prompt's tokens as they are committed (prompts run one after another)."""
    outputs = []
    for i, prompt in enumerate(prompts):
        request_id = engine.add_request(prompt, params)  # checked before anything is printed
        if len(prompts) > 1:
            print(f"--- output {i} ---")
        print(_as_text(prompt), end="", flush=True)
        while engine.has_unfinished_requests():
            for out in engine.step():
                print(out.new_text if engine.tokenizer is not None else _as_text(out.new_token_ids), end="",
                      flush=True)  # fmt: skip
                if out.finished and out.request_id == request_id:
                    outputs.append(out)
        print()
    return outputs


def _print_stats(engine, args: argparse.Namespace, outputs: list) -> None:
    stats = engine.stats
    num_tokens = sum(len(o.token_ids) for o in outputs)
    reasons = Counter(o.finish_reason for o in outputs)
    rows = [
        ("model", f"{engine.adapter.name} ({engine.adapter.model_type}, D={engine.adapter.full_depth})"),
        ("speculation", str(args.speculation)),
        ("requests", str(len(outputs))),
        ("tokens generated", str(num_tokens)),
        ("finish reasons", ", ".join(f"{r}: {n}" for r, n in sorted(reasons.items()))),
    ]
    if stats.num_loop_passes:  # loop-level batching: passes, not rounds
        occupancy = stats.num_loop_pass_positions / stats.num_loop_passes
        rows.append(("loop passes (positions per pass)", f"{stats.num_loop_passes} ({occupancy:.2f})"))
        if stats.num_draft_tokens:
            accepted = f"{stats.num_accepted_tokens}/{stats.num_draft_tokens} ({100 * stats.acceptance_rate:.1f}%)"
            rows.append(("draft tokens accepted", accepted))
    else:
        # no decode round runs when every output ends with the token its prefill samples (--max-tokens 1, eos
        # first, a grammar that one token completes): say so, rather than 0.00 tokens per round and no plans
        no_round = "none: every output ended with the token its prefill gave"
        # the tokens rounds committed: not those a prefill sampled (a first token, and one after each recompute)
        per_round = stats.num_round_tokens / stats.num_rounds if stats.num_rounds else None
        shown = f"{per_round:.2f}" if per_round is not None else no_round
        if per_round is not None and len(outputs) > 1:  # a round commits tokens for every request in its batch
            request_rounds = sum(size * n for size, n in stats.batch_size_histogram.items())
            shown += f" over the batch, {stats.num_round_tokens / request_rounds:.2f} a request"
        plans = ", ".join(f"{k}: {v}" for k, v in sorted(stats.plan_histogram.items()))
        rows += [
            ("decode rounds", f"{stats.num_rounds} ({stats.num_spec_rounds} speculative)"),
            ("tokens per round", shown),
            ("draft tokens accepted",
             f"{stats.num_accepted_tokens}/{stats.num_draft_tokens} ({100 * stats.acceptance_rate:.1f}%)"),
            ("plans used (K,d: rounds)", plans or no_round),
        ]  # fmt: skip
    if args.prefix_caching:
        rows.append(("prompt tokens from the prefix cache",
                     f"{stats.num_prefix_cache_hits}/{stats.num_prefix_cache_queries}"))  # fmt: skip
    if stats.exit_depth_histogram:
        histogram = ", ".join(f"{d}: {n}" for d, n in sorted(stats.exit_depth_histogram.items()))
        rows += [
            (f"exit depths ({engine.config.early_exit}; depth: tokens)", histogram),
            ("loops per token (saved)", f"{stats.mean_loops_per_token:.2f} ({stats.num_exit_loops_saved})"),
        ]
    width = max(len(k) for k, _ in rows)
    print("\n" + "-" * (width + 40))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


def _compare_plain(args: argparse.Namespace, prompts: list[str], params, outputs: list) -> None:
    """The same prompts with and without speculation, side by side: one persistent engine each, whole runs in
    alternating order, repeated, the first pair dropped (warm-up); the median of the pairs' tokens/s ratios.

    Tokens/s, not wall time: sampled outputs (and outputs a stop string or eos ends) of the two engines need not
    be the same length, and the engine that happened to write more tokens would look slower by a time ratio."""
    import statistics

    from looped_spec import LoopedSpecEngine
    from looped_spec.sampling_params import GREEDY_TEMPERATURE

    spec = LoopedSpecEngine(args.model, **engine_options(args) | {"trace_path": None})
    # the temperature the requests ran at: the checkpoint's generation_config.json may sample when --temperature is
    # not given (sampled outputs differ by chance), and one below GREEDY_TEMPERATURE is greedy (they must not differ)
    temperature = params.temperature
    if "temperature" not in params.model_fields_set:
        temperature = spec.adapter.generation.sampling_defaults().get("temperature", temperature)
    # plain decoding runs no adaptive controller: its preset, policy and tunables are not options there
    plain_options = engine_options(args) | {"speculation": "off", "trace_path": None, "preset": None, "control": None}
    plain_options.pop("policy", None)
    plain = LoopedSpecEngine(args.model, **plain_options)
    ratios, same = [], True
    try:
        for i in range(args.compare_repeats + 1):
            rate = {}
            for name, engine in (("spec", spec), ("plain", plain))[:: 1 if i % 2 == 0 else -1]:
                start = time.perf_counter()
                runs = engine.generate(prompts, params)
                rate[name] = sum(len(o.token_ids) for o in runs) / (time.perf_counter() - start)
                same = same and all(a.token_ids == b.token_ids for a, b in zip(runs, outputs))
            if i:
                ratios.append(rate["spec"] / rate["plain"])
    finally:
        spec.close()
        plain.close()
    print(f"{'vs plain decoding':<24}  {speed_ratio(statistics.median(ratios))} [{min(ratios):.2f}-{max(ratios):.2f}] "
          f"(median of {len(ratios)} side-by-side pairs, tokens/s over the wall time incl. prefill"
          f"{' of prompts cached after the first pair' if args.prefix_caching else ''}; outputs "
          f"{'identical' if same else 'differ'})")  # fmt: skip
    if temperature < GREEDY_TEMPERATURE and not same:
        print("looped-spec: warning: greedy speculative output differs from plain decoding", file=sys.stderr)


def speed_ratio(ratio: float) -> str:
    """'1.57x faster', or '0.73x as fast (slower)': never 'faster' for a slowdown."""
    return f"{ratio:.2f}x faster" if ratio >= 1.0 else f"{ratio:.2f}x as fast (slower)"
