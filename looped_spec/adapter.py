"""The old name of looped_spec.model_adapter, kept only until looped_spec.tuner imports from there."""

from looped_spec.model_adapter import ModelAdapter, load_adapter  # noqa: F401
