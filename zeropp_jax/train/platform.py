"""The process and its devices: emulated CPU devices, `jax.distributed`, and the
`('node', 'local')` mesh the trainer's flags describe."""

from __future__ import annotations

import argparse
import importlib.util
import os

from zeropp_jax.train.flag_types import UsageError

_ACCELERATOR_PLUGINS = (
    "jax_cuda13_plugin",
    "jax_cuda12_plugin",
    "jax_rocm7_plugin",
    "jax_rocm60_plugin",
    "libtpu",
)


def will_run_on_cpu() -> bool:
    """Whether JAX's default backend will be the CPU (decided without initialising it)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip().lower() == "cpu"
    return not any(importlib.util.find_spec(name) for name in _ACCELERATOR_PLUGINS)


def configure_host_devices(args: argparse.Namespace) -> None:
    """Emulates several CPU devices when the job will run on the CPU.

    Sets `--xla_force_host_platform_device_count` in XLA_FLAGS (8 per job by default, or
    `--local` per process) unless the user set it. No other XLA flag is set: the engine
    orders its gathers by data dependencies, so the default scheduler keeps about one
    layer's full weights (tests/test_memory.py). Must run before JAX initialises its
    backends; it changes nothing once they are up.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if not will_run_on_cpu():
        return
    if "xla_force_host_platform_device_count" in flags:
        return
    processes = args.num_processes or 1
    if processes > 1:
        count = args.local or max(1, 8 // processes)
    elif args.nodes is not None and args.local is not None:
        count = args.nodes * args.local
    else:
        count = 8
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()


def initialize_distributed(args: argparse.Namespace) -> None:
    """Starts `jax.distributed` when the flags ask for it, or when the process was started
    by `python -m zeropp_jax.launch` (which sets the `ZEROPP_*` variables)."""
    import jax

    if args.coordinator is not None:
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            heartbeat_timeout_seconds=30,
        )
    elif args.distributed:
        jax.distributed.initialize()
    else:  # started by `python -m zeropp_jax.launch`, or single-process
        from zeropp_jax import launch

        launch.initialize_from_env()


def _launched_on_loopback(args: argparse.Namespace) -> bool:
    """Whether `python -m zeropp_jax.launch` started this process (and no flag overrides it)."""
    from zeropp_jax import launch

    started = launch.ENV_COORDINATOR in os.environ
    return started and args.coordinator is None and not args.distributed


def make_mesh(args: argparse.Namespace):
    """The `('node', 'local')` mesh the flags describe (defaults: see `--nodes`), with a
    `model` axis of `--model-parallel` devices inside each node when it is above 1."""
    import jax

    import zeropp_jax as zpp

    nodes, local = args.nodes, args.local
    if jax.process_count() > 1:
        # Under `python -m zeropp_jax.launch` every process emulates one node on this one
        # machine; on a real cluster make_mesh finds the hosts (one node per host).
        if local is None and nodes is None and _launched_on_loopback(args):
            nodes = jax.process_count()
    elif nodes is None and local is None and jax.default_backend() == "cpu":
        n = jax.device_count()
        nodes = 2 if n % 2 == 0 else 1
    k = getattr(args, "model_parallel", 1)
    try:
        return zpp.make_mesh(num_nodes=nodes, local_size=local, model_size=k if k > 1 else None)
    except ValueError as e:
        if k == 1:
            raise
        raise UsageError(f"--model-parallel {k}: {e}") from None


def check_batch(args: argparse.Namespace, n_dev: int) -> None:
    """Raises `UsageError` unless `--batch` divides over the mesh's `n_dev` data-parallel
    devices (`node` x `local`)."""

    if args.batch % n_dev:
        raise UsageError(
            f"--batch {args.batch} is not divisible by the {n_dev} data-parallel devices of "
            f"the mesh; use a multiple of {n_dev}"
        )
