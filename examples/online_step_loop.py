"""The online API: add requests while the engine runs, step it, stream deltas, abort one.

python examples/online_step_loop.py --max-tokens 32
"""

from __future__ import annotations

import argparse

import torch

from looped_spec import LoopedSpecEngine, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-ouro", help="checkpoint folder or shipped model name")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)

    engine = LoopedSpecEngine(args.model)
    greedy = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    sampled = SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=7, stop=["\n\n"])
    first = engine.add_request("def parse(line):", greedy)
    doomed = engine.add_request("while True:", greedy)  # aborted after a few steps
    texts: dict[str, str] = {first: "", doomed: ""}
    finished: set[str] = set()

    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():  # outputs of the requests that advanced this step
            texts[out.request_id] = texts.get(out.request_id, "") + out.new_text
            if out.finished:
                finished.add(out.request_id)
                print(f"[{out.request_id}] finished ({out.finish_reason}): {texts[out.request_id]!r}")
        steps += 1
        if steps == 2:
            later = engine.add_request("import json\n", sampled)  # joins the running batch
            texts[later] = ""
        if steps == 3 and doomed not in finished:
            engine.abort(doomed)  # its output (finish_reason "abort") comes from the next step
    assert engine.num_free_blocks == engine.kv.num_blocks  # every KV block is back
    print(f"{steps} steps; stats: {engine.stats.to_dict()['plan_histogram']}")
    engine.close()


if __name__ == "__main__":
    main()
