"""The differentiable weight gather: the full weight for compute in the forward pass, the
matching gradient reduction in the backward pass.

`gather_weight` (qwZ / hpZ gathers, qgZ or ZeRO-3 reductions) and
`gather_weight_from_reference` (the weight-delta gather of `zeropp_jax.wire._delta`) run inside
`jax.shard_map`; shapes are per device. Both take optional error-feedback residuals
(`zeropp_jax.wire._feedback`): their cotangents are the new residuals, which is how a residual
leaves the backward pass of an unchanged `jax.grad`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from zeropp_jax.wire import _feedback as feedback
from zeropp_jax.wire._encoding import Format, to_wire
from zeropp_jax.wire.collectives import (
    flat_all_gather,
    gather_from_secondary,
    requantize_secondary,
    secondary_gather,
)
from zeropp_jax.wire.quant import XLA_CODEC, Codec
from zeropp_jax.wire.reductions import TwoHop, flat_reduce_scatter, two_hop_reduce_scatter

SECONDARY_NAME = "zeropp_secondary"
"""`checkpoint_name` of the hpZ secondary shard (quantized values and scales, or raw bits)."""

Residuals = tuple[jax.Array | None, jax.Array | None] | tuple[()]
"""`()` (no error feedback) or `(hop1_residual, hop2_residual)`, see `zeropp_jax.wire._feedback`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GatherSpec:
    """Static description of one differentiable weight gather (hashable).

    Every format is resolved (`choices.gather_spec` reads the config's resolved
    properties): a format is a format of `quant.FORMATS` or None (unquantized).

    Attributes:
      hierarchical: two-stage gather through the secondary shard (hpZ) if True, else one
        flat gather over both axes in node-major order (ZeRO-3).
      weight_bits: format of the weight gather (qwZ): of stage 1 (over `node`) with hpZ,
        of the flat gather without.
      weight_block_size: values per quantization block on the weight gather.
      weight_stage2_bits: format of the second gather stage (over `local`, hpZ only).
        Equal to `weight_bits`, stage 2 gathers the stage-1 secondary shard as it is; any
        other format re-quantizes it (see `requantize_secondary`).
      grad_bits: format of the gradient reduction (qgZ): of hop 1 (over `local`) with
        the two-hop reduction, of the flat reduce-scatter without.
      grad_block_size: values per quantization block on gradient hop 1.
      grad_hop2_bits: format of gradient hop 2 (over `node`, two-hop only); the flat
        reduction needs it equal to `grad_bits`.
      grad_hop2_block_size: values per quantization block on gradient hop 2.
      two_hop: reduce gradients in two hops (local, then node) if True, else with one flat
        reduce-scatter over both axes in node-major order.
      dtype: dtype of the gathered weight (the compute dtype).
      codec: block quantization implementation.
      flat_ring: run an unquantized 16-bit flat reduction as a ring of collective-permutes
        (True) or as one reduce-scatter in `dtype` (False); see `ZeroPPConfig.grad_reduce`.
      grad_rotation_block_size: Hadamard rotation block of gradient hop 1 (two-hop only),
        or None for no rotation; see `zeropp_jax.wire._rotation`.
      grad_hop2_rotation_block_size: the same for gradient hop 2.
    """

    hierarchical: bool
    weight_bits: Format | None
    weight_block_size: int
    weight_stage2_bits: Format | None
    grad_bits: Format | None
    grad_block_size: int
    grad_hop2_bits: Format | None
    grad_hop2_block_size: int
    two_hop: bool
    dtype: jnp.dtype
    codec: Codec = XLA_CODEC
    flat_ring: bool = True
    grad_rotation_block_size: int | None = None
    grad_hop2_rotation_block_size: int | None = None

    def two_hop_spec(self) -> TwoHop:
        """What each hop of this two-hop gradient reduction sends (the format, block size
        and rotation of both hops, and the codec)."""
        return TwoHop(
            bits=self.grad_bits,
            block_size=self.grad_block_size,
            node_bits=self.grad_hop2_bits,
            node_block_size=self.grad_hop2_block_size,
            codec=self.codec,
            rotation_block_size=self.grad_rotation_block_size,
            node_rotation_block_size=self.grad_hop2_rotation_block_size,
        )


