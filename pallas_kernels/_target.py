"""Which NVIDIA GPU the compiled kernels are lowered for on a machine without one.

Lowering a Triton kernel needs a target GPU. jax 0.10 takes the machine's GPU, else sm_90.
jax 0.11 and 0.12 take the machine's GPU, else the `abstract_device` of the abstract mesh
that the kernel was traced under (`jax.experimental.pallas.triton.get_gpu_info`), else
raise "No supported GPU devices found". `trace_for_gpu` gives them jax 0.10's target, an
NVIDIA H100 (sm_90): a mesh-less abstract mesh whose abstract device is that GPU.

A `shard_map` body is traced under the abstract mesh of the `shard_map`'s own mesh, whose
devices are this machine's; so a `shard_map` whose body calls the kernels takes its mesh
from `shard_map_mesh`, which puts it on the same abstract GPU.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import jax
from jax.sharding import AbstractMesh, Mesh

ABSTRACT_GPU_KIND = "NVIDIA H100"
"""The GPU the kernels are lowered for without one: sm_90, jax 0.10's fallback."""

_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


@functools.cache
def _target_from_abstract_device() -> bool:
    """Whether this jax lowers Triton kernels for the abstract device (jax 0.11 and newer)."""
    from jax.experimental.pallas import triton as pltriton

    return hasattr(pltriton, "get_gpu_info")


def _is_gpu(device: object) -> bool:
    return getattr(device, "platform", None) in _GPU_PLATFORMS


@contextlib.contextmanager
def trace_for_gpu() -> Iterator[None]:
    """Within: the compiled kernels trace and lower for an NVIDIA H100 where there is no GPU.

    Trace and lower inside it (`jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`):
    jax reads the target when it traces a kernel. Changes nothing where jax has a GPU to
    take the target from, or takes sm_90 itself (jax 0.10). A `shard_map` in the traced
    function gets its mesh from `shard_map_mesh`.
    """
    if not _target_from_abstract_device() or jax.default_backend() == "gpu":
        yield
        return
    device = jax.sharding.AbstractDevice(
        device_kind=ABSTRACT_GPU_KIND, num_cores=None, platform="cuda"
    )
    with jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=device)):
        yield


def shard_map_mesh(mesh: Mesh | AbstractMesh) -> Mesh | AbstractMesh:
    """The mesh for a `shard_map` whose body may call the compiled kernels.

    `mesh` itself, except under an abstract GPU (`trace_for_gpu`, or a
    `jax.sharding.use_abstract_mesh` whose `abstract_device` is a GPU) on jax 0.11 or newer
    while `mesh`'s devices are not GPUs: then `mesh`'s abstract mesh on that GPU, so that
    the kernels in the body lower for it.
    """
    if not _target_from_abstract_device():
        return mesh
    target = jax.sharding.get_abstract_mesh().abstract_device
    abstract = mesh if isinstance(mesh, AbstractMesh) else mesh.abstract_mesh
    if not _is_gpu(target) or _is_gpu(abstract.abstract_device):
        return mesh
    return abstract.update(abstract_device=target)
