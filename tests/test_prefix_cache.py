"""Prefix caching: prompts that begin alike share the KV blocks of that beginning, with every output equal to the
same engine's without the cache (greedy and seeded sampling, every mode), no block leaked, the counts true."""

from __future__ import annotations

import pytest
import torch
from conftest import fixture_dir, load, make_engine

from looped_spec import LoopedSpecEngine, SamplingParams
from looped_spec.engine.prefix_cache import block_digests
from looped_spec.execution.kv_cache import KVCache
from looped_spec.models.kv_layout import KVLayout

SHARED = [5, 17, 29, 3, 88, 41, 9, 60, 2, 33, 71, 14, 90, 6, 25, 48, 7, 19, 64, 11]  # 20 tokens: 5 blocks of 4


def tiny_kv(num_blocks: int = 4) -> KVCache:
    layout = KVLayout(num_planes=1, num_kv_heads=1, head_dim=2, num_loop_planes=1)
    return KVCache(layout, num_blocks, block_size=2, dtype=torch.float32, device="cpu")


# ----- the allocator -----
def test_shared_blocks_are_counted_and_a_cached_block_is_handed_out_last():
    kv = tiny_kv(4)
    a: list[int] = []
    kv.grow(a, 4)  # two blocks
    kv.register(a[0], b"x")
    kv.register(a[1], b"xy")
    assert kv.cached_prefix([b"x", b"xy", b"xyz"]) == a
    b: list[int] = []
    kv.share(b, kv.cached_prefix([b"x"]))
    assert b == a[:1] and kv.holders(a[0]) == 2 and kv.num_free_blocks == 2
    held = list(a)
    kv.free(a)  # held[0] stays with b; held[1] is free but still cached
    assert kv.holders(held[0]) == 1 and kv.holders(held[1]) == 0 and kv.num_free_blocks == 3
    assert kv.cached_prefix([b"x", b"xy"]) == held
    c: list[int] = []
    kv.grow(c, 4)  # the two never-cached blocks first
    assert held[1] not in c and kv.cached_prefix([b"x", b"xy"]) == held
    d: list[int] = []
    kv.grow(d, 2)  # only the cached free block is left: handing it out forgets its prefix
    assert d == [held[1]] and kv.cached_prefix([b"x", b"xy"]) == held[:1]
    assert kv.num_free_blocks == 0 and kv.num_cached_blocks == 1
    for table in (b, c, d):
        kv.free(table)
    assert kv.num_free_blocks == 4


def test_cached_free_blocks_are_evicted_least_recently_freed_first():
    kv = tiny_kv(3)
    tables = []
    for name in (b"p", b"q", b"r"):
        table: list[int] = []
        kv.grow(table, 2)
        kv.register(table[0], name)
        tables.append(table)
    p, q, r = (list(t) for t in tables)
    kv.free(tables[1])
    kv.free(tables[0])
    kv.free(tables[2])
    fresh: list[int] = []
    kv.grow(fresh, 2)
    assert fresh == q  # freed first
    assert kv.cached_prefix([b"q"]) == [] and kv.cached_prefix([b"p"]) == p and kv.cached_prefix([b"r"]) == r


def test_a_block_registers_one_prefix_and_sharing_needs_an_empty_table():
    kv = tiny_kv(3)
    a: list[int] = []
    b: list[int] = []
    kv.grow(a, 2)
    kv.grow(b, 2)
    kv.register(a[0], b"x")
    kv.register(a[0], b"other")  # a block names one prefix
    assert kv.cached_prefix([b"x"]) == a and kv.cached_prefix([b"other"]) == []
    with pytest.raises(RuntimeError, match="starts a block table"):
        kv.share(b, a)