def gather_weight(
    x: jax.Array,
    spec: GatherSpec,
    key: jax.Array | None = None,
    residuals: Residuals = (),
) -> jax.Array:
    """Gathers a weight shard for compute; its gradient leaves through the matching
    reduction (qgZ when `spec.grad_bits` is set).

    With hpZ, stage 1 (the secondary shard, in wire form) is computed here and named
    `SECONDARY_NAME`, so a remat policy can save it; stage 2 runs inside a custom VJP.

    Under `jax.checkpoint` the backward pass re-gathers the weight. The custom VJP is
    declared with `optimize_remat=True`: the forward pass runs its primal function and the
    recompute runs its `fwd` rule, which emit the gather in two equivalent forms (see
    `_all_gather`); identical instructions would be merged by XLA's CSE once the remat
    barriers are expanded (XLA's CPU pipeline), keeping every full weight alive from the
    forward to the backward pass. The wire bytes and the values are the same.

    Args:
      x: per-device float32 master shard `(rows, ...)` in partition layout.
      spec: what to send.
      key: a PRNG key for stochastic rounding of the gradient reduction, the same on every
        device (see `reductions.hop_keys`); None rounds to nearest. Not differentiated.
      residuals: `()`, or `(hop1_residual, hop2_residual)` for error feedback on the
        two-hop reduction (see `zeropp_jax.wire._feedback`; None for a hop without). The forward
        pass ignores them; their cotangents are the new residuals.

    Returns:
      `(N * rows, ...)` in `spec.dtype`. The cotangent of `x` is the float32 sum over all
      devices of their gradients for this device's piece.
    """
    return _gather_full(x, secondary_wire(x, spec), key, residuals, spec)


def secondary_wire(x: jax.Array, spec: GatherSpec, named: bool = True) -> tuple[jax.Array, ...]:
    """Stage 1 of the hpZ gather (over `node`), in the wire form stage 2 gathers; `()` for
    the flat ZeRO-3 gather. Not differentiated; named `SECONDARY_NAME` (unless `named` is
    False: the caller names it).

    Args:
      x: per-device float32 master shard `(rows, ...)`.
      spec: what to send.
      named: whether to name the result `SECONDARY_NAME` here.

    Returns:
      The secondary shard as `secondary_gather` gives it (re-quantized when
      `spec.weight_stage2_bits` differs from `spec.weight_bits`), or `()`.
    """
    if not spec.hierarchical:
        return ()
    xc = lax.stop_gradient(x).astype(spec.dtype)
    wire = secondary_gather(
        xc, bits=spec.weight_bits, block_size=spec.weight_block_size, codec=spec.codec
    )
    wire = requantize_secondary(
        wire,
        x.shape,
        spec.dtype,
        bits=spec.weight_bits,
        local_bits=spec.weight_stage2_bits,
        block_size=spec.weight_block_size,
        codec=spec.codec,
    )
    return tuple(checkpoint_name(w, SECONDARY_NAME) for w in wire) if named else wire


def gather_weight_from_reference(
    x: jax.Array,
    reference: jax.Array,
    spec: GatherSpec,
    key: jax.Array | None = None,
    residuals: Residuals = (),
) -> jax.Array:
    """`gather_weight` for the weight-delta gather (`zeropp_jax.wire._delta`): the secondary
    shard is the kept `reference`, so only the intra-node stage 2 runs here.

    Stage 2 sends the reference in `spec.weight_stage2_bits` (quantized from the
    reference; None: its raw 16-bit values). The cotangent of `x` is the gradient
    reduction of `gather_weight`; `reference` is not differentiated.

    Args:
      x: per-device float32 master shard `(rows, ...)` (differentiated through).
      reference: per-device reference `(num_nodes * rows, ...)` in `spec.dtype`.
      spec: what to send (`spec.hierarchical` must be True).
      key: as for `gather_weight`.
      residuals: as for `gather_weight`.

    Returns:
      `(N * rows, ...)` in `spec.dtype`.
    """
    return _gather_full(x, reference_wire(x, reference, spec), key, residuals, spec)


