"""Training steps compiled for GPUs without a GPU: the target, the mesh over its topology,
the trainer's step of each engine from shapes, and the XLA options of a flag set.

Shared by `gpu_compile.py`, `gpu_compile_time.py`, `gpu_overhead.py` and
`remat_gathers.py`. Needs the CUDA plugin of the installed jaxlib (`plugin_pins`) but no
GPU and no driver: XLA's GPU compiler builds the program for a target described in
`experiments/gpu_targets/<gpu>.txtpb` (a `GpuTargetConfigProto` in text form) on a
topology of `nodes x 1 x GPUs per node` (deviceless ahead-of-time compilation:
`jax.experimental.topologies`).
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import re
from typing import Any

os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver on this machine
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host runs JAX; the GPU is a target

import _engines  # noqa: E402
from gpu_program import FLAG_SETS  # noqa: E402

TARGETS = pathlib.Path(__file__).resolve().parent / "gpu_targets"

DOC_FLAGS: dict[str, Any] = {
    "xla_gpu_enable_latency_hiding_scheduler": True,
    "xla_gpu_enable_pipelined_all_gather": True,
    "xla_gpu_enable_pipelined_reduce_scatter": True,
    "xla_gpu_enable_pipelined_all_reduce": True,
    "xla_gpu_enable_while_loop_double_buffering": True,
    "xla_gpu_all_gather_combine_threshold_bytes": None,  # one layer's bytes (layer_bytes)
    "xla_gpu_reduce_scatter_combine_threshold_bytes": None,
}
"""The seven XLA flags `docs/gpu_cluster.md` checked (`gpu_compile.py --flags-study`), as compiler
options (the `XLA_FLAGS` names without the dashes): the `docs` flag set of the table. The
docs recommend those that change the compiled step and list the others as not needed.
None: one layer's weights in bytes, per model."""

RENAMED: dict[str, tuple[str, str]] = {
    "xla_gpu_enable_pipelined_all_gather": ("xla_gpu_pipeline_all_gather", "ON"),
    "xla_gpu_enable_pipelined_reduce_scatter": ("xla_gpu_pipeline_reduce_scatter", "ON"),
    "xla_gpu_enable_pipelined_all_reduce": ("xla_gpu_pipeline_all_reduce", "ON"),
}
"""Options of `DOC_FLAGS` that newer jaxlibs replaced (jaxlib 0.12.0.1 has no
`xla_gpu_enable_pipelined_*`; its `xla_gpu_pipeline_*` take the enum
`CollectivePipeliningMode`: DEFAULT follows the optimization effort, OFF, ON considers
every structurally eligible collective, EXPLICIT only those marked pipelineable).
`compile_for` passes the new name, `True` as `COLLECTIVE_PIPELINING_MODE_ON` and `False`
as `..._OFF`, where the installed jaxlib refuses the old one."""


def target_config(gpu: str) -> str:
    """The `GpuTargetConfigProto` text of `gpu` (`experiments/gpu_targets/<gpu>.txtpb`)."""
    path = TARGETS / f"{gpu}.txtpb"
    if not path.exists():
        known = sorted(p.stem for p in TARGETS.glob("*.txtpb"))
        raise SystemExit(f"gpu_compile: no target config {path}; expected one of {known}.")
    return path.read_text()


def gpu_devices(gpu: str, nodes: int, local: int) -> list:
    """The devices of a `nodes x 1 x local` topology of `gpu`s (no GPU needed)."""
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=target_config(gpu), topology=f"{nodes}x1x{local}"
        )
    except Exception as e:  # the plugin is missing or refuses the config
        raise SystemExit(
            f"gpu_compile: cannot describe a CUDA topology ({type(e).__name__}: {e}); install "
            f"{plugin_pins()} (the installed jaxlib's version) and set "
            "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1."
        ) from None
    return list(topology.devices)


def plugin_pins() -> str:
    """The pip requirements of the CUDA plugin matching the installed jaxlib."""
    from importlib.metadata import version

    v = version("jaxlib")
    return f'"jax-cuda12-plugin[with-cuda]=={v}" "jax-cuda12-pjrt=={v}"'


def jax_text() -> str:
    """The `jax` column: the jax and CUDA plugin versions that compile the rows."""
    from importlib.metadata import version

    import jax

    return f"{jax.__version__}, plugin {version('jax-cuda12-plugin')}"


def renamed(options: dict[str, Any]) -> dict[str, Any]:
    """`options` with the names of `RENAMED` replaced (newer jaxlibs)."""
    out: dict[str, Any] = {}
    for name, value in options.items():
        if name in RENAMED:
            name, mode = RENAMED[name]
            value = f"COLLECTIVE_PIPELINING_MODE_{mode if value else 'OFF'}"
        out[name] = value
    return out