def test_a_prefix_computed_twice_stays_findable_while_either_copy_is():
    """Two requests computed the same prefix at once: each registers its copy (vLLM keeps every block of a hash).
    Evicting one copy leaves the other findable; a held copy is found before a free one."""
    kv = tiny_kv(4)
    a: list[int] = []
    b: list[int] = []
    kv.grow(a, 2)
    kv.grow(b, 2)
    kv.register(a[0], b"x")
    kv.register(b[0], b"x")
    assert kv.num_cached_blocks == 2 and kv.cached_prefix([b"x"]) in (a, b)
    copy_a, copy_b = a[0], b[0]
    kv.free(a)  # copy_a is free (still cached), copy_b held: sharing the held one takes no free block
    assert kv.cached_prefix([b"x"]) == [copy_b] and kv.num_free_blocks == 3
    other: list[int] = []
    kv.grow(other, 6)  # the two never-registered blocks, then copy_a: its copy is forgotten, copy_b's is not
    assert copy_a in other and kv.cached_prefix([b"x"]) == [copy_b] and kv.num_cached_blocks == 1
    kv.free(b)  # copy_b stays cached after its holder lets go
    assert kv.cached_prefix([b"x"]) == [copy_b]
    again: list[int] = []
    kv.share(again, kv.cached_prefix([b"x"]))
    assert again == [copy_b] and kv.holders(copy_b) == 1 and kv.num_free_blocks == 0
    kv.free(again)
    kv.free(other)
    last: list[int] = []
    kv.grow(last, 8)  # every block handed out: no copy is left
    assert kv.cached_prefix([b"x"]) == [] and kv.num_cached_blocks == 0
    kv.free(last)
    assert kv.num_free_blocks == 4


def test_digests_chain_every_token_before_and_the_seed():
    tokens = list(range(10))
    digests = block_digests(tokens, 3, 3, None)
    assert len(digests) == 3 and len(set(digests)) == 3
    changed = block_digests([99, *tokens[1:]], 3, 3, None)
    assert all(x != y for x, y in zip(digests, changed))  # block 0 differs, so every later prefix does
    assert block_digests(tokens, 3, 3, None)[:2] == block_digests(tokens[:6], 2, 3, None)
    seeded = block_digests(tokens, 3, 3, 7)
    assert seeded != digests and seeded != block_digests(tokens, 3, 3, 8)


# ----- the engine -----
def outputs(engine: LoopedSpecEngine, prompts, params, one_by_one: bool) -> list[list[int]]:
    if one_by_one:  # the later prompts find the earlier ones' blocks
        return [engine.generate([p], params)[0].token_ids for p in prompts]
    return [o.token_ids for o in engine.generate(prompts, params)]


def prompts_sharing(prefix_len: int) -> list[list[int]]:
    tails = [[101, 102, 103], [104], [105, 106, 107, 108, 109, 110], [111, 112]]
    return [SHARED[:prefix_len] + tail for tail in tails]


MODES = {
    "plain": dict(speculation="off"),
    "fixed plan": dict(speculation="2,1"),
    "adaptive": dict(speculation="adaptive"),
    "loop passes": dict(speculation="off", batching="loop"),
    "loop passes, fixed plan": dict(speculation="2,1", batching="loop"),
    "emulated graphs": dict(speculation="2,1", cuda_graphs="emulate"),
}


@pytest.mark.parametrize("family", ["ouro", "nanbeige", "huginn"])
@pytest.mark.parametrize("mode", list(MODES))
def test_outputs_equal_the_uncached_engines_and_every_block_comes_back(family, mode):
    prompts = prompts_sharing(20)
    params = SamplingParams(max_tokens=6, temperature=0.0, seed=3, ignore_eos=True)
    got = {}
    for caching in (False, True):
        engine = make_engine(family, block_size=4, max_batch_size=2, prefix_caching=caching, **MODES[mode])
        got[caching] = outputs(engine, prompts, params, one_by_one=True)
        got[caching] += outputs(engine, prompts, params, one_by_one=False)
        assert engine.num_free_blocks == engine.kv.num_blocks
        if caching:
            # one by one, the three prompts after the first find the 5 shared blocks (20 tokens); run again, each
            # finds every full block before its last token: 5 for prompts of 21-23 tokens, 6 for the one of 26
            hits = 3 * 20 + (20 + 20 + 24 + 20)
            assert engine.stats.num_prefix_cache_hits == hits
            assert engine.stats.num_prefix_cache_queries == 2 * sum(map(len, prompts))
            assert engine.stats.num_prompt_tokens == 2 * sum(map(len, prompts)) - hits
        else:
            assert engine.stats.num_prefix_cache_queries == 0
        engine.close()
    assert got[True] == got[False]


