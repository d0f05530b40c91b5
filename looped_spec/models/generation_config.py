"""`generation_config.json`: the checkpoint's extra stop tokens and default sampling, read as HF does."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from looped_spec.models.checkpoint import CheckpointError
from looped_spec.models.config_fields import token_ids_field
from looped_spec.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# sampling settings a generation_config may carry that looped-spec does not implement, with their no-op value
_UNSUPPORTED = {"repetition_penalty": 1.0, "min_p": None, "typical_p": 1.0, "num_beams": 1, "no_repeat_ngram_size": 0}


class GenerationConfig(BaseModel):
    """The fields looped-spec uses; the file's other fields (max_length, pad ids...) concern other tools."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    eos_token_id: int | list[int] | None = None
    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None

    def stop_token_ids(self) -> list[int]:
        return token_ids_field(self.eos_token_id, "eos_token_id")

    def sampling_defaults(self) -> dict:
        """SamplingParams fields a request gets when it does not set them: HF semantics, so a file with
        `do_sample: false` (or none) means greedy whatever its temperature says."""
        if not self.do_sample:
            return {}
        return {k: v for k in ("temperature", "top_k", "top_p") if (v := getattr(self, k)) is not None}


def read_generation_config(folder: str | Path) -> GenerationConfig:
    """The folder's generation_config.json (an empty GenerationConfig when there is none)."""
    path = Path(folder) / "generation_config.json"
    if not path.is_file():
        return GenerationConfig()
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            raise CheckpointError(f"{path}: expected a JSON object")
        config = GenerationConfig(**data)
        config.stop_token_ids()
        SamplingParams(**config.sampling_defaults())
    except (json.JSONDecodeError, ValidationError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{path}: {' '.join(str(exc).split())}") from exc
    for key, neutral in _UNSUPPORTED.items():
        if data.get(key, neutral) != neutral:
            logger.warning("%s: %s=%r is not implemented by looped-spec and is ignored", path, key, data[key])
    return config
