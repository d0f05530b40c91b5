"""A grammar that starts where the reasoning ends (`SamplingParams.reasoning_end_token_ids`, the engine's
`reasoning_parser`, the server's `--reasoning-parser`): before the first occurrence of the gate's tokens in the output
the grammar masks and consumes nothing, after it it shapes every token; the drafts before a speculative position count
as output, so a gate that opens inside a round's drafts masks the later draft positions with the grammar advanced by
the drafts after it, and speculation keeps plain decoding's output and the constrained distribution.

The tiny models never write `</think>`: the engine tests gate on tokens plain decoding produces early, and the server
tests check the wiring (the gate each request gets) and a reply whose gate never opens."""

from __future__ import annotations

import re
from functools import cache

import httpx
import pytest
import torch
from chisquare import assert_distribution, three_token_distribution
from conftest import decoding_modes
from pydantic import ValidationError

from looped_spec import LoopedSpecEngine, SamplingParams, SpeculativeConfig, StructuredOutputs
from looped_spec.execution.sampler import SamplingRows
from looped_spec.reasoning import END, REASONING_PARSERS
from looped_spec.request import Request
from looped_spec.structured_output import Grammar, GrammarCompiler

SHIPPED = ["tiny-ouro", "tiny-huginn", "tiny-nanbeige"]  # the fixtures ship no tokenizer; grammars need one
PROMPTS = ["def add(a, b):", "class Point:", "# the answer is", "x = [", "print(", "return", "if x:", "import os\n"]
REGEX = StructuredOutputs(regex=r"[0-9]{2,4}-[a-z]{1,3}")  # completes: the request stops
CHOICE = StructuredOutputs(choice=["yes", "no", "maybe so"])
LARK = StructuredOutputs(grammar='start: "(" item (", " item)* ")"\nitem: /[a-c]/')  # may go on: max_tokens ends it


@cache
def engine(model: str, **options) -> LoopedSpecEngine:
    # Huginn's zero initial state: the dense reference below computes the engine's logits
    extra = {"adapter_options": {"initial_state": "zeros"}} if model == "tiny-huginn" else {}
    return LoopedSpecEngine(model, max_batch_size=8, **extra, **options)


def base(model: str) -> LoopedSpecEngine:
    return engine(model, speculation="off")


def allowed_by(matcher, vocab_size: int) -> torch.Tensor:
    """[V] bool: the tokens llguidance's matcher allows next (its own bitmask, unpacked)."""
    words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
    bits = (words.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:vocab_size].bool()


def reference(model: str, prompt: list[int], spec: StructuredOutputs, gate: list[int], max_tokens: int):
    """Greedy decoding by full-sequence dense forwards, one token at a time: the argmax of the logits, masked by a
    fresh matcher of the grammar once the output (never the prompt) holds `gate`, the matcher fed the tokens after
    it; (tokens, finish reason): "stop" once the grammar is complete."""
    adapter, tokenizer = base(model).adapter, base(model).tokenizer
    matcher = GrammarCompiler(tokenizer, adapter.vocab_size, adapter.eos_token_ids).compile(spec).matcher
    out: list[int] = []
    opened = not gate
    while len(out) < max_tokens:
        logits = adapter.dense_logits(torch.tensor(prompt + out))[0, -1]
        if opened:
            logits = logits.masked_fill(~allowed_by(matcher, adapter.vocab_size), float("-inf"))
        token = int(logits.argmax())
        out.append(token)
        if opened:
            assert matcher.consume_token(token)
            if matcher.is_stopped():
                return out, "stop"
        elif out[-len(gate) :] == gate:
            opened = True
    return out, "length"


def first_at(out: list[int], start: int, width: int) -> int:
    """The first j >= start where out[j : j + width] occurs first in `out` (so a gate of it opens exactly there)."""
    for j in range(start, len(out) - width):
        piece = out[j : j + width]
        if all(out[m : m + width] != piece for m in range(j)):
            return j
    raise AssertionError(f"no fresh {width}-gram in {out} from {start}")


