"""The inference engine: compressed caches, jitted prefill / decode, sampling, scheduling."""
