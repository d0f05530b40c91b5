"""bad_words (vLLM's): each word is encoded as vLLM encodes it, and the last token of each encoding is masked at a
position whose output before it (drafts included, never the prompt) ends with the others, in plain decoding, drafts and
verification alike, so speculation keeps plain decoding's output and the target's distribution."""

from __future__ import annotations

import httpx
import pytest
import torch
from chisquare import assert_distribution, three_token_distribution
from conftest import FAMILIES, decoding_modes, load, make_engine
from pydantic import ValidationError
from test_speculative import PROMPTS, top_k_filter

from looped_spec import SamplingParams, SpeculativeConfig, StructuredOutputs
from looped_spec.engine.inputs import bad_word_token_ids, load_tokenizer
from looped_spec.execution.sampler import SamplingRows
from looped_spec.models import shipped_model_path
from looped_spec.request import Request


class SpacedCharTokenizer:
    """The fixtures' tokenizer for these tests (they ship none): one token per character, its code point (below 256);
    a space and the character after it are one token, that character's plus 128 (mod 256), as a tokenizer that folds
    a word's leading space into its first token."""

    def encode(self, text, add_special_tokens=True):
        ids, i = [], 0
        while i < len(text):
            if text[i] == " " and i + 1 < len(text):
                ids.append((ord(text[i + 1]) + 128) % 256)
                i += 2
            else:
                ids.append(ord(text[i]))
                i += 1
        return ids

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(t) for t in ids)


def word(tokens):
    """The text SpacedCharTokenizer encodes to `tokens` (none of them a whitespace character)."""
    assert not any(chr(t).isspace() for t in tokens)
    return "".join(chr(t) for t in tokens)


def encodings(tokens):
    """The token sequences vLLM bans for `word(tokens)` under SpacedCharTokenizer: the word, then the word after a
    space (as many tokens, another first token)."""
    return [list(tokens), [(tokens[0] + 128) % 256, *tokens[1:]]]


def engine_with_tokenizer(family, **options):
    engine = make_engine(family, **options)
    engine.tokenizer = SpacedCharTokenizer()
    return engine


def masked_logits(logits, output, sequences):
    """`logits` with the last token of every sequence masked where `output` ends with the rest (a one-token sequence:
    always). Only output tokens count, never the prompt."""
    masked = logits.clone()
    for seq in sequences:
        prefix = seq[:-1]
        if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
            masked[seq[-1]] = float("-inf")
    return masked


def reference_bad_words(adapter, prompt, max_tokens, sequences):
    """Greedy decoding by dense forwards, one token at a time, the bad words' tokens masked."""
    tokens: list[int] = []
    for _ in range(max_tokens):
        logits = adapter.dense_logits(torch.tensor(prompt + tokens))[0, -1]
        tokens.append(int(masked_logits(logits, tokens, sequences).argmax()))
    return tokens


def test_bad_words_are_encoded_as_vllm_does():
    """vLLM's `SamplingParams.update_from_tokenizer`: the word without its leading whitespace, then after a space,
    both without special tokens; the second only where it has as many tokens and another first token."""
    tokenizer = load_tokenizer(shipped_model_path("tiny-ouro"))

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    for text in ("hello", "  hello", "x", "the cat", "Returns."):
        plain, spaced = encode(text.lstrip()), encode(" " + text.lstrip())
        want = [plain, spaced] if len(spaced) == len(plain) and spaced[0] != plain[0] else [plain]
        assert bad_word_token_ids([text], tokenizer, 1024) == want, text
    # "the cat" after a space folds into fewer tokens: only the word as given is banned, as in vLLM
    assert len(encode("the cat")) != len(encode(" the cat"))
    assert bad_word_token_ids(["the cat"], tokenizer, 1024) == [encode("the cat")]
    spaced = SpacedCharTokenizer()
    assert bad_word_token_ids(["ab", " c"], spaced, 256) == [[97, 98], [225, 98], [99], [227]]
    with pytest.raises(ValueError, match=r"bad_words\[1\] = 'ab' encodes to token 225, outside the vocabulary"):
        bad_word_token_ids(["!", "ab"], spaced, 200)
    with pytest.raises(ValueError, match="bad_words: the model has no tokenizer"):
        bad_word_token_ids(["a"], None, 256)


