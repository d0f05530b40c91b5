"""Chat offline with `engine.chat` (vLLM's LLM.chat): the model's own chat template renders each turn.

tiny-ouro ships a plain template (messages as Python comments); it was not trained to chat, so its
answers are Python-flavoured text. With a real chat model, pass its folder as --model. Prefix caching is on: each
turn's prompt begins with the conversation so far, whose KV the engine keeps (the count is printed per turn).

    python examples/chat.py --message "Write a function that reverses a string."
"""

from __future__ import annotations

import argparse

import torch

from looped_spec import LoopedSpecEngine, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-ouro", help="checkpoint folder or shipped model name")
    parser.add_argument("--message", action="append", help="user message (repeat for more turns)")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(1)

    engine = LoopedSpecEngine(args.model, prefix_caching=True)
    tokenizer = engine.tokenizer
    if tokenizer is None or not tokenizer.chat_template:
        raise SystemExit(f"{args.model} has no chat template; try --model tiny-ouro")
    messages = [{"role": "system", "content": "You are a helpful Python programmer."}]
    for text in args.message or ["Write a function that adds two numbers."]:
        messages.append({"role": "user", "content": text})
        # engine.chat renders the conversation with the template and stops at its end-of-turn token (the
        # tokenizer's eos); this tiny model also rambles, so a blank line ends the reply too
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.7, top_p=0.95, seed=1, stop=["\n\n"])
        out = engine.chat(messages, params)[0]
        reply = out.text.strip()
        messages.append({"role": "assistant", "content": reply})
        cached = f"{out.metrics.num_cached_tokens} of {len(out.prompt_token_ids)} prompt tokens cached"
        print(f"user: {text}\nassistant: {reply}\n({cached})\n")
    engine.close()


if __name__ == "__main__":
    main()
