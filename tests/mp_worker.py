"""A worker for tests/test_multiprocess.py: trains a tiny Flax model a few steps.

Started by `zeropp_jax.launch` (one process per node) or imported by the test, which runs
`train` in-process on 8 devices for the single-process reference. Both paths build the
mesh with `zpp.make_mesh`, feed each process its own rows of the same global batches
(`zeropp_jax.train.data`), and return the gathered parameters and the losses.

    python tests/mp_worker.py --out DIR [--steps N] [--configs exact,zeropp]
                              [--die-process P --die-after S]

writes `DIR/<config>_process<i>.npz` (parameters by tree path, and `__losses__`).
"""

from __future__ import annotations

import argparse
import os
import sys

from zeropp_jax.launch import initialize_from_env

SEED = 0
GLOBAL_BATCH = 16
FEATURES = 11


def runs():
    """Name -> (ZeroPPConfig, optax transformation) of each run the test compares.

    "exact": unquantized float32 gathers and reduce-scatter, with global-norm clipping
    (an all-reduce). "zeropp": the ZeRO++ defaults (small blocks for this small model)
    and no clipping, so no all-reduce feeds the update: every collective it trains
    through is an all-gather or an all-to-all (data movement) followed by local sums.
    """
    import jax.numpy as jnp
    import optax

    import zeropp_jax as zpp

    sgd = optax.sgd(0.05, momentum=0.9)
    return {
        "exact": (
            zpp.ZeroPPConfig(weight_bits=None, grad_bits=None, compute_dtype=jnp.float32),
            optax.chain(optax.clip_by_global_norm(0.5), sgd),
        ),
        "zeropp": (zpp.ZeroPPConfig(weight_block_size=64, grad_block_size=64), sgd),
    }


def _model():
    import flax.linen as nn
    import jax.numpy as jnp

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(96)(x)
            h = nn.LayerNorm()(jnp.tanh(h))
            h = nn.Dense(40)(jnp.tanh(h))
            return nn.Dense(3)(h)

    return Net()


def _train_step(state, batch):
    import jax
    import jax.numpy as jnp
    import optax

    def loss_fn(params):
        out = state.apply_fn({"params": params}, batch["x"])
        return jnp.mean((out.astype(jnp.float32) - batch["y"]) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    metrics = {"loss": loss, "grad_norm": optax.global_norm(grads)}
    return state.apply_gradients(grads=grads), metrics


def global_batch(step: int):
    """The global batch of one step (the same in every process)."""
    import numpy as np

    rs = np.random.RandomState([SEED, step])
    x = rs.randn(GLOBAL_BATCH, FEATURES).astype(np.float32)
    y = np.stack([np.sin(x[:, 0]), np.cos(x[:, 1]), x[:, 2] * x[:, 3]], 1).astype(np.float32)
    return {"x": x, "y": y}


def train(
    config_name: str,
    steps: int,
    *,
    mesh=None,
    die_process=None,
    die_after=None,
    save_at=None,
    ckpt=None,
):
    """Trains `steps` steps on `mesh`: by default one node per process (the launcher
    emulates one node per process on one machine), 2 x 4 in one process of 8 devices.

    Returns:
      (params as {path: np.ndarray}, np.ndarray (steps, 2) of [loss, gradient norm]).
    """
    import jax
    import numpy as np

    import zeropp_jax as zpp
    from zeropp_jax.train.data import batch_sharding, local_rows, make_global_batch

    if mesh is None:
        n = jax.process_count()
        mesh = zpp.make_mesh(num_nodes=n) if n > 1 else zpp.make_mesh(2, 4)
    config, tx = runs()[config_name]
    model = _model()
    params = model.init(jax.random.key(SEED), np.zeros((1, FEATURES), np.float32))["params"]
    state = zpp.TrainState.create(
        apply_fn=model.apply, params=params, tx=tx, mesh=mesh, config=config
    )
    step_fn = zpp.shard(_train_step, mesh=mesh, config=config)
    sharding = batch_sharding(mesh)
    losses = []
    for step in range(steps):
        batch = {
            k: make_global_batch(local_rows(v, sharding), sharding, GLOBAL_BATCH)
            for k, v in global_batch(step).items()
        }
        state, metrics = step_fn(state, batch)
        losses.append([float(metrics[k].addressable_data(0)) for k in ("loss", "grad_norm")])
        if save_at == step:
            zpp.save_checkpoint(ckpt, state)  # every process takes part
        if die_process == jax.process_index() and die_after == step:
            print(f"process {die_process} dying at step {step}", flush=True)
            os._exit(7)
    full = zpp.gather_params(state)
    flat = {
        jax.tree_util.keystr(path): np.asarray(x.addressable_data(0))
        for path, x in jax.tree_util.tree_leaves_with_path(full)
    }
    return flat, np.asarray(losses)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--configs", default="exact,zeropp")
    p.add_argument("--die-process", type=int, default=None)
    p.add_argument("--die-after", type=int, default=None)
    p.add_argument("--save-at", type=int, default=None, help="checkpoint after this step")
    p.add_argument("--ckpt", default=None, help="checkpoint folder for --save-at")
    args = p.parse_args(argv)
    initialize_from_env()
    import jax
    import numpy as np

    print(
        f"process {jax.process_index()}/{jax.process_count()}: {jax.local_device_count()} "
        "local devices",
        flush=True,
    )
    for name in args.configs.split(","):
        flat, losses = train(
            name,
            args.steps,
            die_process=args.die_process,
            die_after=args.die_after,
            save_at=args.save_at,
            ckpt=args.ckpt,
        )
        path = os.path.join(args.out, f"{name}_process{jax.process_index()}.npz")
        np.savez(path, __losses__=losses, **flat)
        print(f"{name}: losses {losses.tolist()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