@pytest.mark.parametrize("mode", ["skip", "select"])
def test_early_exit_requests_share_a_prompt_run_at_full_depth(mode):
    """Exit rules apply from the last prompt token on, which is never cached: a request exiting early finds the blocks
    a full-depth request computed, and the other way round."""
    prompts = prompts_sharing(16)  # 16 shared tokens: the first prompt's last token starts a block of its own
    rules = [dict(exit_at_step=1), dict(), dict(exit_threshold=0.5), dict(exit_at_step=2)]
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, **rule) for rule in rules]
    got = {}
    for caching in (False, True):
        engine = make_engine("ouro", block_size=4, prefix_caching=caching, early_exit=mode, speculation="2,1")
        got[caching] = [engine.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
        assert engine.stats.num_prefix_cache_hits == (3 * 16 if caching else 0)
        assert engine.num_free_blocks == engine.kv.num_blocks
        engine.close()
    assert got[True] == got[False]


@pytest.mark.parametrize("speculation", ["off", "2,1"])
@pytest.mark.parametrize("first_exits", [False, True])
def test_a_conversation_finds_its_previous_turn_cached(speculation, first_exits):
    """The next turn's prompt is the previous prompt, its answer and more: the answer's blocks are cached too when
    every one of its tokens ran at full depth (skip-mode early exit leaves other KV in its planes: not cached)."""
    prompt = SHARED[:10]
    exits = {"exit_at_step": 1} if first_exits else {}
    got = {}
    for caching in (False, True):
        engine = make_engine("ouro", block_size=4, prefix_caching=caching, speculation=speculation)
        first = engine.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, **exits))[0]
        turn = prompt + first.token_ids + [120, 121, 122]
        second = engine.generate([turn], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
        got[caching] = (first.token_ids, second.token_ids)
        if caching:  # the first turn's prompt blocks (8 tokens), or every block before its last token (20)
            assert second.metrics.num_cached_tokens == (8 if first_exits else 20)
        assert engine.num_free_blocks == engine.kv.num_blocks
        engine.close()
    assert got[True] == got[False]


@pytest.mark.parametrize("length", [8, 9, 12, 13])
def test_the_last_prompt_token_is_always_computed(length):
    """A prompt of n tokens caches the full blocks before its last token: (n - 1) // block_size of them."""
    engine = make_engine("ouro", block_size=4, prefix_caching=True)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    first = engine.generate([SHARED[:length]], params)[0]
    again = engine.generate([SHARED[:length]], params)[0]
    assert again.token_ids == first.token_ids
    assert again.metrics.num_cached_tokens == (length - 1) // 4 * 4
    assert first.metrics.num_cached_tokens == 0


@pytest.mark.parametrize("initial_state", ["random", "zeros"])
def test_huginn_random_initial_states_share_only_under_the_same_seed(initial_state):
    """Huginn's random initial state draws each token's from the request's seed: its prompt KV depends on the seed
    (with zeros it does not)."""
    prompt = SHARED[:13]
    got = {}
    for caching in (False, True):
        engine = LoopedSpecEngine(fixture_dir("huginn"), adapter_options={"initial_state": initial_state},
                                  speculation="off", block_size=4, prefix_caching=caching)  # fmt: skip
        runs = [engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, seed=s))[0] for s in (5, 6, 5)]
        got[caching] = [r.token_ids for r in runs]
        if caching:
            expected = [0, 0, 12] if initial_state == "random" else [0, 12, 12]
            assert [r.metrics.num_cached_tokens for r in runs] == expected
        engine.close()
    assert got[True] == got[False]
    if initial_state == "random":
        assert got[False][0] != got[False][1]  # the seeds matter here, so sharing across them would show


def test_seeded_sampling_is_the_uncached_engines():
    prompts = prompts_sharing(20)
    params = [SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, seed=s, ignore_eos=True) for s in range(4)]
    got = {}
    for caching in (False, True):
        engine = make_engine("ouro", block_size=4, prefix_caching=caching)
        got[caching] = [engine.generate([p], q)[0].token_ids for p, q in zip(prompts, params)]
        engine.close()
    assert got[True] == got[False]


