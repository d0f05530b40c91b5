"""Early exit in plain decoding (issue 13): `select` against the fixtures' exit_pdf, `skip` and `select`
against an independent token-by-token reference that keeps its own KV store and fills skipped loops' KV
by the documented rule."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import FAMILIES, load, reference, reference_tensors
from prometheus_client.parser import text_string_to_metric_families

from looped_spec import LoopedSpecEngine, SamplingParams

TAUS = [0.3, 0.5, 0.7, 0.9]


# ----- teacher forcing through the engine's own paths -----
def forced_readouts(engine: LoopedSpecEngine, prompt: list[int], start: int, params: SamplingParams):
    """Feed `prompt` through the engine from `prompt[:start]` on, replacing each sampled token by the
    prompt's next one. Returns [(exit depth, logits [V])] for positions start-1 .. len(prompt)-1."""
    records = []
    runner = engine.runner
    prefill, decode = runner.prefill_with_depths, runner.decode_with_depths

    def record_prefill(requests, chunk_lens):
        logits, depths = prefill(requests, chunk_lens)
        records.append((depths[0], logits[0].clone()))
        return logits, depths

    def record_decode(requests):
        logits, depths = decode(requests)
        records.append((depths[0] if depths is not None else engine.adapter.full_depth, logits[0].clone()))
        return logits, depths

    runner.prefill_with_depths, runner.decode_with_depths = record_prefill, record_decode
    request_id = engine.add_request(prompt[:start], params.model_copy(update={"max_tokens": 64, "ignore_eos": True}))
    request = engine._requests[request_id]
    for position in range(start, len(prompt) + 1):
        engine.step()
        if position < len(prompt):
            request.token_ids[-1] = prompt[position]  # teacher forcing: the fixture's token, not the sampled one
    engine.abort(request_id)
    engine.step()
    return records


def expected_ouro_depth(pdf_row: torch.Tensor, tau: float) -> int:
    cdf = torch.cumsum(pdf_row.double(), 0)
    hits = (cdf >= tau).nonzero()
    return int(hits[0]) + 1 if len(hits) else len(pdf_row)


@pytest.mark.parametrize("tau", TAUS)
def test_select_mode_reads_out_at_the_fixture_exit_pdf_depth(tau):
    adapter, ref, tensors = load("ouro"), reference("ouro"), reference_tensors("ouro")
    engine = LoopedSpecEngine(adapter, speculation="off", early_exit="select")
    depths_seen = set()
    for i, prompt in enumerate(ref["prompts"]):
        pdf = tensors[f"exit_pdf.p{i}"]
        cdf = torch.cumsum(pdf.double(), -1)[:, :-1]
        assert (cdf - tau).abs().min() > 1e-4, "tau too close to a stored cumulative probability to be decisive"
        records = forced_readouts(engine, prompt, 1, SamplingParams(exit_threshold=tau))
        assert len(records) == len(prompt)
        for t, (depth, logits) in enumerate(records):
            want = expected_ouro_depth(pdf[t], tau)
            assert depth == want, (i, t)
            ref_logits = tensors[f"logits.p{i}.depth{want}"][t]
            assert (logits - ref_logits).abs().max() <= 1e-4 * ref_logits.abs().max()
            depths_seen.add(depth)
    assert engine.num_free_blocks == engine.kv.num_blocks
    if tau <= 0.5:
        assert min(depths_seen) < adapter.full_depth  # the sweep really exits early


@pytest.mark.parametrize("mode", ["skip", "select"])
def test_tau_one_is_todays_output(mode):
    adapter, ref, tensors = load("ouro"), reference("ouro"), reference_tensors("ouro")
    for i in range(len(ref["prompts"])):  # no stored gate reaches cumulative probability 1 before D
        assert torch.cumsum(tensors[f"exit_pdf.p{i}"].double(), -1)[:, :-1].max() < 1.0
    engine = LoopedSpecEngine(adapter, speculation="off", early_exit=mode)
    for g in ref["greedy"]:
        prompt = ref["prompts"][g["prompt_index"]]
        for params in (
            SamplingParams(max_tokens=len(g["tokens"]), ignore_eos=True),
            SamplingParams(max_tokens=len(g["tokens"]), ignore_eos=True, exit_threshold=1.0),
        ):
            assert engine.generate([prompt], params)[0].token_ids == g["tokens"]


