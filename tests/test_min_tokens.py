"""min_tokens (vLLM's meaning): the first min_tokens tokens are never stop tokens (masked in the sampler) and complete
no stop string; speculation keeps plain decoding's output and the target's distribution. And the stop text vLLM
leaves out (a stop token's, a stop string) unless include_stop_str_in_output, and skip_special_tokens."""

from __future__ import annotations

import pytest
import torch
from chisquare import assert_distribution, three_token_distribution
from conftest import FAMILIES, decoding_modes, load, make_engine
from pydantic import ValidationError
from test_speculative import PROMPTS, top_k_filter

from looped_spec import SamplingParams, SpeculativeConfig
from looped_spec.detokenizer import IncrementalDetokenizer
from looped_spec.engine.inputs import load_tokenizer
from looped_spec.execution.sampler import SamplingRows
from looped_spec.models import shipped_model_path
from looped_spec.request import Request
from looped_spec.speculative.proposer import DraftProposer


def test_min_tokens_is_checked_naming_the_field():
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4
    with pytest.raises(ValidationError, match="min_tokens=5 must be at most max_tokens=4"):
        SamplingParams(max_tokens=4, min_tokens=5)
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(ValidationError, match="min_tokens"):
            SamplingParams(min_tokens=bad)


def request_with(output: list[int], min_tokens: int, stop_token_ids: list[int], ignore_eos: bool = False) -> Request:
    params = SamplingParams(max_tokens=20, min_tokens=min_tokens, stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
    request = Request("r", 0, [1, 2, 3], params, seed=0, eos_token_ids=[0], max_model_len=64)
    request.token_ids += output
    return request


def test_the_stop_tokens_of_positions_short_of_min_tokens_are_masked():
    """A request with 2 tokens of output and min_tokens 4: at its next position (no drafts before it) and after one
    draft its stop tokens (eos and stop_token_ids) are masked; after two drafts the output before the position holds 4
    and nothing is. Other logits are untouched; a request past its min_tokens, or without one, is not masked; one
    that ignores eos has it masked before min_tokens all the same."""
    logits = torch.randn(6, 12, generator=torch.Generator().manual_seed(3))
    short = request_with([5, 6], 4, [7, 9])
    requests = [short, short, short, request_with([5, 6, 5, 6], 4, [7]), request_with([5], 0, [7]),
                request_with([5], 3, [7], ignore_eos=True)]  # fmt: skip
    drafted = [[], [8], [8, 8], [], [], [1]]
    rows = SamplingRows.build(requests, torch.device("cpu"), drafted)
    assert rows.adjusts and rows.counts_drafts
    got = rows.adjusted(logits)
    want = logits.clone()
    # eos too under ignore_eos, as vLLM's min_tokens masks it
    want[0, [0, 7, 9]] = want[1, [0, 7, 9]] = want[5, [0, 7]] = float("-inf")
    torch.testing.assert_close(got, want)
    # past min_tokens there is nothing to adjust, and no need for the drafts
    done = SamplingRows.build(requests[3:5], torch.device("cpu"))
    assert not done.adjusts and not done.counts_drafts and requests[3].depends_on_output is False


def reference_min_tokens(adapter, prompt, max_tokens, min_tokens, stop_ids):
    """Greedy decoding by dense forwards: the stop tokens' logits set to -inf while the output is short of min_tokens,
    the request ending at the first stop token after that."""
    tokens: list[int] = []
    while len(tokens) < max_tokens:
        logits = adapter.dense_logits(torch.tensor(prompt + tokens))[0, -1].clone()
        if len(tokens) < min_tokens:
            logits[sorted(stop_ids)] = float("-inf")
        tokens.append(int(logits.argmax()))
        if tokens[-1] in stop_ids and len(tokens) > min_tokens:
            break
    return tokens


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_min_tokens_follows_an_independent_reference_with_and_without_speculation(family):
    """Stop tokens chosen among the tokens plain decoding emits first: min_tokens changes the output (they are masked
    early) and ends it at the first one that comes after min_tokens, as the dense reference does, with speculation
    (fixed, adaptive, on loop passes) as without."""
    adapter = load(family)
    plain = make_engine(family)
    unadjusted = [o.token_ids for o in plain.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))]
    params, expected = [], []
    for prompt, out, min_tokens in zip(PROMPTS, unadjusted, [0, 1, 3, 5, 7, 12, 2, 4]):
        stop_ids = set(out[:6:2]) | set(adapter.eos_token_ids)  # the model's eos and three of plain's tokens
        params.append(SamplingParams(max_tokens=12, min_tokens=min_tokens, stop_token_ids=sorted(set(out[:6:2]))))
        expected.append(reference_min_tokens(adapter, prompt, 12, min_tokens, stop_ids))
    assert sum(want != was for want, was in zip(expected, unadjusted)) >= len(PROMPTS) // 2
    assert any(len(want) < 12 for want in expected)  # some end at a stop token after their min_tokens
    for mode in decoding_modes(adapter.full_depth):
        engine = make_engine(family, max_batch_size=len(PROMPTS), **mode)
        outs = engine.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == expected, mode
        assert [o.finish_reason for o in outs] == ["stop" if len(w) < 12 else "length" for w in expected], mode
        assert engine.num_free_blocks == engine.kv.num_blocks


