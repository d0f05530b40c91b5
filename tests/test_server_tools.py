"""Tool calling end to end: a real server (tiny-ouro, adaptive speculation, `--enable-auto-tool-choice
--tool-call-parser hermes`) and the official client. The tiny model never calls a tool of its own accord, so calls
come from constrained decoding (a named function, "required") or, for "auto", from an output forced by a grammar the
request adds; streamed answers are accumulated by the client's own stream helper and must equal the whole ones."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from server_utils import ServerThread, hermes_tool_server

from looped_spec import LoopedSpecEngine, SamplingParams
from looped_spec.cli import main
from looped_spec.structured_output import StructuredOutputs

MODEL = "tiny-ouro"
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                  "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"],
                  "additionalProperties": False}  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "A city's forecast.",
                                            "parameters": WEATHER_SCHEMA}}  # fmt: skip
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: an empty object
CALL_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'


@pytest.fixture(scope="module")
def server():
    yield from hermes_tool_server(MODEL, max_batch_size=4)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat(client, **fields):
    return client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, **fields)


def streamed(client, **fields):
    """The stream accumulated by the client's helper (the snapshot: `get_final_completion` refuses a "length"
    finish), and its chunks."""
    state, chunks = ChatCompletionStreamState(), []
    for chunk in chat(client, stream=True, **fields):
        chunks.append(chunk)
        state.handle_chunk(chunk)
    return state.current_completion_snapshot, chunks


def calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def assert_same_answer(whole, accumulated) -> None:
    """A streamed choice equals the whole one (ids are fresh per answer: only their form is compared)."""
    assert accumulated.message.content == whole.message.content
    assert calls(accumulated.message) == calls(whole.message)
    assert accumulated.finish_reason == whole.finish_reason
    for call in (accumulated.message.tool_calls or []) + (whole.message.tool_calls or []):
        assert call.id.startswith("chatcmpl-tool-") and call.type == "function"


def test_a_named_function_is_called_with_arguments_that_follow_its_schema(server, client):
    """The output is the function's parameters schema's instance, equal to the offline engine's greedy output under
    that schema (speculation off there); content null (OpenAI's) and finish "stop" (OpenAI's and vLLM's for a
    forced function)."""
    out = chat(client, tools=[WEATHER, NOW], tool_choice=CALL_WEATHER, max_tokens=40)
    choice = out.choices[0]
    assert (choice.message.content, choice.finish_reason) == (None, "stop")
    [(name, arguments)] = calls(choice.message)
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER_SCHEMA)
    reference = LoopedSpecEngine(MODEL, speculation="off", max_model_len=256)
    try:
        prompt = reference.tokenizer.apply_chat_template(MESSAGES, tools=[WEATHER, NOW], tokenize=False,
                                                         add_generation_prompt=True)  # fmt: skip
        grammar = StructuredOutputs(json=WEATHER_SCHEMA)
        ref = reference.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=grammar))[0]
    finally:
        reference.close()
    assert arguments == ref.text and out.usage.completion_tokens == len(ref.token_ids)

    accumulated, chunks = streamed(client, tools=[WEATHER, NOW], tool_choice=CALL_WEATHER, max_tokens=40)
    assert_same_answer(choice, accumulated.choices[0])
    pieces = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(pieces) > 1  # the arguments streamed as generated, not in one final piece
    assert pieces[0][0].function.name == "get_weather" and all(p[0].function.name is None for p in pieces[1:])
    assert not any(c.choices[0].delta.content for c in chunks if c.choices)  # no call text as content


def test_required_without_parallel_calls_makes_exactly_one_call(server, client):
    out = chat(client, tools=[WEATHER, NOW], tool_choice="required", parallel_tool_calls=False, max_tokens=40)
    choice = out.choices[0]
    assert (choice.message.content, choice.finish_reason) == (None, "tool_calls")
    [(name, arguments)] = calls(choice.message)
    schema = {"get_weather": WEATHER_SCHEMA, "now": {"type": "object", "properties": {}}}[name]
    jsonschema.validate(json.loads(arguments), schema)
    accumulated, _ = streamed(client, tools=[WEATHER, NOW], tool_choice="required", parallel_tool_calls=False,
                              max_tokens=40)  # fmt: skip
    assert_same_answer(choice, accumulated.choices[0])
    # with parallel calls the tiny model keeps adding calls to the array: max_tokens cuts it, and an array that
    # never closed is no call (its text is the content, the finish "length")
    cut = chat(client, tools=[WEATHER, NOW], tool_choice="required", max_tokens=20).choices[0]
    assert cut.finish_reason == "length" and cut.message.tool_calls is None
    assert cut.message.content.startswith('[{"name": "')


def test_auto_parses_the_hermes_calls_a_model_writes(server, client):
    """The model's output is forced here by a grammar of the request (auto leaves the request's own grammar on)."""
    forced = {"structured_outputs": {"choice": ["Sure. " + HERMES_CALL + " Done."]}}
    for tool_choice in ("auto", None):  # None: auto is the default with tools
        fields = dict(tools=[WEATHER, NOW], max_tokens=80, extra_body=forced)
        if tool_choice is not None:
            fields["tool_choice"] = tool_choice
        choice = chat(client, **fields).choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content == "Sure.  Done."
        assert calls(choice.message) == [("get_weather", '{"city": "Paris", "days": 2}')]
        accumulated, chunks = streamed(client, **fields)
        assert_same_answer(choice, accumulated.choices[0])
        assert not any("<tool_call>" in (c.choices[0].delta.content or "") for c in chunks if c.choices)
    malformed = "Sure. <tool_call>{'name': 'get_weather'}</tool_call>"  # not JSON: stays content
    choice = chat(client, tools=[WEATHER], max_tokens=60,
                  extra_body={"structured_outputs": {"choice": [malformed]}}).choices[0]  # fmt: skip
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (malformed, None, "stop")
    accumulated, _ = streamed(client, tools=[WEATHER], max_tokens=60,
                              extra_body={"structured_outputs": {"choice": [malformed]}})  # fmt: skip
    assert_same_answer(choice, accumulated.choices[0])


def test_none_generates_text_and_a_tool_conversation_renders(server, client):
    """tool_choice "none" generates freely (tiny-ouro's template ignores tools: the same text as without them); a
    conversation that sends back the assistant's calls (content null) and the tool's answer is rendered by the
    template and answered."""
    plain = chat(client, max_tokens=6).choices[0]
    choice = chat(client, tools=[WEATHER], tool_choice="none", max_tokens=6).choices[0]
    assert (choice.message.content, choice.message.tool_calls) == (plain.message.content, None)
    first = chat(client, tools=[WEATHER], tool_choice=CALL_WEATHER, max_tokens=40).choices[0].message
    answer = {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "sunny, 21C"}
    conversation = MESSAGES + [first.model_dump(exclude_none=True), answer]
    conversation[1]["content"] = None  # as clients send an assistant message of calls only
    out = client.chat.completions.create(model=MODEL, messages=conversation, tools=[WEATHER], tool_choice="none",
                                         max_tokens=4, temperature=0)  # fmt: skip
    assert out.choices[0].message.tool_calls is None and out.usage.completion_tokens == 4
    tokenizer = server.engine.tokenizer
    rendered = tokenizer.apply_chat_template(
        [MESSAGES[0], {"role": "assistant", "content": ""}, {"role": "tool", "content": "sunny, 21C"}],
        tokenize=False, add_generation_prompt=True)  # fmt: skip
    assert out.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))


def test_several_choices_with_logprobs_are_each_parsed(server, client):
    """n > 1: each choice is its own call, streamed or not; each call's log-probabilities are its arguments' tokens."""
    fields = dict(tools=[WEATHER], tool_choice=CALL_WEATHER, max_tokens=40, n=2, logprobs=True, top_logprobs=2)
    out = chat(client, **fields)
    assert len(out.choices) == 2
    for choice in out.choices:
        [(name, arguments)] = calls(choice.message)
        jsonschema.validate(json.loads(arguments), WEATHER_SCHEMA)
        assert "".join(entry.token for entry in choice.logprobs.content) == arguments
        assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    accumulated, chunks = streamed(client, **fields)
    for k in range(2):
        assert_same_answer(out.choices[k], accumulated.choices[k])
        streamed_entries = [e for c in chunks for ch in c.choices if ch.index == k and ch.logprobs
                            for e in ch.logprobs.content]  # fmt: skip
        assert [e.token for e in streamed_entries] == [e.token for e in out.choices[k].logprobs.content]
    sampled = client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[WEATHER, NOW], n=3, seed=5,
                                             tool_choice="required", parallel_tool_calls=False, max_tokens=100,
                                             temperature=1.0)  # fmt: skip
    for choice in sampled.choices:  # sampled choices: each its own array of one call
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        name, arguments = calls(choice.message)[0]
        if name == "get_weather":
            jsonschema.validate(json.loads(arguments), WEATHER_SCHEMA)
        else:
            assert (name, arguments) == ("now", "{}")


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **body},
                      timeout=60)  # fmt: skip


def test_every_choice_streams_its_role_first_and_a_call_closes_before_its_finish(server, client):
    """n > 1: the role chunks of every choice come first, in index order (the client's stream helper builds on the
    first chunk, which must be choice 0's); a chunk that carries a call's last piece is followed by the finish
    reason in a chunk of its own, so the helper's `arguments.done` event fires for every call."""
    for fields in (dict(n=3, max_tokens=4), dict(n=3, max_tokens=40, tools=[WEATHER], tool_choice=CALL_WEATHER)):
        _, chunks = streamed(client, **fields)
        firsts = [(c.choices[0].index, c.choices[0].delta.role) for c in chunks[:3]]
        assert firsts == [(0, "assistant"), (1, "assistant"), (2, "assistant")], firsts
        with client.chat.completions.stream(model=MODEL, messages=MESSAGES, temperature=0, **fields) as stream:
            for _ in stream:  # the helper's IndexError when a choice other than 0 came first
                pass
            assert len(stream.current_completion_snapshot.choices) == 3
    fields = dict(tools=[WEATHER, NOW], tool_choice="required", parallel_tool_calls=False, max_tokens=40)
    with client.chat.completions.stream(model=MODEL, messages=MESSAGES, temperature=0, **fields) as stream:
        events = [event.type for event in stream]
    assert events.count("tool_calls.function.arguments.done") == 1
    _, chunks = streamed(client, **fields)
    [carrier] = [c for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert carrier.choices[0].finish_reason is None and len(finish) == 1
    assert finish[0].choices[0].finish_reason == "tool_calls" and chunks.index(finish[0]) > chunks.index(carrier)


def test_required_calls_follow_a_recursive_schema(server, client):
    """A tool whose schema refers to itself ("#"): the arguments are instances of the tool's schema, sampled."""
    tree = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
            "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}}, "required": ["n", "kids"],
            "additionalProperties": False}  # fmt: skip
    tool = {"type": "function", "function": {"name": "tree", "parameters": tree}}
    out = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=[tool],
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=120,
        temperature=1.0,
        seed=3,
        n=4,
    )
    done = [choice for choice in out.choices if choice.finish_reason == "tool_calls"]
    assert done  # the tiny model finishes some trees within max_tokens
    for choice in done:
        [(name, arguments)] = calls(choice.message)
        jsonschema.validate(json.loads(arguments), tree)


def test_tool_requests_that_cannot_be_served_are_400_naming_the_field(server):
    bogus = {"type": "function", "function": {"name": "bad", "parameters": {"type": "bogus"}}}
    cases = [  # (the request's fields, the field the 400 names)
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "sleep"}}},
         "tool_choice.function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": CALL_WEATHER}, "tool_choice"),
        ({"tools": [], "tool_choice": "auto"}, "tool_choice"),
        ({"tools": [WEATHER, NOW, WEATHER], "tool_choice": "none"}, "tools[2].function.name"),
        ({"tools": [bogus], "tool_choice": {"type": "function", "function": {"name": "bad"}}},
         "tools[0].function.parameters"),
        ({"tools": [WEATHER, bogus], "tool_choice": "required"}, "tools[1].function.parameters"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format"),
        ({"tools": [WEATHER], "tool_choice": CALL_WEATHER, "structured_outputs": {"regex": "a"}},
         "structured_outputs"),
        ({"tools": [WEATHER], "tool_choice": "any"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        ({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}, "tools[0].type"),
        ({"messages": [{"role": "user", "content": "a", "tool_calls": []}]}, "messages[0]"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": "{x"}}]}]}, "messages[0].tool_calls[0].function.arguments"),
        ({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": 1}, "parallel_tool_calls"),
        ({"messages": [MESSAGES[0], {"role": "tool", "content": "21C"}]}, "messages[1]"),  # which call it answers
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": nested(250)}}], "tool_choice": "none"},
         "tools"),  # deeper than the chat template walks
        ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "f", "arguments": "[" * 5000 + "]" * 5000}}]}]}, "messages[0].tool_calls[0].function.arguments"),
    ]  # fmt: skip
    for fields, field in cases:
        answer = post(server, fields)
        assert answer.status_code == 400, (fields, answer.text)
        error = answer.json()["error"]
        assert error["param"] == field and error["message"].startswith(field), (fields, error)
    # a response_format of plain text is no grammar: it goes with a forced call
    answer = post(server, {"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False,
                           "response_format": {"type": "text"}, "max_tokens": 40, "temperature": 0})  # fmt: skip
    assert answer.status_code == 200 and answer.json()["choices"][0]["finish_reason"] == "tool_calls"
    # completions take no tools
    answer = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "a", "tools": [WEATHER]})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "tools"


def test_auto_needs_a_server_started_with_a_parser():
    engine = LoopedSpecEngine(MODEL, speculation="off", max_model_len=128)
    with ServerThread(engine, MODEL) as running:
        for fields in ({"tools": [WEATHER], "tool_choice": "auto"}, {"tools": [WEATHER]}):
            answer = post(running, fields)
            error = answer.json()["error"]
            assert answer.status_code == 400 and error["param"] == "tool_choice", answer.text
            assert "--enable-auto-tool-choice" in error["message"] and "--tool-call-parser" in error["message"]
        # forced calls need no parser
        answer = post(running, {"tools": [WEATHER], "tool_choice": CALL_WEATHER, "max_tokens": 40})
        assert answer.status_code == 200 and answer.json()["choices"][0]["message"]["tool_calls"]


def test_serve_flags_for_auto_tool_choice(capsys):
    assert main(["serve", MODEL, "--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser (one of hermes)" in capsys.readouterr().err
    assert main(["serve", MODEL, "--enable-auto-tool-choice", "--tool-call-parser", "pythonic"]) == 2
    assert "--tool-call-parser 'pythonic': unknown; known: hermes" in capsys.readouterr().err
