"""vLLM's prompt dicts and `cache_salt`: `{"prompt": text}` / `{"prompt_token_ids": ids}` wherever a prompt is taken
(offline, async, and the server's requests), and a salt that keeps prefix caching from sharing blocks across salts
(or between salted and unsalted requests), with every output still the uncached engine's."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from conftest import fixture_dir, make_engine
from server_utils import ServerThread

from looped_spec import AsyncLoopedSpecEngine, LoopedSpecEngine, SamplingParams, TextPrompt, TokensPrompt
from looped_spec.engine.prefix_cache import block_digests, chain_start

SHARED = [5, 17, 29, 3, 88, 41, 9, 60, 2, 33, 71, 14, 90, 6, 25, 48, 7, 19, 64, 11]  # 20 tokens: 5 blocks of 4
PROMPT = SHARED + [101]  # 21 tokens: the 5 full blocks before its last token are cacheable
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def salted(ids: list[int], salt: str | None):
    return list(ids) if salt is None else {"prompt_token_ids": list(ids), "cache_salt": salt}


# ----- the digests -----
def test_digests_carry_the_salt_beside_the_seed():
    tokens = list(range(12))
    plain = block_digests(tokens, 3, 4, None)
    assert block_digests(tokens, 3, 4, None, "a") == block_digests(tokens, 3, 4, None, "a")
    chains = [block_digests(tokens, 3, 4, seed, salt) for seed in (None, 7) for salt in (None, "a", "b", "7")]
    assert chains[0] == plain
    # every block differs between any two (seed, salt): the salt enters the start of the chain, so every block's
    # digest carries it (vLLM puts it in the first block's hash; the chain carries it on)
    for i, x in enumerate(chains):
        for y in chains[i + 1 :]:
            assert all(a != b for a, b in zip(x, y))
    starts = {chain_start(seed, salt) for seed in (None, 0, 1, 10) for salt in (None, "", "0", "1", "seed 1\n", "é")}
    assert len(starts) == 24  # the pairs never collide (tagged, the salt's length given)


# ----- the engine -----
MODES = {
    "plain": dict(speculation="off"),
    "fixed plan": dict(speculation="2,1"),
    "loop passes": dict(speculation="off", batching="loop"),
    "loop passes, fixed plan": dict(speculation="2,1", batching="loop"),
}
# (salt, tokens it finds cached): a salt finds only its own blocks, unsalted requests only unsalted blocks
SEQUENCE = [(None, 0), ("a", 0), ("a", 20), ("b", 0), (None, 20), ("b", 20), ("A", 0)]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("sampled", [False, True])
def test_a_salt_shares_blocks_only_with_its_own_salt(mode, sampled):
    params = SamplingParams(max_tokens=6, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True) if sampled else GREEDY
    got = {}
    for caching in (False, True):
        engine = make_engine("ouro", block_size=4, max_batch_size=2, prefix_caching=caching, **MODES[mode])
        outs = [engine.generate(salted(PROMPT, salt), params)[0] for salt, _ in SEQUENCE]
        got[caching] = [o.token_ids for o in outs]
        if caching:
            assert [o.metrics.num_cached_tokens for o in outs] == [cached for _, cached in SEQUENCE]
            assert engine.stats.num_prefix_cache_hits == sum(cached for _, cached in SEQUENCE)
        else:
            assert engine.stats.num_prefix_cache_queries == 0  # without prefix caching a salt changes nothing
        assert engine.num_free_blocks == engine.kv.num_blocks
        engine.close()
    assert got[True] == got[False]
    assert len(set(map(tuple, got[False]))) == 1  # one prompt: only the cache differs


def test_requests_of_one_batch_share_by_salt():
    """Four prompts queued together, two salts: each finds the blocks the first of its salt registered."""
    prompts = [salted(SHARED + tail, salt) for tail, salt in (([101], "a"), ([102, 103], "b"), ([104], "a"),
                                                                ([105], None))]  # fmt: skip
    got = {}
    for caching in (False, True):
        engine = make_engine("ouro", block_size=4, max_batch_size=1, prefix_caching=caching)
        outs = engine.generate(prompts, GREEDY)
        got[caching] = [o.token_ids for o in outs]
        if caching:  # one at a time (max_batch_size 1): only the second "a" finds a salt's blocks
            assert [o.metrics.num_cached_tokens for o in outs] == [0, 0, 20, 0]
        engine.close()
    assert got[True] == got[False]


@pytest.mark.parametrize("initial_state", ["random", "zeros"])
def test_huginn_shares_only_under_the_same_seed_and_salt(initial_state):
    """Huginn's digests carry the seed (its random initial state draws from it) and now the salt as well."""
    runs = [(5, "a"), (5, "b"), (5, "a"), (6, "a"), (5, None), (6, "b")]
    cached = {"random": [0, 0, 20, 0, 0, 0], "zeros": [0, 0, 20, 20, 0, 20]}[initial_state]
    got = {}
    for caching in (False, True):
        engine = LoopedSpecEngine(fixture_dir("huginn"), adapter_options={"initial_state": initial_state},
                                  speculation="off", block_size=4, prefix_caching=caching)  # fmt: skip
        outs = [engine.generate(salted(PROMPT, salt), GREEDY.model_copy(update={"seed": seed}))[0]
                for seed, salt in runs]  # fmt: skip
        got[caching] = [o.token_ids for o in outs]
        if caching:
            assert [o.metrics.num_cached_tokens for o in outs] == cached
        engine.close()
    assert got[True] == got[False]


