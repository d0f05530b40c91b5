"""The OpenAI-compatible HTTP server (`looped-spec serve`): FastAPI app around an AsyncLoopedSpecEngine."""

from looped_spec.server.app import build_app

__all__ = ["build_app"]
