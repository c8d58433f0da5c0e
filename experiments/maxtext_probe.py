"""MaxText's own decoder under `zpp.shard`: a tiny Llama-2 with MaxText's default layout.

On Python 3.12+ MaxText is imported as installed (`experiments/maxtext_env.sh` builds a
Python 3.13 venv with maxtext 0.2.5, jax 0.12.0.1 and the packages its decoder imports):

    bash experiments/maxtext_env.sh
    .venv313-maxtext/bin/python experiments/maxtext_probe.py --out DIR

On Python 3.11 (MaxText asks for 3.12+), it is read from a folder and backported at import
time:

    pip install --no-deps --ignore-requires-python --target /tmp/mt maxtext==0.2.5
    pip install --target /tmp/mtdeps pydantic omegaconf
    python experiments/maxtext_probe.py --maxtext /tmp/mt --deps /tmp/mtdeps

MaxText is not a dependency of this project; this probe is run by hand. It builds
`maxtext.models.models.transformer_as_linen` from MaxText's `base.yml` with a tiny Llama-2
(`decoder_block=llama2`, d_model 64, 2 layers, 4 heads, vocabulary 256, sequence 16),
`scan_layers=True`, MaxText's default `param_scan_axis=1` (each stacked weight stored with
its layer axis at 1; MaxText moves it to the front with a transpose before it scans),
`remat_policy=full`, float32. It trains 3 steps of next-token cross-entropy under
`zpp.shard` (ZeRO-3 unquantized, flat gathers, float32 compute, 2 x 4 mesh of emulated CPU
devices) against `jax.jit` on one device, with SGD and with Adam, and records from the
forward gathers of the communication ledger whether each stacked weight is gathered one
layer at a time, and any whole-gather warning.

On every Python, `maxtext.utils.sharding.maybe_shard_with_name` (MaxText's activation
sharding constraint, a `with_sharding_constraint` on MaxText's own mesh) returns its input
unchanged inside a `shard_map` with manual axes, where values are per device and MaxText's
mesh is not the one in context; outside (the one-device reference) it runs as MaxText
wrote it. MaxText's files are never edited.

Backports, on Python < 3.12 only, applied at import time:
  * MaxText's modules are compiled with Python 3.12's `type X = ...` statements rewritten
    as assignments;
  * `jax.experimental.xla_metadata.must_fuse_call` (newer jax; used only by MaxText's
    flash-attention kernel, which this config does not run) raises if called;
  * packages MaxText imports at module level but this model never calls (`STUBBED`) are
    stand-in modules.

Writes `maxtext_probe.md` into `--out` (default `experiments/results/maxtext_probe/`).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import pathlib
import re
import sys
import types
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

_common.request_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

STUBBED = (
    "aqt",
    "drjax",
    "grain",
    "pathwaysutils",
    "qwix",
    "sentencepiece",
    "sympy",
    "tiktoken",
    "tokamax",
    "transformers",
)
"""Packages MaxText imports at module level that this model never calls (stand-ins on
Python < 3.12 only)."""

SKIP_REASON = (
    "Without it (measured on Python 3.13, jax 0.12.0.1, maxtext 0.2.5), tracing the "
    "backward pass fails: transposing the constraint inside the engine's `shard_map` enters "
    "MaxText's mesh (12 axes of size 1) over the engine's manual 2 x 4 mesh and jax raises "
    "`ValueError: use_abstract_mesh cannot change the size of the mesh`. The constraint "
    "only places values on MaxText's mesh; it computes nothing, so the numbers are MaxText's."
)
"""Why `maybe_shard_with_name` is skipped inside `shard_map` (written into the results)."""

BACKPORTED = sys.version_info < (3, 12)
"""Whether MaxText needs the backports: it is written for Python 3.12+."""

LAYERS, WIDTH, HEADS, HEAD_DIM, MLP, VOCAB, SEQ, BATCH, STEPS = 2, 64, 4, 16, 128, 256, 16, 8, 3


# ----------------------------------------------------------------------------- backports


class _StubMeta(type):
    def __getattr__(cls, name: str) -> type:
        if name.startswith("__"):
            raise AttributeError(name)
        return _StubMeta(name, (_StubBase,), {})


class _StubBase(metaclass=_StubMeta):
    """A stand-in class: accepts any arguments, subclasses and `isinstance` work."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        for k, v in kwargs.items():
            setattr(self, k, v)

    def __init_subclass__(cls, **kwargs: object) -> None:
        pass