def request_with(prompt, output, words, **params):
    request = Request("r", 0, prompt, SamplingParams(max_tokens=20, **params), seed=0, eos_token_ids=[0],
                      max_model_len=64, bad_words=words)  # fmt: skip
    request.token_ids += output
    return request


def test_a_bad_word_is_masked_where_the_output_before_the_position_ends_with_its_prefix():
    """Sequences [5, 6, 7] and [9]: 7 is masked after output ... 5, 6, the drafts before the position counted as
    output, never after a prompt that ends with them; 9 everywhere. The mask depends on the drafts even where nothing
    of it applies yet (`counts_drafts`), so later positions of a round are built with theirs."""
    logits = torch.randn(6, 12, generator=torch.Generator().manual_seed(3))
    words = [[5, 6, 7], [9]]
    after_prompt = request_with([1, 5, 6], [], words)
    half = request_with([1, 2], [4, 5], words)
    requests = [after_prompt, request_with([1, 5], [6], words), half, half, half, request_with([1], [5, 6], [])]
    drafted = [[], [], [], [6], [6, 8], []]
    rows = SamplingRows.build(requests, torch.device("cpu"), drafted)
    assert rows.adjusts and rows.counts_drafts
    want = logits.clone()
    want[:5, 9] = float("-inf")
    want[3, 7] = float("-inf")  # output 4, 5 and the draft 6: the prefix 5, 6 is there
    torch.testing.assert_close(rows.adjusted(logits), want)  # row 1: its 5 is the prompt's, not output
    nothing_yet = SamplingRows.build([request_with([1], [2], [[5, 6, 7]])], torch.device("cpu"))
    assert nothing_yet.bad_words is None and nothing_yet.counts_drafts and nothing_yet.adjusts
    assert nothing_yet.requests[0].depends_on_output  # loop passes give such a request's drafts their drafts before
    only_single = SamplingRows.build([request_with([1], [2], [[9]])], torch.device("cpu"))
    assert only_single.adjusts and not only_single.counts_drafts and not only_single.requests[0].depends_on_output


def test_bad_words_that_would_leave_nothing_give_way():
    """allowed_token_ids [3, 4] and words 2 3, 2 4: after a 2 both allowed tokens would be masked; the row keeps them
    (a token it may take comes, not one outside allowed_token_ids); before it, 3 and 4 stay open as usual."""
    logits = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    cornered = request_with([1], [2], [[2, 3], [2, 4]], allowed_token_ids=[3, 4])
    free = request_with([1], [5], [[2, 3], [2, 4]], allowed_token_ids=[3, 4])
    got = SamplingRows.build([cornered, free], torch.device("cpu")).adjusted(logits)
    assert torch.isfinite(got[:, [3, 4]]).all() and torch.isneginf(got[:, [0, 1, 2, 5, 6, 7]]).all()
    # a one-token word never gives way: with 6 banned everywhere and 2 3, 2 4 cornering the rest after a 2, the row
    # keeps 3 and 4, not 6 (found by an outside audit: the fallback used to restore the one-token words too)
    cornered = request_with([1], [2], [[6], [2, 3], [2, 4]], allowed_token_ids=[3, 4, 6])
    got = SamplingRows.build([cornered], torch.device("cpu")).adjusted(logits[:1])
    assert torch.isfinite(got[0, [3, 4]]).all() and torch.isneginf(got[0, [0, 1, 2, 5, 6, 7]]).all()


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_output_avoids_the_bad_words_as_an_independent_reference_does(family):
    """Each prompt bans a two-token word plain decoding produces (its second token follows its first there), and some
    a one-token word it produces later and a word whose prefix is the prompt's last token (the prompt never counts):
    every mode (fixed plans, adaptive, loop passes, per-token stopping) gives the dense reference's tokens, rows
    without bad_words beside them unchanged."""
    adapter = load(family)
    plain = make_engine(family)
    free = [o.token_ids for o in plain.generate(PROMPTS, SamplingParams(max_tokens=10, ignore_eos=True))]
    params, expected = [], []
    for i, (prompt, out) in enumerate(zip(PROMPTS, free)):
        if i % 3 == 2:  # no bad_words: as plain
            params.append(SamplingParams(max_tokens=10, ignore_eos=True))
            expected.append(out)
            continue
        # the first bigram of plain's output (at or after token 1) whose characters are no whitespace
        j = next(j for j in range(1, len(out) - 1) if not any(chr(t).isspace() for t in out[j : j + 2]))
        chosen = [out[j : j + 2]]
        if i % 3 == 1 and not chr(out[-1]).isspace() and out[-1] not in out[: j + 1]:
            chosen.append(out[-1:])  # a one-token word plain produces last (not before the bigram's word)
        if not chr(prompt[-1]).isspace() and not chr(out[0]).isspace():
            chosen.append([prompt[-1], out[0]])  # its prefix is in the prompt only: never masks the first token
        words = [word(tokens) for tokens in chosen]
        sequences = [seq for tokens in chosen for seq in encodings(tokens)]
        assert bad_word_token_ids(words, SpacedCharTokenizer(), adapter.vocab_size) == sequences
        params.append(SamplingParams(max_tokens=10, ignore_eos=True, bad_words=words))
        expected.append(reference_bad_words(adapter, prompt, 10, sequences))
        assert expected[-1] != out
        if [out[0]] not in sequences:  # the first token is banned by no one-token word, and no prompt counts
            assert expected[-1][0] == out[0]
    assert sum(want != was for want, was in zip(expected, free)) >= len(PROMPTS) // 2
    for mode in decoding_modes(adapter.full_depth):
        engine = engine_with_tokenizer(family, max_batch_size=len(PROMPTS), **mode)
        outs = engine.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == expected, mode
        assert engine.num_free_blocks == engine.kv.num_blocks


