"""vLLM's `return_token_ids` on /v1/completions and /v1/chat/completions, end to end: the prompt's ids and each
choice's generated ids (streamed: the ids new in each chunk), checked against the offline engine's outputs; off, the
answers are what they were before the field existed, key for key.

Servers: tiny-ouro under adaptive speculation with hermes tool calling (streams then carry several tokens a chunk),
tiny-ouro with the deepseek_r1 reasoning parser, and the Ouro fixture, which has no tokenizer files (ids only).
"""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from conftest import fixture_dir
from server_utils import ServerThread, greedy, hermes_tool_server, offline_reference

from looped_spec import LoopedSpecEngine
from looped_spec.structured_output import StructuredOutputs

MODEL = "tiny-ouro"
PROMPTS = ["def fibonacci(n):", "import os"]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
ON = {"return_token_ids": True}
#: the keys every answer had before return_token_ids (the field off must leave them exactly so)
TOP_KEYS = ["id", "object", "created", "model", "choices", "usage"]
COMPLETION_CHOICE_KEYS = ["index", "text", "logprobs", "finish_reason", "stop_reason"]
CHAT_CHOICE_KEYS = ["index", "message", "logprobs", "finish_reason", "stop_reason"]
CHAT_STREAM_CHOICE_KEYS = ["index", "delta", "logprobs", "finish_reason", "stop_reason"]


@pytest.fixture(scope="module")
def reference_engine():
    yield from offline_reference(MODEL)


@pytest.fixture(scope="module")
def server():
    yield from hermes_tool_server(MODEL, max_batch_size=8)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def rendered(engine, messages=MESSAGES) -> str:
    return engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def extra(model) -> dict:
    """The fields the openai client does not know (vLLM's), as it received them."""
    return model.model_extra or {}


def streamed_ids(chunks) -> tuple[dict[int, list[int]], dict[int, list[list[int]]]]:
    """Per choice index, its chunks' `token_ids` concatenated, and the `prompt_token_ids` its chunks carried."""
    ids: dict[int, list[int]] = {}
    prompts: dict[int, list[list[int]]] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            assert isinstance(extra(choice).get("token_ids"), list)  # every choice of every chunk carries its ids
            ids.setdefault(choice.index, []).extend(extra(choice)["token_ids"])
            if "prompt_token_ids" in extra(choice):
                prompts.setdefault(choice.index, []).append(extra(choice)["prompt_token_ids"])
    return ids, prompts