class _StubModule(types.ModuleType):
    """A stand-in module: capitalised attributes are classes, others submodules."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        if name[:1].isupper():
            sub: object = _StubMeta(name, (_StubBase,), {})
        else:
            sub = _StubModule(f"{self.__name__}.{name}")
            sub.__path__ = []
        setattr(self, name, sub)
        return sub

    def __call__(self, *args: object, **kwargs: object) -> _StubModule:
        return self

    def __or__(self, other: object) -> _StubModule:
        return self

    __ror__ = __or__

    def __getitem__(self, key: object) -> _StubModule:
        return self

    def __iter__(self):  # noqa: ANN204
        return iter(())

    def __mro_entries__(self, bases: tuple) -> tuple:
        return (_StubBase,)


_TYPE_STATEMENT = re.compile(r"^(\s*)type (\w+) = ", re.M)


class _Py311Loader(importlib.machinery.SourceFileLoader):
    def source_to_code(self, data, path, *, _optimize=-1):  # noqa: ANN001, ANN201
        text = data.decode() if isinstance(data, bytes) else data
        return compile(_TYPE_STATEMENT.sub(r"\1\2 = ", text), path, "exec", dont_inherit=True)


class _Backports(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):  # noqa: ANN001, ANN201
        top = name.split(".")[0]
        if top in STUBBED:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        if top != "maxtext":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and isinstance(spec.loader, importlib.machinery.SourceFileLoader):
            spec.loader = _Py311Loader(spec.loader.name, spec.loader.path)
        return spec

    def create_module(self, spec):  # noqa: ANN001, ANN201
        module = _StubModule(spec.name)
        module.__path__ = []
        module.__version__ = "0.0.0"
        return module

    def exec_module(self, module):  # noqa: ANN001, ANN201
        pass


def install_backports() -> None:
    """Makes MaxText importable on Python 3.11 (see the module docstring)."""
    sys.dont_write_bytecode = True  # keep the rewritten modules out of maxtext's caches
    sys.meta_path.insert(0, _Backports())
    import jax.experimental.xla_metadata as xla_metadata

    if not hasattr(xla_metadata, "must_fuse_call"):

        def must_fuse_call(*args: object, **kwargs: object) -> None:
            raise NotImplementedError("must_fuse_call needs a newer jax (maxtext_probe backport)")

        xla_metadata.must_fuse_call = must_fuse_call


def import_maxtext(folder: str | None, deps: str | None) -> types.ModuleType:
    """`maxtext` from `folder` (first on the path) or, without one, as installed; with the
    backports on Python < 3.12. `deps` goes after the interpreter's own packages."""
    if folder:
        sys.path.insert(0, folder)
    if deps:
        sys.path.append(deps)  # only what the interpreter lacks
    if BACKPORTED:
        install_backports()
    return importlib.import_module("maxtext")


def unconstrained_inside_shard_map() -> None:
    """Skips MaxText's activation sharding constraint inside the engine's `shard_map`.

    The constraint names MaxText's own mesh; inside the island (manual axes) values are per
    device. Outside it runs as MaxText wrote it. See `SKIP_REASON`.
    """
    import maxtext.utils.sharding as mts

    original = mts.maybe_shard_with_name

    def maybe_shard_with_name(inputs, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        mesh = jax.sharding.get_abstract_mesh()
        if not mesh.empty and jax.sharding.AxisType.Manual in mesh.axis_types:
            return inputs
        return original(inputs, *args, **kwargs)

    for name, module in list(sys.modules.items()):
        if name.startswith("maxtext") and getattr(module, "maybe_shard_with_name", 0) is original:
            module.maybe_shard_with_name = maybe_shard_with_name


# ----------------------------------------------------------------------------- the probe


def build(  # noqa: ANN201
    maxtext: types.ModuleType, param_scan_axis: int, heads: int = HEADS, head_dim: int = HEAD_DIM
):
    """`(model, params, names)`: MaxText's decoder, its unboxed parameters and the
    logical names of each."""
    import flax.linen as nn
    from maxtext.configs import pyconfig
    from maxtext.models import models
    from maxtext.utils import maxtext_utils

    unconstrained_inside_shard_map()
    overrides = dict(
        decoder_block="llama2",
        base_emb_dim=WIDTH,
        base_num_query_heads=heads,
        base_num_kv_heads=heads,
        base_mlp_dim=MLP,
        base_num_decoder_layers=LAYERS,
        head_dim=head_dim,
        vocab_size=VOCAB,
        max_target_length=SEQ,
        per_device_batch_size=1,
        scan_layers=True,
        param_scan_axis=param_scan_axis,
        remat_policy="full",
        attention="dot_product",
        dtype="float32",
        weight_dtype="float32",
        enable_checkpointing=False,
        skip_jax_distributed_system=True,
        hardware="cpu",
        run_name="maxtext_probe",
    )
    base = str(pathlib.Path(maxtext.__file__).parent / "configs" / "base.yml")
    cfg = pyconfig.initialize(["maxtext_probe", base] + [f"{k}={v}" for k, v in overrides.items()])
    mesh = jax.sharding.Mesh(
        maxtext_utils.create_device_mesh(cfg, devices=jax.devices()[:1]), cfg.mesh_axes
    )
    model = models.transformer_as_linen(cfg, mesh, quant=None)
    tokens = jnp.zeros((BATCH, SEQ), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(SEQ), (BATCH, SEQ))
    keys = {"params": jax.random.key(0), "dropout": jax.random.key(1), "aqt": jax.random.key(2)}
    with jax.set_mesh(mesh), nn.logical_axis_rules(cfg.logical_axis_rules):
        boxed = model.init(keys, tokens, positions, enable_dropout=False)["params"]
    names = {
        jax.tree_util.keystr(p): leaf.names
        for p, leaf in jax.tree_util.tree_flatten_with_path(
            boxed, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned)
        )[0]
    }
    return model, jax.tree.map(np.asarray, nn.unbox(boxed)), names  # uncommitted