def test_greedy_bad_words_with_min_tokens_and_allowed_tokens_as_the_reference():
    """bad_words beside min_tokens (eos masked for the first tokens) and allowed_token_ids: the three masks together,
    plain and speculative alike."""
    adapter = load("ouro")
    prompt = PROMPTS[1]
    [out] = make_engine("ouro").generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True))
    out = out.token_ids
    j = next(j for j in range(1, len(out) - 1) if not any(chr(t).isspace() for t in out[j : j + 2]))
    eos = adapter.eos_token_ids[0]
    allowed = sorted(set(out) | {eos, 40, 41})
    sequences = encodings(out[j : j + 2])
    want: list[int] = []
    for _ in range(8):
        logits = adapter.dense_logits(torch.tensor(prompt + want))[0, -1]
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        if len(want) < 5:
            masked[eos] = float("-inf")
        token = int(masked_logits(masked, want, sequences).argmax())
        want.append(token)
        if token == eos:
            break
    params = SamplingParams(max_tokens=8, min_tokens=5, bad_words=[word(out[j : j + 2])], allowed_token_ids=allowed)
    for mode in (dict(), dict(speculation="2,1"), dict(speculation="3,2", batching="loop")):
        [got] = engine_with_tokenizer("ouro", **mode).generate([prompt], params)
        assert got.token_ids == want, mode


def test_speculative_sampling_with_bad_words_keeps_target_distribution():
    """Sampled with K = 2: the three first tokens' joint distribution is the target's with the bad words masked (top_k
    of what is left): a one-token word the third likeliest first token, a two-token word whose prefix is the likeliest
    and whose last token the likeliest after it (so the second draft's mask depends on the first draft). (Banning the
    likeliest first token instead leaves this prompt's depth-1 top 3 and the target's apart: nothing accepted.)"""
    adapter = load("ouro")
    prompt, n, top_k = [5, 9, 13, 200], 4000, 3

    def logits_after(output):
        return adapter.dense_logits(torch.tensor(prompt + output))[0, -1]

    ranked = [t for t in logits_after([]).topk(12).indices.tolist() if not chr(t).isspace()]
    single, lead = ranked[2], ranked[0]
    follow = next(t for t in logits_after([lead]).topk(12).indices.tolist() if not chr(t).isspace())
    sequences = encodings([single]) + encodings([lead, follow])

    def next_tokens(output):
        return zip(*top_k_filter(masked_logits(logits_after(output), output, sequences), top_k))

    probs = three_token_distribution(next_tokens)
    assert sum(p for (t1, _, _), p in probs.items() if t1 == lead) > 0.5  # the prefix comes often
    engine = engine_with_tokenizer(
        "ouro", speculation=SpeculativeConfig(k=2, d=1), max_batch_size=256, max_num_batched_tokens=4096, seed=17
    )
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=top_k, ignore_eos=True,
                            bad_words=[word([single]), word([lead, follow])])  # fmt: skip
    outs = engine.generate([prompt] * n, params)
    assert engine.stats.num_draft_tokens >= 1.5 * n  # K = 2 rounds
    assert engine.stats.num_accepted_tokens > 0 and engine.stats.num_draft_tokens > engine.stats.num_accepted_tokens
    for o in outs:
        assert single not in o.token_ids
        assert all(o.token_ids[m : m + 2] != [lead, follow] for m in range(len(o.token_ids) - 1))
    assert_distribution((tuple(o.token_ids[:3]) for o in outs), probs)


