"""Chat prompts through the tokenizer's own chat template, and the checkpoint's generation defaults."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path


class NoChatTemplateError(ValueError):
    """The model's tokenizer has no chat template: /v1/chat/completions cannot format messages."""


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> str:
    """The prompt text for `messages`, rendered by transformers' `apply_chat_template`."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplateError(
            "this model's tokenizer has no chat_template; use /v1/completions with a plain prompt"
        )
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


@dataclass
class GenerationDefaults:
    """Sampling defaults and extra end-of-turn tokens from the checkpoint's `generation_config.json`.

    A request's own values win; without the file the OpenAI defaults apply (temperature 1, top_p 1).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def load(cls, folder: str | Path | None, tokenizer=None) -> GenerationDefaults:
        defaults = cls()
        path = Path(folder) / "generation_config.json" if folder is not None else None
        if path is not None and path.is_file():
            config = json.loads(path.read_text(encoding="utf-8"))
            if config.get("do_sample") is False:
                defaults.temperature = 0.0
            elif config.get("temperature") is not None:
                defaults.temperature = float(config["temperature"])
            if config.get("top_p") is not None:
                defaults.top_p = float(config["top_p"])
            if config.get("top_k") is not None:
                defaults.top_k = int(config["top_k"])
            eos = config.get("eos_token_id")
            defaults.eos_token_ids = list(eos) if isinstance(eos, list) else [] if eos is None else [int(eos)]
        # the template's end-of-turn token is the tokenizer's eos (e.g. <|im_end|> for chat models)
        eos_id = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
        if eos_id is not None and eos_id not in defaults.eos_token_ids:
            defaults.eos_token_ids.append(int(eos_id))
        return defaults
