"""Engine-side log-probabilities (SamplingParams.logprobs): each generated token's log-softmax of the logits it was
read out from, before temperature. Checked against independent references: the cache-free full-depth forward
(plain and speculative decoding, greedy and sampled), the cache-free forward at a fixed depth, and the token-by-token
early-exit reference of test_early_exit.py (plain and speculative, skip and select)."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import pytest
import torch
from conftest import FAMILIES, load, make_engine, reference, with_small_vocabulary
from test_early_exit import exit_params, reference_generate

from looped_spec import LoopedSpecEngine, SamplingParams, SpeculativeConfig, load_adapter

TOP = 3


def dense_logprobs(adapter, prompt: list[int], tokens: list[int], seed: int, depth: int | None = None) -> list:
    """log p(token) of each generated token from one cache-free forward of prompt + tokens (the reference)."""
    ids = torch.tensor(prompt + tokens)
    logprobs = torch.log_softmax(adapter.dense_logits(ids, depth, seeds=[seed])[0].float(), dim=-1)
    n = len(prompt)
    return [logprobs[n - 1 + i, t].item() for i, t in enumerate(tokens)]


def check_entries(out, expected: list[float]) -> None:
    entries = out.logprobs
    assert len(entries) == len(out.token_ids) == len(expected)
    assert [e.token for e in entries] == list(out.token_ids)
    assert [e.logprob for e in entries] == pytest.approx(expected, abs=2e-4)
    for entry in entries:  # the top list: TOP most likely, descending, the chosen one's value among them if there
        values = [v for _, v in entry.top]
        assert len(values) == TOP and values == sorted(values, reverse=True) and values[0] >= entry.logprob - 1e-5


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("speculation", ["off", SpeculativeConfig(k=3, d=1), "adaptive"])
def test_full_depth_logprobs_are_the_models_own_with_or_without_speculation(family, speculation):
    """Greedy and sampled requests side by side: every token's entry equals the cache-free forward's."""
    adapter = load(family)
    prompts = [reference(family)["prompts"][i % 2] for i in range(3)]
    engine = LoopedSpecEngine(adapter, speculation=speculation, max_batch_size=4)
    params = [
        SamplingParams(max_tokens=9, logprobs=TOP, ignore_eos=True, seed=5),
        SamplingParams(max_tokens=7, logprobs=TOP, ignore_eos=True, temperature=0.9, top_k=20, seed=6),
        SamplingParams(max_tokens=8, ignore_eos=True, seed=7),  # did not ask: no entries, no cost
    ]
    outs = engine.generate(prompts, params)
    for prompt, p, out in zip(prompts, params[:2], outs[:2]):
        check_entries(out, dense_logprobs(adapter, prompt, list(out.token_ids), p.seed))
    assert outs[2].logprobs is None
    assert engine.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("speculation", ["off", SpeculativeConfig(k=3, d=1)])
def test_each_request_gets_its_own_entries_whatever_its_place_in_the_batch(speculation):
    """A request that did not ask comes first and the two that did ask for different counts: each entry is its own
    token's, with as many most likely tokens as its request asked for."""
    adapter = load("ouro")
    prompts = [reference("ouro")["prompts"][i % 2] for i in range(3)]
    params = [
        SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9, seed=4),  # did not ask
        SamplingParams(max_tokens=7, logprobs=1, ignore_eos=True, temperature=0.9, top_k=20, seed=5),
        SamplingParams(max_tokens=8, logprobs=TOP, ignore_eos=True, seed=6),
    ]
    outs = LoopedSpecEngine(adapter, speculation=speculation, max_batch_size=4).generate(prompts, params)
    assert outs[0].logprobs is None
    for prompt, p, out in zip(prompts[1:], params[1:], outs[1:]):
        entries = out.logprobs
        assert [e.token for e in entries] == list(out.token_ids)
        want = dense_logprobs(adapter, prompt, list(out.token_ids), p.seed)
        assert [e.logprob for e in entries] == pytest.approx(want, abs=2e-4)
        assert all(len(e.top) == p.logprobs for e in entries)


