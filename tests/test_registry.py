"""A user-defined looped family (examples/custom_family.py), registered and run end to end through the public API."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from custom_family import ToyLoopedAdapter, make_toy_checkpoint  # noqa: E402

from looped_spec import (  # noqa: E402
    LoopedSpecEngine,
    ModelAdapter,
    SamplingParams,
    SpeculativeConfig,
    load_adapter,
    register_adapter,
)


def test_user_family_end_to_end(tmp_path):
    folder = make_toy_checkpoint(tmp_path / "toy")
    adapter = load_adapter(folder, dtype="float32", device="cpu")
    assert isinstance(adapter, ToyLoopedAdapter) and adapter.full_depth == 3
    prompt = [1, 2, 3, 4, 5]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = LoopedSpecEngine(folder, dtype="float32", device="cpu", speculation="off").generate(prompt, params)[0]
    # the plain output equals a naive dense loop
    seq = list(prompt)
    for _ in range(12):
        seq.append(int(adapter.dense_logits(torch.tensor(seq))[0, -1].argmax()))
    assert plain.token_ids == seq[len(prompt) :]
    spec = LoopedSpecEngine(folder, dtype="float32", device="cpu", speculation=SpeculativeConfig(k=3, d=2))
    assert spec.generate(prompt, params)[0].token_ids == plain.token_ids
    adaptive = LoopedSpecEngine(folder, dtype="float32", device="cpu")  # the default: the generic preset at D=3
    assert adaptive.generate(prompt, params)[0].token_ids == plain.token_ids


def test_an_installed_package_provides_a_family_through_its_entry_point(tmp_path):
    """A family installed as a package (an entry point in the `looped_spec.adapters` group, named by its model_type)
    is found by every process that loads a checkpoint: here the CLI, in a fresh interpreter that never imported it."""
    import json
    import os
    import subprocess

    folder = make_toy_checkpoint(tmp_path / "plugged")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "toy_plugged"}))
    site = tmp_path / "site"
    site.mkdir()
    (site / "toy_plugin.py").write_text(  # a class the package never registers itself
        "from custom_family import ToyLoopedAdapter\n\n\nclass PluggedAdapter(ToyLoopedAdapter):\n"
        "    model_type = 'toy_plugged'\n"
    )
    dist = site / "toy_plugin-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-plugin\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[looped_spec.adapters]\ntoy_plugged = toy_plugin:PluggedAdapter\n")
    prompts = tmp_path / "ids.jsonl"
    prompts.write_text(json.dumps({"prompt": [1, 2, 3, 4, 5]}) + "\n")
    examples = Path(__file__).resolve().parents[1] / "examples"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(examples), os.environ.get("PYTHONPATH", "")]))
    command = [sys.executable, "-m", "looped_spec.cli", "generate", "--model", str(folder), "--prompts-file",
               str(prompts), "--max-tokens", "6", "--ignore-eos", "--speculation", "2,1"]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr
    adapter = load_adapter(make_toy_checkpoint(tmp_path / "toy"), dtype="float32", device="cpu")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with LoopedSpecEngine(adapter, speculation="off") as engine:
        want = engine.generate([[1, 2, 3, 4, 5]], params)[0].token_ids
    # a token-id prompt prints as ids, prompt then continuation (the toy has no tokenizer)
    assert done.stdout.startswith(" ".join(map(str, [1, 2, 3, 4, 5, *want])))

    for target, error in [
        ("toy_plugin:Missing", "loading it failed"),
        ("custom_family:ToyLoopedAdapter", "names a class whose model_type is 'toy_looped'"),
        ("custom_family:make_toy_checkpoint", "registered no adapter for model_type 'toy_plugged'"),
    ]:
        (dist / "entry_points.txt").write_text(f"[looped_spec.adapters]\ntoy_plugged = {target}\n")
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
        assert done.returncode != 0 and f"entry point toy_plugged = '{target}'" in done.stderr
        assert error in done.stderr, done.stderr


def test_an_unknown_model_type_says_how_a_family_is_added(tmp_path):
    import json

    import pytest

    from looped_spec.models.checkpoint import CheckpointError

    folder = make_toy_checkpoint(tmp_path / "toy")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "nobody_registered_this"}))
    with pytest.raises(CheckpointError, match="unknown model_type 'nobody_registered_this'.*'looped_spec.adapters'"):
        load_adapter(folder)


def test_adapter_options_a_family_does_not_declare_are_refused(tmp_path):
    import pytest

    folder = make_toy_checkpoint(tmp_path / "toy")
    with pytest.raises(ValueError, match=r"adapter option num_stepz: not an option of toy_looped; it takes: none"):
        load_adapter(folder, num_stepz=3)
    with pytest.raises(
        ValueError, match=r"adapter option depth: not an option of huginn_raven; it takes: initial_state, num_steps"
    ):
        load_adapter("tiny-huginn", depth=3)

    class WithOption(ToyLoopedAdapter):
        option_names = ("scale",)

    adapter = load_adapter(folder)
    assert WithOption(adapter.config, adapter.weights, scale=2.0).options == {"scale": 2.0}


def test_a_config_field_the_family_reads_and_lacks_names_config_json(tmp_path):
    """A family reads its config as examples/custom_family.py does (`config["loops"]`): a field the file lacks is an
    error naming config.json and the field, whether the family reads it in tensor_specs, in __init__ or in a property
    the engine asks for later (full_depth), not a bare KeyError('loops') from deep in the engine."""
    import json

    import pytest

    from looped_spec.models.checkpoint import CheckpointError

    class ScaledToy(ToyLoopedAdapter):
        def __init__(self, config, weights, **kwargs):
            super().__init__(config, weights, **kwargs)
            self.scale = config["scale"]

    register_adapter(ScaledToy, model_type="toy_scaled")
    for field in ("hidden", "loops", "scale"):
        folder = make_toy_checkpoint(tmp_path / field)
        config = json.loads((folder / "config.json").read_text()) | {"model_type": "toy_scaled", "scale": 2.0}
        del config[field]
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(CheckpointError, match=rf"{folder / 'config.json'}: missing field {field}$"):
            LoopedSpecEngine(folder, dtype="float32", device="cpu", speculation="off")


def test_a_family_registered_for_a_built_in_model_type_is_the_one_loaded(tmp_path):
    """A family registered under a built-in model_type ("ouro") in a process that had not yet loaded a checkpoint: the
    built-in families, which register when first needed, replaced it without a word, and the checkpoint was loaded
    with the built-in adapter. The registration made last now wins, with a warning that it replaces the built-in."""
    import json
    import os
    import subprocess

    folder = make_toy_checkpoint(tmp_path / "toy")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "ouro"}))
    script = (
        "import sys\n"
        "from custom_family import ToyLoopedAdapter\n"
        "from looped_spec import load_adapter, register_adapter\n"
        "class MyOuro(ToyLoopedAdapter):\n"
        "    pass\n"
        "register_adapter(MyOuro, model_type='ouro')\n"
        "print(type(load_adapter(sys.argv[1], device='cpu')).__name__)\n"
    )
    examples = Path(__file__).resolve().parents[1] / "examples"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(examples), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script, str(folder)], env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["MyOuro"]
    assert "model_type 'ouro': MyOuro replaces looped_spec.adapters.ouro.OuroAdapter" in done.stderr

    import pytest

    with pytest.raises(TypeError, match="is not a ModelAdapter subclass"):  # not AttributeError: no model_type
        register_adapter(object)


def test_a_family_missing_a_required_method_is_refused_when_registered():
    """A family that leaves out `tensor_specs` registered, and loading its checkpoint then failed on a bare
    AttributeError ('NoneType' object has no attribute 'items'). Registering it is the error, naming what it lacks."""
    import pytest

    class NoSpecs(ModelAdapter):
        full_depth = vocab_size = state_dim = kv_layout = ToyLoopedAdapter.kv_layout
        embed, loop, readout = ToyLoopedAdapter.embed, ToyLoopedAdapter.loop, ToyLoopedAdapter.readout

    with pytest.raises(TypeError, match="NoSpecs does not implement tensor_specs, which a ModelAdapter must provide"):
        register_adapter(NoSpecs, model_type="toy_no_specs")


def test_a_family_registered_under_two_model_types_is_each_by_its_checkpoint(tmp_path):
    """One class for two model types (a renamed export): registering it again used to rename the class, so a checkpoint
    of the first type reported itself (errors, the tuner's preset) as the second."""
    import json

    import pytest

    from looped_spec.models import adapter as adapter_module

    class TwoNames(ToyLoopedAdapter):
        model_type = "toy_first"

    saved = dict(adapter_module._REGISTRY)
    try:
        register_adapter(TwoNames)
        register_adapter(TwoNames, model_type="toy_second")
        folder = make_toy_checkpoint(tmp_path / "toy")
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps(config | {"model_type": "toy_first"}))
        assert load_adapter(folder).model_type == "toy_first"
        with pytest.raises(ValueError, match="not an option of toy_first"):
            load_adapter(folder, scale=2.0)
        (folder / "config.json").write_text(json.dumps(config | {"model_type": "toy_second"}))
        assert load_adapter(folder).model_type == "toy_second"
    finally:
        adapter_module._REGISTRY.clear()
        adapter_module._REGISTRY.update(saved)


