"""Incremental detokenisation (no split characters), stop strings, and generation_config defaults."""

from __future__ import annotations

import json

import pytest

from looped_spec.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from looped_spec.engine.chat import NoChatTemplateError, render_chat
from looped_spec.engine.inputs import load_tokenizer
from looped_spec.models import shipped_model_path
from looped_spec.models.checkpoint import CheckpointError
from looped_spec.server.chat import GenerationDefaults

TEXT = "héllo wörld → ∑ 😀 done"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(shipped_model_path("tiny-ouro"))


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], bool]:
    deltas, stopped = [], False
    for token in ids:
        stopped = detok.append(token)
        deltas.append(detok.stream_delta(finished=stopped))
        if stopped:
            break
    if not stopped:
        detok.flush()
        deltas.append(detok.stream_delta(finished=True))
    return deltas, stopped


def test_deltas_never_split_a_character(tokenizer):
    ids = tokenizer.encode(TEXT)
    # the byte-level tokenizer really does split these characters across tokens
    assert any(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in ids)
    deltas, stopped = stream(IncrementalDetokenizer(tokenizer), ids)
    assert not stopped
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
    assert "".join(deltas) == TEXT == tokenizer.decode(ids)


def test_several_tokens_per_step_as_in_a_speculative_round(tokenizer):
    ids = tokenizer.encode(TEXT)
    detok, deltas = IncrementalDetokenizer(tokenizer), []
    for start in range(0, len(ids), 3):
        for token in ids[start : start + 3]:
            assert not detok.append(token)
        deltas.append(detok.stream_delta(finished=False))
    detok.flush()
    deltas.append(detok.stream_delta(finished=True))
    assert all(REPLACEMENT_CHAR not in d for d in deltas) and "".join(deltas) == TEXT


def test_incomplete_trailing_character_is_flushed_at_the_end(tokenizer):
    ids = tokenizer.encode("ok 😀")
    cut = ids[:-1]  # the emoji's last byte is missing
    deltas, _ = stream(IncrementalDetokenizer(tokenizer), cut)
    assert "".join(deltas) == tokenizer.decode(cut)
    # a stop string the flushed U+FFFD completes still cuts the text (and the flush says so)
    detok = IncrementalDetokenizer(tokenizer, stop=[" " + REPLACEMENT_CHAR])
    assert not any(detok.append(t) for t in cut)
    assert detok.flush() and detok.text == "ok" and detok.stop_hit == " " + REPLACEMENT_CHAR


def test_stop_string_cuts_text_and_holds_back_partial_matches(tokenizer):
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer, stop=["∑ 😀"])
    deltas, stopped = stream(detok, ids)
    assert stopped and detok.stop_hit == "∑ 😀"
    assert "".join(deltas) == detok.text == "héllo wörld → "
    # the stop string was found at the token that completed it
    assert "∑ 😀" in tokenizer.decode(detok.token_ids) and "∑ 😀" not in tokenizer.decode(detok.token_ids[:-1])
    # a stop string that never completes: held-back text comes out at the end
    deltas, stopped = stream(IncrementalDetokenizer(tokenizer, stop=["done!"]), ids)
    assert not stopped and "".join(deltas) == TEXT


def test_generation_config_defaults(tmp_path, tokenizer):
    """One reading of generation_config.json for offline requests and the server (HF's meaning): sampling settings
    apply with do_sample: true; a file without it asks for greedy decoding; without a file nothing is asked."""
    from looped_spec.models.generation_config import read_generation_config

    assert GenerationDefaults.load(tmp_path).temperature == 1.0  # OpenAI's default without the file
    file = {
        "temperature": 0.6,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.1,
        "eos_token_id": [7, 9],
    }
    (tmp_path / "generation_config.json").write_text(json.dumps(file))
    defaults = GenerationDefaults.load(tmp_path)
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.min_p) == (0.0, 1.0, 0, 0.0)  # greedy
    assert defaults.repetition_penalty == 1.1  # a logits processor in HF: greedy decoding applies it too
    assert read_generation_config(tmp_path).stop_token_ids() == [7, 9]  # the engine's eos tokens (with the tokenizer's)
    (tmp_path / "generation_config.json").write_text(json.dumps(file | {"do_sample": True}))
    defaults = GenerationDefaults.load(tmp_path)
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.min_p) == (0.6, 0.9, 20, 0.05)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": False, "eos_token_id": 7}))
    assert GenerationDefaults.load(tmp_path).temperature == 0.0
    # do_sample: true without a temperature samples at HF's default, 1 (it decoded greedily at this engine's 0)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "top_p": 0.9}))
    assert read_generation_config(tmp_path).sampling_defaults() == {"temperature": 1.0, "top_p": 0.9}