@pytest.mark.parametrize("speculation", ["off", SpeculativeConfig(k=3, d=1)])
def test_entries_are_the_raw_logits_before_every_adjustment_as_vllms_raw_logprobs(speculation):
    """vLLM's default logprobs_mode (raw_logprobs): the log-softmax of the logits before the logit bias, the
    penalties, allowed_token_ids, min_tokens, temperature, top-k, top-p and min-p. Each entry, its rank (the tokens at
    least as likely) and its top ones are the cache-free forward's log-softmax, never the distribution the token was
    drawn from (whose top ones would all be allowed tokens)."""
    adapter = load("ouro")
    prompt = list(reference("ouro")["prompts"][0])
    common = dict(max_tokens=10, logprobs=TOP, ignore_eos=True)
    params = [
        SamplingParams(**common, seed=1, logit_bias={5: 8.0, 7: -5.0}, repetition_penalty=1.8, presence_penalty=1.0,
                       frequency_penalty=0.5),
        SamplingParams(**common, seed=2, temperature=0.7, top_k=5, top_p=0.8, min_p=0.1, repetition_penalty=0.7,
                       allowed_token_ids=list(range(3, 40)), min_tokens=5),
        SamplingParams(**common, seed=3, temperature=2.0, frequency_penalty=-1.0, logit_bias={9: 3.0}),
    ]  # fmt: skip
    outs = LoopedSpecEngine(adapter, speculation=speculation, max_batch_size=4).generate([prompt] * 3, params)
    for p, out in zip(params, outs):
        ids = prompt + list(out.token_ids)
        raw = torch.log_softmax(adapter.dense_logits(torch.tensor(ids), seeds=[p.seed])[0].float(), dim=-1)
        rows = raw[len(prompt) - 1 : -1]
        assert [e.token for e in out.logprobs] == list(out.token_ids)
        assert [e.logprob for e in out.logprobs] == pytest.approx(rows.gather(1, torch.tensor(out.token_ids)[:, None])
                                                                  [:, 0].tolist(), abs=2e-4)  # fmt: skip
        assert [e.rank for e in out.logprobs] == [
            int((row >= row[e.token]).sum()) for row, e in zip(rows, out.logprobs)
        ]
        assert [[t for t, _ in e.top] for e in out.logprobs] == rows.topk(TOP).indices.tolist()
    assert set(outs[1].token_ids) <= set(range(3, 40))
    assert any(t not in range(3, 40) for e in outs[1].logprobs for t, _ in e.top)


def test_greedy_speculative_logprobs_equal_plain_ones_and_stop_where_the_output_stops():
    adapter = load("ouro")
    prompts = reference("ouro")["prompts"][:2]
    params = SamplingParams(max_tokens=12, logprobs=2, ignore_eos=True, seed=1)
    plain = LoopedSpecEngine(adapter, speculation="off").generate(prompts, params)
    spec = LoopedSpecEngine(adapter, speculation=SpeculativeConfig(k=4, d=1)).generate(prompts, params)
    for a, b in zip(plain, spec):
        assert a.token_ids == b.token_ids
        assert [e.logprob for e in a.logprobs] == pytest.approx([e.logprob for e in b.logprobs], abs=1e-5)
    # a stop token inside a speculative round: the entries end with the output
    stop = plain[0].token_ids[4]
    cut = LoopedSpecEngine(adapter, speculation=SpeculativeConfig(k=4, d=1)).generate(
        prompts[:1], params.model_copy(update={"stop_token_ids": [stop]})
    )[0]
    assert len(cut.logprobs) == len(cut.token_ids) == plain[0].token_ids.index(stop) + 1


def test_streamed_outputs_carry_the_entries_of_their_new_tokens_and_survive_preemption():
    """Through step(): the last len(new_token_ids) entries are the new ones; a KV cache small enough to preempt
    (and recompute) requests gives the entries of a roomy one."""
    adapter = load("ouro")
    prompts = [reference("ouro")["prompts"][i % 2] for i in range(4)]
    params = SamplingParams(max_tokens=24, logprobs=1, ignore_eos=True, seed=2)
    roomy = LoopedSpecEngine(adapter, speculation=SpeculativeConfig(k=2, d=1)).generate(prompts, params)
    tight = LoopedSpecEngine(
        adapter, speculation=SpeculativeConfig(k=2, d=1), block_size=4, num_kv_blocks=20, max_model_len=64
    )
    for prompt in prompts:
        tight.add_request(prompt, params)
    streamed: dict[str, list] = {}
    finals = {}
    outputs = []
    while tight.has_unfinished_requests():
        for out in tight.step():
            outputs.append(out)
            new = out.logprobs[len(out.logprobs) - len(out.new_token_ids) :] if out.new_token_ids else []
            streamed.setdefault(out.request_id, []).extend(new)
            if out.finished:
                finals[out.request_id] = out
    assert tight.scheduler.num_preemptions > 0
    # an output keeps the entries it was returned with: one per token it holds, whatever the request did after
    assert all(len(out.logprobs) == len(out.token_ids) for out in outputs)
    for i, want in enumerate(roomy):
        got = finals[str(i)]
        assert got.token_ids == want.token_ids and streamed[str(i)] == got.logprobs
        assert [e.logprob for e in got.logprobs] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-5)


