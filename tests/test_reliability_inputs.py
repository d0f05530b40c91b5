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
        ({"max_batch_szie": 8}, "unknown option 'max_batch_szie': did you mean 'max_batch_size'"),
        ({"draft_override": object()}, "unknown option 'draft_override'"),
        ({"cuda_graphs": "always"}, "cuda_graphs"),
        ({"speculation": "sometimes"}, "speculation='sometimes'"),
        ({"speculation": "²,1"}, "speculation='²,1': use 'off', 'adaptive', 'K,d'"),  # not int()'s invalid literal
        # options that would do nothing are errors, not shrugs
        ({"speculation": "3,1", "preset": "tiny-ouro"}, "preset='tiny-ouro': only with speculation='adaptive'"),
        ({"policy": "ema"}, "policy='ema': only with speculation='adaptive'"),
        ({"policy": "goodput"}, "policy='goodput': only with speculation='adaptive'"),  # the default, but given
        ({"speculation": "adaptive", "control": {"hysteresis": 2}}, r"control\.hysteresis=2 must be in \[0, 1\)"),
        (
            {"speculation": "adaptive", "control": {"hysterisis": 0.1}},
            "control.hysterisis: unknown field \\(did you mean 'hysteresis'",
        ),
        ({"speculation": "2,1", "control": {"hysteresis": 0.5}}, r"control=.*only with speculation='adaptive'"),
        # a tunable given at its default is not shown as no control at all ('control={}: only with ...')
        (
            {"speculation": "2,1", "control": {"decision_interval": 4}},
            r"control=\{\} \(no tunable set away from its default\): only with speculation='adaptive'",
        ),
        (
            {"speculation": "adaptive", "policy": "ema", "control": {"hysteresis": 0.1, "readout_budget": 0.01}},
            r"^LoopedSpecEngine: control\.hysteresis=0\.1: only the goodput policy reads it \(policy='ema' runs",
        ),
        ({"num_kv_blocks": 64, "kv_cache_memory_gb": 1.0}, "set at most one"),
        ({"speculation": {"k": "2"}}, "speculation.k='2'"),
        ({"speculation": {"k": True}}, "speculation.k=True"),
    ],
)
def test_item06_engine_arguments_are_named(kwargs, named):
    args = {"model": str(fixture_dir("ouro")), "device": "cpu", "speculation": "off", **kwargs}
    with pytest.raises(ValueError, match=named):
        LoopedSpecEngine(**args)


def test_item06_loading_options_with_a_loaded_adapter_are_refused():
    adapter = load_adapter(fixture_dir("ouro"), device="cpu")
    for option, value in (("dtype", "float16"), ("device", "cpu"), ("adapter_options", {"x": 1})):
        with pytest.raises(ValueError, match=f"{option}=.*not to a ModelAdapter instance"):
            LoopedSpecEngine(adapter, speculation="off", **{option: value})
    LoopedSpecEngine(adapter, speculation="off").close()


def test_item06_sampling_params_types_are_strict():
    for field, value in (("max_tokens", "8"), ("max_tokens", True), ("seed", True), ("ignore_eos", "yes"),
                         ("logprobs", True), ("temperature", "0.5"), ("max_tokens", 8.0)):  # fmt: skip
        with pytest.raises(ValidationError, match=field):
            SamplingParams(**{field: value})
    params = SamplingParams(temperature=1, stop_token_ids=(3, 4), stop=("a",))  # an int temperature, tuples: fine
    assert params.temperature == 1.0 and params.stop_token_ids == [3, 4] and params.stop == ["a"]
    import numpy as np  # numpy's numbers are numbers

    params = SamplingParams(max_tokens=np.int64(8), seed=np.int32(3), temperature=np.float32(0.5),
                            stop_token_ids=[np.int64(2)])  # fmt: skip
    assert (params.max_tokens, params.seed, params.temperature, params.stop_token_ids) == (8, 3, 0.5, [2])
    assert type(params.max_tokens) is int
    engine = make_engine("ouro")
    assert len(engine.score([1, 2, 3], np.int64(2), np.int64(5))) == 3


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
        ("huginn", {"n_heads": ...}, "missing field n_heads"),
        ("huginn", {"rope_parameters": 50000}, "rope_parameters=50000 must be an object"),
        ("huginn", {"rope_parameters": {"rope_theta": None}}, r"missing field rope_parameters\.rope_theta"),
        ("huginn", {"rope_parameters": {"rope_theta": "big"}}, r"rope_parameters\.rope_theta='big' must be a finite"),
        ("ouro", {"rope_parameters": {"rope_theta": 10000.0, "factor": 2.0}}, r"rope_parameters fields \['factor'\]"),
        ("ouro", {"rope_parameters": {"rope_theta": 20000.0}, "rope_theta": 10000.0},
         "rope_theta=10000.0 disagrees with rope_parameters.rope_theta=20000.0"),
    ],
)  # fmt: skip
def test_item06_bad_config_values_fail_at_load_naming_the_field(tmp_path, family, changes, named):
    folder = copy_model(tmp_path, fixture_dir(family))
    edit_config(folder, **changes)
    with pytest.raises(CheckpointError, match=rf"config\.json: .*{named}"):
        load_adapter(folder, device="cpu")


