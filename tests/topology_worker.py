"""A worker for tests/test_topology.py: one process per device, hosts faked by name.

Started by `zeropp_jax.launch` with `--local 1` (one CPU device per process, as SLURM
starts one process per GPU). Process `p` claims host `fakehost<p % hosts>` (a cyclic
placement, like `srun --distribution=cyclic`), passed to the library as `host_name=`;
the worker reads it from its own flags, never from the environment.

    python tests/topology_worker.py --out DIR [--hosts 2] [--steps 2]

writes `DIR/topology_process<i>.npz`: the mesh layouts (as process indices), what the
topology checks raised or warned, and the parameters and losses after `--steps` steps of
`mp_worker`'s "zeropp" run on the derived mesh.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from zeropp_jax.launch import initialize_from_env


def layout(mesh) -> list[list[int]]:
    """The mesh as the process index of each device."""
    return [[d.process_index for d in row] for row in mesh.devices]


def warned(make) -> list[str]:
    """The TopologyWarning messages `make()` emits."""
    from zeropp_jax._mesh import TopologyWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make()
    return [str(w.message) for w in caught if issubclass(w.category, TopologyWarning)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args(argv)
    initialize_from_env()
    import jax
    import mp_worker
    import numpy as np

    import zeropp_jax as zpp
    from zeropp_jax._mesh import process_hosts

    me, count = jax.process_index(), jax.process_count()
    host = f"fakehost{me % args.hosts}"
    report = {"host_name": host, "local_devices": jax.local_device_count()}
    report["hosts"] = list(process_hosts(host))
    report["hosts_real_names"] = list(process_hosts())  # one machine: one host
    mesh = zpp.make_mesh(host_name=host)
    report["derived"] = layout(mesh)
    report["derived_warnings"] = warned(lambda: zpp.make_mesh(host_name=host))
    report["real_names"] = layout(zpp.make_mesh())
    report["split_warnings"] = warned(lambda: zpp.make_mesh(num_nodes=count, host_name=host))
    report["merge_warnings"] = warned(lambda: zpp.make_mesh(num_nodes=1, host_name=host))
    report["explicit_2"] = layout(zpp.make_mesh(num_nodes=args.hosts, host_name=host))
    try:  # three processes on one host, five on the other
        zpp.make_mesh(host_name="small" if me < 3 else "large")
        report["uneven_error"] = None
    except ValueError as e:
        report["uneven_error"] = str(e)
    print(f"process {me}/{count} on {host}: mesh {report['derived']}", flush=True)

    flat, losses = mp_worker.train("zeropp", args.steps, mesh=mesh)
    path = os.path.join(args.out, f"topology_process{me}.npz")
    np.savez(path, __losses__=losses, __report__=json.dumps(report), **flat)
    print(f"losses {losses.tolist()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
