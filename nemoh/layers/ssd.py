"""Mamba2 state-space scan: the chunked SSD form (prompts), the one-token step (decode), and the
plain per-token recurrence kept as the exact reference for the chunked form.

Notation (per batch row): nh heads of width hd in G groups (head h reads group h // (nh/G)), state
size N. All math in fp32. dt is already softplus'ed (and zero at padding positions, which makes a
padding token a no-op: decay exp(0) = 1 and no input).

    S_t = exp(dt_t * A_h) * S_{t-1} + dt_t * x_t (outer) B_t        S [hd, N]
    y_t = S_t @ C_t + D_h * x_t
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.formats import pow2, row_exponent

_HI = jax.lax.Precision.HIGHEST


def ssd_step(state: jax.Array, x: jax.Array, dt: jax.Array, A: jax.Array, B: jax.Array, C: jax.Array,
             D: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token of the recurrence.

    state [b, nh, hd, N] fp32; x [b, nh, hd]; dt [b, nh]; A, D [nh]; B, C [b, G, N].
    Returns (y [b, nh, hd] fp32, new state [b, nh, hd, N] fp32).
    """
    b, nh, hd = x.shape
    G = B.shape[1]
    x = x.astype(jnp.float32)
    dt = dt.astype(jnp.float32)
    Bh = jnp.repeat(B.astype(jnp.float32), nh // G, axis=1)  # [b, nh, N]
    Ch = jnp.repeat(C.astype(jnp.float32), nh // G, axis=1)
    decay = jnp.exp(dt * A)[..., None, None]
    new_state = decay * state + (dt[..., None] * x)[..., None] * Bh[:, :, None, :]
    y = jnp.einsum("bhpn,bhn->bhp", new_state, Ch, precision=_HI) + D[:, None] * x
    return y, new_state


def ssd_reference(x, dt, A, B, C, D, initial_state=None):
    """Per-token recurrence over a sequence (the test oracle for `ssd_chunked`).

    x [b, T, nh, hd]; dt [b, T, nh]; A, D [nh]; B, C [b, T, G, N]; initial_state [b, nh, hd, N] or None.
    Returns (y [b, T, nh, hd] fp32, final state [b, nh, hd, N] fp32).
    """
    b, T, nh, hd = x.shape
    N = B.shape[-1]
    state = jnp.zeros((b, nh, hd, N), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    def step(s, inputs):
        xt, dtt, Bt, Ct = inputs
        y, s = ssd_step(s, xt, dtt, A, Bt, Ct, D)
        return s, y

    seq_first = lambda t: jnp.moveaxis(t, 1, 0)
    state, ys = jax.lax.scan(step, state, (seq_first(x), seq_first(dt), seq_first(B), seq_first(C)))
    return jnp.moveaxis(ys, 0, 1), state


UNROLLED_CHUNKS = 16  # chunks of ssd_chunked's pass a loop trip holds (all of them, up to this many)


def _segsum(a: jax.Array) -> jax.Array:
    """a [..., Q] -> [..., Q, Q] with out[l, s] = sum_{s < j <= l} a[j] for s <= l, -inf above the diagonal.

    Differences of prefix sums over Q, none over Q x Q (a masked cumulative sum down each column costs a
    Q-long sum an entry: on the GPU a reduce-window, in a fusion of ~150 us a Nano Mamba layer at 2,048
    tokens). Plain differences of fp32 prefix sums would lose bits to the sums' magnitude, so a splits
    exactly into a1 + a2 + a3: a1 and a2 multiples of quanta 2^(e-b) and 2^(e-2b) (2^e above the row's
    largest |a|) of at most b bits each, whose prefix sums and their differences are exact in fp32
    (Q * 2^b <= 2^23), and a remainder a3 below 2^(e-2b-1). Each entry is then within about an ulp of the
    exact sum, closer than a sequential fp32 cumsum gets.
    """
    Q = a.shape[-1]
    b = 23 - max(Q - 1, 1).bit_length()  # Q * 2^b <= 2^23: the quanta's prefix sums stay exact
    e = jnp.maximum(row_exponent(jnp.max(jnp.abs(a), axis=-1, keepdims=True)), 2 * b - 126)  # quanta normal

    def split(r, k):  # (r's multiple of 2^k nearest it, the rest), both exact
        p = jnp.round(r * pow2(-k)) * pow2(k)
        return p, r - p

    a1, rest = split(a, e - b)
    a2, a3 = split(rest, e - 2 * b)
    sums = 0.0
    for part in (a1, a2, a3):
        prefix = jnp.cumsum(part, axis=-1)
        sums = sums + (prefix[..., :, None] - prefix[..., None, :])
    return jnp.where(jnp.tril(jnp.ones((Q, Q), bool)), sums, -jnp.inf)


def ssd_chunked(x, dt, A, B, C, D, chunk_size: int, initial_state=None):
    """Chunked SSD (matmul-shaped within chunks, sequential across chunks). Same contract as
    `ssd_reference`; chunk_size need not divide T (the tail is padded with dt = 0)."""
    b, T, nh, hd = x.shape
    G, N = B.shape[2], B.shape[3]
    hpg = nh // G
    Q = chunk_size
    nc = -(-T // Q)
    pad = nc * Q - T
    f32 = lambda t: t.astype(jnp.float32)
    x, dt, B, C = f32(x), f32(dt), f32(B), f32(C)
    if pad:
        padT = lambda t: jnp.pad(t, [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2))
        x, dt, B, C = padT(x), padT(dt), padT(B), padT(C)
    xc = x.reshape(b, nc, Q, G, hpg, hd)
    dtc = dt.reshape(b, nc, Q, G, hpg)
    Bc = B.reshape(b, nc, Q, G, N)
    Cc = C.reshape(b, nc, Q, G, N)
    a = jnp.moveaxis(dtc * A.reshape(G, hpg), 2, -1)  # [b, nc, G, hpg, Q]
    a_cum = jnp.cumsum(a, axis=-1)
    xdt = xc * dtc[..., None]

    # within each chunk: y_diag[l] = sum_{s<=l} (C_l . B_s) exp(a_cum[l] - a_cum[s]) dt_s x_s
    L = jnp.exp(_segsum(a))  # [b, nc, G, hpg, Q(l), Q(s)]
    CB = jnp.einsum("bclgn,bcsgn->bcgls", Cc, Bc, precision=_HI)
    y_diag = jnp.einsum("bcgls,bcghls,bcsghp->bclghp", CB, L, xdt, precision=_HI)

    # each chunk's own contribution to the state at its end
    decay_to_end = jnp.exp(a_cum[..., -1:] - a_cum)  # [b, nc, G, hpg, Q]
    chunk_states = jnp.einsum("bcsgn,bcghs,bcsghp->bcghpn", Bc, decay_to_end, xdt, precision=_HI)

    # sequential pass over chunks: S_start[c+1] = exp(sum a over chunk c) * S_start[c] + chunk_states[c],
    # UNROLLED_CHUNKS chunks a trip: up to 16 chunks (a 2,048-token prompt chunk) it holds no loop, whose
    # trips each launched their kernels from the host on the GPU (~0.3 ms idle a Mamba layer in a
    # 2,048-token prefill); past that, trips of 16 keep the compile bounded (one Nano-width layer on the
    # CPU: 0.67 s at 16 chunks, 0.79 s at 64, 2.8 s unrolled whole). One product over chunks (exp of the
    # chunk totals' segment sums times the contributions) measured slower than the loop on the GPU
    s0 = (jnp.zeros((b, nh, hd, N), jnp.float32) if initial_state is None else f32(initial_state))
    s0 = s0.reshape(b, G, hpg, hd, N)
    chunk_decay = jnp.exp(a_cum[..., -1])  # [b, nc, G, hpg]

    def across(s, inputs):
        decay, contrib = inputs
        return decay[..., None, None] * s + contrib, s

    final, starts = jax.lax.scan(across, s0, (jnp.moveaxis(chunk_decay, 1, 0), jnp.moveaxis(chunk_states, 1, 0)),
                                 unroll=min(nc, UNROLLED_CHUNKS))
    starts = jnp.moveaxis(starts, 0, 1)  # [b, nc, G, hpg, hd, N]: state entering each chunk

    y_off = jnp.einsum("bclgn,bcghpn,bcghl->bclghp", Cc, starts, jnp.exp(a_cum), precision=_HI)
    y = (y_diag + y_off).reshape(b, nc * Q, nh, hd)[:, :T]
    y = y + D[:, None] * x[:, :T]
    return y, final.reshape(b, nh, hd, N)
