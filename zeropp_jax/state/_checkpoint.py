"""Checkpoints on orbax that restore onto another mesh or config.

`save_checkpoint(path, state)` writes the step, the float32 master parameters, the optax
state and the skipped-step counter (each as stored: rows padded to a multiple of the
device count) plus `zeropp.json` describing the parameter tree, into a staging folder
that is renamed to `path` only once complete: a crash mid-save leaves any previous
checkpoint at `path` loadable. With `ZeroPPConfig.error_feedback` it also writes the
error-feedback residuals (see `zeropp_jax.state._residuals`), and with
`ZeroPPConfig.weight_delta_bits` the weight-delta references (see `zeropp_jax._references`).

`restore_checkpoint(path, target)` loads onto `target`, a `TrainState` built by
`TrainState.create` on the mesh and config to restore onto. Padding rows are zero by
construction, so a leaf saved with `P_old` rows becomes `P_new` rows by dropping or adding
zero rows. Nothing derived from the old mesh is restored: the target's own fresh values
are kept for everything that is not in the list above. Error-feedback residuals are
restored as saved onto a mesh of the same shape; onto another mesh, what they owe the
gradients (their sum per parameter row) is spread evenly over the new devices; a target
without error feedback drops them (with a warning). Weight-delta references are restored as
saved onto a mesh of the same shape in the same compute dtype, so that a resumed run goes on
bit for bit; otherwise (or from a checkpoint without them) they are rebuilt from the
restored parameters by one full weight gather.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import uuid
import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from zeropp_jax._engine import TrainState
from zeropp_jax._mesh import data_parallel_size
from zeropp_jax.state import _optimizer_view as optimizer_view
from zeropp_jax.state import _partition as part
from zeropp_jax.state import _residuals as R
from zeropp_jax.state import _saved_layouts as L

FORMAT = "zeropp_jax.state._checkpoint/1"
STATE_DIR = "state"
META_FILE = "zeropp.json"
REFS_KEY = "weight_ref"
"""The saved tree's entry for the weight-delta references: leaf index (str) -> reference."""


def _saved_tree(state: TrainState, residuals: bool = True) -> dict[str, Any]:
    params, res = R.split(state.params)
    tree = {
        "step": state.step,
        "params": params,
        "opt_state": state.opt_state,
        "skipped_steps": state.skipped_steps,
    }
    if residuals and res is not None:
        tree["error_feedback"] = res
    return tree


def _saved_refs(state: TrainState) -> dict[str, Any] | None:
    """The weight-delta references by parameter leaf index (None without them)."""
    refs = state.weight_ref
    if refs is None:
        return None
    return {str(i): r for i, r in enumerate(refs) if r is not None}


def _refs_layout(state: TrainState) -> dict[str, Any] | None:
    """Which leaves have weight-delta references, their shapes and dtype (None without)."""
    refs = _saved_refs(state)
    if refs is None:
        return None
    return {
        "leaves": [int(i) for i in refs],
        "shapes": [list(r.shape) for r in refs.values()],
        "dtypes": [jnp.dtype(r.dtype).name for r in refs.values()],
    }


def _param_table(state: TrainState) -> list[list[Any]]:
    treedef, layouts = state.layouts
    paths = optimizer_view.param_paths(treedef, layouts)
    return [[p, list(lo.shape), lo.dtype] for p, lo in zip(paths, layouts, strict=True)]


def _metadata(state: TrainState) -> dict[str, Any]:
    cfg = state.config
    return {
        "format": FORMAT,
        "layout": part.LAYOUT_VERSION,
        "step": int(jax.device_get(state.step)),
        "mesh": {k: int(v) for k, v in state.mesh.shape.items()},
        "config": {
            k: (jnp.dtype(v).name if k == "compute_dtype" else v) for k, v in vars(cfg).items()
        },
        "params": _param_table(state),
        "opt_state_tree": str(jax.tree_util.tree_structure(state.opt_state)),
        "stored_shapes": [
            list(x.shape) for x in jax.tree_util.tree_leaves(_saved_tree(state, residuals=False))
        ],
        "error_feedback": _residual_layout(state),
        "weight_ref": _refs_layout(state),
        "model_split": [[lo.model_dim, lo.model_size] for lo in state.layouts[1]],
    }


