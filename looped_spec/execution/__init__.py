"""Running the model: one pass of a loop range over a ragged batch on the paged KV cache, sampling, early exit."""
