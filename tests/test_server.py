"""The OpenAI-compatible server, end to end: a real uvicorn server on 127.0.0.1 and the official client.

One server (tiny-ouro, adaptive speculation, API key set) serves the whole module; references come
from a second, offline engine with speculation off, so the server's greedy output is checked against
plain decoding.
"""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import with_small_vocabulary
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import ServerThread, greedy, idle, offline_reference, wait_until

from looped_spec import AsyncLoopedSpecEngine, LoopedSpecEngine, SamplingParams
from looped_spec.server import build_app

MODEL = "tiny-ouro"
API_KEY = "test-key"
PROMPT = "def fibonacci(n):"
MAX_BATCH = 4


@pytest.fixture(scope="module")
def reference_engine():
    yield from offline_reference(MODEL)


@pytest.fixture(scope="module")
def server():
    engine = LoopedSpecEngine(MODEL, speculation="adaptive", max_batch_size=MAX_BATCH, max_model_len=256)
    with ServerThread(engine, MODEL, max_queued=0, api_key=API_KEY) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return server.client(API_KEY)


def test_models_health_and_open_endpoints(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    # vLLM's card: where the model was loaded from (a client may look it up), no parent, a permission object
    card = httpx.get(server.url + "/v1/models/" + MODEL, headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert Path(card["root"]) == Path(server.engine.adapter.path) and card["parent"] is None
    assert card["max_model_len"] == 256 and card["permission"][0]["object"] == "model_permission"
    # /health and /metrics stay open without the key; /v1/* does not
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert httpx.get(server.url + "/v1/models").status_code == 401
    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)


def test_completion_equals_offline_greedy_and_stream_equals_text(server, client, reference_engine):
    ref = greedy(reference_engine, PROMPT, 24)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.token_ids)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))  # fmt: skip
    deltas = [c.choices[0].text for c in chunks if c.choices]
    assert len([d for d in deltas if d]) > 1  # really streamed, not one final chunk
    assert "".join(deltas) == ref.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)
    # token-id prompts are accepted too
    by_ids = client.completions.create(model=MODEL, prompt=ref.prompt_token_ids, max_tokens=24, temperature=0)
    assert by_ids.choices[0].text == ref.text
    wait_until(lambda: idle(server), what="server idle")


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server, client):
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage counts the tokens streamed so far, for
    completions (generated and scored-only) and chat; beside include_usage false it is a 400 naming it."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for create, fields in (
        (client.completions.create, {"prompt": PROMPT, "n": 2}),
        (client.chat.completions.create, chat),
    ):
        chunks = list(create(model=MODEL, max_tokens=12, temperature=0, stream=True, stream_options=options, **fields))
        counts = [c.usage.completion_tokens for c in chunks]
        assert all(c.usage is not None and c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
                   for c in chunks)  # fmt: skip
        assert counts == sorted(counts) and len(set(counts)) > 2  # growing as tokens come
        assert counts[-1] == chunks[-1].usage.completion_tokens and chunks[-1].choices == []
        assert chunks[-2].usage == chunks[-1].usage  # the last tokens' chunk already counted them all
    scored = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1,
                                            stream=True, stream_options=options))  # fmt: skip
    assert all(c.usage.completion_tokens == 0 and c.usage.prompt_tokens > 0 for c in scored)
    # include_usage left out: as continuous_usage_stats (vLLM's default is true); set false it would send none
    alone = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stream=True,
                                           stream_options={"continuous_usage_stats": True}))  # fmt: skip
    assert all(c.usage is not None for c in alone) and alone[-1].choices == []
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, stream=True,
                                  stream_options={"continuous_usage_stats": True, "include_usage": False})  # fmt: skip
    assert err.value.body["param"] == "stream_options.continuous_usage_stats"


def test_chat_completion_uses_the_template(server, client, reference_engine):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
    rendered = reference_engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("# assistant:")
    ref = greedy(reference_engine, rendered, 16)
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_stop_strings_cut_the_text_and_stop_generation(server, client, reference_engine):
    full = greedy(reference_engine, PROMPT, 32).text
    stop = full[10:13]
    cut = full[: full.index(stop)]
    offline = greedy(reference_engine, PROMPT, 32, stop=[stop])
    assert offline.text == cut and offline.finish_reason == "stop" and offline.stop_reason == stop
    # generation ended at the token that completed the stop string
    tok = reference_engine.tokenizer
    assert stop in tok.decode(offline.token_ids) and stop not in tok.decode(offline.token_ids[:-1])
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, stop=[stop, "@@@@"])
    assert out.choices[0].text == cut and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens == len(offline.token_ids)
    chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, stop=stop,
                                       stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == cut


def test_choices_carry_vllms_stop_reason(server, client, reference_engine):
    """vLLM's `stop_reason` on completions and chat, streamed (in the finishing chunk) and not: the stop string, the
    stop_token_ids token, None for eos and for a length."""
    full = greedy(reference_engine, PROMPT, 32, ignore_eos=True)
    stop = full.text[10:13]
    token = full.token_ids[5]
    cases = [({"stop": [stop, "@@@@"]}, stop), ({"extra_body": {"stop_token_ids": [token]}}, token), ({}, None)]
    for fields, reason in cases:
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, **fields)
        assert out.choices[0].model_extra["stop_reason"] == reason, fields
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=32, temperature=0, stream=True,
                                                **fields))  # fmt: skip
        finishing = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason is not None]
        assert [c.model_extra["stop_reason"] for c in finishing] == [reason], fields
    eos = reference_engine.tokenizer.eos_token_id
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0,
                                    logit_bias={str(eos): 100})  # fmt: skip
    assert out.choices[0].finish_reason == "stop" and out.choices[0].model_extra["stop_reason"] is None
    messages = [{"role": "user", "content": "hi"}]
    reply = greedy(reference_engine, reference_engine.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True), 24, ignore_eos=True).text  # fmt: skip
    stop = reply[4:7]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, stop=[stop])
    assert out.choices[0].finish_reason == "stop" and out.choices[0].model_extra["stop_reason"] == stop
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                                 stop=[stop], stream=True))  # fmt: skip
    finishing = [c.choices[0] for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    assert [c.model_extra["stop_reason"] for c in finishing] == [stop]


def test_a_request_without_a_model_is_for_the_served_one(server, reference_engine):
    """vLLM's server takes a request without `model` as one for the model it serves (a 400 before); another model's
    name is still a 404."""
    expected = greedy(reference_engine, PROMPT, 6, ignore_eos=True).text
    for endpoint, fields in [("/v1/completions", {"prompt": PROMPT}),
                             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})]:  # fmt: skip
        body = {**fields, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        auth = {"Authorization": f"Bearer {API_KEY}"}
        answer = httpx.post(server.url + endpoint, json=body, headers=auth, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == MODEL
        if endpoint == "/v1/completions":
            assert answer.json()["choices"][0]["text"] == expected
        other = httpx.post(server.url + endpoint, json={**body, "model": "another"}, headers=auth, timeout=60)
        assert other.status_code == 404 and "'another' does not exist" in other.json()["error"]["message"]


def test_prompt_lists_and_n_choices(server, client, plain_server, reference_engine):
    """A list of prompts gives one choice per prompt (batched into the engine together); `n` > 1 gives independent
    samples per prompt, reproducible with a seed (choice j draws with seed + j), in OpenAI's order (prompt i's j-th
    sample is choice i * n + j); usage counts each prompt once and every choice's tokens."""
    prompts = ["def fibonacci(n):", "import os", "class A:"]
    out = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [greedy(reference_engine, p, 6).text for p in prompts]
    num_prompt = sum(len(reference_engine.tokenizer.encode(p, add_special_tokens=False)) for p in prompts)
    assert out.usage.prompt_tokens == num_prompt and out.usage.completion_tokens == 18

    # seeded samples are reproducible where the plans are: on a server decoding plainly (adaptive plans follow the
    # machine, and another K draws other numbers)
    plain = openai.OpenAI(base_url=plain_server.url + "/v1", api_key="unused", max_retries=0)
    sampled = dict(model=MODEL, prompt=prompts[:2], max_tokens=6, temperature=1.0, n=2, seed=11)
    first, again = plain.completions.create(**sampled), plain.completions.create(**sampled)
    texts = [c.text for c in first.choices]
    assert [c.index for c in first.choices] == list(range(4)) and texts == [c.text for c in again.choices]
    assert texts[0] != texts[1]  # independent samples of one prompt
    for k, text in enumerate(texts):  # choice i * n + j: prompt i sampled with seed 11 + j
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=11 + k % 2)
        assert text == reference_engine.generate(prompts[k // 2], params)[0].text, k

    # min_p (as in vLLM, in extra_body) reaches the request's sampling
    min_p = plain.completions.create(**(sampled | {"n": 1, "prompt": prompts[0]}), extra_body={"min_p": 0.2})
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, min_p=0.2)
    assert min_p.choices[0].text == reference_engine.generate(prompts[0], params)[0].text

    stream = plain.completions.create(**sampled, stream=True, stream_options={"include_usage": True})
    pieces: dict[int, str] = {}
    usage = None
    for chunk in stream:
        for c in chunk.choices:
            pieces[c.index] = pieces.get(c.index, "") + c.text
        usage = chunk.usage or usage
    assert [pieces[k] for k in range(4)] == texts and usage.completion_tokens == 24
    # more choices than the server ever admits at once (batch 4, no queue) is a 400 naming n, not a 429
    with pytest.raises(openai.BadRequestError, match="^Error code: 400.*n: 6 choices"):
        client.completions.create(**(sampled | {"n": 3, "prompt": prompts[:2]}))

    chat = dict(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=1.0, n=2, seed=3)
    try:
        replies = client.chat.completions.create(**chat)
    except openai.BadRequestError:  # the shipped tiny model has no chat template
        return
    assert [c.index for c in replies.choices] == [0, 1]


def test_logprobs_echo_and_scoring_equal_the_models_own_log_probabilities(server, client, reference_engine):
    """Completions for evaluation harnesses: `logprobs` (top-N per generated token), `echo` (the prompt with its
    scores, the first None) and `max_tokens: 0` (score only). The numbers are log-softmax of the model's full-depth
    logits (an independent cache-free forward here); on a speculating server they are the target's, and the greedy
    token is each position's top-1; echoing a generated text scores its tokens as the generation did."""
    import torch

    ids = reference_engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, logprobs=3, seed=4)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8 and lp.text_offset[0] == 0
    offline = greedy(reference_engine, ids, 8).token_ids
    dense = torch.log_softmax(reference_engine.adapter.dense_logits(ids + offline)[0].float(), -1)
    expected = [dense[len(ids) - 1 + i, t].item() for i, t in enumerate(offline)]
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-4)
    for top, value in zip(lp.top_logprobs, lp.token_logprobs):  # greedy: each token is its position's top-1
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(value, abs=1e-6)

    # echo + max_tokens 0 over prompt + generation: the prompt's scores, then the generation's own
    scored = client.completions.create(model=MODEL, prompt=ids + offline, max_tokens=0, echo=True, logprobs=1)
    echo = scored.choices[0].logprobs
    # each entry holds the N most likely and the token itself, as OpenAI's and vLLM's do (up to N + 1 entries)
    for token, value, top in zip(echo.tokens[1:], echo.token_logprobs[1:], echo.top_logprobs[1:]):
        assert 1 <= len(top) <= 2 and top[token] == pytest.approx(value, abs=1e-6)
    assert echo.token_logprobs[0] is None and len(echo.token_logprobs) == len(ids) + 8
    prompt_expected = [dense[i - 1, t].item() for i, t in enumerate(ids) if i > 0]
    assert echo.token_logprobs[1 : len(ids)] == pytest.approx(prompt_expected, abs=1e-4)
    assert echo.token_logprobs[len(ids) :] == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert scored.choices[0].text == reference_engine.tokenizer.decode(ids + offline)
    assert scored.usage.completion_tokens == 0

    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=2)  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) >= 1 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-6) for c in content)
    assert "".join(c.token for c in content).startswith(chat.choices[0].message.content[:1])


