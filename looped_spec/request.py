"""A request's live state on the hot path (plain Python, no pydantic) and its user-facing output."""

from __future__ import annotations

import enum
import functools
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from looped_spec.detokenizer import IncrementalDetokenizer
from looped_spec.sampling_params import GREEDY_TEMPERATURE, SamplingParams
from looped_spec.structured_output import Grammar

logger = logging.getLogger(__name__)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class Logprob:
    """vLLM's `Logprob`: a token's log-probability at a position, its rank there (1: the most likely) and its text
    (`decoded_token`: as the server's log-probabilities show it, token_bytes.py; None without a tokenizer)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass(frozen=True)
class TokenLogprob(Mapping):
    """One token's log-probability given the tokens before it (`logprob`, its `rank` among the vocabulary: 1 + the
    tokens at least as likely besides it), and the `top` most likely tokens there.

    It also reads as vLLM's entry of a position, a dict token id -> `Logprob` holding the token and the top ones (the
    top ones ranked 1, 2, ...), so code written for vLLM's `logprobs[i][token_id].logprob` runs on it."""

    token: int
    logprob: float
    top: list[tuple[int, float]]
    rank: int | None = None
    # the texts of the token and of the top ones, in order (the Logprobs' `decoded_token`); None without a tokenizer.
    # Derived from the ids: not compared
    texts: tuple[str, ...] | None = field(default=None, compare=False, repr=False)

    @functools.cached_property
    def _entries(self) -> dict[int, Logprob]:
        # the token first, then the top ones (a token among them takes its rank there), as vLLM builds the dict; built
        # once, on first reading (`for t in entry: entry[t]` reads it 1 + N times)
        texts = self.texts or (None,) * (len(self.top) + 1)
        entries = {self.token: Logprob(self.logprob, self.rank, texts[0])}
        entries.update((token, Logprob(value, i + 1, texts[i + 1])) for i, (token, value) in enumerate(self.top))
        return entries

    def __getitem__(self, token_id: int) -> Logprob:
        return self._entries[token_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)


