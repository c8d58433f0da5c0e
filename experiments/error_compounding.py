"""Claim C3: quantizing at every hop of a ring compounds the error; once per hop does not.

    python experiments/error_compounding.py                  # N = 2..512, bits 2/4/8
    python experiments/error_compounding.py --max-n 8 --size 1024 --out /tmp/ec

Plain array math on one CPU device (no collectives): N gradient shards of `size` float32
values are summed four ways, and each result is compared with the exact float32 sum by
the relative error `||approx - exact|| / ||exact||`:

  * ring: a ring reduce-scatter that quantizes on the wire. The partial sum of a chunk
    travels N - 1 hops; at each hop the receiver dequantizes it, adds its own shard and
    quantizes the new partial sum for the next hop. N - 1 quantization events, each on a
    growing sum. (All chunks of a real ring follow this path with the devices in another
    order, so one whole-vector path has the statistics of the whole ring.)
  * one-shot all-to-all: every shard is quantized once, sent, dequantized, and the
    receiver sums in float32. One event per value, whatever N.
  * two-hop (qgZ): one-shot inside groups of `g` devices (a node), then the group's
    float32 partial sum is quantized once more for the one-shot hop across groups. Two
    events per value (one when N <= g).

Shards are `(common + own_k) / sqrt(2)`: a signal shared by all workers plus a worker's
own noise of the same size, both from one distribution: gaussian, Student-t with 3
degrees of freedom (heavy tails, scaled to unit variance), or gaussian with outliers
(0.1% of the values times 100); numpy draws them from fixed seeds, and the shards of a
smaller N are the first rows of the largest N's. Quantization is `zeropp_jax.wire.quant`
(symmetric absmax blocks of `block_size`, round to nearest).

`inject_quantization_events` adds k extra quantization events to a gradient (for the
"how many events can training survive" study; see the TODO at the end of this file).

Writes `error_compounding.{md,csv,png}` and `quantization_events.{md,csv}` into the output
folder (default `experiments/results/error_compounding/`).
"""

from __future__ import annotations

import argparse
import functools
import math
import pathlib
import time
from collections.abc import Sequence
from typing import Any

import _common
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _library import rotation  # noqa: E402

from zeropp_jax.wire import quant

DISTRIBUTIONS = ("gaussian", "student_t3", "outliers")
METHODS = ("ring", "one_shot", "two_hop_g8", "two_hop_g16")
GROUP_SIZES = (8, 16)
OUTLIER_FRACTION = 1e-3
OUTLIER_FACTOR = 100.0


