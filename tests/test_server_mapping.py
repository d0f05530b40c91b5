"""The OpenAI server's request mapping, field by field: each request field reaches the engine's parameter it names,
at its documented default and bounds (what a mutation audit of server/protocol.py and server/serving.py found no test
telling apart). A server with speculation off, so sampled choices reproduce, and an offline reference engine."""

from __future__ import annotations

import httpx
import openai
import pytest
from server_utils import ServerThread, greedy, offline_reference

from looped_spec import LoopedSpecEngine

MODEL = "tiny-ouro"
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def reference_engine():
    yield from offline_reference(MODEL)


@pytest.fixture(scope="module")
def server():
    engine = LoopedSpecEngine(MODEL, speculation="off", max_model_len=256)
    with ServerThread(engine, MODEL) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_a_completion_without_max_tokens_generates_openais_sixteen(server, reference_engine):
    """OpenAI's default max_tokens for completions is 16 (the checkpoint has no max_new_tokens to cap it); sent as
    null it is unset, the same 16."""
    expected = greedy(reference_engine, PROMPT, 16, ignore_eos=True)
    for fields in ({}, {"max_tokens": None}):
        body = {"prompt": PROMPT, "temperature": 0, "ignore_eos": True, **fields}
        answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
        assert answer["usage"]["completion_tokens"] == 16 and answer["choices"][0]["finish_reason"] == "length"
        assert answer["choices"][0]["text"] == expected.text


def test_a_stop_string_longer_than_sixteen_characters_is_one_stop_string(client, reference_engine):
    """`stop` as one string is one stop string, whatever its length (the limit of 16 counts strings, not the
    characters of one)."""
    full = greedy(reference_engine, PROMPT, 24, ignore_eos=True).text
    stop = full[3:23]
    assert len(stop) > 16
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop)
    assert out.choices[0].text == full[: full.index(stop)] and out.choices[0].finish_reason == "stop"
    assert out.choices[0].model_extra["stop_reason"] == stop


def test_max_tokens_may_fill_the_context_exactly(client):
    """A prompt and max_tokens that add up to max_model_len fit (vLLM's bound); one token more is a 400 naming the
    field."""
    ids = [17] * 250  # max_model_len 256: room for 6
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=ids, max_tokens=7)
    assert err.value.body["param"] == "max_tokens"


def test_min_tokens_may_equal_max_tokens(client, reference_engine):
    """min_tokens up to max_tokens is taken (vLLM's bound), holding the stop token back to the end; one more is a
    400 naming min_tokens."""
    first = greedy(reference_engine, PROMPT, 1, ignore_eos=True).token_ids
    fields = {"min_tokens": 4, "stop_token_ids": first}
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, extra_body=fields)
    assert out.usage.completion_tokens == 4
    assert out.choices[0].text == greedy(reference_engine, PROMPT, 4, **fields).text
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, extra_body=fields)
    assert err.value.body["param"] == "min_tokens"


def test_presence_and_frequency_penalty_each_reach_their_own_parameter(client, reference_engine):
    """Each penalty alone: the served greedy text equals the offline one with that penalty, which here differs from
    the other penalty's (a token repeated more than once is penalised by its count only under frequency_penalty)."""
    prompt = "x = ["
    texts = {}
    for name in ("presence_penalty", "frequency_penalty"):
        texts[name] = greedy(reference_engine, prompt, 32, **{name: 0.3}).text
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, **{name: 0.3})
        assert out.choices[0].text == texts[name], name
    assert texts["presence_penalty"] != texts["frequency_penalty"]


def test_top_k_and_top_p_reach_the_request(client, reference_engine):
    """vLLM's top_k and OpenAI's top_p: top_k 1 (or a top_p too small for a second token) samples the most likely
    token, so a sampled choice is the greedy text; the same seed without them samples another."""
    sampled = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=1.0, seed=5)
    expected = greedy(reference_engine, PROMPT, 12).text
    assert client.completions.create(**sampled).choices[0].text != expected
    assert client.completions.create(**sampled, extra_body={"top_k": 1}).choices[0].text == expected
    assert client.completions.create(**sampled, top_p=0.01).choices[0].text == expected


def test_sixteen_stop_strings_are_taken_and_a_seventeenth_is_a_400_naming_stop(client):
    """At most 16 stop strings, as documented (docs/serving.md)."""
    stops = [f"never{i}" for i in range(17)]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stop=stops[:16])
    assert out.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stop=stops)
    assert err.value.body["param"] == "stop" and "at most 16" in err.value.body["message"]


def test_chats_max_completion_tokens_wins_over_max_tokens(client):
    """Both given, chat's max_completion_tokens is the bound (OpenAI's newer field; vLLM's rule, docs/serving.md)."""
    messages = [{"role": "user", "content": "hi"}]
    for max_tokens, max_completion_tokens in ((2, 5), (5, 2)):
        out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens,
                                             max_completion_tokens=max_completion_tokens,
                                             extra_body={"ignore_eos": True})  # fmt: skip
        assert out.usage.completion_tokens == max_completion_tokens


def test_usage_counts_each_prompt_once_whatever_n(client, reference_engine):
    """`n` choices of a prompt share it: usage counts its tokens once and every choice's completion (streamed too)."""
    prompt_tokens = len(reference_engine.tokenizer.encode(PROMPT))
    request = dict(model=MODEL, prompt=[PROMPT, PROMPT], max_tokens=3, temperature=1.0, n=2,
                   extra_body={"ignore_eos": True})  # fmt: skip
    out = client.completions.create(**request)
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (2 * prompt_tokens, 12)
    chunks = list(client.completions.create(**request, stream=True, stream_options={"include_usage": True}))
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (2 * prompt_tokens, 12)


def test_chat_logprobs_without_top_logprobs_score_every_token(client):
    """Chat's `logprobs: true` alone: each generated token's entry, with no alternatives (top_logprobs left out is 0,
    as OpenAI's)."""
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                         temperature=0, logprobs=True, extra_body={"ignore_eos": True})  # fmt: skip
    content = out.choices[0].logprobs.content
    assert len(content) == 4 and all(entry.top_logprobs == [] and entry.logprob <= 0 for entry in content)
