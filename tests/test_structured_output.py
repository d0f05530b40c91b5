"""Structured outputs: the output follows its grammar (JSON schema, JSON object, regex, choice, Lark), ends once the
grammar is complete, and speculation keeps plain decoding's output and the constrained distribution."""

from __future__ import annotations

import json
import re
from functools import cache

import jsonschema
import pytest
import torch
from chisquare import assert_distribution, three_token_distribution
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError
from test_loop_batching import engine_actions
from test_reliability_property import RANDOM_WORKLOADS, FaultyModel, InjectedFault

from looped_spec import LoopedSpecEngine, SamplingParams, SpeculativeConfig
from looped_spec.structured_output import StructuredOutputs

SHIPPED = ["tiny-ouro", "tiny-huginn", "tiny-nanbeige"]
PROMPTS = ["def add(a, b):", "import os\n", "class Point:", "# the answer is", "x = [", "print(", "if x:", "return"]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "maximum": 120},
                   "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2}},
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}  # fmt: skip
GRAMMARS = {
    "json": StructuredOutputs(json=SCHEMA),
    "json text": StructuredOutputs(json=json.dumps(SCHEMA)),
    "json_object": StructuredOutputs(json_object=True),
    "regex": StructuredOutputs(regex=r"[0-9]{2,4}-[a-z]{1,3}"),
    "choice": StructuredOutputs(choice=["yes", "no", 'say "maybe"\\n']),
    "grammar": StructuredOutputs(grammar='start: "(" item (", " item)* ")"\nitem: /[a-c]/'),
}


@cache
def engine(model: str, **options) -> LoopedSpecEngine:
    return LoopedSpecEngine(model, max_batch_size=8, **options)


def follows(kind: str, text: str) -> bool:
    spec = GRAMMARS[kind]
    if kind.startswith("json"):
        value = json.loads(text)
        if kind == "json_object":
            return isinstance(value, dict)
        jsonschema.validate(value, SCHEMA)
        return True
    if kind == "regex":
        return re.fullmatch(spec.regex, text) is not None
    if kind == "choice":
        return text in spec.choice
    return re.fullmatch(r"\([a-c](, [a-c])*\)", text) is not None


@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_greedy_and_sampled_outputs_follow_their_grammar_and_end_with_it(kind):
    """A finished output follows the grammar; one cut by max_tokens (a tiny model may write a JSON key forever) is a
    beginning the grammar accepts."""
    plain = engine("tiny-ouro", speculation="off")
    finished = 0
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=48, temperature=temperature, seed=3, structured_outputs=GRAMMARS[kind])
        for out in plain.generate(PROMPTS, params):
            if out.finish_reason == "stop":
                finished += 1
                assert follows(kind, out.text), (kind, temperature, out.text)
            else:
                matcher = plain._grammars.compile(GRAMMARS[kind]).matcher
                assert out.finish_reason == "length" and matcher.consume_tokens(list(out.token_ids)), out.text
    assert finished >= len(PROMPTS) // 2


def test_a_gbnf_grammar_as_vllms_docs_write_them_constrains_as_its_lark_equal():
    """vLLM's structured outputs docs write grammars in GBNF (`root ::= ...`, which its xgrammar and guidance backends
    read): the same language in Lark gives the same outputs, greedy and seeded samples alike (it was a Lark parse
    error at the first `::=`)."""
    plain = engine("tiny-ouro", speculation="off")
    gbnf = StructuredOutputs(grammar='root ::= "(" item (", " item)* ")"\nitem ::= [a-c]')
    for temperature in (0.0, 1.0):
        params = SamplingParams(max_tokens=48, temperature=temperature, seed=3)
        want, got = (
            plain.generate(PROMPTS, params.model_copy(update={"structured_outputs": g}))
            for g in (GRAMMARS["grammar"], gbnf)
        )
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert any(o.finish_reason == "stop" and follows("grammar", o.text) for o in got)


