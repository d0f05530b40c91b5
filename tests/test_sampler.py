"""The sampling distribution after temperature, top-k, top-p and min-p, against transformers' logits warpers (HF's
meaning, which generation_config.json and the server's fields follow; vLLM applies top-k and top-p in this order too,
min-p before them)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from looped_spec import SamplingParams
from looped_spec.execution.sampler import SamplingRows, probabilities, sample, sample_from


def rows_of(temperature: float, top_k: int, top_p: float, count: int, min_p: float = 0.0) -> SamplingRows:
    return SamplingRows(
        requests=[None] * count,
        temperature=torch.full((count,), temperature),
        top_k=torch.full((count,), top_k, dtype=torch.long),
        top_p=torch.full((count,), top_p),
        greedy=torch.zeros(count, dtype=torch.bool),
        all_greedy=False,
        needs_filter=top_k > 0 or top_p < 1.0,
        min_p=torch.full((count,), min_p) if min_p > 0.0 else None,
    )


def reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """HF's warpers in the order `generate` applies them."""
    scores = TemperatureLogitsWarper(temperature)(None, logits.double())
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    if min_p > 0.0:
        scores = MinPLogitsWarper(min_p)(None, scores)
    return scores.softmax(-1)


def test_top_p_measures_what_top_k_kept():
    """[.4, .3, .2, .1] with top_k=2: [4/7, 3/7]; its first token alone reaches top_p=0.5, so it alone is kept."""
    logits = torch.tensor([[0.4, 0.3, 0.2, 0.1]]).log()
    probs = probabilities(logits, rows_of(1.0, 2, 0.5, 1))
    assert probs.tolist() == [[1.0, 0.0, 0.0, 0.0]]


def test_top_p_keeps_the_smallest_set_whose_mass_reaches_it_exactly():
    """Four equally likely tokens at top_p 0.5: the first two reach it exactly, so those two are kept, as HF's
    TopPLogitsWarper keeps them (not a third)."""
    logits = torch.zeros(1, 4)
    got = probabilities(logits, rows_of(1.0, 0, 0.5, 1))
    assert sorted(got[0].tolist()) == [0.0, 0.0, 0.5, 0.5]
    assert int((reference(logits, 1.0, 0, 0.5) > 0).sum()) == 2


def test_a_draw_at_either_end_of_the_uniform_range_takes_a_token_with_mass():
    """Inverse CDF: token i takes the uniforms in [cdf[i-1], cdf[i]), so u = 0 picks the first token with mass and the
    largest uniform below 1 the last one, never a zero-probability token around them."""
    probs = torch.tensor([[0.0, 1.0, 2.0, 0.0]])
    assert sample_from(probs, torch.tensor([0.0])).tolist() == [1]
    assert sample_from(probs, torch.tensor([1.0 - 2**-24])).tolist() == [2]


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [
        (1.0, 0, 0.9, 0.0), (0.7, 20, 1.0, 0.0), (0.6, 50, 0.9, 0.0), (1.3, 8, 0.5, 0.0), (0.9, 3, 0.95, 0.0),
        (1.0, 1, 0.3, 0.0), (2.0, 100, 0.2, 0.0), (1.0, 0, 1.0, 0.1), (1.5, 0, 1.0, 0.02), (0.8, 40, 0.95, 0.05),
        (1.0, 0, 0.9, 0.3), (1.0, 0, 1.0, 1.0),
    ],
)  # fmt: skip
def test_the_distribution_is_hfs(temperature, top_k, top_p, min_p):
    generator = torch.Generator().manual_seed(top_k)
    logits = torch.randn(16, 257, generator=generator) * 3.0
    got = probabilities(logits, rows_of(temperature, top_k, top_p, 16, min_p)).double()
    want = reference(logits, temperature, top_k, top_p, min_p)
    assert ((got > 0) == (want > 0)).all(), "a different set of tokens kept"
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_top_k_keeps_every_token_tied_with_the_kth_as_hf_does():
    """bf16 logits tie often: HF's TopKLogitsWarper (and vLLM) keep every token tied with the k-th, not the first k the
    sort happens to put there; a top_k above the vocabulary keeps it all."""
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0]])
    assert (probabilities(logits, rows_of(1.0, 2, 1.0, 1)) > 0).tolist() == [[True, True, True, False]]
    bf16 = (torch.randn(16, 4000, generator=torch.Generator().manual_seed(0)) * 3.0).bfloat16().float()
    for top_k in (50, 4000, 10**6):
        got = probabilities(bf16, rows_of(1.0, top_k, 1.0, 16)).double()
        want = reference(bf16, 1.0, min(top_k, 4000), 1.0)
        assert ((got > 0) == (want > 0)).all(), f"top_k={top_k}: a different set of tokens kept"
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_row_at_top_p_one_keeps_the_whole_vocabulary_beside_rows_that_filter():
    """top_p 1 is off: the fp32 running mass rounds to 1 before the vocabulary's tail, which must stay all the same
    (else a row's distribution depends on whether another row of its batch filters)."""
    logits = torch.randn(16, 4000, generator=torch.Generator().manual_seed(0)) * 3.0
    rows = rows_of(1.0, 0, 1.0, 16)
    rows.top_p = torch.tensor([1.0, 0.9] * 8)
    rows.needs_filter = True
    got = probabilities(logits, rows)[::2].double()
    assert (got > 0).all()
    torch.testing.assert_close(got, logits[::2].double().softmax(-1), rtol=1e-5, atol=1e-6)