def test_under_kv_pressure_salted_requests_are_preempted_and_find_only_their_own_blocks():
    """A cache of 12 blocks of 4 tokens, prompts of ~24 tokens under two salts: requests are preempted and
    recomputed; outputs equal the uncached engine's and every block comes back."""
    prompts = [salted(SHARED[: 12 + i] + [120 + i] * (8 + i % 3), "ab"[i % 2]) for i in range(8)]
    got = {}
    for caching in (False, True):
        engine = make_engine("ouro", block_size=4, num_kv_blocks=12, max_model_len=48, max_batch_size=4,
                             prefix_caching=caching, speculation="2,1")  # fmt: skip
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        got[caching] = [o.token_ids for o in engine.generate(prompts, params)]
        got[caching] += [o.token_ids for o in engine.generate(prompts[::-1], params)]
        assert engine.num_free_blocks == engine.kv.num_blocks
        if caching:
            assert engine.scheduler.num_preemptions > 0 and engine.stats.num_prefix_cache_hits > 0
        engine.close()
    assert got[True] == got[False]


def test_a_preempted_salted_request_finds_its_own_blocks_again():
    engine = make_engine("ouro", block_size=4, num_kv_blocks=12, max_model_len=48, prefix_caching=True)
    engine.add_request(salted(range(10, 30), "x"), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), "X")
    engine.add_request(salted(range(40, 45), "y"), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), "Y")
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    preempted = [o for o in outs.values() if o.metrics.num_preemptions]
    assert preempted and engine.stats.num_prefix_cache_hits > sum(len(o.prompt_token_ids) for o in preempted)
    assert [o.metrics.num_cached_tokens for o in outs.values()] == [0, 0]
    assert engine.num_free_blocks == engine.kv.num_blocks
    engine.close()


# ----- prompt dicts -----
@pytest.fixture(scope="module")
def text_engine():
    engine = LoopedSpecEngine("tiny-ouro", speculation="off", prefix_caching=True, block_size=4)
    yield engine
    engine.close()


