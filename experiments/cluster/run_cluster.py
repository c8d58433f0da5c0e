"""The emulated two-node cluster: XLA FSDP, ZeRO-3 and ZeRO++ over a rate-limited link.

    sudo python experiments/cluster/run_cluster.py                 # full sweep (minutes)
    sudo python experiments/cluster/run_cluster.py --quick         # smoke run, tiny model
    sudo python experiments/cluster/run_cluster.py --rates 100,inf --configs zero3,zeropp
    sudo python experiments/cluster/run_cluster.py --model-parallel 1,2,4 --name tp_cluster

Two network namespaces joined by a veth pair stand for two nodes; each direction of the
pair is shaped with `tc ... tbf` (netem, and so latency emulation, is unavailable). One
worker process per namespace, 4 CPU devices each, forms a 2 x 4 `('node', 'local')` mesh
through `jax.distributed` (coordinator on the first namespace's address) and gloo, whose
collectives cross the shaped link. gloo binds to the address the host name resolves to,
so each worker runs in its own mount and UTS namespace with its own host name and
`/etc/hosts`. Addresses exist only inside the namespaces; nothing is sent from or to the
root namespace.

For each config (`CONFIG_LABELS`: XLA's own FSDP from `zeropp_jax.baselines`, as XLA:CPU
compiles it (16-bit collectives widened to float32) and as a GPU sends it
(`xla_fsdp_gpu_wire`: `xla_fsdp_state(..., gpu_wire=True)`), `zpp.ZeroPPConfig.zero3()`,
`zpp.ZeroPPConfig()` and variants, e.g. with `prefetch=False`) and each rate, the workers
time single training steps of an MLP (median of `--steps` after `--warmup`, the configs
alternating step by step), count the bytes on the veth (`/sys/class/net/<if>/statistics`,
each direction) and set them beside what `zpp.comm_ledger(..., compiled=True)` says crosses
each node's link. With `--model-parallel 1,2,4` the sweep repeats per tensor-parallel size
K: for K > 1 each node's 4 devices form `4 / K` data-parallel ranks of a `model` group of K
(`zpp.make_mesh(model_size=K)`) and the MLP's layers are split Megatron-style over it; the
tables gain a TP column (K = 1 alone writes them as before). Writes
`<name>.md`, `<name>.csv` and `<name>.png` into `--out-dir` (default
`experiments/results`). The namespaces are deleted on every exit path (also on failure,
Ctrl-C or SIGTERM); the workers are SIGKILLed first.

Needs root (`ip netns`, `tc`); exits with status 2 and a reason otherwise.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import pathlib
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "experiments"))
from _common import source_version, study_dir  # noqa: E402

WORKER = pathlib.Path(__file__).resolve().parent / "cluster_worker.py"
SUBNET = "10.231.0"  # private; lives only inside the two namespaces
COORDINATOR_PORT = 29431  # the namespaces are new, so any port is free there
LOCAL_DEVICES = 4
# Speedups are over these configs at the same rate.
BASELINES = ("xla_fsdp", "xla_fsdp_gpu_wire", "zero3")
CONFIG_LABELS = {
    "xla_fsdp": "XLA FSDP",
    "xla_fsdp_gpu_wire": "XLA FSDP, 16-bit wire (as a GPU sends)",
    "zero3": "ZeRO-3",
    "zero3_noprefetch": "ZeRO-3, no prefetch",
    "zeropp": "ZeRO++",
    "zeropp_noprefetch": "ZeRO++, no prefetch",
    "zeropp_delta4": "ZeRO++ with int4 weight deltas",
    "beyond": "int4 weight deltas, int8 / int4 rotated gradient hops",
    "beyond_d2": "int2 weight deltas, int8 / int4 rotated gradient hops",
    "beyond_d2_node_rot": "int2 weight deltas, int8 / int4 gradient hops, node hop rotated",
    "zeropp_delta2": "ZeroPPConfig.beyond(): ZeRO++ with int2 weight deltas",
}


def _plot_order(base: str) -> int:
    """The plot labels each bar with its speedup over the first baseline run: XLA FSDP at a
    GPU's widths, else the others in `BASELINES` order."""
    return -1 if base == "xla_fsdp_gpu_wire" else BASELINES.index(base)