def test_chat_top_logprobs_zero_without_logprobs_asks_for_nothing(server, client):
    """Chat's top_logprobs 0 (vLLM's default, which clients send) without logprobs asks for nothing: taken, as vLLM
    takes it, the reply without log-probabilities; a count above 0 without logprobs: true is a 400 naming it."""
    messages = [{"role": "user", "content": "hi"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    for fields in ({"top_logprobs": 0}, {"top_logprobs": 0, "logprobs": False}):
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0, **fields)
        assert chat.choices[0].message.content == plain.choices[0].message.content
        assert chat.choices[0].logprobs is None
    for fields in ({"top_logprobs": 2}, {"top_logprobs": 1, "logprobs": False}):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, **fields)
        error = refused.value.body
        assert error["param"] == "top_logprobs" and error["message"].startswith("top_logprobs: needs logprobs: true")


def test_logprobs_show_tokens_by_their_own_bytes(server, client, reference_engine):
    """A byte-level token holding part of a character shows as OpenAI's `bytes:\\x..` (not U+FFFD, which would make
    different tokens look alike), its text offset is where its character starts, and a chat entry's bytes are the
    token's own."""
    text = "日本 😀 ok"
    ids = reference_engine.tokenizer.encode(text, add_special_tokens=False)
    scored = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=1)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == text and len(lp.tokens) == len(ids)
    assert lp.tokens[:3] == ["bytes:\\xe6", "bytes:\\x97", "bytes:\\xa5"]  # 日, a byte a token
    # a token starts at the character holding its first byte: the complete characters of the bytes before it
    pieces = [reference_engine.tokenizer.convert_ids_to_tokens(t) for t in ids]
    assert pieces[:3] == ["æ", "Ĺ", "¥"]  # (the byte-level alphabet's e6, 97, a5)
    raw = text.encode()
    starts, position = [], 0
    for token in lp.tokens:
        starts.append(len(raw[:position].decode("utf-8", errors="ignore")))
        position += len(token.encode()) if not token.startswith("bytes:") else token.count("\\x")
    assert lp.text_offset == starts and lp.text_offset[:7] == [0, 0, 0, 1, 1, 1, 2]
    streamed = list(client.completions.create(model=MODEL, prompt=text, max_tokens=6, echo=True, logprobs=1,
                                              temperature=0, stream=True))  # fmt: skip
    offsets = [o for c in streamed if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    whole = client.completions.create(model=MODEL, prompt=text, max_tokens=6, echo=True, logprobs=1, temperature=0)
    assert offsets == whole.choices[0].logprobs.text_offset  # carried across chunks

    from looped_spec.token_bytes import TokenBytes

    tokens = TokenBytes(reference_engine.tokenizer)
    assert b"".join(tokens.raw(t) for t in ids) == text.encode()
    whole_chars = [t for t in ids if "\ufffd" not in reference_engine.tokenizer.decode([t])]
    assert whole_chars and all(tokens.text(t) == reference_engine.tokenizer.decode([t]) for t in whole_chars)


def test_streamed_and_early_exit_logprobs_are_the_generations_own(server, client, reference_engine):
    """Streamed chunks carry the entries of their new tokens (completions and chat), echo streams the prompt first;
    under early exit the entries are those of the depth each token was read out at (the engine's, offline)."""
    ids = reference_engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    whole = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0, logprobs=2, echo=True)
    chunks = list(client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0, logprobs=2,
                                            echo=True, stream=True))  # fmt: skip
    pieces = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs is not None]
    joined = [v for piece in pieces for v in piece.token_logprobs]
    # the two calls may run different plans (the adaptive controller moves between them): a token read in a verify
    # pass of K + 1 positions differs from a one-position pass by float rounding (tests/test_logprobs.py: 1e-5)
    assert joined == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert [o for piece in pieces for o in piece.text_offset] == whole.choices[0].logprobs.text_offset
    assert chunks[0].choices[0].text == reference_engine.tokenizer.decode(ids)  # the prompt first
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text

    # early exit: each token's entry is its exit depth's readout, as the engine returns it offline
    exit_fields = {"exit_threshold": 0.6}
    offline = reference_engine.generate(ids, SamplingParams(max_tokens=10, temperature=0.0, logprobs=1, seed=0,
                                                            **exit_fields))[0]  # fmt: skip
    assert len(offline.metrics.exit_depth_histogram) > 1  # mixed depths
    served = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0, logprobs=1,
                                       extra_body=exit_fields)  # fmt: skip
    expected = [e.logprob for e in offline.logprobs]
    assert served.choices[0].logprobs.token_logprobs == pytest.approx(expected, abs=1e-4)
    streamed = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=6, temperature=0, logprobs=True, top_logprobs=1,
                                              stream=True, extra_body=exit_fields)  # fmt: skip
    content = [c for chunk in streamed if chunk.choices and chunk.choices[0].logprobs
               for c in chunk.choices[0].logprobs.content]  # fmt: skip
    assert len(content) == 6 and all(c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-6) for c in content)
    wait_until(lambda: idle(server), what="the server idle")


def test_bad_requests_are_400_naming_the_field(server, client):
    cases = [
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=10_000), "max_tokens"),
        (dict(n=17), "n"),
        (dict(logprobs=21), "logprobs"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(extra_body={"stop_token_ids": ["x"]}), "stop_token_ids"),
        (dict(extra_body={"min_p": 1.5}), "min_p"),
        (dict(extra_body={"min_p": "0.1"}), "min_p"),
    ]
    for kwargs, field in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=MODEL, prompt=PROMPT, **kwargs)
        body = err.value.body
        assert body["param"].startswith(field), (kwargs, body)
        assert body["message"].startswith(field) and "pydantic" not in body["message"], body
    for stop, named in (("", "stop: an empty string (leave stop out for none)"),
                        (["a", ""], "stop: stop[1] is an empty string")):  # fmt: skip
        with pytest.raises(openai.BadRequestError) as err:  # named as given: a string is not stop[0]
            client.completions.create(model=MODEL, prompt=PROMPT, stop=stop, max_tokens=1)
        assert err.value.body["message"] == named, err.value.body
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        client.completions.create(model=MODEL, prompt="x = 1\n" * 200, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match=r"prompt\[1\]"):
        client.completions.create(model=MODEL, prompt=[1, 99999], max_tokens=1)
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\]\.role"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "robot", "content": "hi"}])
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=1)
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    broken = httpx.post(server.url + "/v1/completions", content=b"{not json", headers=headers)
    assert broken.status_code == 400 and "JSON" in broken.json()["error"]["message"]
    huge = json.dumps({"model": MODEL, "prompt": "x" * (2 << 20)})
    too_large = httpx.post(server.url + "/v1/completions", content=huge, headers=headers)
    assert too_large.status_code == 413 and "--max-body-bytes" in too_large.json()["error"]["message"]


