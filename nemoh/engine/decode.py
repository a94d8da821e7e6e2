"""The decode step: (params, carry) -> carry, the whole model in one compiled program.

The sampled token is written into the carry on the device and is the next step's input: there is
no host round trip per token. `decode(params, carry, num_steps)` runs up to num_steps steps inside
one jax.lax.while_loop (stopping early once every slot is finished) per host call; num_steps and the
sampling settings are runtime values, so any of them reuses the same compiled program.

A new carry shape's decode program is compiled on a worker thread while prefill compiles and runs
(`compile_ahead`, started by prefill), so a first call waits for the longer of the two compiles, not
their sum; `decode` waits for that compile instead of starting the same one again.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from nemoh import validate
from nemoh.engine import xla_options
from nemoh.engine.carry import DecodeCarry, check_live, check_matches, consume, raise_if_nonfinite
from nemoh.engine.sampling import sample
from nemoh.layers.context import TokenContext
from nemoh.model import ModelParams, logits_from_hidden, run_layers
from nemoh.sharding.params import resolve
from nemoh.sharding.placement import constrain, tracing


def next_input(carry: DecodeCarry, sampled: jax.Array) -> jax.Array:
    """The token the next step reads: the one just sampled (a seam the stale-input test targets)."""
    return sampled


def step(params: ModelParams, carry: DecodeCarry) -> DecodeCarry:
    """One token for every live slot; finished slots are left untouched (no KV write, no state change).
    A live slot whose logits are not finite is flagged (nonfinite) and finished."""
    live = ~carry.finished
    ctx = TokenContext(positions=carry.lengths[:, None], valid_len=live.astype(jnp.int32),
                       block_tables=carry.block_tables, placement=carry.placement)
    h, states = run_layers(params, carry.tokens[:, None], ctx, carry.states)
    logits = logits_from_hidden(params, h[:, 0])
    sampled = sample(logits, carry.sampling, carry.num_generated)
    bad = live & ~jnp.all(jnp.isfinite(logits), axis=-1)
    lengths = carry.lengths + live
    rows = jnp.arange(lengths.shape[0])
    at = jnp.where(live, lengths, carry.sequences.shape[1])  # finished slots write nothing
    num_generated = carry.num_generated + live
    return DecodeCarry(
        tokens=jnp.where(live, next_input(carry, sampled), carry.tokens),
        lengths=lengths,
        states=states,
        block_tables=carry.block_tables,
        sequences=carry.sequences.at[rows, at].set(sampled, mode="drop"),
        num_generated=num_generated,
        max_new=carry.max_new,
        finished=carry.finished | (live & jnp.isin(sampled, carry.stop_ids)) | (num_generated >= carry.max_new) | bad,
        nonfinite=carry.nonfinite | bad,
        logits=jnp.where(live[:, None], logits, carry.logits),
        stop_ids=carry.stop_ids,
        sampling=carry.sampling,
        state_shape=carry.state_shape,
        placement=carry.placement,
    )


@partial(jax.jit, donate_argnums=(1,), compiler_options=xla_options.ENGINE)
def _decode(params: ModelParams, carry: DecodeCarry, num_steps: jax.Array) -> DecodeCarry:
    def cond(state):
        i, c = state
        return (i < num_steps) & ~jnp.all(c.finished)

    def body(state):
        i, c = state
        return i + 1, constrain(step(params, c), c.placement)

    with tracing(carry.placement):
        return jax.lax.while_loop(cond, body, (jnp.int32(0), carry))[1]


_AHEAD = ThreadPoolExecutor(max_workers=1, thread_name_prefix="nemoh-decode-compile")
_compiling: list[Future] = []


def compile_ahead(params: ModelParams, carry_shape: DecodeCarry) -> None:
    """Compile the decode program for carries shaped like `carry_shape` (ShapeDtypeStruct leaves with
    their shardings) on a worker thread; XLA releases the GIL while it compiles. The executable lands
    in _decode's own cache (the later call reuses it; an already compiled shape costs milliseconds).
    A failure is left for the real call to raise."""
    _compiling.append(_AHEAD.submit(lambda: _decode.lower(params, carry_shape, np.int32(1)).compile()))


def finish_compiling() -> None:
    """Wait for the decode programs compiling ahead (decode does; benchmarks too, before timing)."""
    while True:
        try:
            pending = _compiling.pop()
        except IndexError:  # none left (another thread may have taken the last)
            return
        wait([pending])


def decode(params: ModelParams, carry: DecodeCarry, num_steps: int = 1) -> DecodeCarry:
    """Run up to num_steps decode steps on the device; returns the new carry and consumes the old one
    (passing it again raises StaleCarryError). NaN/Inf logits raise NonFiniteError after the call.
    A sharded carry (from prefill with a mesh) runs on its mesh; params not on it are placed there."""
    validate.instance("params", params, ModelParams, "ModelParams (from nemoh.load)")
    validate.instance("carry", carry, DecodeCarry, "a DecodeCarry (from prefill or decode)")
    num_steps = validate.integer("num_steps", num_steps, 1, validate.INT32_MAX)
    check_live(carry)
    check_matches(params, carry)
    if carry.placement is not None:
        params, _ = resolve(params, carry.placement.mesh, carry.placement.rules)
    finish_compiling()  # one compile of a program, not two racing ones
    new = _decode(params, carry, np.int32(num_steps))
    consume(carry)
    raise_if_nonfinite(new)
    return new
