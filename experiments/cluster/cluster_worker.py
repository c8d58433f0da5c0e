"""One node of the emulated two-node cluster: times training steps per config and link rate.

Started by `run_cluster.py`, one process per network namespace, with the `ZEROPP_*`
variables of `zeropp_jax.launch` (4 CPU devices per process). For each tensor-parallel
size K of `--model-parallel` it builds its mesh (K = 1: the two-axis `('node', 'local')`
mesh and an unannotated MLP; K > 1: `zpp.make_mesh(model_size=K)` and the MLP's layers split
Megatron-style over `model`, see `megatron_init`), and then, for each config it builds
the state and compiles the step once, then for each rate it shapes its own side of the
veth pair (`tc ... tbf` on its egress, so each direction of the link is shaped by the
process that sends on it), waits for the other process at a barrier, runs `warmup` steps
of every config, then times `steps` steps of each, the configs alternating step by step
(`block_until_ready` after each), and reads the bytes its interface sent and received
around each step from `/sys/class/net/<iface>/statistics` (after a barrier of both
processes, so that each step's window holds all the bytes it sent, and the barrier's few).

Writes `<out>/process_<i>.json`: one record per (K, config, rate).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # experiments/
import _engines  # noqa: E402

from zeropp_jax.launch import initialize_from_env  # noqa: E402

UNLIMITED = "inf"
VARIANTS = {
    "zero3_noprefetch": ("zero3", {"prefetch": False}),
    "zeropp_noprefetch": ("zeropp", {"prefetch": False}),
    # int8 / int4 gradient hops with the rotation and int4 weight deltas: what
    # ZeroPPConfig.beyond() meant up to commit 70ded59, spelled out so each config's name
    # means the same at every commit.
    "beyond": ("beyond_d2", {"weight_delta_bits": 4}),
    "beyond_d2_node_rot": ("beyond_d2", {"grad_rotation": False, "grad_node_rotation": True}),
    # XLA FSDP whose collectives cross at a GPU's widths: 16-bit weights gathered as uint16
    # bits, 16-bit gradients ring-reduced as raw bits (`baselines.gathered_copies`).
    "xla_fsdp_gpu_wire": ("xla_fsdp", {"gpu_wire": True}),
}
"""The cluster's configs that are an `_engines` engine with `ZeroPPConfig` overrides; every
other config name is an engine's slug or alias (`xla_fsdp`, `zero3`, `zeropp`,
`zeropp_delta4`, `beyond_d2`, `zeropp_delta2`)."""


def read_counter(iface: str, name: str) -> int:
    with open(f"/sys/class/net/{iface}/statistics/{name}") as f:
        return int(f.read())


def shape_link(iface: str, rate: str, *, burst_kb: int, latency_ms: int) -> None:
    """Puts a tbf qdisc of `rate` Mbit/s on `iface` (egress), or removes it for 'inf'."""
    if rate == UNLIMITED:
        subprocess.run(
            ["tc", "qdisc", "del", "dev", iface, "root"],
            timeout=10,
            check=False,
            capture_output=True,
        )
        return
    mbit = float(rate)
    # At least 10 ms worth of tokens, so the bucket is never smaller than a timer tick.
    burst = max(burst_kb * 1024, int(mbit * 1e6 / 8 / 100))
    subprocess.run(
        ["tc", "qdisc", "replace", "dev", iface, "root", "tbf", "rate", f"{rate}mbit"]
        + ["burst", str(burst), "latency", f"{latency_ms}ms"],
        timeout=10,
        check=True,
    )


def megatron_init(layer: int, depth: int, model_parallel: int) -> dict:
    """`nn.Dense` initializers splitting layer `layer` of `depth` over the `model` axis.

    Layers pair up Megatron-style: an even layer is column-parallel (kernel and bias split
    along the outputs), the odd layer after it row-parallel (kernel split along the inputs,
    bias whole). With an odd `depth` the last layer stays whole; with `model_parallel` 1
    nothing is annotated (the two-axis mesh's model, as before tensor parallelism).
    """
    import flax.linen as nn

    if model_parallel == 1 or (layer % 2 == 0 and layer == depth - 1):
        return {}
    kernel = nn.initializers.lecun_normal()
    if layer % 2 == 0:
        return dict(
            kernel_init=nn.with_partitioning(kernel, (None, "model")),
            bias_init=nn.with_partitioning(nn.initializers.zeros_init(), ("model",)),
        )
    return dict(kernel_init=nn.with_partitioning(kernel, ("model", None)))


def build(config_name: str, width: int, depth: int, batch: int, mesh, model_parallel: int):
    """The state, the step and one global batch for `config_name` on `mesh`.

    Returns `(state, step, batch, params)`, `params` the model's parameter count.
    """
    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from _library import constrain_to_batch

    from zeropp_jax.train.data import batch_sharding, local_rows, make_global_batch

    class MLP(nn.Module):
        """Dense layers computing in bfloat16 (the input is cast; every config hands the
        layers bfloat16 weights, and a float32 input would promote them back to float32).
        Each block's input and the output are pinned to the batch as MaxText pins
        activations (`constrain_to_batch`: XLA FSDP then gathers weights, never
        activations; a no-op inside the engine's island); a block is a layer, or with
        tensor parallelism a Megatron pair (`megatron_init`), whose inner activation is
        split over `model`."""

        @nn.compact
        def __call__(self, x):
            x = x.astype(jnp.bfloat16)
            for i in range(depth):
                x = constrain_to_batch(x) if model_parallel == 1 or i % 2 == 0 else x
                x = nn.Dense(width, **megatron_init(i, depth, model_parallel))(x)
                x = jax.nn.gelu(x) if i < depth - 1 else x
            return constrain_to_batch(x)

    def train_step(state, batch):
        def loss_fn(params):
            out = state.apply_fn({"params": params}, batch["x"])
            return jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), {"loss": loss}

    model = MLP()
    params = model.init(jax.random.key(0), np.zeros((1, width), np.float32))["params"]
    count = sum(int(x.size) for x in jax.tree.leaves(nn.unbox(params)))
    rs = np.random.RandomState(0)
    sharding = batch_sharding(mesh)
    data = {
        "x": rs.randn(batch, width).astype(np.float32),
        "y": rs.randn(batch, width).astype(np.float32),
    }
    data = {k: make_global_batch(local_rows(v, sharding), sharding, batch) for k, v in data.items()}
    engine, overrides = VARIANTS.get(config_name, (config_name, {}))
    state, make_step = _engines.build(
        engine,
        apply_fn=model.apply,
        params=params,
        tx=optax.adam(1e-4),
        mesh=mesh,
        overrides=overrides,
    )
    return state, make_step(train_step), data, count


def run_model_parallel(args, mesh, model_parallel: int, names: list[str]) -> list[dict]:
    """Builds every config on `mesh`, then times them at every rate; one record each."""
    import jax
    from jax.experimental import multihost_utils

    import zeropp_jax as zpp

    me, k = jax.process_index(), model_parallel
    shape_link(args.iface, UNLIMITED, burst_kb=args.burst_kb, latency_ms=args.latency_ms)
    runs, compile_s, predicted, predicted_wire, params = {}, {}, {}, {}, {}
    for name in names:
        t0 = time.perf_counter()
        state, step, batch, params[name] = build(
            name, args.width, args.depth, args.batch, mesh, model_parallel
        )
        # What the ledger predicts for the link, from the program XLA compiled.
        ledger = zpp.comm_ledger(
            step, state, batch, mesh=mesh, param_count=params[name], compiled=True
        )
        predicted[name] = ledger.node_link_bytes()[me].tolist()
        # XLA FSDP at the width its partitioner gives each collective (XLA:CPU widens
        # bfloat16 to float32 after it): the bytes a GPU compilation would send. The
        # engine's own collectives already cross at their width (16-bit as raw bits).
        if name == "xla_fsdp":
            wire = zpp.comm_ledger(
                step, state, batch, mesh=mesh, param_count=params[name], partitioned=True
            )
            predicted_wire[name] = wire.node_link_bytes()[me].tolist()
        else:
            predicted_wire[name] = predicted[name]
        multihost_utils.sync_global_devices(f"{name} tp{k} built")
        state, metrics = step(state, batch)  # compile
        jax.block_until_ready((state, metrics))
        compile_s[name] = time.perf_counter() - t0
        runs[name] = [state, step, batch, metrics]
        print(
            f"process {me}: {name} (TP {k}) built and compiled in {compile_s[name]:.1f}s",
            flush=True,
        )

    def one_step(name: str) -> float:
        state, step, batch, _ = runs[name]
        t = time.perf_counter()
        state, metrics = step(state, batch)
        jax.block_until_ready((state, metrics))
        runs[name][0], runs[name][3] = state, metrics
        return time.perf_counter() - t

    records = []
    for rate in args.rates.split(","):
        shape_link(args.iface, rate, burst_kb=args.burst_kb, latency_ms=args.latency_ms)
        multihost_utils.sync_global_devices(f"tp{k} rate {rate}")
        for _ in range(args.warmup):
            for name in names:
                one_step(name)
        # Configs alternate step by step, so a change in the machine's load hits all alike.
        times = {name: [] for name in names}
        sent = dict.fromkeys(names, 0)
        received = dict.fromkeys(names, 0)
        for _ in range(args.steps):
            for name in names:
                tx0 = read_counter(args.iface, "tx_bytes")
                rx0 = read_counter(args.iface, "rx_bytes")
                times[name].append(one_step(name))
                # Both nodes past the step (after its timing): every byte it sent has
                # crossed the link. A node can finish a step while its last message still
                # waits in the shaped queue (a ring's last hop), which the next config's
                # window would otherwise count.
                multihost_utils.sync_global_devices(f"tp{k} rate {rate} {name} step done")
                sent[name] += read_counter(args.iface, "tx_bytes") - tx0
                received[name] += read_counter(args.iface, "rx_bytes") - rx0
        for name in names:
            loss = float(runs[name][3]["loss"].addressable_data(0))
            records.append(
                dict(
                    process=me,
                    config=name,
                    rate=rate,
                    model_parallel=k,
                    times_s=times[name],
                    tx_bytes=sent[name],
                    rx_bytes=received[name],
                    steps=args.steps,
                    params=params[name],
                    ledger_tx_bytes=predicted[name][0],
                    ledger_rx_bytes=predicted[name][1],
                    wire_ledger_tx_bytes=predicted_wire[name][0],
                    wire_ledger_rx_bytes=predicted_wire[name][1],
                    loss=loss,
                    compile_s=compile_s[name],
                )
            )
            median = sorted(times[name])[len(times[name]) // 2]
            print(
                f"process {me}: {name} (TP {k}) @ {rate} Mbit/s: step {median:.3f}s (median "
                f"of {args.steps}), sent {sent[name] / args.steps / 1e6:.1f} MB/step, "
                f"loss {loss:.4f}",
                flush=True,
            )
    runs.clear()  # free this mesh's states before the next one is built
    return records


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--iface", required=True)
    p.add_argument("--rates", default="100,inf", help="Mbit/s, comma-separated; inf = no limit")
    p.add_argument("--configs", default="zero3,zeropp")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--width", type=int, default=1536)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--model-parallel", default="1", help="TP sizes, comma-separated")
    p.add_argument("--burst-kb", type=int, default=64)
    p.add_argument("--latency-ms", type=int, default=100)
    args = p.parse_args(argv)

    initialize_from_env()
    import jax
    from jax.experimental import multihost_utils

    import zeropp_jax as zpp

    me = jax.process_index()
    names = args.configs.split(",")
    records = []
    for k in (int(k) for k in args.model_parallel.split(",")):
        # K = 1: the two-axis mesh, exactly as before tensor parallelism.
        mesh = zpp.make_mesh(model_size=k) if k > 1 else zpp.make_mesh()
        print(f"process {me}: mesh {dict(mesh.shape)}, iface {args.iface}", flush=True)
        records += run_model_parallel(args, mesh, k, names)
    shape_link(args.iface, UNLIMITED, burst_kb=args.burst_kb, latency_ms=args.latency_ms)
    with open(os.path.join(args.out, f"process_{me}.json"), "w") as f:
        json.dump(records, f, indent=1)
    multihost_utils.sync_global_devices("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
