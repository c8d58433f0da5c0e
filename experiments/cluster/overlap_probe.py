"""Does XLA:CPU run a cross-node collective while it computes? (issue #50, "Overlap on CPU")

    python experiments/cluster/overlap_probe.py --rate 100mbit           # full probe (minutes)
    python experiments/cluster/overlap_probe.py --rate 100mbit --quick   # smoke run

The emulated two-node cluster of `run_cluster.py` (its `Topology`, `setup`, `teardown` and
`worker_commands`; two network namespaces joined by a veth pair, each direction shaped with
`tc ... tbf` by the process that sends on it) runs this file again as a worker in each
namespace (`--worker`): 2 processes x `--local-devices` CPU devices, a `('node', 'local')`
mesh, gloo collectives across the shaped link. Each worker compiles a set of small
`jax.jit(jax.shard_map(...))` programs (`VARIANTS`) over per-device arrays:

- a chain of `--matmuls` `x = tanh(x @ w)` (compute; no communication),
- an all-gather (or psum) over `node` of an independent array of `--gather-mb` MB per
  process (communication; through the veth),
- both in one program, with no data dependence, and arrangements that might change how
  they overlap (`optimization_barrier` orders, a `fori_loop` compute, Eigen dots instead
  of YNNPACK fusions, XLA:CPU's scheduler types) given as per-executable compiler options.

The variants run interleaved, round by round (the order rotates each round), each step
after a coordination-service barrier so that both processes start it together; a step's
time is the slower process's. After the timed rounds each variant runs once more with a
timeline: `jax.profiler.trace` on each process (XLA:CPU's thunk executor records every
thunk's start and end per thread) and a thread sampling the veth's `tx_bytes` every
millisecond. Writes `experiments/results/overlap_probe/overlap_probe.md` (or `--out`).

Needs root (`ip netns`, `tc`); exits with status 2 and a reason otherwise. The namespaces
are deleted on every exit path; the workers are SIGKILLed by the launcher.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import re
import shutil
import signal
import statistics
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT / "experiments")]
from _common import RESULTS  # noqa: E402
from _trace import (  # noqa: E402
    COLLECTIVE,
    STEP_ANNOTATION,
    TxSampler,
    collective_names,
    intersection,
    length,
    thunk_events,
    union,
)

DEFAULT_OUT = RESULTS / "overlap_probe" / "overlap_probe.md"
COORDINATOR_PORT = 29471  # inside the new namespaces, so free
BARRIER_MS = 120_000

# name -> (what it is, the compiler options of its executable)
NO_YNN_DOTS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_REDUCE"}
VARIANTS = {
    "a_compute": ("(a) matmul chain only", {}),
    "b_gather": ("(b) all-gather over node only", {}),
    "b_psum": ("(b') psum over node only", {}),
    "c_both": ("(c) chain and all-gather, independent", {}),
    "c_psum": ("(c') chain and psum, independent", {}),
    "d_serial": ("(d) all-gather, then the chain reads it (x + 0 * g[0]): serial by data", {}),
    "d_gather_then_compute": (
        "(d) all-gather, then barrier((x, gathered)) before the chain",
        {},
    ),
    "d_compute_then_gather": ("(d) chain, then barrier((h, y)) before the all-gather", {}),
    "d_gather_mid": (
        "(d) all-gather tied by barrier to the chain's midpoint, consumed at the end",
        {},
    ),
    "d_tied_inputs": ("(d) barrier((x, y)) first, then both independent", {}),
    "d_fori": ("(d) chain as lax.fori_loop, and all-gather", {}),
    "d_sched_memory": (
        "(d) c, scheduler CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED",
        {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"},
    ),
    "d_sched_concurrency": (
        "(d) c, scheduler CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED",
        {"xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_CONCURRENCY_OPTIMIZED"},
    ),
    "a_compute_eigen": ("(a) chain only, Eigen dots (no YNNPACK dot fusions)", NO_YNN_DOTS),
    "d_eigen": ("(d) c with Eigen dots (no YNNPACK dot fusions)", NO_YNN_DOTS),
}
QUICK_VARIANTS = ("a_compute", "b_gather", "c_both", "d_serial", "d_fori")


# ----------------------------------------------------------------------------- worker


def _programs(name: str, matmuls: int):
    """The shard_map body of variant `name`: `(x, w, y) -> outputs`, per-device arrays."""
    import jax.numpy as jnp
    from jax import lax

    def chain(x, w, k):
        for _ in range(k):
            x = jnp.tanh(x @ w)
        return x

    def gather(y):
        return lax.all_gather(y, "node", tiled=True)

    half = matmuls // 2

    def body(x, w, y):
        if name in ("a_compute", "a_compute_eigen"):
            return (chain(x, w, matmuls),)
        if name == "b_gather":
            return (gather(y),)
        if name == "b_psum":
            return (lax.psum(y, "node"),)
        if name in ("c_both", "d_sched_memory", "d_sched_concurrency", "d_eigen"):
            return chain(x, w, matmuls), gather(y)
        if name == "c_psum":
            return chain(x, w, matmuls), lax.psum(y, "node")
        if name == "d_serial":
            g = gather(y)
            return chain(x + 0.0 * g[0], w, matmuls), g
        if name == "d_gather_then_compute":
            g = gather(y)
            x, g = lax.optimization_barrier((x, g))
            return chain(x, w, matmuls), g
        if name == "d_compute_then_gather":
            h = chain(x, w, matmuls)
            h, y = lax.optimization_barrier((h, y))
            return h, gather(y)
        if name == "d_gather_mid":
            h = chain(x, w, half)
            h, y = lax.optimization_barrier((h, y))
            return chain(h, w, matmuls - half), gather(y)
        if name == "d_tied_inputs":
            x, y = lax.optimization_barrier((x, y))
            return chain(x, w, matmuls), gather(y)
        if name == "d_fori":
            h = lax.fori_loop(0, matmuls, lambda i, h: jnp.tanh(h @ w), x)
            return h, gather(y)
        raise ValueError(f"unknown variant {name!r}; choose from {sorted(VARIANTS)}")

    return body


def _entry_order(hlo_text: str) -> str:
    """The compiled entry computation as a short sequence: C = compute thunk run,
    G = collective, W = while loop (e.g. `C G C`)."""
    entry = hlo_text[hlo_text.index("\nENTRY") :].splitlines()[1:]
    out = []
    for line in entry:
        m = re.match(r"\s*(?:ROOT )?%?[\w.\-]+ = (.*)", line)
        op = m and re.search(r" ([a-z][\w\-]*)\(", m.group(1))
        if not op or op.group(1) in ("parameter", "tuple", "get-tuple-element", "opt-barrier"):
            continue
        kind = op.group(1)
        tag = "G" if COLLECTIVE.match(kind) else "W" if kind == "while" else "C"
        if not out or out[-1][0] != tag:
            out.append([tag, 0])
        out[-1][1] += 1
    return " ".join(f"{t}x{n}" if n > 1 else t for t, n in out)


def _thunk_spans(
    trace_dir: str, collectives: set[str]
) -> tuple[int | None, list[tuple[str, int, int, int]]]:
    """The start of the step's `STEP_ANNOTATION` (profiler clock, ns) and `(kind, device,
    start, end)` per thunk of `thunk_events`, `kind` "collective" or "compute"."""
    step, spans = None, []
    for name, device, start, end in thunk_events(trace_dir):
        if device is None:
            step = start
            continue
        kind = "collective" if name in collectives or COLLECTIVE.match(name) else "compute"
        spans.append((kind, device, int(start), int(end)))
    return step, spans


def _timeline(compiled, args, iface: str, trace_dir: str | None) -> dict:
    """One step with the tx sampler (and the profiler, given `trace_dir`): when the bytes
    went out, when the thunks ran, relative to the step's start (ms)."""
    import jax

    sampler = TxSampler(iface)
    if trace_dir:
        jax.profiler.start_trace(trace_dir)
    sampler.start()
    time.sleep(0.02)
    t0 = time.time_ns()
    with jax.profiler.TraceAnnotation(STEP_ANNOTATION):
        jax.block_until_ready(compiled(*args))
    t1 = time.time_ns()
    time.sleep(0.3)  # bytes still queued in the tbf qdisc when the step returns
    sampler.stop.set()
    sampler.join(timeout=5)
    if trace_dir:
        jax.profiler.stop_trace()
    ms = lambda t: round((t - t0) / 1e6, 1)  # noqa: E731
    out = {"step_ms": ms(t1)}
    samples = [(t, b) for t, b in sampler.samples if t0 - 5_000_000 <= t <= t1 + 300_000_000]
    if len(samples) > 1:
        base, total = samples[0][1], samples[-1][1] - samples[0][1]
        out["tx_mb"] = round(total / 1e6, 3)
        for q in (0.1, 0.5, 0.9) if total > 100_000 else ():  # not the barriers' bytes
            hit = next((t for t, b in samples if b - base >= q * total), None)
            out[f"tx_{int(q * 100)}pct_ms"] = None if hit is None else ms(hit)
    if trace_dir:
        step, spans = _thunk_spans(trace_dir, collective_names(compiled.as_text()))
        step = step if step is not None else min((s for _, _, s, _ in spans), default=0)
        rel = lambda t: round((t - step) / 1e6, 1)  # noqa: E731
        busy = {
            k: union([(s, e) for kind, _, s, e in spans if kind == k])
            for k in ("collective", "compute")
        }
        for kind, iv in busy.items():
            out[f"{kind}_ms"] = [rel(iv[0][0]), rel(iv[-1][1])] if iv else None
            out[f"{kind}_busy_ms"] = round(length(iv) / 1e6, 1)
        # Any thunk of the process computing while any of its collectives runs ...
        out["overlap_ms"] = round(length(intersection(*busy.values())) / 1e6, 1)
        # ... and the same, device by device (one device's collective beside its own
        # compute: overlap inside one executable's run), the mean over devices.
        per_device = []
        for d in sorted({dev for _, dev, _, _ in spans}):
            iv = [
                union([(s, e) for kind, dev, s, e in spans if kind == k and dev == d])
                for k in ("collective", "compute")
            ]
            if iv[0] and iv[1]:
                per_device.append(length(intersection(*iv)) / 1e6)
        out["overlap_same_device_ms"] = round(statistics.mean(per_device), 1) if per_device else 0.0
    return out


def worker(argv: list[str]) -> None:
    """One node: builds the variants, times them round by round, records timelines."""
    p = argparse.ArgumentParser()
    p.add_argument("--iface", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rate", required=True)
    p.add_argument("--variants", required=True)
    p.add_argument("--rounds", type=int, required=True)
    p.add_argument("--matmuls", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--gather-mb", type=float, required=True)
    p.add_argument("--tag", required=True)
    args = p.parse_args(argv)

    from cluster_worker import UNLIMITED, read_counter, shape_link

    from zeropp_jax.launch import initialize_from_env

    initialize_from_env()
    import jax
    import numpy as np
    from jax._src import distributed
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    me, local = jax.process_index(), jax.local_device_count()
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    mesh = Mesh(np.array(devices).reshape(jax.process_count(), local), ("node", "local"))
    spec = P(("node", "local"))
    sharding = NamedSharding(mesh, spec)
    n_dev = mesh.size
    # The same work per process whatever `local`: rows of x scale as 1 / local.
    rows = args.size * 4 // local
    gather_elems = int(args.gather_mb * 1e6 / 4 / local)
    rs = np.random.RandomState(0)
    host = {
        "x": (rs.randn(n_dev * rows, args.size) * 0.05).astype(np.float32),
        "w": (rs.randn(n_dev * args.size, args.size) / np.sqrt(args.size)).astype(np.float32),
        "y": rs.randn(n_dev * gather_elems).astype(np.float32),
    }
    arrays = [
        jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx])
        for v in host.values()
    ]
    client = distributed.global_state.client
    count = [0]

    def barrier() -> None:
        count[0] += 1
        client.wait_at_barrier(f"overlap-{args.tag}-{count[0]}", BARRIER_MS)

    names = args.variants.split(",")
    compiled, order = {}, {}
    for name in names:
        body = _programs(name, args.matmuls)
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 3, out_specs=spec))
        exe = fn.lower(*arrays).compile(compiler_options=VARIANTS[name][1])
        compiled[name], order[name] = exe, _entry_order(exe.as_text())
        print(f"process {me}: {name} compiled; entry {order[name]}", flush=True)

    shape_link(args.iface, args.rate, burst_kb=64, latency_ms=100)
    times = {n: [] for n in names}
    tx = {n: [] for n in names}
    try:
        for name in names:  # warm-up
            barrier()
            jax.block_until_ready(compiled[name](*arrays))
        load = [os.getloadavg()[0]]
        for r in range(args.rounds):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                barrier()
                b0 = read_counter(args.iface, "tx_bytes")
                t = time.perf_counter()
                jax.block_until_ready(compiled[name](*arrays))
                times[name].append(time.perf_counter() - t)
                tx[name].append(read_counter(args.iface, "tx_bytes") - b0)
            load.append(os.getloadavg()[0])
            print(f"process {me}: round {r + 1}/{args.rounds} done", flush=True)
        timelines = {}
        for name in names:
            trace_dir = tempfile.mkdtemp(prefix=f"overlap_trace_{me}_")
            barrier()
            timelines[name] = _timeline(compiled[name], arrays, args.iface, trace_dir)
            shutil.rmtree(trace_dir, ignore_errors=True)
            print(f"process {me}: timeline {name}: {timelines[name]}", flush=True)
    finally:
        shape_link(args.iface, UNLIMITED, burst_kb=64, latency_ms=100)
    record = dict(
        process=me,
        local_devices=local,
        rows=rows,
        gather_elems=gather_elems,
        times_s=times,
        tx_bytes=tx,
        entry=order,
        timelines=timelines,
        load=load,
    )
    with open(os.path.join(args.out, f"{args.tag}_process_{me}.json"), "w") as f:
        json.dump(record, f)
    barrier()


# ----------------------------------------------------------------------------- parent


def _rate(text: str) -> str:
    """`100mbit`, `100` -> "100"; `inf` stays. Raises ValueError otherwise."""
    t = text.strip().lower().removesuffix("mbit").removesuffix("mbit/s")
    if t == "inf" or (t.replace(".", "", 1).isdigit() and float(t) > 0):
        return t
    raise ValueError(f"--rate {text!r}: expected Mbit/s such as 100mbit, or inf")


def _probe_commands(topo, tmp: pathlib.Path, worker_args: list[str]) -> list[list[str]]:
    """run_cluster's worker commands with this file, in worker mode, as the worker."""
    import run_cluster

    commands = run_cluster.worker_commands(topo, tmp, worker_args)
    target = str(run_cluster.WORKER)
    return [
        sum(
            (
                [str(pathlib.Path(__file__).resolve()), "--worker"] if a == target else [a]
                for a in c
            ),
            [],
        )
        for c in commands
    ]


def _summarize(records: list[dict], names: list[str]) -> dict[str, dict]:
    """Per variant: the slower process's step per round, median and range; link MB per
    step (busier direction); compiled entry order; process 0's timeline."""
    out = {}
    for name in names:
        per_round = [max(ts) for ts in zip(*(r["times_s"][name] for r in records), strict=True)]
        mb = max(statistics.median(r["tx_bytes"][name]) for r in records) / 1e6
        out[name] = dict(
            median=statistics.median(per_round),
            min=min(per_round),
            max=max(per_round),
            link_mb=mb,
            entry=records[0]["entry"][name],
            timeline=[r["timelines"][name] for r in records],
        )
    return out


def _fmt_span(v) -> str:
    return "-" if not v else f"{v[0]:.0f}-{v[1]:.0f}"


def _table(rows: dict[str, dict], local: int) -> str:
    a, b = rows.get("a_compute"), rows.get("b_gather")
    lines = [
        f"### {local} device(s) per process\n",
        "| variant | what | step, median (s) | min-max (s) | link MB/step | entry order |"
        " vs a+b | vs max(a,b) |",
        "|---|---|---:|---:|---:|---|---:|---:|",
    ]
    for name, r in rows.items():
        base_a = rows.get("a_compute_eigen") if "eigen" in name else a
        psum = "psum" in name
        base_b = rows.get("b_psum") if psum else b
        ref = ""
        if base_a and base_b and name not in ("a_compute", "a_compute_eigen", "b_gather", "b_psum"):
            s, m = base_a["median"] + base_b["median"], max(base_a["median"], base_b["median"])
            ref = f"| {r['median'] / s:.2f} | {r['median'] / m:.2f} "
        else:
            ref = "| | "
        lines.append(
            f"| `{name}` | {VARIANTS[name][0]} | {r['median']:.3f} | {r['min']:.3f}-{r['max']:.3f}"
            f" | {r['link_mb']:.2f} | {r['entry']} {ref}|"
        )
    if a and b:
        lines.append(
            f"\na = {a['median']:.3f} s, b = {b['median']:.3f} s: a+b = "
            f"{a['median'] + b['median']:.3f} s, max(a,b) = {max(a['median'], b['median']):.3f} s."
        )
    lines += [
        "\nTimeline (one extra step per variant, per process: ms from the step's start; "
        "thunk spans from `jax.profiler`, union over threads; tx from the veth counter "
        "sampled every ms):\n",
        "| variant | process | step (ms) | collective thunks (ms) | busy | compute thunks (ms) "
        "| busy | both at once (ms) | same device, both at once (ms) "
        "| tx 10% / 50% / 90% at (ms) | tx MB |",
        "|---|---:|---:|---|---:|---|---:|---:|---:|---|---:|",
    ]
    for name, r in rows.items():
        for i, t in enumerate(r["timeline"]):
            txs = " / ".join(
                "-" if t.get(f"tx_{q}pct_ms") is None else f"{t[f'tx_{q}pct_ms']:.0f}"
                for q in (10, 50, 90)
            )
            lines.append(
                f"| `{name}` | {i} | {t['step_ms']:.0f} | {_fmt_span(t.get('collective_ms'))} "
                f"| {t.get('collective_busy_ms', 0):.0f} | {_fmt_span(t.get('compute_ms'))} "
                f"| {t.get('compute_busy_ms', 0):.0f} | {t.get('overlap_ms', 0):.0f} "
                f"| {t.get('overlap_same_device_ms', 0):.0f} | {txs} "
                f"| {t.get('tx_mb', 0):.2f} |"
            )
    return "\n".join(lines) + "\n"


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        worker(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="100mbit", help="link rate, e.g. 100mbit, or inf")
    p.add_argument("--quick", action="store_true", help="smoke run: 3 rounds, 5 variants")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds (default 9)")
    p.add_argument("--variants", default=None, help=f"comma-separated, of {list(VARIANTS)}")
    p.add_argument("--local-devices", default=None, help="per process, e.g. 4,1 (default)")
    p.add_argument("--matmuls", type=int, default=24, help="length of the matmul chain")
    p.add_argument("--size", type=int, default=512, help="matmul size n (x: n x n per device)")
    p.add_argument("--gather-mb", type=float, default=4.0, help="all-gather MB per process")
    p.add_argument("--timeout", type=float, default=1500.0, help="seconds per launch")
    p.add_argument("--out", default=None, help=f"default {DEFAULT_OUT.relative_to(ROOT)}")
    args = p.parse_args(argv)
    try:
        rate = _rate(args.rate)
    except ValueError as e:
        p.error(str(e))
    names = (args.variants or ",".join(QUICK_VARIANTS if args.quick else VARIANTS)).split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    rounds = args.rounds or (3 if args.quick else 9)
    locals_ = [int(k) for k in (args.local_devices or ("4" if args.quick else "4,1")).split(",")]
    if any(k not in (1, 2, 4) for k in locals_):
        p.error(f"--local-devices {locals_}: each must be 1, 2 or 4")

    import run_cluster
    from _common import machine_line

    from zeropp_jax import launch

    try:
        run_cluster.check_available()
    except run_cluster.Unavailable as e:
        print(f"overlap_probe: cannot run here: {e}", file=sys.stderr)
        return 2
    load_before = os.getloadavg()
    machine = machine_line()
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    topo = run_cluster.Topology.for_run(f"o{os.getpid() % 100000}")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="zeropp_overlap_"))
    results = {}
    try:
        run_cluster.setup(topo)
        print(f"namespaces {topo.namespaces}; logs in {tmp}", flush=True)
        for j, local in enumerate(locals_):
            tag = f"local{local}"
            worker_args = [
                "--out", str(tmp), "--rate", rate, "--variants", ",".join(names),
                "--rounds", str(rounds), "--matmuls", str(args.matmuls),
                "--size", str(args.size), "--gather-mb", str(args.gather_mb), "--tag", tag,
            ]  # fmt: skip
            envs = [
                launch.worker_env(
                    process_id=i,
                    num_processes=2,
                    coordinator=f"{topo.addresses[0]}:{COORDINATOR_PORT + j}",
                    local_devices=local,
                    heartbeat_timeout=30,
                    base=dict(os.environ, JAX_PLATFORMS="cpu"),
                )
                for i in range(2)
            ]
            result = launch.supervise(
                _probe_commands(topo, tmp, worker_args),
                envs,
                timeout=args.timeout,
                log_dir=str(tmp / f"logs_{tag}"),
                echo=sys.stdout,
            )
            if result.returncode:
                print(result.report(40), file=sys.stderr)
                return result.returncode
            records = [json.loads((tmp / f"{tag}_process_{i}.json").read_text()) for i in (0, 1)]
            results[local] = (_summarize(records, names), records)
    except KeyboardInterrupt as e:
        print(f"overlap_probe: interrupted ({e}); logs in {tmp}", file=sys.stderr)
        return 130
    finally:
        for e in run_cluster.teardown(topo):
            print(f"teardown: {e}", file=sys.stderr)

    loads = [x for _, recs in results.values() for r in recs for x in r["load"]]
    head = (
        f"# Overlap on CPU: does XLA:CPU run a cross-node collective while it computes?\n\n"
        f"{machine}.\n\nCommand: `python experiments/cluster/overlap_probe.py --rate "
        f"{args.rate}{' --quick' if args.quick else ''}` (rounds {rounds}, matmul chain "
        f"{args.matmuls} x n={args.size}, all-gather {args.gather_mb} MB per process per "
        f"direction, link {rate} Mbit/s tbf). Load average (1 min): {load_before[0]:.2f} "
        f"before; {min(loads):.2f}-{max(loads):.2f} during the rounds.\n\n"
        "Step: per round the slower process's wall time (barrier, call, "
        "`block_until_ready`), median and min-max over the rounds; the variants interleaved, "
        "their order rotated each round. Entry order: the compiled entry computation, C = "
        "compute ops, G = collective, W = while loop.\n\n"
    )
    body = "\n".join(_table(rows, local) for local, (rows, _) in results.items())
    # A quick run does not overwrite the results file unless --out says so.
    out = pathlib.Path(args.out or (tmp / "overlap_probe_quick.md" if args.quick else DEFAULT_OUT))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(head + body)
    print(head + body)
    print(f"wrote {out}; raw records (per process) in {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
