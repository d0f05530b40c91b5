"""`generation_config.json`: the checkpoint's extra stop tokens and default sampling, read as HF does."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from looped_spec.models.checkpoint import CheckpointError
from looped_spec.models.config_fields import token_ids_field
from looped_spec.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# settings of HF's GenerationConfig that change what `generate` produces and that looped-spec does not implement,
# with their no-op value: a file that sets one is read with a warning naming it (min_new_tokens too: vLLM does not read
# it either; a request's min_tokens does that)
_UNSUPPORTED = {
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "num_beams": 1, "num_beam_groups": 1,
    "diversity_penalty": 0.0, "penalty_alpha": None, "no_repeat_ngram_size": 0, "encoder_repetition_penalty": 1.0,
    "encoder_no_repeat_ngram_size": 0, "min_length": 0, "min_new_tokens": None, "bad_words_ids": None,
    "force_words_ids": None, "sequence_bias": None, "suppress_tokens": None, "begin_suppress_tokens": None,
    "forced_bos_token_id": None, "forced_eos_token_id": None, "exponential_decay_length_penalty": None,
    "renormalize_logits": False, "guidance_scale": None,
}  # fmt: skip


class GenerationConfig(BaseModel):
    """The fields looped-spec uses; the file's other fields (max_length, pad ids...) concern other tools."""

    # strict, as transformers reads the JSON: "no" is no boolean, "0.7" no temperature (lax, pydantic took both)
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    eos_token_id: int | list[int] | None = None
    do_sample: bool | None = None  # null (transformers 5 writes its unset fields so) is HF's default: no sampling
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    # HF's cap on generated tokens: vLLM takes it as the default max_tokens
    max_new_tokens: int | None = Field(None, gt=0)
    _from_file: bool = PrivateAttr(False)  # read from a checkpoint's file (without one, nothing is asked)

    @field_validator("eos_token_id", mode="before")
    @classmethod
    def _token_ids(cls, value):
        # as config.json's is read: pydantic's lax int took `true` for token 1 and "2" for 2
        token_ids_field(value, "eos_token_id")
        return value

    def stop_token_ids(self) -> list[int]:
        return token_ids_field(self.eos_token_id, "eos_token_id")

    def sampling_defaults(self) -> dict:
        """What the file asks of a request that sets no sampling fields, with HF's meaning (the file's format is HF's):
        `do_sample: true` samples with the file's temperature (HF's 1 if none), top_k, top_p and min_p (those it gives);
        `do_sample` false or absent decodes greedily, whatever temperature the file states. A repetition_penalty applies
        either way (in HF a logits processor, not a sampling warper). A field the file leaves out keeps looped-spec's
        default, as vLLM reads the file (HF's `generate` would take its own defaults, top_k 50). Offline requests and
        the server take these for the fields a request leaves unset (the server: OpenAI's defaults for the rest).
        Its `max_new_tokens` is the default `max_tokens` (vLLM's reading: HF's name for the same cap). Without a file
        nothing is asked."""
        if not self._from_file:
            return {}
        both = {} if self.repetition_penalty is None else {"repetition_penalty": self.repetition_penalty}
        if self.max_new_tokens is not None:
            both["max_tokens"] = self.max_new_tokens
        if not self.do_sample:
            return {"temperature": 0.0} | both
        sampling = ("temperature", "top_k", "top_p", "min_p")
        # `do_sample: true` without a temperature samples at HF's default temperature, 1 (this engine's own default, 0,
        # would decode greedily where the file asks to sample)
        return {"temperature": 1.0} | {k: v for k in sampling if (v := getattr(self, k)) is not None} | both


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
        config._from_file = True
        config.stop_token_ids()
        SamplingParams(**config.sampling_defaults())
    except ValidationError as exc:  # each field and what is wrong with it, without pydantic's links
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg'].removeprefix('Value error, ')}" for e in
                             exc.errors())  # fmt: skip
        raise CheckpointError(f"{path}: {problems}") from exc
    except (json.JSONDecodeError, ValueError) as exc:
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{path}: {' '.join(str(exc).split())}") from exc
    for key, neutral in _UNSUPPORTED.items():
        if data.get(key) not in (None, neutral):  # transformers writes either the no-op value or null
            logger.warning("%s: %s=%r is not implemented by looped-spec and is ignored", path, key, data[key])
    return config