def raw_sse(url: str, body: dict) -> list[dict]:
    with httpx.stream("POST", url, json=body, timeout=60) as answer:
        assert answer.status_code == 200
        lines = [line[6:] for line in answer.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_completions_carry_each_prompts_ids_and_the_generated_ids(client, reference_engine):
    """Two prompts, n=2: choice 2i+j continues prompt i; its ids are the offline engine's prompt and output ids, whole
    and streamed (the first chunk of each choice carries its prompt's ids, every chunk the ids new in it)."""
    refs = [greedy(reference_engine, prompt, 20) for prompt in PROMPTS]
    out = client.completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=20, temperature=0, extra_body=ON)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for choice in out.choices:
        ref = refs[choice.index // 2]
        assert extra(choice)["prompt_token_ids"] == ref.prompt_token_ids
        assert extra(choice)["token_ids"] == ref.token_ids and choice.text == ref.text
    assert out.usage.completion_tokens == sum(len(extra(c)["token_ids"]) for c in out.choices)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=20, temperature=0,
                                            stream=True, extra_body=ON))  # fmt: skip
    ids, prompts = streamed_ids(chunks)
    assert ids == {k: refs[k // 2].token_ids for k in range(4)}
    assert prompts == {k: [refs[k // 2].prompt_token_ids] for k in range(4)}  # once each, in its first chunk
    for k in range(4):
        first = next(c.choices[0] for c in chunks if c.choices[0].index == k)
        assert "prompt_token_ids" in extra(first)
    assert sum(1 for c in chunks if extra(c.choices[0])["token_ids"]) > 4  # really streamed, not one chunk each


def test_echo_and_scoring_keep_the_prompt_apart_from_the_generated_ids(client, reference_engine):
    """With echo the text starts with the prompt, but `token_ids` stay the generated ones and `prompt_token_ids` the
    prompt's: together the ids the log-probabilities name (shown as token_id:<id>). max_tokens 0 generates none."""
    ref = greedy(reference_engine, PROMPTS[0], 8)
    fields = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, echo=True, logprobs=0)
    on = ON | {"return_tokens_as_token_ids": True}
    choice = client.completions.create(**fields, extra_body=on).choices[0]
    assert choice.text.endswith(ref.text) and len(choice.text) > len(ref.text)
    assert (extra(choice)["prompt_token_ids"], extra(choice)["token_ids"]) == (ref.prompt_token_ids, ref.token_ids)
    assert choice.logprobs.tokens == [f"token_id:{t}" for t in ref.prompt_token_ids + ref.token_ids]
    chunks = list(client.completions.create(**fields, stream=True, extra_body=on))
    assert chunks[0].choices[0].text == choice.text[: -len(ref.text)]  # the echoed prompt, in the first chunk
    first = extra(chunks[0].choices[0])
    assert (first["prompt_token_ids"], first["token_ids"]) == (ref.prompt_token_ids, [])
    assert streamed_ids(chunks) == ({0: ref.token_ids}, {0: [ref.prompt_token_ids]})
    scored = dict(fields, max_tokens=0, prompt=PROMPTS)
    for answer in (client.completions.create(**scored, extra_body=ON),
                   *client.completions.create(**scored, stream=True, extra_body=ON)):  # fmt: skip
        for c in answer.choices:
            prompt = reference_engine.tokenizer.encode(PROMPTS[c.index])
            assert (extra(c)["prompt_token_ids"], extra(c)["token_ids"]) == (prompt, [])


def test_a_stop_string_cuts_the_text_not_the_ids_the_engine_generated(client, reference_engine):
    """`token_ids` are the engine's: the tokens that wrote the stop string stay, though the text is cut before it
    (docs/serving.md); streamed, the chunks' ids add up to the same."""
    full = greedy(reference_engine, PROMPTS[0], 32).text
    stop = full[10:13]
    ref = greedy(reference_engine, PROMPTS[0], 32, stop=[stop])
    assert ref.text == full[: full.index(stop)]
    choice = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=32, temperature=0, stop=[stop],
                                       extra_body=ON).choices[0]  # fmt: skip
    assert (choice.text, choice.finish_reason) == (ref.text, "stop")
    assert extra(choice)["token_ids"] == ref.token_ids
    assert stop in reference_engine.tokenizer.decode(ref.token_ids)  # the ids hold what the text left out
    chunks = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=32, temperature=0, stop=[stop],
                                       stream=True, extra_body=ON)  # fmt: skip
    assert streamed_ids(chunks)[0] == {0: ref.token_ids}


def test_a_model_without_a_tokenizer_shows_its_output_as_ids():
    """The fixture has no tokenizer files: every text is empty, so `token_ids` are the output (the offline engine's),
    streamed chunk by chunk as they come rather than in one finishing chunk."""
    folder = str(fixture_dir("ouro"))
    prompt = [5, 17, 42, 9]
    offline = LoopedSpecEngine(folder, speculation="off", max_model_len=128)
    ref = greedy(offline, prompt, 12, ignore_eos=True)
    offline.close()
    engine = LoopedSpecEngine(folder, speculation="off", max_model_len=128)
    with ServerThread(engine, "bare") as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        fields = dict(model="bare", prompt=prompt, max_tokens=12, temperature=0, extra_body=ON | {"ignore_eos": True})
        choice = client.completions.create(**fields).choices[0]
        assert (choice.text, extra(choice)["token_ids"], extra(choice)["prompt_token_ids"]) == ("", ref.token_ids,
                                                                                              prompt)  # fmt: skip
        chunks = list(client.completions.create(**fields, stream=True))
        assert streamed_ids(chunks) == ({0: ref.token_ids}, {0: [prompt]}) and len(chunks) > 1


def test_chat_carries_the_rendered_prompts_ids_and_each_choices_ids(server, client, reference_engine):
    """Chat: `prompt_token_ids` once, at the top (the rendered chat's, as /tokenize gives them), `token_ids` per
    choice; streamed, the prompt's ids in the answer's first chunk only."""
    ref = greedy(reference_engine, rendered(reference_engine), 16)
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=16, temperature=0,
                                         extra_body=ON)  # fmt: skip
    assert extra(out)["prompt_token_ids"] == ref.prompt_token_ids
    tokenized = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}, timeout=60).json()["tokens"]
    assert tokenized == ref.prompt_token_ids
    assert [extra(c)["token_ids"] for c in out.choices] == [ref.token_ids] * 2
    assert "prompt_token_ids" not in extra(out.choices[0])
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=16, temperature=0,
                                                 stream=True, extra_body=ON))  # fmt: skip
    assert extra(chunks[0])["prompt_token_ids"] == ref.prompt_token_ids
    assert not any("prompt_token_ids" in extra(c) for c in chunks[1:])
    assert streamed_ids(chunks) == ({0: ref.token_ids, 1: ref.token_ids}, {})