def test_under_kv_pressure_cached_blocks_are_evicted_and_nothing_leaks():
    """A cache of 12 blocks of 4 tokens, prompts of ~24 tokens: cached prefixes are evicted for new work, requests
    are preempted and recomputed (finding their own blocks again where they are still cached)."""
    prompts = [SHARED[: 12 + i] + [120 + i] * (8 + i % 3) for i in range(8)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    got = {}
    for caching in (False, True):
        engine = make_engine("ouro", block_size=4, num_kv_blocks=12, max_model_len=48, max_batch_size=4,
                             prefix_caching=caching, speculation="2,1")  # fmt: skip
        got[caching] = outputs(engine, prompts, params, one_by_one=False)
        got[caching] += outputs(engine, prompts[::-1], params, one_by_one=False)
        assert engine.num_free_blocks == engine.kv.num_blocks
        if caching:
            assert engine.scheduler.num_preemptions > 0 and engine.stats.num_prefix_cache_hits > 0
        engine.close()
    assert got[True] == got[False]


def test_a_prompt_computed_twice_at_once_stays_cached_after_the_first_copy_is_evicted():
    """The same prompt twice in one batch: both requests compute its blocks, each keeps a copy. Once the first
    finishes and other work takes its freed blocks, the prompt is still found in the second's copy (while it runs
    and after it finishes), with the uncached engine's output."""
    greedy = lambda n: SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)  # noqa: E731
    engine = make_engine("ouro", block_size=4, num_kv_blocks=16, max_model_len=48, prefix_caching=True)
    finished = {}

    def run_until(request_id: str) -> None:
        while request_id not in finished:
            finished.update((o.request_id, o) for o in engine.step() if o.finished)

    engine.add_request(SHARED, greedy(1), "first")
    engine.add_request(SHARED, greedy(24), "second")
    run_until("first")
    engine.add_request(list(range(100, 140)), greedy(1), "other")  # 11 blocks: every free one, the first's too
    run_until("other")
    assert "second" not in finished
    engine.add_request(SHARED, greedy(2), "while running")
    run_until("second")
    engine.add_request(SHARED, greedy(2), "after")
    run_until("after")
    # 20 tokens: the 4 full blocks before the last token
    assert [finished[r].metrics.num_cached_tokens for r in ("first", "second", "while running", "after")] == [
        0, 0, 16, 16,
    ]  # fmt: skip
    assert finished["while running"].token_ids == finished["after"].token_ids == finished["second"].token_ids[:2]
    assert engine.num_free_blocks == engine.kv.num_blocks
    engine.close()
    reference = make_engine("ouro", block_size=4)
    assert reference.generate([SHARED], greedy(24))[0].token_ids == finished["second"].token_ids
    reference.close()


def test_off_by_default_and_counted_in_the_metrics():
    engine = make_engine("ouro", block_size=4)
    assert engine.config.prefix_caching is False and engine.scheduler.prefix_cache is None
    engine.close()
    engine = make_engine("ouro", block_size=4, prefix_caching=True)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    engine.generate([SHARED[:13]] * 1, params)
    engine.generate([SHARED[:13]], params)
    text = engine.stats.to_prometheus()
    assert "looped_spec:prefix_cache_queries_total" in text and "looped_spec:prefix_cache_hits_total" in text
    assert engine.stats.to_dict()["num_prefix_cache_hits"] == 12
    engine.close()
    with pytest.raises(ValueError, match="prefix_caching"):
        LoopedSpecEngine(load("ouro"), prefix_caching="yes")


def test_the_server_reports_cached_prompt_tokens_in_usage():
    """Two chats with the same long system message through the official client: the second finds its start cached
    (OpenAI's usage.prompt_tokens_details.cached_tokens) and answers as an engine without the cache."""
    openai = pytest.importorskip("openai")
    from server_utils import ServerThread

    system = {"role": "system", "content": "You write short, careful Python. " * 6}
    chats = [[system, {"role": "user", "content": question}] for question in ("Sort a list.", "Reverse a string.")]
    reference = LoopedSpecEngine("tiny-ouro", speculation="off")
    engine = LoopedSpecEngine("tiny-ouro", speculation="2,1", prefix_caching=True)
    try:
        with ServerThread(engine, "tiny-ouro") as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
            answers = [client.chat.completions.create(model="tiny-ouro", messages=m, max_tokens=12, temperature=0)
                       for m in chats]  # fmt: skip
        for chat, answer in zip(chats, answers):
            rendered = reference.tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            expected = reference.generate(rendered, SamplingParams(max_tokens=12, temperature=0.0))[0]
            assert answer.choices[0].message.content == expected.text
            assert answer.usage.prompt_tokens == len(expected.prompt_token_ids)
        cached = [a.usage.prompt_tokens_details.cached_tokens for a in answers]
        assert cached[0] == 0 and cached[1] > 0 and cached[1] % engine.kv.block_size == 0
        assert cached[1] == engine.stats.num_prefix_cache_hits
    finally:
        reference.close()
        engine.close()