def _residual_layout(state: TrainState) -> dict[str, list[bool]] | None:
    """Which leaves have residuals, per hop (None without error feedback)."""
    _, res = R.split(state.params)
    if res is None:
        return None
    layout: dict[str, Any] = {hop: [r is not None for r in res[hop]] for hop in ("hop1", "hop2")}
    layout["shapes"] = [list(x.shape) for x in jax.tree_util.tree_leaves(res)]
    return layout


def _is_main() -> bool:
    return jax.process_index() == 0


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def save_checkpoint(path: str | os.PathLike, state: TrainState, *, overwrite: bool = False) -> str:
    """Saves `state` to the folder `path`, atomically.

    Every process of a multi-process job must call it with the same shared `path`.

    Args:
      path: folder to create (its parent must exist or be creatable).
      state: a `zeropp_jax.TrainState`.
      overwrite: replace an existing checkpoint at `path` (the old one is removed only
        after the new one is complete).

    Returns:
      The absolute path written.

    Raises:
      ValueError: if `state` is not a zpp.TrainState, or `path` exists and not `overwrite`.
      OSError: when the write fails, e.g. on a full disk (orbax may raise its own
        `ValueError` or `RuntimeError` instead); the staging folder is then removed and
        `path` left as it was.
    """
    if not isinstance(state, TrainState):
        raise ValueError(f"save_checkpoint expects a zeropp_jax.TrainState, got {type(state)}.")
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not overwrite:
        raise ValueError(
            f"checkpoint path {path} already exists; pass overwrite=True or choose a new "
            "path (e.g. one folder per step)."
        )
    token = uuid.uuid4().hex[:8] if _is_main() else ""
    if jax.process_count() > 1:
        token = (
            multihost_utils.broadcast_one_to_all(np.frombuffer(token.encode().ljust(8), np.uint8))
            .tobytes()
            .decode()
            .strip()
        )
    staging = f"{path}.saving-{token}"
    if _is_main():
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        os.makedirs(staging)
    _sync("zeropp_ckpt_staging")
    try:
        tree = _saved_tree(state)
        refs = _saved_refs(state)
        if refs:
            tree[REFS_KEY] = refs
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(os.path.join(staging, STATE_DIR), tree)
        ckptr.wait_until_finished()
        ckptr.close()
        if _is_main():
            with open(os.path.join(staging, META_FILE), "w") as f:
                json.dump(_metadata(state), f, indent=1)
    except BaseException:
        # A full disk, an interrupt: the staging folder goes, anything at `path` stays.
        if _is_main():
            shutil.rmtree(staging, ignore_errors=True)
        raise
    if _is_main():
        old = None
        if os.path.exists(path):
            old = f"{path}.old-{token}"
            os.rename(path, old)
        os.rename(staging, path)
        if old:
            shutil.rmtree(old)
    _sync("zeropp_ckpt_done")
    return path


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The `zeropp.json` of a checkpoint (step, mesh, config, parameter table)."""
    meta_path = os.path.join(os.fspath(path), META_FILE)
    if not os.path.exists(meta_path):
        raise ValueError(
            f"{os.fspath(path)} is not a zeropp_jax checkpoint (no {META_FILE}); an "
            "interrupted save leaves only a '.saving-*' folder, which is never read."
        )
    with open(meta_path) as f:
        return json.load(f)


def _check_compatible(meta: dict[str, Any], target: TrainState) -> None:
    saved = {p: (tuple(s), d) for p, s, d in meta["params"]}
    want = {p: (tuple(s), d) for p, s, d in _param_table(target)}
    if saved != want:
        missing = sorted(set(want) - set(saved))
        extra = sorted(set(saved) - set(want))
        changed = sorted(p for p in set(saved) & set(want) if saved[p] != want[p])
        detail = []
        if missing:
            detail.append(f"missing from the checkpoint: {missing[:5]}")
        if extra:
            detail.append(f"not in the target: {extra[:5]}")
        if changed:
            p = changed[0]
            detail.append(
                f"{len(changed)} differ in shape/dtype, e.g. {p}: saved {saved[p]}, "
                f"target {want[p]}"
            )
        raise ValueError(
            "the checkpoint's parameter tree differs from the target's ("
            + "; ".join(detail)
            + "); build the target from the same model definition."
        )
    got = str(jax.tree_util.tree_structure(target.opt_state))
    if meta["opt_state_tree"] != got:
        raise ValueError(
            "the checkpoint's optimizer state has a different structure from the target's "
            "(was the optax chain changed?); build the target with the same optimizer."
        )


def restore_checkpoint(
    path: str | os.PathLike, target: TrainState, *, reset_optimizer: bool = False
) -> TrainState:
    """Restores the checkpoint at `path` onto `target`'s mesh and config.

    Checkpoints of the previous stored layout (version 1, stacked and tensor-parallel
    leaves padded in values rather than rows) restore by crop and pad too, optimizer
    moments included; an optimizer state leaf that read the old padded shapes (e.g.
    Adafactor's factored statistics) cannot, and the error says to pass
    `reset_optimizer=True`.

    Args:
      path: a folder written by `save_checkpoint`.
      target: a `TrainState.create(...)` on the mesh and config to restore onto, or a
        `TrainState.abstract(...)` (shapes only: nothing is built before the restore);
        its parameter tree and optimizer must match the saved ones.
      reset_optimizer: keep `target`'s own (fresh) optimizer state instead of the saved
        one; needs a target built by `TrainState.create`.

    Returns:
      `target` with step, parameters, optimizer state and skipped-step counter from the
      checkpoint, sharded for `target.mesh` (and, with `weight_delta_bits`, the saved
      references onto a mesh of the same shape and compute dtype, else references rebuilt
      from the restored parameters by a full weight gather).

    Raises:
      ValueError: for a folder that is not a checkpoint, or trees that differ.
    """
    if not isinstance(target, TrainState):
        raise ValueError(
            f"restore_checkpoint expects a zeropp_jax.TrainState target, got {type(target)}; "
            "build one with zpp.TrainState.create on the mesh and config to restore onto."
        )
    path = os.path.abspath(os.fspath(path))
    meta = read_metadata(path)
    _check_compatible(meta, target)
    want = _saved_tree(target, residuals=False)
    _check_optimizer_state(meta, target, want, reset_optimizer)
    leaves = _leaf_plans(meta, target, want)
    abstract_tree = _abstract_state(meta, target, want, leaves, reset_optimizer)
    keep_refs = _refs_match(meta, target)
    if meta.get("weight_ref"):
        abstract_tree[REFS_KEY] = _abstract_refs(meta["weight_ref"], target, keep_refs)
    loaded = _read_state(path, abstract_tree)
    # Called here, not in a helper: its warning names the caller of restore_checkpoint.
    residuals = _restored_residuals(loaded.pop("error_feedback", None), meta, target)
    loaded_refs = loaded.pop(REFS_KEY, None)
    fitted = [
        _fit_leaf(x, leaf, reset_optimizer)
        for x, leaf in zip(jax.tree_util.tree_leaves(loaded), leaves, strict=True)
    ]
    loaded = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(want), fitted)
    restored = target.replace(
        step=loaded["step"],
        params=R.join(loaded["params"], residuals),
        opt_state=loaded["opt_state"],
        skipped_steps=loaded["skipped_steps"],
        grads_finite=jax.device_put(jnp.array(True), NamedSharding(target.mesh, part.REPLICATED)),
    )
    return _with_references(restored, loaded_refs, keep_refs)


class _Leaf(NamedTuple):
    """How one leaf of the saved tree is read and fitted to the target's leaf."""

    shape: tuple[int, ...]  # as stored in the checkpoint
    target: Any  # the target's leaf: an array or a `jax.ShapeDtypeStruct`
    relayout: tuple[part.LeafLayout, part.LeafLayout] | None  # (saved, target) layouts
    is_opt: bool  # an optimizer state leaf
    stacked: part.LeafLayout | None  # the stacked parameter's layout it is or mirrors
    flat: bool  # a stacked leaf stored flat per layer (layouts 1 and 2)


def _leaf_keys(want: dict[str, Any]) -> list[str]:
    return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(want)[0]]