def test_a_chat_echo_is_not_in_the_ids(server, client, reference_engine):
    """Chat echo repeats the continued assistant message: its ids are in the prompt's (as /tokenize renders it), not
    in `token_ids`, which stay the generated ones; streamed, the echo chunks add no ids."""
    messages = MESSAGES + [{"role": "assistant", "content": "Sure,"}]
    fields = {"add_generation_prompt": False, "continue_final_message": True}
    prompt = httpx.post(server.url + "/tokenize", json={"messages": messages, **fields}, timeout=60).json()["tokens"]
    ref = greedy(reference_engine, prompt, 10)
    request = dict(model=MODEL, messages=messages, n=2, max_tokens=10, temperature=0,
                   extra_body=ON | fields | {"echo": True})  # fmt: skip
    out = client.chat.completions.create(**request)
    assert extra(out)["prompt_token_ids"] == prompt
    assert [(c.message.content, extra(c)["token_ids"]) for c in out.choices] == [("Sure," + ref.text,
                                                                                 ref.token_ids)] * 2  # fmt: skip
    chunks = list(client.chat.completions.create(**request, stream=True))
    assert extra(chunks[0])["prompt_token_ids"] == prompt
    assert streamed_ids(chunks)[0] == {0: ref.token_ids, 1: ref.token_ids}
    echoes = [c.choices[0] for c in chunks if c.choices[0].delta.content == "Sure,"]
    assert len(echoes) == 2 and all(extra(c)["token_ids"] == [] for c in echoes)


def test_tool_calls_leave_the_ids_as_generated(client, reference_engine):
    """A hermes call parsed out of the text: the message holds the call, the ids are the raw output's (the offline
    engine's under the same grammar), whole and streamed."""
    written = "Sure. " + HERMES_CALL + " Done."
    ref = greedy(reference_engine, rendered(reference_engine), 80,
                 structured_outputs=StructuredOutputs(choice=[written]))  # fmt: skip
    assert reference_engine.tokenizer.decode(ref.token_ids, skip_special_tokens=True) == written
    fields = dict(model=MODEL, messages=MESSAGES, tools=[WEATHER], max_tokens=80, temperature=0,
                  extra_body=ON | {"structured_outputs": {"choice": [written]}})  # fmt: skip
    choice = client.chat.completions.create(**fields).choices[0]
    assert choice.message.tool_calls[0].function.name == "get_weather" and choice.message.content == "Sure.  Done."
    assert extra(choice)["token_ids"] == ref.token_ids
    assert streamed_ids(client.chat.completions.create(**fields, stream=True))[0] == {0: ref.token_ids}


def test_a_reasoning_parser_leaves_the_ids_as_generated(reference_engine):
    """Under deepseek_r1 the reply's text becomes reasoning (the tiny model never closes it): the ids are still the
    raw output's, whole and streamed."""
    ref = greedy(reference_engine, rendered(reference_engine), 12)
    engine = LoopedSpecEngine(MODEL, speculation="off", max_model_len=256)
    with ServerThread(engine, MODEL, reasoning_parser="deepseek_r1") as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        fields = dict(model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, extra_body=ON)
        choice = client.chat.completions.create(**fields).choices[0]
        assert choice.message.content is None and extra(choice.message)["reasoning"] == ref.text
        assert extra(choice)["token_ids"] == ref.token_ids
        assert streamed_ids(client.chat.completions.create(**fields, stream=True))[0] == {0: ref.token_ids}


def without_ids(answer: dict) -> dict:
    """An answer as it would be without return_token_ids: its token-id fields removed."""
    answer = {k: v for k, v in answer.items() if k != "prompt_token_ids"}
    answer["choices"] = [{k: v for k, v in c.items() if k not in ("prompt_token_ids", "token_ids")}
                         for c in answer["choices"]]  # fmt: skip
    return answer


def same_but_id(text: str) -> str:
    """An answer's JSON text with its fresh id and creation time blanked."""
    return re.sub(r'"created":\d+', '"created":0', re.sub(r'"id":"[^"]+"', '"id":""', text))