def test_fixed_depth_logprobs_are_the_readout_at_that_depth():
    """exit_at_step = e: a looped model's loops 1..e never see deeper ones, so the cache-free forward at depth e
    reads out every generated token exactly as the engine did."""
    adapter = load("ouro")
    prompts = reference("ouro")["prompts"][:2]
    for speculation in ("off", SpeculativeConfig(k=3, d=1)):
        engine = LoopedSpecEngine(adapter, speculation=speculation)
        for e in range(1, adapter.full_depth):
            params = SamplingParams(max_tokens=8, logprobs=TOP, ignore_eos=True, exit_at_step=e, seed=1)
            for prompt, out in zip(prompts, engine.generate(prompts, params)):
                check_entries(out, dense_logprobs(adapter, prompt, list(out.token_ids), 1, depth=e))


@pytest.mark.parametrize("mode", ["skip", "select"])
@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_early_exit_logprobs_are_the_exit_depths_readout(family, mode):
    """Rules that exit at mixed depths: the entries equal the token-by-token early-exit reference's logits, with
    and without speculation."""
    adapter = load(family)
    prompt = reference(family)["prompts"][0]
    for base in exit_params(family):
        params = base.model_copy(update={"max_tokens": 8, "ignore_eos": True, "seed": 3, "logprobs": TOP})
        tokens, logits, _ = reference_generate(adapter, family, prompt, 8, params, mode, 3)
        expected = [torch.log_softmax(row.float(), -1)[t].item() for row, t in zip(logits, tokens)]
        for speculation in ("off", SpeculativeConfig(k=3, d=1)):
            engine = LoopedSpecEngine(adapter, speculation=speculation, early_exit=mode)
            out = engine.generate([prompt], params)[0]
            assert list(out.token_ids) == tokens, (base, speculation)
            check_entries(out, expected)


@pytest.mark.parametrize("family", ["ouro", "huginn"])
def test_loop_batching_returns_the_step_engines_logprobs(family):
    """One loop pass serving requests at different loops: plain tokens, early exits and a fixed plan's verified
    tokens carry the entries the step engine gives them."""
    adapter = load(family)
    prompts = [reference(family)["prompts"][i % 2] for i in range(4)]
    # a threshold (Ouro's gate; Huginn's KL rule reads out through attention, which loop passes refuse) and a depth
    rules = [exit_params(family)[0] if family == "ouro" else SamplingParams(exit_at_step=2), exit_params(family)[-1]]
    rules += [SamplingParams(), SamplingParams()]
    params = [p.model_copy(update={"max_tokens": 7 + i, "ignore_eos": True, "seed": i, "logprobs": 2})
              for i, p in enumerate(rules)]  # fmt: skip
    for speculation in ("off", SpeculativeConfig(k=2, d=1)):
        step = LoopedSpecEngine(adapter, speculation=speculation, max_batch_size=4).generate(prompts, params)
        loop = LoopedSpecEngine(adapter, speculation=speculation, max_batch_size=4, batching="loop")
        for a, b in zip(step, loop.generate(prompts, params)):
            assert a.token_ids == b.token_ids
            assert [e.token for e in b.logprobs] == list(b.token_ids)
            assert [e.logprob for e in b.logprobs] == pytest.approx([e.logprob for e in a.logprobs], abs=1e-5)
        assert loop.stats.num_loop_passes > 0


def test_logprobs_count_is_checked():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


