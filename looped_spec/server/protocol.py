"""OpenAI request and response schemas for the fields looped-spec supports (pydantic at the boundary).

Requests forbid unknown fields, so an unsupported OpenAI option (`functions`, ...) is a 400 naming it rather than
silently ignored; options whose effect is not built (completions' `best_of` and `suffix`, vLLM's `use_beam_search`
and `length_penalty`) are taken only at their neutral values (1, empty, false, 1.0), which change nothing (clients
such as benchmark harnesses send them), and any other value is a 400 naming the field. Requests are strict about
types as OpenAI is (`"max_tokens": "5"` or `"logprobs": true` on completions is a 400, not a silent conversion); a
null field is an unset one, as OpenAI's schema has it.
Extensions beyond OpenAI's schema, as in vLLM: `top_k`, `min_p`,
`repetition_penalty`, `ignore_eos`, `stop_token_ids`, `min_tokens`, `include_stop_str_in_output`,
`skip_special_tokens`, `bad_words`, `structured_outputs` (OpenAI's `response_format` too), `priority`, `cache_salt`,
`return_token_ids` (and `seed`, which OpenAI has too), chat's `add_generation_prompt`, `continue_final_message`,
`chat_template`, `chat_template_kwargs` and `echo`; and looped-spec's early exit, `exit_threshold` / `exit_at_step`
(checked by `SamplingParams` and the engine, errors naming the field).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer, model_validator

from looped_spec.sampling_params import is_token_key
from looped_spec.structured_output import StructuredOutputs


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None  # the output always follows the schema: strict or not


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or an instance of a JSON schema."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema: give it exactly when type is "json_schema"')
        return self

    def structured_outputs(self) -> StructuredOutputs | None:
        if self.type == "json_object":
            return StructuredOutputs(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputs(json=self.json_schema.json_schema)
        return None


class RequestFields(BaseModel):
    """A request's fields: OpenAI's schema lets a client send null for an optional field, meaning it is not set (clients
    generated from the schema do), so a null field takes its default; a required one is then missing."""

    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        return {key: value for key, value in data.items() if value is not None} if isinstance(data, dict) else data


class StreamOptions(RequestFields):
    """`stream_options`; a null option is an unset one, as for the request's own fields."""

    include_usage: bool | None = None  # unset: as continuous_usage_stats (vLLM's default is true, OpenAI's false)
    # vLLM's: every chunk carries the usage so far too
    continuous_usage_stats: bool = False

    @property
    def final_usage(self) -> bool:
        """Whether a usage chunk ends the stream."""
        return self.include_usage if self.include_usage is not None else self.continuous_usage_stats


