"""How a checkpoint's saved leaves map onto a target state's stored layout.

A checkpoint records the stored layout version it was written in (`partition.LAYOUT_VERSION`),
its mesh and each parameter's `model` split. Restoring onto another mesh, split or layout
version changes a leaf's stored shape in one of three ways, each undone here (global
arrays, run under `jax.jit` by `zeropp_jax.state._checkpoint`):

- padded for another device count: the same rank, one axis longer or shorter
  (`padded_axis`, `resize`);
- split over `model` differently: back to the model's shape and laid out again
  (`relayout`);
- a stacked leaf stored flat per layer, `(layers, padded values)`, as layouts 1 and 2 did:
  cut to its values, shaped and padded in rows (`is_flat_stacked`, `unflatten`).

A leaf of the optimizer state that mirrors a parameter (an Adam moment) is carried over
like the parameter; `param_of` finds which one by the end of its key path.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from zeropp_jax.state import _partition as part


def layout_version(meta: dict[str, Any]) -> int:
    """The stored layout a checkpoint was written in (`partition.with_devices`): 1 for
    checkpoints without the field (written before the optimizer saw model shapes)."""
    version = int(meta.get("layout", 1))
    if version not in range(1, part.LAYOUT_VERSION + 1):
        raise ValueError(
            f"the checkpoint's stored layout is version {version}; this zeropp_jax reads "
            f"versions 1 to {part.LAYOUT_VERSION}: restore it with the zeropp_jax that wrote it."
        )
    return version


def saved_layouts(
    meta: dict[str, Any], layouts: tuple[part.LeafLayout, ...]
) -> list[part.LeafLayout]:
    """Per parameter leaf (the target's `layouts`), the layout it was saved with: its
    `model` split, the saved mesh's data-parallel size (and `local` size, for a row split
    over two axes) and the layout version (a checkpoint without `model_split` split
    nothing)."""
    local = int(meta["mesh"].get("local", 1))
    dp = int(meta["mesh"].get("node", 1)) * local
    split = meta.get("model_split") or [[None, 1]] * len(layouts)
    version = layout_version(meta)
    out = []
    for lo, (dim, k) in zip(layouts, split, strict=True):
        base = part.LeafLayout(lo.shape, lo.dtype, lo.sharded, 0)
        out.append(part.with_model_split(base, dim, int(k), dp, version=version, local_size=local))
    return out


def param_of(tree: Any, paths: list[str]) -> list[int | None]:
    """Per leaf of `tree` (a saved state's shapes), the index of the parameter it is or
    mirrors (an optimizer moment: its key path ends with the parameter's, e.g.
    `['opt_state'][0].mu['Dense_0']['kernel']`; the longest such path wins), else None."""
    out: list[int | None] = []
    for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = jax.tree_util.keystr(path)
        match = [i for i, p in enumerate(paths) if key.endswith(p)]
        out.append(max(match, key=lambda i: len(paths[i]), default=None))
    return out


def check_optimizer_layout(
    version: int, opt: list[tuple[str, tuple[int, ...], tuple[int, ...]]], mirror: tuple
) -> None:
    """Raises for a checkpoint of layout 1 whose optimizer state holds a leaf that is
    neither shaped as the target's nor a moment of a parameter (so crop and pad cannot
    carry it over): a transform that read the padded layout's shapes. `opt` is, per
    optimizer state leaf, `(key path, target shape, saved shape)`; `mirror` the target's
    `opt_mirror`."""
    if version >= 2:
        return
    for (key, have, saved), m in zip(opt, mirror, strict=True):
        if saved != have and m is None:
            raise ValueError(
                f"the checkpoint was written with stored layout 1, before the optimizer saw "
                f"the model's shapes, and its optimizer state leaf {key} (shape {saved}) "
                f"has no counterpart here (shape {have}); restore it with "
                "restore_checkpoint(path, target, reset_optimizer=True) to keep step and "
                "parameters and start the optimizer afresh, then save it again."
            )


def is_flat_stacked(saved: tuple[int, ...], layout: part.LeafLayout) -> bool:
    """Whether a saved leaf is a stacked leaf of `layout` (or a moment shaped like it)
    stored flat per layer, `(layers, values)`, as layouts 1 and 2 stored it."""
    return (
        layout.stacked
        and not layout.tensor_parallel
        and len(saved) == 2
        and saved[0] == layout.lead
        and saved[1] >= layout.cols
    )


def unflatten(x: jax.Array, saved: part.LeafLayout, new: part.LeafLayout) -> jax.Array:
    """A stacked leaf saved flat per layer, `(layers, padded values)` (layouts 1 and 2:
    each layer's values first, then its padding), -> layout `new`."""
    return part.to_master(x[:, : saved.cols].reshape(saved.shape), new)


def relayout(x: jax.Array, old: part.LeafLayout, new: part.LeafLayout) -> jax.Array:
    """A stored leaf (or a moment shaped like it) in layout `old` -> layout `new`; a stacked
    leaf saved flat per layer (layouts 1 and 2) is read as such."""
    if is_flat_stacked(tuple(x.shape), old):
        return unflatten(x, old, new)
    return part.to_master(part.from_master(x, old, jnp.float32), new)


def padded_axis(saved: tuple[int, ...], target: tuple[int, ...]) -> int | None:
    """The one axis in which a saved leaf differs from the target's (its padding for
    another device count), or None when they differ otherwise."""
    if len(saved) != len(target) or not saved:
        return None
    differ = [i for i, (a, b) in enumerate(zip(saved, target, strict=True)) if a != b]
    return differ[0] if len(differ) == 1 else None


def resize(x: jax.Array, axis: int, size: int) -> jax.Array:
    """`x` cropped or zero-padded along `axis` to `size`."""
    if x.shape[axis] >= size:
        return jax.lax.slice_in_dim(x, 0, size, axis=axis)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, pad)
