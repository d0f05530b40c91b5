"""Bounded loopback load test of `looped-spec serve`: concurrent streaming clients, checked answers.

Starts the server as a subprocess on 127.0.0.1 (a free port), runs `--clients` concurrent clients that
each stream `--requests-per-client` greedy completions through the official `openai` client — or, with
`--arrival-rate R`, an open loop: the same number of requests arriving as a Poisson process of R requests per second
(seeded), each streamed by its own client — then:

- checks every response is complete and equal to the offline greedy output of the same prompt
  (an offline engine with speculation off, in this process),
- checks no KV block leaked (the server's /metrics: KV usage 0, no running or waiting request),
- prints p50/p99 time to first token, p50/p99 inter-token latency (between streamed chunks), p50/p99 end-to-end
  latency and throughput.

Finite by construction: `clients × requests-per-client` requests, each `--max-tokens` long; a request
timeout bounds a stuck one. Exit code 1 when a check fails. The numbers are for one machine at one
moment (no timed assertion); compare runs side by side.

    python benchmarks/bench_server.py --model tiny-ouro --clients 32 --max-tokens 32
    python benchmarks/bench_server.py --model tiny-ouro --speculation off --batching loop --exit-threshold 0.7 \
        --arrival-rate 20 --clients 64 --requests-per-client 1
    python benchmarks/bench_server.py --replicas 1,2 --clients 32    # Ray Serve replicas (pip install -e ".[ray]")

With `--replicas 1,2` each count runs in turn as `looped-spec serve --replicas N` (Ray Serve, one engine per
replica, every replica's own metrics port read and summed), and a last table puts throughput and TTFT side by side.
On a small CPU box the replicas share the cores: the table reports, it does not promise a speed-up.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

PROMPTS = [
    "def fibonacci(n):",
    "import os\n",
    "class Stack:",
    "def parse_args(argv):",
    "for i in range(10):",
    "def read_file(path):",
    "import json\n\n\ndef load(",
    "class Node:\n    def __init__(self",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(args: argparse.Namespace, port: int, replicas: int | None, metrics_port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "looped_spec.cli", "serve", args.model, "--port", str(port),
               "--max-batch-size", str(args.max_batch_size), "--max-queued", str(args.clients),
               "--speculation", args.speculation, "--threads", str(args.threads), "--log-level", "warning",
               "--batching", args.batching]  # fmt: skip
    if replicas is not None:
        command += ["--replicas", str(replicas), "--metrics-port", str(metrics_port)]
    # 0: torch's default, which the server picks itself (OMP_NUM_THREADS=0 is an invalid value to libgomp)
    threads = {"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}
    return subprocess.Popen(command, env=os.environ | threads)


def wait_healthy(url: str, server: subprocess.Popen, timeout: float = 180.0) -> None:
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


def offline_references(args: argparse.Namespace) -> dict[str, str]:
    import torch

    from looped_spec import LoopedSpecEngine, SamplingParams

    if args.threads:  # 0: torch's default
        torch.set_num_threads(args.threads)
    engine = LoopedSpecEngine(args.model, speculation="off")
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, exit_threshold=args.exit_threshold)
    outputs = engine.generate(PROMPTS, params)
    engine.close()
    return {p: o.text for p, o in zip(PROMPTS, outputs)}


async def one_request(client: openai.AsyncOpenAI, model: str, prompt: str, args, results: list) -> None:
    start = time.perf_counter()
    first, parts, finish, gaps, last = None, [], None, [], None
    extra = {} if args.exit_threshold is None else {"exit_threshold": args.exit_threshold}
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=args.max_tokens,
                                             temperature=0, stream=True, extra_body=extra)  # fmt: skip
    async for chunk in stream:
        if not chunk.choices:
            continue
        if chunk.choices[0].text:
            now = time.perf_counter()
            if first is None:
                first = now - start
            else:
                gaps.append(now - last)
            last = now
        parts.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    results.append((prompt, "".join(parts), finish, first, time.perf_counter() - start, gaps))


async def one_client(client: openai.AsyncOpenAI, model: str, index: int, args, results: list) -> None:
    for r in range(args.requests_per_client):
        await one_request(client, model, PROMPTS[(index + r) % len(PROMPTS)], args, results)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def server_gauges(urls: list[str]) -> dict[str, float]:
    """Every metrics endpoint's samples, summed over endpoints (KV usage: the largest)."""
    total: dict[str, float] = {}
    for url in urls:
        text = httpx.get(url + "/metrics").text
        for sample in (s for f in text_string_to_metric_families(text) for s in f.samples):
            merge = max if sample.name == "looped_spec:kv_cache_usage_perc" else (lambda a, b: a + b)
            total[sample.name] = merge(total.get(sample.name, 0.0), sample.value)
    return total


