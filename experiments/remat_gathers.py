"""Gathers per step of a model whose blocks are under remat, and what holding the
recompute's weights costs: the engines' two forms side by side, in one commit.

    JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1 python experiments/remat_gathers.py   # 125m, 16x8 H200s
    python experiments/remat_gathers.py --cpu --model tiny --mesh 2x4        # emulated CPUs

Flags it does not know go to the trainer (`--d-model 32 --n-layers 2`).

The trainer's GPT unscanned (`--no-scan-layers`), each block under `nn.remat`
(`--remat full`), one 2048-token sequence per device (`--seq-len`), AdamW, under ZeRO-3 and
ZeRO++. A use of a weight inside a remat block runs twice in the backward: in the block's
recompute, and in its own backward. `hold` is the engine's form in a program for GPUs
(`dataflow.Gathers.hold_recomputed`): the use's backward reads the weights the recompute
gathered. `gather again` is the form of CPU programs, forced here on the same mesh: the
backward gathers them a second time. Each row: the ledger of the step (`zpp.comm_ledger`,
the program as JAX wrote it; M = the model in 16-bit bytes) and the compiled step's
temporaries per device (`memory_analysis()`; compiled from shapes, deviceless for GPUs
with the CUDA plugin, `_gpu_target.gpu_mesh`).

Writes `remat_gathers.{md,csv}` into `--out` (default `experiments/results/remat_gathers/`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import shlex
import sys
import warnings
from collections.abc import Iterator
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

ENGINES = ("ZeRO-3", "ZeRO++")
FORMS = {"hold": True, "gather again": False}


def trainer_argv(model: str, seq_len: int, devices: int, extra: list[str]) -> list[str]:
    """The trainer's flags of the measured step: unscanned, every block under remat, then
    `extra` (more of the trainer's flags)."""
    return [
        *["--model", model, "--seq-len", str(seq_len), "--batch", str(devices)],
        *["--no-scan-layers", "--remat", "full", *extra],
    ]


@contextlib.contextmanager
def forced_hold(hold: bool) -> Iterator[None]:
    """The island builds its `LeafGathers` with `hold_recomputed=hold`, whatever the
    platform (the engine's choice is `plan.platform == "gpu"`)."""
    from _library import island, leaf_gathers

    build = leaf_gathers.LeafGathers
    island.LeafGathers = lambda **kw: build(**{**kw, "hold_recomputed": hold})
    try:
        yield
    finally:
        island.LeafGathers = build


def row(engine: str, form: str, mesh: Any, argv: list[str]) -> dict[str, Any]:
    """One engine in one form: its ledger and compiled temporaries."""
    import gpu_overhead

    import zeropp_jax as zpp

    with forced_hold(FORMS[form]), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # NothingSentWarning and friends: not this study's
        fn, state, batch = gpu_overhead.build_step(engine, mesh, argv)
        ledger = zpp.comm_ledger(fn, state, batch)
        compiled = fn.lower(state, batch).compile()
    m = ledger.in_units_of_M
    by = ledger.bytes_by("op", "phase")
    return {
        "engine": engine,
        "form": form,
        "forward_gathers_M": round(m(by.get(("all-gather", "forward"), 0.0)), 4),
        "backward_gathers_M": round(m(by.get(("all-gather", "backward"), 0.0)), 4),
        "per_device_M": round(m(ledger.total_bytes), 4),
        "per_node_link_M": round(m(ledger.link_bytes), 4),
        "temp_MB": round(compiled.memory_analysis().temp_size_in_bytes / 1e6, 3),
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="125m", help="GPT preset (125m)")
    p.add_argument("--mesh", default="16x8", help="NODESxLOCAL (16x8)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--cpu", action="store_true", help="emulated CPU devices, not H200s")
    p.add_argument("--out", default=str(_common.study_dir("remat_gathers")))
    args, extra = p.parse_known_args(argv)
    nodes, local = (int(k) for k in args.mesh.split("x"))
    if args.cpu:
        _common.request_cpu_devices(nodes * local)
        import zeropp_jax as zpp

        mesh, target = zpp.make_mesh(nodes, local), "emulated CPU devices"
    else:
        os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
        os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the host runs JAX; the GPU is a target
        import _gpu_target

        mesh, target = _gpu_target.gpu_mesh("h200", nodes, local), "H200s, compiled deviceless"
    flags = trainer_argv(args.model, args.seq_len, nodes * local, extra)
    rows = [row(e, f, mesh, flags) for e in ENGINES for f in FORMS]
    head = (
        f"# Gathers of remat blocks, held or gathered again\n\n{_common.machine_line()}\n\n"
        f"`{shlex.join(['python', 'experiments/remat_gathers.py', *(argv or sys.argv[1:])])}`: the "
        f"trainer's GPT (`{' '.join(flags)}`) on {args.mesh} {target}. `hold`: a use's "
        "backward reads the weights its block's recompute gathered (the engine's form on "
        "GPUs); `gather again`: it gathers them again (the form on CPUs). Gathers and "
        "traffic in M (the model in 16-bit bytes) per step, from the ledger; `temp_MB` "
        "the compiled step's temporaries per device.\n\n"
    )
    _common.write_table(pathlib.Path(args.out), "remat_gathers", head, rows)
    return rows


if __name__ == "__main__":
    main()