@cache
def cases(model: str):
    """Per prompt: (prompt ids, params, expected tokens, expected finish reason). Gates of one and two tokens that
    plain decoding produces first at positions 2 to 4, the grammars a regex that completes, a choice and a Lark
    grammar that may go on; a prompt that ends with its gate (the prompt never opens it); a grammar without a gate and
    a request without a grammar beside them."""
    tokenizer = base(model).tokenizer
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    free = [o.token_ids for o in base(model).generate(prompts, SamplingParams(max_tokens=14, ignore_eos=True))]
    out = []
    grammars = [REGEX, CHOICE, LARK]
    for i, (prompt, tokens) in enumerate(zip(prompts, free)):
        spec = grammars[i % 3]
        if i == 6:  # no gate: the grammar from the first token
            gate = []
        elif i == 7:  # no grammar
            params = SamplingParams(max_tokens=14, ignore_eos=True)
            out.append((prompt, params, tokens, "length"))
            continue
        else:
            width = 1 + i % 2
            j = first_at(tokens, 2 + i % 3, width)
            gate = tokens[j : j + width]
            if i == 5:
                prompt = prompt + gate  # its gate is in the prompt: only the output's counts
        params = SamplingParams(max_tokens=14, ignore_eos=True, structured_outputs=spec, reasoning_end_token_ids=gate)
        want, reason = reference(model, prompt, spec, gate, 14)
        out.append((prompt, params, want, reason))
    return out


def gated_positions(monkeypatch) -> list[int]:
    """A counter of the masks computed at a position whose gate opened in the drafts before it."""
    seen = [0]
    original = Grammar.after_gate

    def after_gate(self, drafted):
        after = original(self, drafted)
        if not self.opened and after is not None:
            seen[0] += 1
        return after

    monkeypatch.setattr(Grammar, "after_gate", after_gate)
    return seen


@pytest.mark.parametrize("model", SHIPPED)
def test_greedy_output_with_a_gated_grammar_is_the_dense_references_in_every_mode(model, monkeypatch):
    """Every mode (plain, fixed plans, adaptive, loop passes, per-token stopping) gives the reference's tokens and
    finish reasons; with K >= 3 some gates open inside a round's drafts (their later positions masked by the grammar
    after the drafts that follow the gate)."""
    run = cases(model)
    prompts = [prompt for prompt, *_ in run]
    params = [p for _, p, *_ in run]
    expected = [(want, reason) for *_, want, reason in run]
    free = [o.token_ids for o in base(model).generate(prompts, [p.model_copy(update={"structured_outputs": None,
            "reasoning_end_token_ids": None}) for p in params])]  # fmt: skip
    for i, ((_, p, want, _), was) in enumerate(zip(run, free)):
        gate = p.reasoning_end_token_ids
        if gate and i != 5:  # the gate opens in the output, and the grammar then changes it
            j = next(j for j in range(len(want)) if want[j : j + len(gate)] == gate)
            assert want[: j + len(gate)] == was[: j + len(gate)] and want != was
    assert sum(reason == "stop" for _, reason in expected) >= 2  # grammars that complete end their requests
    ungated = run[5][1].model_copy(update={"reasoning_end_token_ids": []})  # as if the prompt's gate counted
    assert base(model).generate([run[5][0]], ungated)[0].token_ids != run[5][2]
    seen = gated_positions(monkeypatch)
    depth = base(model).adapter.full_depth
    inside = 0
    for mode in [*decoding_modes(depth), dict(speculation="4,1"), dict(speculation="3,1", batching="loop")]:
        runner = engine(model, **mode)
        before = seen[0]
        outs = runner.generate(prompts, params)
        assert [(o.token_ids, o.finish_reason) for o in outs] == expected, mode
        assert runner.num_free_blocks == runner.kv.num_blocks
        if mode.get("speculation") in ("4,1", f"3,{depth - 1}"):
            inside += seen[0] - before
    assert inside > 0  # a gate opened inside a round's drafts and the positions after it were masked


