"""Issue 11: the engine never wedges and never loses an output. One regression test per numbered item."""

from __future__ import annotations

import pytest
import torch
from conftest import TokenizerFailingOn, make_engine
from pydantic import ValidationError

from looped_spec import SamplingParams, SpeculativeConfig
from looped_spec.engine.inputs import naming
from looped_spec.execution.sampler import SamplingRows

PROMPTS = [[5, 9, 13], [200, 1, 77, 4, 4, 19], [42, 43], [17, 18, 19, 20]]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def sampled(n: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.8, seed=seed, ignore_eos=True)


def fail_one_step(engine) -> None:
    """One step whose loops fail (a fault in model code): raised once, and the model as it was after."""
    engine.adapter.loop = OneShotFault(engine.adapter.loop, lambda *args, **kwargs: True)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()
    finally:
        del engine.adapter.loop


def run_to_end(engine, max_errors: int = 0) -> dict:
    """Step until nothing is left; collect each finished output (asserting it is reported once)."""
    finished: dict = {}
    errors = 0
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        try:
            outs = engine.step()
        except RuntimeError:
            errors += 1
            assert errors <= max_errors, "the engine raised again: it is wedged"
            continue
        for out in outs:
            if out.finished:
                assert out.request_id not in finished, f"{out.request_id} reported finished twice"
                finished[out.request_id] = out
    assert not engine.has_unfinished_requests()
    assert engine.num_free_blocks == engine.kv.num_blocks
    # on loop passes nothing of a finished request stays behind (its work in flight, its turn in the pass budget)
    assert engine.loop_batcher is None or engine.loop_batcher.is_empty
    return finished


class OneShotFault:
    """Raise RuntimeError the first time `when(*args)` is true, then behave normally."""

    def __init__(self, original, when) -> None:
        self.original = original
        self.when = when
        self.fired = False

    def __call__(self, *args, **kwargs):
        if not self.fired and self.when(*args, **kwargs):
            self.fired = True
            raise RuntimeError("injected fault")
        return self.original(*args, **kwargs)


# ----- 1. a mixed greedy/sampled speculative batch where the sampled request has the smaller K -----
@pytest.mark.parametrize("family", ["ouro", "nanbeige"])
def test_item01_mixed_batch_sampled_request_with_smaller_k(family):
    alone = make_engine(family).generate(PROMPTS[0], greedy(12))[0].token_ids
    engine = make_engine(family, speculation=SpeculativeConfig(k=3, d=1))
    # max_tokens=3: after its first token the sampled request may take at most 1 draft, the greedy one 3
    outs = engine.generate(PROMPTS[:2], [greedy(12), sampled(3, seed=7)])
    assert outs[0].token_ids == alone
    assert len(outs[1].token_ids) == 3
    assert engine.num_free_blocks == engine.kv.num_blocks


# ----- 2. an error while sampling the first token after prefill -----
def test_item02_error_sampling_first_token_does_not_wedge(monkeypatch):
    params = [greedy(6), sampled(6, seed=3), greedy(4)]
    expected = [o.token_ids for o in make_engine("ouro").generate(PROMPTS[:3], params)]
    engine = make_engine("ouro")
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:3], params)]
    fault = OneShotFault(SamplingRows.build.__func__, lambda cls, requests, device, *drafted: True)
    monkeypatch.setattr(SamplingRows, "build", classmethod(fault))
    finished = run_to_end(engine, max_errors=1)
    assert fault.fired
    assert [finished[i].token_ids for i in ids] == expected
    assert all(finished[i].finish_reason == "length" for i in ids)
    with pytest.raises(ValidationError, match="top_k"):
        SamplingParams(top_k=2**70)


# ----- 3. a step that fails after committing tokens; a pending abort report -----
def test_item03_outputs_of_a_failed_step_are_reported_later(monkeypatch):
    engine = make_engine("ouro")
    done = engine.add_request(PROMPTS[0], greedy(2))  # finishes in the first decode round
    engine.step()  # prefill
    fault = OneShotFault(engine.controller.observe, lambda feedback: True)
    monkeypatch.setattr(engine.controller, "observe", fault)  # fails after the round is committed
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    assert engine.has_unfinished_requests()
    finished = run_to_end(engine)
    assert finished[done].finish_reason == "length" and len(finished[done].token_ids) == 2

    keep = engine.add_request(PROMPTS[1], greedy(5))
    gone = engine.add_request(PROMPTS[2], greedy(5))
    engine.step()
    engine.abort(gone)
    loop = OneShotFault(engine.adapter.loop, lambda *args: True)
    monkeypatch.setattr(engine.adapter, "loop", loop)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    finished = run_to_end(engine)
    assert finished[gone].finish_reason == "abort"
    assert finished[keep].token_ids == make_engine("ouro").generate(PROMPTS[1], greedy(5))[0].token_ids

    # a generate() whose step fails leaves nothing of its requests behind, not even as suspects of the failed step
    fault = OneShotFault(engine.adapter.loop, lambda *args: True)
    monkeypatch.setattr(engine.adapter, "loop", fault)
    with pytest.raises(RuntimeError, match="injected"):
        engine.generate(PROMPTS[:2], greedy(4))
    assert fault.fired and not engine.failures.suspects and not engine.has_unfinished_requests()
    # ... nor an output owed to it when it failed after committing tokens: no later step returns one
    fault = OneShotFault(engine.controller.observe, lambda feedback: True)
    monkeypatch.setattr(engine.controller, "observe", fault)
    with pytest.raises(RuntimeError, match="injected"):
        engine.generate(PROMPTS[:2], greedy(4))
    assert fault.fired and not engine.has_unfinished_requests() and engine.step() == []


