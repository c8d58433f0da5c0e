"""What the trainer prints besides its progress: the ledger table of its summary, the
one-line name of its engine, and the `--plan` report."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from zeropp_jax import _choices as choices
from zeropp_jax.train.flags import PROG, gpt_config, zeropp_config
from zeropp_jax.train.platform import check_batch, make_mesh


def ledger_table(ledgers: dict[str, Any]) -> str:
    """Side-by-side table of per-device bytes per step in units of M, one column per
    ledger, one row per (phase, collective, mesh axes); then the totals per device and
    through the busiest node's network link in one direction, per phase and in all, and
    the program each ledger was read from (`CommLedger.program`)."""
    rows: dict[tuple, dict[str, float]] = {}
    for name, ledger in ledgers.items():
        for (phase, op, axes), num in ledger.bytes_by("phase", "op", "axes").items():
            rows.setdefault((phase, op, axes), {})[name] = ledger.in_units_of_M(num)
    order = {"forward": 0, "backward": 1, "update": 2}
    names = list(ledgers)
    width = max([40, *(len(f"{k[0]} {k[1]} over {'+'.join(k[2]) or '-'}") + 1 for k in rows)])
    lines = [f"{'collective (per device, one step)':<{width}}" + "".join(f"{n:>10}" for n in names)]
    for key in sorted(rows, key=lambda k: (order.get(k[0], 2), k[1], k[2])):
        phase, op, axes = key
        label = f"{phase} {op} over {'+'.join(axes) or '-'}"
        lines.append(
            f"{label:<{width}}" + "".join(f"{rows[key].get(n, 0.0):>9.3f}M" for n in names)
        )
    phases = sorted({k[0] for k in rows}, key=lambda p: order.get(p, 3))
    by_phase = {n: ledgers[n].link_bytes_by("phase") for n in names}
    for phase in phases:
        lines.append(
            f"{'per node link, ' + phase:<{width}}"
            + "".join(
                f"{ledgers[n].in_units_of_M(by_phase[n].get((phase,), 0.0)):>9.3f}M" for n in names
            )
        )
    for label, attr in (
        ("total per device", "total_bytes"),
        ("per node link, each way", "link_bytes"),
    ):
        lines.append(
            f"{label:<{width}}"
            + "".join(
                f"{ledgers[n].in_units_of_M(getattr(ledgers[n], attr)):>9.3f}M" for n in names
            )
        )
    lines.append(
        f"{'read from the program':<{width}}" + "".join(f"{ledgers[n].program:>10}" for n in names)
    )
    return "\n".join(lines)


def shared_grad_text(config: Any, state: Any = None) -> str:
    """How the tied embedding's gradient is reduced, for `config_text`: "" for "once",
    ", tied gradients reduced per use", and for `shared_grad="auto"` which of the two it
    picked on `state`'s mesh (the decision for the largest leaf, the table; without a
    state, both are named)."""
    if config.shared_grad != "auto":
        return "" if config.shared_grad == "once" else ", tied gradients reduced per use"
    if state is None:
        return ", tied gradients reduced once or per use (auto)"
    per_use = choices.largest_per_use(state.plan, state.layouts[1])
    return f", tied gradients reduced {'per use' if per_use else 'once'} (auto)"


def config_text(config: Any, state: Any = None) -> str:
    """One line naming the engine a `ZeroPPConfig` (None: XLA FSDP) runs (on `state`, a
    `zpp.TrainState`, to say what `shared_grad="auto"` picked there)."""
    if config is None:
        return "XLA FSDP (jax.jit, parameters and optimizer state sharded over all devices)"
    per_use = shared_grad_text(config, state)
    if config.is_zero3:
        return f"ZeRO-3 ({config.compute_dtype.name}{per_use})"
    return (
        f"ZeRO++ (weights {config.weight_bits or 'unquantized'}"
        f"{'-bit' if config.weight_bits else ''}, hpZ {'on' if config.hierarchical else 'off'}, "
        f"gradients {config.grad_bits or 'unquantized'}{'-bit' if config.grad_bits else ''}, "
        f"{config.compute_dtype.name}{per_use})"
    )


class Prelowered:
    """Hands `comm_ledger` a lowering made earlier instead of tracing the step again."""

    def __init__(self, lowered):
        self._lowered = lowered

    def lower(self, *args, **kwargs):
        return self._lowered


def plan_report(args: argparse.Namespace, *, train_step: Callable, tx: Any) -> str:
    """What `--plan` prints: the step these flags describe (`train_step` with optimizer
    `tx`), compiled from shapes alone (nothing is initialised or allocated), with XLA's
    per-device memory analysis beside the analytic estimate of `zeropp_jax.train.plan`,
    and one step's communication ledger."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import zeropp_jax as zpp
    from zeropp_jax._mesh import data_parallel_size
    from zeropp_jax.state._partition import BATCH_SPEC
    from zeropp_jax.train import fit, plan
    from zeropp_jax.train.model import GPT, init_fn
    from zeropp_jax.train.model import param_count as param_count_of

    mesh = make_mesh(args)
    check_batch(args, data_parallel_size(mesh))
    config = None if args.engine == "xla-fsdp" else zeropp_config(args)
    gpt = gpt_config(args)
    model = GPT(gpt)
    count = param_count_of(gpt)
    sharding = jax.sharding.NamedSharding(mesh, BATCH_SPEC)
    batch = jax.ShapeDtypeStruct((args.batch, args.seq_len + 1), jnp.int32, sharding=sharding)
    if config is None:
        from zeropp_jax.baselines import xla_fsdp_state, xla_fsdp_step

        state = xla_fsdp_state(
            apply_fn=model.apply,
            params=init_fn(gpt, args.seed),
            tx=tx,
            mesh=mesh,
            compute_dtype=args.compute_dtype,
            abstract=True,
        )
        step = xla_fsdp_step(train_step, state, mesh)
        layouts = None
    else:
        state = zpp.TrainState.abstract(
            apply_fn=model.apply, params=init_fn(gpt, args.seed), tx=tx, mesh=mesh, config=config
        )
        step = zpp.shard(train_step, mesh=mesh, config=config, donate_state=True)
        layouts = state.layouts[1]
    lowered = step.lower(state, batch)
    need = fit.need_of(lowered.compile())
    # The whole step (the optimizer update's collectives included), from the program
    # compiled above (a lowering compiles once).
    ledger = zpp.comm_ledger(
        Prelowered(lowered), batch, mesh=mesh, param_count=count, compiled=True
    )
    nodes, local = mesh.shape["node"], mesh.shape["local"]
    est = plan.estimate(
        gpt,
        state=state,
        layouts=layouts,
        batch=args.batch // mesh.size,
        seq=args.seq_len,
        mesh_shape=(nodes, local),
        compute_bytes=int(np.dtype(args.compute_dtype).itemsize),
        config=config,
        platform=jax.default_backend(),
    )
    scale, unit = (plan.GB, "GB") if need.total >= plan.GB else (1e6, "MB")
    head = (
        f"{PROG} --plan: {count / 1e6:.2f}M parameters ({args.model}: d_model {args.d_model}, "
        f"{args.n_layers} layers, {args.n_heads} heads, vocabulary {args.vocab_size}, "
        f"{'scanned' if args.scan_layers else 'unrolled'}, remat {args.remat}); "
        f"{config_text(config, state if config is not None else None)}; {args.optimizer}; "
        f"a {nodes} x {local} mesh of "
        f"{jax.default_backend()} devices; batch {args.batch} ({args.batch // mesh.size} per "
        f"device) x {args.seq_len} tokens. Compiled from shapes; nothing was allocated."
    )
    measured = [
        ("arguments", need.arguments),
        ("outputs (not donated)", need.outputs),
        ("temporaries", need.temp),
        ("generated code", need.code),
        ("total", need.total),
    ]
    lines = [head, "", "memory per device, XLA's memory analysis    | analytic estimate"]
    terms = est.rows()
    for i in range(max(len(measured), len(terms))):
        left = (
            f"  {measured[i][0]:<24}{measured[i][1] / scale:>10.3f} {unit}"
            if i < len(measured)
            else ""
        )
        right = f"{terms[i][0]:<16}{terms[i][1] / scale:>10.3f} {unit}" if i < len(terms) else ""
        lines.append(f"{left:<44}| {right}")
    lines.append(
        f"  XLA / estimate: {need.total / est.total:.3f} (the estimate's terms: "
        "zeropp_jax/train/plan.py)"
    )
    m = ledger.model_bytes
    lines += [
        "",
        f"communication per step, M = {m / 1e6:.1f} MB (parameters in 16 bits), from the "
        "compiled step (every collective, the optimizer update's included):",
        f"  per device          {ledger.total_bytes / 1e6:>12.1f} MB "
        f"({ledger.in_units_of_M(ledger.total_bytes):.3f} M)",
        f"  per node link, each way {ledger.link_bytes / 1e6:>8.1f} MB "
        f"({ledger.in_units_of_M(ledger.link_bytes):.3f} M)",
    ]
    device = mesh.devices.flat[0]
    capacity = fit.device_capacity(device, len(jax.local_devices()))
    if capacity is not None:
        problem = fit.fit_error({"training step": need}, capacity)
        fits = (
            f"fits: {need.total / plan.GB:.3f} GB per device of {capacity[0] / plan.GB:.2f} GB "
            f"({capacity[1]})"
        )
        lines += ["", problem or fits]
    return "\n".join(lines)