def _check_optimizer_state(
    meta: dict[str, Any], target: TrainState, want: dict[str, Any], reset_optimizer: bool
) -> None:
    """Raises where the saved optimizer state cannot be restored onto `target` as asked."""
    if reset_optimizer:
        if any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(want)):
            raise ValueError(
                "restore_checkpoint(..., reset_optimizer=True) keeps the target's optimizer "
                "state, but the target holds only shapes (TrainState.abstract); build it "
                "with TrainState.create."
            )
        return
    keys = _leaf_keys(want)
    shapes = [tuple(s) for s in meta["stored_shapes"]]
    is_opt = [k.startswith("['opt_state']") for k in keys]
    want_leaves = jax.tree_util.tree_leaves(want)
    opt = [
        (k, tuple(x.shape), s)
        for k, x, s, o in zip(keys, want_leaves, shapes, is_opt, strict=True)
        if o
    ]
    L.check_optimizer_layout(L.layout_version(meta), opt, target.opt_mirror or ())


def _leaf_plans(meta: dict[str, Any], target: TrainState, want: dict[str, Any]) -> list[_Leaf]:
    """Per leaf of the saved tree, its `_Leaf`: what was stored and how it is laid out again."""
    want_leaves = jax.tree_util.tree_leaves(want)
    shapes = [tuple(s) for s in meta["stored_shapes"]]
    is_opt = [k.startswith("['opt_state']") for k in _leaf_keys(want)]
    layouts = target.layouts[1]
    saved = L.saved_layouts(meta, layouts)
    owner = L.param_of(want, [p for p, _, _ in _param_table(target)])
    # Per leaf: (saved, target) layout of its parameter where the two split it over `model`
    # differently, split another axis over the data-parallel devices, or kept axis 0
    # whole where the other did not (layout 5, `partition.keeps_layers`); the layout of the
    # stacked parameter (not split over `model`) it is or mirrors, shaped as the target
    # stores it.
    relayouts = [
        None
        if i is None
        or (saved[i].model_dim, saved[i].model_size, saved[i].split, saved[i].stacked)
        == (layouts[i].model_dim, layouts[i].model_size, layouts[i].split, layouts[i].stacked)
        else (saved[i], layouts[i])
        for i in owner
    ]
    stacked = [
        layouts[i]
        if i is not None
        and layouts[i].stacked
        and not layouts[i].tensor_parallel
        and tuple(x.shape) == layouts[i].stored_shape
        else None
        for i, x in zip(owner, want_leaves, strict=True)
    ]
    flat = [
        lo is not None and r is None and L.is_flat_stacked(shape, lo)
        for shape, lo, r in zip(shapes, stacked, relayouts, strict=True)
    ]
    return [
        _Leaf(*a) for a in zip(shapes, want_leaves, relayouts, is_opt, stacked, flat, strict=True)
    ]


