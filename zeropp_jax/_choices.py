"""What a `ZeroPPConfig` implies on one mesh, resolved once: `resolve(config, mesh)` is the
`Plan` that the island, the optimizer update, the weight-delta references and the
error-feedback residuals read (no other module reads the config's fields; a test checks),
with the quantization codec, the gather spec and the stochastic-rounding keys."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from zeropp_jax._config import ZeroPPConfig
from zeropp_jax.state import _partition as part
from zeropp_jax.wire import _weight_gather as weight_gather
from zeropp_jax.wire._encoding import Format
from zeropp_jax.wire.quant import XLA_CODEC, Codec, is_float_format


def mesh_platform(mesh: Any) -> str:
    """The platform of `mesh`'s devices ("cpu", "gpu", ...): what the island compiles for,
    whatever `jax.default_backend()` says (a CPU mesh on a GPU host is "cpu")."""
    return mesh.devices.flat[0].platform


def resolve_codec(config: ZeroPPConfig, platform: str | None = None) -> Codec:
    """The block-quantization implementation `config.kernels` asks for.

    "auto" is Pallas on GPU and XLA elsewhere; "pallas_interpret" runs the Pallas kernels
    in interpret mode (for CPU tests). `platform` defaults to `jax.default_backend()`.

    Raises:
      ValueError: for Pallas with an fp8 format, compiled Pallas off a GPU, or compiled
        Pallas with a block size that is not a power of two.
    """
    platform = platform or jax.default_backend()
    kind = config.kernels
    if kind == "auto":
        kind = "pallas" if platform == "gpu" else "xla"
    if kind == "xla":
        return XLA_CODEC
    formats = (
        config.weight_bits,
        config.weight_stage2_bits,
        config.grad_bits,
        config.grad_hop2_bits,
        config.weight_delta_bits,
    )
    fp8 = [f for f in formats if isinstance(f, str) and is_float_format(f)]
    if fp8:
        raise ValueError(
            f"ZeroPPConfig.kernels={config.kernels!r} resolves to the Pallas kernels, which "
            f"implement the integer formats only, but the config uses {fp8[0]!r}; use "
            "kernels='xla' for fp8 formats."
        )

    if kind == "pallas" and platform != "gpu":
        raise ValueError(
            f"ZeroPPConfig.kernels='pallas' needs a GPU, but the backend is {platform!r}; "
            "use kernels='xla' (or 'pallas_interpret' to run the kernels interpreted)."
        )
    if kind == "pallas":
        sizes = {
            "weight_block_size": config.weight_block_size,
            "grad_block_size": config.grad_block_size,
            "grad_node_block_size": config.grad_node_block_size,
        }
        for field, size in sizes.items():
            if size is not None and size & (size - 1):
                raise ValueError(
                    f"ZeroPPConfig.kernels={config.kernels!r} resolves to the compiled Pallas "
                    f"kernels, which tile blocks in powers of two, but {field}={size}; use a "
                    "power of two (64, 128, 256, 512) or kernels='xla'."
                )
    from zeropp_jax.wire.kernels import pallas_codec

    return pallas_codec(interpret=kind == "pallas_interpret")


def resolve_grad_reduce(config: ZeroPPConfig, platform: str | None = None) -> str:
    """`config.grad_reduce` with "auto" resolved: "ring" on CPU, "reduce_scatter" elsewhere.

    `platform` defaults to `jax.default_backend()`.
    """
    if config.grad_reduce != "auto":
        return config.grad_reduce
    platform = platform or jax.default_backend()
    return "ring" if platform == "cpu" else "reduce_scatter"


def gather_spec(
    config: ZeroPPConfig, codec: Codec, platform: str | None = None
) -> weight_gather.GatherSpec:
    """How every sharded weight is gathered and how its gradient is reduced."""
    return weight_gather.GatherSpec(
        hierarchical=config.hierarchical,
        weight_bits=config.weight_bits,
        weight_block_size=config.weight_block_size,
        weight_stage2_bits=config.weight_stage2_bits,
        grad_bits=config.grad_bits,
        grad_block_size=config.grad_block_size,
        grad_hop2_bits=config.grad_hop2_bits,
        grad_hop2_block_size=config.grad_hop2_block_size,
        two_hop=config.hierarchical
        or config.grad_bits is not None
        or config.grad_hop2_bits is not None,
        dtype=jnp.dtype(config.compute_dtype),
        codec=codec,
        flat_ring=resolve_grad_reduce(config, platform) == "ring",
        grad_rotation_block_size=config.grad_hop1_rotation_block_size,
        grad_hop2_rotation_block_size=config.grad_hop2_rotation_block_size,
    )


def rounding_key(seed: int, step: jax.Array, leaf_index: int) -> jax.Array:
    """The stochastic-rounding key of one parameter leaf at one step (the same on every
    device; the gradient reduction folds in the device and the hop, see
    `reductions.hop_keys`): a pure function of `(seed, step, leaf_index)`
    (`ZeroPPConfig.rounding_seed`)."""
    key = jax.random.fold_in(jax.random.key(seed), step)
    return jax.random.fold_in(key, leaf_index)


def feedback_hops(config: ZeroPPConfig, num_nodes: int, local_size: int) -> tuple[bool, bool]:
    """Whether hop 1 and hop 2 keep error-feedback residuals on this mesh.

    Raises:
      ValueError: when `config.error_feedback` is on but no hop of this mesh can carry it.
    """
    if config.error_feedback is None:
        return False, False
    hop1 = config.error_feedback == "all" and local_size > 1 and config.grad_bits is not None
    hop2 = num_nodes > 1 and config.grad_hop2_bits is not None
    if not (hop1 or hop2):
        raise ValueError(
            f"ZeroPPConfig.error_feedback={config.error_feedback!r} has no quantized gradient "
            f"hop to act on with a mesh of {num_nodes} node(s) x {local_size} device(s) "
            f"(grad_bits={config.grad_bits!r}, grad_node_bits={config.grad_node_bits!r}); "
            "use error_feedback='all' on a single-node mesh, or error_feedback=None."
        )
    return hop1, hop2


@dataclasses.dataclass(frozen=True)
class Plan:
    """A `ZeroPPConfig` resolved once for one mesh (`resolve`).

    Attributes:
      platform: of the mesh's devices.
      codec: the block-quantization implementation (`resolve_codec`).
      spec: how every sharded weight is gathered and its gradient reduced (`gather_spec`).
      compute_dtype: what the model computes in.
      num_nodes: the mesh's `node` axis.
      local_size: the mesh's `local` axis.
      check_vma: whether the island checks varying axes (Pallas calls carry none).
      prefetch: gather one use (one layer) ahead.
      shared_grad: "once", "per_use", or "auto" (decided per weight by
        `per_use_leaves`; "once" with error feedback).
      rounding_seed: the stochastic-rounding seed, or None when rounding to nearest.
      reference_bits: the format of the full gather that builds weight-delta references.
      delta_bits: the weight-delta gather's format, or None without weight deltas.
      weight_block_size: block size of both.
      feedback: `error_feedback` as configured ("all", "node" or None).
      feedback_hops: whether hop 1 and hop 2 keep error-feedback residuals.
      feedback_decay: what a kept residual is multiplied by after each step.
      feedback_reset: residuals are zeroed after every this many steps (0: never).
      skip_nonfinite: a step with non-finite gradients keeps the state.
    """

    platform: str
    codec: Codec
    spec: weight_gather.GatherSpec
    compute_dtype: jnp.dtype
    num_nodes: int
    local_size: int
    check_vma: bool
    prefetch: bool
    shared_grad: str
    rounding_seed: int | None
    reference_bits: Format | None
    delta_bits: Format | None
    weight_block_size: int
    feedback: str | None
    feedback_hops: tuple[bool, bool]
    feedback_decay: float
    feedback_reset: int
    skip_nonfinite: bool

    @property
    def num_devices(self) -> int:
        """Data-parallel devices (`node` x `local`)."""
        return self.num_nodes * self.local_size

    @property
    def stochastic_rounding(self) -> bool:
        return self.rounding_seed is not None

    @property
    def weight_delta(self) -> bool:
        return self.delta_bits is not None

    @property
    def error_feedback(self) -> bool:
        return any(self.feedback_hops)


class NothingSentWarning(UserWarning):
    """A quantized config on a mesh of one data-parallel device: nothing is sent, so the
    weight and gradient formats are not applied."""


def _sending_nothing(spec: weight_gather.GatherSpec, config: ZeroPPConfig) -> Any:
    """`spec` on one data-parallel device, where no gather or reduction sends anything:
    without its weight and gradient formats (quantizing would only lose precision and
    cost passes over every weight at every use), said once in a `NothingSentWarning`.
    Weight deltas keep theirs (their references are built in the configured format)."""
    quantized = (spec.weight_bits, spec.weight_stage2_bits, spec.grad_bits, spec.grad_hop2_bits)
    if config.weight_delta_bits is not None or all(f is None for f in quantized):
        return spec
    warnings.warn(
        "zeropp_jax: the mesh has one data-parallel device, so no weight gather or "
        "gradient reduction sends anything; the config's weight and gradient formats "
        f"({config.weight_bits!r}, {config.grad_bits!r}) are not applied (the step runs "
        "unquantized).",
        NothingSentWarning,
        stacklevel=4,
    )
    return dataclasses.replace(
        spec,
        weight_bits=None,
        weight_stage2_bits=None,
        grad_bits=None,
        grad_hop2_bits=None,
        grad_rotation_block_size=None,
        grad_hop2_rotation_block_size=None,
    )


PER_USE_ABOVE = 0.2
"""`shared_grad="auto"` reduces a shared weight's gradient per use where holding it whole
(its full size in the compute dtype, through the backward) would cost more than this
fraction of the device's stored float32 master weights. Set from the memory tables
(`experiments/memory.py`): "per_use" needed less memory for the trainer's 125M-1.3B GPTs on
2 x 4 (a tied table's gradient 1.2x-0.31x of the master weights per device) and for every
size on 16 x 8; "once" for the 6.7B on 2 x 4 (0.12x)."""


def per_use_leaves(plan: Plan, leaf_layouts: Sequence[part.LeafLayout]) -> frozenset[int]:
    """The parameter leaves whose gradient, if several equations read them, is reduced
    per use (see `ZeroPPConfig.shared_grad`): all of them, none, or, for "auto", those
    whose full size in the compute dtype exceeds `PER_USE_ABOVE` times the per-device
    stored master weights of all `leaf_layouts`."""
    if plan.shared_grad == "once":
        return frozenset()
    sharded = [i for i, lo in enumerate(leaf_layouts) if lo.sharded]
    if plan.shared_grad == "per_use":
        return frozenset(sharded)
    master = sum(4 * lo.padded_size for lo in leaf_layouts if lo.sharded) / plan.num_devices
    itemsize = plan.compute_dtype.itemsize
    return frozenset(i for i in sharded if itemsize * leaf_layouts[i].size > PER_USE_ABOVE * master)


def largest_per_use(plan: Plan, leaf_layouts: Sequence[part.LeafLayout]) -> bool:
    """Whether the largest leaf (a tied embedding's table) would have its gradient reduced
    per use (`per_use_leaves`): what the trainer and the memory tables report."""
    largest = max(range(len(leaf_layouts)), key=lambda i: leaf_layouts[i].size)
    return largest in per_use_leaves(plan, leaf_layouts)


@functools.lru_cache(maxsize=64)
def resolve(config: ZeroPPConfig, mesh: Any) -> Plan:
    """The `Plan` of `config` on `mesh` (a `('node', 'local'[, 'model'])` mesh).

    Raises:
      ValueError: where the config cannot run on this mesh's platform or axes (see
        `resolve_codec`, `feedback_hops`).
    """
    platform = mesh_platform(mesh)
    codec = resolve_codec(config, platform)
    num_nodes, local_size = mesh.shape["node"], mesh.shape["local"]
    spec = gather_spec(config, codec, platform)
    if num_nodes * local_size == 1:
        spec = _sending_nothing(spec, config)
    return Plan(
        platform=platform,
        codec=codec,
        spec=spec,
        compute_dtype=jnp.dtype(config.compute_dtype),
        num_nodes=num_nodes,
        local_size=local_size,
        check_vma=codec is XLA_CODEC,
        prefetch=config.prefetch,
        shared_grad=(
            "once"
            if config.shared_grad == "auto" and config.error_feedback is not None
            else config.shared_grad
        ),
        rounding_seed=config.rounding_seed if config.stochastic_rounding else None,
        reference_bits=config.weight_bits,
        delta_bits=config.weight_delta_bits,
        weight_block_size=config.weight_block_size,
        feedback=config.error_feedback,
        feedback_hops=feedback_hops(config, num_nodes, local_size),
        feedback_decay=config.error_feedback_decay,
        feedback_reset=config.error_feedback_reset,
        skip_nonfinite=config.skip_nonfinite_updates,
    )