def test_min_p_rows_mix_with_rows_without_it():
    """Rows of one batch each keep their own min_p (0: off)."""
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(3)) * 2.0
    rows = rows_of(1.0, 0, 1.0, 4, 0.2)
    rows.min_p = torch.tensor([0.0, 0.2, 0.0, 0.5])
    rows.needs_filter = False
    got = probabilities(logits, rows).double()
    for i, min_p in enumerate([0.0, 0.2, 0.0, 0.5]):
        torch.testing.assert_close(got[i], reference(logits[i : i + 1], 1.0, 0, 1.0, min_p)[0], rtol=1e-5, atol=1e-6)


def test_logit_bias_is_added_before_every_filter_and_to_greedy_rows():
    from types import SimpleNamespace

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(5))
    plain = SimpleNamespace(greedy=True, logit_bias={}, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, penalized=False,
                            num_output_tokens=0, min_tokens=0, stop_id_list=[0], grammar=None,
                            allowed_ids=None, bad_words=None)  # fmt: skip
    banned = logits[0].argmax().item()
    requests = [
        SimpleNamespace(**(vars(plain) | {"logit_bias": {banned: -100.0}})),  # greedy, its argmax all but banned
        SimpleNamespace(**(vars(plain) | {"greedy": False, "temperature": 0.8, "top_k": 5, "logit_bias": {7: 100.0}})),
        plain,
    ]
    rows = SamplingRows.build(requests, torch.device("cpu"))
    biased = logits.clone()
    biased[0, banned] -= 100.0
    biased[1, 7] += 100.0
    torch.testing.assert_close(rows.adjusted(logits), biased)
    probs = probabilities(logits, rows)
    assert probs[0].argmax().item() == biased[0].argmax().item() != banned
    torch.testing.assert_close(probs[1].double(), reference(biased[1:2], 0.8, 5, 1.0)[0], rtol=1e-5, atol=1e-6)
    assert probs[2].argmax().item() == logits[2].argmax().item()


def test_logit_bias_parameters_round_trip_through_json_and_name_the_field():
    from pydantic import ValidationError

    from looped_spec import SamplingParams

    params = SamplingParams(logit_bias={5: 1.5, 7: -100.0}, min_p=0.1)
    assert SamplingParams.model_validate_json(params.model_dump_json()) == params  # JSON's keys are strings
    for bad in ({"x": 1.0}, {True: 1.0}, {5: 101.0}, {-1: 1.0}, {5: "1"}, {5: float("nan")}):
        with pytest.raises(ValidationError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


def penalty_request(prompt, output, repetition=1.0, presence=0.0, frequency=0.0):
    from types import SimpleNamespace

    return SimpleNamespace(
        token_ids=list(prompt) + list(output), num_prompt_tokens=len(prompt), repetition_penalty=repetition,
        presence_penalty=presence, frequency_penalty=frequency,
        penalized=repetition != 1.0 or presence != 0.0 or frequency != 0.0,
    )  # fmt: skip


def reference_penalties(logits, prompt, output, repetition, presence, frequency):
    """HF's repetition-penalty processor on prompt + output, then OpenAI's presence/frequency formula on the output."""
    from collections import Counter

    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    scores = logits.double()[None].clone()
    if repetition != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(repetition)(torch.tensor([list(prompt) + list(output)]), scores)
    for token, count in Counter(output).items():
        scores[0, token] -= presence + frequency * count
    return scores[0]


@pytest.mark.parametrize(
    "repetition, presence, frequency", [(1.3, 0.0, 0.0), (0.8, 0.0, 0.0), (1.0, 1.2, 0.0), (1.0, 0.0, 0.7),
                                        (1.5, -0.5, 0.4), (1.0, 0.0, -2.0)],
)  # fmt: skip
def test_penalties_are_hfs_repetition_penalty_and_openais_presence_and_frequency(repetition, presence, frequency):
    """Rows of one batch: a penalised one whose drafts count as output, one without drafts, one not penalised."""
    from looped_spec.execution.penalties import PenaltyRows

    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(11)) * 3.0
    prompt, output, drafts = [1, 2, 3, 2], [5, 6, 5, 30], [6, 9]
    requests = [
        penalty_request(prompt, output, repetition, presence, frequency),
        penalty_request([4], [4, 4, 7], repetition, presence, frequency),
        penalty_request(prompt, output),
    ]
    rows = PenaltyRows.build(requests, [drafts, [], [1, 2]])
    got = rows.apply(logits).double()
    want = [
        reference_penalties(logits[0], prompt, output + drafts, repetition, presence, frequency),
        reference_penalties(logits[1], [4], [4, 4, 7], repetition, presence, frequency),
        logits[2].double(),
    ]
    torch.testing.assert_close(got, torch.stack(want), rtol=1e-5, atol=1e-5)
    assert PenaltyRows.build([requests[2]], None) is None  # nothing to do where no row is penalised