# ----- 4. add_request() mixed with generate(); a generate() that fails part way -----
def test_item04_online_requests_survive_generate_and_failed_generate_queues_nothing():
    engine = make_engine("nanbeige")
    online = engine.add_request(PROMPTS[0], greedy(2))
    outs = engine.generate(PROMPTS[1:3], greedy(8))
    assert [len(o.token_ids) for o in outs] == [8, 8]
    finished = run_to_end(engine)  # the online request finished during generate(): step() still reports it
    assert finished[online].finish_reason == "length" and len(finished[online].token_ids) == 2

    engine.add_request(PROMPTS[3], greedy(3), request_id="1")  # an id generate() would also number
    outs = engine.generate(PROMPTS[:3], greedy(3))
    assert len({o.request_id for o in outs} | {"1"}) == 4
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        engine.generate([PROMPTS[0], [10**6]], greedy(3))
    finished = run_to_end(engine)
    assert list(finished) == ["1"]  # nothing of the rejected generate() was queued


@pytest.mark.parametrize("batching", ["step", "loop"])
def test_a_generate_failing_mid_way_forgets_its_requests_and_the_engine_goes_on(batching):
    """A fault in model code during generate() is raised from it (its requests are aborted and forgotten: no output
    of theirs comes later, their KV blocks and, on loop passes, their work in flight are released); a request added
    online beside it goes on, and the engine's next generate() decodes as a fresh engine does."""
    engine = make_engine("ouro", speculation=SpeculativeConfig(k=2, d=1), batching=batching)
    online = engine.add_request(PROMPTS[0], greedy(6))
    calls = {"n": 0}

    def fifth_call(*args, **kwargs) -> bool:  # a decode step of generate(), after its prompts went in
        calls["n"] += 1
        return calls["n"] == 5 * engine.adapter.full_depth

    engine.adapter.loop = OneShotFault(engine.adapter.loop, fifth_call)
    try:
        with pytest.raises(RuntimeError, match="injected"):
            engine.generate(PROMPTS[1:], greedy(8))
        assert engine.adapter.loop.fired
    finally:
        del engine.adapter.loop
    finished = run_to_end(engine)  # no KV block held, nothing left in flight on loop passes
    assert list(finished) == [online] and len(finished[online].token_ids) == 6
    fresh = make_engine("ouro", speculation=SpeculativeConfig(k=2, d=1), batching=batching)
    expected = [o.token_ids for o in fresh.generate(PROMPTS[1:], greedy(8))]
    assert [o.token_ids for o in engine.generate(PROMPTS[1:], greedy(8))] == expected


def test_add_request_keeps_ids_apart_and_refuses_what_it_cannot_run_queueing_nothing():
    """An id the caller chose is never given to another request, nor taken twice; a request the engine cannot run
    (stop strings without the model's tokenizer, a sampling_params entry that is not SamplingParams) is refused with
    the field named, and nothing of it is queued."""
    engine = make_engine("nanbeige")  # the fixture has no tokenizer files
    chosen = engine.add_request(PROMPTS[0], greedy(2), request_id="0")  # the first id the engine would number
    numbered = engine.add_request(PROMPTS[1], greedy(3))
    assert (chosen, numbered != "0") == ("0", True)
    for request_id in ("0", numbered):
        with pytest.raises(ValueError, match=f"request_id '{request_id}' is already in use"):
            engine.add_request(PROMPTS[2], greedy(4), request_id=request_id)
    with pytest.raises(ValueError, match="stop strings need the model's tokenizer files; use stop_token_ids instead"):
        engine.add_request(PROMPTS[2], SamplingParams(max_tokens=4, stop=["x"]))
    with pytest.raises(ValueError, match="stop strings need the model's tokenizer"):
        engine.generate(PROMPTS[2:4], [greedy(4), SamplingParams(max_tokens=4, stop="x")])
    with pytest.raises(TypeError, match=r"sampling_params\[1\] must be SamplingParams, got dict"):
        engine.generate(PROMPTS[2:4], [greedy(4), {"max_tokens": 4}])
    finished = run_to_end(engine)
    assert {i: len(o.token_ids) for i, o in finished.items()} == {"0": 2, numbered: 3}
    assert engine.score([]) == []  # nothing to score


