"""The decode engine: the explicit carry, KV page allocation, prefill, the jitted decode step."""
