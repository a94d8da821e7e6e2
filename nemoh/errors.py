"""The exception types nemoh raises on bad input. Each message names the culprit."""


class NemohError(Exception):
    """Base class of every error nemoh raises on purpose."""


class ConfigError(NemohError, ValueError):
    """A config.json that is malformed or inconsistent (names the field and the value)."""


class CheckpointError(NemohError, ValueError):
    """A checkpoint that is missing, unreadable, or whose tensors do not match the config
    (names the tensor and the file)."""


class CacheCapacityError(NemohError, ValueError):
    """A request that cannot fit the KV page pool or device memory; raised before any work."""


class RequestError(NemohError, ValueError):
    """A bad argument to a public entry point (generate, forward, load, prefill, decode, CacheSpec, the
    gate): names the argument, the value and what is allowed."""


class MeshError(NemohError, ValueError):
    """A device mesh or sharding rules that do not fit the model: an axis size that does not divide the
    dim it splits (names the tensor, the dim and the mesh axis), a mesh axis given to two dims of one
    tensor, or a layout the sharded MoE cannot run; raised before any device work."""


class NonFiniteError(NemohError, FloatingPointError):
    """NaN or Inf logits met during prefill or decode (names the prompts and the step); raised after
    the call instead of returning tokens sampled from them."""


class StaleCarryError(NemohError, RuntimeError):
    """A decode carry that was already consumed by an earlier step was passed again."""


class LayerError(NemohError, TypeError):
    """A layer that does not follow the layer protocol (nemoh.layers.protocol), or whose mixer returns
    a state of another structure than it was given: names the layer index and type."""