def test_a_text_encoding_outside_the_vocabulary_is_a_400_naming_the_field(tmp_path):
    """A checkpoint whose tokenizer has a token past the model's vocabulary: a text prompt (or a chat) holding it is a
    400 naming `prompt` (`messages`), not one naming an index of ids the client never sent, nor a 500 when scored."""

    folder = with_a_token_past_the_vocabulary(tmp_path / "extra-token", "<extra>", special=False)
    engine = LoopedSpecEngine(str(folder), speculation="off", max_model_len=64)
    cases = [("/v1/completions", {"prompt": "hi <extra>", "max_tokens": 2}, "prompt"),
             ("/v1/completions", {"prompt": "hi <extra>", "max_tokens": 0, "echo": True, "logprobs": 1}, "prompt"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "<extra>"}]}, "messages")]  # fmt: skip
    with ServerThread(engine, MODEL) as running:
        for path, body, field in cases:
            answer = httpx.post(running.url + path, json=body, timeout=60)
            assert answer.status_code == 400, (body, answer.text)
            error = answer.json()["error"]
            assert error["param"] == field and "encodes to token 1024, outside the model's" in error["message"]
    engine.close()


def test_logprobs_beyond_a_small_vocabulary_are_a_400_naming_the_field(tmp_path):
    """A model of 16 tokens asked for the 20 most likely: a 400 naming `logprobs`, generating or scoring (echo scored
    the prompt first and answered a 500 'internal server error: ValueError'; generation's 400 named no field)."""
    engine = LoopedSpecEngine(str(with_small_vocabulary(tmp_path / "vocab-16", 16)), max_model_len=64)
    bodies = [{"max_tokens": 2}, {"max_tokens": 0, "echo": True}, {"max_tokens": 2, "echo": True},
              {"max_tokens": 2, "stream": True}]  # fmt: skip
    with ServerThread(engine, MODEL) as running:
        for body in bodies:
            answer = httpx.post(running.url + "/v1/completions", json={"prompt": [1, 2, 3], "logprobs": 20} | body,
                                timeout=60)  # fmt: skip
            assert answer.status_code == 400, (body, answer.text)
            error = answer.json()["error"]
            assert error["param"] == "logprobs" and "vocabulary holds (16)" in error["message"], body
        whole = httpx.post(running.url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 0, "echo": True,
                                                                  "logprobs": 16}, timeout=60)  # fmt: skip
        assert [len(top) for top in whole.json()["choices"][0]["logprobs"]["top_logprobs"][1:]] == [16, 16]
    engine.close()


def test_chat_top_logprobs_beyond_a_small_vocabulary_are_a_400_naming_top_logprobs(tmp_path):
    """Chat's count of the most likely tokens is `top_logprobs` (`logprobs` is its switch): a model of 16 tokens asked
    for 20 is a 400 naming top_logprobs, streamed or not. The 16-token copy gets tiny-ouro's tokenizer and a server
    template that writes the messages' text alone ("!" is token 1)."""
    import shutil

    from looped_spec.models import shipped_model_path
    from looped_spec.server.chat_template import ChatTemplateConfig

    folder = with_small_vocabulary(tmp_path / "vocab-16", 16)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(shipped_model_path(MODEL) / name, folder / name)
    template = ChatTemplateConfig(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    engine = LoopedSpecEngine(str(folder), speculation="off", max_model_len=64)
    chat = {"messages": [{"role": "user", "content": "!"}], "max_tokens": 2, "logprobs": True}
    with ServerThread(engine, MODEL, chat_template=template) as running:
        for body in ({"top_logprobs": 20}, {"top_logprobs": 20, "stream": True}):
            answer = httpx.post(running.url + "/v1/chat/completions", json=chat | body, timeout=60)
            assert answer.status_code == 400, (body, answer.text)
            error = answer.json()["error"]
            assert error["param"] == "top_logprobs" and error["message"].startswith("top_logprobs=20: more"), error
        whole = httpx.post(running.url + "/v1/chat/completions", json=chat | {"top_logprobs": 16}, timeout=60)
        assert [len(t["top_logprobs"]) for t in whole.json()["choices"][0]["logprobs"]["content"]] == [16, 16]
    engine.close()


def test_a_tokenizer_eos_outside_the_vocabulary_stops_nothing_served_as_offline(tmp_path):
    """A tokenizer whose eos is a token past the model's vocabulary: the engine leaves it out of its eos tokens (the
    model cannot generate it), so offline requests run; the server added it to every request's stop_token_ids, so
    each was a 400 naming stop_token_ids, which the client never sent. The server now stops where the engine does."""

    folder = with_a_token_past_the_vocabulary(tmp_path / "eos-past-vocabulary", "<end>", special=True)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config | {"eos_token": "<end>"}))
    engine = LoopedSpecEngine(str(folder), speculation="off", max_model_len=64)
    assert engine.tokenizer.eos_token_id == 1024 and engine.eos_token_ids == engine.adapter.eos_token_ids
    offline = engine.generate("hi", SamplingParams(max_tokens=3))[0]
    with ServerThread(engine, MODEL) as running:
        answer = httpx.post(running.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0},
                            timeout=60)  # fmt: skip
    engine.close()
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == offline.text


def test_score_only_streams_and_counts_against_admission(server, client, monkeypatch):
    """`max_tokens: 0` with echo scores the prompts: streamed it is a server-sent-event stream (a chunk per choice,
    the usage chunk when asked, [DONE]) equal to the plain answer; more prompts than the server ever admits is a
    400 naming the prompt, as for generation; a prompt of exactly max_model_len tokens may be scored."""
    prompts = [PROMPT, "import os"]
    fields = dict(model=MODEL, prompt=prompts, max_tokens=0, echo=True, logprobs=2)
    whole = client.completions.create(**fields)
    chunks = list(client.completions.create(**fields, stream=True, stream_options={"include_usage": True}))
    assert [c.choices[0].index for c in chunks[:-1]] == [0, 1] and chunks[-1].choices == []
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens and chunks[-1].usage.completion_tokens == 0
    for chunk, choice in zip(chunks, whole.choices):
        assert chunk.choices[0].text == choice.text and chunk.choices[0].finish_reason == "length"
        assert chunk.choices[0].logprobs.token_logprobs == choice.logprobs.token_logprobs
    ticks = iter(range(1000, 2000))
    monkeypatch.setattr("looped_spec.server.app.now", lambda: next(ticks))  # every call a new second
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, stream=True))
    chat = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                               stream=True))  # fmt: skip
    assert len({c.created for c in streamed}) == 1 and len({c.created for c in chat}) == 1  # one time per response
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=["x"] * (MAX_BATCH + 1), max_tokens=0, echo=True, logprobs=1)
    assert err.value.body["param"] == "prompt" and "exceed" in err.value.body["message"]
    full = client.completions.create(model=MODEL, prompt=[5] * 256, max_tokens=0, echo=True, logprobs=1)
    assert len(full.choices[0].logprobs.token_logprobs) == 256
    with pytest.raises(openai.BadRequestError, match="fewer than max_model_len"):
        client.completions.create(model=MODEL, prompt=[5] * 256, max_tokens=1)
    wait_until(lambda: idle(server), what="the server idle")