def test_bad_keys_and_penalties_are_refused_naming_the_field():
    """Keys must name a token one way only (ASCII digits, no leading zero); a repetition penalty so small that fp32
    logits divided by it overflow is refused."""
    from pydantic import ValidationError

    from looped_spec import SamplingParams

    assert SamplingParams(logit_bias={"0": 1.0, "12": 2.0}).logit_bias == {0: 1.0, 12: 2.0}
    for bad in ({"05": 1.0}, {"١٢": 1.0}, {"²": 1.0}, {"": 1.0}, {5: 1.0, "5": 2.0}):
        with pytest.raises(ValidationError, match="logit_bias"):
            SamplingParams(logit_bias=bad)
    for bad in (1e-300, 1e-40, 0.0, 0.001):
        with pytest.raises(ValidationError, match="repetition_penalty"):
            SamplingParams(repetition_penalty=bad)


def test_a_temperature_fp32_cannot_hold_is_refused_and_one_it_can_keeps_to_the_masks():
    """Above fp32's largest value the sampler's temperature was inf: every logit / inf is 0 and a masked one (-inf)
    NaN, so a request drew token 0 outside its allowed_token_ids, every time. A temperature within fp32's range
    draws its allowed tokens, all of them alike."""
    from conftest import make_engine
    from pydantic import ValidationError

    from looped_spec import SamplingParams

    for bad in (1e39, 1e300):
        with pytest.raises(ValidationError, match="temperature"):
            SamplingParams(temperature=bad)
    allowed = [3, 5, 7]
    params = SamplingParams(max_tokens=30, temperature=3.4e38, allowed_token_ids=allowed, seed=1, ignore_eos=True)
    out = make_engine("ouro").generate([5, 9, 13], params)[0]
    assert set(out.token_ids) == set(allowed)


def test_a_seed_of_minus_one_is_no_seed_as_vllm_reads_it():
    """vLLM's SamplingParams reads seed=-1 as None (clients send it for "random"): it was an error naming seed here.
    Other negative seeds, and -1 as a bool or float, stay errors."""
    from pydantic import ValidationError

    from looped_spec import SamplingParams

    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=0).seed == 0
    for bad in (-2, -1.0):
        with pytest.raises(ValidationError, match="seed"):
            SamplingParams(seed=bad)


VOCAB, EOS = 12, 11


def vllm_adjusted(logits, params, prompt, output, words):
    """vLLM's `Sampler.apply_logits_processors` in float64, from its definitions: allowed_token_ids, bad_words (a
    word's last token where the output before the position ends with its other tokens), min_tokens (the stop tokens
    and the eos, ignore_eos or not), logit_bias, then the repetition penalty (prompt and output), frequency and
    presence (output only)."""
    from collections import Counter

    x = logits.double().clone()
    if params.allowed_token_ids is not None:
        outside = torch.ones(VOCAB, dtype=torch.bool)
        outside[params.allowed_token_ids] = False
        x[outside] = float("-inf")
    for word in words:
        if len(word) == 1 or list(output[len(output) - len(word) + 1 :]) == list(word[:-1]):
            x[word[-1]] = float("-inf")
    if len(output) < params.min_tokens:
        x[[*params.stop_token_ids, EOS]] = float("-inf")
    for token, value in params.logit_bias.items():
        x[token] += value
    counts = Counter(output)
    for token in set(prompt) | set(output):
        x[token] = x[token] / params.repetition_penalty if x[token] > 0 else x[token] * params.repetition_penalty
    for token, count in counts.items():
        x[token] -= params.frequency_penalty * count + params.presence_penalty
    return x