def compile_for(lowered: Any, options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """`lowered.compile(compiler_options=options)`, with the new names of `RENAMED` where
    this jaxlib has no such option (it refuses them before compiling anything); returns
    the compiled step and the options it took."""
    try:
        return lowered.compile(compiler_options=options), options
    except Exception as e:
        missing = re.search(r"No such compile option: '(\w+)'", str(e))
        if missing is None or missing.group(1) not in RENAMED:
            raise
    options = renamed(options)
    return lowered.compile(compiler_options=options), options


def gpu_mesh(gpu: str, nodes: int, local: int):
    """A `('node', 'local')` mesh (Auto axes) over a topology: node r = host r."""
    import numpy as np
    from jax.sharding import AxisType, Mesh

    devices = sorted(gpu_devices(gpu, nodes, local), key=lambda d: (d.process_index, d.id))
    grid = np.array(devices, dtype=object).reshape(nodes, local)
    return Mesh(grid, ("node", "local"), axis_types=(AxisType.Auto, AxisType.Auto))


# ------------------------------------------------------------------------- the steps


@dataclasses.dataclass
class Step:
    """A step to compile: the jitted callable, its abstract arguments, the estimate."""

    fn: Any
    state: Any
    batch: Any
    estimate: Any  # plan.estimate(..., platform="gpu")
    estimate_cpu: Any  # the CPU form, for comparison
    config: Any  # ZeroPPConfig, or None for XLA FSDP
    layer_bytes: int
    param_count: int


def model_args(model: str, n: int) -> list[str]:
    """The trainer's flags for `model` on `n` GPUs."""
    if model == "gpt":  # the trainer's default: tiny, scanned, no remat, batch 32
        return ["--batch", "32"]
    return ["--model", model, "--remat", "full", "--seq-len", "2048", "--batch", str(n)]


def build_step(engine: str, model: str, mesh: Any) -> Step:
    """The training step of `engine` for `model` on `mesh` (the trainer's `train_step` and
    AdamW chain), from shapes, with its memory estimates."""
    import jax
    import jax.numpy as jnp
    from _library import BATCH_SPEC
    from jax.sharding import NamedSharding

    from zeropp_jax.train import plan
    from zeropp_jax.train.cli import make_optimizer, train_step
    from zeropp_jax.train.flags import gpt_config, parse_args
    from zeropp_jax.train.model import GPT, init_fn, param_count

    nodes, local = mesh.devices.shape
    n = nodes * local
    args = parse_args(model_args(model, n))
    gpt = gpt_config(args)
    net, tx = GPT(gpt), make_optimizer(args)
    batch = jax.ShapeDtypeStruct(
        (args.batch, gpt.seq_len + 1), jnp.int32, sharding=NamedSharding(mesh, BATCH_SPEC)
    )
    kw = dict(batch=args.batch // n, seq=gpt.seq_len, mesh_shape=(nodes, local))
    d, f = gpt.d_model, gpt.mlp_ratio * gpt.d_model
    layer_bytes = 2 * (4 * d * d + 2 * d * f + 9 * d + f)
    state, make_step = _engines.build(
        engine,
        apply_fn=net.apply,  # the GPT pins its activations to the batch itself
        params=init_fn(gpt, 0),
        tx=tx,
        mesh=mesh,
        abstract=True,
    )
    fn = make_step(train_step)
    config = _engines.config_of(engine)  # None for XLA FSDP
    layouts = None if config is None else state.layouts[1]

    def estimate(platform):
        return plan.estimate(
            gpt, state=state, layouts=layouts, config=config, platform=platform, **kw
        )

    return Step(
        fn, state, batch, estimate("gpu"), estimate("cpu"), config, layer_bytes, param_count(gpt)
    )


def compiler_options(flags: str, layer_bytes: int) -> dict[str, Any]:
    """The XLA options of a flag set: `none`, or `docs` (`DOC_FLAGS`, one layer's bytes as
    the combine thresholds), each optionally followed by `+name=value` options of XLA's
    (`docs+xla_gpu_experimental_parallel_collective_overlap_limit=2`)."""
    base, *extra = flags.split("+")
    if base not in FLAG_SETS:
        raise SystemExit(
            f"gpu_compile: flag set {flags!r} starts with {base!r}; expected "
            f"one of {FLAG_SETS}, then optional '+name=value' options."
        )
    out = (
        {}
        if base == "none"
        else {k: (layer_bytes if v is None else v) for k, v in DOC_FLAGS.items()}
    )
    for option in extra:
        name, sep, value = option.partition("=")
        if not sep or not name.startswith("xla_"):
            raise SystemExit(
                f"gpu_compile: option {option!r} in {flags!r} is not 'xla_<name>=<value>'."
            )
        out[name] = {"true": True, "false": False}.get(value.lower(), value)
        if isinstance(out[name], str) and out[name].lstrip("-").isdigit():
            out[name] = int(out[name])
    return out