def test_the_usage_of_n_choices_counts_the_fewest_cached_tokens_any_choice_found():
    """`n` choices of one prompt run one after another (max_batch_size 1), so the second finds the blocks the first
    cached: the usage's cached_tokens is the fewest any choice found (0 the first time, every full block once the
    prompt is cached; not the most, not their sum), streamed or not, completions and chat."""
    openai = pytest.importorskip("openai")
    from server_utils import ServerThread

    engine = LoopedSpecEngine("tiny-ouro", speculation="off", prefix_caching=True, block_size=4, max_batch_size=1)
    try:
        with ServerThread(engine, "tiny-ouro") as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)

            def cached(stream: bool, chat: bool, text: str) -> tuple[int, int]:
                """(the usage's cached_tokens, prompt tokens the choices found cached between them)."""
                hits = engine.stats.num_prefix_cache_hits
                common = dict(model="tiny-ouro", max_tokens=3, temperature=0, n=2, stream=stream)
                if stream:
                    common["stream_options"] = {"include_usage": True}
                if chat:
                    answer = client.chat.completions.create(messages=[{"role": "user", "content": text}], **common)
                else:
                    answer = client.completions.create(prompt=text, **common)
                usage = [c.usage for c in answer if c.usage is not None][-1] if stream else answer.usage
                return usage.prompt_tokens_details.cached_tokens, engine.stats.num_prefix_cache_hits - hits

            for k, (stream, chat) in enumerate(((False, False), (True, False), (False, True), (True, True))):
                text = f"Request {k}: you write short, careful Python. Sort a list."
                first, found_first = cached(stream, chat, text)
                again, found = cached(stream, chat, text)
                assert again > 0 and found == 2 * again, (stream, chat)  # each choice found every full block
                # the first time the second choice found them all (the first one, less: a chat template's start)
                assert first < again and found_first == first + again, (stream, chat)
    finally:
        engine.close()


@pytest.mark.cuda
@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_prefix_caching_on_cuda_equals_the_uncached_engine(family):
    """On a GPU, in fp32, with captured steps and captured loop passes (the paged kernel reading shared blocks):
    outputs with the cache equal those without, and no block leaks."""
    from conftest import adapter_options

    from looped_spec import load_adapter

    adapter = load_adapter(fixture_dir(family), dtype="float32", device="cuda", **adapter_options(family))
    prompts = prompts_sharing(20)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for batching in ("step", "loop"):
        got = {}
        for caching in (False, True):
            engine = LoopedSpecEngine(adapter, speculation="2,1", block_size=4, batching=batching,
                                      prefix_caching=caching)  # fmt: skip
            got[caching] = outputs(engine, prompts, params, one_by_one=True)
            assert engine.num_free_blocks == engine.kv.num_blocks
            if caching:
                assert engine.stats.num_prefix_cache_hits == 3 * 20
            engine.close()
        assert got[True] == got[False], batching


def test_a_preempted_request_counts_what_its_first_admission_found():
    """Back after a preemption, a request finds its own blocks (those of its prompt and of tokens it generated): the
    queries and hits count them (tokens to prefill), its num_cached_tokens only what the cache gave it at first (as
    vLLM; the server's usage.prompt_tokens_details.cached_tokens)."""
    engine = make_engine("ouro", block_size=4, num_kv_blocks=12, max_model_len=48, prefix_caching=True)
    engine.add_request(list(range(10, 30)), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True), "X")
    engine.add_request(list(range(40, 45)), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True), "Y")
    outs = {}
    while engine.has_unfinished_requests():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    preempted = [o for o in outs.values() if o.metrics.num_preemptions]
    assert preempted and engine.stats.num_prefix_cache_hits > sum(len(o.prompt_token_ids) for o in preempted)
    assert [o.metrics.num_cached_tokens for o in outs.values()] == [0, 0]  # prompts that share nothing
    assert engine.stats.num_prompt_tokens == engine.stats.num_prefix_cache_queries - engine.stats.num_prefix_cache_hits
    engine.close()