@pytest.mark.parametrize("model", SHIPPED)
def test_gated_grammars_under_early_exit_match_plain_early_exit(model):
    """exit_at_step (the target is the early-exit model; a draft the exit rule decides is the target's own sample):
    fixed plans and loop passes give plain early-exit decoding's tokens."""
    run = cases(model)
    prompts = [prompt for prompt, *_ in run]
    params = [p.model_copy(update={"exit_at_step": 2, "seed": i}) for i, (_, p, *_) in enumerate(run)]
    want = [o.token_ids for o in base(model).generate(prompts, params)]
    for mode in (dict(speculation="3,1"), dict(speculation="3,1", batching="loop")):
        assert [o.token_ids for o in engine(model, **mode).generate(prompts, params)] == want, mode


def test_a_preempted_gated_request_is_recomputed_to_the_same_output():
    """A KV cache small enough to preempt: the requests recomputed keep their grammar where their committed output
    left it (gate and all), so the outputs are the references'."""
    run = cases("tiny-ouro")
    prompts = [prompt for prompt, *_ in run]
    tight = LoopedSpecEngine("tiny-ouro", speculation=SpeculativeConfig(k=3, d=1), block_size=4, num_kv_blocks=14,
                             max_batch_size=8, max_model_len=40)  # fmt: skip
    outs = tight.generate(prompts, [p for _, p, *_ in run])
    assert tight.scheduler.num_preemptions > 0
    assert [(o.token_ids, o.finish_reason) for o in outs] == [(want, reason) for *_, want, reason in run]


def test_the_gate_opens_at_its_first_occurrence_and_rolls_back():
    model = base("tiny-ouro")
    digit, letter = model.tokenizer.encode("7")[0], model.tokenizer.encode("a")[0]
    grammar = model._grammars.compile(StructuredOutputs(regex="[0-9]{2}"), gate=[letter, letter])
    assert grammar.after_gate([digit, letter]) is None and grammar.after_gate([letter, letter, letter]) == [letter]
    grammar.consume(letter)  # the gate spans the committed output and the drafts
    assert not grammar.opened and grammar.after_gate([letter, digit]) == [digit]
    assert grammar.after_gate([digit, letter, letter]) == []
    grammar.consume(letter)
    assert grammar.opened and not grammar.complete and grammar.after_gate([digit]) == [digit]
    assert grammar.matcher.validate_tokens([letter]) == 0  # after the gate the grammar decides
    grammar.consume(digit)
    grammar.rollback(2)  # the digit, then the gate's last token: closed again
    assert not grammar.opened and (grammar.before, grammar.after) == ([letter], 0)
    assert grammar.after_gate([letter, digit]) == [digit] and grammar.matcher.validate_tokens([digit, digit]) == 2
    grammar.consume(letter)
    grammar.consume(digit)
    grammar.consume(digit)
    eos = model.adapter.eos_token_ids[0]
    grammar.consume(eos)
    assert grammar.complete
    unopened = model._grammars.compile(StructuredOutputs(regex="[0-9]{2}"), gate=[letter])
    unopened.consume(eos)  # an eos before the gate: the grammar is not complete (the eos ends it as a stop token)
    assert not unopened.opened and not unopened.complete


def test_a_rows_mask_counts_the_drafts_before_it_for_the_gate_and_the_grammar():
    """Rows of one request at the positions of a round: free while the gate is closed after the drafts before the
    position, then masked by the grammar after the drafts that follow the gate (the prompt never counts)."""
    model = base("tiny-ouro")
    tok = model.tokenizer
    digit, letter, gate = tok.encode("7")[0], tok.encode("a")[0], tok.encode("!")[0]
    spec = StructuredOutputs(regex="[0-9][a-z]")
    grammar = model._grammars.compile(spec, gate=[gate])
    request = Request("r", 0, [1, gate], SamplingParams(max_tokens=8, structured_outputs=spec), 0, [0], 64,
                      grammar=grammar)  # fmt: skip
    drafted = [[], [digit], [gate], [gate, digit], [digit, gate, digit]]
    rows = SamplingRows.build([request] * len(drafted), torch.device("cpu"), drafted)
    assert rows.counts_drafts and rows.adjusts
    got = rows.adjusted(torch.zeros(len(drafted), model.adapter.vocab_size))
    free = torch.isfinite(got)
    assert free[0].all() and free[1].all()  # the prompt's gate does not count
    starts = {t for t in range(model.adapter.vocab_size) if re.fullmatch("[0-9][a-z]?", tok.decode([t]))}
    assert digit in starts and set(free[2].nonzero().flatten().tolist()) == starts  # opened by the draft before it
    assert free[3, letter] and not free[3, digit] and free[4, letter] and not free[4, digit]


