"""Plain decoding through LoopedSpecEngine: exactness, batching, limits, preemption, bad input."""

from __future__ import annotations

import time
from dataclasses import fields

import pytest
from conftest import FAMILIES, adapter_options, fixture_dir, make_engine, reference
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from looped_spec import EngineConfig, LoopedSpecEngine, SamplingParams, load_adapter
from looped_spec.engine.stats import EngineStats

FILLER = [[9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11], [40, 41], [100, 3, 3, 3, 77]]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


@pytest.mark.parametrize("family", FAMILIES)
def test_fixture_greedy_alone_and_batched(family):
    ref = reference(family)
    engine = make_engine(family)
    for prompt, expected in zip(ref["prompts"], ref["greedy"]):
        out = engine.generate(prompt, greedy(len(expected["tokens"])))[0]
        assert out.token_ids == expected["tokens"]
        assert out.finish_reason == "length"
    prompts = FILLER[:1] + ref["prompts"] + FILLER[1:]
    params = [greedy(7)] + [greedy(len(g["tokens"])) for g in ref["greedy"]] + [greedy(13), greedy(3)]
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs[1:3]] == [g["tokens"] for g in ref["greedy"]]
    assert engine.num_free_blocks == engine.kv.num_blocks


def test_checkpoint_path_api_matches_fixture():
    ref = reference("huginn")
    engine = LoopedSpecEngine(
        str(fixture_dir("huginn")),
        dtype="float32",
        device="cpu",
        speculation="off",
        adapter_options=adapter_options("huginn"),
    )
    out = engine.generate(ref["prompts"][1], greedy(20))[0]
    assert out.token_ids == ref["greedy"][1]["tokens"]


def test_engine_config_object_and_keyword_options():
    """`config=EngineConfig(...)` and keyword options are one configuration; keywords override the object."""
    config = EngineConfig(speculation="off", max_batch_size=2, block_size=4)
    engine = LoopedSpecEngine(str(fixture_dir("ouro")), config, max_batch_size=3, device="cpu")
    assert engine.config.max_batch_size == 3 and engine.config.block_size == 4 and engine.kv.block_size == 4
    assert engine.config.speculation == "off" and config.max_batch_size == 2
    with pytest.raises(ValidationError, match="max_num_batched_tokenz"):
        EngineConfig(max_num_batched_tokenz=3)


def test_generate_and_chat_take_sampling_params_by_vllms_name_and_by_the_older_one():
    """`sampling_params=` as vLLM's `LLM.generate` / `LLM.chat` name it; `params=`, this engine's older keyword, still
    taken; both at once an error. SamplingParams takes vLLM's single stop string, and names a field it lacks."""
    engine = make_engine("ouro")
    want = engine.generate([5, 9, 13], greedy(5))[0].token_ids
    assert engine.generate([5, 9, 13], sampling_params=greedy(5))[0].token_ids == want
    assert engine.generate([5, 9, 13], params=greedy(5))[0].token_ids == want
    with pytest.raises(TypeError, match="sampling_params and params: give one"):
        engine.generate([5, 9, 13], sampling_params=greedy(5), params=greedy(5))
    with pytest.raises(ValueError, match=r"sampling_params: 2 SamplingParams for 1 prompts"):
        engine.generate([5, 9, 13], sampling_params=[greedy(5), greedy(5)])
    assert SamplingParams(stop="\n").stop == ["\n"] and SamplingParams(stop=["a", "b"]).stop == ["a", "b"]
    with pytest.raises(ValidationError, match=r"top_pp: not a SamplingParams field \(did you mean 'top_p'\?\)"):
        SamplingParams(top_pp=0.5)
    with pytest.raises(ValidationError, match="n=2: one output per request here"):
        SamplingParams(n=2)


