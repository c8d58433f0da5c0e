"""The trainer's GPT step on the devices of one host: memory, step time and ledger per engine.

    python experiments/gpu_step.py                     # on a GPU host: 125m, every engine
    python experiments/gpu_step.py --model tiny --steps 3 --engines ZeRO++   # anywhere

Builds the trainer's `train_step` and AdamW chain (`zeropp_jax.train.cli`) for the GPT of
`--model` (scanned unless `--no-scan-layers`, `--remat full` for the large presets,
`--seq-len` tokens, `--batch` sequences), on a `('node', 'local')` mesh of every device the
process sees (1 x N), under each engine: XLA's own FSDP (`zeropp_jax.baselines`), the
engine's ZeRO-3, ZeRO++, ZeRO++ with int2 weight deltas (`zeropp_delta2`,
`ZeroPPConfig.beyond()`) and the same with the Hadamard-rotated int8 / int4 gradient hops
(`beyond_d2`); the names are `beyond_bytes.py`'s and the cluster's. For each: the compiled
step's `memory_analysis()` per device (arguments, outputs, temporaries), the median time
of `--steps` timed steps of that compiled step after two warm-up steps, with its min-max
range (`block_until_ready`, random tokens), and the ledger's bytes per device and through
each node's link (the latter zero on a one-node mesh; on one device both are zero, and the
time is the engines' own work and the model's, not their wires).

Prints one table (markdown) and writes it with its machine line to `--out`
(`gpu_step.md`).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402
import _engines  # noqa: E402

ENGINES = ("XLA FSDP", "ZeRO-3", "ZeRO++", "zeropp_delta2", "beyond_d2")
"""The engines measured, as `_engines` spells them (the last two by their aliases)."""


def trainer_args(model: str, seq_len: int, batch: int) -> list[str]:
    """The trainer's flags for the step measured."""
    args = ["--batch", str(batch), "--seq-len", str(seq_len)]
    if model != "tiny":
        args += ["--model", model, "--remat", "full"]
    return args


def measure(engine: str, argv: list[str], steps: int, mesh) -> dict:
    """One engine's compiled step: memory per device, step times, ledger (MB)."""
    import jax
    import jax.numpy as jnp
    from _library import BATCH_SPEC
    from jax.sharding import NamedSharding

    import zeropp_jax as zpp
    from zeropp_jax.train.cli import make_optimizer, train_step
    from zeropp_jax.train.flags import gpt_config, parse_args
    from zeropp_jax.train.model import GPT, init_fn

    args = parse_args(argv)
    gpt = gpt_config(args)
    net, tx = GPT(gpt), make_optimizer(args)
    params = init_fn(gpt, 0)
    state, make_step = _engines.build(engine, apply_fn=net.apply, params=params, tx=tx, mesh=mesh)
    fn = make_step(train_step)
    tokens = jax.random.randint(
        jax.random.key(1), (args.batch, gpt.seq_len + 1), 0, gpt.vocab_size, jnp.int32
    )
    batch = jax.device_put(tokens, NamedSharding(mesh, BATCH_SPEC))
    ledger = zpp.comm_ledger(fn, state, batch) if _engines.lookup(engine).kind == "zpp" else None
    compiled = fn.lower(state, batch).compile()  # timed below: compiled once, not again
    mem = compiled.memory_analysis()
    del params
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        state, metrics = compiled(state, batch)
        jax.block_until_ready((state, metrics))
        if i >= 2:
            times.append(time.perf_counter() - t0)
    mb = 1e6
    row = {
        "engine": engine,
        "args_MB": mem.argument_size_in_bytes / mb,
        "out_MB": mem.output_size_in_bytes / mb,
        "temp_MB": mem.temp_size_in_bytes / mb,
        "step_ms": 1e3 * statistics.median(times),
        "min_ms": 1e3 * min(times),
        "max_ms": 1e3 * max(times),
        "loss": float(metrics["loss"]),
    }
    if ledger is not None:
        row["ledger_device_MB"] = ledger.total_bytes / mb
        row["ledger_link_MB"] = ledger.link_bytes / mb
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="125m", help="the trainer's --model (tiny, 125m, ...)")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8, help="sequences per step, all devices")
    p.add_argument("--steps", type=int, default=10, help="timed steps per engine")
    p.add_argument("--no-scan-layers", action="store_true", help="the trainer's --no-scan-layers")
    p.add_argument("--engines", default=",".join(ENGINES), help="comma-separated")
    p.add_argument("--out", default=str(_common.study_dir("gpu_step")))
    args = p.parse_args(argv)

    import jax
    import numpy as np
    from jax.sharding import AxisType, Mesh

    devices = np.array(jax.devices(), dtype=object).reshape(1, -1)
    mesh = Mesh(devices, ("node", "local"), axis_types=(AxisType.Auto, AxisType.Auto))
    argv_t = trainer_args(args.model, args.seq_len, args.batch)
    argv_t += ["--no-scan-layers"] if args.no_scan_layers else []
    head = (
        f"Machine: {_common.machine_line()}\n\n"
        f"Device: {jax.devices()[0].device_kind} x {devices.size}; model {args.model}, "
        f"`{' '.join(argv_t)}`; {args.steps} timed steps after 2 warm-up steps.\n"
    )
    print(head, flush=True)
    rows = []
    for engine in args.engines.split(","):
        t0 = time.perf_counter()
        try:
            rows.append(measure(engine, argv_t, args.steps, mesh))
        except Exception as e:  # one engine failing must not hide the others' rows
            print(f"{engine}: FAILED {type(e).__name__}: {e}", flush=True)
            continue
        print(f"{engine}: {rows[-1]} ({time.perf_counter() - t0:.0f} s)", flush=True)
    cols = ["engine", "args_MB", "out_MB", "temp_MB", "step_ms", "min_ms", "max_ms", "loss"]
    cols += ["ledger_device_MB", "ledger_link_MB"]
    fmt = {"step_ms": "{:.2f}", "min_ms": "{:.2f}", "max_ms": "{:.2f}", "loss": "{:.4f}"}
    cells = [
        [c if isinstance(c, str) else fmt.get(k, "{:.1f}").format(c) for k, c in cell_row]
        for cell_row in ([(k, r.get(k, "-")) for k in cols] for r in rows)
    ]
    table = _common.markdown_table(cols, cells, align="l" + "r" * (len(cols) - 1))
    print(table)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_step.md").write_text(head + "\n" + table + "\n")


if __name__ == "__main__":
    main()