@pytest.mark.parametrize(
    "bad, message",
    [
        (SamplingParams(max_tokens=4, stop=["x"]), "stop strings need the model's tokenizer files"),
        (SamplingParams(max_tokens=4, allowed_token_ids=[5, 10**6]), "allowed_token_ids"),
        (SamplingParams(max_tokens=4, bad_words=["x"]), "bad_words: the model has no tokenizer files"),
        (SamplingParams(max_tokens=4, top_k=5), "top_k=5: the temperature is unset"),
        (SamplingParams(max_tokens=4, stop_token_ids=[10**6]), "stop_token_ids"),
        (SamplingParams(max_tokens=4, logit_bias={10**6: 1.0}), "logit_bias"),
    ],
)
def test_generate_names_the_sampling_params_entry_at_fault_and_queues_nothing(bad, message):
    """A list of SamplingParams, one per prompt: a bad entry's error names it (`sampling_params[2]: ...`), as a bad
    prompt's names `prompts[i]`; one SamplingParams for every prompt keeps the field's own message. Nothing of the
    call is queued either way."""
    engine = make_engine("nanbeige")  # the fixture has no tokenizer files
    online = engine.add_request(PROMPTS[0], greedy(2))
    with pytest.raises((ValueError, TypeError), match=r"^sampling_params\[2\]: " + message):
        engine.generate(PROMPTS[:3], [greedy(4), greedy(4), bad])
    with pytest.raises((ValueError, TypeError)) as single:
        engine.generate(PROMPTS[:3], bad)
    assert str(single.value).startswith(message.split(":")[0]) and "sampling_params" not in str(single.value)
    with pytest.raises((ValueError, TypeError), match=r"^prompts\[1\]"):  # a prompt's error is named as before
        engine.generate([PROMPTS[0], [10**6]], [greedy(4), bad])
    finished = run_to_end(engine)
    assert list(finished) == [online]  # nothing of the rejected calls was queued


def test_a_request_refused_for_its_params_takes_no_request_id():
    """A rejected add_request leaves the engine as it was: the next request gets the number it would have had (a
    SamplingParams error took one since its checks ran after the id was drawn)."""
    engine = make_engine("nanbeige")
    for bad in (SamplingParams(max_tokens=4, top_k=5), SamplingParams(max_tokens=4, stop_token_ids=[10**6])):
        with pytest.raises(ValueError):
            engine.add_request(PROMPTS[0], bad)
    assert engine.add_request(PROMPTS[0], greedy(2)) == "0"


def _pydantic_error():
    SamplingParams(max_tokens="8")


def _decode_error():
    b"\xff".decode("utf-8")


def _two_args():
    raise ValueError("first", "second")


@pytest.mark.parametrize("fault", [_pydantic_error, _decode_error, _two_args])
def test_naming_names_the_entry_of_an_error_whose_text_is_not_its_first_argument(fault):
    """naming() prefixed args[0]: a pydantic ValidationError (no args) kept no name, a UnicodeDecodeError (args[0]
    its codec) showed none and had its codec rewritten, several args showed as a tuple. Each is named now, the error
    itself left whole as the cause."""
    with pytest.raises(Exception) as bare:
        fault()
    with pytest.raises((ValueError, TypeError)) as named:
        with naming("sampling_params[1]"):
            fault()
    assert str(named.value) == f"sampling_params[1]: {bare.value}"
    assert named.value.__cause__ is None or named.value.__cause__.args == bare.value.args


# ----- 5. preemption takes the newest request, counted by arrival -----
def test_item05_preemption_victim_is_the_latest_arrival():
    engine = make_engine("ouro", block_size=4, num_kv_blocks=14, max_model_len=40)
    arrival_order: list[str] = []
    victims: list[tuple[str, list[str]]] = []
    original = engine.scheduler.preempt

    def preempt(request):
        victims.append((request.request_id, [r.request_id for r in engine.scheduler.running]))
        original(request)

    engine.scheduler.preempt = preempt
    for prompt, n in [(PROMPTS[0], 1), (PROMPTS[1], 1), (PROMPTS[2], 30), (PROMPTS[3], 30)]:
        arrival_order.append(engine.add_request(prompt, greedy(n)))
    for _ in range(3):  # the two short requests finish; live requests are now fewer than arrivals
        engine.step()
    for prompt in PROMPTS[:2]:
        arrival_order.append(engine.add_request(prompt, greedy(30)))
    run_to_end(engine)
    assert victims
    for victim, running in victims:
        assert victim == max(running, key=arrival_order.index)


