"""Issue 11 items 6-12: inputs accepted and then failing, and checkpoints loaded silently wrong."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from conftest import fixture_dir, make_engine
from pydantic import ValidationError
from safetensors.torch import load_file, save_file

from looped_spec import CheckpointError, LoopedSpecEngine, SamplingParams, load_adapter
from looped_spec.models import shipped_model_path


def copy_model(tmp_path, source) -> object:
    dst = tmp_path / source.name
    shutil.copytree(source, dst)
    for p in dst.iterdir():
        p.chmod(0o644)
    return dst


def edit_config(folder, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    for key, value in changes.items():
        if value is ...:  # remove the key
            config.pop(key)
    (folder / "config.json").write_text(json.dumps(config))


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


# ----- 6. inputs that were accepted and then failed, or failed without naming the field -----
def test_item06_sampling_params_bounds():
    assert SamplingParams(temperature=1e-45).greedy
    engine = make_engine("ouro")
    tiny = engine.generate([5, 9, 13], SamplingParams(max_tokens=6, temperature=1e-45, ignore_eos=True))[0]
    assert tiny.token_ids == engine.generate([5, 9, 13], greedy(6))[0].token_ids
    for field, value in (("top_k", 2**70), ("seed", 2**70), ("temperature", float("nan")), ("top_p", float("nan"))):
        with pytest.raises(ValidationError, match=field):
            SamplingParams(**{field: value})


@pytest.mark.parametrize(
    "kwargs,named",
    [
        ({"dtype": torch.int32}, "dtype"),
        ({"dtype": torch.bool}, "dtype"),
        ({"max_model_len": 0}, "max_model_len"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": -1}, "block_size"),
        ({"model": None}, "model"),
        ({"preset": 123, "speculation": "adaptive"}, "preset"),
        ({"preset": {}, "speculation": "adaptive"}, "preset"),
        ({"max_batch_size": "8"}, "max_batch_size"),
        ({"kv_cache_memory_gb": float("nan")}, "kv_cache_memory_gb"),
        ({"adapter_options": {"no_such_option": 1}}, "no_such_option"),
    ],
)
def test_item06_engine_arguments_are_named(kwargs, named):
    args = {"model": str(fixture_dir("ouro")), "device": "cpu", "speculation": "off", **kwargs}
    with pytest.raises(ValueError, match=named):
        LoopedSpecEngine(**args)


def test_item06_nanbeige_rejects_unknown_adapter_options():
    with pytest.raises(ValueError, match="no_such_option"):
        load_adapter(fixture_dir("nanbeige"), device="cpu", no_such_option=1)


@pytest.mark.parametrize(
    "family,changes,named",
    [
        ("ouro", {"eos_token_id": "x"}, "eos_token_id"),
        ("nanbeige", {"eos_token_id": [2, "x"]}, "eos_token_id"),
        ("huginn", {"n_heads": 0}, "n_heads"),
        ("ouro", {"num_attention_heads": 0}, "num_attention_heads"),
        ("ouro", {"vocab_size": "abc"}, "vocab_size"),
        ("huginn", {"vocab_size": "abc", "padded_vocab_size": ...}, "vocab_size"),
    ],
)
def test_item06_bad_config_values_fail_at_load_naming_the_field(tmp_path, family, changes, named):
    folder = copy_model(tmp_path, fixture_dir(family))
    edit_config(folder, **changes)
    with pytest.raises(CheckpointError, match=rf"config\.json: .*{named}"):
        load_adapter(folder, device="cpu")


def test_item06_corrupt_tokenizer_names_the_file(tmp_path):
    folder = copy_model(tmp_path, shipped_model_path("tiny-ouro"))
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": {"type": "nonsense"')
    with pytest.raises(CheckpointError, match="tokenizer.json"):
        LoopedSpecEngine(str(folder), device="cpu", speculation="off")


# ----- 7. a shard index naming files outside the checkpoint folder -----
@pytest.mark.parametrize("name", ["../outside.safetensors", "/tmp/outside.safetensors", "sub/../../x.safetensors"])
def test_item07_shard_index_cannot_leave_the_folder(tmp_path, name):
    folder = copy_model(tmp_path, fixture_dir("ouro"))
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    outside = tmp_path / "outside.safetensors"
    save_file(tensors, str(outside))
    weight_map = {key: name for key in tensors}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match="inside the checkpoint folder"):
        load_adapter(folder, device="cpu")


# ----- 8. plain decoding written as presets write it -----
def test_item08_speculation_zero_zero_is_plain():
    plain = make_engine("ouro", speculation="off").generate([5, 9, 13], greedy(5))[0].token_ids
    for spec in ("0,0", {"k": 0, "d": 0}):
        engine = make_engine("ouro", speculation=spec)
        assert engine.generate([5, 9, 13], greedy(5))[0].token_ids == plain
        assert engine.stats.num_spec_rounds == 0
    with pytest.raises(ValueError, match="d=0 must be >= 1 when k=2"):
        make_engine("ouro", speculation="2,0")