def test_an_integer_config_field_written_as_a_whole_float_is_read(tmp_path):
    """HF configs write 4.0 for 4: the same model loads."""
    folder = copy_model(tmp_path, fixture_dir("huginn"))
    edit_config(folder, n_heads=4.0, n_layers_in_recurrent_block=2.0)
    ids = torch.tensor([5, 9, 13, 200])
    options = {"device": "cpu", "initial_state": "zeros"}
    expected = load_adapter(fixture_dir("huginn"), **options).dense_logits(ids)
    assert torch.equal(load_adapter(folder, **options).dense_logits(ids), expected)


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


# ----- 9. transformers-5 configs: rope_parameters instead of a top-level rope_theta -----
@pytest.mark.parametrize("family", ["ouro", "nanbeige"])
def test_item09_rope_parameters_are_read(tmp_path, family):
    folder = copy_model(tmp_path, fixture_dir(family))
    theta = json.loads((folder / "config.json").read_text())["rope_theta"]
    edit_config(folder, rope_theta=..., rope_parameters={"rope_theta": theta, "rope_type": "default"})
    ids = torch.tensor([[5, 9, 13, 200, 1, 77, 4, 4, 19, 88, 23, 7, 150, 3]])
    expected = load_adapter(fixture_dir(family), device="cpu").dense_logits(ids)
    assert load_adapter(folder, device="cpu").rope_theta == theta
    torch.testing.assert_close(load_adapter(folder, device="cpu").dense_logits(ids), expected)
    edit_config(folder, rope_parameters={"rope_theta": theta, "rope_type": "yarn", "factor": 4.0})
    with pytest.raises(CheckpointError, match="rope_type='yarn'"):
        load_adapter(folder, device="cpu")


# ----- 10. Nanbeige architecture flags the adapter does not implement -----
@pytest.mark.parametrize(
    "flag,value",
    [
        ("loop_share_kv", True),
        ("enable_double_loop_split", True),
        ("enable_depth_attention", True),
        ("qk_layernorm", True),
        ("loop_middle_layers", [1]),
        ("enable_hyper_connection", True),
        ("enable_mhc", True),
        ("emb_neighbor_num", 2),
    ],
)
def test_item10_unimplemented_nanbeige_flags_are_rejected_by_name(tmp_path, flag, value):
    folder = copy_model(tmp_path, fixture_dir("nanbeige"))
    edit_config(folder, **{flag: value})
    with pytest.raises(CheckpointError, match=flag):
        load_adapter(folder, device="cpu")
    edit_config(folder, **{flag: None})  # unset is fine
    load_adapter(folder, device="cpu")


@pytest.mark.parametrize(
    "family,changes,named",
    [
        ("huginn", {"state_init": "zero"}, "state_init"),
        ("huginn", {"norm_class_name": "LayerNorm"}, "norm_class_name"),
        ("huginn", {"nonlin_name": "GELU"}, "nonlin_name"),
        ("ouro", {"hidden_act": "gelu"}, "hidden_act"),
        ("nanbeige", {"mlp_bias": True}, "mlp_bias"),
    ],
)
def test_item10_same_rule_for_every_family(tmp_path, family, changes, named):
    folder = copy_model(tmp_path, fixture_dir(family))
    edit_config(folder, **changes)
    with pytest.raises(CheckpointError, match=named):
        load_adapter(folder, device="cpu")


# ----- 11. what real exports carry: inv_freq buffers, a lone shard, generation_config.json, freqs_cis -----
def test_item11_stored_inv_freq_buffers_are_ignored(tmp_path):
    folder = copy_model(tmp_path, fixture_dir("ouro"))
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["model.rotary_emb.inv_freq"] = torch.ones(8)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(tensors, str(folder / "model.safetensors"))
    ids = torch.tensor([[5, 9, 13, 200]])
    expected = load_adapter(fixture_dir("ouro"), device="cpu").dense_logits(ids)
    torch.testing.assert_close(load_adapter(folder, device="cpu").dense_logits(ids), expected)