# ----- the design rule: a step is a transaction over requests -----
@pytest.mark.parametrize("batching", ["step", "loop"])
def test_rule_a_request_failing_by_itself_finishes_with_error_and_the_others_go_on(monkeypatch, batching):
    params = [greedy(6), sampled(6, seed=5), greedy(5)]
    expected = [o.token_ids for o in make_engine("ouro", speculation="2,1").generate(PROMPTS[:3], params)]
    engine = make_engine("ouro", speculation="2,1", batching=batching)
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:3], params)]
    engine.step()  # prefill
    original = SamplingRows.build.__func__

    def build(cls, requests, device, drafted=None):  # a fault only this request's sampling hits, every time
        if any(r.request_id == ids[1] for r in requests):
            raise RuntimeError("bad request")
        return original(cls, requests, device, drafted)

    monkeypatch.setattr(SamplingRows, "build", classmethod(build))
    # raised for the batch, raised again when it first fails alone (a one-shot engine fault would not
    # fail twice), then it is the culprit. On loop passes the suspect runs alone until its token is done: a pass
    # alone that ends before the stage that fails proves nothing, and must not send it back into the batch
    finished = run_to_end(engine, max_errors=2)
    assert finished[ids[1]].finish_reason == "error" and "bad request" in finished[ids[1]].error
    assert [finished[ids[0]].token_ids, finished[ids[2]].token_ids] == [expected[0], expected[2]]
    # counted as a failure, not as a success (request_success_total / request_failure_total)
    assert (engine.stats.num_requests_finished, engine.stats.num_requests_failed) == (2, 1)
    assert 'looped_spec:request_failure_total{model_name=""} 1.0' in engine.stats.to_prometheus()
    # every plan the controller gave is reported or abandoned: the failed rounds' and the blamed one's commit nothing
    stats = engine.controller.stats()
    assert stats["plans"] == stats["observed"] + stats["abandoned"], stats


def test_rule_a_failed_round_is_rolled_back_generators_included(monkeypatch):
    import looped_spec.speculative.round as round_module

    params = [sampled(9, seed=11), greedy(9), sampled(7, seed=12)]
    expected = [o.token_ids for o in make_engine("huginn", speculation="2,3").generate(PROMPTS[:3], params)]
    engine = make_engine("huginn", speculation="2,3")
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:3], params)]
    engine.step()
    engine.step()  # one committed round, so the generators have drawn before the fault

    original = round_module.accept

    def accept_then_fail(*args, **kwargs):  # fails after the rejection sampler drew its uniforms
        monkeypatch.setattr(round_module, "accept", original)
        original(*args, **kwargs)
        raise RuntimeError("injected fault")

    monkeypatch.setattr(round_module, "accept", accept_then_fail)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    finished = run_to_end(engine)
    assert [finished[i].token_ids for i in ids] == expected


@pytest.mark.parametrize(
    "options", [dict(), dict(speculation="2,1"), dict(speculation="adaptive"), dict(speculation="3,2", batching="loop")]
)
def test_a_step_of_greedy_requests_draws_nothing_from_their_generators(options):
    """Why a transaction saves no generator state for a step whose requests are all greedy (engine/failures.py):
    nothing in it draws, adjusted logits (penalties, a bias, min_tokens, allowed tokens) included."""
    params = [
        greedy(9),
        SamplingParams(max_tokens=9, ignore_eos=True, repetition_penalty=1.3, logit_bias={7: 2.0}),
        SamplingParams(max_tokens=9, min_tokens=5, allowed_token_ids=list(range(40)), seed=3),
    ]
    engine = make_engine("ouro", **options)
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    requests = [engine._requests[i] for i in ids]
    before = [r.generator.get_state() for r in requests]
    finished = run_to_end(engine)
    assert all(len(finished[i].token_ids) == 9 for i in ids)
    assert all(torch.equal(r.generator.get_state(), state) for r, state in zip(requests, before))


@pytest.mark.parametrize("batching", ["step", "loop"])
@pytest.mark.parametrize("speculation", ["off", "2,1"])
def test_rule_a_request_whose_commit_fails_finishes_with_error_and_the_others_go_on(batching, speculation):
    from looped_spec.detokenizer import IncrementalDetokenizer

    params = [greedy(6), greedy(6), greedy(5)]
    expected = [o.token_ids for o in make_engine("ouro").generate(PROMPTS[:3], params)]
    engine = make_engine("ouro", speculation=speculation, batching=batching)
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS[:3], params)]
    bad = expected[1][3]
    assert bad not in expected[1][:3]
    # its stop string makes its commit decode each token (it never matches: the text is letters)
    engine._requests[ids[1]].detokenizer = IncrementalDetokenizer(TokenizerFailingOn(bad), stop=["!"])
    finished = run_to_end(engine)  # never raised: the failure is the request's own
    failed = finished[ids[1]]
    assert failed.finish_reason == "error" and f"cannot decode token {bad}" in failed.error
    assert failed.token_ids == expected[1][:3]  # the tokens before the one it could not take, once each
    assert failed.text == "".join(chr(ord("a") + t % 26) for t in expected[1][:3])
    assert [finished[ids[0]].token_ids, finished[ids[2]].token_ids] == [expected[0], expected[2]]
    assert (engine.stats.num_requests_finished, engine.stats.num_requests_failed) == (2, 1)