def test_every_prompt_form_gives_the_same_output(text_engine):
    text = "def fibonacci(n):"
    ids = text_engine.tokenizer.encode(text)
    params = SamplingParams(max_tokens=5, temperature=0.0)
    forms = [text, ids, TextPrompt(prompt=text), TokensPrompt(prompt_token_ids=ids),
             {"prompt": text, "cache_salt": "t"}, {"prompt_token_ids": tuple(ids), "cache_salt": "t"},
             {"prompt": text, "cache_salt": None, "multi_modal_data": None, "mm_processor_kwargs": None},
             TokensPrompt(prompt_token_ids=ids, prompt="the text they came from")]  # fmt: skip
    outs = text_engine.generate(forms, params)
    assert all(o.prompt_token_ids == ids and o.token_ids == outs[0].token_ids for o in outs)
    # RequestOutput.prompt: the text of a text prompt, a text dict's included, and the text beside a TokensPrompt's ids
    assert [o.prompt for o in outs] == [text, None, text, None, text, None, text, "the text they came from"]
    one = text_engine.generate({"prompt": text, "cache_salt": "t"}, params)  # a single dict is one prompt
    assert len(one) == 1 and one[0].token_ids == outs[0].token_ids and one[0].prompt == text
    request_id = text_engine.add_request({"prompt": text, "cache_salt": "u"}, params)
    finished = []
    while text_engine.has_unfinished_requests():
        finished += [o for o in text_engine.step() if o.finished]
    assert [(o.request_id, o.prompt, o.token_ids) for o in finished] == [(request_id, text, outs[0].token_ids)]


BAD_PROMPTS = [
    ({"prompt": "x", "multi_modal_data": {"image": 1}}, ValueError, "prompts[1]: 'multi_modal_data' is not supported"),
    ({"prompt": "x", "mm_processor_kwargs": {}}, ValueError, "prompts[1]: 'mm_processor_kwargs' is not supported"),
    ({"prompt_token_ids": [1], "prompt_embeds": [0.5]}, ValueError, "prompts[1]: 'prompt_embeds' is not supported"),
    ({"prompt": "x", "cache_sallt": "a"}, ValueError, "prompts[1]: unknown key 'cache_sallt'"),
    ({"prompt": 5, "prompt_token_ids": [1]}, TypeError, "prompts[1].prompt must be a string, got int"),
    ({"cache_salt": "a"}, ValueError, "prompts[1]: a prompt dict needs 'prompt' (text) or 'prompt_token_ids'"),
    ({"prompt": 5}, TypeError, "prompts[1].prompt must be a string, got int"),
    ({"prompt": ""}, ValueError, "prompts[1].prompt is empty"),
    ({"prompt_token_ids": "1 2"}, TypeError, "prompts[1].prompt_token_ids must be a list of token ids, got str"),
    ({"prompt_token_ids": [1, "2"]}, TypeError, "prompts[1].prompt_token_ids[1] = '2' is not an int token id"),
    ({"prompt_token_ids": [1, 10**9]}, ValueError, "prompts[1].prompt_token_ids[1] = 1000000000 is outside"),
    ({"prompt_token_ids": []}, ValueError, "prompts[1].prompt_token_ids is empty"),
    ({"prompt_token_ids": [1], "cache_salt": 3}, TypeError, "prompts[1].cache_salt must be a string, got int"),
    ({"prompt_token_ids": [1], "cache_salt": ""}, ValueError, "prompts[1].cache_salt must be a non-empty string"),
]


@pytest.mark.parametrize("bad, kind, message", BAD_PROMPTS)
def test_a_wrong_prompt_dict_is_refused_naming_the_prompt_and_the_key(text_engine, bad, kind, message):
    queued = text_engine.scheduler.has_unfinished()
    with pytest.raises(kind) as err:
        text_engine.generate([[1, 2, 3], bad], GREEDY)
    assert str(err.value).startswith(message), str(err.value)
    assert text_engine.scheduler.has_unfinished() == queued  # nothing was queued, the good prompt neither
    with pytest.raises(kind) as err:
        text_engine.add_request(bad, GREEDY)
    assert str(err.value).startswith(message.replace("prompts[1]", "prompt")), str(err.value)


