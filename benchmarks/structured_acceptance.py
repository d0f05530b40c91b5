"""How a grammar changes what speculation accepts: drafts accepted ÷ drafted of fixed plans, greedy, free text against
the same prompts under a JSON schema and under a regex (structured outputs). Deterministic counts, no timing: greedy
decoding under a fixed plan drafts and accepts the same tokens on every run and in any batch.

    python benchmarks/structured_acceptance.py --models tiny-ouro,tiny-huginn,tiny-nanbeige --plans 3,1 2,2
"""

from __future__ import annotations

import argparse

from looped_spec import LoopedSpecEngine, SamplingParams, StructuredOutputs
from looped_spec.tuning.prompt_sets import prompt_group

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    },
    "required": ["title", "year", "tags"],
    "additionalProperties": False,
}
GRAMMARS = {
    "free text": None,
    "JSON schema": StructuredOutputs(json=SCHEMA),
    "regex [a-z ,.]{1,80}": StructuredOutputs(regex=r"[a-z ,.]{1,80}"),
}


def main(argv: list[str] | None = None) -> dict[tuple[str, str], list[tuple[int, int]]]:
    """Prints the table; returns (model, plan) -> [(accepted, drafted) per grammar]."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny-ouro,tiny-huginn,tiny-nanbeige")
    parser.add_argument("--plans", nargs="+", default=["3,1", "2,2"], help="fixed plans K,d (d < the model's D)")
    parser.add_argument("--group", default="code", help="evaluation prompt group")
    parser.add_argument("--prompts", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    prompts = prompt_group(args.group, args.prompts)
    print(f"{len(prompts)} prompts of group {args.group!r}, {args.max_tokens} new tokens each, greedy")
    print("| model | plan | " + " | ".join(GRAMMARS) + " |")
    print("|---|---|" + "---|" * len(GRAMMARS))
    table = {}
    for model in args.models.split(","):
        for plan in args.plans:
            try:
                engine = LoopedSpecEngine(model, speculation=plan, max_batch_size=len(prompts))
            except ValueError:  # a draft depth the model does not have (tiny-nanbeige runs D = 2)
                continue
            cells, counts = [], []
            for grammar in GRAMMARS.values():
                drafted, accepted = engine.stats.num_draft_tokens, engine.stats.num_accepted_tokens
                params = SamplingParams(max_tokens=args.max_tokens, seed=1, structured_outputs=grammar)
                outputs = engine.generate(prompts, params)
                drafted = engine.stats.num_draft_tokens - drafted
                accepted = engine.stats.num_accepted_tokens - accepted
                tokens = sum(len(o.token_ids) for o in outputs)
                cells.append(f"{accepted / max(drafted, 1):.2f} ({accepted}/{drafted}; {tokens} tokens)")
                counts.append((accepted, drafted))
            print(f"| {model} | ({plan}) | " + " | ".join(cells) + " |")
            table[model, plan] = counts
    return table


if __name__ == "__main__":
    main()