@pytest.mark.parametrize("batching", ["step", "loop"])
def test_rule_a_culprit_is_blamed_after_two_raises_when_its_exit_rule_fails(batching):
    """The fault strikes in the exit rule after the culprit's first loop: on loop passes a pass alone runs one loop
    at a time under an exit rule, so the culprit must stay alone until its token is done to be caught alone twice."""
    poison = 0.4321
    engine = make_engine("ouro", batching=batching)
    params = [SamplingParams(max_tokens=6, ignore_eos=True, exit_threshold=poison if i == 1 else 0.5) for i in range(4)]
    ids = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params)]
    original = engine.adapter.exit_rule

    def exit_rule(state, depth, prev, carry, threshold, ctx):
        if bool(torch.isclose(torch.as_tensor(threshold).float(), torch.tensor(poison)).any()):
            raise RuntimeError("bad threshold")
        return original(state, depth, prev, carry, threshold, ctx)

    engine.adapter.exit_rule = exit_rule
    finished = run_to_end(engine, max_errors=2)
    assert finished[ids[1]].finish_reason == "error" and "bad threshold" in finished[ids[1]].error
    assert all(finished[i].finish_reason == "length" for i in ids if i != ids[1])


@pytest.mark.parametrize("include_stop", [False, True])  # kept, its text is decoded: that is what fails
def test_a_stop_token_the_tokenizer_cannot_decode_still_stops_the_request(include_stop):
    from looped_spec.detokenizer import IncrementalDetokenizer

    expected = make_engine("ouro").generate(PROMPTS[1], greedy(6))[0].token_ids
    stop = expected[3]
    assert stop not in expected[:3]
    engine = make_engine("ouro")
    request_id = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=6, ignore_eos=True, stop_token_ids=[stop]))
    engine._requests[request_id].detokenizer = IncrementalDetokenizer(TokenizerFailingOn(stop), stop=["!"],
                                                                      include_stop=include_stop)  # fmt: skip
    out = run_to_end(engine)[request_id]
    assert (out.finish_reason, out.token_ids) == ("stop", expected[:4])  # it ends the request, as a stop token does
    assert out.stop_reason == stop
    assert out.text == "".join(chr(ord("a") + t % 26) for t in expected[:3])


def test_a_text_the_tokenizer_cannot_decode_leaves_the_tokens_and_says_so(caplog):
    """Without stop strings a request's text is decoded as it is reported: a tokenizer that fails there does not fail
    the request (its token ids are the output), its text is None and a warning names the request, once: not again at
    every later step that reports it."""
    from looped_spec.detokenizer import IncrementalDetokenizer

    expected = make_engine("ouro", speculation="off").generate(PROMPTS[1], greedy(12))[0].token_ids
    engine = make_engine("ouro", speculation="off")  # a token a step: the steps after the failure report it again
    request_id = engine.add_request(PROMPTS[1], greedy(12))
    engine._requests[request_id].detokenizer = IncrementalDetokenizer(TokenizerFailingOn(expected[3]))
    with caplog.at_level("WARNING", logger="looped_spec"):
        reported = []
        while engine.has_unfinished_requests():
            reported += [out for out in engine.step() if out.request_id == request_id]
    out = reported[-1]
    assert (out.finish_reason, out.token_ids, out.text) == ("length", expected, None)
    assert len(reported) > 6  # several steps reported it after the one that failed
    warnings = [r.getMessage() for r in caplog.records if "cannot decode its output" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].startswith(f"request {request_id}: cannot decode its output to text")


def test_on_loop_passes_a_suspect_alone_runs_its_loops_back_to_back():
    """Nothing can join a suspect's passes (the batch is the suspect alone), so a request waiting for admission must
    not cut its pass to one loop: its token is done in one step, and the suspects drain in as many steps."""
    engine = make_engine("ouro", batching="loop", max_batch_size=4)
    ids = [engine.add_request(p, greedy(6)) for p in PROMPTS[:2]]
    while not all(engine._requests[i].prefilled for i in ids):
        engine.step()
    fault = OneShotFault(engine.adapter.loop, lambda *args, **kwargs: True)
    engine.adapter.loop = fault
    try:
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()
        engine.add_request(PROMPTS[2], greedy(6))  # waits: the suspects run alone first
        for suspects_left in (1, 0):
            engine.step()
            assert len(engine.failures.suspects) == suspects_left
    finally:
        del engine.adapter.loop
    run_to_end(engine)