def _abstract_leaf(
    leaf: _Leaf, mesh: Mesh, n_dp: int, reset_optimizer: bool
) -> jax.ShapeDtypeStruct:
    """The shape, dtype and sharding one saved leaf is read with."""
    shape, tgt = leaf.shape, leaf.target
    sharding = tgt.sharding
    if leaf.is_opt and reset_optimizer:  # read as saved, then dropped
        return jax.ShapeDtypeStruct(shape, tgt.dtype, sharding=NamedSharding(mesh, part.REPLICATED))
    if leaf.relayout is not None:
        # Split over `model` differently (another model_size, or none): loaded split over
        # the data-parallel axes as saved where they divide it, else whole, then laid out
        # again.
        old = leaf.relayout[0]
        if shape != old.stored_shape and not L.is_flat_stacked(shape, old):
            raise ValueError(
                f"checkpoint leaf of shape {shape} does not have the shape of its saved "
                f"layout {old.stored_shape}; the checkpoint's metadata is inconsistent."
            )
        spec = part.manual_spec(old)
        if not _divides(shape, old, mesh):
            spec = part.REPLICATED
        return jax.ShapeDtypeStruct(shape, tgt.dtype, sharding=NamedSharding(mesh, spec))
    if leaf.flat:
        # A stacked leaf stored flat per layer (layouts 1 and 2): read as saved, then cut
        # to its values, shaped and padded in rows.
        spec = part.ROW_PARAM_SPEC if shape[1] % n_dp == 0 else part.REPLICATED
        return jax.ShapeDtypeStruct(shape, tgt.dtype, sharding=NamedSharding(mesh, spec))
    if shape != tuple(tgt.shape):
        # Padded for another device count (axis 0, or the last axis of a stacked leaf):
        # load sharded if that axis divides evenly over this mesh, else replicated (one
        # transient full copy of that leaf).
        axis = L.padded_axis(shape, tuple(tgt.shape))
        if axis is None:
            raise ValueError(
                f"checkpoint leaf of shape {shape} cannot be restored into a target leaf "
                f"of shape {tuple(tgt.shape)}."
            )
        if shape[axis] % n_dp:
            sharding = NamedSharding(mesh, part.REPLICATED)
    return jax.ShapeDtypeStruct(shape, tgt.dtype, sharding=sharding)