@pytest.mark.parametrize(("path", "body", "choice_keys"), [
    ("/v1/completions", {"prompt": PROMPTS, "n": 2, "echo": True}, COMPLETION_CHOICE_KEYS),
    ("/v1/chat/completions", {"messages": MESSAGES, "n": 2}, CHAT_CHOICE_KEYS),
])  # fmt: skip
def test_off_the_answer_is_as_before_byte_for_byte(server, path, body, choice_keys):
    """Left out, null or false: the same JSON text (but the id and time), with the keys answers always had; on, the
    same answer with the ids added (nothing else changes). Without logprobs: their last digits follow the batch."""
    body = body | {"model": MODEL, "max_tokens": 6, "temperature": 0}
    texts = [httpx.post(server.url + path, json=body | fields, timeout=60).text
             for fields in ({}, {"return_token_ids": None}, {"return_token_ids": False})]  # fmt: skip
    assert len({same_but_id(text) for text in texts}) == 1
    off = json.loads(texts[0])
    assert list(off) == TOP_KEYS and all(list(c) == choice_keys for c in off["choices"])
    on = httpx.post(server.url + path, json=body | ON, timeout=60).json()
    assert all("token_ids" in c for c in on["choices"]) and without_ids(on) | {"id": "", "created": 0} == off | {
        "id": "", "created": 0}  # fmt: skip


@pytest.mark.parametrize(("path", "body", "choice_keys"), [
    ("/v1/completions", {"prompt": PROMPTS[0], "echo": True}, COMPLETION_CHOICE_KEYS),
    ("/v1/chat/completions", {"messages": MESSAGES}, CHAT_STREAM_CHOICE_KEYS),
])  # fmt: skip
def test_off_a_stream_has_the_chunks_it_had(server, path, body, choice_keys):
    """Streamed without the field (left out, null, false): every chunk with the keys chunks always had, none of the
    token-id fields."""
    body = body | {"model": MODEL, "max_tokens": 6, "temperature": 0, "stream": True}
    for fields in ({}, {"return_token_ids": None}, {"return_token_ids": False}):
        chunks = raw_sse(server.url + path, body | fields)
        assert all(list(c) == TOP_KEYS and all(list(x) == choice_keys for x in c["choices"]) for c in chunks)


@pytest.mark.parametrize("value", ["yes", 1, [True]])
def test_a_return_token_ids_that_is_not_a_bool_is_a_400_naming_it(client, value):
    for create, fields in ((client.completions.create, {"prompt": PROMPTS[0]}),
                           (client.chat.completions.create, {"messages": MESSAGES})):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:
            create(model=MODEL, max_tokens=2, extra_body={"return_token_ids": value}, **fields)
        assert err.value.body["param"] == "return_token_ids"


def test_a_stop_token_that_ends_a_choice_stays_last_in_its_ids(client, reference_engine):
    """An eos (the greedy token once min_tokens let it, under a logit_bias) or a stop_token_ids token ends the choice
    and is the last of its `token_ids`, as the offline engine's output keeps it (vLLM's too): completions and chat,
    whole and streamed (in the finishing chunk). include_stop_str_in_output (and, for the eos, skip_special_tokens off)
    puts the token's text in the text; the ids are the same either way."""
    eos = reference_engine.tokenizer.eos_token_id
    assert eos in reference_engine.eos_token_ids
    forced = {"min_tokens": 3, "logit_bias": {eos: 100}}
    for prompt, create in ((PROMPTS[0], client.completions.create),
                           (rendered(reference_engine), client.chat.completions.create)):  # fmt: skip
        token = greedy(reference_engine, prompt, 8, ignore_eos=True).token_ids[4]
        cases = [
            (forced, eos),
            (forced | {"include_stop_str_in_output": True, "skip_special_tokens": False}, eos),
            ({"stop_token_ids": [token]}, token),
            ({"stop_token_ids": [token], "include_stop_str_in_output": True}, token),
            (forced | {"ignore_eos": True, "stop_token_ids": [eos]}, eos),  # an eos named: its stop_reason
        ]
        texts = set()
        for options, last in cases:
            ref = greedy(reference_engine, prompt, 16, **options)
            assert (ref.finish_reason, ref.token_ids[-1]) == ("stop", last), options
            texts.add(ref.text)
            body = ON | options
            if "logit_bias" in options:  # JSON's keys are strings
                body["logit_bias"] = {str(k): v for k, v in options["logit_bias"].items()}
            fields = dict(model=MODEL, max_tokens=16, temperature=0, extra_body=body)
            fields |= {"messages": MESSAGES} if create == client.chat.completions.create else {"prompt": prompt}
            choice = create(**fields).choices[0]
            text = choice.message.content if "messages" in fields else choice.text
            assert (text, choice.finish_reason, choice.stop_reason) == (ref.text, "stop", ref.stop_reason), options
            assert extra(choice)["token_ids"] == ref.token_ids, options
            chunks = list(create(**fields, stream=True))
            assert streamed_ids(chunks)[0] == {0: ref.token_ids}, options
            finishing = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason is not None]
            assert len(finishing) == 1 and extra(finishing[0])["token_ids"][-1:] == [last], options
        assert len(texts) == 4, prompt  # the options that keep the stop token's text changed the text, not the ids