def test_bad_words_are_checked_naming_the_field():
    assert SamplingParams(bad_words=["a", " b"]).bad_words == ["a", " b"]
    assert SamplingParams(bad_words=[]).bad_words == []
    for bad, match in (([""], r"bad_words\[0\] = '' is empty"), (["a", " \n"], r"bad_words\[1\] = ' \\n' is empty"),
                       ("ab", "bad_words"), ([3], "bad_words")):  # fmt: skip
        with pytest.raises(ValidationError, match=match):
            SamplingParams(bad_words=bad)
    with pytest.raises(ValidationError, match="bad_words and structured_outputs: set at most one"):
        SamplingParams(bad_words=["a"], structured_outputs=StructuredOutputs(regex="a"))
    without = make_engine("ouro")  # the fixture has no tokenizer files
    with pytest.raises(ValueError, match="bad_words: the model has no tokenizer"):
        without.generate([[1, 2]], SamplingParams(bad_words=["a"]))
    assert without.generate([[1, 2]], SamplingParams(max_tokens=2, bad_words=[]))[0].token_ids
    engine = engine_with_tokenizer("ouro")
    with pytest.raises(ValueError, match="bad_words: every token of allowed_token_ids is a one-token bad word"):
        engine.generate([[1, 2]], SamplingParams(bad_words=["a", "b"], allowed_token_ids=[97, 98]))
    eos = engine.adapter.eos_token_ids[0]
    with pytest.raises(ValueError, match="bad_words: every token they leave is a stop token"):
        engine.generate([[1, 2]], SamplingParams(bad_words=["a"], allowed_token_ids=[97, eos], min_tokens=1))
    with pytest.raises(ValueError, match=r"bad_words\[0\] = '\u0100' encodes to token 256, outside"):
        engine.generate([[1, 2]], SamplingParams(bad_words=["\u0100"]))
    assert engine.num_free_blocks == engine.kv.num_blocks


def test_a_bad_word_the_tokenizer_encodes_to_nothing_is_named():
    """A word that a tokenizer drops altogether (here: one of characters it does not know) would ban nothing."""

    class DroppingTokenizer(SpacedCharTokenizer):
        def encode(self, text, add_special_tokens=True):
            return [t for t in super().encode(text, add_special_tokens) if t != ord("~")]

    engine = make_engine("ouro")
    engine.tokenizer = DroppingTokenizer()
    with pytest.raises(ValueError, match=r"bad_words\[1\] = ' ~~' encodes to no tokens"):
        engine.generate([[1, 2]], SamplingParams(bad_words=["a", " ~~"]))
    assert not engine.has_unfinished_requests()


