"""Loading real-format checkpoints: sharded files, tied heads, and clear errors for bad folders."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from conftest import fixture_dir, load
from safetensors.torch import load_file, save_file

from looped_spec import CheckpointError, LoopedSpecEngine, load_adapter


def copy_fixture(tmp_path, family: str):
    dst = tmp_path / family
    shutil.copytree(fixture_dir(family), dst)
    for p in dst.iterdir():
        p.chmod(0o644)
    return dst


def edit_config(folder, **changes):
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def edit_weights(folder, fn):
    tensors = load_file(str(folder / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


def test_missing_config(tmp_path):
    folder = copy_fixture(tmp_path, "ouro")
    (folder / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json"):
        load_adapter(folder, device="cpu")


def test_missing_folder(tmp_path):
    with pytest.raises(CheckpointError, match="not a checkpoint folder"):
        load_adapter(tmp_path / "nope", device="cpu")


def test_unknown_model_type_lists_registered(tmp_path):
    folder = copy_fixture(tmp_path, "ouro")
    edit_config(folder, model_type="llama")
    with pytest.raises(CheckpointError, match=r"unknown model_type 'llama'.*huginn_raven.*nanbeige.*ouro"):
        load_adapter(folder, device="cpu")


def test_missing_tensor_is_named(tmp_path):
    folder = copy_fixture(tmp_path, "ouro")
    edit_weights(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor.*model\.layers\.1\.mlp\.up_proj\.weight"):
        load_adapter(folder, device="cpu")


def test_wrong_shape_names_file_and_tensor(tmp_path):
    folder = copy_fixture(tmp_path, "nanbeige")
    edit_weights(folder, lambda t: t.update({"model.norm.weight": torch.ones(65)}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor model\.norm\.weight has shape \[65\]"):
        load_adapter(folder, device="cpu")


def test_unexpected_tensor(tmp_path):
    folder = copy_fixture(tmp_path, "ouro")
    edit_weights(folder, lambda t: t.update({"model.layers.9.extra.weight": torch.ones(2)}))
    with pytest.raises(CheckpointError, match=r"unexpected tensor.*model\.layers\.9\.extra\.weight"):
        load_adapter(folder, device="cpu")


def test_pickle_only_folder_is_refused(tmp_path):
    folder = copy_fixture(tmp_path, "ouro")
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match=r"pickle.*pytorch_model\.bin"):
        load_adapter(folder, device="cpu")


@pytest.mark.parametrize(
    "family,changes,message",
    [
        ("ouro", {"use_sliding_window": True, "sliding_window": 64}, "sliding_window"),
        ("ouro", {"layer_types": ["sliding_attention", "full_attention"]}, r"layer_types\[0\]"),
        ("ouro", {"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ("nanbeige", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling"),
        ("huginn", {"injection_type": "add"}, "injection_type 'add'"),
    ],
)
def test_unsupported_config_values(tmp_path, family, changes, message):
    folder = copy_fixture(tmp_path, family)
    edit_config(folder, **changes)
    with pytest.raises(CheckpointError, match=message):
        load_adapter(folder, device="cpu")


def test_tied_head_may_be_omitted(tmp_path):
    folder = copy_fixture(tmp_path, "ouro")
    edit_config(folder, tie_word_embeddings=True)
    edit_weights(folder, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    stored = load_adapter(folder, dtype="float32", device="cpu")
    edit_weights(folder, lambda t: t.pop("lm_head.weight"))
    omitted = load_adapter(folder, dtype="float32", device="cpu")
    ids = torch.tensor([5, 6, 7, 8])
    assert torch.equal(stored.dense_logits(ids), omitted.dense_logits(ids))


def test_huginn_tied_head_and_freqs_buffer(tmp_path):
    folder = copy_fixture(tmp_path, "huginn")
    edit_weights(folder, lambda t: t.pop("lm_head.weight"))
    adapter = load_adapter(folder, dtype="float32", device="cpu", initial_state="zeros")
    ids = torch.tensor([5, 6, 7, 8])
    assert torch.allclose(adapter.dense_logits(ids), load("huginn").dense_logits(ids))


def shard_weights(folder) -> dict[str, str]:
    """The folder's model.safetensors split into two shards and an index; returns the index's weight_map."""
    tensors = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(folder / file))
        weight_map.update(dict.fromkeys(keys, file))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return weight_map


def test_sharded_checkpoint(tmp_path):
    folder = copy_fixture(tmp_path, "nanbeige")
    shard_weights(folder)
    adapter = load_adapter(folder, dtype="float32", device="cpu")
    ids = torch.tensor([1, 2, 3])
    assert torch.equal(adapter.dense_logits(ids), load("nanbeige").dense_logits(ids))


def test_bad_dtype_and_options(tmp_path):
    with pytest.raises(ValueError, match="dtype='int8': not supported"):
        load_adapter(fixture_dir("ouro"), dtype="int8", device="cpu")


def test_an_unsupported_torch_dtype_in_config_is_named_not_the_dtype_option(tmp_path):
    """dtype='auto' follows config.json's torch_dtype: a value there not supported is that file's field at fault, not
    the dtype the caller left at auto (the command line said `--dtype float64` to a user who gave no --dtype)."""
    folder = copy_fixture(tmp_path, "ouro")
    edit_config(folder, torch_dtype="float64")
    with pytest.raises(
        CheckpointError, match=r"config\.json: torch_dtype='float64' is not supported, and dtype='auto'"
    ):
        load_adapter(folder, device="cpu")
    assert load_adapter(folder, dtype="float32", device="cpu").dtype == torch.float32  # an explicit dtype decides
    with pytest.raises(ValueError, match="initial_state='ones'"):
        load_adapter(fixture_dir("huginn"), device="cpu", initial_state="ones")


@pytest.mark.parametrize("file", ["config.json", "generation_config.json"])
def test_an_eos_token_outside_the_vocabulary_is_named_at_load(tmp_path, file):
    """An eos_token_id past the vocabulary (256 here) loaded, and a request with min_tokens, which masks the eos
    tokens, then failed with a bare IndexError; it is an error naming the file and the field when loading."""
    folder = copy_fixture(tmp_path, "ouro")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": 0}))
    (folder / file).write_text(json.dumps(json.loads((folder / file).read_text()) | {"eos_token_id": [0, 300]}))
    with pytest.raises(
        CheckpointError, match=rf"{file}: eos_token_id 300 is outside the model's vocabulary \[0, 256\)"
    ):
        LoopedSpecEngine(folder, dtype="float32", device="cpu", speculation="off")


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool])
def test_a_weight_of_an_integer_dtype_names_file_and_tensor(tmp_path, dtype):
    """A weight stored as integers or booleans (a broken export) was cast to the model's dtype without a word and
    generated garbage; it is an error naming the file and the tensor."""
    folder = copy_fixture(tmp_path, "ouro")
    edit_weights(folder, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].to(dtype)}))
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor model\.norm\.weight has dtype {name}, exp"):
        load_adapter(folder, dtype="float32", device="cpu")


@pytest.mark.parametrize(
    "family,field",
    [("nanbeige", "skip_loop_final_norm"), ("ouro", "tie_word_embeddings"), ("huginn", "tie_embeddings")],
)
def test_a_boolean_config_field_written_as_a_string_is_named(tmp_path, family, field):
    """`"skip_loop_final_norm": "false"` was read with bool(), so true: the norm moved and other tokens came out,
    without a word (a tied head likewise: a missing head taken from the embedding where the file says untied). It is
    an error naming config.json and the field."""
    folder = copy_fixture(tmp_path, family)
    edit_config(folder, **{field: "false"})
    with pytest.raises(CheckpointError, match=rf"config\.json: {field}='false' must be true or false"):
        load_adapter(folder, dtype="float32", device="cpu")


@pytest.mark.parametrize("family, key", [("ouro", "tie_word_embeddings"), ("huginn", "tie_embeddings")])
def test_a_tied_head_is_the_embedding_even_where_the_file_stores_another(tmp_path, family, key):
    """transformers ties the head to the embedding at load when the config says so, whatever head the file stores:
    a stored head that differs is not used (the reference's logits are the embedding's)."""
    folder = copy_fixture(tmp_path, family)
    edit_config(folder, **{key: True})
    embedding = "transformer.wte.weight" if family == "huginn" else "model.embed_tokens.weight"
    edit_weights(folder, lambda t: t.update({"lm_head.weight": t[embedding] * 2.0}))
    options = {"initial_state": "zeros"} if family == "huginn" else {}
    stored = load_adapter(folder, dtype="float32", device="cpu", **options)
    edit_weights(folder, lambda t: t.pop("lm_head.weight"))
    omitted = load_adapter(folder, dtype="float32", device="cpu", **options)
    ids = torch.tensor([5, 6, 7, 8])
    assert torch.equal(stored.dense_logits(ids), omitted.dense_logits(ids))


@pytest.mark.parametrize(
    "text,message",
    [
        ('{"model_type": "ouro"', r"config\.json: not valid JSON"),
        ('["ouro"]', r"config\.json: expected a JSON object"),
        ('{"vocab_size": 256}', r"config\.json: no model_type field"),
    ],
)
def test_a_config_json_that_is_no_config_names_the_file(tmp_path, text, message):
    folder = copy_fixture(tmp_path, "ouro")
    (folder / "config.json").write_text(text)
    with pytest.raises(CheckpointError, match=message):
        load_adapter(folder, device="cpu")


@pytest.mark.parametrize(
    "index,message",
    [
        ("{", "malformed index"),
        ({"weights": {}}, r"malformed index \('weight_map'\)"),
        ({"weight_map": ["model-00001-of-00002.safetensors"]}, "malformed index"),
        ({"weight_map": {"model.norm.weight": 1}}, "shard name 1 is not a file name inside the checkpoint folder"),
        ({"weight_map": {"model.norm.weight": "model-00003-of-00003.safetensors"}},
         "names shard model-00003-of-00003.safetensors, which is missing"),
    ],
)  # fmt: skip
def test_a_bad_shard_index_names_the_index_and_the_fault(tmp_path, index, message):
    folder = copy_fixture(tmp_path, "nanbeige")
    shard_weights(folder)
    (folder / "model.safetensors.index.json").write_text(index if isinstance(index, str) else json.dumps(index))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors\.index\.json: {message}"):
        load_adapter(folder, device="cpu")


def test_a_shard_linked_from_outside_the_folder_is_refused(tmp_path):
    folder = copy_fixture(tmp_path, "nanbeige")
    shard_weights(folder)
    outside = tmp_path / "elsewhere.safetensors"
    (folder / "model-00002-of-00002.safetensors").rename(outside)
    (folder / "model-00002-of-00002.safetensors").symlink_to(outside)
    with pytest.raises(CheckpointError, match=r"index\.json: shard model-00002-of-00002\.safetensors resolves outside"):
        load_adapter(folder, device="cpu")


def test_a_tensor_stored_in_two_shards_names_both(tmp_path):
    folder = copy_fixture(tmp_path, "nanbeige")
    weight_map = shard_weights(folder)
    first, second = (folder / name for name in sorted(set(weight_map.values())))
    moved = next(name for name, file in weight_map.items() if file == first.name)
    tensors = load_file(str(second))
    save_file(tensors | {moved: load_file(str(first))[moved]}, str(second))
    with pytest.raises(
        CheckpointError, match=rf"model-00002-of-00002\.safetensors: tensor {re.escape(moved)} also stored in "
        r"model-00001-of-00002\.safetensors"
    ):  # fmt: skip
        load_adapter(folder, device="cpu")


def test_a_corrupt_safetensors_file_names_the_file(tmp_path):
    folder = copy_fixture(tmp_path, "ouro")
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(CheckpointError, match=r"model\.safetensors: cannot read safetensors file"):
        load_adapter(folder, device="cpu")


def test_weights_under_another_file_name_are_named(tmp_path):
    """The safetensors files found are listed, in a sentence for one or several."""
    folder = copy_fixture(tmp_path, "nanbeige")  # beside its model.safetensors, the fixture's reference.safetensors
    (folder / "model.safetensors").rename(folder / "weights.safetensors")
    with pytest.raises(CheckpointError, match=r"no model\.safetensors.*\(found only reference\.safetensors and "
                                              r"weights\.safetensors, neither of which is a weights file name "
                                              r"looped-spec reads\)"):  # fmt: skip
        load_adapter(folder, device="cpu")
    (folder / "a.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"\(found only a\.safetensors, reference\.safetensors and "
                                              r"weights\.safetensors, none of which is a weights"):  # fmt: skip
        load_adapter(folder, device="cpu")
    (folder / "a.safetensors").unlink()
    (folder / "reference.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"\(found only weights\.safetensors, which is not a weights file name "
                                              r"looped-spec reads\)"):  # fmt: skip
        load_adapter(folder, device="cpu")


@pytest.mark.parametrize(
    "options,error,message",
    [
        ({"dtype": 16}, TypeError, "dtype=16 must be a string or a torch dtype"),
        ({"device": 0}, TypeError, "device=0 must be a string or a torch.device"),
        ({"device": "gpu"}, ValueError, "device='gpu' is not a device"),
        ({"device": "meta"}, ValueError, "device='meta' is not supported; use 'auto', 'cpu' or 'cuda"),
    ],
)
def test_a_dtype_or_device_of_the_wrong_kind_is_named(options, error, message):
    with pytest.raises(error, match=re.escape(message)):
        load_adapter(fixture_dir("ouro"), **({"device": "cpu"} | options))
    assert load_adapter(fixture_dir("ouro"), dtype=torch.float16, device=torch.device("cpu")).dtype == torch.float16


def test_a_shard_index_naming_a_shard_by_a_number_names_it(tmp_path):
    """An index whose weight_map gives one tensor a number for its shard said only "malformed index ('<' not
    supported between instances of 'str' and 'int')", sorting the names; it names the shard name at fault."""
    folder = copy_fixture(tmp_path, "nanbeige")
    weight_map = shard_weights(folder)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map | {"extra": 2}}))
    with pytest.raises(CheckpointError, match=r"index\.json: shard name 2 is not a file name inside the checkpoint"):
        load_adapter(folder, device="cpu")


@pytest.mark.parametrize(
    "text,message",
    [('{"do_sample": true', r"Expecting ',' delimiter"), ("[2]", "expected a JSON object"), ("", "Expecting value")],
)
def test_a_generation_config_that_is_no_object_names_the_file(tmp_path, text, message):
    folder = copy_fixture(tmp_path, "ouro")
    (folder / "generation_config.json").write_text(text)
    with pytest.raises(CheckpointError, match=rf"generation_config\.json: {message}"):
        load_adapter(folder, device="cpu")
