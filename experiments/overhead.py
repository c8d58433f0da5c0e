"""Compute overhead of ZeRO++ on emulated CPU devices, no link limit.

Times the same MLP's training step under XLA's own FSDP (`zeropp_jax.baselines`), ZeRO-3,
each ZeRO++ technique alone and full ZeRO++, interleaved round by round (so machine noise
hits every variant alike), and prints each variant's median step time with its min-max
range over the rounds, and its ratio to each baseline paired round by round: in each round
the variant's step over the baseline's step of the same round, reported as the median of
those per-round ratios with their interquartile range and min-max spread (a single slow
round moves the spread, not the median). Every round's times go to `overhead_rounds.csv`,
and the machine's load average before and after the timed steps to the header (the timings
need a quiet machine: a load above the core count means other jobs shared it). Then breaks
the ZeRO++ step down by timing its stages on one device's share of the data: quantize
(incl. packing), dequantize (incl. unpacking), the fused dequantize-sum(-requantize) of
each gradient hop, and the model's own compute (forward + backward on one device's batch
slice with full weights).

    python experiments/overhead.py                 # sizes 4M and 12M parameters
    python experiments/overhead.py --quick         # tiny smoke run
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import _engines
from _common import (
    machine_line,
    markdown_table,
    request_cpu_devices,
    study_dir,
    write_csv,
)

request_cpu_devices(8)

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from _library import constrain_to_batch  # noqa: E402

import zeropp_jax as zpp  # noqa: E402
from zeropp_jax.wire import quant  # noqa: E402

BASELINES = ("XLA FSDP", "ZeRO-3")
"""Variants the others are compared with."""


def paired_ratios(times: list[float], base: list[float]) -> list[float]:
    """Per round, the variant's step time over the baseline's in the same round."""
    if len(times) != len(base):
        raise ValueError(f"paired_ratios: {len(times)} rounds against {len(base)}.")
    return [t / b for t, b in zip(times, base, strict=True)]


def ratio(times: list[float], base: list[float]) -> str:
    """The median of the per-round ratios `times / base`, their interquartile range and
    their min-max spread, e.g. `0.712 (IQR 0.690-0.731; 0.650-0.801)`; "1" for the
    baseline itself."""
    if times is base:
        return "1"
    r = paired_ratios(times, base)
    q1, _, q3 = statistics.quantiles(r, n=4, method="inclusive")
    return f"{statistics.median(r):.3f} (IQR {q1:.3f}-{q3:.3f}; {min(r):.3f}-{max(r):.3f})"


def load_line() -> str:
    """The machine's load averages over 1, 5 and 15 minutes (`os.getloadavg`)."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f}, {five:.2f}, {fifteen:.2f} (1, 5, 15 min)"


VARIANTS = {  # name: (engine of `_engines`, ZeroPPConfig overrides)
    "XLA FSDP": ("XLA FSDP", {}),
    "ZeRO-3": ("ZeRO-3", {}),
    "qwZ only": ("ZeRO++", {"weight_bits": 8, "hierarchical": False, "grad_bits": None}),
    "hpZ only": ("ZeRO++", {"weight_bits": None, "hierarchical": True, "grad_bits": None}),
    "qgZ only": ("ZeRO++", {"weight_bits": None, "hierarchical": False, "grad_bits": 4}),
    "ZeRO++": ("ZeRO++", {}),
}


class MLP(nn.Module):
    width: int
    depth: int

    @nn.compact
    def __call__(self, x):
        # bfloat16 compute, as every variant's weights arrive (a float32 input would promote
        # them back); activations pinned to the batch at each layer (a no-op in the engine).
        x = x.astype(jnp.bfloat16)
        for _ in range(self.depth):
            x = constrain_to_batch(jnp.tanh(nn.Dense(self.width)(constrain_to_batch(x))))
        return x