def random_params(rng):
    fields = {}
    if rng.random() < 0.8:  # else greedy, the default
        fields["temperature"] = rng.choice([1e-6, 0.3, 0.7, 1.0, 1.5, 3.0])  # below 1e-5: greedy, as vLLM's eps
        if rng.random() < 0.5:
            fields["top_k"] = rng.choice([-1, 0, 1, 2, 3, 5, VOCAB - 1, VOCAB, 50])
        if rng.random() < 0.5:
            fields["top_p"] = rng.choice([0.1, 0.5, 0.8, 0.95, 1.0])
        if rng.random() < 0.4:
            fields["min_p"] = rng.choice([0.0, 0.05, 0.2, 0.5, 1.0])
    if rng.random() < 0.5:
        fields["repetition_penalty"] = rng.choice([0.5, 0.9, 1.0, 1.3, 2.0])
    for name in ("presence_penalty", "frequency_penalty"):
        if rng.random() < 0.5:
            fields[name] = rng.uniform(-2.0, 2.0)
    if rng.random() < 0.3:
        fields["logit_bias"] = {rng.randrange(VOCAB): rng.uniform(-100.0, 100.0) for _ in range(rng.randint(1, 3))}
    if rng.random() < 0.3:
        fields["allowed_token_ids"] = rng.sample(range(VOCAB - 1), rng.randint(4, 7))
    if rng.random() < 0.3:
        fields["stop_token_ids"] = rng.sample(range(VOCAB - 1), rng.randint(1, 2))
    fields["ignore_eos"] = rng.random() < 0.2
    if rng.random() < 0.3:
        fields["min_tokens"] = rng.randint(1, 8)
    return SamplingParams(max_tokens=16, **fields)


def test_random_requests_sample_from_vllms_adjusted_logits_through_hfs_warpers():
    """Seeded random batches of real requests (prompt, output and the drafts before the position, bad words of one to
    three tokens) with every adjustment and warper at random, against an independent reference: vLLM's adjustments
    (`vllm_adjusted`), then greedy (temperature below 1e-5) or temperature, top-k, top-p and min-p as HF's warpers
    (the order documented; vLLM applies min_p before top-k and top-p). Logits are continuous or on a 0.5 grid (ties
    at the top-k, top-p and min-p boundaries): where top-p cuts inside a tie, which of the tied tokens stay is the
    sort's choice, so those rows compare the distribution's values only."""
    import random

    from looped_spec.request import Request

    rng, generator = random.Random(0), torch.Generator().manual_seed(0)
    compared = 0
    for case in range(300):
        requests, expected, tied = [], [], []
        ties = case % 2 == 1
        logits = torch.randn(rng.randint(1, 4), VOCAB, generator=generator) * 3.0
        if ties:
            logits = (logits * 2.0).round() / 2.0
        drafted = []
        for row in logits:
            params = random_params(rng)
            prompt = [rng.randrange(VOCAB - 1) for _ in range(rng.randint(1, 6))]
            output = [rng.randrange(VOCAB - 1) for _ in range(rng.randint(0, 6))]
            drafts = [rng.randrange(VOCAB - 1) for _ in range(rng.randint(0, 3))]
            words = []
            if rng.random() < 0.3:
                words = [tuple(rng.randrange(VOCAB - 1) for _ in range(rng.randint(1, 3))) for _ in range(2)]
            request = Request("r", 0, prompt, params, case, [EOS], 4096, bad_words=words)
            request.token_ids += output
            requests.append(request)
            drafted.append(drafts)
            x = vllm_adjusted(row, params, prompt, output + drafts, words)
            assert not torch.isneginf(x).all()
            if params.temperature < 1e-5:
                want = torch.zeros(VOCAB, dtype=torch.float64)
                want[x.argmax()] = 1.0
            else:
                want = reference(x[None], params.temperature, max(params.top_k, 0), params.top_p, params.min_p)[0]
            expected.append(want)
            tied.append(ties and params.top_p < 1.0)
        rows = SamplingRows.build(requests, torch.device("cpu"), drafted)
        if rows.all_greedy:
            got = torch.nn.functional.one_hot(rows.adjusted(logits).argmax(-1), VOCAB).double()
        else:
            got = probabilities(logits, rows).double()
        drawn = sample(logits, rows)
        for i, want in enumerate(expected):
            assert got[i, drawn[i]] > 0, f"case {case} row {i}: drew a token the distribution excludes"
            if tied[i]:
                torch.testing.assert_close(got[i].sort().values, want.sort().values, rtol=1e-4, atol=1e-6)
            else:
                # kept: where the reference keeps a token (fp32 rounds a probability below 1e-38 to 0), nowhere else
                kept = f"case {case} row {i}: a different set of tokens kept"
                assert not ((got[i] > 0) & (want == 0)).any() and not ((got[i] == 0) & (want > 1e-30)).any(), kept
                torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-6, msg=f"case {case} row {i}")
            compared += 1
    assert compared > 600