# ----- the independent reference: one token at a time, its own KV store -----
class TokenContext:
    """Attention of one token over a plain per-plane store {plane: {position: (k, v)}} (last write wins)."""

    def __init__(self, store: dict, position: int, seed: int) -> None:
        self.store, self.position, self.seed = store, position, seed
        self.positions = torch.tensor([position])
        self.memo: dict = {}
        self.touched: list[int] = []

    def attention(self, plane, q, k, v):
        self.store.setdefault(plane, {})[self.position] = (k[0].clone(), v[0].clone())
        self.touched.append(plane)
        entries = [self.store[plane][p] for p in range(self.position + 1)]
        keys = torch.stack([e[0] for e in entries]).float()  # [T, KVH, hd]
        values = torch.stack([e[1] for e in entries]).float()
        group = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # [T, H, hd]
        scores = torch.einsum("hd,thd->ht", q[0].float(), keys) / q.shape[-1] ** 0.5
        out = torch.einsum("ht,thd->hd", scores.softmax(-1), values)
        return out[None].to(q.dtype)

    def token_seeds(self):
        return [(self.seed, self.position)]


def reference_exit(adapter, family, states, initial, ctx, params) -> int:
    """First depth at which the family's rule (or exit_at_step) says stop, computed here from scratch."""
    depth = adapter.full_depth
    if params.exit_at_step is not None:
        return params.exit_at_step
    if params.exit_threshold is None:
        return depth
    if family == "ouro":
        gates = torch.stack([adapter.exit_signal(s, d + 1) for d, s in enumerate(states)], -1)[0]
        return expected_ouro_depth(adapter.exit_pdf(gates), params.exit_threshold)
    if getattr(adapter, "exit_criterion", "kl") == "latent":  # huginn: relative change of the latent x
        hidden = adapter.state_dim // 2
        for d in range(1, depth):
            x, prev = states[d - 1][0, :hidden], (states[d - 2] if d > 1 else initial)[0, :hidden]
            if (x - prev).norm() / x.norm() < params.exit_threshold:
                return d
        return depth
    prev_logp = None
    for d, s in enumerate(states[:-1]):  # huginn, KL criterion
        logp = F.log_softmax(adapter.readout(s, d + 1, ctx), -1)
        if prev_logp is not None:
            kl = F.kl_div(logp, prev_logp, reduction="sum", log_target=True)  # KL(p_{s-1} || p_s), as Huginn's code
            if kl < params.exit_threshold:
                return d + 1
        prev_logp = logp
    return depth


@torch.no_grad()
def reference_generate(adapter, family, prompt, max_tokens, params, mode, seed):
    """Greedy tokens, logits and exit depths of early-exit decoding, token by token, without the engine."""
    depth = adapter.full_depth
    store: dict = {}
    loop_planes: dict[int, list[int]] = {}
    seq = list(prompt)
    tokens, all_logits, depths = [], [], []
    for t in range(len(prompt) - 1 + max_tokens):
        ctx = TokenContext(store, t, seed)
        state = initial = adapter.embed(torch.tensor([seq[t]]), ctx)
        states = []
        generated = t >= len(prompt)
        for i in range(depth):
            ctx.touched = []
            state = adapter.loop(state, i, ctx)
            loop_planes.setdefault(i, list(ctx.touched))
            states.append(state)
        if t < len(prompt) - 1:  # prompt: full depth (Huginn's coda KV from the full-depth readout)
            adapter.readout(states[-1], depth, ctx)
            continue
        exit_depth = reference_exit(adapter, family, states, initial, ctx, params)
        if mode == "skip" and generated:  # the loops after the exit: never run, their planes hold the exit KV
            for i in range(exit_depth, depth):
                for src, dst in zip(loop_planes[exit_depth - 1], loop_planes[i]):
                    store[dst][t] = store[src][t]
        logits = adapter.readout(states[exit_depth - 1], exit_depth, ctx)[0]
        token = int(logits.argmax())
        tokens.append(token)
        all_logits.append(logits)
        depths.append(exit_depth)
        seq.append(token)
    return tokens, all_logits, depths