def _divides(shape: tuple[int, ...], old: part.LeafLayout, mesh: Mesh) -> bool:
    """Whether a leaf saved in layout `old`, of `shape`, splits evenly over `mesh` as
    `old` split it (its split axis over the data-parallel devices; split over two axes,
    each over its own mesh axis)."""
    if old.two_axis:
        a, b = old.padded_axis, old.padded_node_axis
        return not shape[a] % int(mesh.shape["local"]) and not shape[b] % int(mesh.shape["node"])
    return not shape[old.padded_axis % len(shape)] % data_parallel_size(mesh)


def _abstract_state(
    meta: dict[str, Any],
    target: TrainState,
    want: dict[str, Any],
    leaves: list[_Leaf],
    reset_optimizer: bool,
) -> dict[str, Any]:
    """The saved tree as orbax reads it (without the references), residuals included."""
    mesh = target.mesh
    n_dp = data_parallel_size(mesh)
    tree = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(want),
        [_abstract_leaf(leaf, mesh, n_dp, reset_optimizer) for leaf in leaves],
    )
    saved_res = meta.get("error_feedback")
    if saved_res is not None:
        tree["error_feedback"] = _abstract_residuals(saved_res, mesh)
    return tree


def _read_state(path: str, abstract_tree: dict[str, Any]) -> dict[str, Any]:
    """Reads the checkpoint's arrays as `abstract_tree` lays them out."""
    ckptr = ocp.StandardCheckpointer()
    loaded = ckptr.restore(os.path.join(path, STATE_DIR), abstract_tree)
    ckptr.close()
    return loaded


def _fit_leaf(x: jax.Array, leaf: _Leaf, reset_optimizer: bool) -> jax.Array:
    """One read leaf laid out, cropped or padded as the target stores it."""
    tgt, relayout, layout = leaf.target, leaf.relayout, leaf.stacked
    if leaf.is_opt and reset_optimizer:
        return tgt
    if layout is not None and L.is_flat_stacked(tuple(x.shape), layout) and relayout is None:
        return jax.jit(L.unflatten, static_argnums=(1, 2), out_shardings=tgt.sharding)(
            x, layout, layout
        )
    if relayout is not None:
        return jax.jit(L.relayout, static_argnums=(1, 2), out_shardings=tgt.sharding)(x, *relayout)
    if x.shape == tgt.shape:
        return x
    axis = L.padded_axis(tuple(x.shape), tuple(tgt.shape))
    return jax.jit(L.resize, static_argnums=(1, 2), out_shardings=tgt.sharding)(
        x, axis, tgt.shape[axis]
    )


def _with_references(restored: TrainState, loaded_refs: Any, keep: bool) -> TrainState:
    """`restored` with the saved weight-delta references when `keep`, else rebuilt."""
    if keep:
        # What every node held when the checkpoint was written: the next delta gather
        # sends what the uninterrupted run would have sent.
        refs = tuple(loaded_refs.get(str(i)) for i in range(len(restored.layouts[1])))
        return restored.replace(apply_fn=dataclasses.replace(restored.apply_fn, weight_ref=refs))
    # Onto another mesh or compute dtype (or from a checkpoint without references): rebuilt
    # from the restored parameters by one full gather.
    return restored.reset_weight_references()


def _same_split_axes(meta: dict[str, Any], target: TrainState) -> bool:
    """Whether the checkpoint split every leaf on the axis the target splits it on."""
    layouts = target.layouts[1]
    saved = L.saved_layouts(meta, layouts)
    return all(a.split == b.split for a, b in zip(saved, layouts, strict=True))


