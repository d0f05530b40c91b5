"""Self-speculative decoding units: draft proposer, verifier, rejection sampler, round driver."""