def test_an_output_reads_as_vllms_with_its_one_completion_output():
    """`out.outputs[0]` as vLLM's CompletionOutput: the same text, tokens, finish and stop reasons; the
    log-probabilities' sum with `logprobs`, else None."""
    engine = make_engine("ouro")
    out = engine.generate([5, 9, 13], greedy(6, logprobs=1))[0]
    (completion,) = out.outputs
    assert (completion.index, completion.token_ids, completion.finish_reason) == (0, out.token_ids, "length")
    assert completion.text == "" and out.text is None  # a model without a tokenizer: ids only
    assert completion.stop_reason is None and completion.logprobs == out.logprobs
    assert completion.cumulative_logprob == pytest.approx(sum(entry.logprob for entry in out.logprobs))
    assert engine.generate([5, 9, 13], greedy(2))[0].outputs[0].cumulative_logprob is None
    with LoopedSpecEngine("tiny-ouro", speculation="off") as texts:  # with a tokenizer: the text
        out = texts.generate("def add(a, b):", greedy(4))[0]
        assert out.outputs[0].text == out.text and out.text


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_equals_sequential_with_seeded_sampling(family):
    prompts = FILLER + reference(family)["prompts"]
    params = [
        SamplingParams(max_tokens=9, temperature=0.9, top_k=20, top_p=0.9, seed=100 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    alone = [make_engine(family).generate(p, sp)[0].token_ids for p, sp in zip(prompts, params)]
    batched = [o.token_ids for o in make_engine(family, max_batch_size=3).generate(prompts, params)]
    assert alone == batched


def test_unseeded_requests_follow_engine_seed():
    prompts = FILLER
    params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    a = [o.token_ids for o in make_engine("ouro", seed=3).generate(prompts, params)]
    b = [o.token_ids for o in make_engine("ouro", seed=3).generate(prompts, params)]
    assert a == b


def test_stop_tokens_and_eos():
    ref = reference("ouro")
    engine = make_engine("ouro")
    expected = ref["greedy"][1]["tokens"]  # 119, 19, 19, ...
    out = engine.generate(ref["prompts"][1], greedy(20, stop_token_ids=[37]))[0]
    assert out.token_ids == expected[: expected.index(37) + 1] and out.finish_reason == "stop"
    assert out.stop_reason == 37 == out.outputs[0].stop_reason  # the stop token named, as vLLM reports it
    # the same stop token as the last token max_tokens allows: the stop ended it, not the length
    last = engine.generate(ref["prompts"][1], greedy(expected.index(37) + 1, stop_token_ids=[37]))[0]
    assert (last.token_ids, last.finish_reason, last.stop_reason) == (out.token_ids, "stop", 37)
    # the ouro fixture's eos id is 0; a prompt continuing into eos stops unless ignore_eos
    eos_engine = make_engine("nanbeige")
    eos = eos_engine.adapter.eos_token_ids[0]
    target = reference("nanbeige")["greedy"][0]["tokens"]
    eos_engine.adapter.config["eos_token_id"] = target[2]
    try:
        out = eos_engine.generate(reference("nanbeige")["prompts"][0], SamplingParams(max_tokens=20))[0]
        assert out.token_ids == target[:3] and out.finish_reason == "stop" and out.stop_reason is None  # an eos
    finally:
        eos_engine.adapter.config["eos_token_id"] = eos


def test_an_eos_named_in_stop_token_ids_under_ignore_eos_is_the_stop_reason():
    """With ignore_eos the eos ends the request only as a stop_token_ids token, so vLLM reports it (its eos check is
    skipped); without ignore_eos it stops as the eos (None)."""
    engine = make_engine("ouro")
    eos = engine.adapter.eos_token_ids[0]
    for ignore_eos, expected in ((True, eos), (False, None)):
        params = SamplingParams(max_tokens=5, ignore_eos=ignore_eos, stop_token_ids=[eos], logit_bias={eos: 100})
        out = engine.generate([1, 2, 3], params)[0]
        assert (out.token_ids, out.finish_reason) == ([eos], "stop")
        assert out.stop_reason == expected == out.outputs[0].stop_reason, ignore_eos


def test_max_tokens_and_max_model_len():
    engine = make_engine("ouro", max_model_len=12)
    out = engine.generate([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], greedy(50))[0]
    assert len(out.token_ids) == 2 and out.finish_reason == "length"


@pytest.mark.parametrize("speculation", ["off", "3,1"])
def test_max_tokens_none_generates_what_max_model_len_leaves(speculation):
    """vLLM's `SamplingParams(max_tokens=None)`: no cap of the request's own, so it stops at max_model_len ("length"),
    as one with a large max_tokens does; min_tokens still applies."""
    engine = make_engine("ouro", max_model_len=24, speculation=speculation)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    uncapped = engine.generate(prompt, greedy(None, min_tokens=5))[0]
    assert uncapped.finish_reason == "length" and len(uncapped.token_ids) == 14
    assert uncapped.token_ids == engine.generate(prompt, greedy(100))[0].token_ids


def test_a_round_with_room_for_one_more_token_drafts_none():
    """A speculative round commits at most its drafts and one more token: with one token left (of max_model_len or of
    max_tokens) it drafts nothing, rather than drafts counted as proposed past the request's end."""
    for options, max_tokens in (({"max_model_len": 12}, 50), ({}, 2)):
        engine = make_engine("ouro", speculation="3,1", **options)
        out = engine.generate([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], greedy(max_tokens))[0]
        assert len(out.token_ids) == 2 and out.finish_reason == "length"  # the prefill's token, then one round's
        assert (out.metrics.rounds, out.metrics.num_draft_tokens, engine.stats.num_draft_tokens) == (1, 0, 0)


def test_online_api_and_abort():
    engine = make_engine("nanbeige")
    first = engine.add_request([1, 2, 3], greedy(30))
    second = engine.add_request([4, 5, 6], greedy(5))
    seen: dict[str, list[int]] = {}
    for _ in range(3):
        for out in engine.step():
            seen[out.request_id] = out.token_ids
    assert sorted(engine.request_ids()) == sorted([first, second])
    engine.abort(first)
    assert sorted(engine.request_ids()) == sorted([first, second])  # aborted: held until its output is returned
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert finished[first].finish_reason == "abort" and len(finished[first].token_ids) < 30
    assert finished[second].finish_reason == "length" and len(finished[second].token_ids) == 5
    assert engine.num_free_blocks == engine.kv.num_blocks and engine.request_ids() == []
    # counted by finish reason, as vLLM's request_success (an abort was counted nowhere)
    assert engine.stats.finished_reasons == {"abort": 1, "length": 1} and engine.stats.num_requests_finished == 1
    assert 'request_success_total{finished_reason="abort",model_name="m"} 1.0' in engine.stats.to_prometheus("m")
    with pytest.raises(KeyError, match="unknown request_id 'nope'"):
        engine.abort("nope")


@pytest.mark.parametrize("family", FAMILIES)
def test_kv_exhaustion_preempts_and_recomputes(family):
    prompts = [list(range(1 + i, 12 + i)) for i in range(8)]
    params = greedy(24)
    expected = [o.token_ids for o in make_engine(family).generate(prompts, params)]
    # each request needs ceil(35 / 4) = 9 blocks; 8 requests need 72, the cache holds 24
    engine = make_engine(family, block_size=4, num_kv_blocks=24, max_num_batched_tokens=16, max_model_len=64)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == expected
    assert engine.scheduler.num_preemptions > 0
    assert engine.num_free_blocks == engine.kv.num_blocks


def test_kv_cache_of_one_max_length_request_is_enough():
    """A request's KV never covers more than max_model_len tokens (drafts included): a cache of exactly
    ceil(max_model_len / block_size) blocks runs requests to max_model_len, speculating; one block fewer is
    refused at construction."""
    prompts = [list(range(3, 30)), [5, 9, 13]]  # 27 + 5 = 32 tokens: the first ends at max_model_len
    options = {"block_size": 4, "max_model_len": 32, "max_num_batched_tokens": 12}
    expected = [o.token_ids for o in make_engine("ouro", **options).generate(prompts, greedy(40))]
    engine = make_engine("ouro", speculation="3,1", num_kv_blocks=8, max_batch_size=2, **options)
    outs = engine.generate(prompts, greedy(40))
    assert [o.token_ids for o in outs] == expected and outs[0].finish_reason == "length"
    assert engine.stats.num_spec_rounds > 0 and engine.num_free_blocks == 8
    with pytest.raises(ValueError, match=r"^num_kv_blocks=7 cannot hold one request .*give num_kv_blocks >= 8"):
        make_engine("ouro", num_kv_blocks=7, **options)
    with pytest.raises(ValueError, match=r"^kv_cache_memory_gb=1e-06 GiB \(0 blocks\).*kv_cache_memory_gb >= ") as err:
        make_engine("ouro", kv_cache_memory_gb=1e-6, **options)
    least = float(str(err.value).split("kv_cache_memory_gb >= ")[1].split(",")[0])
    assert make_engine("ouro", kv_cache_memory_gb=least, **options).kv.num_blocks >= 8  # the least it names works


def test_a_kv_cache_is_sized_in_whole_blocks_for_a_max_model_len_that_is_not():
    """max_model_len=30 in blocks of 4 tokens takes 8 blocks (the last one half used): 7 cannot hold a request of
    that length and are refused, 8 run one to max_model_len."""
    options = {"block_size": 4, "max_model_len": 30}
    with pytest.raises(ValueError, match=r"^num_kv_blocks=7 cannot hold one request .*give num_kv_blocks >= 8"):
        make_engine("ouro", num_kv_blocks=7, **options)
    prompt = list(range(3, 28))  # 25 + 5 = 30 tokens
    expected = make_engine("ouro", **options).generate([prompt], greedy(40))[0].token_ids
    out = make_engine("ouro", num_kv_blocks=8, **options).generate([prompt], greedy(40))[0]
    assert out.token_ids == expected and out.finish_reason == "length" and len(out.token_ids) == 5


def test_a_kv_cache_the_device_cannot_hold_is_an_error_naming_the_option():
    """torch's allocator error names neither the option nor the size; the engine's names both. The size asked for
    (~6e8 GiB) is past any address space, so no allocator hands it out whatever the machine's overcommit."""
    with pytest.raises(
        ValueError,
        match=r"^num_kv_blocks=1000000000: 1000000000 blocks of 65536 tokens \(.* GiB of "
        r"keys and values\) cannot be allocated on cpu .*; give fewer num_kv_blocks",
    ):
        make_engine("ouro", speculation="off", block_size=65536, num_kv_blocks=10**9)
    # past int64 elements torch.zeros raises a TypeError whose message is C++ stack frames
    with pytest.raises(ValueError, match=r"^num_kv_blocks=4611686018427387904: .*cannot be allocated on cpu \(more "
                       r"elements than a tensor holds\); give fewer num_kv_blocks"):  # fmt: skip
        make_engine("ouro", speculation="off", num_kv_blocks=2**62)


def test_a_kv_cache_memory_past_what_a_float_holds_in_bytes_is_what_a_full_batch_needs():
    """kv_cache_memory_gb is a ceiling: one past float range in bytes (1e300 GiB is inf bytes) sizes the cache as
    any large one does, to what max_batch_size requests of max_model_len need (it overflowed in int())."""
    engine = make_engine("ouro", speculation="off", kv_cache_memory_gb=1e300, max_batch_size=2, max_model_len=64)
    assert engine.kv.num_blocks == make_engine("ouro", speculation="off", kv_cache_memory_gb=1e3, max_batch_size=2,
                                               max_model_len=64).kv.num_blocks == 2 * 64 // 16  # fmt: skip


def test_a_text_prompt_encoding_outside_the_vocabulary_is_an_error_naming_it():
    """A tokenizer with more tokens than the model has embeddings: a text prompt holding one is refused as token ids
    are (it reached the embedding lookup, an IndexError there; on CUDA a device-side assert)."""
    engine = LoopedSpecEngine("tiny-ouro", speculation="off")
    engine.tokenizer.add_tokens(["<extra>"])
    extra = engine.adapter.vocab_size
    with pytest.raises(ValueError, match=rf"prompts\[0\]: its text encodes to token {extra}, outside the model's"):
        engine.generate("hi <extra>", greedy(2))
    assert not engine.has_unfinished_requests()


def test_a_chat_rendering_outside_the_vocabulary_is_an_error_naming_the_messages():
    """Offline chat as the server's: a conversation the template renders to a token past the vocabulary names the
    messages, not an index into the rendered ids the caller never saw (it said 'prompts[0][7] = 1024')."""
    engine = LoopedSpecEngine("tiny-ouro", speculation="off")
    engine.tokenizer.add_tokens(["<extra>"])
    extra = engine.adapter.vocab_size
    conversation = [{"role": "user", "content": "hi <extra>"}]
    with pytest.raises(ValueError, match=rf"^messages: its text encodes to token {extra}, outside the model's"):
        engine.chat(conversation, greedy(2))
    with pytest.raises(ValueError, match=rf"^messages\[1\]: its text encodes to token {extra}, outside the model's"):
        engine.chat([[{"role": "user", "content": "hi"}], conversation], greedy(2))
    assert not engine.has_unfinished_requests()


def test_bad_input_is_rejected_and_nothing_accepted_is_lost():
    engine = make_engine("ouro", max_model_len=32)
    keep = engine.add_request([1, 2, 3], greedy(4))
    with pytest.raises(ValueError, match="prompt is empty"):
        engine.add_request([], greedy(4))
    with pytest.raises(ValueError, match="max_model_len=32"):
        engine.add_request(list(range(1, 40)), greedy(4))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request([1, 999], greedy(4))
    with pytest.raises(ValueError, match=r"stop_token_ids\[1\] = 999 is outside the vocabulary"):
        engine.add_request([1, 2], greedy(4, stop_token_ids=[3, 999]))
    with pytest.raises(ValueError, match="no tokenizer"):
        engine.add_request("hello", greedy(4))
    with pytest.raises(ValueError, match=r"prompts\[1\] has 40 tokens"):
        engine.generate([[1, 2], list(range(40))], greedy(2))
    with pytest.raises(ValidationError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValidationError, match="temperature"):
        SamplingParams(temperature=-0.5)
    for bad in (0.0, 1.5):
        with pytest.raises(ValidationError, match="top_p"):
            SamplingParams(top_p=bad)
    with pytest.raises(ValidationError, match="top_k"):
        SamplingParams(top_k=-3)
    with pytest.raises(ValidationError, match="unknown_field|extra"):
        SamplingParams(unknown_field=1)
    with pytest.raises(ValueError, match="speculation="):
        make_engine("ouro", speculation="sometimes")
    with pytest.raises(ValueError, match=r"speculation\.d=4: must be in 1\.\.3"):
        make_engine("ouro", speculation="2,4")
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in outs] == [keep] and len(outs[0].token_ids) == 4


def test_stats_dict_and_prometheus():
    engine = make_engine("ouro")
    engine.generate(FILLER, greedy(5))
    stats = engine.stats.to_dict()
    assert stats["num_generation_tokens"] == 15 and stats["num_requests_finished"] == 3
    assert stats["num_rounds"] == 4 and sum(stats["batch_size_histogram"].values()) == 4
    assert stats["num_round_tokens"] == 12  # the rounds' tokens: each request's first came from its prefill
    assert set(stats) == {f.name for f in fields(EngineStats)} | {"acceptance_rate", "mean_loops_per_token"}
    assert type(stats["batch_size_histogram"]) is dict and list(stats["batch_size_histogram"]) == sorted(
        stats["batch_size_histogram"]
    )
    text = engine.stats.to_prometheus('ouro "tiny"')
    samples = {
        (s.name, s.labels.get("le", s.labels.get("phase"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("looped_spec:generation_tokens_total", None)] == 15
    assert samples[("looped_spec:batch_size_bucket", "+Inf")] == 4
    assert ("looped_spec:phase_seconds_total", "decode") in samples
    assert 'model_name="ouro \\"tiny\\""' in text  # label values escaped


def test_start_up_logs_device_dtype_kv_cache_and_controller(caplog):
    with caplog.at_level("INFO", logger="looped_spec.engine.engine"):
        engine = make_engine("ouro", speculation="off", num_kv_blocks=80, block_size=8, max_batch_size=3)
    line = next(r.getMessage() for r in caplog.records if r.name == "looped_spec.engine.engine")
    assert "on cpu, float32" in line and "KV cache 80 blocks x 8 tokens" in line
    assert "max_batch_size 3" in line and f"controller {type(engine.controller).__name__}" in line


@pytest.mark.parametrize(
    "options",
    [
        {"speculation": "off"},
        {"speculation": "adaptive"},
        {"cuda_graphs": "emulate"},
        {"speculation": "2,1", "batching": "loop"},
    ],
)
def test_a_dropped_engine_frees_its_kv_cache_and_weights_without_the_cycle_collector(options):
    """No reference cycle holds an engine's runner (the property test once grew to 17 GB): dropping the last reference
    frees the KV cache and the weights at once."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        engine = LoopedSpecEngine("tiny-ouro", max_model_len=64, **options)
        engine.generate(["def f(x):", "import os"], SamplingParams(max_tokens=5))
        weights = next(iter(engine.adapter.weights.values()))
        held = [weakref.ref(x) for x in (engine, engine.runner, engine.kv.key_cache, engine.adapter, weights)]
        del engine, weights
        assert [ref() is None for ref in held] == [True] * len(held)
    finally:
        gc.enable()


def test_close_releases_the_kv_cache_and_owned_weights_and_refuses_work_after():
    import gc
    import weakref

    from looped_spec.engine.async_engine import AsyncLoopedSpecEngine

    with LoopedSpecEngine("tiny-ouro", max_model_len=64, speculation="2,1") as engine:
        engine.generate(["def f(x):"], SamplingParams(max_tokens=4))
        engine.add_request("import os", SamplingParams(max_tokens=50))  # unfinished at close: dropped
        engine.step()
        held = [weakref.ref(x) for x in (engine.kv.key_cache, engine.adapter, engine.runner)]
    gc.disable()
    try:
        engine.close()  # twice is fine
        assert [ref() is None for ref in held] == [True] * 3  # while `engine` itself is still referenced
    finally:
        gc.enable()
    assert not engine.has_unfinished_requests()
    for call in (lambda: engine.generate(["x"]), lambda: engine.add_request("x"), engine.step):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    # an adapter the caller passed in is the caller's: close() leaves it usable
    adapter = load_adapter("tiny-ouro")
    with LoopedSpecEngine(adapter, speculation="off") as first:
        first.generate(["x"], SamplingParams(max_tokens=2))
    with AsyncLoopedSpecEngine(LoopedSpecEngine(adapter, speculation="off")) as front:
        assert front.is_running
    assert not front.is_running and front.engine.closed
    assert LoopedSpecEngine(adapter, speculation="off").generate(["x"], SamplingParams(max_tokens=2))[0].token_ids


@pytest.mark.parametrize(
    "options", [{"speculation": "off"}, {"speculation": "3,1"}, {"batching": "loop", "speculation": "off"}]
)
def test_time_to_first_token_and_inter_token_latency_count_every_generated_token(options):
    engine = LoopedSpecEngine("tiny-ouro", max_model_len=64, **options)
    outs = engine.generate(["def f(x):", "import os", "x = ["], SamplingParams(max_tokens=9, ignore_eos=True))
    stats = engine.stats
    assert stats.time_to_first_token.count == 3  # one first token per request
    assert stats.inter_token_latency.count == sum(len(o.token_ids) for o in outs) - 3
    assert 0.0 < stats.time_to_first_token.mean and sum(stats.inter_token_latency.buckets) == 24
    exported = stats.to_prometheus("m")
    assert 'looped_spec:engine_time_to_first_token_seconds_count{model_name="m"} 3.0' in exported
    assert stats.to_dict()["inter_token_latency"]["count"] == 24


def test_the_first_token_time_is_when_the_first_token_came_not_a_prompt_chunk():
    """A prompt prefilled in chunks commits no token before its last chunk: its time to first token runs to that."""
    engine = make_engine("ouro", max_num_batched_tokens=2)
    engine.add_request(list(range(3, 13)), greedy(2))
    outputs, steps = [], 0
    while not outputs:
        before = time.perf_counter()
        outputs, steps = engine.step(), steps + 1
    assert steps > 1 and outputs[0].new_token_ids and outputs[0].metrics.first_token_time >= before


def test_latency_histogram_counts_each_value_in_the_bucket_of_its_upper_bound():
    from looped_spec.engine.stats import LATENCY_BOUNDS, Latencies

    latencies = Latencies()
    for seconds in (0.0, 0.001, 0.0011, 10.0, 10.5):  # a bound is its own bucket's; past the last: the overflow
        latencies.observe(seconds)
    latencies.observe(0.003, times=3)
    expected = [0] * (len(LATENCY_BOUNDS) + 1)
    expected[0], expected[1], expected[2], expected[-2], expected[-1] = 2, 1, 3, 1, 1
    assert latencies.buckets == expected
    assert (latencies.count, latencies.total) == (8, pytest.approx(0.0 + 0.001 + 0.0011 + 10.0 + 10.5 + 0.009))


def test_what_a_vllm_script_does_runs_or_says_what_to_use_instead():
    """A script written for vLLM: its neutral values are taken, its calls in vLLM's shape work, and what this engine
    has under another name is named."""
    assert SamplingParams(n=1, best_of=None, stop=None, stop_token_ids=None) == SamplingParams()
    assert SamplingParams(logit_bias=None) == SamplingParams()  # vLLM's default: no bias
    params = SamplingParams(max_tokens=3)
    assert params.clone() == params and params.clone() is not params
    for field, instead in (("guided_decoding", "structured_outputs"), ("logits_processors", "logit_bias")):
        with pytest.raises(ValidationError, match=f"{field}: .*{instead}"):
            SamplingParams(**{field: None})
    vllm_options = [("max_num_seqs", "max_batch_size"), ("enforce_eager", "cuda_graphs=False"),
                    ("gpu_memory_utilization", "kv_cache_memory_gb"), ("trust_remote_code", "runs no"),
                    ("logprobs_mode", "raw_logprobs"), ("max_logprobs", "fixed at vLLM's default 20"),
                    ("kv_cache_dtype", "the model's dtype"), ("num_gpu_blocks_override", "num_kv_blocks"),
                    ("enable_chunked_prefill", "always on"), ("tokenizer", "tokenizer files"),
                    ("quantization", "no quantized weights"),
                    ("generation_config", "generation_config.json"), ("async_scheduling", "not offered"),
                    ("enable_prefix_caching", "prefix_caching, off by default"),
                    ("speculative_config", "speculation='adaptive'"),
                    ("num_speculative_tokens", "speculation='K,d'"), ("download_dir", "nothing is downloaded"),
                    ("revision", "nothing is downloaded"), ("load_format", "always safetensors"),
                    ("enable_lora", "no LoRA"), ("swap_space", "recomputed"),
                    ("cpu_offload_gb", "not offered")]  # fmt: skip
    for option, instead in vllm_options:
        with pytest.raises(ValueError, match=f"{option}: vLLM's engine argument; .*{instead}"):
            LoopedSpecEngine(str(fixture_dir("ouro")), speculation="off", **{option: 1})
    engine = make_engine("ouro")
    assert engine.get_tokenizer() is engine.tokenizer
    with pytest.raises(TypeError, match="vLLM's LLMEngine puts request_id first"):
        engine.add_request("r0", "hello", greedy(2))  # vLLM's order: (request_id, prompt, params)
    ids = [engine.add_request([5, 9, 13], greedy(8)) for _ in range(3)]
    with pytest.raises(KeyError, match="unknown request_ids"):
        engine.abort([ids[0], "nope"])  # checked before any stops
    engine.abort(ids[:2])  # several at once, as vLLM's abort_request takes them
    finished = {}
    while engine.has_unfinished_requests():
        finished |= {o.request_id: o for o in engine.step() if o.finished}
    assert [finished[i].finish_reason for i in ids] == ["abort", "abort", "length"]
    assert finished[ids[2]].outputs[0].finished() and finished[ids[2]].num_cached_tokens == 0


def test_chat_takes_openai_text_parts_as_the_server_does():
    with LoopedSpecEngine("tiny-ouro", speculation="off") as engine:
        parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
        message = {"role": "user", "content": parts}
        joined = engine.chat([message], greedy(3))[0]
        assert message["content"] is parts  # the caller's message is left as it was
        assert joined.prompt == engine.chat([{"role": "user", "content": "hi\nthere"}], greedy(3))[0].prompt
        with pytest.raises(ValueError, match=r"messages\[0\]\.content\[0\]: only text parts"):
            engine.chat([{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}], greedy(3))


def test_a_streamed_output_reads_its_text_so_far_as_vllms_cumulative_output():
    """From `step()`, `outputs[0].text` is the text streamed so far (every `new_text` up to it), then the whole text."""
    with LoopedSpecEngine("tiny-ouro", speculation="2,1") as engine:
        engine.add_request("def add(a, b):", SamplingParams(max_tokens=24, ignore_eos=True, stop=["\n\n\n"]))
        streamed, texts = "", []
        while engine.has_unfinished_requests():
            for out in engine.step():
                streamed += out.new_text
                texts.append(out.outputs[0].text)
                assert out.outputs[0].text == (out.text if out.finished else streamed)
        assert len(texts) > 2 and texts[-1] == streamed and any(texts[:-1])  # it grew before the end