def test_a_lark_grammar_with_a_gbnf_looking_line_is_read_as_lark():
    """A grammar defining Lark's `start:` rule is Lark (llguidance's own test), whatever a line of a regex in it looks
    like (`b ::= c` opening a line of a multi-line regex was taken for GBNF: a conversion error); GBNF never writes
    `start:`, and a GBNF rule named start (`start ::= ...`) is still GBNF."""
    plain = engine("tiny-ouro", speculation="off")
    for lark in ("start: /a\nb ::= c/\n", "%llguidance {}\nstart: x\nx: /a\nb ::= c/\n"):
        plain.check_grammar(StructuredOutputs(grammar=lark))
    with pytest.raises(ValueError, match="structured_outputs.grammar: GBNF"):
        plain.check_grammar(StructuredOutputs(grammar='start ::= "x"\n'))  # (llguidance renames root start)


@pytest.mark.parametrize("model", SHIPPED)
def test_greedy_speculation_with_a_grammar_is_plain_decoding_with_it(model):
    """The draft masks what the target masks at each position (the grammar advanced by the drafts before it), so
    every speculative mode gives plain decoding's tokens; so does early exit, where a draft the exit rule decides is
    drawn from the masked target. Requests without a grammar share the batches."""
    # seeded: Huginn's initial state is drawn from the request's seed (an unseeded one takes the engine's next)
    params = [
        SamplingParams(max_tokens=40, seed=i, structured_outputs=GRAMMARS[kind]) for i, kind in enumerate(GRAMMARS)
    ]
    params += [SamplingParams(max_tokens=12, ignore_eos=True, seed=9)] * 2
    prompts = PROMPTS[: len(params)]
    expected = [o.token_ids for o in engine(model, speculation="off").generate(prompts, params)]
    depth = engine(model, speculation="off").adapter.full_depth
    modes = [dict(speculation="2,1"), dict(speculation=f"4,{depth - 1}"), dict(speculation="adaptive"),
             dict(speculation="3,1", batching="loop"), dict(batching="loop"),
             dict(speculation=SpeculativeConfig(k=4, d=1, stop_margin=0.01))]  # fmt: skip
    for mode in modes:
        runner = engine(model, **mode)
        assert [o.token_ids for o in runner.generate(prompts, params)] == expected, mode
        assert runner.num_free_blocks == runner.kv.num_blocks
    for step in (1, 2):
        exits = [p.model_copy(update={"exit_at_step": step}) for p in params]
        want = [o.token_ids for o in engine(model, speculation="off").generate(prompts, exits)]
        for mode in (dict(speculation="2,1"), dict(speculation="2,1", batching="loop")):
            assert [o.token_ids for o in engine(model, **mode).generate(prompts, exits)] == want, (mode, step)


def test_a_draft_into_a_dead_end_of_the_grammar_leaves_the_committed_output_free():
    """A grammar with a branch no text completes: a draft down it makes the mask after it meet the dead end, which
    llguidance's matcher keeps as an error through its rollback; the request whose target rejected that draft then
    failed on its own committed token (greedy "q" and an error where plain decoding gave "qs", "stop"). Drafts are
    taken by a copy of the matcher, so every mode gives plain decoding's outputs, the errors of the requests whose
    own output reaches the dead end included."""
    dead_end = StructuredOutputs(grammar='start: "q" (/[a-m]/ dead | /[n-z]/)\ndead: /[^\\s\\S]/')
    params = [SamplingParams(max_tokens=6, seed=i, structured_outputs=dead_end) for i in range(len(PROMPTS))]
    plain = engine("tiny-ouro", speculation="off").generate(PROMPTS, params)
    expected = [(o.token_ids, o.finish_reason) for o in plain]
    assert {reason for _, reason in expected} == {"stop", "error"}  # both branches taken
    for mode in (dict(speculation="2,1"), dict(speculation="3,1", batching="loop")):
        outs = engine("tiny-ouro", **mode).generate(PROMPTS, params)
        assert [(o.token_ids, o.finish_reason) for o in outs] == expected, mode


