"""What a committed step tells the caller: a request's `RequestOutput` and its token timing."""

from __future__ import annotations

import logging

from looped_spec.engine.stats import EngineStats
from looped_spec.request import Request, RequestOutput

logger = logging.getLogger(__name__)


def request_output(request: Request) -> RequestOutput:
    """The request's output now: every token so far, and what is new since its last output (ids and text)."""
    text, new_text, so_far, detok = None, "", "", request.detokenizer
    finish_reason = request.finish_reason
    if detok is not None:
        try:
            if request.finished:
                # the last, incomplete character's U+FFFD completed a stop string (an abort or error stays one)
                # (the text flushed is the last token's: a stop string there counts past the first min_tokens)
                if detok.flush(request.num_output_tokens > request.min_tokens) and finish_reason == "length":
                    finish_reason = "stop"
                text = detok.text
            new_text = detok.stream_delta(request.finished)
            so_far = detok.sent_text
        except Exception as exc:  # the token ids are the output; text is a convenience that must not wedge
            if not request.decode_failed:  # once a request, not again at every later step that reports it
                logger.warning("request %s: cannot decode its output to text: %r", request.request_id, exc)
                request.decode_failed = True
            text, new_text, so_far = None, "", ""
    output_ids = request.output_token_ids
    new_ids = output_ids[request.num_emitted :]
    request.num_emitted = len(output_ids)
    return RequestOutput(
        request.request_id,
        request.token_ids[: request.num_prompt_tokens],
        output_ids,
        text,
        finish_reason,
        request.finished,
        request.metrics,
        request.prompt_text,
        new_ids,
        new_text,
        _stop_reason(request, finish_reason, detok),
        request.error,
        list(request.logprobs) if request.logprobs_top is not None else None,
        request.prompt_logprobs,
        so_far,
    )


def _stop_reason(request: Request, finish_reason: str | None, detok) -> str | int | None:
    """What ended a stopped request, as vLLM reports it: the stop string, or the stop token id the request named
    (`stop_token_ids`; an eos is None, as in vLLM, unless ignore_eos: then only stop_token_ids can have stopped at it).
    `finish_reason`: the output's (a stop string the last flush completed turns "length" into "stop")."""
    if finish_reason != "stop":  # an abort or error whose flushed text completes a stop string was not ended by it
        return None
    if detok is not None and detok.stop_hit is not None:
        return detok.stop_hit
    last = request.output_token_ids[-1] if request.output_token_ids else None
    named = last is not None and last in request.stop_ids
    return last if named and (request.ignore_eos or last not in request.eos_ids) else None


def time_tokens(stats: EngineStats, request: Request, count: int, now: float) -> None:
    """Time to first token and inter-token latency of `count` tokens the request just committed."""
    m = request.metrics
    if m.first_token_time is None:
        m.first_token_time = now
        stats.time_to_first_token.observe(now - m.arrival_time)
        count -= 1
    elif count:
        stats.inter_token_latency.observe((now - m.last_token_time) / count, count)
        count = 0
    if count:  # the first token and more in one commit (a first round after a recompute): no gap between them
        stats.inter_token_latency.observe(0.0, count)
    m.last_token_time = now