@dataclass
class RequestMetrics:
    """Per-request speculation counters."""

    rounds: int = 0
    num_draft_tokens: int = 0  # proposed
    # accepted by the verifier (as vLLM counts them): a stop that ends the request inside a round does not take back
    # the drafts accepted after it, so 1 + accepted per round may exceed the tokens the request kept
    num_accepted_tokens: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache when it was first admitted
    exit_depth_histogram: dict[int, int] = field(default_factory=dict)  # readout depth -> generated tokens
    arrival_time: float = 0.0  # time.perf_counter() at add_request
    first_token_time: float | None = None  # ... when its first generated token was committed
    last_token_time: float | None = None  # ... when its latest one was

    @property
    def mean_exit_depth(self) -> float:
        """Mean loop depth the generated tokens were read out at, for a request that exits early (0.0 for one that runs
        every token at full depth: no histogram is kept for it)."""
        total = sum(self.exit_depth_histogram.values())
        return sum(d * n for d, n in self.exit_depth_histogram.items()) / total if total else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Drafts the verifier accepted ÷ drafts proposed (0.0 before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """1 + accepted drafts per decode round, plain rounds included: the tokens a round commits unless a stop ends
        the request inside it. vLLM's mean acceptance length counts only the rounds that drafted: the two agree when
        every round drafts (a fixed plan, but for a last round left no room to draft), and this one is lower where
        adaptive speculation also ran plain rounds."""
        return (self.rounds + self.num_accepted_tokens) / self.rounds if self.rounds else 0.0


class BadWords:
    """A request's bad_words as token sequences (engine/inputs.py `bad_word_token_ids`, vLLM's encoding): the last
    token of each is masked at a position whose output before it ends with the others, a one-token word's
    everywhere. As in vLLM, only output tokens count (the drafts before the position among them), never the prompt."""

    def __init__(self, sequences: Sequence[Sequence[int]]) -> None:
        unique = sorted({tuple(s) for s in sequences})
        self.sequences = unique
        self.single = sorted({s[0] for s in unique if len(s) == 1})  # masked at every position
        self.phrases = [(s[:-1], s[-1]) for s in unique if len(s) > 1]  # (prefix, last token)
        self.longest = max((len(prefix) for prefix, _ in self.phrases), default=0)

    def completing(self, output: Sequence[int], drafted: Sequence[int] = ()) -> list[int]:
        """The last tokens of the words of several tokens whose prefix the output before the position ends with."""
        if not self.phrases:
            return []
        n = self.longest
        tail = tuple(list(output[-n:]) + list(drafted))[-n:]
        return sorted({last for prefix, last in self.phrases
                       if len(prefix) <= len(tail) and tail[len(tail) - len(prefix) :] == prefix})  # fmt: skip


@dataclass(frozen=True)
class CompletionOutput:
    """vLLM's view of a request's one output (`RequestOutput.outputs[0]`): its index, text, token ids, the sum of its
    tokens' log-probabilities (with `logprobs`, else None), the per-token log-probabilities, and why it finished."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    stop_reason: str | int | None

    def finished(self) -> bool:
        """Whether the output is complete (vLLM's `CompletionOutput.finished()`)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """What `generate` / `step` return for a request.

    `token_ids` / `text` are the whole output (`text` once finished, cut before a stop string);
    `new_token_ids` / `new_text` are what this output adds to the previous one of the same request,
    for streaming (`new_text` never splits a character, nor sends text a stop string may still cut).
    `outputs` holds the same as vLLM's RequestOutput does (one CompletionOutput: one output per request here).
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None  # "length" | "stop" | "abort" | "error" | None while running
    finished: bool
    metrics: RequestMetrics
    prompt: str | None = None  # the prompt text, when the request was given text
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    # what ended a stopped request: the stop string, or the stop_token_ids token (vLLM's; None for an eos)
    stop_reason: str | int | None = None
    error: str | None = None  # with finish_reason "error": what went wrong
    # with SamplingParams.logprobs: one entry per token of `token_ids` (the last len(new_token_ids) are new)
    logprobs: list[TokenLogprob] | None = None
    # with SamplingParams.prompt_logprobs: one entry per prompt token (the first None)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # the text streamed so far: every `new_text` up to and including this output's (`text` once finished)
    text_so_far: str = ""

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens whose KV came from the prefix cache (vLLM's field; `metrics.num_cached_tokens`)."""
        return self.metrics.num_cached_tokens

    @property
    def outputs(self) -> list[CompletionOutput]:
        """[the output as vLLM's CompletionOutput], so code written for vLLM's `output.outputs[0].text` runs. Its
        text is `text` once the request finished, before that the text streamed so far (vLLM's cumulative output)."""
        text = self.text if self.text is not None else self.text_so_far
        cumulative = sum(entry.logprob for entry in self.logprobs) if self.logprobs is not None else None
        return [CompletionOutput(0, text, self.token_ids, cumulative, self.logprobs, self.finish_reason,
                                 self.stop_reason)]  # fmt: skip


class Request:
    """Mutable state of one request. `num_computed` tokens have KV in every plane of the cache."""

    def __init__(
        self,
        request_id: str,
        arrival: int,
        prompt: list[int],
        params: SamplingParams,
        seed: int,
        eos_token_ids: list[int],
        max_model_len: int,
        detokenizer: IncrementalDetokenizer | None = None,
        prompt_text: str | None = None,
        grammar: Grammar | None = None,
        bad_words: Sequence[Sequence[int]] = (),
    ) -> None:
        self.request_id = request_id
        self.arrival = arrival  # admission order: preemption takes the latest arrival first
        self.priority = 0  # lower is served first under scheduling_policy="priority" (0 under "fcfs")
        self.token_ids: list[int] = list(prompt)
        self.num_prompt_tokens = len(prompt)
        # max_tokens None: no cap of its own, max_model_len ends it
        self.max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len
        # below GREEDY_TEMPERATURE a softmax overflows: such a temperature means greedy
        self.temperature = 0.0 if params.temperature < GREEDY_TEMPERATURE else float(params.temperature)
        self.top_k = int(params.top_k) if params.top_k > 0 else 0
        self.top_p = float(params.top_p)
        self.min_p = float(params.min_p)
        self.logit_bias: dict[int, float] = dict(params.logit_bias)
        self.repetition_penalty = float(params.repetition_penalty)
        self.presence_penalty = float(params.presence_penalty)
        self.frequency_penalty = float(params.frequency_penalty)
        # whether a penalty changes its logits (execution/penalties.py)
        self.penalized = self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        self.eos_ids = frozenset(eos_token_ids)
        self.ignore_eos = params.ignore_eos  # an eos then stops the request only as one of its stop_token_ids
        self.stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_ids.update(eos_token_ids)
        # the first min_tokens tokens are never stop tokens (their logits are masked, execution/sampler.py) and
        # complete no stop string
        self.min_tokens = params.min_tokens
        # the tokens masked before min_tokens, sorted: the stop tokens and the eos tokens even under ignore_eos, as
        # vLLM's `_all_stop_token_ids` (its min_tokens processor masks the model's eos whatever ignore_eos says)
        self.stop_id_list = sorted(self.stop_ids | self.eos_ids)
        # structured outputs: the grammar, advanced by every committed token (structured_output.py)
        self.grammar = grammar
        # allowed_token_ids: the only tokens it may generate (the sampler masks the rest; None: any)
        self.allowed_ids = sorted(set(params.allowed_token_ids)) if params.allowed_token_ids is not None else None
        # bad_words, as the token sequences the engine encoded them to (None: none)
        self.bad_words = BadWords(bad_words) if bad_words else None
        self.max_model_len = max_model_len
        self.seed = seed
        self.generator = torch.Generator().manual_seed(seed)
        self.status = RequestStatus.WAITING
        self.num_computed = 0
        self.prefilled = False  # True once the (re)computed prefix has produced its next token
        self.block_table: list[int] = []
        # prefix caching (engine/prefix_cache.py): digests of its cacheable blocks so far (extended as it generates),
        # and how many blocks of the table are registered or came from the cache
        self.block_digests: list[bytes] | None = None
        # vLLM's cache_salt: its digests carry it, so it shares cached blocks only with requests of the same salt
        self.cache_salt: str | None = None
        self.num_registered_blocks = 0
        self.finish_reason: str | None = None
        self.error: str | None = None  # set with finish_reason "error"
        self.metrics = RequestMetrics()
        self.num_emitted = 0  # output tokens already reported by step()
        self.prompt_text = prompt_text
        self.detokenizer = detokenizer  # None without a tokenizer; checks `params.stop` strings
        self.decode_failed = False  # its text could not be decoded once (warned of then, not at every later step)
        # early exit (the engine resolves them against the model): the rule's threshold, None when no rule
        # can fire, and a fixed depth, None for "up to D"
        self.exit_threshold: float | None = None
        self.exit_at_step: int | None = None
        # exit depth of each token's own forward from the last prompt token on (position num_prompt_tokens - 1
        # + i): in skip mode a generated token's deeper loop planes hold its exit loop's KV, and a readout that
        # writes KV (Huginn's coda) wrote it at that depth, so a recompute after preemption redoes exactly that
        self.exit_depths: list[int] = []
        # SamplingParams.logprobs: how many most likely tokens to return per generated token (None: no
        # log-probabilities), and the entries of the tokens generated so far
        self.logprobs_top: int | None = params.logprobs
        self.logprobs: list[TokenLogprob] = []
        # a token id's text in its entries (the engine's, shared by its requests; None: no tokenizer, no texts)
        self.token_text: Callable[[int], str] | None = None
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # set at admission when asked for

    @property
    def exits_early(self) -> bool:
        return self.exit_threshold is not None or self.exit_at_step is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def adjusts_logits(self) -> bool:
        """Whether its logits are changed before sampling (execution/sampler.py `SamplingRows.adjusted`)."""
        return (bool(self.logit_bias) or self.allowed_ids is not None or self.bad_words is not None
                or self.depends_on_output)  # fmt: skip

    @property
    def depends_on_output(self) -> bool:
        """Whether its logits at a position depend on the output before that position (a penalty, min_tokens not
        yet reached, a grammar, a bad word of several tokens): a speculative position's drafts before it then count as
        output."""
        return (self.penalized or self.num_output_tokens < self.min_tokens or self.grammar is not None
                or (self.bad_words is not None and bool(self.bad_words.phrases)))  # fmt: skip

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def remaining_budget(self) -> int:
        """Tokens this request may still commit: what max_tokens and max_model_len leave."""
        return min(self.max_tokens - self.num_output_tokens, self.max_model_len - self.num_tokens)

    def append(self, token: int) -> bool:
        """Commit one generated token; returns True when the request is now finished. If the detokenizer fails
        (it decodes to look for stop strings), the error is raised and the token is not committed, unless the token
        is a stop token: that ends the request anyway (its text, if any, is then left out).

        As in vLLM, the first min_tokens tokens end nothing (a stop token cannot be sampled there), a stop string is
        looked for in the text of the tokens after them, and a stop token's text is left out of the text unless the
        request keeps its stop strings (`include_stop_str_in_output`): kept, it is kept whole, and the stop token is
        what ended the request even where its text holds a stop string (vLLM looks for none in a stop token's text)."""
        stop_token = token in self.stop_ids
        grammar = self.grammar
        if grammar is not None:  # first: a token its grammar refuses (the sampler masks them) commits nothing
            grammar.consume(token)
            # an eos that completes the grammar ends the request as a stop token does, ignore_eos or not: the
            # grammar decides where the output ends, and the eos's text is no part of it
            stop_token = stop_token or (token in self.eos_ids and grammar.complete)
        detokenizer = self.detokenizer
        stop_string = False
        if detokenizer is not None and (detokenizer.include_stop or not stop_token):
            try:
                stop_string = detokenizer.append(token, self.num_output_tokens >= self.min_tokens and not stop_token)
            except Exception as exc:
                if not stop_token:
                    if grammar is not None:
                        grammar.rollback(1)  # the token is not committed
                    raise
                logger.warning("request %s: its stop token %d cannot be decoded (left out of its text): %r",
                               self.request_id, token, exc)  # fmt: skip
        self.token_ids.append(token)
        if stop_token or stop_string or (grammar is not None and grammar.complete):
            self.finish_reason = "stop"
        elif self.num_output_tokens >= self.max_tokens or self.num_tokens >= self.max_model_len:
            self.finish_reason = "length"
        return self.finish_reason is not None


@dataclass
class ScheduledBatch:
    """One engine step's work: a prefill chunk per request, or a decode round."""

    is_prefill: bool
    requests: list[Request]
    chunk_lens: list[int] = field(default_factory=list)  # prefill only


def mean_context(requests: list[Request]) -> float:
    """Mean tokens already in the KV per request (`num_computed`): the context a decode round's passes read.

    A round's cost grows with it, so the controller prices plans at it. A Python mean over ints: cheap enough
    for every round, no device sync.
    """
    return sum(r.num_computed for r in requests) / len(requests) if requests else 0.0
