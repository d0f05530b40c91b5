"""Chat prompts through the tokenizer's own chat template, and the checkpoint's generation defaults."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from looped_spec.models.generation_config import GenerationConfig, read_generation_config


class NoChatTemplateError(ValueError):
    """The model's tokenizer has no chat template: /v1/chat/completions cannot format messages."""


def render_chat(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    chat_template: str | None = None,
    continue_final_message: bool = False,
    template_kwargs: dict | None = None,
) -> str:
    """The prompt text for `messages`, rendered by transformers' `apply_chat_template` with `chat_template` (None: the
    tokenizer's own); `tools` (OpenAI's shape) reach the template as its `tools` variable (a template that does not
    use them ignores them), `template_kwargs` as variables of their own; `continue_final_message` leaves the last
    message open (the text ends with its content)."""
    if tokenizer is None or (chat_template is None and not getattr(tokenizer, "chat_template", None)):
        raise NoChatTemplateError(
            "this model's tokenizer has no chat_template; use /v1/completions with a plain prompt"
        )
    return tokenizer.apply_chat_template(
        messages,
        tools=tools,
        chat_template=chat_template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        **(template_kwargs or {}),
    )


@dataclass
class GenerationDefaults:
    """The server's sampling defaults and extra end-of-turn tokens: what the checkpoint's `generation_config.json` asks
    (`GenerationConfig.sampling_defaults`, the one reading offline and server share), OpenAI's defaults (temperature
    1, top_p 1) for what it does not say. A request's own values win."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_config(cls, generation: GenerationConfig, tokenizer=None) -> GenerationDefaults:
        defaults = cls(**generation.sampling_defaults())
        defaults.eos_token_ids = generation.stop_token_ids()
        # the template's end-of-turn token is the tokenizer's eos (e.g. <|im_end|> for chat models)
        eos_id = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        if eos_id is not None and eos_id not in defaults.eos_token_ids:
            defaults.eos_token_ids.append(int(eos_id))
        return defaults

    @classmethod
    def load(cls, folder: str | Path | None, tokenizer=None) -> GenerationDefaults:
        """`from_config` of the folder's generation_config.json (none: nothing asked)."""
        return cls.from_config(read_generation_config(folder) if folder is not None else GenerationConfig(), tokenizer)
