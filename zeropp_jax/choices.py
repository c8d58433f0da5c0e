"""What a `ZeroPPConfig` implies for the island: the quantization codec, the gather spec
and the stochastic-rounding keys."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from zeropp_jax import weight_gather
from zeropp_jax.config import ZeroPPConfig
from zeropp_jax.quant import XLA_CODEC, Codec, is_float_format


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
    from zeropp_jax.kernels import pallas_codec

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


def rounding_key(config: ZeroPPConfig, step: jax.Array, leaf_index: int) -> jax.Array:
    """The stochastic-rounding key of one parameter leaf at one step (the same on every
    device; the gradient reduction folds in the device and the hop, see
    `reductions.hop_keys`): a pure function of `(config.rounding_seed, step, leaf_index)`."""
    key = jax.random.fold_in(jax.random.key(config.rounding_seed), step)
    return jax.random.fold_in(key, leaf_index)
