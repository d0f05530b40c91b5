"""Host malloc settings: applied once on glibc, switched off by the environment, fault count measured."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import resource, torch
    from looped_spec import LoopedSpecEngine, SamplingParams, load_adapter
    from looped_spec.execution.host_memory import keep_freed_memory
    from looped_spec.tuning.prompt_sets import prompt_group
    torch.set_num_threads(1)
    engine = LoopedSpecEngine(load_adapter("tiny-ouro"), speculation="off", max_batch_size=8)
    prompts, params = prompt_group("eval", 8), SamplingParams(max_tokens=24, ignore_eos=True)
    for _ in range(2):  # warm: the heap reaches its working size (one generate was not always enough)
        engine.generate(prompts, params)
    faults = []
    for _ in range(3):  # the fewest of three: a burst of the interpreter's own arenas in one is not the heap's
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        engine.generate(prompts, params)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(keep_freed_memory(), min(faults))
    """
)


def _run(switch: str | None) -> tuple[bool, int]:
    env = {k: v for k, v in os.environ.items() if k != "LOOPED_SPEC_KEEP_FREED_MEMORY"}
    if switch is not None:
        env["LOOPED_SPEC_KEEP_FREED_MEMORY"] = switch
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    applied, faults = out.stdout.split()
    return applied == "True", int(faults)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and getrusage fault counts")
def test_freed_blocks_are_reused_instead_of_faulted_in_again():
    applied, faults = _run(None)
    off, faults_off = _run("0")
    assert applied and not off  # mallopt accepted both settings; the switch leaves malloc alone
    # tiny-ouro at B = 8 allocates multi-MB tensors every loop pass; kept, a warm engine reuses them. With
    # glibc's defaults the count depends on its dynamic thresholds (~10^4 faults per generate measured here,
    # none in another run), so only the guarantee is asserted, not the default's misbehaviour.
    assert faults < 1000, (faults, faults_off)