def _refs_match(meta: dict[str, Any], target: TrainState) -> bool:
    """Whether the checkpoint's weight-delta references are the target's as they are: the
    same mesh shape and split axes (so the same pieces in the same order) and, per leaf,
    shape and dtype."""
    saved, want = meta.get("weight_ref"), _saved_refs(target)
    if not saved or want is None:
        return False
    same_mesh = meta["mesh"] == {k: int(v) for k, v in target.mesh.shape.items()}
    same_axes = _same_split_axes(meta, target)
    layout = list(zip(saved["leaves"], map(tuple, saved["shapes"]), saved["dtypes"], strict=True))
    want_layout = [(int(i), tuple(r.shape), jnp.dtype(r.dtype).name) for i, r in want.items()]
    return same_mesh and same_axes and layout == want_layout


def _abstract_refs(saved: dict[str, Any], target: TrainState, keep: bool) -> dict[str, Any]:
    """The saved references' `jax.ShapeDtypeStruct`s: placed as the target's when `keep`,
    else spread over the target's devices where they divide (read, then dropped)."""
    mesh, n_dp = target.mesh, data_parallel_size(target.mesh)
    want = _saved_refs(target) or {}
    out = {}
    for i, shape, dtype in zip(saved["leaves"], saved["shapes"], saved["dtypes"], strict=True):
        if keep:
            sharding = want[str(i)].sharding
        else:
            spec = part.BATCH_SPEC if shape[0] % n_dp == 0 else part.REPLICATED
            sharding = NamedSharding(mesh, spec)
        out[str(i)] = jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype), sharding=sharding)
    return out


def _abstract_residuals(
    saved: dict[str, Any], mesh: Any
) -> dict[str, tuple[jax.ShapeDtypeStruct | None, ...]]:
    it = iter(tuple(s) for s in saved["shapes"])

    def one(present: bool) -> jax.ShapeDtypeStruct | None:
        if not present:
            return None
        shape = next(it)
        spec = R.SPEC if shape[0] % mesh.size == 0 else part.REPLICATED
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, spec))

    return {hop: tuple(one(p) for p in saved[hop]) for hop in ("hop1", "hop2")}


def _restored_residuals(loaded: Any, meta: dict[str, Any], target: TrainState) -> Any:
    """The target's residuals: as saved on a mesh of the same shape, else the saved ones'
    missing mass spread over the target's devices; the target's own (zeros) when nothing
    was saved."""
    _, fresh = R.split(target.params)
    if fresh is not None and any(
        isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(fresh)
    ):  # an abstract target: its zeros, made now
        fresh = R.zeros(target.layouts[1], target.plan, target.mesh)
    if fresh is None:
        if loaded is not None:
            warnings.warn(
                "the checkpoint holds error-feedback residuals but the target's config has "
                "error_feedback=None: they are dropped (the gradients they still owed are "
                "lost, a fraction of one step's rounding error).",
                stacklevel=3,
            )
        return None
    if loaded is None:
        return fresh
    shapes = [x.shape for x in jax.tree_util.tree_leaves(loaded)]
    same = jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(fresh) and (
        shapes == [x.shape for x in jax.tree_util.tree_leaves(fresh)]
    )
    same_axes = _same_split_axes(meta, target)
    if same and same_axes and meta["mesh"] == {k: int(v) for k, v in target.mesh.shape.items()}:
        return jax.tree_util.tree_map(lambda a, b: jax.device_put(a, b.sharding), loaded, fresh)
    old_nn, old_ll = meta["mesh"]["node"], meta["mesh"]["local"]
    old_n = old_nn * old_ll
    version = L.layout_version(meta)
    old_layouts = tuple(
        part.with_devices(lo, old_n, version=version, local_size=old_ll) for lo in target.layouts[1]
    )
    mass = R.missing_mass(loaded, old_layouts, old_nn, old_ll, flat_stacked=version < 3)
    if version < 3:
        mass = tuple(
            m
            if m is None or not L.is_flat_stacked(tuple(m.shape), old)
            else L.unflatten(m, old, new)
            for m, old, new in zip(mass, old_layouts, target.layouts[1], strict=True)
        )
    # Split on another axis here (another device count or layout version): laid out again.
    mass = tuple(
        jax.jit(L.relayout, static_argnums=(1, 2))(m, old, new)
        if m is not None and old.split != new.split and tuple(m.shape) == old.stored_shape
        else m
        for m, old, new in zip(mass, old_layouts, target.layouts[1], strict=True)
    )
    return R.respread(mass, target.layouts[1], target.plan, target.mesh)