def train_step(state, batch):
    def loss_fn(p):
        return jnp.mean(state.apply_fn({"params": p}, batch) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def _time(fn, *args) -> float:
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return time.perf_counter() - t0


def step_times(width: int, depth: int, batch: int, rounds: int) -> dict[str, list[float]]:
    """Interleaved step times per variant (seconds), after one warm-up step each."""
    mesh = zpp.make_mesh(2, 4)
    model = MLP(width, depth)
    x = np.random.RandomState(0).randn(batch, width).astype(np.float32)
    params = model.init(jax.random.key(0), x)["params"]
    runs = {}
    for name, (engine, overrides) in VARIANTS.items():
        state, make_step = _engines.build(
            engine,
            apply_fn=model.apply,
            params=params,
            tx=optax.adam(1e-4),
            mesh=mesh,
            overrides=overrides,
            # As the committed tables measured: XLA FSDP donates its state, ours do not.
            donate=engine == "XLA FSDP",
        )
        step = make_step(train_step)
        state, _ = step(state, x)  # compile + warm-up
        runs[name] = [step, state]
    times = {name: [] for name in VARIANTS}
    for _ in range(rounds):
        for name, run in runs.items():
            t0 = time.perf_counter()
            run[1], m = run[0](run[1], x)
            jax.block_until_ready(m)
            times[name].append(time.perf_counter() - t0)
    return times


def stage_times(width: int, depth: int, batch: int, repeats: int) -> dict[str, float]:
    """Median seconds of each stage, per device, summed over all weight matrices."""
    n_dev, local = 8, 4
    rs = np.random.RandomState(1)
    w = jnp.asarray(rs.randn(width, width).astype(np.float32)).astype(jnp.bfloat16)
    g = w.reshape(-1, 256)
    q8 = jax.jit(lambda b: quant.quantize_blocks(b, bits=8))
    q4 = jax.jit(lambda b: quant.quantize_blocks(b, bits=4))
    v8, s8 = q8(g)
    v4, s4 = q4(g)
    d8 = jax.jit(lambda v, s: quant.dequantize_blocks(v, s, bits=8, dtype=jnp.bfloat16))
    # Hop 1 receives `local` chunks of 1/local of the gradient; hop 2 `nodes` of 1/N.
    h1v = v4.reshape(local, -1, v4.shape[-1])
    h1s = s4.reshape(local, -1)
    hop1 = jax.jit(lambda v, s: quant.dequantize_sum_quantize_blocks(v, s, bits=4, out_bits=4))
    h2v = v4[: 2 * (v4.shape[0] // n_dev)].reshape(2, -1, v4.shape[-1])
    h2s = s4[: h2v.shape[0] * h2v.shape[1]].reshape(2, -1)
    hop2 = jax.jit(lambda v, s: quant.dequantize_sum_blocks(v, s, bits=4))
    model = MLP(width, depth)
    xb = jnp.asarray(rs.randn(batch // n_dev, width).astype(np.float32))
    params = jax.tree_util.tree_map(
        lambda p: p.astype(jnp.bfloat16), model.init(jax.random.key(0), xb)["params"]
    )
    compute = jax.jit(jax.grad(lambda p, x: jnp.mean(model.apply({"params": p}, x) ** 2)))
    stages = {
        # Forward gather: each device quantizes its 1/N shard, dequantizes the full weight.
        "quantize int8 (own shard)": (q8, (g[: g.shape[0] // n_dev],), depth),
        "dequantize int8 (full weight)": (d8, (v8, s8), depth),
        # Backward: re-gather dequantizes again; gradient: quantize full, two fused hops.
        "dequantize int8 (re-gather)": (d8, (v8, s8), depth),
        "quantize+pack int4 (full gradient)": (q4, (g,), depth),
        "hop-1 dequantize-sum-requantize": (hop1, (h1v, h1s), depth),
        "hop-2 dequantize-sum": (hop2, (h2v, h2s), depth),
        "model compute (fwd+bwd, 1 device)": (compute, (params, xb), 1),
    }
    out = {}
    for name, (fn, args, count) in stages.items():
        jax.block_until_ready(fn(*args))
        out[name] = statistics.median(_time(fn, *args) for _ in range(repeats)) * count
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", default=str(study_dir("overhead")))
    args = parser.parse_args(argv)
    sizes = [(256, 2, 16)] if args.quick else [(1024, 4, 64), (1536, 5, 64)]
    rounds = 2 if args.quick else args.rounds
    print(machine_line())
    load_before = load_line()
    print(f"before: {load_before}", flush=True)
    rows, stage_rows, round_rows = [], [], []
    for width, depth, batch in sizes:
        params_m = depth * (width * width + width) / 1e6
        times = step_times(width, depth, batch, rounds)
        for i in range(rounds):
            round_rows.append(
                {"model": f"MLP {depth}x{width} ({params_m:.1f}M)", "round": i}
                | {name: round(ts[i], 5) for name, ts in times.items()}
            )
        for name, ts in times.items():
            row = {
                "model": f"MLP {depth}x{width} ({params_m:.1f}M)",
                "variant": name,
                "step_s_median": round(statistics.median(ts), 4),
                "step_s_min": round(min(ts), 4),
                "step_s_max": round(max(ts), 4),
            }
            for base in BASELINES:
                row[f"ratio_to_{base}"] = ratio(ts, times[base])
            rows.append(row)
        for stage, seconds in stage_times(width, depth, batch, 3 if args.quick else 7).items():
            stage_rows.append(
                {
                    "model": f"MLP {depth}x{width} ({params_m:.1f}M)",
                    "stage": stage,
                    "ms_per_step_per_device": round(seconds * 1e3, 2),
                }
            )
    load_after = load_line()
    head = ["model", "variant", "step s (median)", "min", "max"]
    head += [f"ratio to {b}" for b in BASELINES]
    table = markdown_table(head, [list(r.values()) for r in rows], "llrrrrr")
    stage_table = markdown_table(
        ["model", "stage", "ms per step per device"],
        [list(r.values()) for r in stage_rows],
        "llr",
    )
    import pathlib

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(out / "overhead.csv", rows)
    write_csv(out / "overhead_stages.csv", stage_rows)
    write_csv(out / "overhead_rounds.csv", round_rows)
    text = (
        "# ZeRO++ compute overhead (no link limit)\n\n"
        f"{machine_line()}; mesh 2x4, {rounds} interleaved rounds, "
        "bf16 compute.\n\n"
        f"Machine load: before the timed steps {load_before}; after them {load_after} "
        "(this run alone keeps about one runnable thread per core busy; a load well above "
        "the core count means other jobs shared the cores).\n\n"
        f"{table}\nStep times: median and range over the rounds (every round in "
        "`overhead_rounds.csv`; timings on a machine shared with other jobs are noisy). A "
        "ratio pairs the rounds: per round the variant's step over the baseline's step of "
        "the same round; shown is the median of those ratios, their interquartile range "
        "(IQR) and their min-max spread.\n\n"
        "Stages of the ZeRO++ step (per device, summed over the weights, "
        f"medians of single runs; devices share the 2 cores, so 8 devices' stages "
        f"serialize):\n\n{stage_table}"
    )
    (out / "overhead.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
