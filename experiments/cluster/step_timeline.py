"""Where a training step's time goes on the emulated two-node cluster: a thunk timeline.

    sudo python experiments/cluster/step_timeline.py --configs zeropp --rate 100

The two-namespace cluster of `run_cluster.py` (2 processes x 4 CPU devices, a shaped
veth between them) runs this file as a worker in each namespace. Each worker builds the
cluster's MLP and step for every config (`cluster_worker.build`; `--compiler-options`
compiles every step's executable with those XLA options), times `--steps` steps at
`--rate` (configs alternating), then runs one more step per config under
`jax.profiler.trace` with the veth's `tx_bytes` sampled every millisecond
(`_trace.TxSampler`): XLA:CPU's thunk executor records each thunk's start and end.
`phases` splits that step into forward and backward + update and reports, per phase, the
bytes the link carried and the time it needs for them, and per device how long its
collective thunks ran, its compute thunks ran, and both at once, with the largest kinds of
compute. Writes the table to `--out` (markdown; default
`experiments/results/step_timeline/step_timeline.md`); the raw spans stay in the run's
temporary folder (`process_<i>.json`).

Needs root (`ip netns`, `tc`); exits with status 2 and a reason otherwise.
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
from _common import study_dir  # noqa: E402

COORDINATOR_PORT = 29491  # inside the new namespaces, so free
BARRIER_MS = 300_000


COLLECTIVE_THUNK = re.compile(
    r"^(all[-_]gather|all[-_]reduce|reduce[-_]scatter|all[-_]to[-_]all|ppermute|collective[-_]permute)"
)
CONTAINER_THUNK = re.compile(r"^(while|call|conditional)([._]\d+)?$")
"""Thunks that only run nested thunks (recorded themselves): neither compute nor collective."""


def _spans(trace_dir: str, collectives: set[str]) -> list[tuple[str, str, int, int, int]]:
    """`(name, kind, device, start_ns, end_ns)` of every thunk in a profiler trace, `kind`
    "collective", "compute" or "step" (the step's annotation, device -1); loop and call
    thunks, which only run nested thunks, are left out."""
    from _trace import thunk_events

    out = []
    for name, device, start, end in thunk_events(trace_dir):
        if device is None:
            out.append((name, "step", -1, start, end))
        elif not CONTAINER_THUNK.match(name):
            collective = name in collectives or COLLECTIVE_THUNK.match(name)
            out.append((name, "collective" if collective else "compute", device, start, end))
    return out


def worker(argv: list[str]) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--iface", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--rate", required=True)
    p.add_argument("--configs", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--width", type=int, default=1536)
    p.add_argument("--depth", type=int, default=5)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--compiler-options", default="")
    args = p.parse_args(argv)

    from _trace import STEP_ANNOTATION, TxSampler, collective_names
    from cluster_worker import UNLIMITED, build, shape_link

    from zeropp_jax.launch import initialize_from_env

    initialize_from_env()
    import jax
    from jax._src import distributed

    import zeropp_jax as zpp

    me = jax.process_index()
    client = distributed.global_state.client
    count = [0]

    def barrier() -> None:
        count[0] += 1
        client.wait_at_barrier(f"timeline-{count[0]}", BARRIER_MS)

    mesh = zpp.make_mesh()
    names = args.configs.split(",")
    runs, hlo = {}, {}
    for name in names:
        state, step, batch, _ = build(name, args.width, args.depth, args.batch, mesh, 1)
        options = dict(kv.split("=", 1) for kv in args.compiler_options.split(";") if kv)
        exe = step.lower(state, batch).compile(compiler_options=options)
        hlo[name] = exe.as_text()
        barrier()
        state, _ = jax.block_until_ready(exe(state, batch))
        runs[name] = [state, exe, batch]
        print(f"process {me}: {name} compiled", flush=True)

    def one(name):
        state, step, batch = runs[name]
        state, metrics = jax.block_until_ready(step(state, batch))
        runs[name][0] = state

    shape_link(args.iface, args.rate, burst_kb=64, latency_ms=100)
    times = {n: [] for n in names}
    records = {}
    try:
        for name in names:
            barrier()
            one(name)
        for _ in range(args.steps):
            for name in names:
                barrier()
                t = time.perf_counter()
                one(name)
                times[name].append(time.perf_counter() - t)
        for name in names:
            trace_dir = tempfile.mkdtemp(prefix=f"step_trace_{me}_")
            sampler = TxSampler(args.iface)
            barrier()
            jax.profiler.start_trace(trace_dir)
            sampler.start()
            time.sleep(0.02)
            t0 = time.time_ns()
            with jax.profiler.TraceAnnotation(STEP_ANNOTATION):
                one(name)
            t1 = time.time_ns()
            time.sleep(0.3)
            sampler.stop.set()
            sampler.join(timeout=5)
            jax.profiler.stop_trace()
            spans = _spans(trace_dir, collective_names(hlo[name]))
            shutil.rmtree(trace_dir, ignore_errors=True)
            records[name] = dict(
                t0=t0,
                t1=t1,
                spans=spans,
                tx=[(t, b) for t, b in sampler.samples if t0 - 5e6 <= t <= t1 + 3e8],
                times_s=times[name],
            )
            print(f"process {me}: timeline {name}: {len(spans)} spans", flush=True)
    finally:
        shape_link(args.iface, UNLIMITED, burst_kb=64, latency_ms=100)
    with open(os.path.join(args.out, f"process_{me}.json"), "w") as f:
        json.dump(records, f)
    barrier()


def _kind(name: str) -> str:
    """A thunk's kind without its number: `ynn_fusion.9` -> "ynn_fusion (dot)"."""
    base = re.sub(r"[._]\d+$", "", name)
    return f"{base} (dot)" if base.startswith("ynn") or base == "dot" else base


def phases(record: dict, rate_mbit: float | None) -> list[dict]:
    """The step's forward (up to its first collective other than an all-gather: the
    loss's all-reduce or the first gradient reduction) and backward + update, and the whole
    step: wall ms, bytes the veth sent and the time the link needs for them at
    `rate_mbit`, and per device (the mean over this process's devices) the ms its
    collective thunks ran, its compute thunks ran, and both at once, with the compute
    thunks' five largest kinds on the process's first device."""
    from _trace import intersection, length, union

    spans = [tuple(x) for x in record["spans"]]
    start = next((s for _, k, _, s, _ in spans if k == "step"), record["t0"])
    ms = lambda t: (t - start) / 1e6  # noqa: E731  profiler clock
    end = (record["t1"] - record["t0"]) / 1e6
    tx = [((t - record["t0"]) / 1e6, b) for t, b in record["tx"]]

    def sent(a: float, b: float) -> float:
        at = lambda x: max([v for t, v in tx if t <= x] or [tx[0][1]])  # noqa: E731
        return (at(b) - at(a)) / 1e6 if tx else 0.0

    not_gathers = [ms(s) for n, k, _, s, _ in spans if k == "collective" and "gather" not in n]
    split = min(not_gathers, default=end)
    devices = sorted({d for _, k, d, _, _ in spans if k != "step"})
    out = []
    for phase, (a, b) in (
        ("forward", (0.0, split)),
        ("backward + update", (split, end)),
        ("step", (0.0, end)),
    ):
        clip = lambda iv: [(max(s, a), min(e, b)) for s, e in iv if min(e, b) > max(s, a)]  # noqa: B023, E731
        busy = []
        for d in devices:
            coll = clip(
                union([(ms(s), ms(e)) for _, k, dv, s, e in spans if dv == d and k == "collective"])
            )
            comp = clip(
                union([(ms(s), ms(e)) for _, k, dv, s, e in spans if dv == d and k == "compute"])
            )
            busy.append((length(coll), length(comp), length(intersection(coll, comp))))
        kinds: dict[str, float] = {}
        for n, k, dv, s, e in spans:
            if k == "compute" and dv == devices[0] and a <= ms(s) < b:
                kinds[_kind(n)] = kinds.get(_kind(n), 0.0) + (e - s) / 1e6
        mb = sent(a, b)
        out.append(
            dict(
                phase=phase,
                ms=b - a,
                tx_mb=mb,
                link_ms=mb * 8e3 / rate_mbit if rate_mbit else None,
                collective_ms=statistics.mean(x[0] for x in busy),
                compute_ms=statistics.mean(x[1] for x in busy),
                both_ms=statistics.mean(x[2] for x in busy),
                kinds=sorted(kinds.items(), key=lambda kv: -kv[1])[:5],
            )
        )
    return out


def report(records: list[dict], names: list[str], rate: str) -> str:
    """Markdown: per config the step (median and range over the timed steps, the slower
    process each step) and each process's phases."""
    rate_mbit = None if rate == "inf" else float(rate)
    head = (
        "| config | process | phase | wall (ms) | link MB | link time at the rate (ms) | "
        "collective (ms/device) | compute (ms/device) | both at once (ms/device) | "
        "largest compute kinds, first device (ms) |\n"
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|\n"
    )
    rows, steps = [], []
    for name in names:
        times = [max(a, b) for a, b in zip(*(r[name]["times_s"] for r in records), strict=True)]
        steps.append(
            f"- `{name}`: step {statistics.median(times):.3f} s (median of {len(times)}; "
            f"{min(times):.3f}-{max(times):.3f})"
        )
        for i, r in enumerate(records):
            for p in phases(r[name], rate_mbit):
                link = "" if p["link_ms"] is None else f"{p['link_ms']:.0f}"
                kinds = ", ".join(f"{k} {v:.0f}" for k, v in p["kinds"])
                cells = [f"`{name}`", str(i), p["phase"], f"{p['ms']:.0f}", f"{p['tx_mb']:.2f}"]
                cells += [link, f"{p['collective_ms']:.0f}", f"{p['compute_ms']:.0f}"]
                cells += [f"{p['both_ms']:.1f}", kinds]
                rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(steps) + "\n\n" + head + "\n".join(rows) + "\n"


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        worker(argv[1:])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rate", default="100", help="Mbit/s, or inf")
    p.add_argument("--configs", default="zeropp")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument(
        "--compiler-options",
        default="",
        help="XLA options of every step's executable, 'key=value;key=value'",
    )
    p.add_argument("--timeout", type=float, default=1500.0)
    p.add_argument("--out", default=None, help="markdown file (default results/step_timeline/)")
    args = p.parse_args(argv)

    import run_cluster
    from overlap_probe import _probe_commands, _raise_interrupt

    from zeropp_jax import launch

    try:
        run_cluster.check_available()
    except run_cluster.Unavailable as e:
        print(f"step_timeline: cannot run here: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    topo = run_cluster.Topology.for_run(f"t{os.getpid() % 100000}")
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="zeropp_timeline_"))
    try:
        run_cluster.setup(topo)
        worker_args = ["--out", str(tmp), "--rate", args.rate, "--configs", args.configs]
        worker_args += ["--steps", str(args.steps), "--compiler-options", args.compiler_options]
        commands = [
            [str(pathlib.Path(__file__).resolve()) if a == str(HERE / "overlap_probe.py") else a
             for a in c]
            for c in _probe_commands(topo, tmp, worker_args)
        ]  # fmt: skip
        envs = [
            launch.worker_env(
                process_id=i,
                num_processes=2,
                coordinator=f"{topo.addresses[0]}:{COORDINATOR_PORT}",
                local_devices=4,
                heartbeat_timeout=30,
                base=dict(os.environ, JAX_PLATFORMS="cpu"),
            )
            for i in range(2)
        ]
        result = launch.supervise(
            commands, envs, timeout=args.timeout, log_dir=str(tmp / "logs"), echo=sys.stdout
        )
        if result.returncode:
            print(result.report(40), file=sys.stderr)
            return result.returncode
    except KeyboardInterrupt as e:
        print(f"step_timeline: interrupted ({e}); logs in {tmp}", file=sys.stderr)
        return 130
    finally:
        for e in run_cluster.teardown(topo):
            print(f"teardown: {e}", file=sys.stderr)
    records = [json.loads((tmp / f"process_{i}.json").read_text()) for i in (0, 1)]
    from _common import machine_line

    options = f" --compiler-options '{args.compiler_options}'" if args.compiler_options else ""
    text = (
        f"# Where a step's time goes on the emulated two-node cluster\n\n{machine_line()}.\n\n"
        f"Command: `python experiments/cluster/step_timeline.py --configs {args.configs} "
        f"--rate {args.rate} --steps {args.steps}{options}` (the cluster's MLP, 2 processes x "
        "4 CPU devices on 2 cores, link shaped with tc tbf).\n\n"
        "Phases of one extra step per config, recorded with `jax.profiler` (thunk spans) and "
        "the veth's tx counter sampled every ms: forward = up to the first all-to-all (the "
        "first gradient reduction). Per device: the ms its collective thunks ran, its compute "
        "thunks ran, and both at once (the same device's compute during its own "
        "collective), the mean over the process's 4 devices.\n\n"
        + report(records, args.configs.split(","), args.rate)
    )
    print(text)
    out = pathlib.Path(args.out or study_dir("step_timeline") / "step_timeline.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}; raw in {tmp}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