class SamplingFields(RequestFields):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # left out: the served model, as vLLM's server takes it (OpenAI's requires it)
    temperature: float | None = Field(None, ge=0.0, le=2.0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0, allow_inf_nan=False)
    n: int = Field(
        1, ge=1, le=16, description="Independent choices per prompt (with `seed` s, choice j draws with s + j)."
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = Field(None, description="Stop strings (at most 16), cut from the output.")
    # OpenAI's and vLLM's range, any 64-bit integer; the engine draws with it modulo 2**63, except -1, which vLLM (and
    # clients sending it) read as no seed: each request then samples anew
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int = Field(0, ge=0, description="Fewest tokens before eos, stop_token_ids or a stop string may end "
                            "the choice (vLLM's).")  # fmt: skip
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # a grammar the output follows: OpenAI's response_format, or vLLM's structured_outputs (one of the two)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # early exit (SamplingParams): the family rule's threshold, or a fixed loop depth per token
    exit_threshold: float | None = Field(None, allow_inf_nan=False)
    exit_at_step: int | None = None
    user: str | None = None  # accepted and ignored, as OpenAI clients send it
    # token id (as a string, JSON's keys) -> a bias in [-100, 100] added to its logit, as in OpenAI's API
    logit_bias: dict[str, float] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, ge=0.01, le=100.0, allow_inf_nan=False)
    allowed_token_ids: list[int] | None = Field(None, min_length=1, description="Only these tokens may be generated "
                                               "(vLLM's).")  # fmt: skip
    return_tokens_as_token_ids: bool | None = Field(None, description="With logprobs: each token shown as "
                                                    "'token_id:<id>' (vLLM's; default: the server's "
                                                    "--return-tokens-as-token-ids).")  # fmt: skip
    priority: int = Field(0, description="Lower is admitted first and preempted last, under --scheduling-policy "
                          "priority; anything but 0 is refused otherwise (vLLM's).")  # fmt: skip
    bad_words: list[str] | None = Field(None, description="Words that may not be generated (vLLM's).")
    cache_salt: str | None = Field(None, description="With prefix caching, cached blocks are shared only with requests "
                                   "of the same salt (vLLM's; a non-empty string).")  # fmt: skip
    return_token_ids: bool = Field(False, description="The answer carries the prompt's token ids and each choice's "
                                   "generated ids (streamed: the ids new in each chunk; vLLM's).")  # fmt: skip
    # vLLM's beam search, not built: accepted at vLLM's defaults only (its clients send them), which change nothing
    use_beam_search: bool = False
    length_penalty: float | None = Field(None, allow_inf_nan=False)

    @field_validator("use_beam_search")
    @classmethod
    def _no_beam_search(cls, value: bool) -> bool:
        if value:
            raise ValueError("not supported: beam search is not offered here; only false is accepted")
        return value

    @field_validator("length_penalty")
    @classmethod
    def _no_length_penalty(cls, value: float | None) -> float | None:
        if value not in (None, 1.0):  # vLLM reads it only under beam search: any other value would do nothing
            raise ValueError("not supported: beam search is not offered here; only 1.0 (no penalty) is accepted")
        return value

    @field_validator("seed")
    @classmethod
    def _minus_one_is_no_seed(cls, value: int | None) -> int | None:
        return None if value == -1 else value

    @field_validator("cache_salt")
    @classmethod
    def _non_empty_salt(cls, value: str | None) -> str | None:
        if value is not None and not value:
            raise ValueError("must be a non-empty string if given (vLLM's rule); leave it out for no salt")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not is_token_key(key):  # ASCII digits without leading zeros: two keys never name one token
                raise ValueError(f"key {key!r} is not a token id (a non-negative integer, written without leading "
                                 "zeros)")  # fmt: skip
        return value

    def token_bias(self) -> dict[int, float]:
        """`logit_bias` with integer token ids (SamplingParams checks the values' range)."""
        return {int(key): value for key, value in (self.logit_bias or {}).items()}

    def grammar(self) -> StructuredOutputs | None:
        """The grammar asked for (the server refuses one in both fields, naming structured_outputs)."""
        if self.structured_outputs is not None:
            return self.structured_outputs
        return self.response_format.structured_outputs() if self.response_format is not None else None

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0, description="0 with `echo`: score the prompt, generate nothing.")
    logprobs: int | None = Field(None, ge=0, le=20, description="Log-probability of each token and the N most likely.")
    echo: bool = Field(False, description="Return the prompt before the completion (its tokens scored by `logprobs`).")
    add_special_tokens: bool = Field(True, description="The tokenizer's special tokens (a BOS) around a text prompt, "
                                     "as vLLM and the offline engine encode it.")  # fmt: skip
    # not built: accepted at their neutral values only
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("best_of")
    @classmethod
    def _one_of_one(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError("not supported: only 1 (each choice is its own sample) is accepted")
        return value

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        if value:
            raise ValueError("not supported (no insertion): only an empty suffix is accepted")
        return value


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    """A call the model made: the function's name and its arguments as JSON text (OpenAI's shape, both ways)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1)
    description: str | None = None
    # a JSON schema of the arguments object (None: any object, as OpenAI takes a function without parameters)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the arguments always follow the schema where a call is forced: strict or not


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the one function the model must call."""

    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["function"]
    function: FunctionName


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, sent back in a tool conversation
    tool_call_id: str | None = None  # the call a tool message answers
    # an assistant's reasoning sent back (a reply's `reasoning`, vLLM's field; `reasoning_content`, its former name):
    # the template gets it as `reasoning_content`, the variable thinking models' templates read
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _calls_from_the_assistant(self) -> ChatMessage:
        for name in ("tool_calls", "reasoning", "reasoning_content"):
            if getattr(self, name) is not None and self.role != "assistant":
                raise ValueError(f"{name}: only on assistant messages (this one's role is {self.role!r})")
        if self.reasoning is not None and self.reasoning_content is not None:
            raise ValueError("reasoning, reasoning_content: one of the two (reasoning_content is its former name)")
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("tool_call_id: a tool message names the call it answers (OpenAI's rule)")
        return self

    def text(self) -> str:
        if isinstance(self.content, list):  # text parts, one a line (vLLM's "string" content format)
            return "\n".join(part.text for part in self.content)
        return self.content or ""


class ChatTemplateFields(RequestFields):
    """How a chat request's messages become its prompt (vLLM's fields; server/chat_template.py has the rules)."""

    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = Field(False, description="Leave the last message open for the model to continue "
                                         "(with add_generation_prompt: false).")  # fmt: skip
    chat_template: str | None = Field(None, description="A template of the request's own (a server started with "
                                      "--trust-request-chat-template only).")  # fmt: skip
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Extra template variables (those the "
                                                        "template does not read are dropped).")  # fmt: skip
    add_special_tokens: bool = Field(False, description="Special tokens (BOS) on top of what the template writes.")


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    echo: bool = Field(False, description="vLLM's: the reply starts with the last message's content when that message "
                       "is the assistant's (the text continue_final_message continues).")  # fmt: skip
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # tool calling (server/tools.py): what may be called, and whether the model must, may or must not call
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description='Default: "auto" with tools, "none" without (OpenAI\'s).'
    )
    parallel_tool_calls: bool = True
    include_reasoning: bool = Field(True, description="With --reasoning-parser: whether the reply carries the "
                                    "reasoning (false: the content alone; vLLM's).")  # fmt: skip

    def chosen_tool_mode(self) -> str | NamedToolChoice:
        """`tool_choice` with OpenAI's default filled in: "auto" when tools are given, else "none"."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"


class TokenizeCompletionRequest(RequestFields):
    """/tokenize of a plain prompt (vLLM's); a null field is unset, as in the chat form and the other endpoints."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatTemplateFields):
    """/tokenize of chat messages, rendered as chat completions renders them (vLLM's)."""

    model: str | None = None
    tools: list[ChatTool] | None = None
    return_token_strs: bool = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestFields):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens whose KV came from the prefix cache (0 without prefix caching)


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None  # None when nothing was generated (scores only)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class CompletionLogprobs(BaseModel):
    """OpenAI's completions log-probabilities: per token its text, log-probability (None for a first prompt token),
    the most likely tokens there and the token's character offset in the choice's text."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class OmitsUnaskedTokenIds(BaseModel):
    """Serialised without its `prompt_token_ids` / `token_ids` when they are None: a request without
    `return_token_ids` gets the answer it got before the field existed, key for key."""

    @model_serializer(mode="wrap")
    def _token_ids_when_asked(self, handler) -> dict[str, Any]:
        return _without_null(handler(self), ("prompt_token_ids", "token_ids"))


class CompletionChoice(OmitsUnaskedTokenIds):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: the stop string or stop_token_ids token that ended the choice (None for eos, a length, or not yet)
    stop_reason: int | str | None = None
    # with return_token_ids (vLLM's): the ids of the prompt this choice continues (streamed: in its first chunk), and
    # the ids it generated (streamed: those new in the chunk); never the echoed prompt's
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None
    reasoning: str | None = None  # with --reasoning-parser (vLLM's field); left out of the JSON when None

    @model_serializer(mode="wrap")
    def _reasoning_when_any(self, handler) -> dict[str, Any]:
        return _without_null(handler(self), ("reasoning",))


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob]


class ChatChoice(OmitsUnaskedTokenIds):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # as CompletionChoice's
    token_ids: list[int] | None = None  # with return_token_ids: the generated ids, whatever the parsers made of them


class ChatCompletionResponse(OmitsUnaskedTokenIds):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = None  # with return_token_ids: the rendered chat's ids (one prompt, n choices)


class OmitsNone(BaseModel):
    """Serialised without its None fields: OpenAI's stream accumulation (the `openai` client's) takes an explicit
    null as a value (a null `type` would replace the call's "function")."""

    @model_serializer(mode="wrap")
    def _without_none(self, handler) -> dict[str, Any]:
        return {key: value for key, value in handler(self).items() if value is not None}


class DeltaFunctionCall(OmitsNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OmitsNone):
    """A piece of a streamed tool call: the first piece of call `index` carries its id, type and name; the arguments
    pieces concatenate to the call's arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    reasoning: str | None = None  # with --reasoning-parser (vLLM's field); left out of the JSON when None

    @model_serializer(mode="wrap")
    def _reasoning_when_any(self, handler) -> dict[str, Any]:
        return _without_null(handler(self), ("reasoning",))


def _without_null(fields: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """`fields` without those of `names` that are None: fields only some servers or requests fill (a reasoning
    parser's `reasoning`, return_token_ids' ids) are left out, so everyone else gets the answer as before."""
    for name in names:
        if name in fields and fields[name] is None:
            del fields[name]
    return fields


class ChatStreamChoice(OmitsUnaskedTokenIds):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # as CompletionChoice's, in the chunk that finishes the choice
    token_ids: list[int] | None = None  # with return_token_ids: the ids generated since the choice's last chunk


class ChatCompletionChunk(OmitsUnaskedTokenIds):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids: the rendered chat's ids, in the first chunk


class ModelPermission(BaseModel):
    """vLLM's (and OpenAI's former) permission object: clients that list models may read it."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=now)
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(BaseModel):
    """A served model as vLLM lists it: `root` is the checkpoint it was loaded from (`id` may be a
    `--served-model-name`), `parent` the base model of an adapter (none here)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "looped-spec"
    root: str | None = None
    parent: str | None = None
    max_model_len: int
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