def test_a_family_is_described_without_its_weights_or_not_at_all(tmp_path):
    """`describe_adapter` (what Ray Serve's driver checks the engine options against) builds the family on weightless
    tensors: the shipped families and the example give the depth, positions and vocabulary loading them gives (an
    adapter option moving the depth included); a family computing on its weights as it is built is not described
    (None: the replicas check), and its own error about an option is raised as loading raises it."""
    import pytest

    from looped_spec.models import shipped_model_path
    from looped_spec.models.adapter import describe_adapter
    from looped_spec.models.checkpoint import CheckpointError

    toy = make_toy_checkpoint(tmp_path / "toy")
    for model, options in (("tiny-ouro", {}), ("tiny-nanbeige", {}), ("tiny-huginn", {"num_steps": 12}), (toy, {})):
        described, loaded = describe_adapter(model, **options), load_adapter(model, device="cpu", **options)
        assert described.weights and all(w.is_meta for w in described.weights.values())
        for name in ("full_depth", "max_positions", "vocab_size", "model_type", "name", "path"):
            assert getattr(described, name) == getattr(loaded, name), name
    with pytest.raises(ValueError, match="adapter option num_steps=0 must be a positive integer"):
        describe_adapter("tiny-huginn", num_steps=0)

    class WeighedToy(ToyLoopedAdapter):
        def __init__(self, config, weights, **kwargs):
            super().__init__(config, weights, **kwargs)
            self.scale = float(next(iter(self.weights.values())).abs().max())  # reads a weight's value

    register_adapter(WeighedToy, model_type="toy_weighed")
    folder = make_toy_checkpoint(tmp_path / "weighed")
    config = json.loads((folder / "config.json").read_text()) | {"model_type": "toy_weighed"}
    (folder / "config.json").write_text(json.dumps(config))
    assert describe_adapter(folder) is None
    assert load_adapter(folder, device="cpu").full_depth == config["loops"]

    class ScaledToy(ToyLoopedAdapter):  # reads a config field in __init__: one the file lacks is named, as loading does
        def __init__(self, config, weights, **kwargs):
            super().__init__(config, weights, **kwargs)
            self.scale = config["scale"]

    register_adapter(ScaledToy, model_type="toy_scaled_described")
    folder = make_toy_checkpoint(tmp_path / "scaled")
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "toy_scaled_described"}))
    with pytest.raises(CheckpointError, match=rf"{folder / 'config.json'}: missing field scale$"):
        describe_adapter(folder)

    class LookedUpToy(ToyLoopedAdapter):  # a KeyError of its own of a field the file has: not described, and loading
        def __init__(self, config, weights, **kwargs):  # raises it as the family's own, not as config.json's
            super().__init__(config, weights, **kwargs)
            self.table = {}["loops"]

    register_adapter(LookedUpToy, model_type="toy_looked_up")
    folder = make_toy_checkpoint(tmp_path / "looked_up")
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "toy_looked_up"}))
    assert describe_adapter(folder) is None
    with pytest.raises(KeyError, match="loops"):
        load_adapter(folder, device="cpu")
    folder = tmp_path / "huginn"  # a bad value in config.json is named as loading names it, before any weight
    folder.mkdir()
    huginn = json.loads((shipped_model_path("tiny-huginn") / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(huginn | {"n_heads": 0}))
    with pytest.raises(CheckpointError, match=rf"{folder / 'config.json'}: n_heads=0 must be >= 1"):
        describe_adapter(folder)


def test_two_installed_packages_providing_one_model_type_are_named(tmp_path, monkeypatch):
    """Two packages whose entry points both claim a checkpoint's model_type: which one loads is not for an import
    order to decide; the error names both entry points and the packages they come from, to uninstall all but one."""
    import json

    import pytest

    from looped_spec.models.checkpoint import CheckpointError

    folder = make_toy_checkpoint(tmp_path / "twice")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"model_type": "toy_twice"}))
    for name in ("first", "second"):
        dist = tmp_path / name / f"{name}_plugin-0.1.dist-info"
        dist.mkdir(parents=True)
        (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}-plugin\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text(f"[looped_spec.adapters]\ntoy_twice = {name}_plugin:Adapter\n")
        monkeypatch.syspath_prepend(str(tmp_path / name))
    with pytest.raises(CheckpointError, match="model_type 'toy_twice': several installed packages provide it") as error:
        load_adapter(folder)
    message = str(error.value)
    for name in ("first", "second"):
        assert f"'{name}_plugin:Adapter' (package {name}-plugin)" in message
    assert re.search(r"uninstall all but one of the packages (first|second)-plugin, (first|second)-plugin$", message)


def test_an_adapter_built_without_a_folder_serves_token_ids_and_refuses_text(tmp_path):
    """A family constructed in-process from a config and weights has no folder to read tokenizer files from: token
    ids run as from the checkpoint, a text prompt is an error saying to pass ids."""
    import pytest

    loaded = load_adapter(make_toy_checkpoint(tmp_path / "toy"), dtype="float32", device="cpu")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with LoopedSpecEngine(loaded, speculation="off") as engine:
        want = engine.generate([[1, 2, 3]], params)[0].token_ids
    with LoopedSpecEngine(ToyLoopedAdapter(loaded.config, loaded.weights), speculation="off") as engine:
        assert engine.generate([[1, 2, 3]], params)[0].token_ids == want
        with pytest.raises(ValueError, match=r"prompts\[0\] is text, but the model has no tokenizer files; pass token"):
            engine.generate("hello", params)
