"""How each sharded leaf of one island is gathered and its gradient reduced: `LeafGathers`,
the `dataflow.Gathers` that `zeropp_jax.interpreter._placement` runs the model with (built by
`zeropp_jax.interpreter._island` per step, with that step's keys, references and residuals).

Shapes: pieces are per device, flattened (see `partition`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name

from zeropp_jax import _tensor_parallel as tensor_parallel
from zeropp_jax.interpreter import _dataflow as dataflow
from zeropp_jax.interpreter import _relayout as relayout
from zeropp_jax.state import _blocks as blocks
from zeropp_jax.state import _partition as part
from zeropp_jax.wire import _weight_gather as weight_gather
from zeropp_jax.wire import reductions


def per_leaf(values: list[Any], present: list[bool]) -> tuple[Any, ...]:
    """`values` spread over the leaves where `present`, None elsewhere."""
    it = iter(values)
    return tuple(next(it) if on else None for on in present)


def residuals_per_leaf(
    res: tuple[list[jax.Array], list[jax.Array]],
    res_at: tuple[tuple[bool, bool], ...],
    leaf_layouts: tuple[part.LeafLayout, ...],
) -> tuple[weight_gather.Residuals, ...]:
    """Per leaf, its error-feedback residuals `(hop1, hop2)` (either None where absent),
    or `()` for a leaf that has none; `res` holds the present ones in leaf order and
    `res_at` says, per leaf, which are present."""
    r1, r2 = iter(res[0]), iter(res[1])
    out: list[weight_gather.Residuals] = []
    for i, lo in enumerate(leaf_layouts):
        has1, has2 = res_at[i] if res_at and lo.sharded else (False, False)
        if has1 or has2:
            out.append((next(r1) if has1 else None, next(r2) if has2 else None))
        else:
            out.append(())
    return tuple(out)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["key", "ref", "residuals"],
    meta_fields=["layout", "num_devices"],
)
@dataclasses.dataclass(frozen=True)
class LeafState:
    """What one leaf's gathers and gradient reduction read beside its piece: a pytree of
    traced values the interpreter passes along explicitly.

    Only the residuals are differentiated: their cotangent is the new residuals
    (`cotangent`); the key and reference get zero cotangents.

    Attributes:
      key: the leaf's stochastic-rounding key this step, or None (rounding to nearest).
      ref: the leaf's weight-delta reference, per device (`(num_nodes * padded / N,)`,
        see `zeropp_jax.wire._delta`), or None without weight deltas.
      residuals: the leaf's error-feedback residuals `(hop1, hop2)` (either None where
        absent; per-device pieces of the whole leaf, like `ref`), or `()` without.
      layout: the layout `ref` and `residuals` are in: the leaf's stored one, or the
        stack's after a relayout (`relaid`).
      num_devices: data-parallel devices.
    """

    key: Any
    ref: jax.Array | None
    residuals: weight_gather.Residuals
    layout: part.LeafLayout
    num_devices: int

    @property
    def has_reference(self) -> bool:
        """Whether the leaf's wire is read from a kept weight-delta reference (no
        communication: a loop computes it again where needed rather than keeping it)."""
        return self.ref is not None

    def layer(self, i: Any) -> LeafState:
        """What the gather and reduction of layer `i` (traced; along axis 0 of the stack
        `layout` describes) read: the reference and residuals cut to that layer's pieces
        (`_blocks.layer_of_pieces`); the key as is (the reduction folds the layer in)."""
        piece = self.layout.padded // self.num_devices

        def cut(x: jax.Array) -> jax.Array:
            return blocks.layer_of_pieces(x, self.layout.lead, piece, i)

        ref = None if self.ref is None else cut(self.ref)
        return dataclasses.replace(
            self, ref=ref, residuals=jax.tree_util.tree_map(cut, self.residuals)
        )

    def relaid(self, axis: int) -> LeafState:
        """Re-laid out as `relayout.layers_to_front` does the leaf's shard for a scan over
        `axis`.

        Raises:
          ValueError: for a leaf with residuals (their new values would need the same
            all-to-all back; the interpreter gathers such a leaf whole instead).
        """
        if self.residuals:
            raise ValueError(
                f"LeafState.relaid(axis={axis}): a leaf with error-feedback residuals cannot "
                "be re-laid out; gather it whole (a scan over its axis 0 needs no relayout)."
            )
        layout = relayout.layout(self.layout, axis, self.num_devices)
        if self.ref is None:
            return dataclasses.replace(self, layout=layout)
        ref = relayout.reference_to_front(self.ref, self.layout, axis)
        return dataclasses.replace(self, ref=ref, layout=layout)

    def cotangent(self, residuals: weight_gather.Residuals) -> LeafState:
        """The state's cotangent for a gradient reduction that returned `residuals`: zero
        for the key and reference, `residuals` (the new ones) for the residuals."""
        key, ref = jax.tree_util.tree_map(dataflow.zero_cotangent, (self.key, self.ref))
        return dataclasses.replace(self, key=key, ref=ref, residuals=residuals)


@dataclasses.dataclass(frozen=True)
class LeafGathers:
    """The `dataflow.Gathers` of one island: how each sharded leaf is gathered and how its
    gradient is reduced. Pieces are per device, flattened (see `partition`).

    Attributes:
      layouts: per parameter leaf.
      names: per parameter leaf, its path (for warnings).
      spec: the gather spec of the config.
      num_devices: data-parallel devices of the mesh (`node` x `local`).
      check_vma: whether the island checks varying axes (tensor-parallel leaves run their
        collectives in a nested shard_map over `model` that checks alike).
      states: per leaf, its `LeafState` (traced).
      barrier_ties: whether `dataflow.tie` orders with `lax.optimization_barrier` (the
        mesh's devices are GPUs, whose compiler keeps it) rather than a `-0.0` add.
      hold_recomputed: whether a use inside a remat block holds the weights its recompute
        gathered for its backward rather than gathering them again (the mesh's devices
        are GPUs; see `dataflow.Gathers`).
      peel_in_branch: whether the backward loop's peeled last layer runs inside a
        `lax.cond` where the body recomputes (the mesh's devices are CPUs; see
        `dataflow.Gathers`).
    """

    layouts: tuple[part.LeafLayout, ...]
    names: tuple[str, ...]
    spec: weight_gather.GatherSpec
    num_devices: int
    check_vma: bool
    states: tuple[LeafState, ...]
    barrier_ties: bool = False
    hold_recomputed: bool = False
    peel_in_branch: bool = False

    def layout(self, leaf: int) -> part.LeafLayout:
        return self.layouts[leaf]

    def name(self, leaf: int) -> str:
        return self.names[leaf]

    def state(self, leaf: int) -> LeafState:
        return self.states[leaf]

    def _per_rank(self, leaf: int, fn: Any, split: tuple, shared: tuple) -> Any:
        """`fn(*split, *shared)`, once per `model` rank for a tensor-parallel leaf (its
        pieces carry the `model` slices on axis 0)."""
        if not self.layouts[leaf].tensor_parallel:
            return fn(*split, *shared)
        return tensor_parallel.per_model_rank(fn, split, shared, self.check_vma)

    def wire(self, leaf: int, piece: jax.Array, state: LeafState) -> tuple[jax.Array, ...]:
        ref = state.ref
        if ref is None:
            if not self.layouts[leaf].tensor_parallel:
                return weight_gather.secondary_wire(piece, self.spec)
            # Named outside the nested shard_map: a remat policy then saves or recomputes
            # that shard_map whole (JAX cannot split a nested shard_map for remat).
            fn = lambda p: weight_gather.secondary_wire(p, self.spec, named=False)  # noqa: E731
            wire = self._per_rank(leaf, fn, (piece,), ())
            return tuple(checkpoint_name(w, weight_gather.SECONDARY_NAME) for w in wire)
        # Read once the piece exists (ordered like the gathers that read the shard).
        ref = dataflow.tie(piece, ref, barrier=self.barrier_ties)
        return weight_gather.reference_wire(piece, ref, self.spec)

    def gather(
        self,
        leaf: int,
        piece: jax.Array,
        wire: tuple[jax.Array, ...],
        state: LeafState,
        alternate: bool,
    ) -> jax.Array:
        def fn(p, w):
            return weight_gather.gather_from(p, w, self.spec, alternate_form=alternate)

        return self._per_rank(leaf, fn, (piece, wire), ())

    def reduce(
        self,
        leaves: Sequence[int],
        gs: Sequence[jax.Array],
        states: Sequence[LeafState],
        layer: jax.Array | None,
    ) -> list[tuple[jax.Array, weight_gather.Residuals]]:
        keys = [
            jax.random.fold_in(s.key, layer) if s.key is not None and layer is not None else s.key
            for s in states
        ]
        split = [self.layouts[leaf].tensor_parallel for leaf in leaves]
        plain = [k for k, tp in enumerate(split) if not tp]
        reduced = iter(
            weight_gather.reduce_gradients(
                [gs[k] for k in plain],
                self.spec,
                [keys[k] for k in plain],
                [states[k].residuals for k in plain],
                self.num_devices,
            )
        )

        def per_rank(leaf, g, key):
            def fn(g, key):
                key = reductions.model_rank_key(key, axis_name=part.MODEL_AXIS)
                return weight_gather.reduce_gradient(g, self.spec, key)[0]

            return self._per_rank(leaf, fn, (g,), (key,)), ()

        return [
            per_rank(leaf, g, key) if tp else next(reduced)
            for leaf, g, key, tp in zip(leaves, gs, keys, split, strict=True)
        ]

    def full(
        self,
        leaves: Sequence[int],
        pieces: Sequence[jax.Array],
        wires: Sequence[tuple[jax.Array, ...]],
        states: Sequence[LeafState],
    ) -> list[jax.Array]:
        def per_rank(p, w, key):
            key = reductions.model_rank_key(key, axis_name=part.MODEL_AXIS)
            return weight_gather.gather_from_wire(p, w, self.spec, key)

        out: list[jax.Array | None] = [None] * len(leaves)
        plain = [k for k, leaf in enumerate(leaves) if not self.layouts[leaf].tensor_parallel]
        for k, leaf in enumerate(leaves):
            if k not in plain:  # tensor-parallel: gathered and reduced once per `model` rank
                out[k] = self._per_rank(leaf, per_rank, (pieces[k], wires[k]), (states[k].key,))
        together = weight_gather.gather_many_from_wire(
            [pieces[k] for k in plain],
            [wires[k] for k in plain],
            self.spec,
            [states[k].key for k in plain],
            [states[k].residuals for k in plain],
            self.num_devices,
        )
        for k, full in zip(plain, together, strict=True):
            out[k] = full
        return out
