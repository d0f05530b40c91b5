"""Every script in examples/ runs (a smoke run on the shipped tiny model, a few tokens)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from server_utils import ray_subprocess_env

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# script -> (arguments, text its output must contain)
RUNS = {
    "offline_generate.py": (["--max-tokens", "4"], "draft tokens accepted"),
    "online_step_loop.py": (["--max-tokens", "16"], "finished (abort)"),
    "chat.py": (["--max-tokens", "6"], "assistant:"),
    "custom_family.py": (["--max-tokens", "6"], "speculative:"),
    "openai_client.py": (["--max-tokens", "4"], "looped_spec:generation_tokens_total"),
    "tune_preset.py": (["--tokens", "3", "--out", "{tmp}/preset.json"], "with the tuned preset"),
}


def test_every_example_is_smoke_tested():
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(RUNS)


@pytest.mark.parametrize("script", sorted(RUNS))
def test_example_runs(script, tmp_path):
    args, expected = RUNS[script]
    args = [a.format(tmp=tmp_path) for a in args]
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert expected in done.stdout, done.stdout


def test_server_load_test_passes_its_checks():
    """benchmarks/bench_server.py, small: concurrent streams equal offline greedy, no KV block left in use."""
    script = EXAMPLES.parent / "benchmarks" / "bench_server.py"
    args = ["--clients", "12", "--requests-per-client", "1", "--max-tokens", "8", "--max-batch-size", "4"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "12/12 equal to offline greedy" in done.stdout and "after the run: none" in done.stdout


def test_server_load_test_runs_an_open_loop_against_loop_batching():
    """bench_server.py with Poisson arrivals, loop batching and early exit: answers equal offline, ITL reported."""
    script = EXAMPLES.parent / "benchmarks" / "bench_server.py"
    args = ["--clients", "6", "--requests-per-client", "1", "--max-tokens", "6", "--max-batch-size", "4"]
    args += ["--speculation", "off", "--batching", "loop", "--exit-threshold", "0.7", "--arrival-rate", "50"]
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "6/6 equal to offline greedy" in done.stdout and "inter-token" in done.stdout


@pytest.mark.slow
def test_server_load_test_runs_against_ray_serve_replicas(ray_cluster_turn):
    """bench_server.py --replicas 1: the load test through Ray Serve's proxy, every answer equal offline greedy, KV
    freed in the replica (one replica: test_ray_serve.py checks two, their balancing and a replica's failure)."""
    script = EXAMPLES.parent / "benchmarks" / "bench_server.py"
    args = ["--clients", "6", "--requests-per-client", "1", "--max-tokens", "6", "--max-batch-size", "4"]
    env = ray_subprocess_env()
    done = subprocess.run([sys.executable, str(script), *args, "--replicas", "1"], capture_output=True, text=True,
                          timeout=600, env=env)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "6/6 equal to offline greedy" in done.stdout and "after the run: none" in done.stdout
    assert "replicas   tokens/s" in done.stdout