def test_the_gate_is_checked_naming_its_field():
    assert SamplingParams(structured_outputs=CHOICE, reasoning_end_token_ids=[]).reasoning_end_token_ids == []
    for bad, match in (([-1], r"reasoning_end_token_ids\[0\] = -1 is negative"), ([True], "reasoning_end_token_ids"),
                       ("ab", "reasoning_end_token_ids")):  # fmt: skip
        with pytest.raises(ValidationError, match=match):
            SamplingParams(structured_outputs=CHOICE, reasoning_end_token_ids=bad)
    with pytest.raises(ValidationError, match="reasoning_end_token_ids: only with structured_outputs"):
        SamplingParams(reasoning_end_token_ids=[3])
    with pytest.raises(ValueError, match=r"reasoning_end_token_ids\[1\] = 5000 is outside the vocabulary"):
        base("tiny-ouro").generate("x", SamplingParams(structured_outputs=CHOICE, reasoning_end_token_ids=[1, 5000]))
    assert not base("tiny-ouro").has_unfinished_requests()
    with pytest.raises(ValueError, match="reasoning_parser='r2': unknown reasoning parser; known: deepseek_r1, qwen3"):
        LoopedSpecEngine("tiny-ouro", speculation="off", reasoning_parser="r2")
    with pytest.raises(ValueError, match="reasoning_parser='qwen3': '</think>': the model has no tokenizer"):
        LoopedSpecEngine("tests/fixtures/ouro-tiny", speculation="off", reasoning_parser="qwen3")


def test_the_engines_reasoning_parser_gates_every_grammar_unless_the_request_says():
    """`reasoning_parser` (vLLM's LLM option): a grammar starts after `</think>` as the tokenizer encodes it; a
    request's own reasoning_end_token_ids wins ([]: from the first token). The tiny model never writes `</think>`:
    the gated output is the free one."""
    gated = LoopedSpecEngine("tiny-ouro", speculation="2,1", reasoning_parser="deepseek_r1")
    prompt = "def add(a, b):"
    free = base("tiny-ouro").generate(prompt, SamplingParams(max_tokens=10))[0]
    shaped = base("tiny-ouro").generate(prompt, SamplingParams(max_tokens=10, structured_outputs=CHOICE))[0]
    assert shaped.text in CHOICE.choice and free.text not in CHOICE.choice and END not in free.text
    assert gated.generate(prompt, SamplingParams(max_tokens=10, structured_outputs=CHOICE))[0].text == free.text
    own = SamplingParams(max_tokens=10, structured_outputs=CHOICE, reasoning_end_token_ids=[])
    assert gated.generate(prompt, own)[0].token_ids == shaped.token_ids