def reference_wire(x: jax.Array, reference: jax.Array, spec: GatherSpec) -> tuple[jax.Array, ...]:
    """The weight-delta reference in the wire form of stage 2 (`spec.weight_stage2_bits`);
    no communication. Shapes as for `gather_weight_from_reference`."""
    if not spec.hierarchical:
        raise ValueError("gather_weight_from_reference needs GatherSpec.hierarchical=True.")
    ref = lax.stop_gradient(reference).astype(spec.dtype)
    wire = requantize_secondary(
        (to_wire(ref),),
        x.shape,
        spec.dtype,
        bits=None,
        local_bits=spec.weight_stage2_bits,
        block_size=spec.weight_block_size,
        codec=spec.codec,
    )
    return tuple(checkpoint_name(w, SECONDARY_NAME) for w in wire)


def gather_from_wire(
    x: jax.Array,
    wire: tuple[jax.Array, ...],
    spec: GatherSpec,
    key: jax.Array | None = None,
    residuals: Residuals = (),
) -> jax.Array:
    """`gather_weight` from a secondary `wire` computed beforehand (`secondary_wire` or
    `reference_wire`; `()` for the flat gather): the full weight, whose cotangent leaves
    through the gradient reduction. Shapes as for `gather_weight`."""
    return _gather_full(x, wire, key, residuals, spec)


def gather_many_from_wire(
    xs: Sequence[jax.Array],
    wires: Sequence[tuple[jax.Array, ...]],
    spec: GatherSpec,
    keys: Sequence[jax.Array | None],
    residuals: Sequence[Residuals],
    num_devices: int,
) -> list[jax.Array]:
    """`gather_from_wire` of several weights at once, whose gradients leave through one
    `reduce_gradients` (those that can share a reduction bucket do). Per weight, shapes,
    key and residuals as for `gather_from_wire`; `num_devices` is `N`."""
    if not xs:
        return []
    return list(
        _gather_many(tuple(xs), tuple(wires), tuple(keys), tuple(residuals), spec, num_devices)
    )


def gather_from(
    x: jax.Array, wire: tuple[jax.Array, ...], spec: GatherSpec, alternate_form: bool = False
) -> jax.Array:
    """The full weight `(N * rows, ...)` in `spec.dtype` from the shard `x` (flat ZeRO-3
    gather) or from the secondary `wire` (hpZ stage 2, over `local` only). Not
    differentiable; `alternate_form` as in `collectives.gather_from_secondary`."""
    if spec.hierarchical:
        return gather_from_secondary(
            wire,
            x.shape,
            spec.dtype,
            bits=spec.weight_stage2_bits,
            codec=spec.codec,
            alternate_form=alternate_form,
        )
    return flat_all_gather(
        x.astype(spec.dtype),
        bits=spec.weight_bits,
        block_size=spec.weight_block_size,
        codec=spec.codec,
        alternate_form=alternate_form,
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _gather_full(
    x: jax.Array,
    wire: tuple[jax.Array, ...],
    key: jax.Array | None,
    residuals: Residuals,
    spec: GatherSpec,
) -> jax.Array:
    """The full weight from the shard `x` (flat) or from the secondary `wire` (hpZ); `key`
    and `residuals` only feed the backward rule (stochastic rounding, error feedback)."""
    return gather_from(x, wire, spec, alternate_form=False)


def _gather_full_fwd(
    x: jax.Array,
    wire: tuple[jax.Array, ...],
    key: jax.Array | None,
    residuals: Residuals,
    spec: GatherSpec,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array | None, Residuals]]:
    # The residual `-0.0` (x + -0.0 == x for every float x, signed zeros and NaN included)
    # is what makes `optimize_remat` pick this rule for the recompute: JAX replaces a
    # `fwd` whose residuals are unused by the primal function, which is what happens in
    # the forward pass, where the policy saves no residual of this call.
    full = gather_from(x, wire, spec, alternate_form=True)
    return full, (jnp.array(-0.0, jnp.float32), key, residuals)


