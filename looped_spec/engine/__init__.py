"""The engine: requests in, tokens out (schedule -> run -> postprocess), its async front and its config."""