async def load(url: str, model: str, args) -> tuple[list, float]:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=args.timeout)
    results: list = []
    start = time.perf_counter()
    if args.arrival_rate is None:
        await asyncio.gather(*(one_client(client, model, i, args, results) for i in range(args.clients)))
    else:  # open loop: Poisson arrivals, each request its own client
        rng = random.Random(0)
        tasks = []
        for i in range(args.clients * args.requests_per_client):
            tasks.append(asyncio.ensure_future(one_request(client, model, PROMPTS[i % len(PROMPTS)], args, results)))
            await asyncio.sleep(rng.expovariate(args.arrival_rate))
        await asyncio.gather(*tasks)
    elapsed = time.perf_counter() - start
    await client.close()
    return results, elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-ouro", help="checkpoint folder or shipped model name")
    parser.add_argument("--clients", type=int, default=32, help="concurrent streaming clients")
    parser.add_argument("--requests-per-client", type=int, default=2, help="requests each client sends in turn")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per completion")
    parser.add_argument("--max-batch-size", type=int, default=16, help="the server's running batch")
    parser.add_argument("--speculation", default="adaptive", help="the server's speculation setting")
    threads = "torch threads of the server and the references (0: torch's default)"
    parser.add_argument("--threads", type=int, default=1, help=threads)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before one request fails")
    parser.add_argument("--batching", default="step", choices=["step", "loop"], help="the server's batching")
    parser.add_argument("--exit-threshold", type=float, default=None, help="every request's early-exit threshold")
    open_loop = "open loop: requests per second, Poisson (clients x requests-per-client of them)"
    parser.add_argument("--arrival-rate", type=float, default=None, help=open_loop)
    parser.add_argument("--replicas", default=None, metavar="N[,N...]",
                        help="run the server as N Ray Serve replicas, each count in turn (e.g. 1,2)")  # fmt: skip
    args = parser.parse_args()
    if args.replicas is not None and not all(n.isdigit() and int(n) > 0 for n in args.replicas.split(",")):
        parser.error("--replicas: a comma-separated list of replica counts > 0, e.g. 1,2")
    if args.arrival_rate is not None and not args.arrival_rate > 0:
        parser.error("--arrival-rate must be > 0")
    if args.threads < 0:
        parser.error("--threads must be >= 0 (0: torch's default)")

    references = offline_references(args)
    counts = [None] if args.replicas is None else [int(n) for n in args.replicas.split(",")]
    rows, ok = [], True
    for replicas in counts:
        if replicas is not None:
            print(f"--- {replicas} replica(s) behind Ray Serve's proxy")
        row, passed = run_server(args, references, replicas)
        rows.append(row)
        ok = ok and passed
    if args.replicas is not None:
        print(f"{'replicas':>8}  {'tokens/s':>9}  {'TTFT p50 ms':>11}  {'TTFT p99 ms':>11}  (one run each, in turn)")
        for replicas, (throughput, ttft50, ttft99) in zip(counts, rows):
            print(f"{replicas:>8}  {throughput:9.1f}  {1000 * ttft50:11.1f}  {1000 * ttft99:11.1f}")
    return 0 if ok else 1


def run_server(args: argparse.Namespace, references: dict[str, str], replicas: int | None) -> tuple[tuple, bool]:
    """Start a server, run the load, check and print; ((throughput, TTFT p50, TTFT p99), checks passed)."""
    port, metrics_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(args, port, replicas, metrics_port)
    metrics_urls = [url] if replicas is None else [f"http://127.0.0.1:{metrics_port + r}" for r in range(replicas)]
    try:
        wait_healthy(url, server)
        model = Path(str(args.model)).name
        results, elapsed = asyncio.run(load(url, model, args))
        time.sleep(0.5)  # let the worker hand back the last requests
        gauges = server_gauges(metrics_urls)
    finally:
        server.terminate()
        server.wait(timeout=60)

    failures = [(p, text) for p, text, finish, *_ in results if finish is None or text != references[p]]
    leaked = gauges.get("looped_spec:kv_cache_usage_perc", 1.0) != 0.0
    busy = gauges.get("looped_spec:num_requests_running", 1) + gauges.get("looped_spec:num_requests_waiting", 1)
    ttft = [r[3] for r in results if r[3] is not None]
    e2e = [r[4] for r in results]
    itl = [gap for r in results for gap in r[5]]
    tokens = gauges.get("looped_spec:generation_tokens_total", 0.0)
    arrivals = f"Poisson arrivals at {args.arrival_rate}/s" if args.arrival_rate else f"{args.clients} clients"
    print(f"{len(results)} streamed requests ({arrivals}), {args.max_tokens} tokens each, server max batch "
          f"{args.max_batch_size}, speculation {args.speculation}, batching {args.batching}, exit threshold "
          f"{args.exit_threshold}")  # fmt: skip
    print(f"TTFT            p50 {1000 * statistics.median(ttft):8.1f} ms   p99 {1000 * percentile(ttft, 0.99):8.1f} ms")
    if itl:
        print(
            f"inter-token     p50 {1000 * statistics.median(itl):8.1f} ms   p99 {1000 * percentile(itl, 0.99):8.1f} ms"
        )
    print(f"end to end      p50 {1000 * statistics.median(e2e):8.1f} ms   p99 {1000 * percentile(e2e, 0.99):8.1f} ms")
    print(f"throughput      {tokens / elapsed:8.1f} generated tokens/s over {elapsed:.2f} s (this machine, now)")
    accepted = gauges.get("looped_spec:spec_decode_num_accepted_tokens_total", 0.0)
    drafted = gauges.get("looped_spec:spec_decode_num_draft_tokens_total", 0.0)
    print(f"draft tokens accepted {accepted:.0f}/{drafted:.0f}")
    kv_state = "some (LEAK)" if leaked else "none"
    print(f"checks: {len(results) - len(failures)}/{len(results)} equal to offline greedy; "
          f"KV blocks in use after the run: {kv_state}; requests left: {busy:.0f}")  # fmt: skip
    for prompt, text in failures[:3]:
        print(f"MISMATCH {prompt!r}: got {text!r}, offline {references[prompt]!r}", file=sys.stderr)
    ok = not failures and not leaked and busy == 0 and len(results) == args.clients * args.requests_per_client
    return (tokens / elapsed, statistics.median(ttft), percentile(ttft, 0.99)), ok


if __name__ == "__main__":
    sys.exit(main())