class Unavailable(RuntimeError):
    """The machine cannot run the cluster (not root, no `ip netns`)."""


def _run(cmd: list[str], *, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=20)


@dataclasses.dataclass(frozen=True)
class Topology:
    """Names of the two namespaces, their veth ends and addresses (unique per run)."""

    namespaces: tuple[str, str]
    ifaces: tuple[str, str]
    addresses: tuple[str, str]
    hostnames: tuple[str, str]

    @classmethod
    def for_run(cls, tag: str) -> Topology:
        return cls(
            namespaces=(f"zpp{tag}n0", f"zpp{tag}n1"),
            ifaces=(f"zpp{tag}v0", f"zpp{tag}v1"),  # <= 15 characters
            addresses=(f"{SUBNET}.1", f"{SUBNET}.2"),
            hostnames=(f"zpp-node0-{tag}", f"zpp-node1-{tag}"),
        )


def check_available() -> None:
    """Raises `Unavailable` with the reason when namespaces cannot be made here."""
    if os.geteuid() != 0:
        raise Unavailable("needs root for `ip netns` and `tc`")
    for tool in ("ip", "tc", "unshare", "mount"):
        if shutil.which(tool) is None:
            raise Unavailable(f"`{tool}` is not installed")


def setup(topo: Topology) -> None:
    """Creates the namespaces and the veth pair; brings them up with their addresses."""
    (n0, n1), (v0, v1) = topo.namespaces, topo.ifaces
    _run(["ip", "netns", "add", n0])
    _run(["ip", "netns", "add", n1])
    _run(["ip", "link", "add", v0, "type", "veth", "peer", "name", v1])
    _run(["ip", "link", "set", v0, "netns", n0])
    _run(["ip", "link", "set", v1, "netns", n1])
    for ns, iface, addr in zip(topo.namespaces, topo.ifaces, topo.addresses, strict=True):
        _run(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", iface])
        _run(["ip", "-n", ns, "link", "set", iface, "up"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])


def teardown(topo: Topology) -> list[str]:
    """Deletes the namespaces (and with them the veth pair); returns what failed."""
    errors = []
    existing = _run(["ip", "netns", "list"], check=False).stdout
    for ns in topo.namespaces:
        if ns in existing:
            r = _run(["ip", "netns", "del", ns], check=False)
            if r.returncode:
                errors.append(f"ip netns del {ns}: {r.stderr.strip()}")
    r = _run(["ip", "link", "show", topo.ifaces[0]], check=False)
    if r.returncode == 0:  # created but never moved into its namespace
        _run(["ip", "link", "del", topo.ifaces[0]], check=False)
    return errors


def worker_commands(topo: Topology, tmp: pathlib.Path, worker_args: list[str]) -> list[list]:
    """`ip netns exec <ns> unshare -m -u sh -c '<bind hosts, set hostname, exec worker>'`."""
    hosts = "127.0.0.1 localhost\n" + "".join(
        f"{a} {h}\n" for a, h in zip(topo.addresses, topo.hostnames, strict=True)
    )
    script = 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"'
    commands = []
    for i, ns in enumerate(topo.namespaces):
        hosts_file = tmp / f"hosts_{i}"
        hosts_file.write_text(hosts)
        commands.append(
            ["ip", "netns", "exec", ns, "unshare", "-m", "-u", "sh", "-c", script, "sh"]
            + [str(hosts_file), topo.hostnames[i], sys.executable, str(WORKER)]
            + ["--iface", topo.ifaces[i], *worker_args]
        )
    return commands


# ----------------------------------------------------------------------------- results


def rate_label(rate: str) -> str:
    return "unlimited" if rate == "inf" else f"{rate} Mbit/s"


def summarize(
    records: list[dict], configs: list[str], rates: list[str], model_parallel: list[int] = (1,)
) -> list[dict]:
    """One row per (rate, config), and per tensor-parallel size K when `model_parallel` is
    not just 1: the slower process's step time per step, median and range over steps;
    bytes through the link per step in each direction, measured on the veth and predicted
    by the ledger; speedups over each of `BASELINES` run at that rate (and K)."""
    by = {}
    for r in records:
        by.setdefault((r.get("model_parallel", 1), r["config"], r["rate"]), []).append(r)
    with_tp = list(model_parallel) != [1]
    rows = []
    for k, rate in ((k, rate) for k in model_parallel for rate in rates):
        procs = {cfg: sorted(by[(k, cfg, rate)], key=lambda r: r["process"]) for cfg in configs}
        per_step = {
            cfg: [max(ts) for ts in zip(*(r["times_s"] for r in recs), strict=True)]
            for cfg, recs in procs.items()
        }
        medians = {cfg: statistics.median(times) for cfg, times in per_step.items()}
        wire_s = {}
        for cfg, recs in procs.items():
            measured = [r["tx_bytes"] / r["steps"] for r in recs]
            ledger = [r["ledger_tx_bytes"] for r in recs]
            wire = [r.get("wire_ledger_tx_bytes", r["ledger_tx_bytes"]) for r in recs]
            wire_s[cfg] = equal_wire_step(medians[cfg], rate, measured, ledger, wire)
        for cfg, recs in procs.items():
            measured = [r["tx_bytes"] / r["steps"] for r in recs]  # per direction
            ledger = [r["ledger_tx_bytes"] for r in recs]
            wire = [r.get("wire_ledger_tx_bytes", r["ledger_tx_bytes"]) for r in recs]
            row = dict(model_parallel=k) if with_tp else {}  # K = 1 alone: columns as before
            row.update(
                rate=rate,
                config=cfg,
                step_s=medians[cfg],
                step_min_s=min(per_step[cfg]),
                step_max_s=max(per_step[cfg]),
                mb_node0_to_node1=measured[0] / 1e6,
                mb_node1_to_node0=measured[1] / 1e6,
                ledger_mb_node0_to_node1=ledger[0] / 1e6,
                ledger_mb_node1_to_node0=ledger[1] / 1e6,
                link_mb_per_step=max(measured) / 1e6,
                measured_over_ledger=max(measured) / max(ledger) if max(ledger) else None,
                wire_ledger_mb=max(wire) / 1e6,
                equal_wire_step_s=wire_s[cfg],
                link_in_M=max(measured) / (2 * recs[0]["params"]),  # M: the model, 16-bit
                link_mbit_per_s=max(measured) * 8 / 1e6 / medians[cfg],
                steps=recs[0]["steps"],
                params=recs[0]["params"],
                loss=recs[0]["loss"],
            )
            for base in BASELINES:
                row[f"speedup_over_{base}"] = (
                    medians[base] / medians[cfg] if base in medians else None
                )
                row[f"equal_wire_speedup_over_{base}"] = (
                    wire_s[base] / medians[cfg]
                    if base in wire_s and wire_s[base] is not None
                    else None
                )
                row[f"spreads_apart_from_{base}"] = (
                    base in per_step
                    and base != cfg
                    and (
                        max(per_step[cfg]) < min(per_step[base])
                        or min(per_step[cfg]) > max(per_step[base])
                    )
                )
            rows.append(row)
    return rows


def equal_wire_step(
    median_s: float,
    rate: str,
    measured: list[float],
    ledger: list[float],
    wire: list[float],
) -> float | None:
    """The step time a config would take if it sent `wire` bytes instead of `ledger`
    (per step and direction, per process): a projection by the link model, the median
    less the time the shaped link takes to carry the difference (at the tbf rate, with
    the measured protocol overhead, `measured / ledger`). The config's own step when
    the two agree; None without a rate limit (no link model to project with)."""
    extra = max(ledger) - max(wire)
    if extra <= 0:
        return median_s
    if rate == "inf":
        return None
    overhead = max(measured) / max(ledger)
    return median_s - extra * overhead * 8 / (float(rate) * 1e6)


def _speedup(row: dict, base: str) -> str:
    value = row[f"speedup_over_{base}"]
    if value is None:
        return "n/a"
    if row["config"] == base:
        return "1.00x"
    overlap = "" if row[f"spreads_apart_from_{base}"] else " (ranges overlap)"
    return f"{value:.2f}x{overlap}"


def _wire_cells(row: dict) -> list[str]:
    """The equal-wire cells of a row: XLA FSDP's 16-bit ledger and projected step (on
    its own row), and the speedup over that projection."""
    if row["config"] != "xla_fsdp":
        cells = ["", ""]
    else:
        step = row["equal_wire_step_s"]
        cells = [f"{row['wire_ledger_mb']:.2f}", "n/a" if step is None else f"{step:.3f}"]
    value = row["equal_wire_speedup_over_xla_fsdp"]
    return [
        cells[0] + (" / " + cells[1] if cells[1] else ""),
        "n/a" if value is None else f"{value:.2f}x",
    ]


def write_results(rows: list[dict], out_dir: pathlib.Path, name: str, meta: str) -> list[str]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    csv_path = out_dir / f"{name}.csv"
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    paths.append(str(csv_path))

    bases = [b for b in BASELINES if any(r[f"speedup_over_{b}"] is not None for r in rows)]
    wire = "xla_fsdp" in bases
    with_tp = "model_parallel" in rows[0]
    head = (
        ("| TP | " if with_tp else "| ")
        + "link rate | config | step time, median (s) | min-max (s) | link MB/step, measured "
        "| ledger | measured / ledger | in units of M | "
        + " | ".join(f"speedup over {CONFIG_LABELS[b]}" for b in bases)
        + (
            " | XLA FSDP at 16 bits: ledger MB, step (s, projected) | speedup over it"
            if wire
            else ""
        )
        + " |"
    )
    lines = [f"# Emulated two-node cluster\n\n{meta}\n", head]
    cols = 6 + len(bases) + 2 * wire
    lines.append(("|---:|" if with_tp else "|") + "---|---|" + "---:|" * cols)
    for r in rows:
        ratio = "n/a" if r["measured_over_ledger"] is None else f"{r['measured_over_ledger']:.3f}"
        lines.append(
            (f"| {r['model_parallel']} " if with_tp else "")
            + f"| {rate_label(r['rate'])} | {CONFIG_LABELS.get(r['config'], r['config'])} | "
            f"{r['step_s']:.3f} | {r['step_min_s']:.3f}-{r['step_max_s']:.3f} | "
            f"{r['link_mb_per_step']:.2f} | "
            f"{max(r['ledger_mb_node0_to_node1'], r['ledger_mb_node1_to_node0']):.2f} | "
            f"{ratio} | {r['link_in_M']:.3f} | "
            + " | ".join(_speedup(r, b) for b in bases)
            + (" | " + " | ".join(_wire_cells(r)) if wire else "")
            + " |"
        )
    lines.append(
        "\nStep time: per step the slower process, median (and range) over the timed steps, "
        "the configs alternating step by step. Link MB/step: bytes one node sends through its "
        "network link per step (the veth's `tx_bytes`, the busier of the two directions), "
        "collectives and all protocol overhead (TCP/IP headers, gloo's framing) included. "
        "Ledger: the same from `zpp.comm_ledger(..., compiled=True)` (bytes through each "
        "node's link, gloo's algorithms), payload only. M is the model's size in 16-bit bytes "
        "(2 x parameters). Speedup: the baseline's median step time over the config's, at the "
        "same rate" + (" and TP size" if with_tp else "") + "; '(ranges overlap)' when the two "
        "min-max ranges overlap, so the ratio is not resolved by these steps."
        + (
            " XLA FSDP at 16 bits: XLA:CPU widens the baseline's bfloat16 gathers and "
            "all-reduces to float32, the engine sends its 16-bit values as raw bits; a GPU "
            "compilation keeps them 16-bit. The ledger column reads the program XLA's SPMD "
            "partitioner wrote, before that widening (`comm_ledger(..., partitioned=True)`, "
            "an all-reduce sliced to a shard counted as a reduce-scatter), and the step is a "
            "projection, not a measurement: XLA FSDP's measured median less the time the "
            "shaped link takes to carry the difference (at the tbf rate, with the measured "
            "protocol overhead); none without a rate limit. The last column is that "
            "projection over the config's measured median (equal wires)."
            if wire
            else ""
        )
        + (
            " TP: the tensor-parallel size K, the `model` axis of `zpp.make_mesh(model_size=K)` "
            "inside each node (4 / K data-parallel devices per node); K = 1 is the two-axis "
            "mesh and an unannotated MLP. For K > 1 the MLP's layers are split in Megatron "
            "pairs (column-parallel, then row-parallel; an odd last layer whole); XLA's "
            "tensor-parallel all-reduces run over `model`, inside a node, so they do not "
            "cross the link."
            if with_tp
            else ""
        )
    )
    md_path = out_dir / f"{name}.md"
    md_path.write_text("\n".join(lines) + "\n")
    paths.append(str(md_path))

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return paths
    # One group of bars per rate (per TP size and rate when there is a TP column).
    group = (lambda r: (r["model_parallel"], r["rate"])) if with_tp else (lambda r: r["rate"])
    rates = list(dict.fromkeys(group(r) for r in rows))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10 + 2 * with_tp, 4))
    width = 0.8 / len(configs)
    for j, cfg in enumerate(configs):
        sel = {group(r): r for r in rows if r["config"] == cfg}
        xs = [i + (j - (len(configs) - 1) / 2) * width for i in range(len(rates))]
        label = CONFIG_LABELS.get(cfg, cfg)
        ax0.bar(xs, [sel[r]["step_s"] for r in rates], width, label=label)
        ax1.bar(xs, [sel[r]["link_mb_per_step"] for r in rates], width, label=label)
        for x, rate in zip(xs, rates, strict=True):
            over = [sel[rate][f"speedup_over_{b}"] for b in sorted(BASELINES, key=_plot_order)]
            speedup = next((x for x in over if x is not None), None)
            if speedup is not None and cfg not in BASELINES:
                ax0.annotate(
                    f"{speedup:.1f}x",
                    (x, sel[rate]["step_s"]),
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
    for ax, title in ((ax0, "step time, median (s)"), (ax1, "link MB per step, each way")):
        labels = [f"TP {r[0]}, {rate_label(r[1])}" if with_tp else rate_label(r) for r in rates]
        ax.set_xticks(range(len(rates)), labels, rotation=20, fontsize=8 if with_tp else None)
        ax.set_title(title)
        ax.set_ylim(top=ax.get_ylim()[1] * 1.3)  # room for the legend
        ax.legend(loc="upper right", fontsize=8, framealpha=1.0)
    fig.suptitle(textwrap.fill(meta, 160), fontsize=7)
    fig.tight_layout()
    png_path = out_dir / f"{name}.png"
    fig.savefig(png_path, dpi=120)
    plt.close(fig)
    paths.append(str(png_path))
    return paths


# ----------------------------------------------------------------------------- main


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: tiny MLP, 2 steps")
    p.add_argument("--rates", default=None, help="Mbit/s, comma-separated; inf = no limit")
    p.add_argument("--configs", default="xla_fsdp,zero3,zeropp")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per rate (1)")
    p.add_argument("--width", type=int, default=None, help="MLP width (default 1536)")
    p.add_argument("--depth", type=int, default=None, help="MLP layers (default 5)")
    p.add_argument("--batch", type=int, default=None, help="global batch (default 64)")
    p.add_argument(
        "--model-parallel",
        default="1",
        help="tensor-parallel sizes K, comma-separated (default 1: no tensor parallelism); "
        "K > 1 splits the MLP over a `model` axis of K devices inside each node",
    )
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    p.add_argument("--out-dir", default=str(study_dir("cluster")))
    p.add_argument("--name", default=None, help="output file stem (default cluster[_quick])")
    p.add_argument("--keep-logs", action="store_true", help="keep the temporary directory")
    return p


def _defaults(args: argparse.Namespace) -> argparse.Namespace:
    quick = dict(rates="200,inf", steps=2, warmup=1, width=256, depth=2, batch=16)
    full = dict(rates="100,200,400,1000,inf", steps=5, warmup=1, width=1536, depth=5, batch=64)
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.name is None:
        args.name = "cluster_quick" if args.quick else "cluster"
    return args


def parse_model_parallel(text: str, width: int) -> list[int]:
    """The TP sizes of `--model-parallel`; raises `ValueError` naming a size that cannot be."""
    sizes = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) < 1:
            raise ValueError(f"{part!r} is not a positive whole number; give e.g. 1,2,4")
        k = int(part)
        if LOCAL_DEVICES % k:
            raise ValueError(f"{k} does not divide the {LOCAL_DEVICES} devices of a node")
        if width % k:
            raise ValueError(f"{k} does not divide the MLP width {width}; choose another --width")
        sizes.append(k)
    if len(set(sizes)) != len(sizes):
        raise ValueError(f"{text!r} repeats a size")
    return sizes


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    args = _defaults(_parser().parse_args(argv))
    rates = [r.strip() for r in args.rates.split(",")]
    configs = [c.strip() for c in args.configs.split(",")]
    for r in rates:
        if r != "inf" and not (r.replace(".", "", 1).isdigit() and float(r) > 0):
            print(f"--rates: {r!r} is not a positive number of Mbit/s or 'inf'", file=sys.stderr)
            return 2
    if not set(configs) <= set(CONFIG_LABELS):
        print(f"--configs: {configs}; choose from {sorted(CONFIG_LABELS)}", file=sys.stderr)
        return 2
    try:
        model_parallel = parse_model_parallel(args.model_parallel, args.width)
    except ValueError as e:
        print(f"--model-parallel: {e}", file=sys.stderr)
        return 2
    try:
        check_available()
    except Unavailable as e:
        print(f"run_cluster: cannot run here: {e}", file=sys.stderr)
        return 2

    from zeropp_jax import launch  # after the checks: imports jax

    load_before = os.getloadavg()[0]
    version = source_version()  # before the run: the code the workers import
    signal.signal(signal.SIGTERM, _raise_interrupt)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even if started in background
    topo = Topology.for_run(str(os.getpid()))
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="zeropp_cluster_"))
    worker_args = [
        "--out", str(tmp), "--rates", ",".join(rates), "--configs", ",".join(configs),
        "--steps", str(args.steps), "--warmup", str(args.warmup), "--width", str(args.width),
        "--depth", str(args.depth), "--batch", str(args.batch),
        "--model-parallel", ",".join(map(str, model_parallel)),
    ]  # fmt: skip
    coordinator = f"{topo.addresses[0]}:{COORDINATOR_PORT}"
    envs = [
        launch.worker_env(
            process_id=i,
            num_processes=2,
            coordinator=coordinator,
            local_devices=LOCAL_DEVICES,
            heartbeat_timeout=30,  # heartbeats cross the shaped link too
            base=dict(os.environ, JAX_PLATFORMS="cpu"),
        )
        for i in range(2)
    ]
    try:
        setup(topo)
        print(f"namespaces {topo.namespaces} joined by {topo.ifaces}; logs in {tmp}", flush=True)
        result = launch.supervise(
            worker_commands(topo, tmp, worker_args),
            envs,
            timeout=args.timeout,
            log_dir=str(tmp / "logs"),
            echo=sys.stdout,
        )
    except KeyboardInterrupt as e:
        print(f"run_cluster: interrupted ({e}); workers killed, logs in {tmp}", file=sys.stderr)
        return 130
    finally:
        errors = teardown(topo)
        for e in errors:
            print(f"teardown: {e}", file=sys.stderr)
    if result.returncode:
        print(result.report(40), file=sys.stderr)
        return result.returncode
    records = []
    for i in range(2):
        records += json.loads((tmp / f"process_{i}.json").read_text())
    rows = summarize(records, configs, rates, model_parallel)
    tp = "" if model_parallel == [1] else f"tensor-parallel sizes {args.model_parallel}; "
    meta = (
        f"MLP {args.depth} x {args.width} ({rows[0]['params'] / 1e6:.1f}M parameters), {tp}global "
        f"batch {args.batch}; 2 processes x {LOCAL_DEVICES} CPU devices on {os.cpu_count()} "
        f"cores ({platform.machine()}); median of {args.steps} steps after {args.warmup} "
        "warm-up; link shaped with tc tbf in each direction. Load average (1 min) "
        f"{load_before:.1f} before the run, {os.getloadavg()[0]:.1f} after. {version}."
    )
    for path in write_results(rows, pathlib.Path(args.out_dir), args.name, meta):
        print(f"wrote {path}")
    print((pathlib.Path(args.out_dir) / f"{args.name}.md").read_text())
    if not args.keep_logs:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