def test_generation_settings_not_implemented_are_named_in_a_warning(tmp_path, caplog):
    """HF settings that change what `generate` produces and that looped-spec does not run are never dropped silently;
    their no-op values (or null, as recent transformers writes them) say nothing."""
    from looped_spec.models.generation_config import read_generation_config

    file = {"num_beams": 4, "min_new_tokens": 5, "suppress_tokens": [3], "typical_p": None, "epsilon_cutoff": 0.0,
            "renormalize_logits": False, "no_repeat_ngram_size": 0, "temperature": 0.7}  # fmt: skip
    (tmp_path / "generation_config.json").write_text(json.dumps(file))
    with caplog.at_level("WARNING", logger="looped_spec.models.generation_config"):
        read_generation_config(tmp_path)
    named = sorted(record.getMessage().split(": ")[1].split("=")[0] for record in caplog.records)
    assert named == ["min_new_tokens", "num_beams", "suppress_tokens"]


def test_offline_requests_and_the_server_read_generation_config_alike(tmp_path):
    """The same file gives an offline request and a server request that set nothing the same sampling settings."""
    import shutil

    from looped_spec import LoopedSpecEngine, SamplingParams
    from looped_spec.engine.async_engine import AsyncLoopedSpecEngine
    from looped_spec.models import shipped_model_path
    from looped_spec.server.protocol import CompletionRequest
    from looped_spec.server.serving import OpenAIServing

    for file in (
        {"temperature": 0.6, "top_k": 20},
        {"do_sample": True, "temperature": 0.6, "top_p": 0.8, "min_p": 0.1},
    ):
        folder = tmp_path / str(len(file))
        shutil.copytree(shipped_model_path("tiny-nanbeige"), folder)
        (folder / "generation_config.json").write_text(json.dumps(file))
        engine = LoopedSpecEngine(str(folder), speculation="off")
        offline = engine._new_request([1, 2, 3], SamplingParams(max_tokens=4), None)
        serving = OpenAIServing(AsyncLoopedSpecEngine(engine), "m")
        served = serving.sampling_params(CompletionRequest(model="m", prompt="x"), 1, 4)
        settings = lambda p: (p.temperature, p.top_k, p.top_p, p.min_p)  # noqa: E731
        assert (offline.temperature, offline.top_k, offline.top_p, offline.min_p) == settings(served), file
        assert served.min_p == file.get("min_p", 0.0)


def test_get_default_sampling_params_are_the_checkpoints_as_vllms_llm_gives_them(tmp_path):
    """vLLM's `llm.get_default_sampling_params()` (its offline examples start from it): the checkpoint's
    generation_config.json sampling defaults as SamplingParams, which sample as a request that leaves them unset does;
    SamplingParams() without the file."""
    import shutil

    from looped_spec import LoopedSpecEngine, SamplingParams
    from looped_spec.models import shipped_model_path

    assert LoopedSpecEngine("tiny-nanbeige", speculation="off").get_default_sampling_params() == SamplingParams()
    folder = tmp_path / "sampling"
    shutil.copytree(shipped_model_path("tiny-nanbeige"), folder)
    file = {"do_sample": True, "temperature": 0.6, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 5}
    (folder / "generation_config.json").write_text(json.dumps(file))
    engine = LoopedSpecEngine(str(folder), speculation="off")
    defaults = engine.get_default_sampling_params()
    assert defaults == SamplingParams(temperature=0.6, top_k=20, repetition_penalty=1.1, max_tokens=5)
    prompts = [[1, 2, 3], [4, 5]]
    unset = engine.generate(prompts, [SamplingParams(seed=s) for s in (1, 2)])
    given = engine.generate(prompts, [defaults.model_copy(update={"seed": s}) for s in (1, 2)])
    assert [o.token_ids for o in given] == [o.token_ids for o in unset]