def test_the_async_engine_takes_prompt_dicts_and_hands_back_their_errors():
    engine = make_engine("ouro", block_size=4, prefix_caching=True)
    front = AsyncLoopedSpecEngine(engine, max_queued=0)

    async def run(prompt) -> list:
        return [o async for o in front.generate(prompt, GREEDY)]

    async def main():
        first = await run({"prompt_token_ids": PROMPT, "cache_salt": "a"})
        again = await run({"prompt_token_ids": PROMPT, "cache_salt": "a"})
        other = await run(salted(PROMPT, "b"))
        plain = await run(PROMPT)
        with pytest.raises(ValueError, match=r"^prompt: 'multi_modal_data' is not supported"):
            await run({"prompt_token_ids": PROMPT, "multi_modal_data": {"image": 0}})
        with pytest.raises(ValueError, match=r"^prompt\.cache_salt must be a non-empty string"):
            await run({"prompt_token_ids": PROMPT, "cache_salt": ""})
        return first[-1], again[-1], other[-1], plain[-1]

    front.start()
    try:
        outs = asyncio.run(main())
    finally:
        front.shutdown()
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 20, 0, 0]
    assert len({tuple(o.token_ids) for o in outs}) == 1


# ----- the server -----
def test_the_server_takes_cache_salt_on_completions_and_chat():
    """Completions and chat with `cache_salt` (the official client's extra_body): the same salt finds the blocks its
    first request cached (usage.prompt_tokens_details.cached_tokens), another salt or none finds nothing; an empty
    or non-string salt is a 400 naming cache_salt."""
    openai = pytest.importorskip("openai")
    engine = LoopedSpecEngine("tiny-ouro", speculation="2,1", prefix_caching=True, block_size=4)
    reference = LoopedSpecEngine("tiny-ouro", speculation="off")
    prompt = "You write short, careful Python. " * 4 + "Sort a list."
    system = {"role": "system", "content": "You write short, careful Python. " * 4}
    try:
        with ServerThread(engine, "tiny-ouro") as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)

            def complete(salt, n=1):
                extra = {} if salt is None else {"cache_salt": salt}
                return client.completions.create(model="tiny-ouro", prompt=prompt, max_tokens=6, temperature=0, n=n,
                                                 extra_body=extra)  # fmt: skip

            salts = ["tenant-a", "tenant-a", "tenant-b", None, "tenant-b", None]
            answers = [complete(salt) for salt in salts]
            two = complete("tenant-c", n=2)  # two choices of one salt: both carry it
            again = complete("tenant-c")
            asks = (("Sort a list.", "x"), ("Reverse a string.", "x"), ("Add two.", "y"))
            chats = [client.chat.completions.create(
                model="tiny-ouro", messages=[system, {"role": "user", "content": question}], max_tokens=6,
                temperature=0, extra_body={"cache_salt": salt}) for question, salt in asks]  # fmt: skip
            for bad in ("", 5, ["a"]):
                for path, body in (("/v1/completions", {"prompt": prompt}),
                                   ("/v1/chat/completions", {"messages": [system]})):  # fmt: skip
                    answer = httpx.post(server.url + path, json={"model": "tiny-ouro", "cache_salt": bad, **body},
                                        timeout=60)  # fmt: skip
                    error = answer.json()["error"]
                    assert answer.status_code == 400 and error["param"] == "cache_salt", (path, bad, answer.text)
                    assert "cache_salt" in error["message"]
        expected = reference.generate(prompt, SamplingParams(max_tokens=6, temperature=0.0))[0].text
        assert all(a.choices[0].text == expected for a in [*answers, again]) and two.choices[1].text == expected
        cached = [a.usage.prompt_tokens_details.cached_tokens for a in answers]
        full = (answers[0].usage.prompt_tokens - 1) // 4 * 4
        assert full > 0 and cached == [0, full, 0, 0, full, full]
        assert two.usage.prompt_tokens_details.cached_tokens == 0  # choices of one request: admitted together
        assert again.usage.prompt_tokens_details.cached_tokens == full
        chat_cached = [c.usage.prompt_tokens_details.cached_tokens for c in chats]
        assert chat_cached[0] == 0 and chat_cached[1] > 0 and chat_cached[2] == 0
    finally:
        engine.close()
        reference.close()
