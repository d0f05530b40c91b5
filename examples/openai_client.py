"""Start `looped-spec serve` on a free local port and call it with the official `openai` client.

    python examples/openai_client.py --max-tokens 32

The same calls work against a server you started yourself (`looped-spec serve tiny-ouro`):
point `base_url` at it. curl works too:

    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"model": "tiny-ouro", "prompt": "def add(a, b):", "max_tokens": 16, "temperature": 0}'
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time

import httpx
import openai


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_healthy(url: str, server: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit(f"the server exited with code {server.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit("the server did not become healthy")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-ouro", help="checkpoint folder or shipped model name")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    port, key = free_port(), "example-key"
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "looped_spec.cli", "serve", args.model, "--port", str(port),
               "--log-level", "warning", "--max-batch-size", "8"]  # fmt: skip
    server = subprocess.Popen(command, env=os.environ | {"LOOPED_SPEC_API_KEY": key})
    try:
        wait_healthy(url, server)
        client = openai.OpenAI(base_url=url + "/v1", api_key=key)
        name = client.models.list().data[0].id

        done = client.completions.create(model=name, prompt="def add(a, b):", max_tokens=args.max_tokens,
                                         temperature=0)  # fmt: skip
        print("completion:", repr(done.choices[0].text), done.usage)

        print("streamed:   ", end="")
        stream = client.completions.create(model=name, prompt="def add(a, b):", max_tokens=args.max_tokens,
                                           temperature=0, stream=True)  # fmt: skip
        for chunk in stream:
            print(chunk.choices[0].text, end="", flush=True)
        print()

        chat = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "Write a function that reverses a string."}],
            max_tokens=args.max_tokens,
            temperature=0.7,
            seed=1,
            stop=["\n\n"],
        )
        print("chat:", repr(chat.choices[0].message.content), chat.choices[0].finish_reason)

        # structured output: the reply is an instance of the schema (a tiny model fills it with whatever it likes)
        schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                                   "year": {"type": "integer", "minimum": 1900, "maximum": 2100}},
                  "required": ["name", "year"], "additionalProperties": False}  # fmt: skip
        person = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "Name a programming language and the year it appeared."}],
            max_tokens=64,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "language", "schema": schema}},
        )
        print("json:", person.choices[0].message.content, person.choices[0].finish_reason)
        metrics = httpx.get(url + "/metrics").text
        print(next(line for line in metrics.splitlines() if line.startswith("looped_spec:generation_tokens_total")))
    finally:
        server.terminate()
        server.wait(timeout=30)


if __name__ == "__main__":
    main()