def test_what_openai_refuses_is_refused_naming_the_field(server, client, monkeypatch):
    """Types are strict as OpenAI's (no silent conversion), text must be valid Unicode, stream options need a stream,
    stop tokens must be in the vocabulary; a bug of the server's own is still a JSON error body."""
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}

    def post(path: str, body: str) -> httpx.Response:
        return httpx.post(server.url + path, content=body, headers=headers, timeout=60)

    completions, chat = "/v1/completions", "/v1/chat/completions"
    text_parts = '[{"type": "text", "text": "a"}, {"type": "text", "text": "\\udfff"}]'
    cases = [  # (endpoint, the body's fields beside the model, the field the 400 must name)
        (completions, '"prompt": "\\ud800", "max_tokens": 2', "prompt"),
        (completions, '"prompt": ["a", "\\udfff"], "max_tokens": 2', "prompt[1]"),
        (chat, '"messages": [{"role": "user", "content": "\\ud800"}]', "messages[0].content"),
        (completions, '"prompt": "a", "max_tokens": "5"', "max_tokens"),
        (completions, '"prompt": "a", "max_tokens": 2, "logprobs": true', "logprobs"),
        (completions, '"prompt": "a", "n": 2.0', "n"),
        (completions, '"prompt": "a", "temperature": NaN', "temperature"),
        (completions, '"prompt": "a", "stream_options": {"include_usage": true}', "stream_options"),
        (completions, f'"prompt": "a", "stop_token_ids": [{2**40}]', "stop_token_ids"),
        (completions, '"prompt": "a", "stop": ["x", "\\ud800"]', "stop[1]"),
        (chat, f'"messages": [{{"role": "user", "content": {text_parts}}}]', "messages[0].content[1].text"),
        # options not built are taken at their neutral values only (below); other values name the field
        (completions, '"prompt": "a", "presence_penalty": 2.5', "presence_penalty"),
        (chat, '"messages": [{"role": "user", "content": "a"}], "frequency_penalty": -3', "frequency_penalty"),
        (completions, '"prompt": "a", "repetition_penalty": 0', "repetition_penalty"),
        (completions, '"prompt": "a", "repetition_penalty": 1e-300', "repetition_penalty"),
        (completions, '"prompt": "a", "logit_bias": {"5": 101}', "logit_bias"),
        (completions, '"prompt": "a", "logit_bias": {"x": 1}', "logit_bias"),
        (completions, '"prompt": "a", "logit_bias": {"05": 1, "5": -1}', "logit_bias"),
        (completions, '"prompt": "a", "logit_bias": {"99999": 1}', "logit_bias"),
        (completions, '"prompt": "a", "max_tokens": 4, "min_tokens": 5', "min_tokens"),
        (completions, '"prompt": "a", "max_tokens": 0, "echo": true, "min_tokens": 1', "min_tokens"),
        (chat, '"messages": [{"role": "user", "content": "a"}], "min_tokens": -1', "min_tokens"),
        # a score is read at full depth: an early-exit field with max_tokens 0 was taken and did nothing
        (completions, '"prompt": "a", "max_tokens": 0, "echo": true, "logprobs": 2, "exit_at_step": 1', "exit_at_step"),
        (completions, '"prompt": "a", "max_tokens": 0, "echo": true, "exit_threshold": 0.5', "exit_threshold"),
        (completions, '"prompt": "a", "structured_outputs": {"regex": "(a"}', "structured_outputs.regex"),
        (
            completions,
            '"prompt": "a", "max_tokens": 0, "echo": true, "structured_outputs": {"regex": "a"}',
            "structured_outputs.regex",
        ),
        (completions, '"prompt": "a", "structured_outputs": {"regex": "a", "choice": ["b"]}', "structured_outputs"),
        (
            chat,
            '"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_schema", '
            '"json_schema": {"name": "x", "schema": {"type": "bogus"}}}',
            "response_format.json_schema.schema",
        ),
        (  # a $ref cycle no value satisfies: found at the grammar's first mask (it was a 500 once generating)
            chat,
            '"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_schema", '
            '"json_schema": {"name": "x", "schema": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, '
            '"b": {"$ref": "#/$defs/a"}}}}}',
            "response_format.json_schema.schema",
        ),
        (completions, '"prompt": "a", "structured_outputs": {"regex": "a[^\\\\s\\\\S]b"}', "structured_outputs.regex"),
        (
            chat,
            '"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_schema"}',
            "response_format",
        ),
        (
            chat,
            '"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_object"}, '
            '"structured_outputs": {"regex": "a"}',
            "structured_outputs",
        ),
        (completions, '"prompt": "a", "best_of": 3', "best_of"),
        (completions, '"prompt": "a", "suffix": "return x"', "suffix"),
        (chat, '"messages": [{"role": "user", "content": "a"}], "functions": []', "functions"),
    ]
    for path, fields, field in cases:
        body = f'{{"model": "{MODEL}", {fields}}}'
        answer = post(path, body)
        error = answer.json()["error"]
        assert answer.status_code == 400 and error["param"] == field, (body, answer.text)
        assert error["message"].startswith(field) and error["type"] == "invalid_request_error", error
    # an integer temperature is still a number
    assert post(
        "/v1/completions", f'{{"model": "{MODEL}", "prompt": "a", "max_tokens": 1, "temperature": 0}}'
    ).is_success
    # every field refused is named, not only the first
    answer = post(completions, f'{{"model": "{MODEL}", "prompt": "a", "tools": [], "functions": []}}')
    assert answer.status_code == 400 and answer.json()["error"]["message"] == "tools, functions: not supported fields"
    # within a union's value, the part at fault (not the first branch's complaint about the whole field), once: each
    # of the union's branches failing is one more error on the same field
    for endpoint, fields, named in (
        (completions, '"prompt": [1, "a"]', "prompt[1]"),
        (completions, '"prompt": 5', "prompt"),
        (completions, '"prompt": "a", "stop": 5', "stop"),
        (chat, '"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]',
         "messages[0].content[0].text"),
        (chat, '"messages": [{"role": "user", "content": "x"}], "tool_choice": {"type": "function"}',
         "tool_choice.function"),
    ):  # fmt: skip
        error = post(endpoint, f'{{"model": "{MODEL}", {fields}}}').json()["error"]
        assert error["param"] == named and error["message"].startswith(f"{named}: "), error
        assert "; " not in error["message"], error
    # chat's max_completion_tokens named as given; an empty body said to be one
    body = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], "max_completion_tokens": 99999}}'
    error = post(chat, body).json()["error"]
    assert error["param"] == "max_completion_tokens" and error["message"].startswith("max_completion_tokens: 99999 +")
    assert post(completions, "").json()["error"]["message"] == "the request body is empty: send a JSON object"
    # a misspelt field is told the field it was likely meant to be
    # a vLLM field this server lacks says what stands for it, not a guess ('did you mean skip_special_tokens?')
    answer = post(completions, f'{{"model": "{MODEL}", "prompt": "a", "spaces_between_special_tokens": false}}')
    message = answer.json()["error"]["message"]
    assert "spaces_between_special_tokens (not supported: special tokens are decoded" in message, message
    assert "did you mean" not in message
    # vLLM's prompt_logprobs: where the prompt's scores are here (the guess named chat's top_logprobs)
    for endpoint, fields in ((completions, '"prompt": "a"'), (chat, '"messages": [{"role": "user", "content": "a"}]')):
        error = post(endpoint, f'{{"model": "{MODEL}", {fields}, "prompt_logprobs": 1}}').json()["error"]
        assert error["param"] == "prompt_logprobs" and "echo with logprobs" in error["message"], error
        assert "did you mean" not in error["message"]
    # OpenAI's fields not served are named as sent, not guessed at ('reasoning_effort': did you mean response_format?)
    for field, value in (("reasoning_effort", '"low"'), ("store", "true"), ("web_search_options", "{}")):
        error = post(
            chat, f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "a"}}], "{field}": {value}}}'
        )
        assert error.json()["error"]["message"] == f"{field}: not a supported field", error.text
    answer = post(completions, f'{{"model": "{MODEL}", "prompt": "a", "temprature": 0.5}}')
    error = answer.json()["error"]
    assert error["message"] == "temprature (did you mean 'temperature'?): not a supported field", error
    assert error["param"] == "temprature"
    answer = post(completions, f'{{"model": "{MODEL}", "prompt": "a", "best_of": 2, "tools": [], "n": 2.0}}')
    error = answer.json()["error"]
    named = [part.split(":")[0] for part in error["message"].split("; ")]
    assert (answer.status_code, error["param"], named) == (400, "n", ["n", "best_of", "tools"]), error
    # neutral values of the options not built change nothing: accepted, as benchmark clients send them
    neutral = '"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {"5": 0}'
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
    body = f'{{"model": "{MODEL}", "prompt": {json.dumps(PROMPT)}, "max_tokens": 4, "temperature": 0, {neutral}, '
    answer = post(completions, body + '"best_of": 1, "suffix": ""}')
    assert answer.status_code == 200 and answer.json()["choices"][0]["text"] == plain, answer.text
    chat_body = f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "a"}}], "max_tokens": 2, {neutral}}}'
    assert post(chat, chat_body).status_code == 200

    lower = httpx.get(server.url + "/v1/models", headers={"Authorization": f"bearer {API_KEY}"})
    assert lower.status_code == 200  # the auth scheme is case-insensitive
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")
    wrong_method = httpx.get(server.url + "/v1/completions", headers=headers)
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["type"] == "invalid_request_error"

    def refusing_template(*args, **kwargs):
        from jinja2 import TemplateError

        raise TemplateError("Conversation roles must alternate user/assistant/user/assistant/...")

    # a template's raise_exception
    monkeypatch.setattr("looped_spec.server.chat_template.render_chat", refusing_template)
    answer = post("/v1/chat/completions", f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "a"}}]}}')
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages"
    assert "roles must alternate" in answer.json()["error"]["message"]
    monkeypatch.undo()

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(server.app.state.serving, "prompt_lists", broken)
    answer = post("/v1/completions", f'{{"model": "{MODEL}", "prompt": "a", "max_tokens": 1}}')
    assert answer.status_code == 500 and answer.json()["error"]["type"] == "server_error"
    monkeypatch.undo()
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_vllm_scripts_fields_this_server_lacks_say_what_stands_for_them(server, client):
    """A vLLM user's script sends vLLM's own fields in extra_body: its guided_* fields (vLLM's docs until 0.12, now
    structured_outputs) and beam search's are a 400 naming the field and what to send instead, never a guess at
    another field ('length_penalty': did you mean 'presence_penalty'?)."""
    messages = [{"role": "user", "content": "Classify this sentiment: vLLM is wonderful!"}]
    for extra, field, told in (
        ({"guided_choice": ["positive", "negative"]}, "guided_choice", 'structured_outputs: {"choice": ...}'),
        ({"guided_json": {"type": "object"}}, "guided_json", 'structured_outputs: {"json": ...}'),
        ({"guided_regex": "a+"}, "guided_regex", 'structured_outputs: {"regex": ...}'),
        ({"guided_grammar": 'root ::= "a"'}, "guided_grammar", 'structured_outputs: {"grammar": ...}'),
        ({"guided_decoding_backend": "xgrammar"}, "guided_decoding_backend", "leave it out"),
    ):
        for create, prompt in ((client.chat.completions.create, {"messages": messages}),
                               (client.completions.create, {"prompt": "a"})):  # fmt: skip
            with pytest.raises(openai.BadRequestError) as refused:
                create(model=MODEL, max_tokens=2, extra_body=extra, **prompt)
            error = refused.value.body
            assert error["param"] == field and error["message"].startswith(f"{field} ("), error
            assert told in error["message"] and "did you mean" not in error["message"], error
    # what the hint says to send runs
    choice = {"structured_outputs": {"choice": ["positive", "negative"]}}
    answer = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, extra_body=choice)
    assert answer.choices[0].message.content in ("positive", "negative")