def test_speculative_sampling_with_min_tokens_keeps_target_distribution():
    """min_tokens 2 with the likeliest tokens as stop tokens: the first two positions mask them, the third does not
    (and a stop token there ends the request). The third token comes from the same K = 2 round as the second, whose
    masks differ by the drafts before each position: rejection sampling keeps the joint distribution of the three."""
    adapter = load("ouro")
    prompt, n, top_k, min_tokens = [5, 9, 13, 200], 4000, 4, 2
    first = adapter.dense_logits(torch.tensor(prompt))[0, -1]
    stop_ids = sorted(set(first.topk(2).indices.tolist()) | set(adapter.eos_token_ids))

    def next_tokens(output):
        logits = adapter.dense_logits(torch.tensor(prompt + output))[0, -1].clone()
        if len(output) < min_tokens:
            logits[stop_ids] = float("-inf")
        return zip(*top_k_filter(logits, top_k))

    probs = three_token_distribution(next_tokens)
    engine = make_engine(
        "ouro", speculation=SpeculativeConfig(k=2, d=1), max_batch_size=256, max_num_batched_tokens=4096, seed=17
    )
    # max_tokens 4: the round after the first token drafts K = 2 (a round keeps one token of the budget for its last)
    params = SamplingParams(max_tokens=4, min_tokens=min_tokens, temperature=1.0, top_k=top_k,
                            stop_token_ids=first.topk(2).indices.tolist())  # fmt: skip
    outs = engine.generate([prompt] * n, params)
    assert engine.stats.num_accepted_tokens > 0 and engine.stats.num_draft_tokens > engine.stats.num_accepted_tokens
    assert engine.stats.num_draft_tokens >= 1.5 * n  # K = 2 rounds
    assert all(len(o.token_ids) >= 3 for o in outs)  # nothing stops before the third token
    assert any(o.finish_reason == "stop" and len(o.token_ids) == 3 for o in outs)  # a stop token there does end it
    assert_distribution((tuple(o.token_ids[:3]) for o in outs), probs)


def test_the_detokenizer_finds_stop_strings_only_in_text_it_is_asked_to_look_at():
    """A stop string whose text ends in tokens appended with find_stop=False is ignored; one that a later token
    completes ends the request (text cut before it)."""
    tokenizer = load_tokenizer(shipped_model_path("tiny-ouro"))
    ids = tokenizer.encode("ab ab ab cd")

    def run(find_from: int) -> tuple[int, str]:
        detok = IncrementalDetokenizer(tokenizer, stop=["ab"])
        for n, token in enumerate(ids, 1):
            if detok.append(token, n >= find_from):
                return n, detok.text
        return len(ids), detok.text

    first = next(n for n in range(1, len(ids) + 1) if "ab" in tokenizer.decode(ids[:n]))
    assert run(1) == (first, "")
    later, text = run(first + 1)
    assert later > first and text == tokenizer.decode(ids[:later]).rsplit("ab", 1)[0]
    assert text.startswith("ab")  # the first "ab" stayed in the text