def _gather_full_bwd(
    spec: GatherSpec, res: tuple[jax.Array, jax.Array | None, Residuals], g: jax.Array
) -> tuple[jax.Array, None, None, Residuals]:
    negative_zero, key, residuals = res
    dx, new_residuals = reduce_gradient(g, spec, key, residuals)
    return dx + negative_zero, None, None, new_residuals


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _gather_many(
    xs: tuple[jax.Array, ...],
    wires: tuple[tuple[jax.Array, ...], ...],
    keys: tuple[jax.Array | None, ...],
    residuals: tuple[Residuals, ...],
    spec: GatherSpec,
    num_devices: int,
) -> tuple[jax.Array, ...]:
    """`_gather_full` of several weights, reduced together in the backward."""
    return tuple(
        gather_from(x, w, spec, alternate_form=False) for x, w in zip(xs, wires, strict=True)
    )


def _gather_many_fwd(
    xs: tuple[jax.Array, ...],
    wires: tuple[tuple[jax.Array, ...], ...],
    keys: tuple[jax.Array | None, ...],
    residuals: tuple[Residuals, ...],
    spec: GatherSpec,
    num_devices: int,
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, tuple, tuple]]:
    # The `-0.0` residual as in `_gather_full_fwd`.
    fulls = tuple(
        gather_from(x, w, spec, alternate_form=True) for x, w in zip(xs, wires, strict=True)
    )
    return fulls, (jnp.array(-0.0, jnp.float32), keys, residuals)


def _gather_many_bwd(
    spec: GatherSpec, num_devices: int, res: tuple[jax.Array, tuple, tuple], gs: tuple
) -> tuple[tuple[jax.Array, ...], None, None, tuple[Residuals, ...]]:
    negative_zero, keys, residuals = res
    reduced = reduce_gradients(list(gs), spec, list(keys), list(residuals), num_devices)
    return (
        tuple(dx + negative_zero for dx, _ in reduced),
        None,
        None,
        tuple(r for _, r in reduced),
    )


def reduce_gradient(
    g: jax.Array, spec: GatherSpec, key: jax.Array | None = None, residuals: Residuals = ()
) -> tuple[jax.Array, Residuals]:
    """The gradient reduction of a gathered weight (qgZ two-hop, or ZeRO-3's flat one).

    Args:
      g: per-device full-size gradient `(N * rows, ...)`, in partition order.
      spec: what to send.
      key: stochastic-rounding key (the same on every device) or None.
      residuals: as for `gather_weight`.

    Returns:
      `(dx, new_residuals)`: the float32 sum over all devices for this device's `(rows,
      ...)`, and the new error-feedback residuals (`()` without them).
    """
    if not spec.two_hop:
        rotated = (spec.grad_rotation_block_size, spec.grad_hop2_rotation_block_size)
        if key is not None or spec.grad_hop2_bits != spec.grad_bits or residuals or any(rotated):
            raise ValueError(
                "stochastic rounding, a hop-2 format other than grad_bits, error feedback "
                "and the gradient rotation need the two-hop gradient reduction "
                "(GatherSpec.two_hop=True)."
            )
        dx = flat_reduce_scatter(
            g,
            bits=spec.grad_bits,
            block_size=spec.grad_block_size,
            codec=spec.codec,
            ring=spec.flat_ring,
        )
        return dx, ()
    if residuals:
        dx, r1, r2 = feedback.two_hop_reduce_scatter_feedback(
            g, *residuals, spec.two_hop_spec(), key=key
        )
        return dx, (r1, r2)
    return two_hop_reduce_scatter(g, spec.two_hop_spec(), key=key), ()


def _block_unit(spec: GatherSpec) -> int:
    """Values per piece that every quantization block of `spec`'s reduction divides: the
    block sizes of its quantized hops (1 where nothing is quantized)."""
    sizes = [spec.grad_block_size if spec.grad_bits is not None else 1]
    if spec.two_hop:
        sizes.append(spec.grad_hop2_block_size if spec.grad_hop2_bits is not None else 1)
    return math.lcm(*sizes)


BUCKET_FLOOR = 1 << 18
"""Values a reduction bucket may always hold (1 MiB of float32), however small its
largest gradient: small gradients (a stack's biases and norm scales) then share one
reduction rather than each compiling its own (XLA:CPU compiles an all-to-all into a kernel
per peer and per array: issue #48's compile time)."""