def engine_generate(engine, prompt, params):
    """Greedy tokens, per-token logits and exit depths from the engine (prefill + plain decode rounds)."""
    logits_seen, depths_seen = [], []
    runner = engine.runner
    prefill, decode = runner.prefill_with_depths, runner.decode_with_depths

    def record_prefill(requests, chunk_lens):
        logits, depths = prefill(requests, chunk_lens)
        logits_seen.append(logits[0].clone())
        depths_seen.append(depths[0] or engine.adapter.full_depth)
        return logits, depths

    def record_decode(requests):
        logits, depths = decode(requests)
        logits_seen.append(logits[0].clone())
        depths_seen.append(depths[0] if depths else engine.adapter.full_depth)
        return logits, depths

    runner.prefill_with_depths, runner.decode_with_depths = record_prefill, record_decode
    out = engine.generate([prompt], params)[0]
    runner.prefill_with_depths, runner.decode_with_depths = prefill, decode
    return out, logits_seen, depths_seen


def exit_params(family: str) -> list[SamplingParams]:
    """Thresholds that exit at mixed depths on the fixtures, plus fixed depths."""
    depth = load(family).full_depth
    fixed = [SamplingParams(exit_at_step=k) for k in sorted({1, max(1, depth // 2)})]
    if family == "ouro":
        return [SamplingParams(exit_threshold=t) for t in (0.3, 0.6, 0.9)] + fixed
    if family == "huginn":
        return [SamplingParams(exit_threshold=t) for t in (1e-3, 3e-2, 0.3)] + fixed
    return fixed


@pytest.mark.parametrize("mode", ["skip", "select"])
@pytest.mark.parametrize("family", FAMILIES)
def test_early_exit_matches_token_by_token_reference(family, mode):
    adapter, ref = load(family), reference(family)
    engine = LoopedSpecEngine(adapter, speculation="off", early_exit=mode)
    max_tokens = 10
    all_depths = set()
    for params in exit_params(family):
        params = params.model_copy(update={"max_tokens": max_tokens, "ignore_eos": True, "seed": 7})
        for prompt in ref["prompts"]:
            out, logits, depths = engine_generate(engine, prompt, params)
            want_tokens, want_logits, want_depths = reference_generate(
                adapter, family, prompt, max_tokens, params, mode, seed=7
            )
            assert depths == want_depths, params
            assert out.token_ids == want_tokens, params
            for got, want in zip(logits, want_logits):
                assert (got - want).abs().max() <= 1e-4 * (1 + want.abs().max()), params
            all_depths.update(depths)
    assert engine.num_free_blocks == engine.kv.num_blocks
    assert min(all_depths) < adapter.full_depth  # tokens did exit early


@pytest.mark.parametrize("mode", ["skip", "select"])
def test_huginn_latent_criterion_matches_reference(mode):
    from conftest import fixture_dir

    from looped_spec import load_adapter

    adapter = load_adapter(fixture_dir("huginn"), device="cpu", initial_state="zeros", exit_criterion="latent")
    engine = LoopedSpecEngine(adapter, speculation="off", early_exit=mode)
    depths_seen = set()
    for threshold in (0.05, 0.2, 0.5):
        params = SamplingParams(max_tokens=8, ignore_eos=True, exit_threshold=threshold)
        for prompt in reference("huginn")["prompts"]:
            out, logits, depths = engine_generate(engine, prompt, params)
            want_tokens, want_logits, want_depths = reference_generate(adapter, "huginn", prompt, 8, params, mode, 0)
            assert (depths, out.token_ids) == (want_depths, want_tokens)
            for got, want in zip(logits, want_logits):
                assert (got - want).abs().max() <= 1e-4 * (1 + want.abs().max())
            depths_seen.update(depths)
    assert len(depths_seen) > 1  # mixed depths


def test_huginn_exit_threshold_option_is_the_requests_default():
    """Adapter option exit_threshold: the threshold of requests that set none; a request's own exit_threshold
    (or exit_at_step) overrides it; unset, requests run every step, as without the option."""
    from conftest import fixture_dir

    from looped_spec import load_adapter

    def huginn(**options):
        return load_adapter(fixture_dir("huginn"), device="cpu", initial_state="zeros", **options)

    assert load("huginn").default_exit_threshold is None
    paper = huginn(exit_threshold=5e-4)
    assert paper.default_exit_threshold == type(paper).PAPER_KL_THRESHOLD == 5e-4
    plain = LoopedSpecEngine(load("huginn"), speculation="off")
    engine = LoopedSpecEngine(huginn(exit_threshold=0.3), speculation="off")
    depth = engine.adapter.full_depth
    base = SamplingParams(max_tokens=8, ignore_eos=True)
    prompts = reference("huginn")["prompts"]

    def run(eng, **fields):
        outs = eng.generate(prompts, base.model_copy(update=fields))
        return [(o.token_ids, o.metrics.exit_depth_histogram) for o in outs]

    default = run(engine)
    assert default == run(plain, exit_threshold=0.3)
    assert min(d for _, hist in default for d in hist) < depth  # the default exits early
    assert run(engine, exit_threshold=3e-2) == run(plain, exit_threshold=3e-2) != default
    full = run(plain)
    assert all(hist == {} for _, hist in full)  # no option, no request field: no early exit
    assert [t for t, _ in run(engine, exit_at_step=depth)] == [t for t, _ in full]
    for bad in (0, -1.0, float("inf"), "high", True):
        with pytest.raises(ValueError, match="adapter option exit_threshold="):
            huginn(exit_threshold=bad)
    speculative = LoopedSpecEngine(huginn(exit_threshold=0.3), speculation="2,1")
    assert run(speculative) == default  # the default's KL rule: those requests run K = 0 inside the rounds


# ----- batches, preemption and the API -----
def mixed_params(family: str) -> list[SamplingParams]:
    """Requests with different rules side by side (and one without early exit)."""
    depth = load(family).full_depth
    fixed = [SamplingParams(exit_at_step=1), SamplingParams()]
    rule = {"ouro": [0.4, 0.8], "huginn": [3e-2, 0.3]}.get(family, [])
    rules = [SamplingParams(exit_threshold=t) for t in rule] or [SamplingParams(exit_at_step=max(1, depth - 1))]
    return [p.model_copy(update={"max_tokens": 9, "ignore_eos": True, "seed": 3}) for p in fixed + rules]


def record_logits(engine) -> dict[str, list[torch.Tensor]]:
    """Logits each request's tokens were drawn from, in order, by request id (prefill and decode)."""
    seen: dict[str, list[torch.Tensor]] = {}
    runner = engine.runner
    prefill, decode = runner.prefill_with_depths, runner.decode_with_depths

    def record_prefill(requests, chunk_lens):
        logits, depths = prefill(requests, chunk_lens)
        for i, (r, n) in enumerate(zip(requests, chunk_lens)):
            if r.num_computed + n == r.num_tokens:
                seen.setdefault(r.request_id, []).append(logits[i].clone())
        return logits, depths

    def record_decode(requests):
        logits, depths = decode(requests)
        for i, r in enumerate(requests):
            seen.setdefault(r.request_id, []).append(logits[i].clone())
        return logits, depths

    runner.prefill_with_depths, runner.decode_with_depths = record_prefill, record_decode
    return seen


@pytest.mark.parametrize("mode", ["skip", "select"])
@pytest.mark.parametrize("family", FAMILIES)
def test_batched_and_preempted_equal_alone(family, mode):
    """Rows leaving a pass early, and a request recomputed after preemption (it redoes its recorded exit
    depths), give what the request gives alone: the same tokens from the same logits."""
    adapter, ref = load(family), reference(family)
    params = mixed_params(family)
    prompts = [ref["prompts"][i % len(ref["prompts"])] for i in range(len(params))]
    alone = LoopedSpecEngine(adapter, speculation="off", early_exit=mode)
    alone_logits = record_logits(alone)
    want = [alone.generate([p], sp)[0].token_ids for p, sp in zip(prompts, params)]
    want_logits = [alone_logits[str(i)] for i in range(len(params))]
    batched = LoopedSpecEngine(adapter, speculation="off", early_exit=mode, max_batch_size=4)
    assert [o.token_ids for o in batched.generate(prompts, params)] == want
    # blocks of 4 tokens: the requests (up to 13 + 9 tokens) cannot all stay
    tight = LoopedSpecEngine(
        adapter,
        speculation="off",
        early_exit=mode,
        max_batch_size=4,
        block_size=4,
        num_kv_blocks=4 * len(params) - 2,
        max_model_len=22,
    )
    tight_logits = record_logits(tight)
    outs = tight.generate(prompts, params)
    preempted = [o.metrics.num_preemptions > 0 and len(o.token_ids) for o in outs]
    assert any(preempted)
    assert [o.token_ids for o in outs] == want
    for out, want_row in zip(outs, want_logits):
        got = tight_logits[out.request_id]
        assert len(got) == len(want_row)
        for a, b in zip(got, want_row):
            assert (a - b).abs().max() <= 1e-4 * (1 + b.abs().max())
    assert tight.num_free_blocks == tight.kv.num_blocks


def test_exit_parameters_are_validated_naming_the_field():
    from pydantic import ValidationError

    for bad in ({"exit_threshold": 0.0}, {"exit_threshold": float("nan")}, {"exit_at_step": 0}):
        with pytest.raises(ValidationError, match=next(iter(bad))):
            SamplingParams(**bad)
    with pytest.raises(ValidationError, match="exit_threshold.*exit_at_step"):
        SamplingParams(exit_threshold=0.5, exit_at_step=2)
    with pytest.raises(ValueError, match="early_exit"):
        LoopedSpecEngine(load("ouro"), speculation="off", early_exit="sometimes")
    engine = LoopedSpecEngine(load("nanbeige"), speculation="off")
    with pytest.raises(ValueError, match="exit_threshold=0.5: nanbeige has no exit signal"):
        engine.add_request([1, 2], SamplingParams(exit_threshold=0.5))
    with pytest.raises(ValueError, match="exit_at_step=3 exceeds the model's 2 loops"):
        engine.add_request([1, 2], SamplingParams(exit_at_step=3))
    assert not engine.has_unfinished_requests()
    ouro = LoopedSpecEngine(load("ouro"), speculation="off")  # tau is a cumulative exit probability
    with pytest.raises(ValueError, match=r"exit_threshold=1.5: ouro's exit rule reads a threshold of at most 1.0"):
        ouro.add_request([1, 2], SamplingParams(exit_threshold=1.5))
    ouro.add_request([1, 2], SamplingParams(exit_threshold=1.0, max_tokens=2))  # 1.0: never before D
    with pytest.raises(ValueError, match=r"speculation: d=1 with k=0: plain decoding drafts nothing"):
        LoopedSpecEngine(load("ouro"), speculation="0,1")


@pytest.mark.parametrize("speculation", ["adaptive", "2,1"])
def test_early_exit_with_speculation_is_accepted(speculation):
    """Speculation combines with early exit (test_early_exit_speculative.py checks it is exact)."""
    engine = LoopedSpecEngine(load("ouro"), speculation=speculation)
    plain = LoopedSpecEngine(load("ouro"), speculation="off")
    for params in (SamplingParams(exit_threshold=0.5), SamplingParams(exit_at_step=2)):
        params = params.model_copy(update={"max_tokens": 6, "ignore_eos": True})
        assert engine.generate([[1, 2, 3]], params)[0].token_ids == plain.generate([[1, 2, 3]], params)[0].token_ids


def test_exit_stats():
    adapter = load("ouro")
    engine = LoopedSpecEngine(adapter, speculation="off", early_exit="skip")
    out = engine.generate([[4, 5, 6]], SamplingParams(max_tokens=8, ignore_eos=True, exit_at_step=2))[0]
    assert out.metrics.exit_depth_histogram == {2: 8}
    assert out.metrics.mean_exit_depth == 2.0
    stats = engine.stats.to_dict()
    assert stats["exit_depth_histogram"] == {2: 8}
    # the first token comes from the prompt's last position, which ran every loop; the 7 others ran 2
    depth = adapter.full_depth
    assert stats["mean_loops_per_token"] == (depth + 7 * 2) / 8
    assert stats["num_exit_loops_saved"] == 7 * (depth - 2)
    # Prometheus: a bucket per depth (1..D with full_depth, else up to the deepest seen), loops run and saved
    for full_depth, bounds in ((depth, range(1, depth + 1)), (None, range(1, 3))):
        samples = {
            (s.name, s.labels.get("le")): s.value
            for family in text_string_to_metric_families(engine.stats.to_prometheus("m", full_depth))
            if family.name.startswith("looped_spec:exit_")
            for s in family.samples
        }
        buckets = {le: v for (name, le), v in samples.items() if name == "looped_spec:exit_depth_bucket"}
        assert buckets == {**{str(b): 8 * (b >= 2) for b in bounds}, "+Inf": 8}
        assert samples[("looped_spec:exit_depth_sum", None)] == 16
        assert samples[("looped_spec:exit_loops_run_total", None)] == depth + 7 * 2
        assert samples[("looped_spec:exit_loops_saved_total", None)] == 7 * (depth - 2)
    select = LoopedSpecEngine(adapter, speculation="off", early_exit="select")
    select.generate([[4, 5, 6]], SamplingParams(max_tokens=8, ignore_eos=True, exit_at_step=2))
    assert select.stats.num_exit_loops_saved == 0 and select.stats.mean_loops_per_token == depth


def test_cli_generate_exit_flags(capsys):
    from looped_spec.cli import main

    argv = ["generate", "--model", "tiny-ouro", "--prompt", "def ", "--max-tokens", "6", "--ignore-eos"]
    assert main([*argv, "--exit-at-step", "2", "--early-exit", "select", "--speculation", "off"]) == 0
    out = capsys.readouterr().out
    assert "exit depths (select; depth: tokens)  2: 6" in out and "speculation" in out and " off" in out
    plain_text = out.split("---")[0]
    assert main([*argv, "--exit-at-step", "2", "--early-exit", "select", "--speculation", "2,1"]) == 0
    out = capsys.readouterr().out  # speculation with early exit: the same text and depths
    assert out.split("---")[0] == plain_text and "exit depths (select; depth: tokens)  2: 6" in out
    assert "decode rounds" in out and "speculative)" in out
    assert main([*argv, "--exit-at-step", "9"]) == 2
    assert "--exit-at-step 9 exceeds the model's 4 loops" in capsys.readouterr().err


# ----- fewer calls, the same decisions -----
def test_huginn_kl_rule_never_fires_before_a_previous_distribution_exists():
    """The KL rule's carry before step 1 (`exit_carry`) holds no distribution: no threshold fires there, so rows at
    step 1 share a rule call with deeper rows; from its returned carry the same state has KL 0 and fires."""
    from conftest import fixture_dir

    from looped_spec import load_adapter

    adapter = load_adapter(fixture_dir("huginn"), initial_state="zeros", exit_criterion="kl")
    state = torch.randn(1, adapter.state_dim, generator=torch.Generator().manual_seed(0))
    threshold = torch.full((1,), 1e30)
    store: dict = {}  # the token's coda KV: the second readout of the same state overwrites it with the same
    fired, carry, logits = adapter.exit_rule(
        state, 1, state, adapter.exit_carry(1), threshold, TokenContext(store, 0, 0)
    )
    assert not fired.any() and carry.shape == (1, adapter.vocab_size) and torch.isfinite(carry).all()
    # the rule hands out the readout it made (the engine uses it for a token that exits here in skip mode)
    torch.testing.assert_close(logits, adapter.readout(state, 1, TokenContext(store, 0, 0)))
    fired, _, _ = adapter.exit_rule(state, 2, state, carry, threshold, TokenContext(store, 0, 0))
    assert fired.all()


def test_huginn_kl_rule_measures_the_divergence_the_reference_measures():
    """The Huginn authors' KL criterion is `F.kl_div(log_probs, prev_log_probs, log_target=True)`: KL(p_{s-1} || p_s),
    the previous step's distribution as the target. KL is not symmetric, so at a threshold just below or just above
    that value the rule must agree with it (the other direction differs here by about 1 %)."""
    from conftest import fixture_dir

    from looped_spec import load_adapter
    from looped_spec.models.dense import DenseContext

    adapter = load_adapter(fixture_dir("huginn"), initial_state="zeros", exit_criterion="kl")
    prompt = reference("huginn")["prompts"][1]
    ctx = DenseContext(1, len(prompt), torch.arange(len(prompt)))
    state, carry, prev_log_probs = adapter.embed(torch.tensor(prompt), ctx), adapter.exit_carry(len(prompt)), None
    for depth in range(1, adapter.full_depth):
        state = adapter.loop(state, depth - 1, ctx)
        log_probs = F.log_softmax(adapter.readout(state, depth, ctx), -1)
        if prev_log_probs is not None:
            kl = F.kl_div(log_probs, prev_log_probs, reduction="none", log_target=True).sum(-1)
            below, _, _ = adapter.exit_rule(state, depth, None, carry, kl * (1 - 1e-3), ctx)
            above, _, _ = adapter.exit_rule(state, depth, None, carry, kl * (1 + 1e-3), ctx)
            assert not below.any() and above.all(), depth
        _, carry, _ = adapter.exit_rule(state, depth, None, carry, torch.zeros(len(prompt)), ctx)
        prev_log_probs = log_probs


@pytest.mark.parametrize("uniform_loops, calls", [(True, 1), (False, 3)])
def test_tokens_exiting_at_different_depths_are_read_out_in_one_call_when_the_readout_ignores_depth(
    uniform_loops, calls
):
    from types import SimpleNamespace

    adapter = load("ouro")
    seen = []

    def readout(state, depth, ctx):
        seen.append(depth)
        return adapter.readout(state, depth, ctx)

    runner = SimpleNamespace(adapter=SimpleNamespace(uniform_loops=uniform_loops, readout_uses_kv=False),
                             readout=readout)  # fmt: skip
    assert type(adapter).uniform_loops  # the shipped families' readouts ignore the depth
    from looped_spec.execution.early_exit import read_out_by_depth

    states = torch.randn(4, adapter.state_dim, generator=torch.Generator().manual_seed(1))
    depths = [1, 3, 1, 4]
    logits = read_out_by_depth(runner, [None] * 4, [0] * 4, [1] * 4, states, depths, None)
    assert len(seen) == calls
    torch.testing.assert_close(logits, adapter.readout(states, 4, None))


@pytest.mark.parametrize("batching", ["step", "loop"])
def test_a_token_the_kl_rule_exits_keeps_the_rules_readout(batching):
    """Skip mode: a token Huginn's KL rule exits after loop 2 leaves with the readout the rule made of its exit state
    (its logits, its coda KV written), so a decoded token costs the rule's two readouts and no third."""
    from conftest import fixture_dir

    from looped_spec import load_adapter

    adapter = load_adapter(fixture_dir("huginn"), initial_state="zeros", exit_criterion="kl")
    calls, readout = [], adapter.readout

    def counted(*args):
        calls.append(1)
        return readout(*args)

    adapter.readout = counted
    engine = LoopedSpecEngine(adapter, speculation="off", batching=batching)
    counts = []
    for tokens in (2, 6):  # the difference is four decoded tokens' readouts (the first token comes from the prompt)
        calls.clear()
        params = SamplingParams(max_tokens=tokens, ignore_eos=True, exit_threshold=1e9)  # KL < 1e9: exits at loop 2
        out = engine.generate([[5, 9, 2, 7]], params)[0]
        assert set(out.metrics.exit_depth_histogram) == {2}
        counts.append(len(calls))
    assert counts[1] - counts[0] == 4 * 2