def test_more_most_likely_tokens_than_the_vocabulary_holds_is_an_error_naming_the_field(tmp_path):
    """A model of 16 tokens asked for the 20 most likely: refused at add_request naming `logprobs` /
    `prompt_logprobs` (a step failed on it with torch's 'selected index k out of range'); the whole vocabulary may be
    asked for."""
    folder = with_small_vocabulary(tmp_path / "vocab-16", 16)
    for options in (dict(speculation="off"), dict(speculation="2,1"), dict(batching="loop")):
        engine = LoopedSpecEngine(str(folder), **options)
        for field in ("logprobs", "prompt_logprobs"):
            with pytest.raises(ValueError, match=rf"^{field}=20: .*vocabulary holds \(16\)"):
                engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, **{field: 20}))
            assert not engine.has_unfinished_requests()
        out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, logprobs=16, prompt_logprobs=16))[0]
        assert [len(e.top) for e in out.logprobs] == [16, 16] and len(out.prompt_logprobs[1].top) == 16


def test_score_checks_its_arguments_naming_them():
    engine = make_engine("ouro", max_model_len=32)
    vocab = engine.adapter.vocab_size
    cases = [
        (([1, vocab],), ValueError, r"token_ids\[1\] = .* outside the vocabulary"),
        (([1, -1],), ValueError, r"token_ids\[1\]"),
        (([1, 2.0],), TypeError, r"token_ids\[1\]"),
        (("hello",), TypeError, "list of token ids"),
        # a prompt dict or an array is not token ids: a salted dict scored 2 of its 4 tokens, an array failed on its
        # truth value (numpy's or torch's message, naming no field)
        (({"prompt_token_ids": [1, 2, 3, 4], "cache_salt": "s"},), TypeError, "token_ids must be a list .* got dict"),
        (({"prompt_token_ids": [1, 2, 3, 4]},), TypeError, "token_ids must be a list .* got dict"),
        ((torch.tensor([1, 2, 3]),), TypeError, "token_ids must be a list .* got Tensor"),
        ((list(range(1, 34)),), ValueError, "max_model_len=32"),
        (([1, 2], -1), ValueError, "top_n=-1"),
        (([1, 2], vocab + 1), ValueError, "top_n="),
        (([1, 2], 1, -1), ValueError, "seed=-1"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            engine.score(*args)
    assert len(engine.score(list(range(1, 33)), 2)) == 32  # max_model_len tokens may be scored


@pytest.mark.parametrize("family", FAMILIES)
def test_prompt_logprobs_score_each_prompt_token_given_the_ones_before_it(family):
    """SamplingParams.prompt_logprobs (vLLM's): one entry per prompt token, the first None, each the log-softmax of the
    full-depth logits at the position before it, whatever the engine's mode; outputs without it carry None."""
    adapter = load(family)
    prompts = list(reference(family)["prompts"][:2])
    for options in (dict(speculation="off"), dict(speculation=SpeculativeConfig(k=2, d=1)), dict(batching="loop")):
        engine = LoopedSpecEngine(adapter, max_batch_size=2, **options)
        outs = engine.generate(prompts, [SamplingParams(max_tokens=3, seed=4, prompt_logprobs=TOP),
                                         SamplingParams(max_tokens=3, seed=4)])  # fmt: skip
        entries = outs[0].prompt_logprobs
        assert outs[1].prompt_logprobs is None and len(entries) == len(prompts[0]) and entries[0] is None
        expected = dense_logprobs(adapter, prompts[0][:1], prompts[0][1:], seed=4)
        assert [e.token for e in entries[1:]] == prompts[0][1:]
        assert [e.logprob for e in entries[1:]] == pytest.approx(expected, abs=2e-4)
        assert all(len(e.top) == TOP for e in entries[1:])
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


@pytest.mark.parametrize("speculation", ["off", SpeculativeConfig(k=3, d=1)])
def test_vllm_code_reads_the_entries_as_vllms_dicts_of_ranked_logprobs(speculation):
    """Code written for vLLM reads `outputs[0].logprobs[i]` and `prompt_logprobs[i]` as dicts token id -> Logprob
    (`.logprob`, `.rank`): the token and the top ones, each ranked as in the full distribution (the cache-free
    forward's: 1 + the tokens at least as likely besides it), the top ones 1, 2, ..."""
    adapter = load("ouro")
    prompt = list(reference("ouro")["prompts"][0])
    engine = LoopedSpecEngine(adapter, speculation=speculation, max_batch_size=2)
    params = SamplingParams(max_tokens=8, logprobs=TOP, prompt_logprobs=TOP, ignore_eos=True, temperature=1.0, seed=3)
    out = engine.generate([prompt], params)[0]
    ids = prompt + list(out.token_ids)
    reference_logprobs = torch.log_softmax(adapter.dense_logits(torch.tensor(ids), seeds=[3])[0].float(), dim=-1)
    positions = [(len(prompt) - 1 + i, entry) for i, entry in enumerate(out.outputs[0].logprobs)]
    positions += [(i - 1, entry) for i, entry in enumerate(out.prompt_logprobs) if entry is not None]
    assert len(positions) == len(out.token_ids) + len(prompt) - 1
    ranked_below_top = 0
    for position, entry in positions:
        token = ids[position + 1]
        row = reference_logprobs[position]
        assert token in entry and set(entry) == {token, *row.topk(TOP).indices.tolist()}
        assert entry[token].logprob == pytest.approx(row[token].item(), abs=2e-4)
        top_ids = row.topk(TOP).indices.tolist()
        expected_rank = top_ids.index(token) + 1 if token in top_ids else int((row >= row[token]).sum())
        assert entry[token].rank == expected_rank
        ranked_below_top += expected_rank > TOP
        assert sorted(entry[t].rank for t in top_ids) == list(range(1, TOP + 1))
        assert all(entry[t].decoded_token is None for t in entry)  # the fixture has no tokenizer: no texts
    assert ranked_below_top > 0  # sampled at temperature 1: some tokens lie outside the top ones


def test_entries_carry_each_tokens_text_as_vllms_decoded_token():
    """With a tokenizer, every Logprob of an entry (the token's and the top ones', generated and prompt) has its token's
    text in `decoded_token`, as vLLM fills it: the token decoded alone, or, where its bytes are not whole UTF-8
    characters (a piece of a multi-byte one) `bytes:\\x..`, as the server's log-probabilities show it, never U+FFFD.
    The entries still pickle (the texts are strings)."""
    engine = LoopedSpecEngine("tiny-ouro", speculation="off")
    tokenizer = engine.tokenizer
    prompt = tokenizer.encode("def fibonacci(n): 日本")
    params = SamplingParams(max_tokens=8, logprobs=TOP, prompt_logprobs=TOP, temperature=1.0, seed=5, ignore_eos=True)
    out = engine.generate([prompt], params)[0]
    entries = [*out.outputs[0].logprobs, *out.prompt_logprobs[1:]]
    seen = set()
    for entry in entries:
        for token in entry:
            text, alone = entry[token].decoded_token, tokenizer.decode([token])
            assert text == alone or (text.startswith("bytes:") and alone == "\ufffd")
            seen.add(text)
    assert any(text.startswith("bytes:") for text in seen)  # "日本" splits into pieces of characters
    assert pickle.loads(pickle.dumps(entries)) == entries


@pytest.mark.parametrize("family", [*FAMILIES, "toy"])
def test_scoring_holds_one_chunk_of_positions_logits_at_a_time(family, monkeypatch, tmp_path):
    """`score` (and `prompt_logprobs`, which it serves) projects max_num_batched_tokens positions at a time, as a
    prefill step reads out, so a long prompt's [T, V] logits never have to fit beside the KV cache; its entries are one
    dense forward's. A family that does not split its readout (the example's toy) is scored in slices of its logits."""
    if family == "toy":
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
        from custom_family import make_toy_checkpoint

        adapter = load_adapter(make_toy_checkpoint(tmp_path / "toy"), dtype="float32", device="cpu")
    else:
        adapter = load(family)
    engine = LoopedSpecEngine(adapter, max_num_batched_tokens=4, max_model_len=32, speculation="off")
    projected = []  # rows per vocabulary projection
    if family != "toy":
        head = adapter.head
        monkeypatch.setattr(adapter, "head", lambda hidden: projected.append(len(hidden)) or head(hidden))
    ids = [(7 * i + 3) % adapter.vocab_size for i in range(19)]
    entries = engine.score(ids, TOP, seed=3)
    # the 19 positions (the last one scores nothing, but is read out with its chunk)
    assert projected == ([] if family == "toy" else [4, 4, 4, 4, 3])
    full = torch.log_softmax(adapter.dense_logits(torch.tensor(ids), seeds=[3])[0], dim=-1)
    assert entries[0] is None and [e.token for e in entries[1:]] == ids[1:]
    assert [e.logprob for e in entries[1:]] == pytest.approx([full[t, i].item() for t, i in enumerate(ids[1:])],
                                                             abs=2e-4)  # fmt: skip
    assert [[i for i, _ in e.top] for e in entries[1:]] == full[:-1].topk(TOP).indices.tolist()