def test_vllm_beam_search_fields_at_their_neutral_values_change_nothing(server, client):
    """vLLM's clients may send beam search's fields at vLLM's defaults, use_beam_search false and length_penalty 1.0
    (or null, unset): taken on both endpoints as sampling without them; any other value is a 400 naming the field,
    as beam search is not offered here (vLLM ignores a length_penalty without beam search; here it would be ignored
    silently, so it is refused)."""
    messages = [{"role": "user", "content": "Classify this sentiment: vLLM is wonderful!"}]
    endpoints = (
        (client.chat.completions.create, {"messages": messages}, lambda answer: answer.choices[0].message.content),
        (client.completions.create, {"prompt": PROMPT}, lambda answer: answer.choices[0].text),
    )
    for create, prompt, text in endpoints:
        plain = text(create(model=MODEL, max_tokens=4, temperature=0, **prompt))
        for neutral in ({"use_beam_search": False, "length_penalty": 1.0}, {"length_penalty": 1},
                        {"use_beam_search": None, "length_penalty": None}):  # fmt: skip
            assert text(create(model=MODEL, max_tokens=4, temperature=0, extra_body=neutral, **prompt)) == plain
        for extra, field in (({"use_beam_search": True}, "use_beam_search"),
                             ({"length_penalty": 2.0}, "length_penalty"),
                             ({"length_penalty": 0.5, "use_beam_search": False}, "length_penalty")):  # fmt: skip
            with pytest.raises(openai.BadRequestError) as refused:
                create(model=MODEL, max_tokens=2, extra_body=extra, **prompt)
            error = refused.value.body
            assert error["param"] == field and error["message"].startswith(f"{field}: "), error
            assert "beam search is not offered here" in error["message"], error


def test_an_engine_refusal_inside_a_stream_is_an_error_event(server, monkeypatch):
    """Once a stream's headers are sent, a request the engine's worker refuses ends with a 400 error event and
    [DONE], not a cut connection."""

    def refuse(*args, **kwargs):
        raise ValueError("prompt: refused by the engine")

    monkeypatch.setattr(server.engine, "add_request", refuse)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=60) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == 400 and "refused by the engine" in error["message"]
    monkeypatch.undo()
    wait_until(lambda: idle(server), what="the server idle")


def test_a_request_that_fails_inside_a_stream_is_a_500_error_event(server, monkeypatch):
    """A request the engine finishes with an error after the headers are sent (here its text cannot be decoded) ends
    its stream with a 500 error event (the server's fault, not the client's 400) and [DONE]; the server goes on."""
    from looped_spec.detokenizer import IncrementalDetokenizer

    def broken(self, token_id, find_stop=True):
        raise RuntimeError("injected decode failure")

    monkeypatch.setattr(IncrementalDetokenizer, "append", broken)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True, "stop": ["never"]}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=60) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == 500 and "injected decode failure" in error["message"], error
    monkeypatch.undo()
    wait_until(lambda: idle(server), what="the server idle")


def poison_embedding(engine, monkeypatch, clean: str) -> str:
    """A prompt whose tokens the model fails on (its embedding raises) wherever they appear, unlike the tokens of
    `clean`: a request that causes a fault in model code every time it runs."""
    poison = "Ω poisoned"
    poison_ids = set(engine.tokenizer.encode(poison, add_special_tokens=False)) - set(
        engine.tokenizer.encode(clean, add_special_tokens=False)
    )
    assert poison_ids
    real_embed = engine.adapter.embed

    def embed(token_ids, ctx):
        if poison_ids & set(token_ids.tolist()):
            raise RuntimeError("injected fault: poisoned token")
        return real_embed(token_ids, ctx)

    monkeypatch.setattr(engine.adapter, "embed", embed)
    return poison


def slowed(real, seconds: float):
    def run(*args, **kwargs):
        time.sleep(seconds)
        return real(*args, **kwargs)

    return run


def test_full_queue_is_429_and_disconnect_aborts(server, client, monkeypatch):
    """MAX_BATCH long streams fill the server (max_queued=0); closing them aborts them and frees their KV."""
    # slow every decode round so the streams are surely still running when the queue is checked
    monkeypatch.setattr(server.engine.runner, "decode", slowed(server.engine.runner.decode, 0.05))
    monkeypatch.setattr(server.engine.spec_round, "run", slowed(server.engine.spec_round.run, 0.05))
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "temperature": 0,
            "stream": True}  # fmt: skip
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as http:
        streams = [http.stream("POST", "/v1/completions", json=body) for _ in range(MAX_BATCH)]
        responses = [s.__enter__() for s in streams]
        try:
            assert [r.status_code for r in responses] == [200] * MAX_BATCH
            lines = [r.iter_lines() for r in responses]  # kept: dropping one closes its connection
            for it in lines:
                assert next(it).startswith("data: ")  # generation started
            assert server.async_engine.num_in_flight == MAX_BATCH
            with pytest.raises(openai.RateLimitError) as err:
                client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
            assert err.value.response.headers["retry-after"] == "1"
            assert err.value.response.json()["error"]["type"] == "rate_limit_error"  # OpenAI's type for a 429
            generated_before = server.engine.stats.num_generation_tokens
        finally:
            for s in streams:
                s.__exit__(None, None, None)
    wait_until(lambda: idle(server), what="aborted requests freed")
    # each stream stopped well before its 200 tokens
    assert server.engine.stats.num_generation_tokens - generated_before < MAX_BATCH * 150
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_a_real_burst_gets_429_beyond_the_queue_and_the_admitted_requests_complete(reference_engine):
    """Many concurrent clients at once against a server admitting batch + queue: the rest get 429 with Retry-After,
    every admitted request completes equal to offline greedy, and the server serves after the burst."""
    import asyncio

    engine = LoopedSpecEngine(MODEL, speculation="off", max_batch_size=2, max_model_len=128)
    runner = engine.runner
    runner.decode = slowed(runner.decode, 0.01)  # the burst arrives while the first requests still decode
    prompts = ["def fibonacci(n):", "import os", "class A:", "x = ["]
    expected = {p: greedy(reference_engine, p, 8).text for p in prompts}
    with ServerThread(engine, MODEL, max_queued=2) as running:
        client = openai.AsyncOpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=60)

        async def one(i: int):
            prompt = prompts[i % len(prompts)]
            try:
                out = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
            except openai.RateLimitError as exc:
                return "429", exc.response.headers.get("retry-after")
            return prompt, out.choices[0].text

        async def burst():
            return await asyncio.gather(*(one(i) for i in range(24)))

        results = asyncio.run(burst())
        limited = [r for r in results if r[0] == "429"]
        served = [r for r in results if r[0] != "429"]
        assert limited and all(retry == "1" for _, retry in limited)
        assert len(served) >= 4 and all(text == expected[prompt] for prompt, text in served)
        wait_until(lambda: idle(running), what="burst drained")
        after = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        assert (
            after.completions.create(model=MODEL, prompt=prompts[0], max_tokens=8, temperature=0).choices[0].text
            == expected[prompts[0]]
        )


def test_a_stopped_engine_is_503_and_a_shutdown_ends_open_streams_with_an_error(reference_engine):
    """Shutting the engine down mid-stream ends the open stream with an error event (never a hang); afterwards
    completions are 503 with Retry-After and /health reports 503."""
    import threading

    engine = LoopedSpecEngine(MODEL, speculation="off", max_model_len=256)
    engine.runner.decode = slowed(engine.runner.decode, 0.02)
    with ServerThread(engine, MODEL) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        assert httpx.get(running.url + "/health").status_code == 200
        stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        chunks = iter(stream)
        next(chunks)  # generating
        threading.Thread(target=running.async_engine.shutdown).start()
        with pytest.raises(openai.APIError, match="shut down"):
            for _ in chunks:
                pass
        wait_until(lambda: not running.async_engine.is_running, what="engine stopped")
        with pytest.raises(openai.APIStatusError) as err:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert err.value.status_code == 503 and err.value.response.headers["retry-after"] == "1"
        health = httpx.get(running.url + "/health")
        assert health.status_code == 503 and health.json() == {"status": "engine stopped"}


def test_a_server_shutting_down_ends_open_requests_with_an_error_not_a_cut(reference_engine):
    """SIGTERM with requests still running: after the graceful period (less a second) a stream ends with an error
    event and [DONE], and an answer not streamed is a 503, instead of connections cut mid-response."""
    import threading

    engine = LoopedSpecEngine(MODEL, speculation="off", max_model_len=256)
    engine.runner.decode = slowed(engine.runner.decode, 0.02)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True}
    running = ServerThread(engine, MODEL, graceful_seconds=1.5).__enter__()
    answers = {}

    def not_streamed():
        answers["whole"] = httpx.post(running.url + "/v1/completions", json=body, timeout=60)

    with httpx.stream("POST", running.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as stream:
        lines = stream.iter_lines()
        assert next(lines).startswith("data: {")  # generating
        waiter = threading.Thread(target=not_streamed)
        waiter.start()
        wait_until(lambda: running.async_engine.num_in_flight == 2, what="both requests running")
        started = time.monotonic()
        running.server.should_exit = True  # what uvicorn's SIGTERM handler sets
        events = [line for line in lines if line.startswith("data: ")]
    waiter.join(30)
    running.__exit__(None, None, None)
    assert events[-1] == "data: [DONE]" and "shutting down" in events[-2], events[-3:]
    assert 0.3 < time.monotonic() - started < 5  # after most of the graceful period, not at once, not cut off
    assert answers["whole"].status_code == 503 and "shutting down" in answers["whole"].json()["error"]["message"]


def test_non_streaming_client_that_leaves_has_its_request_aborted(server, monkeypatch):
    monkeypatch.setattr(server.engine.runner, "decode", slowed(server.engine.runner.decode, 0.05))
    monkeypatch.setattr(server.engine.spec_round, "run", slowed(server.engine.spec_round.run, 0.05))
    before = server.engine.stats.num_generation_tokens
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                   timeout=httpx.Timeout(60, read=0.5))  # fmt: skip
    wait_until(lambda: idle(server), what="abandoned request aborted")
    assert server.engine.stats.num_generation_tokens - before < 150


