"""The checkpoint's generation defaults as the server applies them (chat templates: engine/chat.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from looped_spec.models.generation_config import GenerationConfig, read_generation_config


@dataclass
class GenerationDefaults:
    """The server's sampling defaults: what the checkpoint's `generation_config.json` asks
    (`GenerationConfig.sampling_defaults`, the one reading offline and server share), OpenAI's defaults (temperature
    1, top_p 1) for what it does not say. A request's own values win. (Its eos tokens, the tokenizer's among them, are
    the engine's own: `LoopedSpecEngine.eos_token_ids`.)"""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = None  # the file's max_new_tokens: caps a request that leaves max_tokens out, as in vLLM

    @classmethod
    def from_config(cls, generation: GenerationConfig) -> GenerationDefaults:
        return cls(**generation.sampling_defaults())

    @classmethod
    def load(cls, folder: str | Path | None) -> GenerationDefaults:
        """`from_config` of the folder's generation_config.json (none: nothing asked)."""
        return cls.from_config(read_generation_config(folder) if folder is not None else GenerationConfig())