@pytest.mark.parametrize("speculation", [SpeculativeConfig(k=2, d=1), "adaptive"])
def test_a_failed_round_is_abandoned_to_the_controller(speculation):
    """A decode round that fails commits nothing and reports nothing: the controller hears it was abandoned (an EMA
    probe round among them is planned again), and the rounds after it report as before."""
    engine = make_engine("ouro", speculation=speculation)
    engine.add_request(PROMPTS[0], greedy(8))
    engine.step()  # the prompt
    fail_one_step(engine)
    stats = engine.controller.stats()
    assert (stats["plans"], stats["observed"], stats["abandoned"]) == (1, 0, 1)
    run_to_end(engine)
    stats = engine.controller.stats()
    assert stats["plans"] == stats["observed"] + 1 and stats["abandoned"] == 1


@pytest.mark.parametrize("batching", ["step", "loop"])
def test_an_error_after_the_commit_keeps_the_steps_counters(monkeypatch, batching):
    """A step committed before the controller's observe raised: its tokens stay, and so do the counters of what it ran
    (a loop pass's passes, positions and embeddings were counted after the feedback, and lost with it). Sampled requests
    show a pass or round run again after the error: their generators drew for it already."""

    def counters(engine) -> tuple:
        s = engine.stats
        return (s.num_generation_tokens, s.num_spec_rounds, s.num_loop_passes, s.num_loop_pass_positions,
                s.num_loop_pass_embeds)  # fmt: skip

    params = [greedy(8), sampled(8, seed=3), sampled(8, seed=9)]
    clean = make_engine("ouro", speculation="2,1", batching=batching)
    expected = run_to_end_with(clean, PROMPTS[:3], params)
    engine = make_engine("ouro", speculation="2,1", batching=batching)
    fault = OneShotFault(engine.controller.observe, lambda feedback: True)
    monkeypatch.setattr(engine.controller, "observe", fault)
    assert run_to_end_with(engine, PROMPTS[:3], params, max_errors=1) == expected
    assert fault.fired and counters(engine) == counters(clean)


def test_an_error_telling_the_controller_one_plan_of_a_pass_keeps_the_others_told(monkeypatch):
    """Loop passes finish several plans at once: an error in the controller's observe of one of them is raised after
    the others were told (they were dropped, and a probe among them would wait for its feedback for good)."""
    # early exit ends a plan's rounds at different passes, so plans entered at different passes finish together
    params = [SamplingParams(max_tokens=12 + 3 * i, temperature=0.0, ignore_eos=True, exit_threshold=0.5)
              for i in range(len(PROMPTS))]  # fmt: skip
    clean = make_engine("ouro", speculation="2,1", batching="loop")
    heard_clean: list[int] = []
    observe_clean = clean.controller.observe
    monkeypatch.setattr(clean.controller, "observe", lambda fb: (heard_clean.append(fb.plan_id), observe_clean(fb)))
    expected = run_to_end_with(clean, PROMPTS, params)

    engine = make_engine("ouro", speculation="2,1", batching="loop")
    heard: list[int] = []
    armed = {"now": False, "fired": None}
    finish = engine.loop_rounds.finish

    def finish_arming(*args):  # arm the fault at the first pass that finishes more than one plan
        feedbacks = finish(*args)
        armed["now"] = armed["fired"] is None and len(feedbacks) > 1
        return feedbacks

    def observe(fb):
        if armed["now"]:
            armed["now"], armed["fired"] = False, fb.plan_id
            raise RuntimeError("injected fault")
        heard.append(fb.plan_id)
        return engine.controller.__class__.observe(engine.controller, fb)

    monkeypatch.setattr(engine.loop_rounds, "finish", finish_arming)
    monkeypatch.setattr(engine.controller, "observe", observe)
    assert run_to_end_with(engine, PROMPTS, params, max_errors=1) == expected
    assert armed["fired"] is not None  # some pass finished two plans or more
    assert sorted([*heard, armed["fired"]]) == sorted(heard_clean)  # every other plan was heard