def test_a_cancelled_handler_aborts_its_request_as_ray_serve_cancels_it(monkeypatch):
    """Behind Ray Serve's proxy a client that leaves is not an http.disconnect: Ray cancels the replica's handler. A
    request not streamed (and one whose echo is being scored) must be aborted then, its KV freed, not run on to its
    last token for nobody."""
    import asyncio

    engine = LoopedSpecEngine(MODEL, speculation="off", max_model_len=256)
    engine.runner.decode = slowed(engine.runner.decode, 0.02)
    front = AsyncLoopedSpecEngine(engine)
    app = build_app(front, MODEL)
    body = json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "headers": [(b"content-type", b"application/json")], "http_version": "1.1",
             "scheme": "http", "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 1), "root_path": ""}  # fmt: skip

    async def run() -> tuple[int, int]:
        sent: list[dict] = []
        first = True

        async def receive() -> dict:
            nonlocal first
            if first:
                first = False
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # Ray's receive: no disconnect message before the cancellation

        async def send(message: dict) -> None:
            sent.append(message)

        handler = asyncio.ensure_future(app(scope, receive, send))
        while front.num_in_flight == 0 or engine.stats.num_generation_tokens == 0:
            await asyncio.sleep(0.01)
        handler.cancel()  # what Ray Serve does when the client disconnects
        await asyncio.gather(handler, return_exceptions=True)
        before = engine.stats.num_generation_tokens
        for _ in range(300):  # up to 3 s for the worker to apply the abort
            if front.num_in_flight == 0 and not engine.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        return front.num_in_flight, engine.stats.num_generation_tokens - before

    with front:
        in_flight, generated_after = asyncio.run(run())
        assert in_flight == 0 and generated_after < 150, "the request ran on for nobody"
        wait_until(lambda: not engine.has_unfinished_requests(), what="the request aborted")
        assert engine.num_free_blocks == engine.kv.num_blocks


def test_a_one_shot_engine_fault_is_retried_and_the_stream_completes(server, client, reference_engine, monkeypatch):
    """One failure policy (the engine's): a step that fails once leaves every request as it was and is retried."""
    engine = server.engine
    calls = {"n": 0}
    real_round = engine.spec_round.run

    def fails_once(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected fault")
        return real_round(*args, **kwargs)

    monkeypatch.setattr(engine.spec_round, "run", fails_once)
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0, stream=True)
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert calls["n"] > 3
    assert text == greedy(reference_engine, PROMPT, 20).text
    wait_until(lambda: idle(server), what="request freed")


def test_a_poisoned_request_fails_alone_and_the_concurrent_streams_complete(server, client, reference_engine,
                                                                           monkeypatch):  # fmt: skip
    """A fault that strikes every step the poisoned request is in: the engine runs the failed step's requests alone,
    the poisoned one fails alone twice and ends with an error event; the others complete equal to offline greedy, and
    the server keeps serving."""
    import threading

    engine = server.engine
    poison = poison_embedding(engine, monkeypatch, clean="def fibonacci(n): import os class A:")
    prompts = ["def fibonacci(n):", poison, "import os", "class A:"]
    results: dict[int, object] = {}

    def ask(i: int) -> None:
        try:
            stream = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=10, temperature=0,
                                               stream=True)  # fmt: skip
            results[i] = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        except openai.APIError as exc:
            results[i] = exc

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert isinstance(results[1], openai.APIError) and "poisoned token" in str(results[1])
    for i in (0, 2, 3):
        assert results[i] == greedy(reference_engine, prompts[i], 10).text, i
    wait_until(lambda: idle(server), what="failed request freed")
    monkeypatch.undo()
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.usage.completion_tokens == 4


def test_a_choice_that_fails_ends_its_answer_not_streamed_at_once_and_aborts_the_others(server, client, monkeypatch):
    """A request of several choices answered whole: one choice finished with an error makes the answer a 500, as a
    stream ends at its error event. The other choices are aborted then (their KV freed), not run to their last token
    for an answer that is already an error."""
    engine = server.engine
    poison = poison_embedding(engine, monkeypatch, clean=PROMPT)
    monkeypatch.setattr(engine.runner, "decode", slowed(engine.runner.decode, 0.05))
    monkeypatch.setattr(engine.spec_round, "run", slowed(engine.spec_round.run, 0.05))
    before = engine.stats.num_generation_tokens
    with pytest.raises(openai.InternalServerError, match="poisoned token"):
        client.completions.create(model=MODEL, prompt=[PROMPT, poison], max_tokens=200, temperature=0,
                                  extra_body={"ignore_eos": True})  # fmt: skip
    wait_until(lambda: idle(server), what="the other choice aborted")
    assert engine.stats.num_generation_tokens - before < 150


def test_metrics_parse_and_match_engine_stats(server, client):
    for _ in range(5):  # the latency counts below need 5 requests, whichever tests ran on this server before
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    wait_until(lambda: idle(server), what="server idle")
    text = httpx.get(server.url + "/metrics").text
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name")))] = s.value
            assert s.labels.get("model_name") == MODEL
    stats = server.engine.stats.to_dict()
    for metric, key in [
        ("generation_tokens_total", "num_generation_tokens"),
        ("prompt_tokens_total", "num_prompt_tokens"),
        ("request_failure_total", "num_requests_failed"),
        ("spec_decode_num_draft_tokens_total", "num_draft_tokens"),
        ("spec_decode_num_accepted_tokens_total", "num_accepted_tokens"),
        ("spec_decode_num_drafts_total", "num_drafts"),
        ("decode_rounds_total", "num_rounds"),
        ("num_preemptions_total", "num_preemptions"),
    ]:
        assert samples[("looped_spec:" + metric, ())] == stats[key], metric
    # by finish reason, as vLLM's: stop and length make up num_requests_finished
    success = {dict(labels)["finished_reason"]: v for (name, labels), v in samples.items()
               if name == "looped_spec:request_success_total"}  # fmt: skip
    assert set(success) == {"stop", "length", "abort"}
    assert success["stop"] + success["length"] == stats["num_requests_finished"]
    assert success == {reason: stats["finished_reasons"].get(reason, 0) for reason in success}
    per_pos = {int(dict(labels)["position"]): v for (name, labels), v in samples.items()
               if name == "looped_spec:spec_decode_num_accepted_tokens_per_pos_total"}  # fmt: skip
    assert sum(per_pos.values()) == stats["num_accepted_tokens"]
    assert samples[("looped_spec:num_requests_running", ())] == 0
    assert samples[("looped_spec:kv_cache_usage_perc", ())] == 0.0
    assert samples[("looped_spec:time_to_first_token_seconds_count", ())] >= 5
    assert samples[("looped_spec:e2e_request_latency_seconds_count", ())] >= 5
    assert any(name == "looped_spec:spec_plan_k" for name, _ in samples)


def test_chat_without_a_template_and_a_threshold_without_an_exit_signal_are_400():
    engine = LoopedSpecEngine("tiny-nanbeige", speculation="off", max_model_len=64)
    with ServerThread(engine, "tiny-nanbeige") as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="chat_template"):
            client.chat.completions.create(model="tiny-nanbeige", messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError, match="^Error code: 400.*exit_threshold=0.5: .*no exit signal"):
            client.completions.create(model="tiny-nanbeige", prompt="x", max_tokens=2,
                                      extra_body={"exit_threshold": 0.5})  # fmt: skip
        # a fixed depth works on every family
        out = client.completions.create(model="tiny-nanbeige", prompt="x", max_tokens=2, extra_body={"exit_at_step": 1})
        assert out.usage.completion_tokens >= 1


# ----- early exit: request fields and /metrics (a server with speculation off: early exit runs in plain decoding)
@pytest.fixture(scope="module")
def plain_server():
    engine = LoopedSpecEngine(MODEL, speculation="off", max_model_len=256)
    with ServerThread(engine, MODEL) as running:
        yield running


def exit_metrics(url: str) -> dict:
    """The early-exit samples of /metrics: {name or (name, le): value}."""
    out = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        if family.name.startswith("looped_spec:exit_"):
            for s in family.samples:
                out[(s.name, s.labels["le"]) if "le" in s.labels else s.name] = s.value
    return out


def test_exit_fields_run_as_the_engine_does_and_fill_the_exit_metrics(plain_server, reference_engine):
    client = openai.OpenAI(base_url=plain_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    depth = plain_server.engine.adapter.full_depth
    full = greedy(reference_engine, PROMPT, 16, ignore_eos=True)
    ref = greedy(reference_engine, PROMPT, 16, ignore_eos=True, exit_at_step=1)
    assert ref.token_ids != full.token_ids  # one loop changes the output: the field is seen to act
    extra = {"ignore_eos": True, "exit_at_step": 1}
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body=extra)
    assert out.choices[0].text == ref.text and out.usage.completion_tokens == 16
    wait_until(lambda: idle(plain_server), what="server idle")
    # 16 tokens read out at depth 1; the first from the prompt's last position, which ran every loop
    want = {("looped_spec:exit_depth_bucket", str(b)) for b in range(1, depth + 1)}
    got = exit_metrics(plain_server.url)
    assert want <= set(got) and all(got[key] == 16 for key in want)
    assert got[("looped_spec:exit_depth_bucket", "+Inf")] == got["looped_spec:exit_depth_count"] == 16
    assert got["looped_spec:exit_depth_sum"] == 16
    assert got["looped_spec:exit_loops_run_total"] == depth + 15
    assert got["looped_spec:exit_loops_saved_total"] == 15 * (depth - 1)
    # a threshold, streamed: the same text as the engine's, and the metrics are exactly engine.stats
    ref = greedy(reference_engine, PROMPT, 16, ignore_eos=True, exit_threshold=0.5)
    chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True, "exit_threshold": 0.5})  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    wait_until(lambda: idle(plain_server), what="server idle")
    stats, got = plain_server.engine.stats, exit_metrics(plain_server.url)
    for b in range(1, depth + 1):
        assert got[("looped_spec:exit_depth_bucket", str(b))] == sum(
            n for d, n in stats.exit_depth_histogram.items() if d <= b
        )
    assert got["looped_spec:exit_depth_count"] == 32
    assert got["looped_spec:exit_loops_run_total"] / got["looped_spec:exit_depth_count"] == stats.mean_loops_per_token
    assert got["looped_spec:exit_loops_saved_total"] == stats.num_exit_loops_saved


