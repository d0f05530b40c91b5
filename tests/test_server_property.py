"""The OpenAI server under a random concurrent mix of real-client traffic, against offline decoding.

A server on tiny-ouro takes, per example, a few concurrent requests through the official async client: completions
and chat, streamed or not, `n` choices, stop strings (kept in the text or not), `ignore_eos`, `max_tokens`, seeds
(-1 and negative ones included), log-probabilities, echo, return_token_ids, some left early (a stream closed after a
few chunks, an answer not streamed given up on). Checked: every answer that completes is whole and well formed (one
choice per index, each with its finish reason, usage counting its tokens; with return_token_ids its prompt's ids
once and its generated ids, whose decoded text is the text up to any stop string, without it neither field); greedy
choices equal offline plain decoding of the same prompt and parameters (text, finish and stop reason,
log-probabilities, token count, token ids); seeded sampled choices equal the same request run alone offline under
the server's plan when that plan is fixed (docs/architecture.md, "Sampling parameters": a seed reproduces under a
fixed plan whatever else is in the batch; under adaptive speculation the plan follows the batch, so there only their
bounds are checked); once idle the engine holds no request and every KV block is free; the server then stays healthy
and serves.

Deterministic by default (derandomized, no example database); set LOOPED_SPEC_HYPOTHESIS_EXAMPLES to explore more.
"""

from __future__ import annotations

import asyncio
import os

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from server_utils import ServerThread, idle, wait_until

from looped_spec import LoopedSpecEngine, SamplingParams

MODEL = "tiny-ouro"
EXAMPLES = int(os.environ.get("LOOPED_SPEC_HYPOTHESIS_EXAMPLES", "6"))
PROMPTS = ["def fibonacci(n):", "import os", "class A:", "x = ["]
MESSAGES = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}],
]
STOPS = [None, "\n", "self", ["(", ":"], " ", "pack"]
#: a request the client leaves runs long, so that it is surely still generating when left
LEFT = {"max_tokens": 200, "ignore_eos": True}

requests_st = st.fixed_dictionaries(
    {
        "chat": st.booleans(),
        "prompts": st.lists(st.integers(0, len(PROMPTS) - 1), min_size=1, max_size=2),  # completions: a list of 2
        "stream": st.booleans(),
        "n": st.integers(1, 3),
        "max_tokens": st.integers(1, 20),
        "stop": st.sampled_from(STOPS),
        "include_stop": st.booleans(),
        "ignore_eos": st.booleans(),
        "sampled": st.booleans(),
        "seed": st.one_of(st.none(), st.just(-1), st.integers(-(2**63), 2**63 - 1)),  # -1: no seed, as vLLM's
        "logprobs": st.sampled_from([None, 0, 2]),
        "echo": st.booleans(),  # completions only: the prompt before the text
        "include_usage": st.booleans(),
        "continuous_usage": st.booleans(),
        # a stream closed after this many chunks; an answer not streamed given up on after this many hundredths of a
        # second (the request may not have reached the server by then)
        "leave_after": st.one_of(st.none(), st.none(), st.integers(0, 4)),
        "token_ids": st.booleans(),  # return_token_ids (vLLM's): the prompt's ids and each choice's generated ids
    }
).map(lambda spec: spec if spec["leave_after"] is None else spec | LEFT)


@pytest.fixture(scope="module")
def plain_engine():
    engine = LoopedSpecEngine(MODEL, speculation="off", max_model_len=256)
    yield engine
    engine.close()


@pytest.fixture(scope="module", params=["adaptive", "2,1"])
def served(request):
    """(server, offline engine of its plan: the reference of its seeded samples, None where the plan adapts)."""
    plan = request.param
    engine = LoopedSpecEngine(MODEL, speculation=plan, max_batch_size=4, max_model_len=256)
    alone = None if plan == "adaptive" else LoopedSpecEngine(MODEL, speculation=plan, max_model_len=256)
    with ServerThread(engine, MODEL, max_queued=64) as running:
        yield running, alone
    if alone is not None:
        alone.close()


def metric(server, name: str, **labels) -> float:
    """A sample of the server's /metrics."""
    for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    raise AssertionError(f"no {name} {labels} in /metrics")


def seeded(spec: dict) -> bool:
    return spec["sampled"] and spec["seed"] is not None and spec["seed"] != -1