def test_item11_single_shard_without_index_loads(tmp_path):
    folder = copy_model(tmp_path, fixture_dir("nanbeige"))
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    ids = torch.tensor([[5, 9, 13, 200]])
    expected = load_adapter(fixture_dir("nanbeige"), device="cpu").dense_logits(ids)
    torch.testing.assert_close(load_adapter(folder, device="cpu").dense_logits(ids), expected)
    (folder / "model-00001-of-00001.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="incomplete"):
        load_adapter(folder, device="cpu")


def test_item11_generation_config_gives_eos_and_default_sampling(tmp_path):
    folder = copy_model(tmp_path, fixture_dir("ouro"))
    edit_config(folder, eos_token_id=...)
    plain = LoopedSpecEngine(str(folder), device="cpu", speculation="off")
    assert plain.adapter.eos_token_ids == []
    continuation = plain.generate([5, 9, 13], greedy(8))[0].token_ids
    stop = continuation[3]
    other = next(t for t in range(plain.adapter.vocab_size - 1, 0, -1) if t not in continuation)  # never generated
    generation = {"eos_token_id": [other, stop], "do_sample": True, "temperature": 0.7, "top_k": 5}
    (folder / "generation_config.json").write_text(json.dumps(generation))
    engine = LoopedSpecEngine(str(folder), device="cpu", speculation="off")
    assert engine.adapter.eos_token_ids == [other, stop]
    out = engine.generate([5, 9, 13], SamplingParams(max_tokens=8, temperature=0.0))[0]
    assert out.token_ids == continuation[: continuation.index(stop) + 1] and out.finish_reason == "stop"
    request = engine._new_request([5, 9, 13], SamplingParams(max_tokens=4), None)
    assert (request.temperature, request.top_k, request.top_p) == (0.7, 5, 1.0)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": "x"}))
    with pytest.raises(CheckpointError, match="generation_config.json"):
        load_adapter(folder, device="cpu")


def test_item11_shipped_huginn_carries_the_original_freqs_cis_buffer():
    from safetensors import safe_open

    from looped_spec.adapters.huginn import reference_freqs_cis

    folder = shipped_model_path("tiny-huginn")
    config = json.loads((folder / "config.json").read_text())
    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        assert "freqs_cis" in handle.keys()
        stored = handle.get_tensor("freqs_cis")
    # the original code's layout, [1, block_size, 1, head_dim / 2, (cos, sin)], as the Huginn fixture stores it
    fixture = load_file(str(fixture_dir("huginn") / "model.safetensors"))["freqs_cis"]
    assert stored.shape == (1, config["block_size"], 1, config["n_embd"] // config["n_heads"] // 2, 2)
    assert fixture.shape[0::2] == stored.shape[0::2] and torch.isfinite(stored).all()
    torch.testing.assert_close(stored, reference_freqs_cis(config))
    torch.testing.assert_close(
        reference_freqs_cis(json.loads((fixture_dir("huginn") / "config.json").read_text())), fixture
    )


# ----- 12. accepted options are acted on, or refused -----
def test_item12_ouro_early_exit_threshold_below_one_is_used(tmp_path):
    """Issue 13: the checkpoint's early_exit_threshold is the default exit rule, with or without speculation
    (the same tokens and depths either way), never ignored."""
    folder = copy_model(tmp_path, fixture_dir("ouro"))
    edit_config(folder, early_exit_threshold=0.3)
    adapter = load_adapter(folder, device="cpu")
    assert adapter.default_exit_threshold == 0.3
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    out = LoopedSpecEngine(adapter, speculation="off").generate([[5, 6, 7]], params)[0]
    assert min(out.metrics.exit_depth_histogram) < adapter.full_depth
    spec = LoopedSpecEngine(adapter, speculation="2,1").generate([[5, 6, 7]], params)[0]
    assert (spec.token_ids, spec.metrics.exit_depth_histogram) == (out.token_ids, out.metrics.exit_depth_histogram)
    edit_config(folder, early_exit_threshold=0.0)
    with pytest.raises(CheckpointError, match="early_exit_threshold"):
        load_adapter(folder, device="cpu")


def test_item06_text_prompts_must_be_valid_unicode():
    engine = LoopedSpecEngine("tiny-ouro", speculation="off")
    with pytest.raises(ValueError, match=r"prompt: not valid Unicode text \(surrogates not allowed at character 3\)"):
        engine.add_request("abc\ud800", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"prompts\[1\]: not valid Unicode"):
        engine.generate(["fine", "\udfff"], SamplingParams(max_tokens=2))
    assert not engine.has_unfinished_requests()


def test_options_over_a_config_keep_what_it_was_given():
    """`LoopedSpecEngine(model, config, **options)`: the config's defaults are not options it was given (plain over
    a default config is fine), while a policy it was given still needs adaptive speculation."""
    from looped_spec.engine.config import EngineConfig

    assert EngineConfig.from_options(EngineConfig(), speculation="off").speculation == "off"
    adaptive = EngineConfig(speculation="adaptive", policy="ema")
    assert EngineConfig.from_options(adaptive, max_batch_size=4).policy == "ema"
    with pytest.raises(ValueError, match="policy='ema': only with speculation='adaptive'"):
        EngineConfig.from_options(adaptive, speculation="off")


def test_a_rejected_request_leaves_the_engine_seed_where_it_was():
    """`add_request` draws a request's seed from the engine seed; one it rejects (after the draw: a grammar that does
    not compile, a reasoning gate out of the vocabulary) leaves the engine as it was, so the next unseeded request
    samples as if the rejected one had never been sent (the mutation check: it sampled other tokens)."""
    from looped_spec.structured_output import StructuredOutputs

    sampled = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    outputs = []
    for rejected in ([], [StructuredOutputs(regex="(")]):
        engine = make_engine("ouro", speculation="off", seed=1)
        for grammar in rejected:
            with pytest.raises(ValueError, match="structured_outputs"):
                engine.add_request([5, 9], SamplingParams(structured_outputs=grammar))
        outputs.append(engine.generate([5, 9, 13], sampled)[0].token_ids)
    assert outputs[0] == outputs[1]
    # a generate() call is rejected whole (its valid prompts drew seeds before the bad one was found): the same
    engine = make_engine("ouro", speculation="off", seed=1)
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        engine.generate([[5, 9], [10**6]], sampled)
    assert engine.generate([5, 9, 13], sampled)[0].token_ids == outputs[0]


def test_token_id_prompts_take_any_integer_type_and_name_the_id_that_is_not_one():
    """numpy's integers are token ids, as they are seeds, stop_token_ids and score's ids (a list of them was read as a
    list of prompts, each "got int64"); in a list of ids one that is not an integer is named by its index (it was
    "prompts[0] must be a string, ... got int", the list read as prompts)."""
    import numpy as np

    engine = make_engine("ouro")
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    expected = engine.generate([5, 9, 13], params)[0].token_ids
    ids = list(np.array([5, 9, 13]))
    assert engine.generate(ids, params)[0].token_ids == expected
    assert engine.generate([ids], params)[0].token_ids == expected
    out = engine.generate({"prompt_token_ids": ids}, params)[0]
    assert out.token_ids == expected and type(out.prompt_token_ids[0]) is int
    for prompt, named in (([5, 9.0], r"prompts\[0\]\[1\] = 9.0"), ([True, 5], r"prompts\[0\]\[0\] = True"),
                          ([np.int64(5), np.float32(2)], r"prompts\[0\]\[1\] = \S*2\.0\S*")):  # fmt: skip
        with pytest.raises(TypeError, match=named + " is not an int token id"):
            engine.generate(prompt, params)
    assert not engine.has_unfinished_requests()


def test_prompts_of_no_kind_the_engine_takes_are_named():
    engine = make_engine("ouro")
    params = SamplingParams(max_tokens=3)
    for prompts, error, named in (([], ValueError, "prompts is empty"),
                                  (7, TypeError, "prompts must be a string, token ids, a prompt dict, or a list of "
                                   "those; got int"),
                                  ([[5, 9], 3.5], TypeError, r"prompts\[1\] must be a string, a list of token ids or "
                                   "a prompt dict; got float")):  # fmt: skip
        with pytest.raises(error, match=named):
            engine.generate(prompts, params)
    assert not engine.has_unfinished_requests()


def test_a_prompt_must_leave_room_to_generate_within_max_model_len():
    """A prompt of max_model_len tokens leaves no position to generate into: an error naming the prompt and the limit
    (one token shorter is taken and generates up to the limit)."""
    engine = make_engine("ouro", max_model_len=16)
    with pytest.raises(ValueError, match=r"^prompts\[1\] has 16 tokens; max_model_len=16 leaves no room to generate"):
        engine.generate([[5] * 4, [5] * 16], SamplingParams(max_tokens=4))
    out = engine.generate([5] * 15, SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert (len(out.token_ids), out.finish_reason) == (1, "length")