class Letters:
    """A tokenizer writing token t as one letter (a..z)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + t % 26) for t in ids)


@pytest.mark.parametrize("others", [[], ["zzzzzzzz"], ["q", "zzzzzz"]])
def test_a_stop_string_must_end_in_text_looked_at_whatever_the_other_stop_strings(others):
    """Each stop string is looked for where an occurrence would end in the new text: a longer stop string beside it
    must not widen the window back into text that was not to be looked at."""
    tokens = [23, 24, 2, 3, 24, 23, 24, 6]  # "xycdyxyg": "xy" ends at the 2nd letter, and again at the 7th
    detok = IncrementalDetokenizer(Letters(), stop=["xy", *others])
    stopped = next(n for n, t in enumerate(tokens, 1) if detok.append(t, n > 4))  # looks from the 5th token on
    assert (stopped, detok.text, detok.stop_hit) == (7, "xycdy", "xy")


def test_a_stop_string_ends_a_request_only_from_the_token_after_its_min_tokens():
    """As vLLM: the token at output index i may complete a stop string only when i >= min_tokens."""
    engine = make_engine_with_tokenizer()
    prompt = "def add(a, b):"
    full = engine.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True))[0]
    text = full.text
    stop = next(text[i : i + 2] for i in range(len(text) - 1) if text.count(text[i : i + 2]) >= 2)
    early = engine.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert early.finish_reason == "stop" and early.text == text[: text.index(stop)]
    n = len(early.token_ids)  # the stop string's last token is at index n - 1
    at = engine.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop], min_tokens=n - 1))[0]
    assert at.token_ids == early.token_ids and at.text == early.text
    past = engine.generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop], min_tokens=n))[0]
    assert len(past.token_ids) > n and past.token_ids == full.token_ids[: len(past.token_ids)]
    assert past.text.startswith(early.text + stop)


def test_a_vocabulary_of_stop_tokens_is_refused_with_min_tokens():
    """Nothing could be sampled before min_tokens: an error naming min_tokens, not a silent first token."""
    engine = make_engine("ouro")
    every = list(range(engine.adapter.vocab_size))
    with pytest.raises(ValueError, match="min_tokens=2: every token of the vocabulary is a stop token"):
        engine.generate([1, 2], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=every))
    assert engine.generate([1, 2], SamplingParams(max_tokens=4, stop_token_ids=every))[0].finish_reason == "stop"


@pytest.mark.parametrize("speculation", [None, SpeculativeConfig(k=2, d=1)])
def test_eos_is_masked_before_min_tokens_under_ignore_eos_as_in_vllm(speculation):
    """vLLM's min_tokens masks the model's eos whether or not the request ignores eos (its `_all_stop_token_ids`
    holds it either way): a logit bias that makes eos every position's choice gives it only from min_tokens on,
    plain and speculative alike."""
    engine = make_engine("ouro", speculation=speculation)
    eos = engine.eos_token_ids[0]
    params = SamplingParams(max_tokens=6, min_tokens=3, ignore_eos=True, logit_bias={eos: 100.0})
    out = engine.generate([5, 9, 13], params)[0]
    assert eos not in out.token_ids[:3] and out.token_ids[3:] == [eos] * 3
    engine.close()


def make_engine_with_tokenizer():
    from looped_spec import LoopedSpecEngine

    return LoopedSpecEngine("tiny-ouro", speculation="off")


class RecordingProposer(DraftProposer):
    """The engine's proposer, recording every draft it draws: (the request's tokens then, step j, the token)."""

    def __init__(self, runner) -> None:
        super().__init__(runner)
        self.drawn: list[tuple[list[int], int, int]] = []

    def draw(self, logits, rows, requests, j, drafted=None):
        tokens, q = super().draw(logits, rows, requests, j, drafted)
        self.drawn += [(list(r.token_ids), j, t) for r, t in zip(requests, tokens.tolist())]
        return tokens, q


def test_each_draft_masks_what_the_target_masks_at_its_position():
    """Speculation stays exact with any draft; acceptance needs the draft to mask the stop tokens exactly where the
    target does, counting the drafts before its position as output. Loops 1..d never see deeper ones, so a draft is
    the dense depth-d readout of the tokens before it: checked draft by draft against that reference, with stop tokens
    the target emits and a deep draft whose drafts it accepts."""
    adapter = load("ouro")
    prompt, d, min_tokens = PROMPTS[2], adapter.full_depth - 1, 4
    engine = make_engine("ouro", speculation=SpeculativeConfig(k=4, d=d))
    plain = make_engine("ouro").generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True))[0].token_ids
    stop_ids = sorted(set(plain))
    recorder = RecordingProposer(engine.runner)
    engine.spec_round.proposer = recorder
    params = SamplingParams(max_tokens=14, min_tokens=min_tokens, stop_token_ids=stop_ids, ignore_eos=True)
    out = engine.generate(prompt, params)[0]
    assert engine.stats.num_accepted_tokens > 0
    masked_somewhere = unmasked_somewhere = False
    round_drafts: list[int] = []
    for tokens, j, token in recorder.drawn:
        round_drafts = round_drafts[:j]
        logits = adapter.dense_logits(torch.tensor(tokens + round_drafts), depth=d)[0, -1].clone()
        if len(tokens) - len(prompt) + j < min_tokens:
            masked_somewhere = True
            logits[stop_ids] = float("-inf")
        else:
            unmasked_somewhere = True
        assert token == int(logits.argmax()), (tokens, j)
        round_drafts.append(token)
    assert masked_somewhere and unmasked_somewhere
    # loop passes draft the same: as many drafts, as many accepted (the draft's mask decides what it proposes)
    loop = make_engine("ouro", speculation=SpeculativeConfig(k=4, d=d), batching="loop")
    assert loop.generate(prompt, params)[0].token_ids == out.token_ids
    for name in ("num_draft_tokens", "num_accepted_tokens"):
        assert getattr(loop.stats, name) == getattr(engine.stats, name), name


def test_stop_text_is_left_out_unless_kept_and_special_tokens_unless_asked():
    """As vLLM: a stop token's text and a stop string are cut from the text; `include_stop_str_in_output` keeps
    either (text after a stop string is still cut, and nothing streamed is taken back); `skip_special_tokens=False`
    writes special tokens (eos here) into the text."""
    engine = make_engine_with_tokenizer()
    tok = engine.tokenizer
    prompt = "def add(a, b):"
    full = engine.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))[0]
    ids = list(full.token_ids)
    stop_token = ids[4]
    for keep in (False, True):
        out = engine.generate(prompt, SamplingParams(max_tokens=12, stop_token_ids=[stop_token],
                                                     include_stop_str_in_output=keep))[0]  # fmt: skip
        assert out.token_ids == ids[: ids.index(stop_token) + 1] and out.finish_reason == "stop"
        assert out.text == tok.decode(out.token_ids if keep else out.token_ids[:-1])
    stop = full.text[5:8]
    cut = full.text.index(stop)
    for keep in (False, True):
        params = SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop], include_stop_str_in_output=keep)
        request_id = engine.add_request(prompt, params)
        streamed = ""
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id == request_id:
                    streamed += out.new_text
                    last = out
        assert last.text == streamed == full.text[: cut + len(stop) if keep else cut] and last.stop_reason == stop
    forced = dict(max_tokens=3, ignore_eos=True, logit_bias={tok.eos_token_id: 100.0})
    assert engine.generate(prompt, SamplingParams(**forced))[0].text == ""
    assert engine.generate(prompt, SamplingParams(**forced, skip_special_tokens=False))[0].text == tok.eos_token * 3


def test_a_kept_stop_tokens_text_is_kept_whole_and_the_token_is_the_stop_reason():
    """As vLLM (its detokenizer looks for no stop string in a stop token's text): with include_stop_str_in_output, a
    stop token whose text holds a stop string keeps all of its text and is the stop_reason; an eos so kept is whole
    (stop_reason None), not cut inside its special text."""
    engine = make_engine_with_tokenizer()
    tok = engine.tokenizer
    prompt = "def add(a, b):"
    ids = engine.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True))[0].token_ids
    # a token whose text starts (after spaces) with a letter the text before it does not hold: that letter is a stop
    # string the token completes
    at = next(i for i, t in enumerate(ids) if len(tok.decode([t]).strip()) > 1
              and tok.decode([t]).strip()[0] not in tok.decode(ids[:i]))  # fmt: skip
    stop_token, letter = ids[at], tok.decode([ids[at]]).strip()[0]
    out = engine.generate(prompt, SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[stop_token],
                                                 stop=[letter], include_stop_str_in_output=True))[0]  # fmt: skip
    assert out.token_ids == ids[: at + 1] and out.finish_reason == "stop"
    assert (out.text, out.stop_reason) == (tok.decode(ids[: at + 1]), stop_token)
    forced = SamplingParams(max_tokens=3, logit_bias={tok.eos_token_id: 100.0}, stop=["end"],
                            skip_special_tokens=False, include_stop_str_in_output=True)  # fmt: skip
    out = engine.generate(prompt, forced)[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (tok.eos_token, "stop", None)
