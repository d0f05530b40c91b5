"""Passes do not make the host wait for the device, beyond reading the tokens they commit (tests/host_syncs.py).

On an H200 a captured loop pass waited on the device about eight times (host-to-device copies of its indices and
planes); the idle device cost the loop engine 0.83-0.91x the step engine at full depth (docs/benchmarking.md, "The
second GPU run"). These tests hold both engines to no blocking host-to-device copy at all, and a plain decode pass
to one read of the device per token step.
"""

from __future__ import annotations

import pytest
import torch
from conftest import load
from host_syncs import counting_host_waits

from looped_spec import LoopedSpecEngine, SamplingParams, SpeculativeConfig
from looped_spec.execution.transfers import to_device

PROMPTS = [[(7 * i + j) % 200 + 5 for j in range(6)] for i in range(6)]
NEW = 9


def counted_run(family: str, speculation, extra: dict, **options):
    engine = LoopedSpecEngine(load(family), speculation=speculation, early_exit="skip", max_batch_size=8, **options)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, **extra)
    engine.generate(PROMPTS, SamplingParams(max_tokens=2, ignore_eos=True, **extra))  # first shapes and tables
    with counting_host_waits() as (copies, reads):
        engine.generate(PROMPTS, params)
    return copies, reads


ENGINES = {"step": {"cuda_graphs": "emulate"}, "loop": {"batching": "loop", "cuda_graphs": "emulate"},
           "loop eager": {"batching": "loop"}}  # fmt: skip
MODES = {"plain": ("off", {}), "speculative": (SpeculativeConfig(k=2, d=1), {}),
         "exit at loop 2": ("off", {"exit_at_step": 2}),
         "speculative, exit at loop 2": (SpeculativeConfig(k=2, d=1), {"exit_at_step": 2}),
         "exit threshold": ("off", {"exit_threshold": 0.9})}  # fmt: skip


@pytest.mark.parametrize("engine", sorted(ENGINES))
@pytest.mark.parametrize("mode", sorted(MODES))
def test_no_pass_copies_to_the_device_synchronously(engine, mode):
    speculation, extra = MODES[mode]
    copies, _ = counted_run("ouro", speculation, extra, **ENGINES[engine])
    assert not copies, dict(copies)


@pytest.mark.parametrize("family", ["ouro", "nanbeige"])
def test_a_plain_decode_pass_reads_the_device_once_per_token_step(family):
    """Captured loop passes at full depth: the sampled tokens are the only read (plus the prompts' first tokens)."""
    for engine in ("step", "loop"):
        _, reads = counted_run(family, "off", {}, **ENGINES[engine])
        token_steps = NEW - 1
        assert sum(reads.values()) <= token_steps + 1, (engine, dict(reads))


def test_to_device_keeps_values_and_dtype():
    assert torch.equal(to_device([3, 1, 2], "cpu"), torch.tensor([3, 1, 2]))
    assert to_device([1, 2], "cpu", torch.int32).dtype == torch.int32
    assert to_device([True, False], "cpu").dtype == torch.bool
    host = torch.arange(4)
    assert torch.equal(to_device(host, torch.device("cpu"), torch.float32), host.float())


@pytest.mark.cuda
def test_to_device_copies_asynchronously_and_keeps_its_values_on_cuda():
    values = list(range(1000))
    copies = [to_device(values, "cuda") for _ in range(50)]  # pinned staging blocks stay alive until copied
    torch.cuda.synchronize()
    assert all(torch.equal(c.cpu(), torch.tensor(values)) for c in copies)