def test_the_server_takes_bad_words():
    from server_utils import ServerThread

    from looped_spec import LoopedSpecEngine

    engine = LoopedSpecEngine("tiny-ouro", speculation="2,1", max_model_len=128)
    reference = LoopedSpecEngine("tiny-ouro", speculation="off", max_model_len=128)  # the served one is busy
    prompt = "Once upon a time"
    # the chat continues an assistant message: a plain reply of this model is newlines, which no bad word can ban
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "def"}]
    turn = {"continue_final_message": True, "add_generation_prompt": False}
    greedy = SamplingParams(max_tokens=8, temperature=0)
    [free] = reference.generate([prompt], greedy)
    [free_chat] = reference.chat(messages, greedy, **turn)
    words = [free.text.split()[-1], free_chat.text.split()[1]]
    bans = greedy.model_copy(update={"bad_words": words})
    [offline] = reference.generate([prompt], bans)
    [offline_chat] = reference.chat(messages, bans, **turn)
    assert offline.text != free.text and offline_chat.text != free_chat.text
    with ServerThread(engine, "tiny-ouro") as server:
        body = {"model": "tiny-ouro", "max_tokens": 8, "temperature": 0, "bad_words": words}
        answer = httpx.post(server.url + "/v1/completions", json={**body, "prompt": prompt}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == offline.text
        answer = httpx.post(server.url + "/v1/chat/completions", json={**body, "messages": messages, **turn},
                             timeout=60)  # fmt: skip
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["message"]["content"] == offline_chat.text
        for bad, message in ((["ok", " "], "bad_words[1] = ' ' is empty"), ("ok", "bad_words"),
                             (["ok"] * 129, "bad_words: at most 128 words")):  # fmt: skip
            refused = httpx.post(server.url + "/v1/completions", json={**body, "prompt": prompt, "bad_words": bad},
                                 timeout=60)  # fmt: skip
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "bad_words", refused.text
            assert message in refused.json()["error"]["message"], refused.text
        chat_body = {**body, "messages": messages, "bad_words": [""]}
        refused = httpx.post(server.url + "/v1/chat/completions", json=chat_body, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "bad_words", refused.text
        # beside a grammar, or leaving nothing to generate: a 400 naming bad_words and what it meets (the field the
        # client sent, not the engine's structured_outputs)
        eos = engine.adapter.eos_token_ids[0]
        word = reference.tokenizer.decode([eos])
        tools = [{"type": "function", "function": {"name": "now"}}]
        cases = [("/v1/completions", {"prompt": prompt, "response_format": {"type": "json_object"}}, "response_format"),
                 ("/v1/completions", {"prompt": prompt, "structured_outputs": {"choice": ["a"]}}, "structured_outputs"),
                 ("/v1/chat/completions", {"messages": messages, "tools": tools, "tool_choice": "required"},
                  "tool_choice required"),
                 ("/v1/completions", {"prompt": prompt, "allowed_token_ids": [eos], "bad_words": [word]},
                  "every token of allowed_token_ids is a one-token bad word")]  # fmt: skip
        for path, extra, said in cases:
            refused = httpx.post(server.url + path, json={**body, **extra}, timeout=60)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "bad_words", refused.text
            assert said in refused.json()["error"]["message"], refused.text
        refused = httpx.post(server.url + "/v1/completions", timeout=60, json={
            **body, "prompt": prompt, "allowed_token_ids": [1, 2], "response_format": {"type": "json_object"},
            "bad_words": None})  # fmt: skip
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "allowed_token_ids", refused.text
        scoring = {**body, "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 1}  # generates nothing
        refused = httpx.post(server.url + "/v1/completions", json=scoring, timeout=60)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "bad_words", refused.text


@pytest.mark.parametrize("mode", ["skip", "select"])
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculation_with_early_exit_and_bad_words_equals_plain(family, mode):
    """Early exit (the target is the early-exit model; a draft position that exits is the target's own sample): with
    bad words taken from each request's plain output, fixed plans, per-token stopping and loop passes give plain
    early-exit decoding's tokens and exit depths."""
    from test_early_exit_speculative import batch_params, batch_prompts, run

    params = batch_params(family)
    prompts = batch_prompts(family, len(params))
    free = engine_with_tokenizer(family, early_exit=mode, max_batch_size=8).generate(prompts, params)
    banned = []
    for p, out in zip(params, free):
        tokens = out.token_ids
        j = next((j for j in range(len(tokens) - 1) if not any(chr(t).isspace() for t in tokens[j : j + 2])), None)
        banned.append(p if j is None else p.model_copy(update={"bad_words": [word(tokens[j : j + 2])]}))
    want = run(engine_with_tokenizer(family, early_exit=mode, max_batch_size=8), prompts, banned)
    assert sum(w[0] != o.token_ids for w, o in zip(want, free)) >= len(params) // 2
    for spec in ("2,1", f"3,{load(family).full_depth - 1}", SpeculativeConfig(k=3, d=1, stop_margin=0.05)):
        for batching in ("step", "loop"):
            engine = engine_with_tokenizer(family, speculation=spec, early_exit=mode, batching=batching,
                                           max_batch_size=8)  # fmt: skip
            assert run(engine, prompts, banned) == want, (spec, batching)