def _buckets(
    sizes: Sequence[int], members: Sequence[int], floor: int = BUCKET_FLOOR
) -> list[list[int]]:
    """`members` (with `sizes` values each) cut, in order, into buckets of at most the
    largest one's values, or of `floor`: a bucket's reduction then holds no more at once
    than the largest gradient's alone, or `floor` values, so bucketing costs no peak memory
    beyond that (unbounded, ZeRO-3's 6.7B step on 16 x 8 held 3.832 GB per device against
    3.765)."""
    cap = max([*sizes, floor])
    out: list[list[int]] = []
    total = cap + 1
    for size, member in zip(sizes, members, strict=True):
        if total + size > cap:
            out.append([])
            total = 0
        out[-1].append(member)
        total += size
    return out


def reduce_gradients(
    gs: Sequence[jax.Array],
    spec: GatherSpec,
    keys: Sequence[jax.Array | None],
    residuals: Sequence[Residuals],
    num_devices: int,
) -> list[tuple[jax.Array, Residuals]]:
    """`reduce_gradient` of each gradient, those that can share one reduction bucketed.

    A bucket is gradients of one dtype, without a stochastic-rounding key or error feedback,
    consecutive, together at most as large as the largest of them or `BUCKET_FLOOR`
    (`_buckets`): concatenated piece by piece, each piece (`g.size / num_devices` values)
    zero-padded to a whole number of every quantization block, they go through one
    reduction (one collective per hop, as DeepSpeed's qgZ reduces a bucket), and each gets
    back its own values. Every block then holds the values it held alone, plus zeros where
    a piece smaller than a block was reduced alone in a smaller block (zeros change no
    block's scale), and every sum adds the same terms in the same order, so the result is
    that of the gradients reduced one by one, bit for bit, in fewer, larger collectives and
    one quantizer in the program rather than one per gradient. The padding is the only
    difference on the wire: a gradient whose piece is not a whole number of blocks sends
    less than one block unit (the hops' block sizes' least common multiple) more per device
    than alone. With a gradient rotation only gradients whose pieces are whole blocks share
    a bucket (a smaller block rotates in a smaller block). The others are reduced alone.

    Args:
      gs: per-device full-size gradients `(N * rows, ...)`, each in partition order.
      spec: what to send.
      keys, residuals: per gradient, as for `reduce_gradient`.
      num_devices: `N`, the data-parallel devices (`node` x `local`).

    Returns:
      Per gradient, `reduce_gradient`'s `(dx, new_residuals)`.
    """
    unit = _block_unit(spec)
    rotated = spec.two_hop and any(
        (spec.grad_rotation_block_size, spec.grad_hop2_rotation_block_size)
    )
    pieces = [g.size // num_devices for g in gs]
    padded = [-(-p // unit) * unit for p in pieces]
    out: list[tuple[jax.Array, Residuals] | None] = [None] * len(gs)
    kinds: dict[str, list[int]] = {}
    for i, (g, key, res) in enumerate(zip(gs, keys, residuals, strict=True)):
        whole = pieces[i] == padded[i]
        if key is None and not res and pieces[i] and (whole or not rotated):
            kinds.setdefault(jnp.dtype(g.dtype).name, []).append(i)
    sizes = [p * num_devices for p in padded]  # what each holds whole, per device
    buckets = [b for same in kinds.values() for b in _buckets([sizes[i] for i in same], same)]
    for members in buckets:
        if len(members) < 2:
            continue
        flat = jnp.concatenate(
            [
                jnp.pad(gs[i].reshape(num_devices, -1), ((0, 0), (0, padded[i] - pieces[i])))
                for i in members
            ],
            axis=1,
        )
        summed, _ = reduce_gradient(flat.reshape(-1), spec)
        at = 0
        for i in members:
            rows = (gs[i].shape[0] // num_devices, *gs[i].shape[1:])
            out[i] = (summed[at : at + pieces[i]].reshape(rows), ())
            at += padded[i]
    return [
        r if r is not None else reduce_gradient(g, spec, key, res)
        for r, g, key, res in zip(out, gs, keys, residuals, strict=True)
    ]


_gather_full.defvjp(_gather_full_fwd, _gather_full_bwd, optimize_remat=True)
_gather_many.defvjp(_gather_many_fwd, _gather_many_bwd, optimize_remat=True)