@pytest.mark.slow
def test_speculative_sampling_with_a_grammar_keeps_the_constrained_distribution():
    """Three tokens of a regex grammar, the second and third from one K = 2 round: the draft's and the target's
    distributions are masked by the grammar after the tokens before each position, so rejection sampling keeps the
    constrained joint distribution, computed here from dense forwards and the grammar's own token checks."""
    from looped_spec.structured_output import GrammarCompiler

    model = engine("tiny-ouro", speculation="off")
    adapter, tokenizer = model.adapter, model.tokenizer
    spec = StructuredOutputs(regex=r"[a-e]{1,2}( [a-e]{1,2}){0,4}")
    fresh = GrammarCompiler(tokenizer, adapter.vocab_size, adapter.eos_token_ids)
    prompt, top_k, n = tokenizer.encode("x ="), 3, 4000

    def next_tokens(output):
        matcher = fresh.compile(spec).matcher
        assert matcher.consume_tokens(list(output))
        logits = adapter.dense_logits(torch.tensor(prompt + list(output)))[0, -1].double()
        allowed = [t for t in range(adapter.vocab_size) if matcher.validate_tokens([t]) == 1]
        keep = torch.full_like(logits, float("-inf"))
        keep[allowed] = logits[allowed]
        values, ids = keep.topk(top_k)
        probs = values.softmax(-1)
        return [(t, p) for t, p in zip(ids.tolist(), probs.tolist()) if p > 0]

    exact = three_token_distribution(next_tokens)
    runner = LoopedSpecEngine("tiny-ouro", speculation=SpeculativeConfig(k=2, d=1), max_batch_size=256,
                              max_num_batched_tokens=4096, seed=11)  # fmt: skip
    # max_tokens 4: the round after the first token drafts K = 2 (a round keeps one token of the budget for its last)
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=top_k, structured_outputs=spec)
    outs = runner.generate([prompt] * n, params)
    assert runner.stats.num_accepted_tokens > 0 and runner.stats.num_draft_tokens > runner.stats.num_accepted_tokens
    assert runner.stats.num_draft_tokens >= 1.5 * n  # K = 2 rounds
    assert all(len(o.token_ids) >= 3 for o in outs)
    assert_distribution((tuple(o.token_ids[:3]) for o in outs), exact)


def test_grammar_errors_name_the_field():
    for bad in ({}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"json_object": False}, {"regex": 5}):
        with pytest.raises(ValidationError, match="StructuredOutputs|choice|regex"):
            StructuredOutputs(**bad)
    model = engine("tiny-ouro", speculation="off")
    cases = [({"json": "{not json"}, "structured_outputs.json"),
             ({"json": {"type": "bogus"}}, "structured_outputs.json"), ({"regex": "(a"}, "structured_outputs.regex"),
             ({"grammar": "start: foo"}, "structured_outputs.grammar"),
             ({"grammar": "root ::= ("}, "structured_outputs.grammar: GBNF"),
             # no text satisfies them: found at the first mask, which the compiler computes (they failed at generation)
             ({"regex": "a[^\\s\\S]b"}, "structured_outputs.regex: no text satisfies the grammar"),
             ({"json": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}},
              "structured_outputs.json: no text satisfies the grammar"),
             # JSON Schema's boolean false, and llguidance options that are no object (llguidance dropped them)
             ({"json": "false"}, "structured_outputs.json: false is the schema no value satisfies"),
             ({"json": {"type": "object", "x-guidance": 3}},
              "structured_outputs.json: x-guidance must be an object")]  # fmt: skip
    for fields, where in cases:
        with pytest.raises(ValueError, match=re.escape(where)):
            model.generate("x", SamplingParams(structured_outputs=StructuredOutputs(**fields)))
    assert not model.has_unfinished_requests()
    # boolean true, any JSON value (llguidance takes object schemas only: it was "Expecting object schema")
    anything = model.generate("x", SamplingParams(max_tokens=40, structured_outputs=StructuredOutputs(json="true")))[0]
    assert anything.finish_reason in ("stop", "length") and anything.text  # (a JSON number may run to max_tokens)
    without_tokenizer = LoopedSpecEngine("tests/fixtures/ouro-tiny", speculation="off")
    with pytest.raises(ValueError, match="structured_outputs.regex: .*tokenizer"):
        without_tokenizer.generate([1, 2], SamplingParams(structured_outputs=StructuredOutputs(regex="a")))