def test_bad_exit_fields_are_400_naming_the_field(server, client, plain_server):
    plain = openai.OpenAI(base_url=plain_server.url + "/v1", api_key="unused", max_retries=0)
    depth = plain_server.engine.adapter.full_depth
    cases = [
        (plain, {"exit_threshold": 0}, "exit_threshold", "greater than 0"),
        (plain, {"exit_threshold": "high"}, "exit_threshold", "valid number"),
        (plain, {"exit_at_step": 0}, "exit_at_step", "greater than or equal to 1"),
        (plain, {"exit_at_step": depth + 1}, "exit_at_step", f"exceeds the model's {depth} loops"),
        (plain, {"exit_at_step": 1, "exit_threshold": 0.5}, "exit_at_step", "at most one"),
        (client, {"exit_at_step": depth + 1}, "exit_at_step", f"exceeds the model's {depth} loops"),
    ]
    for api, extra, field, text in cases:
        with pytest.raises(openai.BadRequestError) as err:
            api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, extra_body=extra)
        body = err.value.body
        assert body["param"] == field and body["message"].startswith(field) and text in body["message"], body
    wait_until(lambda: idle(plain_server) and idle(server), what="nothing queued")


def test_exit_fields_on_a_speculating_server_give_the_plain_early_exit_text(server, client, reference_engine):
    """The module's server speculates (adaptive): early exit combines with it, and the text is what plain
    early-exit decoding gives; drafts that exited within the draft are counted in /metrics."""
    for extra in ({"exit_at_step": 1}, {"exit_threshold": 0.5}):
        ref = greedy(reference_engine, PROMPT, 16, ignore_eos=True, **extra)
        out = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"ignore_eos": True, **extra}
        )
        assert out.choices[0].text == ref.text and out.usage.completion_tokens == 16
    wait_until(lambda: idle(server), what="server idle")
    assert "looped_spec:exit_draft_decided_total" in exit_metrics(server.url)


def test_penalties_reach_the_request(server, client, reference_engine):
    """OpenAI's presence_penalty / frequency_penalty and vLLM's repetition_penalty: greedy output equals the offline
    engine's with the same penalties, and differs from the output without them."""
    settings = dict(presence_penalty=1.5, frequency_penalty=1.0)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, **settings,
                                    extra_body={"repetition_penalty": 1.3})  # fmt: skip
    ref = greedy(reference_engine, PROMPT, 24, repetition_penalty=1.3, **settings)
    assert out.choices[0].text == ref.text != greedy(reference_engine, PROMPT, 24).text


def test_min_tokens_reaches_the_request(server, client, reference_engine):
    """vLLM's min_tokens: with the tokens greedy decoding emits first as stop tokens, the output equals the offline
    engine's with the same fields (those tokens masked until min_tokens, then ending it), and differs from the output
    without min_tokens (which stops at once)."""
    first = greedy(reference_engine, PROMPT, 8, ignore_eos=True).token_ids
    fields = dict(min_tokens=6, stop_token_ids=first[:2])
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, extra_body=fields)
    ref = greedy(reference_engine, PROMPT, 16, **fields)
    without = greedy(reference_engine, PROMPT, 16, stop_token_ids=first[:2])
    assert out.choices[0].text == ref.text and len(ref.token_ids) > 6 > len(without.token_ids)
    assert out.usage.completion_tokens == len(ref.token_ids)


def test_stop_text_and_special_token_fields_reach_the_request(server, client, reference_engine):
    """vLLM's include_stop_str_in_output (the stop string kept in the text) and skip_special_tokens=False (eos, forced
    here by a logit bias, written into the text)."""
    full = greedy(reference_engine, PROMPT, 16, ignore_eos=True).text
    stop = full[6:9]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stop=[stop],
                                    extra_body={"include_stop_str_in_output": True})  # fmt: skip
    assert out.choices[0].text == full[: full.index(stop) + len(stop)] and out.choices[0].finish_reason == "stop"
    eos = reference_engine.tokenizer.eos_token_id
    fields = {"ignore_eos": True, "skip_special_tokens": False}
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0,
                                    logit_bias={str(eos): 100}, extra_body=fields)  # fmt: skip
    assert out.choices[0].text == reference_engine.tokenizer.eos_token * 2


def test_response_format_and_structured_outputs_reach_the_request(server, client, reference_engine):
    """OpenAI's response_format (a JSON schema on chat) and vLLM's structured_outputs (a choice on completions): the
    text follows the grammar and equals the offline engine's with the same grammar (the server speculates
    adaptively)."""
    from looped_spec.structured_output import StructuredOutputs

    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 99}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    messages = [{"role": "user", "content": "give a number"}]
    out = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0,
                                         response_format={"type": "json_schema",
                                                          "json_schema": {"name": "n", "schema": schema}})  # fmt: skip
    value = json.loads(out.choices[0].message.content)
    assert set(value) == {"n"} and isinstance(value["n"], int) and out.choices[0].finish_reason == "stop"
    prompt = reference_engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ref = greedy(reference_engine, prompt, 24, structured_outputs=StructuredOutputs(json=schema))
    assert out.choices[0].message.content == ref.text
    choice = ["red", "green", "blue"]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"structured_outputs": {"choice": choice}})  # fmt: skip
    assert out.choices[0].text in choice
    assert (
        out.choices[0].text
        == greedy(reference_engine, PROMPT, 8, structured_outputs=StructuredOutputs(choice=choice)).text
    )


def test_logit_bias_reaches_the_request(server, client, reference_engine):
    """OpenAI's logit_bias (token id strings -> [-100, 100]): greedy output equals the offline engine's with the same
    bias (the server speculates adaptively, the reference decodes plainly)."""
    bias = {"17": 100, "3": -100}
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logit_bias=bias)
    ref = greedy(reference_engine, PROMPT, 6, logit_bias={17: 100.0, 3: -100.0})
    assert out.choices[0].text == ref.text and ref.token_ids == [17] * 6
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logit_bias=bias)  # fmt: skip
    assert chat.choices[0].message.content == reference_engine.tokenizer.decode([17] * 3)


def test_a_text_prompt_gets_the_tokenizers_special_tokens_as_offline_and_chat_only_the_templates(server, monkeypatch):
    """vLLM's defaults, which the offline engine's encoding shares: completions encode a text prompt with the
    tokenizer's special tokens (a BOS; `add_special_tokens: false` leaves them out), chat encodes the rendered
    template without them (the template writes its own). The shipped tokenizers add none, so one here adds a BOS."""
    from tokenizers.processors import TemplateProcessing

    tokenizer = copy.deepcopy(server.app.state.serving.tokenizer)
    bos = tokenizer.eos_token_id
    tokenizer._tokenizer.post_processor = TemplateProcessing(single=f"{tokenizer.eos_token} $A",
                                                             special_tokens=[(tokenizer.eos_token, bos)])  # fmt: skip
    monkeypatch.setattr(server.app.state.serving, "tokenizer", tokenizer)
    plain = len(tokenizer.encode(PROMPT, add_special_tokens=False))
    assert tokenizer.encode(PROMPT)[0] == bos and len(tokenizer.encode(PROMPT)) == plain + 1
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def prompt_tokens(path: str, body: dict) -> int:
        answer = httpx.post(server.url + path, json={"model": MODEL, "max_tokens": 1, **body}, headers=headers)
        assert answer.status_code == 200, answer.text
        return answer.json()["usage"]["prompt_tokens"]

    assert prompt_tokens("/v1/completions", {"prompt": PROMPT}) == plain + 1
    assert prompt_tokens("/v1/completions", {"prompt": PROMPT, "add_special_tokens": False}) == plain
    messages = [{"role": "user", "content": PROMPT}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    templated = len(tokenizer.encode(rendered, add_special_tokens=False))
    assert prompt_tokens("/v1/chat/completions", {"messages": messages}) == templated
    assert prompt_tokens("/v1/chat/completions", {"messages": messages, "add_special_tokens": True}) == templated + 1


def test_return_tokens_as_token_ids_names_each_token_by_its_id(plain_server, reference_engine):
    """vLLM's return_tokens_as_token_ids: completions' and chat's log-probabilities show tokens as "token_id:<id>",
    the ids the model generated (a client gets them exactly, whatever their bytes); the server flag sets the default;
    asked without logprobs it is a 400 naming it."""
    ref = greedy(reference_engine, PROMPT, 6)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "logprobs": 2}
    out = httpx.post(plain_server.url + "/v1/completions", json={**body, "return_tokens_as_token_ids": True}).json()
    logprobs = out["choices"][0]["logprobs"]
    assert logprobs["tokens"] == [f"token_id:{t}" for t in ref.token_ids]
    assert all(len(top) == 2 and all(k.startswith("token_id:") for k in top) for top in logprobs["top_logprobs"])
    plain = httpx.post(plain_server.url + "/v1/completions", json=body).json()["choices"][0]["logprobs"]
    assert "".join(plain["tokens"]) == ref.text and plain["token_logprobs"] == logprobs["token_logprobs"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "logprobs": True,
            "top_logprobs": 1, "return_tokens_as_token_ids": True}  # fmt: skip
    content = httpx.post(plain_server.url + "/v1/chat/completions", json=chat).json()["choices"][0]["logprobs"][
        "content"
    ]
    assert all(e["token"].startswith("token_id:") and e["top_logprobs"][0]["token"].startswith("token_id:")
               for e in content) and len(content) == 4  # fmt: skip
    for path, request in (("/v1/completions", {k: v for k, v in body.items() if k != "logprobs"}),
                          ("/v1/chat/completions", {**chat, "logprobs": False, "top_logprobs": None})):  # fmt: skip
        refused = httpx.post(plain_server.url + path, json={**request, "return_tokens_as_token_ids": True})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "return_tokens_as_token_ids"
    engine = LoopedSpecEngine(MODEL, speculation="off", max_model_len=256)
    with ServerThread(engine, MODEL, return_tokens_as_token_ids=True) as server:
        by_default = httpx.post(server.url + "/v1/completions", json=body).json()["choices"][0]["logprobs"]
        assert by_default["tokens"] == logprobs["tokens"]
        off = httpx.post(server.url + "/v1/completions", json={**body, "return_tokens_as_token_ids": False}).json()
        assert off["choices"][0]["logprobs"]["tokens"] == plain["tokens"]
        assert httpx.post(server.url + "/v1/completions", json={**body, "logprobs": None}).status_code == 200