def test_a_sampling_filter_given_while_decoding_greedily_is_an_error(tmp_path):
    """top_k / top_p / min_p with the temperature left unset: this engine's default temperature is 0 (vLLM's 1), so
    they would do nothing; an error naming the filter, where a vLLM script would sample. A temperature given (0 as
    well: vLLM takes it), or a checkpoint whose generation_config.json samples, takes them."""
    import shutil

    from looped_spec import LoopedSpecEngine, SamplingParams
    from looped_spec.models import shipped_model_path

    engine = LoopedSpecEngine("tiny-nanbeige", speculation="off")
    for field, value in (("top_p", 0.9), ("top_k", 5), ("min_p", 0.1)):
        with pytest.raises(ValueError, match=f"{field}={value}: the temperature is unset, so the request decodes "
                                             "greedily"):  # fmt: skip
            engine.generate([1, 2, 3], SamplingParams(max_tokens=2, **{field: value}))
    for params in (SamplingParams(max_tokens=2, top_p=0.9, temperature=0.0),  # vLLM takes it: greedy, as asked
                   SamplingParams(max_tokens=2, top_p=0.9, temperature=1.0, seed=1),
                   SamplingParams(max_tokens=2, top_p=1.0, top_k=-1, min_p=0.0)):  # fmt: skip
        assert len(engine.generate([1, 2, 3], params)[0].token_ids) == 2
    folder = tmp_path / "sampling"
    shutil.copytree(shipped_model_path("tiny-nanbeige"), folder)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 0.7}))
    sampling = LoopedSpecEngine(str(folder), speculation="off")
    assert len(sampling.generate([1, 2, 3], SamplingParams(max_tokens=2, top_p=0.9, seed=1))[0].token_ids) == 2
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": False, "temperature": 0.7}))
    with pytest.raises(ValueError, match="top_p=0.9: the temperature is unset"):
        LoopedSpecEngine(str(folder), speculation="off").generate([1, 2, 3], SamplingParams(max_tokens=2, top_p=0.9))


def test_generation_config_max_new_tokens_is_the_default_max_tokens(tmp_path):
    """vLLM reads generation_config.json's max_new_tokens (HF's name) as the default max_tokens: offline for a request
    that leaves max_tokens unset, on the server as the cap of one that leaves it out, and on the command line."""
    import shutil

    from looped_spec import LoopedSpecEngine, SamplingParams
    from looped_spec.cli.generate import checkpoint_max_tokens
    from looped_spec.engine.async_engine import AsyncLoopedSpecEngine
    from looped_spec.models import shipped_model_path
    from looped_spec.server.protocol import ChatCompletionRequest, CompletionRequest
    from looped_spec.server.serving import OpenAIServing

    folder = tmp_path / "capped"
    shutil.copytree(shipped_model_path("tiny-nanbeige"), folder)
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 5}))
    engine = LoopedSpecEngine(str(folder), speculation="off")
    out = engine.generate([1, 2, 3], SamplingParams(temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5 and out.finish_reason == "length"
    given = engine.generate([1, 2, 3], SamplingParams(max_tokens=7, ignore_eos=True))[0]
    assert len(given.token_ids) == 7  # the request's own value wins
    with pytest.raises(ValueError, match="min_tokens=6 is more than max_tokens=5, the checkpoint's generation_config"):
        engine.generate([1, 2, 3], SamplingParams(min_tokens=6))
    serving = OpenAIServing(AsyncLoopedSpecEngine(engine), "m")
    assert serving.completion_tokens(CompletionRequest(model="m", prompt="x")) == 5  # OpenAI's 16, within the cap
    assert serving.completion_tokens(CompletionRequest(model="m", prompt="x", max_tokens=9)) == 9
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}])
    assert serving.sampling_params(chat, 3, None).max_tokens == 5  # left out: the context's room, within the cap
    assert checkpoint_max_tokens(str(folder)) == 5 and checkpoint_max_tokens("tiny-nanbeige") is None
    (folder / "generation_config.json").write_text(json.dumps({"max_new_tokens": 0}))
    with pytest.raises(CheckpointError, match="max_new_tokens"):
        LoopedSpecEngine(str(folder), speculation="off")