def test_a_schema_nested_too_deeply_is_an_error_naming_its_field():
    """A schema as text deeper than Python's JSON decoder goes is a ValueError naming structured_outputs.json, so the
    server answers 400 (it was a RecursionError, a 500); so is a dict deeper than its encoder goes (llguidance,
    given the dict, overflowed the native stack: the process died)."""
    model = engine("tiny-ouro", speculation="off")
    deep: dict = {"type": "integer"}
    for _ in range(20_000):
        deep = {"type": "array", "items": deep}
    for schema in ("[" * 100_000, deep):
        with pytest.raises(ValueError, match=r"^structured_outputs\.json: nested too deeply"):
            model.generate("x", SamplingParams(structured_outputs=StructuredOutputs(json=schema)))
    assert not model.has_unfinished_requests()


def test_structured_outputs_round_trip_through_json():
    params = SamplingParams(structured_outputs=StructuredOutputs(json=SCHEMA))
    assert SamplingParams.model_validate_json(params.model_dump_json(by_alias=True)) == params
    assert StructuredOutputs.model_validate({"json": SCHEMA}).json_schema == SCHEMA


grammar_request_st = st.fixed_dictionaries(
    {
        "prompt": st.sampled_from(PROMPTS),
        "grammar": st.sampled_from([None, *GRAMMARS]),
        "max_tokens": st.integers(1, 24),
        "min_tokens": st.sampled_from([0, 0, 2]),
    }
)


def grammar_params(spec: dict) -> SamplingParams:
    grammar = GRAMMARS[spec["grammar"]] if spec["grammar"] is not None else None
    return SamplingParams(max_tokens=spec["max_tokens"], min_tokens=min(spec["min_tokens"], spec["max_tokens"]),
                          seed=5, structured_outputs=grammar)  # fmt: skip


@cache
def alone_with_grammar(prompt: str, params_json: str) -> tuple[int, ...]:
    params = SamplingParams.model_validate_json(params_json)
    return tuple(engine("tiny-ouro", speculation="off").generate(prompt, params)[0].token_ids)


@pytest.mark.slow
@RANDOM_WORKLOADS
@given(
    speculation=st.sampled_from(["off", "2,1", "3,2", "adaptive"]),
    batching=st.sampled_from(["step", "loop"]),
    num_kv_blocks=st.integers(10, 16),  # block_size 4, max_model_len 40: one request needs up to 10
    initial=st.lists(grammar_request_st, min_size=1, max_size=5),
    actions=engine_actions(grammar_request_st, 14),
)
def test_grammars_survive_arrivals_aborts_faults_and_preemption(speculation, batching, num_kv_blocks, initial, actions):
    """Greedy requests with and without grammars arriving mid-run, aborted, hit by a fault in model code and preempted
    for KV blocks: each finished one equals the request run alone (a fault or a preemption never leaves a grammar
    advanced past the committed output), every finished request is reported once, no block leaks."""
    runner = LoopedSpecEngine("tiny-ouro", speculation=speculation, batching=batching, block_size=4,
                              num_kv_blocks=num_kv_blocks, max_model_len=40, max_batch_size=4,
                              max_num_batched_tokens=16)  # fmt: skip
    adapter = runner.adapter
    faulty = FaultyModel(adapter)
    specs, finished, aborted, last_ok = {}, {}, set(), True

    def step() -> None:
        nonlocal last_ok
        try:
            outputs = runner.step()
        except InjectedFault:
            last_ok = False
            return
        last_ok = True
        for out in outputs:
            if out.finished:
                assert out.request_id not in finished
                finished[out.request_id] = out

    try:
        for spec in initial:
            specs[runner.add_request(spec["prompt"], grammar_params(spec))] = spec
        for action in actions:
            if action[0] == "step":
                step()
            elif action[0] == "add":
                specs[runner.add_request(action[1]["prompt"], grammar_params(action[1]))] = action[1]
            elif action[0] == "abort":
                live = [i for i in specs if i not in finished]
                if live:
                    runner.abort(live[action[1] % len(live)])
                    aborted.add(live[action[1] % len(live)])
            elif faulty.countdown is None and last_ok:
                faulty.arm(action[1])
        for _ in range(400):
            if not runner.has_unfinished_requests():
                break
            step()
        faulty.countdown = None
        assert not runner.has_unfinished_requests() and sorted(finished) == sorted(specs)
        assert runner.num_free_blocks == runner.kv.num_blocks
        for request_id, out in finished.items():
            if request_id in aborted and out.finish_reason == "abort":
                continue
            spec = specs[request_id]
            expected = alone_with_grammar(spec["prompt"], grammar_params(spec).model_dump_json(by_alias=True))
            assert tuple(out.token_ids) == expected, (spec, out.finish_reason)
    finally:
        faulty.remove()


