"""The exception types nemoh raises on bad input. Each message names the culprit."""


class NemohError(Exception):
    """Base class of every error nemoh raises on purpose."""


class ConfigError(NemohError, ValueError):
    """A config.json that is malformed or inconsistent (names the field and the value)."""


class CheckpointError(NemohError, ValueError):
    """A checkpoint that is missing, unreadable, or whose tensors do not match the config
    (names the tensor and the file)."""


class CacheCapacityError(NemohError, ValueError):
    """A request that cannot fit the KV page pool or the sequence slots; raised before any work."""


class RequestError(NemohError, ValueError):
    """A malformed generation request: empty prompt, token id outside the vocabulary, bad options."""


class StaleCarryError(NemohError, RuntimeError):
    """A decode carry that was already consumed by an earlier step was passed again."""