def run_to_end_with(engine, prompts, params, max_errors: int = 0) -> list[list[int]]:
    """`params`: one SamplingParams for every prompt, or one each."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    ids = [engine.add_request(p, q) for p, q in zip(prompts, each)]
    finished = run_to_end(engine, max_errors=max_errors)
    return [finished[i].token_ids for i in ids]


def test_a_prompt_run_alone_after_a_failed_step_keeps_to_max_num_batched_tokens():
    """After a prefill step fails, its request runs alone for a step: a chunk within max_num_batched_tokens like any
    other, not the whole rest of its prompt. A 40-token prompt under a budget of 16 still takes 3 prefill steps."""
    prompt = list(range(3, 43))
    expected = make_engine("ouro").generate([prompt], greedy(3))[0].token_ids
    engine = make_engine("ouro", max_num_batched_tokens=16)
    engine.add_request(prompt, greedy(3), "long")
    fail_one_step(engine)  # its first chunk
    finished = run_to_end(engine)
    assert finished["long"].token_ids == expected
    assert engine.stats.num_prefill_steps == 3 and engine.stats.num_prompt_tokens == len(prompt)


@pytest.mark.parametrize("batching", ["step", "loop"])
def test_a_failed_step_counts_no_decode_round(batching):
    """A step is a transaction: a decode round (on loop passes, a plan's first pass) that fails ran no round, so the
    stats count only the rounds the requests ran: each request's rounds add up to the batch sizes counted, and every
    round counted was reported to the controller."""
    engine = make_engine("ouro", batching=batching)
    for prompt in PROMPTS[:3]:
        engine.add_request(prompt, greedy(8))
    engine.step(), engine.step()  # the prompts, then the first round (or pass) of the three
    fail_one_step(engine)
    finished = run_to_end(engine)
    stats = engine.stats
    assert sum(size * n for size, n in stats.batch_size_histogram.items()) == sum(
        out.metrics.rounds for out in finished.values()
    )
    assert stats.num_rounds == sum(stats.plan_histogram.values()) == engine.controller.stats()["observed"]


def fault_at_call(original, n: int | None) -> OneShotFault:
    """`original`, except that its `n`-th call from now raises RuntimeError (None: none does)."""
    calls = iter(range(1, 10**9))
    return OneShotFault(original, lambda *args, **kwargs: next(calls) == n)


class ArmedFault:
    """Wraps a model function: once armed, its next call raises RuntimeError, once."""

    def __init__(self, original) -> None:
        self.original = original
        self.armed = False

    def __call__(self, *args, **kwargs):
        if self.armed:
            self.armed = False
            raise RuntimeError("injected fault")
        return self.original(*args, **kwargs)


@pytest.mark.parametrize("batching", ["step", "loop"])
def test_one_shot_faults_while_suspects_run_alone_blame_nobody(batching):
    """One-shot faults: one fails a batch, the next fails its first suspect's first step alone (raised, not blamed:
    only two failures alone in a row are), a third strikes after a step alone that did not fail (on loop passes an
    exit rule makes every pass one loop, so that step alone can end mid-token: the failures are not in a row). Every
    fault is raised once, nobody is finished with an error and every output equals the clean run."""
    params = [SamplingParams(max_tokens=6, ignore_eos=True, exit_threshold=0.999) for _ in PROMPTS[:3]]
    clean = make_engine("ouro", batching=batching)
    expected = run_to_end_with(clean, PROMPTS[:3], params)
    engine = make_engine("ouro", batching=batching)
    ids = [engine.add_request(p, q) for p, q in zip(PROMPTS[:3], params)]
    fault = ArmedFault(engine.adapter.loop)
    engine.adapter.loop = fault
    try:
        for _ in range(3):  # the prompts and a first token
            engine.step()
        for strike in (True, True, False, True):
            fault.armed = strike
            if strike:
                with pytest.raises(RuntimeError, match="injected"):
                    engine.step()
            else:
                assert all(not out.finished for out in engine.step())
        finished = run_to_end(engine)
    finally:
        del engine.adapter.loop
    assert [(finished[i].finish_reason, finished[i].token_ids) for i in ids] == [("length", t) for t in expected]
    assert engine.stats.num_requests_failed == 0


def test_an_interrupt_striking_a_suspect_alone_twice_is_raised_each_time_and_blames_nobody(monkeypatch):
    """A KeyboardInterrupt (not an Exception) is no fault of a request: it is raised each time, also when it strikes
    a suspect running alone twice in a row (not taken for the request's own failure: the request finished with
    "error" and the second interrupt swallowed); decoding then goes on to plain decoding's tokens."""
    params = greedy(6)
    expected = make_engine("ouro", speculation="off").generate([PROMPTS[0]], params)[0].token_ids
    engine = make_engine("ouro", speculation="off")
    request_id = engine.add_request(PROMPTS[0], params)
    engine.step()  # prefill
    fail_one_step(engine)  # a fault in model code: the request runs alone next, a suspect
    real_loop, interrupts = engine.adapter.loop, [2]

    def loop(*args, **kwargs):
        if interrupts[0]:
            interrupts[0] -= 1
            raise KeyboardInterrupt
        return real_loop(*args, **kwargs)

    monkeypatch.setattr(engine.adapter, "loop", loop)
    for _ in range(2):
        with pytest.raises(KeyboardInterrupt):
            engine.step()
    finished = run_to_end(engine)
    assert finished[request_id].finish_reason == "length" and finished[request_id].token_ids == expected