def test_the_grammar_decides_where_the_output_ends():
    """A complete grammar ends the request before its min_tokens; a grammar that allows only stop tokens there ends
    it with one (never a token both forbid, never an error); an eos that completes the grammar ends it under
    ignore_eos too, its text left out."""
    model = engine("tiny-ouro", speculation="off")
    eos = model.adapter.eos_token_ids[0]
    for mode in ("off", "2,1"):
        runner = engine("tiny-ouro", speculation=mode)
        out = runner.generate("x", SamplingParams(max_tokens=8, min_tokens=5,
                                                  structured_outputs=StructuredOutputs(choice=["a"])))[0]  # fmt: skip
        assert (out.text, out.finish_reason) == ("a", "stop")
        out = runner.generate("x", SamplingParams(max_tokens=8, min_tokens=3,
                                                  structured_outputs=StructuredOutputs(choice=[""])))[0]  # fmt: skip
        assert (out.token_ids, out.finish_reason) == ([eos], "stop")
        yes_no = StructuredOutputs(choice=["yes", "no"])
        matcher = model._grammars.compile(yes_no).matcher
        allowed = [t for t in range(model.adapter.vocab_size) if matcher.validate_tokens([t]) == 1]  # the first token
        for temperature in (0.0, 1.0):
            params = SamplingParams(max_tokens=8, min_tokens=2, temperature=temperature, seed=2, stop_token_ids=allowed,
                                    structured_outputs=yes_no)  # fmt: skip
            out = runner.generate("x", params)[0]
            assert out.finish_reason == "stop" and out.token_ids[-1:] == out.token_ids[:1], out.token_ids
            assert out.token_ids[0] in allowed, (mode, temperature, out.token_ids)
        params = SamplingParams(max_tokens=12, ignore_eos=True, skip_special_tokens=False, logit_bias={eos: 100.0},
                                structured_outputs=StructuredOutputs(regex="[0-9]{1,6}"))  # fmt: skip
        out = runner.generate("x =", params)[0]  # eos as soon as the grammar allows it: after the first token
        assert out.finish_reason == "stop" and out.token_ids[-1] == eos and re.fullmatch("[0-9]+", out.text), out.text