def train_step(state, batch):  # noqa: ANN001, ANN201
    def loss(p):  # noqa: ANN001, ANN202
        logits = state.apply_fn({"params": p}, batch["tokens"], batch["positions"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), {"loss": value}


def batches() -> list[dict[str, np.ndarray]]:
    return _common.random_token_batches(STEPS, BATCH, SEQ, VOCAB)


def run(model, params, tx_name: str) -> dict:  # noqa: ANN001
    """Trains `STEPS` steps under `zpp.shard` and under `jax.jit`; returns the ledger, the
    whole-gather warnings and the largest relative differences."""
    from flax.training import train_state

    import zeropp_jax as zpp

    def apply(variables, tokens, positions):  # noqa: ANN001, ANN202
        return model.apply(variables, tokens, positions, enable_dropout=False)

    tx = optax.sgd(0.1) if tx_name == "sgd" else optax.adam(1e-2)
    config = zpp.ZeroPPConfig(
        weight_bits=None, grad_bits=None, hierarchical=False, compute_dtype=jnp.float32
    )
    state = zpp.TrainState.create(
        apply_fn=apply, params=params, tx=tx, mesh=zpp.make_mesh(2, 4), config=config
    )
    ref = train_state.TrainState.create(apply_fn=apply, params=params, tx=tx)
    step, ref_step = zpp.shard(train_step), jax.jit(train_step)
    data = batches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ledger = zpp.comm_ledger(step, state, data[0])
    whole_warnings = [str(w.message) for w in caught if "gather" in str(w.message).lower()]
    loss_err = 0.0
    for b in data:
        state, m = step(state, b)
        ref, rm = ref_step(ref, b)
        loss_err = max(loss_err, abs(float(m["loss"]) / float(rm["loss"]) - 1))
    got = jax.tree_util.tree_flatten_with_path(zpp.gather_params(state))[0]
    want = jax.tree_util.tree_leaves(ref.params)
    errs = {
        jax.tree_util.keystr(p): float(
            np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b)))
        )
        for (p, a), b in zip(got, want, strict=True)
    }
    stored = {
        path: "one row" if lo.sharded and not lo.stacked else "stacked"
        for path, lo in zip(
            [jax.tree_util.keystr(p) for p, _ in got], state.layouts[1], strict=True
        )
    }
    return {
        "ledger": ledger,
        "stored": {
            k: f"{v}, {tuple(lo.stored_shape)} split on axis {lo.padded_axis}"
            for (k, v), lo in zip(stored.items(), state.layouts[1], strict=True)
        },
        "warnings": whole_warnings,
        "loss_err": loss_err,
        "errs": errs,
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--maxtext",
        default=None,
        help="folder holding the maxtext package (default: the installed one; "
        "needed on Python < 3.12)",
    )
    p.add_argument("--deps", default=None, help="folder with pydantic and omegaconf (Python 3.11)")
    p.add_argument("--param-scan-axis", type=int, default=1, help="MaxText's default: 1")
    p.add_argument("--heads", type=int, default=HEADS, help=f"attention heads (default {HEADS})")
    p.add_argument(
        "--head-dim",
        type=int,
        default=HEAD_DIM,
        help=f"head width (default {HEAD_DIM}); --heads 3 --head-dim 12 stores the attention "
        "kernels (64, 2, 3, 12) as one row split on their axis 0 (no axis of a layer fits 8 "
        "devices), re-laid out locally for the scan",
    )
    p.add_argument("--out", default=str(_common.study_dir("maxtext_probe")))
    args = p.parse_args(argv)
    if args.maxtext is None and importlib.util.find_spec("maxtext") is None:
        p.error(f"maxtext is not installed for {sys.executable}: give --maxtext FOLDER")
    machine = _common.machine_line()
    maxtext = import_maxtext(args.maxtext, args.deps)
    version = importlib.metadata.version("maxtext")
    if BACKPORTED:
        how = "backported at import time, see `experiments/maxtext_probe.py`"
    else:
        how = "as installed, no backports"
    where = pathlib.Path(maxtext.__file__).parent
    model, params, names = build(maxtext, args.param_scan_axis, args.heads, args.head_dim)
    from _library import placement

    runs = {tx: run(model, params, tx) for tx in ("sgd", "adam")}
    ledger = runs["sgd"]["ledger"]
    forward = [r for r in ledger.records if r.phase == "forward" and r.op == "all-gather"]
    rows = []
    flat = [
        (jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]
    ]
    stacked = [(k, x) for k, x in flat if "layers" in names[k]]
    for key, leaf in stacked:
        whole = sum(
            1
            for r in forward
            if placement.WHOLE_SCOPE in r.op_name and r.out_bytes == 4 * leaf.size
        )
        rows.append(
            [
                key,
                str(tuple(leaf.shape)),
                str(names[key]),
                runs["sgd"]["stored"][key],
                4 * leaf.size // LAYERS,
                whole,
                f"{runs['sgd']['errs'][key]:.1e}",
                f"{runs['adam']['errs'][key]:.1e}",
            ]
        )
    head = [
        "stacked weight",
        "shape",
        "logical names",
        "stored (layout, global shape, split axis)",
        "one layer (B)",
        "whole-stack gathers",
        "max rel err SGD",
        "max rel err Adam",
    ]
    matrices = sum(4 * x.size // LAYERS for _, x in stacked if x.ndim > 2)
    in_loop = [r for r in forward if "/while/" in r.op_name]
    loop_bytes = sum(r.out_bytes for r in in_loop)
    loop_trips = sorted({r.trip_count for r in in_loop})
    text = (
        f"# MaxText's decoder under zpp.shard\n\n{machine}; maxtext {version} ({how}; "
        f"`{where}`).\n\n"
        f"`transformer_as_linen`, Llama-2 block, d_model {WIDTH}, {LAYERS} layers, {args.heads} "
        f"heads of {args.head_dim}, MLP {MLP}, vocabulary {VOCAB}, sequence {SEQ}, batch {BATCH}, "
        f"`scan_layers=True`, `param_scan_axis={args.param_scan_axis}`, `remat_policy=full`, "
        "float32; ZeRO-3 unquantized with flat gathers on a 2 x 4 mesh against `jax.jit` on "
        f"one device, {STEPS} steps (SGD 0.1; Adam 1e-2). Whole-gather warnings: "
        f"{len(runs['sgd']['warnings'])}. Largest relative loss difference: "
        f"SGD {runs['sgd']['loss_err']:.1e}, Adam {runs['adam']['loss_err']:.1e}. Largest "
        f"relative parameter difference over all leaves: SGD "
        f"{max(runs['sgd']['errs'].values()):.1e}, Adam {max(runs['adam']['errs'].values()):.1e}."
        "\n\nInside the forward layer loop the engine gathers "
        f"{loop_bytes} bytes per trip in {len(in_loop)} all-gathers (trip counts "
        f"{loop_trips}; {sum(x.ndim > 2 for _, x in stacked)} stacked matrices), against "
        f"{matrices} bytes in "
        "one layer of every stacked matrix: one gather per stacked matrix per trip, each "
        "stacked matrix gathered one layer at a time (layer 0 before the loop, layer i+1 "
        "in iteration i); "
        + (
            "no byte more than the unpadded layers."
            if loop_bytes == matrices
            else f"the excess, {loop_bytes - matrices} bytes, is layout padding."
        )
        + " The per-layer vectors "
        "(the norm scales) are gathered whole before the loop, by design, without a warning."
        "\n\nOne change to MaxText's behaviour, on every Python: its activation sharding "
        "constraint `maxtext.utils.sharding.maybe_shard_with_name` (a "
        "`with_sharding_constraint` to a `NamedSharding` on MaxText's own mesh) returns its "
        "input unchanged inside the engine's `shard_map`, where the mesh axes are manual and "
        "values are per device; outside it (the one-device reference) it runs as written. "
        + SKIP_REASON
        + "\n\nPer stacked weight (layer axis named `layers`): its whole stack's gathers "
        "under the engine's whole-gather scope, and the largest relative difference of its "
        "trained values against one device.\n\n" + _common.markdown_table(head, rows)
    )
    out = pathlib.Path(args.out)
    _common.write_text(out / "maxtext_probe.md", text)
    _common.say_written([out / "maxtext_probe.md"])


if __name__ == "__main__":
    main()