def test_a_null_field_is_an_unset_one():
    """OpenAI's schema lets a client send null for any optional field (clients generated from it do): it takes the
    field's default, as leaving it out would; a required field sent as null is missing."""
    from pydantic import ValidationError

    from looped_spec.server.protocol import ChatCompletionRequest, CompletionRequest

    nulls = {"n": None, "stream": None, "echo": None, "temperature": None, "stop": None}
    assert CompletionRequest.model_validate(
        {"model": MODEL, "prompt": "x", **nulls}
    ) == CompletionRequest.model_validate({"model": MODEL, "prompt": "x"})
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    nulls = {"n": None, "logprobs": None, "parallel_tool_calls": None, "tool_choice": None}
    assert ChatCompletionRequest.model_validate({**chat, **nulls}) == ChatCompletionRequest.model_validate(chat)
    with pytest.raises(ValidationError, match="prompt\n  Field required"):
        CompletionRequest.model_validate({"model": MODEL, "prompt": None})
    # inside stream_options too (vLLM's continuous_usage_stats is Optional there)
    streamed = {"model": MODEL, "prompt": "x", "stream": True}
    options = {"include_usage": True, "continuous_usage_stats": None}
    assert CompletionRequest.model_validate(
        {**streamed, "stream_options": options}
    ) == CompletionRequest.model_validate({**streamed, "stream_options": {"include_usage": True}})


def test_an_unsupported_field_is_named_however_it_is_spelt(plain_server):
    """A field no schema has is named as the client spelt it: a capitalised name (`Temperature`, a client written for
    another API) or one that looks like a type (`int`) had been taken for pydantic's union branch names and dropped,
    leaving a 400 that named no field."""
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    for path, body, named in (
        ("/v1/completions", {"prompt": "a", "Temperature": 0.5}, "Temperature"),
        ("/v1/completions", {"prompt": "a", "int": 1}, "int"),
        ("/v1/completions", {"prompt": "a", "stream": True, "stream_options": {"Include_usage": True}},
         "stream_options.Include_usage"),
        ("/v1/chat/completions", {**chat, "MaxTokens": 5}, "MaxTokens"),
        ("/tokenize", {"prompt": "a", "Add_special_tokens": False}, "Add_special_tokens"),
    ):  # fmt: skip
        answer = httpx.post(plain_server.url + path, json={"model": MODEL, **body}, timeout=60)
        error = answer.json()["error"]
        assert answer.status_code == 400 and error["param"] == named, (body, error)
        assert error["message"].startswith(named) and "not a supported field" in error["message"], error


def test_a_body_not_sent_as_json_is_told_its_content_type(plain_server):
    """A JSON body without `Content-Type: application/json` (curl -d sends a form's type) is not parsed by FastAPI:
    the 400 says which header to send, not pydantic's "Input should be a valid dictionary" about the raw bytes; JSON
    that is not an object is told so."""
    body = json.dumps({"model": MODEL, "prompt": "a", "max_tokens": 1}).encode()
    for path in ("/v1/completions", "/detokenize"):
        for headers in ({"Content-Type": "application/x-www-form-urlencoded"}, {"Content-Type": "text/plain"}, {}):
            error = httpx.post(plain_server.url + path, content=body, headers=headers, timeout=60).json()["error"]
            assert "Content-Type: application/json" in error["message"], (path, headers, error)
    listed = httpx.post(plain_server.url + "/v1/completions", json=[1, 2], timeout=60)
    assert listed.status_code == 400 and listed.json()["error"]["message"] == "the request body must be a JSON object"


def test_a_negative_seed_is_taken_as_openai_and_vllm_take_it(plain_server, reference_engine):
    """OpenAI's schema (and vLLM's) takes any 64-bit integer as `seed`: the choices draw with it modulo 2**63, as the
    server reduces every choice's seed s + j, so -2 samples as 2**63 - 2 does offline. -1 is vLLM's "no seed" (its
    SamplingParams reads it so; clients send it for random): it drew as 2**63 - 1, the same text every call."""
    sampled = {"model": MODEL, "max_tokens": 6, "temperature": 1.0, "n": 2, "seed": -2}
    for path, fields, text in (
        ("/v1/completions", {"prompt": PROMPT}, lambda choice: choice["text"]),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]},
         lambda choice: choice["message"]["content"]),
    ):  # fmt: skip
        answer = httpx.post(plain_server.url + path, json={**sampled, **fields}, timeout=60)
        assert answer.status_code == 200, answer.text
        wrapped = httpx.post(plain_server.url + path, json={**sampled, **fields, "seed": 2**63 - 2}, timeout=60).json()
        assert [text(c) for c in answer.json()["choices"]] == [text(c) for c in wrapped["choices"]]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=2**63 - 2)
    first = httpx.post(plain_server.url + "/v1/completions", json={**sampled, "prompt": PROMPT, "n": 1}).json()
    assert first["choices"][0]["text"] == reference_engine.generate(PROMPT, params)[0].text
    unseeded = {**sampled, "prompt": PROMPT, "n": 1, "seed": -1, "max_tokens": 12}
    texts = {httpx.post(plain_server.url + "/v1/completions", json=unseeded).json()["choices"][0]["text"]
             for _ in range(4)}  # fmt: skip
    assert len(texts) > 1  # sampled anew each call (four 12-token samples alike: vanishingly unlikely)
    below = {**sampled, "prompt": PROMPT, "seed": -(2**63) - 1}
    too_small = httpx.post(plain_server.url + "/v1/completions", json=below)
    assert too_small.status_code == 400 and too_small.json()["error"]["param"] == "seed"


def with_a_token_past_the_vocabulary(folder, content: str, special: bool):
    """A copy of the model in `folder` whose tokenizer has one token more (`content`, id 1024) than the model's
    vocabulary."""
    import shutil

    from looped_spec.models import shipped_model_path

    shutil.copytree(shipped_model_path(MODEL), folder)
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({"id": 1024, "content": content, "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": special})  # fmt: skip
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    return folder


def test_request_latencies_of_minutes_fall_in_a_bucket_of_their_own():
    """A long answer takes minutes end to end (and a queued request minutes to its first token): the histograms'
    buckets reach as far as vLLM's, so such a latency is not lost in +Inf with everything past 80 s."""
    import asyncio

    from looped_spec.server.metrics import ServerMetrics

    engine = LoopedSpecEngine(MODEL, speculation="off", max_model_len=64)
    outputs = engine.generate([PROMPT], SamplingParams(max_tokens=2, ignore_eos=True))
    metrics = ServerMetrics(engine, MODEL)

    async def answer():
        for out in outputs:
            yield out

    async def drain():  # the request arrived 200 s ago
        return [out async for out in metrics.timed(answer(), time.perf_counter() - 200.0)]

    asyncio.run(drain())
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
        family = next(f for f in text_string_to_metric_families(generate_latest(metrics.registry).decode())
                      if f.name == "looped_spec:" + name)  # fmt: skip
        counted = [float(s.labels["le"]) for s in family.samples if s.name.endswith("_bucket") and s.value == 1]
        assert 200.0 <= min(counted) < float("inf"), name


def test_a_streamed_chat_starts_with_empty_content_for_text_and_null_for_a_call(server):
    """The first chunk of a streamed chat (the role's) carries `"content": ""` for a plain-text reply, as OpenAI
    sends it, and `"content": null` for a reply that may be all tool calls (raw SSE: a client reads null and ""
    apart)."""
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}  # fmt: skip
    headers = {"Authorization": f"Bearer {API_KEY}"}
    text = {"model": MODEL, "messages": [{"role": "user", "content": "Sort a list."}], "max_tokens": 2,
            "temperature": 0, "stream": True, "n": 2}  # fmt: skip
    call = {**text, "n": 1, "max_tokens": 12, "tools": [tool], "tool_choice": "required"}
    for body, content in ((text, ""), ({**text, "tools": [tool], "tool_choice": "none"}, ""), (call, None)):
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as sse:
            events = [line.removeprefix("data: ") for line in sse.iter_lines() if line.startswith("data: ")]
        roles = [json.loads(event)["choices"][0] for event in events[: body["n"]]]
        assert [(c["index"], c["delta"]["role"], c["delta"]["content"]) for c in roles] == [
            (k, "assistant", content) for k in range(body["n"])
        ], events[:3]