@pytest.mark.parametrize("grammar", [{"grammar": 'start: "q" dead\ndead: /[^\\s\\S]/'}])
def test_a_grammar_no_text_satisfies_fails_its_request_alone(grammar):
    """A grammar whose every text reaches a dead end after "q" compiles (its first mask allows "q"; one that allows
    nothing is refused, `test_grammar_errors_name_the_field`), and the matcher
    allows only the end of sequence once the mask at the dead end is computed (its error state): the request finishes
    with an error naming structured_outputs, not as a completed "stop" whose output the grammar never took (the
    mutation check: that was the outcome); the request beside it runs on. Under speculation the dead end after "q" is
    met by the draft's mask, and the verifier's mask there is the same end of sequence (the matcher, stopped by its
    error, allowed every token to the verifier, whose token the grammar then refused)."""
    for mode in ("off", "2,1"):
        runner = engine("tiny-ouro", speculation=mode)
        never = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputs(**grammar))
        failed, fine = runner.generate(["x", "y"], [never, SamplingParams(max_tokens=4, ignore_eos=True)])
        assert failed.finish_reason == "error" and "structured_outputs: the grammar cannot be followed" in failed.error
        assert fine.finish_reason == "length" and len(fine.token_ids) == 4


def test_a_grammar_compiles_once_and_each_request_gets_its_own_matcher():
    compiler = engine("tiny-ouro", speculation="off")._grammars
    spec = StructuredOutputs(regex="[a-c]{2}")
    first, second = compiler.compile(spec), compiler.compile(spec)
    assert len([key for key in compiler._compiled if key == spec.lark()]) == 1
    token = engine("tiny-ouro", speculation="off").tokenizer.encode("a")[0]
    first.consume(token)
    assert first.matcher is not second.matcher and second.matcher.validate_tokens([token, token]) == 2


def test_a_token_whose_text_fails_to_decode_leaves_the_grammar_where_it_was():
    """The commit of a token is all or nothing: when its text cannot be decoded (for stop strings) it is not
    committed, and the grammar, which took it first, gives it back."""
    from conftest import TokenizerFailingOn

    from looped_spec.detokenizer import IncrementalDetokenizer
    from looped_spec.request import Request

    model = engine("tiny-ouro", speculation="off")
    digit = model.tokenizer.encode("7")[0]
    grammar = model._grammars.compile(StructuredOutputs(regex="[0-9]{2}"))
    request = Request("r", 0, [1, 2], SamplingParams(max_tokens=4), 0, [0], 64,
                      IncrementalDetokenizer(TokenizerFailingOn(digit), stop=["!"]), None, grammar)  # fmt: skip
    with pytest.raises(ValueError, match="cannot decode"):
        request.append(digit)
    assert request.num_output_tokens == 0 and grammar.matcher.validate_tokens([digit, digit]) == 2


def test_the_tokenizers_eos_ends_a_request_and_a_grammar_as_the_models_own(tmp_path):
    """A chat model's turn ends at its tokenizer's eos, which may not be config.json's: it is an eos too (vLLM stops
    on it), so a request stops there with stop_reason None, and a grammar may end there (else an open-ended grammar,
    a number or a repeated rule, ran to max_tokens)."""
    import json
    import shutil

    from looped_spec import LoopedSpecEngine, SamplingParams
    from looped_spec.models import shipped_model_path
    from looped_spec.structured_output import GrammarCompiler, StructuredOutputs, allowed_tokens

    folder = tmp_path / "turn-end"
    shutil.copytree(shipped_model_path("tiny-ouro"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = config_eos = 5  # another token than the tokenizer's eos
    (folder / "config.json").write_text(json.dumps(config))
    engine = LoopedSpecEngine(str(folder), speculation="off")
    turn_end = engine.tokenizer.eos_token_id
    assert turn_end != config_eos and engine.eos_token_ids == [config_eos, turn_end]
    for token in (config_eos, turn_end):
        out = engine.generate([1, 2, 3], SamplingParams(max_tokens=4, logit_bias={token: 100.0}))[0]
        assert (out.token_ids, out.finish_reason, out.stop_reason) == ([token], "stop", None), token
    compiler = GrammarCompiler(engine.tokenizer, engine.adapter.vocab_size, engine.eos_token_ids)
    grammar = compiler.compile(StructuredOutputs(regex="[0-9]+"))
    grammar.consume(engine.tokenizer.encode("7")[0])
    mask = allowed_tokens([grammar], [[]])[0]
    assert mask[turn_end] and mask[config_eos]  # either ends the number