def test_the_gate_is_the_end_tag_as_the_tokenizer_encodes_it():
    """deepseek_r1: always `</think>`'s ids (everything before it is reasoning); qwen3: none when the prompt ends with
    `</think>` and whitespace (the template closed the reasoning: the reply is all content), else `</think>`'s ids."""
    tokenizer, vocab = base("tiny-ouro").tokenizer, base("tiny-ouro").adapter.vocab_size
    end = tokenizer.encode(END, add_special_tokens=False)

    def encode(text):
        return tokenizer.encode(text, add_special_tokens=False)

    closed = encode("<|im_start|>assistant\n<think>\n\n") + end + encode("\n\n")
    opened = encode("<|im_start|>assistant\n<think>\n")
    earlier = encode("<think>a") + end + encode("b<|im_start|>assistant\n")  # closed, then more than whitespace
    assert END not in tokenizer.decode(opened) and tokenizer.decode(closed).endswith("</think>\n\n")
    r1, qwen3 = REASONING_PARSERS["deepseek_r1"], REASONING_PARSERS["qwen3"]
    for prompt in (closed, opened, earlier, []):
        assert r1.grammar_gate(tokenizer, vocab, prompt) == end
    assert qwen3.grammar_gate(tokenizer, vocab, closed) == []
    assert qwen3.grammar_gate(tokenizer, vocab, opened) == qwen3.grammar_gate(tokenizer, vocab, earlier) == end
    with pytest.raises(ValueError, match="'</think>': the model has no tokenizer"):
        r1.grammar_gate(None, vocab)
    with pytest.raises(ValueError, match=f"'</think>' encodes to token {end[0]}, outside the vocabulary"):
        r1.grammar_gate(tokenizer, min(end))

    class Nothing:
        def encode(self, text, add_special_tokens=True):
            return []

    with pytest.raises(ValueError, match="'</think>': the model's tokenizer encodes it to no tokens"):
        r1.grammar_gate(Nothing(), vocab)


def test_speculative_sampling_with_a_gated_grammar_keeps_the_constrained_distribution():
    """Three tokens, the second and third from one K = 2 round, the gate the likeliest first token: after it the
    second and third are masked by the grammar (the third after the second), otherwise nothing is; rejection sampling
    keeps that joint distribution, computed here from dense forwards and the grammar's own masks."""
    model = base("tiny-ouro")
    adapter, tokenizer = model.adapter, model.tokenizer
    spec = StructuredOutputs(regex=r"[a-e]{1,2}( [a-e]{1,2}){0,4}")
    fresh = GrammarCompiler(tokenizer, adapter.vocab_size, adapter.eos_token_ids)
    prompt, top_k, n = tokenizer.encode("x ="), 3, 4000

    def logits_after(output):
        return adapter.dense_logits(torch.tensor(prompt + list(output)))[0, -1].double()

    gate = int(logits_after([]).argmax())

    def next_tokens(output):
        logits = logits_after(output)
        if gate in output:
            matcher = fresh.compile(spec).matcher
            assert matcher.consume_tokens(list(output[output.index(gate) + 1 :]))
            logits = logits.masked_fill(~allowed_by(matcher, adapter.vocab_size), float("-inf"))
        values, ids = logits.topk(top_k)
        return [(t, p) for t, p in zip(ids.tolist(), values.softmax(-1).tolist()) if p > 0]

    exact = three_token_distribution(next_tokens)
    assert 0.2 < sum(p for (t1, _, _), p in exact.items() if t1 == gate) < 0.9  # the gate opens in about half
    runner = LoopedSpecEngine("tiny-ouro", speculation=SpeculativeConfig(k=2, d=1), max_batch_size=256,
                              max_num_batched_tokens=4096, seed=11)  # fmt: skip
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=top_k, ignore_eos=True, structured_outputs=spec,
                            reasoning_end_token_ids=[gate])  # fmt: skip
    outs = runner.generate([prompt] * n, params)
    assert runner.stats.num_accepted_tokens > 0 and runner.stats.num_draft_tokens > runner.stats.num_accepted_tokens
    assert runner.stats.num_draft_tokens >= 1.5 * n  # K = 2 rounds
    assert_distribution((tuple(o.token_ids[:3]) for o in outs), exact)


# ----- the server -----

MODEL = "tiny-ouro"
HELLO = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server():
    from server_utils import ServerThread

    from looped_spec.server.tools import ToolCallingConfig

    engine = LoopedSpecEngine(MODEL, speculation="2,1", max_model_len=256)
    tools = ToolCallingConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with ServerThread(engine, MODEL, tool_calling=tools, reasoning_parser="deepseek_r1") as running:
        yield running


