"""Shared fixtures: the tiny real-format checkpoints in tests/fixtures/ and their reference outputs."""

from __future__ import annotations

import gc
import json
import logging
import types
from functools import cache
from pathlib import Path

import pytest
import torch

FIXTURES = Path(__file__).parent / "fixtures"
FAMILIES = ["ouro", "huginn", "nanbeige"]

torch.set_num_threads(1)  # tiny models: thread hand-off costs more than it saves


def _pin_hypothesis_constants() -> None:
    """Hypothesis (6.170 does) draws now and then (5% of draws, 15% of floats) a literal found in the source of the
    "local" modules (neither stdlib nor site-packages, test files excepted) then in sys.modules, rescanned whenever
    sys.modules grows. So a derandomized property test drew other examples after other test modules (test_server's,
    test_cli's) had imported more of the package, or after its own first example had imported the engine's modules.
    Pinned here to the literals of every module of the package, read from its files whatever was imported: a test's
    examples depend on its own source, the package's and Hypothesis's version only, not on which tests ran before."""
    try:
        from hypothesis.internal.conjecture import providers
        from hypothesis.internal.constants_ast import Constants, constants_from_module
        from hypothesis.internal.floats import float_to_int
        from sortedcontainers import SortedSet
    except ImportError:  # a Hypothesis before local constants: nothing to pin
        return
    package = Path(__file__).parents[1] / "looped_spec"
    pinned: list[Constants] = []

    def local_constants() -> Constants:
        if not pinned:
            # sorted sets, as Hypothesis keeps them: it draws a constant by its index
            floats = SortedSet(key=float_to_int)
            constants = Constants(integers=SortedSet(), floats=floats, bytes=SortedSet(), strings=SortedSet())
            for path in sorted(package.rglob("*.py")):
                module = types.ModuleType(f"pinned_constants_of_{path.stem}")
                module.__file__ = str(path)
                constants |= constants_from_module(module)
            providers.CONSTANTS_CACHE.cache.clear()  # its tuples of permitted constants were filtered from the old pool
            pinned.append(constants)
        return pinned[0]

    providers._get_local_constants = local_constants


_pin_hypothesis_constants()


def fixture_dir(family: str) -> Path:
    return FIXTURES / f"{family}-tiny"


def adapter_options(family: str) -> dict:
    """The fixtures' references use Huginn's zero initial state."""
    return {"initial_state": "zeros"} if family == "huginn" else {}


@cache
def reference(family: str) -> dict:
    return json.loads((fixture_dir(family) / "reference.json").read_text())


@cache
def reference_tensors(family: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(fixture_dir(family) / "reference.safetensors"))


@cache
def load(family: str, dtype: str = "float32"):
    from looped_spec import load_adapter

    return load_adapter(fixture_dir(family), dtype=dtype, device="cpu", **adapter_options(family))


def with_small_vocabulary(folder: Path, vocab_size: int = 16) -> Path:
    """A copy of the Ouro fixture at `folder` keeping only its first `vocab_size` tokens (embedding and head rows): a
    model of fewer tokens than the 20 most likely a request may ask for."""
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True)
    config = json.loads((fixture_dir("ouro") / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"vocab_size": vocab_size}))
    weights = load_file(str(fixture_dir("ouro") / "model.safetensors"))
    size = config["vocab_size"]
    save_file({name: w[:vocab_size].contiguous() if w.shape[0] == size else w for name, w in weights.items()},
              str(folder / "model.safetensors"))  # fmt: skip
    return folder


def decoding_modes(full_depth: int) -> list[dict]:
    """Engine options of every decoding mode an exactness test compares with plain decoding: plain, fixed plans at
    the shallowest and deepest draft, adaptive, loop passes with and without a plan, per-token stopping."""
    from looped_spec import SpeculativeConfig

    return [dict(), dict(speculation="2,1"), dict(speculation=f"3,{full_depth - 1}"), dict(speculation="adaptive"),
            dict(speculation="2,1", batching="loop"), dict(batching="loop"),
            dict(speculation=SpeculativeConfig(k=4, d=1, stop_margin=0.01))]  # fmt: skip


def make_engine(family: str, **kwargs):
    from looped_spec import LoopedSpecEngine

    kwargs.setdefault("speculation", "off")
    return LoopedSpecEngine(load(family), **kwargs)


def engine_with_graphs(model, graphs: bool | str, **kwargs):
    """A LoopedSpecEngine with `cuda_graphs=graphs` ("emulate": the CUDA-graph runner's padded static-buffer path
    run eagerly without capture, so CPU tests cover it)."""
    from looped_spec import LoopedSpecEngine

    return LoopedSpecEngine(model, cuda_graphs=graphs, **kwargs)


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture
def ray_cluster_turn(tmp_path_factory):
    """Tests that start a local Ray cluster take turns: two clusters with two replicas each at once overload a
    2-core box (a test's replicas then miss their checks). An exclusive lock in the run's temporary folder, which the
    pytest-xdist workers share."""
    import fcntl

    with open(tmp_path_factory.getbasetemp().parent / "ray_cluster.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def pytest_collection_finish(session):
    """What collecting imported (torch, transformers, Ray, every test module: ~250,000 objects, more with the whole
    suite) lives for the run: moved out of the cycle collector's reach, each full collection walks only what tests
    made since. The property tests collect after every example to free its engines (0.2 to 0.4 s a collection
    before, half their time)."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    # the `slow` tests first: pytest-xdist hands tests out in this order, so none of the longest is left to run alone at
    # the end while the other workers idle. The tests that start a Ray cluster take turns (`ray_cluster_turn`): one
    # first, the others last among the slow ones, so that no worker waits on the lock from the start
    slow = [item for item in items if "slow" in item.keywords]
    ray = [item for item in slow if "ray_cluster_turn" in getattr(item, "fixturenames", ())]
    first = ray[-1:] + [item for item in slow if item not in ray] + ray[:-1]  # test_ray_serve's, the longest, first
    items[:] = first + [item for item in items if "slow" not in item.keywords]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


class TokenizerFailingOn:
    """A tokenizer that cannot decode token `bad` (it raises whenever the ids hold it), one letter per other token:
    the commit of a request whose stop strings make it decode its tokens fails on that token."""

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def decode(self, ids, skip_special_tokens=True):
        if self.bad in ids:
            raise ValueError(f"cannot decode token {self.bad}")
        return "".join(chr(ord("a") + t % 26) for t in ids)


@pytest.fixture(autouse=True)
def _looped_spec_logging_restored():
    """`main(["generate" | "serve", ...])` run in-process sets the looped_spec logger's level and stderr handler
    (logs.py): each test starts from the logger as the previous one found it, not at INFO on stderr."""
    logger = logging.getLogger("looped_spec")
    handlers, level = list(logger.handlers), logger.level
    yield
    logger.handlers[:] = handlers
    logger.setLevel(level)
