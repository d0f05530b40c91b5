"""allowed_token_ids (vLLM's): only those tokens may be generated; every other logit is masked, in plain decoding,
drafts and verification alike, so speculation keeps plain decoding's output and the target's distribution."""

from __future__ import annotations

import httpx
import pytest
import torch
from chisquare import assert_distribution, three_token_distribution
from conftest import FAMILIES, decoding_modes, load, make_engine
from pydantic import ValidationError
from test_speculative import PROMPTS, top_k_filter

from looped_spec import SamplingParams, SpeculativeConfig, StructuredOutputs


def reference_allowed(adapter, prompt, max_tokens, allowed):
    """Greedy decoding by dense forwards with every token outside `allowed` masked."""
    tokens: list[int] = []
    for _ in range(max_tokens):
        logits = adapter.dense_logits(torch.tensor(prompt + tokens))[0, -1]
        masked = torch.full_like(logits, float("-inf"))
        masked[sorted(allowed)] = logits[sorted(allowed)]
        tokens.append(int(masked.argmax()))
    return tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_keeps_to_the_allowed_tokens_as_an_independent_reference_does(family):
    """Each prompt allows a few tokens plain decoding takes later but not its first (so the mask changes the output)
    and two others: every mode (fixed plans, adaptive, loop passes, per-token stopping) gives the dense
    reference's tokens, rows without allowed_token_ids beside them unchanged."""
    adapter = load(family)
    plain = make_engine(family)
    free = [o.token_ids for o in plain.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True))]
    params, expected = [], []
    for i, (prompt, out) in enumerate(zip(PROMPTS, free)):
        if i % 3 == 2:  # no allowed_token_ids: as plain
            params.append(SamplingParams(max_tokens=10, ignore_eos=True))
            expected.append(out)
            continue
        # plain's first token is not allowed, so each masked output differs from plain's from its first token
        allowed = sorted((set(out[1::3]) | {(7 * i + 11) % adapter.vocab_size, (13 * i + 5) % adapter.vocab_size})
                         - {out[0]})  # fmt: skip
        params.append(SamplingParams(max_tokens=10, ignore_eos=True, allowed_token_ids=allowed))
        expected.append(reference_allowed(adapter, prompt, 10, allowed))
        assert set(expected[-1]) <= set(allowed)
    assert sum(want != was for want, was in zip(expected, free)) >= len(PROMPTS) // 2
    for mode in decoding_modes(adapter.full_depth):
        engine = make_engine(family, max_batch_size=len(PROMPTS), **mode)
        outs = engine.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == expected, mode
        assert engine.num_free_blocks == engine.kv.num_blocks


def test_speculative_sampling_with_allowed_tokens_keeps_target_distribution():
    """Sampled with K = 2: the three first tokens' joint distribution is the target's renormalised over the allowed
    tokens (top_k of those), drafts masked as their verification is."""
    adapter = load("ouro")
    prompt, n, top_k = [5, 9, 13, 200], 4000, 3
    first = adapter.dense_logits(torch.tensor(prompt))[0, -1]
    allowed = sorted(set(first.topk(12).indices.tolist()[2:8]))  # not the two likeliest first tokens

    def next_tokens(output):
        logits = adapter.dense_logits(torch.tensor(prompt + output))[0, -1]
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        return zip(*top_k_filter(masked, top_k))

    probs = three_token_distribution(next_tokens)
    engine = make_engine(
        "ouro", speculation=SpeculativeConfig(k=2, d=1), max_batch_size=256, max_num_batched_tokens=4096, seed=17
    )
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=top_k, ignore_eos=True, allowed_token_ids=allowed)
    outs = engine.generate([prompt] * n, params)
    assert engine.stats.num_draft_tokens >= 1.5 * n  # K = 2 rounds
    assert engine.stats.num_accepted_tokens > 0 and engine.stats.num_draft_tokens > engine.stats.num_accepted_tokens
    assert all(set(o.token_ids) <= set(allowed) for o in outs)
    assert_distribution((tuple(o.token_ids[:3]) for o in outs), probs)


def test_allowed_tokens_are_checked_naming_the_field():
    assert SamplingParams(allowed_token_ids=[3, 1]).allowed_token_ids == [3, 1]
    for bad, match in (([], "allowed_token_ids"), ([-1], r"allowed_token_ids\[0\] = -1 is negative"),
                       (["a"], "allowed_token_ids")):  # fmt: skip
        with pytest.raises(ValidationError, match=match):
            SamplingParams(allowed_token_ids=bad)
    with pytest.raises(ValidationError, match="allowed_token_ids and structured_outputs: set at most one"):
        SamplingParams(allowed_token_ids=[1], structured_outputs=StructuredOutputs(regex="a"))
    engine = make_engine("ouro")
    vocab = engine.adapter.vocab_size
    with pytest.raises(ValueError, match=rf"allowed_token_ids\[1\] = {vocab} is outside the vocabulary"):
        engine.generate([[1, 2]], SamplingParams(allowed_token_ids=[1, vocab]))
    eos = engine.adapter.eos_token_ids[0]
    with pytest.raises(ValueError, match="allowed_token_ids: every one is a stop token"):
        engine.generate([[1, 2]], SamplingParams(allowed_token_ids=[eos], min_tokens=1))
    assert engine.num_free_blocks == engine.kv.num_blocks


def test_the_server_takes_allowed_token_ids():
    from server_utils import ServerThread

    from looped_spec import LoopedSpecEngine

    engine = LoopedSpecEngine("tiny-ouro", speculation="2,1", max_model_len=128)
    allowed = [199, 262, 297]
    with ServerThread(engine, "tiny-ouro") as server:
        body = {"model": "tiny-ouro", "prompt": [1, 2, 3], "max_tokens": 6, "temperature": 0,
                "allowed_token_ids": allowed}  # fmt: skip
        answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        reference = LoopedSpecEngine("tiny-ouro", speculation="off", max_model_len=128)  # the served one is busy
        [offline] = reference.generate([[1, 2, 3]], SamplingParams(max_tokens=6, temperature=0,
                                                                   allowed_token_ids=allowed))  # fmt: skip
        assert set(offline.token_ids) <= set(allowed) and len(offline.token_ids) == 6
        assert answer.json()["choices"][0]["text"] == offline.text
        bad = httpx.post(server.url + "/v1/completions", json={**body, "allowed_token_ids": [10**6]}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "allowed_token_ids", bad.text