def test_render_chat(tokenizer):
    prompt = render_chat(tokenizer, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    assert prompt == "# user: hi\n# assistant: yo<|endoftext|>\n# assistant:"
    with pytest.raises(NoChatTemplateError, match="chat_template"):
        render_chat(load_tokenizer(shipped_model_path("tiny-nanbeige")), [{"role": "user", "content": "hi"}])


def test_a_stop_completed_at_the_flush_ends_a_length_finish_as_stop_but_never_an_abort(tokenizer):
    from types import SimpleNamespace

    from looped_spec.engine.outputs import request_output

    ids = tokenizer.encode("ok 😀")[:-1]  # ends inside a character: its U+FFFD appears only at the flush
    cases = [("length", 0, "stop", "ok"), ("abort", 0, "abort", "ok"), ("error", 0, "error", "ok"),
             # a length finish short of min_tokens (the context ran out): stop strings are not looked for yet
             ("length", len(ids) + 1, "length", tokenizer.decode(ids)),
             # ... or just reaching it: the flushed text is the last token's, the min_tokens-th
             ("length", len(ids), "length", tokenizer.decode(ids))]  # fmt: skip
    for reason, min_tokens, expected, text in cases:
        detok = IncrementalDetokenizer(tokenizer, stop=[" " + REPLACEMENT_CHAR])
        assert not any(detok.append(t) for t in ids)
        request = SimpleNamespace(
            request_id="r", detokenizer=detok, finished=True, finish_reason=reason, output_token_ids=ids,
            num_emitted=0, token_ids=ids, num_prompt_tokens=0, metrics=None, prompt_text=None, error=None,
            logprobs_top=None, logprobs=[], num_output_tokens=len(ids), min_tokens=min_tokens, prompt_logprobs=None,
        )  # fmt: skip
        out = request_output(request)
        assert (out.finish_reason, out.text) == (expected, text), reason
        # the stop string the flush completed is what ended a "length" finish; an abort or error it did not end
        assert out.stop_reason == (" " + REPLACEMENT_CHAR if expected == "stop" else None), reason


@pytest.mark.parametrize("stop", [[], ["\n"]])
def test_generate_returns_each_output_whole_and_stepping_streams_the_same_text(tokenizer, stop):
    """`generate` returns one output per request, so what is new in it is all of it; its text is what stepping the
    same requests streams, delta by delta (several tokens a round under speculation)."""
    from looped_spec import LoopedSpecEngine, SamplingParams

    prompts = ["def fibonacci(n):", "The weather today", "import os\nimport sys\n"]
    params = SamplingParams(max_tokens=24, stop=stop)
    engine = LoopedSpecEngine("tiny-ouro", speculation="2,1")
    outputs = engine.generate(prompts, params)
    assert all(o.new_token_ids == o.token_ids and o.new_text == o.text for o in outputs)
    if not stop:
        assert [o.text for o in outputs] == [tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outputs]
    ids = [engine.add_request(p, params) for p in prompts]
    streamed = dict.fromkeys(ids, "")
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed[out.request_id] += out.new_text
    assert [streamed[i] for i in ids] == [o.text for o in outputs]


def test_a_null_do_sample_is_read_as_not_sampling(tmp_path):
    """transformers 5 writes the fields a GenerationConfig leaves unset as null (`to_json_file(use_diff=False)`), a
    greedy one's `"do_sample": null` among them: the file was refused ("do_sample Input should be a valid boolean")
    and so was the checkpoint. null is HF's default, no sampling."""
    from looped_spec.models.generation_config import read_generation_config

    file = {"do_sample": None, "temperature": 0.7, "top_k": None, "max_new_tokens": None, "eos_token_id": 7}
    (tmp_path / "generation_config.json").write_text(json.dumps(file))
    config = read_generation_config(tmp_path)
    assert config.sampling_defaults() == {"temperature": 0.0} and config.stop_token_ids() == [7]


@pytest.mark.parametrize("eos", [True, "2", [2, False]])
def test_a_generation_config_eos_token_id_not_an_integer_is_named(tmp_path, eos):
    """generation_config.json's eos_token_id went through pydantic's lax int: `true` became a stop on token 1 and "2"
    on token 2, where config.json's eos_token_id of the same value is an error. It is an error naming the file and the
    field here too."""
    from looped_spec.models.checkpoint import CheckpointError
    from looped_spec.models.generation_config import read_generation_config

    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: .*eos_token_id=.* must be a token id"):
        read_generation_config(tmp_path)


@pytest.mark.parametrize(
    "field, value", [("do_sample", "no"), ("temperature", "0.7"), ("top_k", 2.5), ("max_new_tokens", "16")]
)
def test_a_generation_config_value_of_the_wrong_json_type_is_named(tmp_path, field, value):
    """transformers reads generation_config.json's values as JSON types: "no" is a truthy string, not false, and "0.7"
    no temperature. pydantic's lax reading took "no" for false (greedy where HF samples) and "0.7" for 0.7; each is an
    error naming the file and the field, without pydantic's links."""
    from looped_spec.models.checkpoint import CheckpointError
    from looped_spec.models.generation_config import read_generation_config

    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, field: value}))
    with pytest.raises(CheckpointError, match=rf"generation_config\.json: {field}: ") as info:
        read_generation_config(tmp_path)
    assert "pydantic" not in str(info.value)
    (tmp_path / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 1, "top_k": 5}))
    assert read_generation_config(tmp_path).sampling_defaults()["temperature"] == 1.0  # an integer is a number