def sample(dist: str, rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of unit scale from `dist` (one of `DISTRIBUTIONS`)."""
    if dist == "gaussian":
        return rng.standard_normal(shape, dtype=np.float32)
    if dist == "student_t3":
        return (rng.standard_t(3.0, shape) / math.sqrt(3.0)).astype(np.float32)
    if dist == "outliers":
        x = rng.standard_normal(shape, dtype=np.float32)
        hit = rng.random(shape) < OUTLIER_FRACTION
        return np.where(hit, np.float32(OUTLIER_FACTOR) * x, x)
    raise ValueError(f"dist={dist!r}; expected one of {DISTRIBUTIONS}.")


def make_shards(dist: str, n: int, size: int, seed: int) -> np.ndarray:
    """`(n, size)` float32 gradient shards `(common + own_k) / sqrt(2)` (see the module
    docstring); the first `m` rows are the shards of an `m`-device run."""
    rng = np.random.default_rng([seed, DISTRIBUTIONS.index(dist)])
    common = sample(dist, rng, (size,))
    own = sample(dist, rng, (n, size))
    return ((common + own) * np.float32(1 / math.sqrt(2))).astype(np.float32)


def round_trip(
    x: jax.Array, *, bits: int, block_size: int, rotation_block_size: int | None = None
) -> jax.Array:
    """One quantization event: block-quantize `x` (1-d, size divisible by `block_size`)
    with the reference quantizer and dequantize it back to float32. With
    `rotation_block_size`, the blocks are rotated by the block Hadamard rotation
    (`zeropp_jax.wire._rotation`) before quantizing and rotated back after, as a rotated
    gradient hop does."""
    blocks = x.reshape(-1, block_size)
    if rotation_block_size is not None:
        blocks = rotation.rotate_blocks(blocks, rotation_block_size)
    values, scales = quant.quantize_blocks(blocks, bits=bits)
    out = quant.dequantize_blocks(values, scales, bits=bits)
    if rotation_block_size is not None:
        out = rotation.rotate_blocks(out, rotation_block_size)
    return out.reshape(x.shape)


def _relative(approx: jax.Array, exact: jax.Array) -> jax.Array:
    return jnp.linalg.norm(approx - exact) / jnp.linalg.norm(exact)


@functools.partial(jax.jit, static_argnames=("bits", "block_size", "group_sizes"))
def reduction_errors(
    shards: jax.Array,
    n: jax.Array,
    *,
    bits: int,
    block_size: int,
    group_sizes: tuple[int, ...] = GROUP_SIZES,
) -> dict[str, jax.Array]:
    """Relative errors of the ring, one-shot and two-hop reductions of `n` shards.

    Args:
      shards: float32 `(max_n, size)`; the first `n` rows are summed (`size` a multiple of
        `block_size`).
      n: number of shards (devices), a traced int so one compilation serves every N.
      bits: bits per value on the wire.
      block_size: values per quantization block.
      group_sizes: devices per group (node) of the two-hop variants.

    Returns:
      `{method: relative error}` for `ring`, `one_shot` and `two_hop_g{g}` per group size.
    """
    size = shards.shape[1]

    def shard(k):
        return jax.lax.dynamic_index_in_dim(shards, k, keepdims=False)

    def qdq(x):
        return round_trip(x, bits=bits, block_size=block_size)

    zeros = jnp.zeros((size,), jnp.float32)

    def body(k, carry):
        exact, ring, one_shot, group_acc, two_hop = carry
        x = shard(k)
        exact = exact + x
        ring = jnp.where(k == 0, x, qdq(ring) + x)  # receive, dequantize, add, (re)quantize
        qx = qdq(x)
        one_shot = one_shot + qx
        new_acc, new_two = [], []
        for g, acc, two in zip(group_sizes, group_acc, two_hop, strict=True):
            acc = acc + qx  # hop 1: one-shot inside the group, float32 sum
            end = ((k + 1) % g == 0) | (k == n - 1)
            two = jax.lax.cond(end, lambda t, a: t + qdq(a), lambda t, a: t, two, acc)
            new_acc.append(jnp.where(end, zeros, acc))
            new_two.append(two)
        return exact, ring, one_shot, tuple(new_acc), tuple(new_two)

    init = (zeros, zeros, zeros, (zeros,) * len(group_sizes), (zeros,) * len(group_sizes))
    exact, ring, one_shot, _, two_hop = jax.lax.fori_loop(0, n, body, init)
    out = {"ring": _relative(ring, exact), "one_shot": _relative(one_shot, exact)}
    for g, two in zip(group_sizes, two_hop, strict=True):
        # With n <= g there is one group: a single (intra-node) hop, i.e. the one-shot sum.
        out[f"two_hop_g{g}"] = _relative(jnp.where(n <= g, one_shot, two), exact)
    return out


def error_rows(
    ns: Sequence[int],
    bits_list: Sequence[int] = (2, 4, 8),
    dists: Sequence[str] = DISTRIBUTIONS,
    *,
    size: int = 65536,
    block_size: int = 256,
    seed: int = 0,
    verbose: bool = False,
) -> list[dict[str, Any]]:
    """One row per (distribution, bits, N) with the relative error of every method."""
    if size % block_size:
        raise ValueError(f"size={size} must be a multiple of block_size={block_size}.")
    rows = []
    for dist in dists:
        shards = jnp.asarray(make_shards(dist, max(ns), size, seed))
        for bits in bits_list:
            start = time.perf_counter()
            for n in ns:
                errs = reduction_errors(shards, jnp.int32(n), bits=bits, block_size=block_size)
                row = dict(dist=dist, bits=bits, n=n)
                row.update({m: float(errs[m]) for m in METHODS})
                row["ring_over_one_shot"] = row["ring"] / row["one_shot"]
                rows.append(row)
            if verbose:
                print(
                    f"  {dist:<10} {bits} bits: N up to {max(ns)} in "
                    f"{time.perf_counter() - start:.1f} s",
                    flush=True,
                )
    return rows


# ------------------------------------------------------------- events for training


def inject_quantization_events(
    grads: Any,
    k: int | jax.Array,
    *,
    bits: int,
    block_size: int,
    key: jax.Array,
    mode: str = "ring",
    spread: float = 1.0,
    rotation_block_size: int | None = None,
) -> Any:
    """`grads` (a pytree of float arrays) after `k` extra quantization events.

    Re-quantizing an already quantized array with the same blocks changes almost nothing
    (its values already sit on the grid), so repeating `round_trip` k times would not model
    k events. Two honest models:

      * `mode="ring"`: what a ring of k + 1 workers does to their gradients. Each leaf `g`
        is split into k + 1 contributions `c_j = g / (k + 1) + spread * rms(g) / (k + 1)
        * z_j` (z_j standard normal, the worker's own noise; the last contribution is
        `g - sum of the others`, so they add up to `g` exactly). The partial sum runs
        the ring: `p = c_0`, then `p = round_trip(p) + c_j` for j = 1..k. Each event
        quantizes a different partial sum, as on the wire; the result is `g` plus the
        ring's quantization error.
      * `mode="shifted"`: k round trips of the leaf itself, each with the block
        boundaries shifted by a random offset (the array is rolled by a random amount
        in [0, block_size), quantized, dequantized and rolled back), so each event sees
        different blocks and scales. A milder model: no growing sums.

    Args:
      grads: pytree of float arrays (any shapes; the result keeps shapes and dtypes).
      k: number of events (a Python int or a traced int32 scalar; 0 returns `grads`).
      bits: a format of `quant.FORMATS`.
      block_size: values per block.
      key: PRNG key (noise for `ring`, offsets for `shifted`).
      mode: "ring" or "shifted".
      spread: `ring` only: a worker's gradient noise relative to its share of the
        gradient (0 gives identical workers).
      rotation_block_size: rotate every event's blocks with the block Hadamard rotation
        of this size before quantizing and back after (see `round_trip`); None: plain.

    Returns:
      A pytree like `grads`.
    """
    quant.check_bits(bits, block_size)
    if mode not in ("ring", "shifted"):
        raise ValueError(f"mode={mode!r}; expected 'ring' or 'shifted'.")
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    out = []
    for index, leaf in enumerate(leaves):
        leaf_key = jax.random.fold_in(key, index)
        x = jnp.asarray(leaf).astype(jnp.float32).reshape(-1)
        padded = quant.num_blocks(x.size, block_size) * block_size
        x = jnp.pad(x, (0, padded - x.size))
        qdq = functools.partial(
            round_trip, bits=bits, block_size=block_size, rotation_block_size=rotation_block_size
        )
        if mode == "ring":
            y = _ring_events(x, k, qdq, leaf_key, spread)
        else:
            y = _shifted_events(x, k, qdq, block_size, leaf_key)
        out.append(y[: leaf.size].reshape(leaf.shape).astype(leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def _ring_events(x, k, qdq, key, spread):
    k = jnp.asarray(k, jnp.int32)
    share = x / (k + 1).astype(jnp.float32)
    noise_scale = spread * jnp.sqrt(jnp.mean(x * x)) / (k + 1).astype(jnp.float32)

    def contribution(j):
        return share + noise_scale * jax.random.normal(jax.random.fold_in(key, j), x.shape)

    def body(j, carry):
        partial, given = carry  # ring partial sum; exact sum of the contributions so far
        c = jnp.where(j == k, x - given, contribution(j))
        partial = qdq(partial) + c
        return partial, given + c

    first = jnp.where(k == 0, x, contribution(0))
    partial, _ = jax.lax.fori_loop(1, k + 1, body, (first, first))
    return partial


def _shifted_events(x, k, qdq, block_size, key):
    def body(j, y):
        shift = jax.random.randint(jax.random.fold_in(key, j), (), 0, block_size)
        rolled = jnp.roll(y, shift)
        return jnp.roll(qdq(rolled), -shift)

    return jax.lax.fori_loop(0, jnp.asarray(k, jnp.int32), body, x)


def event_rows(
    ks: Sequence[int],
    bits_list: Sequence[int] = (2, 4, 8),
    *,
    size: int = 65536,
    block_size: int = 256,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """Relative error of `inject_quantization_events` on a gaussian vector, per k and mode."""
    x = jnp.asarray(sample("gaussian", np.random.default_rng([seed, 99]), (size,)))
    rows = []
    for bits in bits_list:
        for mode in ("ring", "shifted"):
            fn = jax.jit(
                functools.partial(
                    inject_quantization_events, bits=bits, block_size=block_size, mode=mode
                )
            )
            for k in ks:
                y = fn(x, jnp.int32(k), key=jax.random.key(seed + 2))
                rows.append(dict(bits=bits, mode=mode, k=k, rel_error=float(_relative(y, x))))
    return rows


# --------------------------------------------------------------------------- outputs


def errors_markdown(rows: Sequence[dict[str, Any]]) -> str:
    ns = sorted({r["n"] for r in rows})
    head = ["distribution", "bits", "method", *[f"N={n}" for n in ns]]
    body = []
    for dist in dict.fromkeys(r["dist"] for r in rows):
        for bits in sorted({r["bits"] for r in rows}):
            sel = {r["n"]: r for r in rows if r["dist"] == dist and r["bits"] == bits}
            if not sel:
                continue
            for m in (*METHODS, "ring_over_one_shot"):
                fmt = "{:.2f}x" if m == "ring_over_one_shot" else "{:.2e}"
                body.append([dist, bits, m, *[fmt.format(sel[n][m]) for n in ns]])
    return _common.markdown_table(head, body, "lll" + "r" * len(ns))


def events_markdown(rows: Sequence[dict[str, Any]]) -> str:
    ks = sorted({r["k"] for r in rows})
    head = ["bits", "mode", *[f"k={k}" for k in ks]]
    body = []
    for bits in sorted({r["bits"] for r in rows}):
        for mode in ("ring", "shifted"):
            sel = {r["k"]: r["rel_error"] for r in rows if r["bits"] == bits and r["mode"] == mode}
            body.append([bits, mode, *[f"{sel[k]:.2e}" for k in ks]])
    return _common.markdown_table(head, body, "ll" + "r" * len(ks))


def plot(rows: Sequence[dict[str, Any]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bits_list = sorted({r["bits"] for r in rows})
    fig, axes = plt.subplots(1, len(bits_list), figsize=(5 * len(bits_list), 4.4), squeeze=False)
    colors = dict(zip(METHODS, ("tab:red", "tab:blue", "tab:green", "tab:purple"), strict=True))
    styles = dict(zip(DISTRIBUTIONS, ("-", "--", ":"), strict=True))
    for ax, bits in zip(axes[0], bits_list, strict=True):
        for dist in dict.fromkeys(r["dist"] for r in rows):
            sel = sorted((r for r in rows if r["dist"] == dist and r["bits"] == bits), key=_n)
            for m in METHODS:
                ax.plot(
                    [r["n"] for r in sel],
                    [r[m] for r in sel],
                    color=colors[m],
                    ls=styles[dist],
                    marker="o",
                    ms=3,
                    label=f"{m}, {dist}",
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N (devices whose shards are summed)")
        ax.set_title(f"{bits}-bit blocks")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("||approx - exact|| / ||exact||")
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=c, marker="o", ms=3, label=m) for m, c in colors.items()]
    handles += [Line2D([], [], color="gray", ls=ls, label=d) for d, ls in styles.items()]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8)
    fig.suptitle("Relative error of a quantized reduction: ring (every hop) vs one-shot vs two-hop")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _n(row):
    return row["n"]


def main(argv: Sequence[str] | None = None) -> tuple[list, list]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-n", type=int, default=512, help="largest N (powers of two from 2)")
    p.add_argument("--size", type=int, default=65536, help="values per shard")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--bits", default="2,4,8")
    p.add_argument("--dists", default=",".join(DISTRIBUTIONS))
    p.add_argument("--max-k", type=int, default=64, help="largest k of the injected events")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=pathlib.Path, default=_common.study_dir("error_compounding"))
    args = p.parse_args(argv)
    ns = [2**i for i in range(1, int(math.log2(args.max_n)) + 1)]
    bits_list = [int(b) for b in args.bits.split(",")]
    dists = [d.strip() for d in args.dists.split(",")]
    ks = [0] + [2**i for i in range(int(math.log2(args.max_k)) + 1)]
    machine = _common.machine_line()
    print(f"error_compounding: {machine}")
    start = time.perf_counter()
    rows = error_rows(
        ns,
        bits_list,
        dists,
        size=args.size,
        block_size=args.block_size,
        seed=args.seed,
        verbose=True,
    )
    table = errors_markdown(rows)
    print()
    print(table)
    events = event_rows(ks, bits_list, size=args.size, block_size=args.block_size, seed=args.seed)
    events_table = events_markdown(events)
    print(events_table)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    setup = (
        f"{args.size} values per shard, block size {args.block_size}, seed {args.seed}; "
        "relative error ||approx - exact|| / ||exact|| against the float32 sum."
    )
    paths = [out / "error_compounding.md", out / "error_compounding.csv"]
    _common.write_text(
        paths[0],
        f"<!-- generated by experiments/error_compounding.py on {machine} -->\n\n{setup}\n\n"
        + table,
    )
    _common.write_csv(paths[1], rows)
    paths.append(out / "error_compounding.png")
    plot(rows, paths[-1])
    paths += [out / "quantization_events.md", out / "quantization_events.csv"]
    _common.write_text(
        paths[-2],
        f"<!-- generated by experiments/error_compounding.py on {machine} -->\n\n"
        f"inject_quantization_events on one gaussian vector: {setup}\n\n" + events_table,
    )
    _common.write_csv(paths[-1], events)
    _common.say_written(paths)
    print(f"error_compounding: {time.perf_counter() - start:.0f} s")
    return rows, events


# TODO(training study, to be run by the lead with `zeropp-train`): apply
# `inject_quantization_events(grads, k, bits=..., block_size=..., key=...)` to the gradient
# inside the train step for k in {0, 1, 2, 4, 8, ...} (mode="ring", the honest model of a
# ring of k + 1 workers) and find the smallest k at which the validation loss of the
# convergence run moves (e.g. by more than 1% against k = 0, same seed and data order).

if __name__ == "__main__":
    main()
