"""The checkpoint's generation defaults as the server applies them (chat templates: engine/chat.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from looped_spec.models.generation_config import GenerationConfig, read_generation_config


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