@pytest.mark.parametrize("batching", ["step", "loop"])
@pytest.mark.parametrize("aborted", [0, 1])
def test_a_suspect_aborted_before_it_runs_alone_is_reported_once_and_the_others_go_on(batching, aborted):
    """A failed step's requests run alone next; one aborted meanwhile finishes with "abort" (reported once, its blocks
    freed) and is never run alone: the other suspects and then the batch go on, equal to the clean run."""
    params = [greedy(6), sampled(6, seed=4), greedy(5)]
    expected = run_to_end_with(make_engine("ouro", speculation="2,1", batching=batching), PROMPTS[:3], params)
    engine = make_engine("ouro", speculation="2,1", batching=batching)
    ids = [engine.add_request(p, q) for p, q in zip(PROMPTS[:3], params)]
    fault = ArmedFault(engine.adapter.loop)
    engine.adapter.loop = fault
    try:
        for _ in range(3):
            engine.step()
        fault.armed = True
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()
    finally:
        del engine.adapter.loop
    engine.abort(ids[aborted])
    finished = run_to_end(engine)
    assert finished[ids[aborted]].finish_reason == "abort"
    assert finished[ids[aborted]].token_ids == expected[aborted][: len(finished[ids[aborted]].token_ids)]
    others = [i for i in range(3) if i != aborted]
    assert [finished[ids[i]].token_ids for i in others] == [expected[i] for i in others]
    assert engine.stats.num_requests_failed == 0


def test_an_abort_after_a_request_finished_leaves_its_output_as_it_finished():
    """A request that finished while generate() ran others (its output is owed to step()) is not aborted by a later
    abort(): its output comes once, with the finish reason and the tokens it finished with."""
    expected = make_engine("ouro").generate(PROMPTS[0], greedy(2))[0].token_ids
    engine = make_engine("ouro")
    done = engine.add_request(PROMPTS[0], greedy(2))
    engine.generate(PROMPTS[1], greedy(6))  # the online request finishes meanwhile
    engine.abort(done)
    finished = run_to_end(engine)
    assert (finished[done].finish_reason, finished[done].token_ids) == ("length", expected)
    assert engine.stats.finished_reasons["abort"] == 0


def test_a_pass_failing_at_a_later_loop_leaves_its_prompt_chunk_as_it_was():
    """Loop passes: a prompt's chunk keeps its last position's state at every depth for the exit rule of its first
    token. Its first pass runs one loop (a request waits to join); once nothing waits, its other loops run back to back
    in one pass, and a fault at a later loop of that pass fails it after the first ran: the retry starts from the chunk
    as it was, so the first token and its exit depth are those of the clean run."""
    prompt = [17, 18, 19, 20, 21, 22]  # its first token exits at loop 3 of 4
    early = SamplingParams(max_tokens=3, ignore_eos=True, exit_threshold=0.5)
    results = []
    for strike in (None, 2):  # the clean run, then a fault at the pass's second loop
        engine = make_engine("ouro", batching="loop", max_num_batched_tokens=len(prompt))
        first = engine.add_request(prompt, early)
        waiting = engine.add_request(PROMPTS[0], greedy(3))  # no room in the pass's token budget: it waits to join
        engine.step()  # the chunk's first loop
        engine.abort(waiting)
        engine.adapter.loop = fault_at_call(engine.adapter.loop, strike)
        try:
            out = run_to_end(engine, max_errors=1)[first]
        finally:
            del engine.adapter.loop
        results.append((out.token_ids, out.metrics.exit_depth_histogram))
    assert results[1] == results[0]


@pytest.mark.parametrize("speculation", ["2,1", "3,1"])
@pytest.mark.parametrize("exit_threshold", [None, 0.5])
def test_a_loop_pass_failing_at_any_readout_leaves_its_rounds_as_they_were(speculation, exit_threshold):
    """Loop passes on a fixed plan: a pass that finishes drafts reads them out after it added their positions to their
    rounds, and one that finishes verifications reads them out after it recorded their rows' exits. A one-shot fault
    at any readout of the run fails its pass there: the retry runs from the rounds and verifications as they were
    before it, so every request, greedy or sampled, ends with the tokens and exit depths of the clean run."""
    params = [
        SamplingParams(max_tokens=8 + i, ignore_eos=True, exit_threshold=exit_threshold, seed=3 + i,
                       temperature=0.8 if i % 2 else 0.0)
        for i in range(len(PROMPTS))
    ]  # fmt: skip

    def run(strike: int | None) -> tuple[list, bool]:
        engine = make_engine("ouro", speculation=speculation, batching="loop")
        ids = [engine.add_request(p, q) for p, q in zip(PROMPTS, params)]
        fault = fault_at_call(engine.adapter.readout, strike)
        engine.adapter.readout = fault
        try:
            finished = run_to_end(engine, max_errors=1)
        finally:
            del engine.adapter.readout
        return [(finished[i].token_ids, finished[i].metrics.exit_depth_histogram) for i in ids], fault.fired

    expected, _ = run(None)
    if exit_threshold is not None:
        assert any(set(hist) != {4} for _, hist in expected), "no token exits early: the exits are not exercised"
    strike, fired = 1, True
    while fired:  # every readout call of the run, until one past the last
        got, fired = run(strike)
        assert got == expected, strike
        strike += 1
    assert strike > 10  # the run read out at many passes