def test_the_server_gates_each_grammar_with_the_end_tag(server, monkeypatch):
    """structured_outputs, response_format and a forced tool call each reach the engine with `</think>`'s ids as
    their gate; a request without a grammar with none."""
    from looped_spec.server.serving import OpenAIServing

    seen = []
    original = OpenAIServing.start_all

    def start_all(self, prompts, params, priority=0, cache_salt=None):
        seen.extend(params)
        return original(self, prompts, params, priority)

    monkeypatch.setattr(OpenAIServing, "start_all", start_all)
    end = base(MODEL).tokenizer.encode(END, add_special_tokens=False)
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    for extra in ({"structured_outputs": {"choice": ["a"]}}, {"response_format": {"type": "json_object"}},
                  {"tools": tools, "tool_choice": "required"}, {}):  # fmt: skip
        seen.clear()
        body = {"model": MODEL, "messages": HELLO, "max_tokens": 4, "n": 2, **extra}
        answer = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert [p.reasoning_end_token_ids for p in seen] == [end if extra else None] * 2, extra
        assert (seen[0].structured_outputs is not None) == bool(extra)


def test_a_grammar_whose_reasoning_never_ends_leaves_the_reply_all_reasoning(server):
    """The tiny model never writes `</think>`: under deepseek_r1 the reply is all reasoning, the model's free text
    (the grammar never applied), whole and streamed; a forced tool call likewise makes no call."""
    import openai

    # the chat continues an assistant message: a plain reply of this model to a user is newlines
    messages = [*HELLO, {"role": "assistant", "content": "def"}]
    turn = {"continue_final_message": True, "add_generation_prompt": False}
    free_engine = LoopedSpecEngine(MODEL, speculation="off", max_model_len=256)
    [free] = free_engine.chat(messages, SamplingParams(max_tokens=8, temperature=0), **turn)
    thought = free.text  # deepseek_r1: the reasoning as written (no <think> in the reply)
    assert END not in free.text and thought and free.text not in ("a", "b")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    message = client.chat.completions.create(**body, extra_body={"structured_outputs": {"choice": ["a", "b"]}, **turn})
    assert (message.choices[0].message.model_extra["reasoning"], message.choices[0].message.content) == (thought, None)
    reasoning = ""
    for chunk in client.chat.completions.create(**body, stream=True, response_format={"type": "json_object"},
                                                extra_body=turn):  # fmt: skip
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning") or ""
            assert not choice.delta.content
    assert reasoning == thought
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    called = client.chat.completions.create(**body, tools=tools, tool_choice="required", extra_body=turn).choices[0]
    assert called.message.model_extra["reasoning"] == thought and not called.message.tool_calls


def test_a_server_that_cannot_encode_the_end_tag_refuses_a_grammar_naming_its_field():
    """A 400 naming structured_outputs, response_format or tool_choice when `</think>` cannot be encoded (no
    tokenizer); a request without a grammar goes on without a gate."""
    from types import SimpleNamespace

    from looped_spec.server.errors import APIError
    from looped_spec.server.protocol import ChatCompletionRequest
    from looped_spec.server.serving import OpenAIServing
    from looped_spec.server.tools import ToolCallingConfig, plan_tools

    serving = SimpleNamespace(reasoning=REASONING_PARSERS["deepseek_r1"], tokenizer=None, vocab_size=1024)
    now = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}]
    for extra, field in (({"structured_outputs": {"choice": ["a"]}}, "structured_outputs"),
                         ({"response_format": {"type": "json_object"}}, "response_format"),
                         ({"tools": now, "tool_choice": "required"}, "tool_choice"), ({}, None)):  # fmt: skip
        body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": HELLO, **extra})
        plan = plan_tools(body, ToolCallingConfig())
        if field is None:
            assert OpenAIServing.check_reasoning(serving, body, plan, [1, 2]) is None
            continue
        with pytest.raises(APIError) as refused:
            OpenAIServing.check_reasoning(serving, body, plan, [1, 2])
        assert refused.value.status == 400 and refused.value.param == field, extra
        assert "'</think>': the model has no tokenizer" in str(refused.value), extra