class Offline:
    """Each request's choices decoded offline, alone: greedy with plain decoding, seeded samples with the server's
    plan (choice j draws with seed + j modulo 2**63)."""

    def __init__(self, plain: LoopedSpecEngine, alone: LoopedSpecEngine | None) -> None:
        self.plain, self.alone = plain, alone
        self.cache: dict = {}

    def prompt_ids(self, spec: dict) -> list[list[int]]:
        """Each prompt's token ids (chat: the rendered messages')."""
        tokenizer = self.plain.tokenizer
        if spec["chat"]:
            rendered = tokenizer.apply_chat_template(MESSAGES[spec["prompts"][0] % len(MESSAGES)], tokenize=False,
                                                     add_generation_prompt=True)  # fmt: skip
            return [tokenizer.encode(rendered, add_special_tokens=False)]  # the template writes its own
        return [tokenizer.encode(PROMPTS[i]) for i in spec["prompts"]]  # with the tokenizer's, as offline

    def knows(self, spec: dict) -> bool:
        return not spec["sampled"] or (seeded(spec) and self.alone is not None)

    def choice(self, spec: dict, k: int):
        """The offline output of choice k, prompt k // n's sample k % n (None where the server's text is not
        determined)."""
        if not self.knows(spec):
            return None
        ids, j = self.prompt_ids(spec)[k // spec["n"]], k % spec["n"]
        seed = (spec["seed"] + j) % 2**63 if spec["sampled"] else None
        stop = spec["stop"] if not isinstance(spec["stop"], list) else tuple(spec["stop"])
        key = (tuple(ids), seed, stop, *(spec[f] for f in ("max_tokens", "logprobs", "ignore_eos", "include_stop")))
        if key not in self.cache:
            top_n = None if spec["logprobs"] is None else max(spec["logprobs"], 1)  # the token's own at least
            params = SamplingParams(max_tokens=spec["max_tokens"], temperature=1.0 if spec["sampled"] else 0.0,
                                    seed=seed, stop=spec["stop"], ignore_eos=spec["ignore_eos"],
                                    include_stop_str_in_output=spec["include_stop"], logprobs=top_n)  # fmt: skip
            engine = self.alone if spec["sampled"] else self.plain
            self.cache[key] = engine.generate(ids, params)[0]
        return self.cache[key]


def request_fields(spec: dict) -> dict:
    fields = dict(model=MODEL, n=spec["n"], stop=spec["stop"], temperature=1.0 if spec["sampled"] else 0.0)
    if spec["seed"] is not None:
        fields["seed"] = spec["seed"]
    fields["extra_body"] = {"ignore_eos": spec["ignore_eos"], "include_stop_str_in_output": spec["include_stop"]}
    if spec["token_ids"]:
        fields["extra_body"]["return_token_ids"] = True
    if spec["chat"]:
        fields |= dict(messages=MESSAGES[spec["prompts"][0] % len(MESSAGES)], max_completion_tokens=spec["max_tokens"])
        if spec["logprobs"] is not None:
            fields |= dict(logprobs=True, top_logprobs=spec["logprobs"])
    else:
        prompts = [PROMPTS[i] for i in spec["prompts"]]
        fields |= dict(prompt=prompts if len(prompts) > 1 else prompts[0], max_tokens=spec["max_tokens"],
                       echo=spec["echo"])  # fmt: skip
        if spec["logprobs"] is not None:
            fields["logprobs"] = spec["logprobs"]
    if spec["stream"]:
        options = {"include_usage": True} if spec["include_usage"] else {}
        if spec["continuous_usage"]:
            options["continuous_usage_stats"] = True  # include_usage left out: as this
        fields |= dict(stream=True, stream_options=options or None)
    return fields


def logprob_values(logprobs, spec: dict) -> list[float | None]:
    """A choice's (or a chunk's) log-probabilities, each entry's top list checked on the way: at most N + 1 entries
    holding the token itself (completions), N (chat)."""
    if logprobs is None:
        return []
    n = spec["logprobs"]
    if spec["chat"]:
        assert all(len(entry.top_logprobs) == n for entry in logprobs.content)
        return [entry.logprob for entry in logprobs.content]
    lengths = {
        len(logprobs.tokens),
        len(logprobs.token_logprobs),
        len(logprobs.top_logprobs),
        len(logprobs.text_offset),
    }
    assert len(lengths) == 1
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert value is None or (len(top) <= n + 1 and top[token] == pytest.approx(value, abs=1e-6))
    return list(logprobs.token_logprobs)


def extra(model) -> dict:
    """The fields the openai client does not know (vLLM's return_token_ids' among them), as it received them."""
    return model.model_extra or {}


def collect_ids(ids: dict, prompt_ids: dict, index, model, spec: dict) -> None:
    """The return_token_ids fields of a choice (or chat answer, `index` "chat") or one of its chunks: its generated ids
    added to `ids[index]` and its prompt's to `prompt_ids[index]`; a request without the field has neither."""
    fields = extra(model)
    if not spec["token_ids"]:
        assert "token_ids" not in fields and "prompt_token_ids" not in fields, (spec, fields)
        return
    if index != "chat":  # every choice of every chunk carries the ids it adds (chat's prompt ids: at the top)
        assert isinstance(fields.get("token_ids"), list), (spec, fields)
        ids.setdefault(index, []).extend(fields["token_ids"])
    if fields.get("prompt_token_ids") is not None:
        prompt_ids.setdefault(index, []).append(fields["prompt_token_ids"])


async def run_one(client: openai.AsyncOpenAI, spec: dict) -> dict | None:
    """The answer as {"choices": {index: (text, finish_reason, stop_reason, log-probabilities or None)}, "usage",
    "token_ids": {index: generated ids}, "prompt_token_ids": {index or "chat": [the prompt ids sent, once each]}}
    (return_token_ids'; empty without it); None when the client left before it was whole."""
    create = client.chat.completions.create if spec["chat"] else client.completions.create
    fields = request_fields(spec)
    leave = spec["leave_after"]
    wants_logprobs = spec["logprobs"] is not None
    if not spec["stream"]:
        call = create(**fields)
        if leave is not None:
            try:
                out = await asyncio.wait_for(call, timeout=leave / 100)
            except TimeoutError:
                return None
        else:
            out = await call
        choices, ids, prompt_ids = {}, {}, {}
        if spec["chat"]:
            collect_ids(ids, prompt_ids, "chat", out, spec)
        for c in out.choices:
            assert c.index not in choices
            text = c.message.content if spec["chat"] else c.text
            values = logprob_values(c.logprobs, spec) if wants_logprobs else None
            choices[c.index] = (text or "", c.finish_reason, c.stop_reason, values)
            collect_ids(ids, prompt_ids, c.index, c, spec)
        return {"choices": choices, "usage": out.usage, "token_ids": ids, "prompt_token_ids": prompt_ids}
    stream = await create(**fields)
    texts, finishes, stops, values, usage, chunks = {}, {}, {}, {}, None, 0
    ids, prompt_ids = {}, {}
    async for chunk in stream:
        if leave is not None and chunks >= leave:
            await stream.close()  # the client closes the stream mid-way
            return None
        chunks += 1
        if spec["chat"]:
            collect_ids(ids, prompt_ids, "chat", chunk, spec)
        if spec["continuous_usage"]:  # in every chunk, growing
            assert chunk.usage is not None and (
                usage is None or chunk.usage.completion_tokens >= usage.completion_tokens
            )
            usage = chunk.usage
        elif chunk.usage is not None:
            assert usage is None and chunk.choices == []  # one usage chunk, the last, with no choices
            usage = chunk.usage
        for c in chunk.choices:
            assert c.index not in finishes, f"choice {c.index}: a chunk after its finishing one"
            delta = c.delta.content if spec["chat"] else c.text
            texts[c.index] = texts.get(c.index, "") + (delta or "")
            values.setdefault(c.index, []).extend(logprob_values(c.logprobs, spec))
            collect_ids(ids, prompt_ids, c.index, c, spec)
            if c.finish_reason is not None:
                finishes[c.index], stops[c.index] = c.finish_reason, c.stop_reason
    assert (usage is not None) == (spec["include_usage"] or spec["continuous_usage"])
    choices = {k: (texts.get(k, ""), finishes.get(k), stops.get(k), values.get(k, []) if wants_logprobs else None)
               for k in set(texts) | set(finishes)}  # fmt: skip
    return {"choices": choices, "usage": usage, "token_ids": ids, "prompt_token_ids": prompt_ids}


def check_text_of_ids(text: str, ids: list[int], stop_reason, spec: dict, tokenizer) -> None:
    """A choice's text is its token ids decoded, cut where a stop string ended it (the ids keep the tokens that wrote
    it and any text after it in the last one): before the stop string, or after it with include_stop_str_in_output."""
    decoded = tokenizer.decode(ids, skip_special_tokens=True)
    if not isinstance(stop_reason, str):  # a length, or an eos (its text is none: a special token)
        assert text == decoded, (spec, text, ids)
        return
    kept = text[: len(text) - len(stop_reason)] if spec["include_stop"] else text
    assert decoded.startswith(kept + stop_reason) and (not spec["include_stop"] or text.endswith(stop_reason)), (
        spec, text, ids)  # fmt: skip


def check_answer(spec: dict, answer: dict, offline: Offline) -> None:
    choices, usage = answer["choices"], answer["usage"]
    prompts = offline.prompt_ids(spec)
    num_choices = len(prompts) * spec["n"]
    assert sorted(choices) == list(range(num_choices)), spec
    echo = spec["echo"] and not spec["chat"]
    stops = [] if spec["stop"] is None else [spec["stop"]] if isinstance(spec["stop"], str) else spec["stop"]
    ids = answer["token_ids"]
    if spec["token_ids"]:  # the prompt's ids once (chat: the rendered messages', at the top), each choice's own
        wanted = {"chat": [prompts[0]]} if spec["chat"] else {j: [prompts[j // spec["n"]]] for j in range(num_choices)}
        assert answer["prompt_token_ids"] == wanted, spec
        assert sorted(ids) == list(range(num_choices)), spec
    else:
        assert ids == answer["prompt_token_ids"] == {}, spec
    counts = []
    for j in range(num_choices):
        prompt = prompts[j // spec["n"]]
        prompt_text = offline.plain.tokenizer.decode(prompt) if echo else ""
        text, finish, stop_reason, values = choices[j]
        assert finish in ("stop", "length"), (spec, j, finish)
        assert text.startswith(prompt_text), (spec, j)
        text = text[len(prompt_text) :]
        if values is not None:
            if echo:  # the prompt's scores first, its first token's None
                assert values[0] is None and None not in values[1:] and len(values) >= len(prompt), (spec, j)
                values = values[len(prompt) :]
            counts.append(len(values))
            assert len(values) == spec["max_tokens"] if finish == "length" else len(values) <= spec["max_tokens"]
        if not spec["include_stop"]:
            assert not any(s in text for s in stops), (spec, j, text)  # cut before a stop string
        if spec["token_ids"]:
            count, most = len(ids[j]), spec["max_tokens"]
            assert count == most if finish == "length" else 0 < count <= most, (spec, j, finish, ids[j])
            check_text_of_ids(text, ids[j], stop_reason, spec, offline.plain.tokenizer)
        ref = offline.choice(spec, j)
        if ref is None:
            continue
        assert (text, finish, stop_reason) == (ref.text, ref.finish_reason, ref.stop_reason), (spec, j)
        if spec["token_ids"]:
            assert ids[j] == list(ref.token_ids), (spec, j)
        if values is not None:
            assert values == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-4), (spec, j)
    if usage is None:
        return
    assert usage.prompt_tokens == sum(len(p) for p in prompts), spec  # once per prompt, whatever n
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if counts:
        assert usage.completion_tokens == sum(counts), spec
    if spec["token_ids"]:
        assert usage.completion_tokens == sum(len(ids[j]) for j in range(num_choices)), spec
    if offline.knows(spec):
        assert usage.completion_tokens == sum(len(offline.choice(spec, j).token_ids) for j in range(num_choices)), spec
    assert usage.completion_tokens <= num_choices * spec["max_tokens"]


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # fmt: skip
@given(mix=st.lists(requests_st, min_size=1, max_size=6))
def test_a_random_mix_of_client_requests_is_served_as_offline_and_leaves_nothing_behind(served, plain_engine, mix):
    server, alone = served
    offline = Offline(plain_engine, alone)
    for spec in mix:  # the references first: the offline engines run in this thread
        for k in range(len(offline.prompt_ids(spec)) * spec["n"]):
            offline.choice(spec, k)

    async def traffic():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0,
                                      timeout=60) as client:  # fmt: skip
            return await asyncio.gather(*(run_one(client, spec) for spec in mix))

    aborted_before = metric(server, "looped_spec:request_success_total", finished_reason="abort")
    answers = asyncio.run(traffic())
    for spec, answer in zip(mix, answers):
        if answer is not None:
            check_answer(spec, answer, offline)
    wait_until(lambda: idle(server), what="every request finished and its KV freed")
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    gauges = {s.name: s.value for family in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)
              for s in family.samples}  # fmt: skip
    assert gauges["looped_spec:num_requests_running"] == gauges["looped_spec:num_requests_waiting"] == 0
    assert gauges["looped_spec:kv_cache_usage_perc"] == 0.0
    # only requests the client left were aborted (not every choice of one: a choice may have stopped before)
    aborted = metric(server, "looped_spec:request_success_total", finished_reason="abort") - aborted_before
    assert aborted <= sum(
        len(offline.prompt_ids(spec)) * spec["n"] for spec, answer in zip(mix, answers) if answer is None
    )
    after = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    out = after.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0)
    plain = dict(chat=False, echo=False, prompts=[0], n=1, sampled=False, max_tokens=6, stop=None, logprobs=None,
                 ignore_eos=False, include_stop=False)  # fmt: skip
    assert out.choices[0].text == offline.choice(plain, 0).text
