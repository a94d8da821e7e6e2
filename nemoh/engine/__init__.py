"""The decode engine: the explicit carry, bucketed layouts and the memory check, KV page allocation,
prefill, the jitted decode step, per-row sampling."""