def test_the_text_is_cut_before_the_first_stop_string_one_token_completes(tokenizer):
    """A token whose text completes two stop strings: the text ends before the one that occurs first, so it holds
    none (whatever their order in the list, or which of them ends first)."""
    ids = tokenizer.encode("Say the word")
    assert tokenizer.decode(ids[3:4]) == " the"  # one token brings both "t" and "he"
    detok = IncrementalDetokenizer(tokenizer, stop=["he", "t"])
    deltas, stopped = stream(detok, ids)
    assert stopped and detok.stop_hit == "t"
    assert "".join(deltas) == detok.text == "Say "


@pytest.mark.parametrize(("stop", "held"), [([], 0), (["\n"], 0), (["\n", "word!"], 4)])
def test_streaming_holds_back_one_character_less_than_the_longest_stop_string(tokenizer, stop, held):
    """Text that a later token may still turn into a stop string is held back, and only that much: with one-character
    stop strings every delta is all the text decoded so far."""
    ids = tokenizer.encode("Say the word")
    detok, sent = IncrementalDetokenizer(tokenizer, stop=stop), ""
    for i, token in enumerate(ids):
        assert not detok.append(token)
        sent += detok.stream_delta(finished=False)
        text = tokenizer.decode(ids[: i + 1])
        assert sent == text[: max(0, len(text) - held)]


def test_a_prompt_ending_inside_a_character_leaves_the_output_the_text_of_its_own_tokens(tokenizer):
    """Decode windows start in the prompt's last tokens, unless those end inside a character: the output's text is
    then what its own tokens decode to (a U+FFFD where it completes the prompt's character), as the module says."""
    ids = tokenizer.encode("ok 😀 done")
    prompt, output = ids[:5], ids[5:]
    assert tokenizer.decode(prompt).endswith(REPLACEMENT_CHAR)  # the emoji's last byte is the output's first token
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    deltas, stopped = stream(detok, output)
    assert not stopped and "".join(deltas) == detok.text == tokenizer.decode(output)
