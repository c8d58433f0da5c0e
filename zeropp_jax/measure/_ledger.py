"""`comm_ledger`: the bytes every collective of a jitted step sends, per mesh axis and phase.

The ledger reads the lowered, pre-optimisation HLO of a jitted callable (the program as
JAX wrote it, before XLA merges, widens or reorders anything) and turns each collective
into a `CollectiveRecord`: its dtype, its per-device shapes, the mesh axes its replica
groups span, whether it crosses nodes, its phase (forward or backward) and how often it
runs (the product of the trip counts of the loops around it). `comm_ledger(...,
compiled=True)` reads XLA's optimised program the same way, to check what actually runs.
`comm_ledger(..., partitioned=True)` reads the program as XLA's SPMD partitioner leaves it,
before the backend's own passes (`zeropp_jax.measure._partitioned`): the wire a GPU would carry.

Bytes sent per device follow one set of definitions (DESIGN.md, "How we measure"), with
`G` the replica group size and `n` the loop trip count:

  * all-gather: `out * (G - 1) / G * n`
  * reduce-scatter and all-to-all: `in * (G - 1) / G * n`
  * all-reduce: `2 * in * (G - 1) / G * n`
  * collective-permute: `in * n`

Bytes through each node's network link (`CollectiveRecord.node_out_bytes` /
`node_in_bytes`, `CommLedger.link_bytes`) follow the algorithm the collective library runs
over the replica group, counting only the device-to-device transfers whose two ends sit on
different nodes (`links=`, default from the mesh's platform):

  * `'gloo'` (XLA:CPU, what the emulated cluster runs): all-gather and all-reduce are
    rings in the group's order (`out * (G-1)/G` per edge; all-reduce `2 * in * (G-1)/G`);
    reduce-scatter is gloo's recursive halving (step `s` sends `in / 2^(s+1)` to the rank
    `2^s` away; a group whose size is not a power of two is counted as a ring);
  * `'nccl'` (GPU): the same rings, ordered as NCCL orders them, one node after the other,
    so a ring crosses each node boundary once; reduce-scatter is a ring too;
  * both: all-to-all sends `in / G` to every other member of the group, and a
    collective-permute `in` along each of its source-target pairs.

How the HLO is read:

  * Device ids in replica groups are logical ids, i.e. positions in the computation's
    device assignment, which for a computation over a mesh is `mesh.devices.flat`. An id
    is therefore mapped to its mesh coordinates with `np.unravel_index(id, mesh shape)`,
    whatever the physical device order of the mesh is.
  * Phase: a collective is `'backward'` when any op name on its chain of call sites
    (from the entry computation down to the op itself) names a `transpose(...)`
    (reverse-mode AD, including a `custom_vjp` backward rule) or a
    `rematted_computation` (recomputation under `jax.checkpoint`); `'update'` when one
    lies in the optimizer update's named scope (`optimizer_view.UPDATE_SCOPE`); else
    `'forward'`.
    Inside a `shard_map` body op names are relative to the body, hence the call chain.
  * Loops: the trip count of a `lax.scan` / static `fori_loop` is read from the loop
    itself in the pre-optimisation HLO (counter from a constant, `+1`, `< N`). Any other
    `while` takes `known_trip_count` from the compiled HLO, matched by source location
    and phase. A loop whose count neither gives raises a `ValueError`.
  * Part: `CollectiveRecord.part` names the part of the step a collective serves, from
    its op and phase: forward or backward weight gather, gradient reduction, or other.
  * Tuple-shaped (variadic) collectives give one record per element dtype, with the
    bytes of that dtype's elements summed.
  * Sizes use numpy item sizes: 4-bit and 2-bit types count one byte per element (what
    travels unless they are packed into bytes).
  * Each call path to a computation is counted: a body reached twice counts twice, and
    every branch of a `conditional` is counted (an upper bound).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from zeropp_jax.measure._groups import crosses_nodes, group_axes, node_of
from zeropp_jax.measure._hlo_text import (
    COLLECTIVE_OPS,
    HloInstruction,
    array_shapes,
    call_paths,
    known_trip_counts,
    parse_hlo_module,
    parse_replica_groups,
    scan_trip_count,
)
from zeropp_jax.measure._links import LINK_MODELS, default_links, node_traffic, transfers  # noqa: F401 (public here)
from zeropp_jax.measure._partitioned import partitioned_program, sliced_all_reduces
from zeropp_jax.measure._phases import (
    LoopKey,
    compiled_trip_counts,
    lowered_trip_counts,
    path_names,
    phase_of,
)

PHASES = ("forward", "backward", "update")
"""The values of `CollectiveRecord.phase`: `update` is the optimizer update (collectives
XLA inserts there, seen with `compiled=True`; see `zeropp_jax.state._optimizer_view`)."""


PROGRAMS = ("lowered", "partitioned", "compiled")
"""The values of `CommLedger.program`: which program of the step a ledger was read from."""

PARTS = ("fwd_gather", "bwd_gather", "grad_reduce", "other")
"""The values of `CollectiveRecord.part`."""

_GRAD_REDUCE_OPS = ("reduce-scatter", "all-to-all", "collective-permute", "all-reduce")


# --------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True)
class CollectiveRecord:
    """One collective of the step (or one dtype of a variadic collective).

    Attributes:
      op: `'all-gather'`, `'reduce-scatter'`, `'all-to-all'`, `'all-reduce'` or
        `'collective-permute'` (async `-start` forms are folded into these).
      dtype: numpy dtype name of the data moved, e.g. `'int8'`, `'bfloat16'`.
      in_bytes: operand bytes per device (shard_map shapes are per device).
      out_bytes: result bytes per device.
      group_size: devices per replica group (2 for a collective-permute pair).
      axes: mesh axes the groups span, in mesh order; `()` when no data moves.
      cross_node: whether a group holds devices of different nodes.
      phase: `'forward'`, `'backward'` or `'update'` (the optimizer update).
      trip_count: product of the trip counts of the enclosing loops (1 if none).
      op_name: the op's name with its call sites prefixed, for reading.
      node_out_bytes: bytes leaving each node through its network link in one execution,
        indexed by node (the `node` mesh coordinate, else the process index).
      node_in_bytes: bytes entering each node through its network link in one execution.
    """

    op: str
    dtype: str
    in_bytes: int
    out_bytes: int
    group_size: int
    axes: tuple[str, ...]
    cross_node: bool
    phase: str
    trip_count: int = 1
    op_name: str = ""
    node_out_bytes: tuple[float, ...] = ()
    node_in_bytes: tuple[float, ...] = ()

    @property
    def link_bytes(self) -> float:
        """Bytes through the busiest node link, in its busier direction, over all trips."""
        return max((*self.node_out_bytes, *self.node_in_bytes), default=0.0) * self.trip_count

    @property
    def bytes_sent(self) -> float:
        """Bytes this collective sends per device over the whole step (all trips)."""
        return bytes_sent(self.op, self.in_bytes, self.out_bytes, self.group_size) * (
            self.trip_count
        )

    @property
    def part(self) -> str:
        """Which part of the training step this collective serves.

        Returns:
          `'fwd_gather'` for a forward all-gather (the weight gather of the forward pass),
          `'bwd_gather'` for a backward all-gather (the weights gathered again for the
          backward pass), `'grad_reduce'` for a backward reduce-scatter, all-to-all,
          collective-permute or all-reduce (the gradient reduction; ZeRO-3's ring is
          collective-permutes, XLA's FSDP on CPU all-reduces), and `'other'` for the rest
          (forward reductions such as the loss, the optimizer update's collectives, XLA's
          own choices).
        """
        if self.phase == "update":
            return "other"
        if self.op == "all-gather":
            return "fwd_gather" if self.phase == "forward" else "bwd_gather"
        if self.op in _GRAD_REDUCE_OPS and self.phase == "backward":
            return "grad_reduce"
        return "other"


def bytes_sent(op: str, in_bytes: int, out_bytes: int, group_size: int) -> float:
    """Bytes sent per device by one execution of a collective (DESIGN.md formulas).

    Args:
      op: one of `COLLECTIVE_OPS`.
      in_bytes: operand bytes per device.
      out_bytes: result bytes per device.
      group_size: replica group size G.

    Returns:
      all-gather `out*(G-1)/G`; reduce-scatter, all-to-all `in*(G-1)/G`; all-reduce
      `2*in*(G-1)/G`; collective-permute `in`.
    """
    share = (group_size - 1) / group_size
    if op == "all-gather":
        return out_bytes * share
    if op in ("reduce-scatter", "all-to-all"):
        return in_bytes * share
    if op == "all-reduce":
        return 2 * in_bytes * share
    if op == "collective-permute":
        return float(in_bytes)
    raise ValueError(f"bytes_sent: op={op!r}; expected one of {COLLECTIVE_OPS}.")


@dataclasses.dataclass(frozen=True)
class CommLedger:
    """The collectives of one jitted step and the bytes they send per device.

    Attributes:
      records: one `CollectiveRecord` per collective (per dtype, per call path).
      param_count: number of model parameters, or None when unknown.
      program: the program the records were read from (one of `PROGRAMS`): `'lowered'`
        (as JAX wrote it: the collectives XLA inserts, e.g. for an optimizer update on
        sharded matrices, are not in it), `'partitioned'` (after XLA's SPMD partitioner:
        every collective, at the width a GPU sends) or `'compiled'` (as XLA:CPU runs it).
      model_bytes: M = `2 * param_count` (model size in 16-bit bytes), or None.
    """

    records: tuple[CollectiveRecord, ...]
    param_count: int | None = None
    program: str = "lowered"

    @property
    def model_bytes(self) -> int | None:
        """M in bytes (`2 * param_count`), or None without a parameter count."""
        return None if self.param_count is None else 2 * self.param_count

    @property
    def total_bytes(self) -> float:
        """Bytes sent per device by all collectives of the step."""
        return sum(r.bytes_sent for r in self.records)

    @property
    def cross_node_bytes(self) -> float:
        """Bytes sent per device by collectives whose groups span nodes."""
        return sum(r.bytes_sent for r in self.records if r.cross_node)

    @property
    def intra_node_bytes(self) -> float:
        """Bytes sent per device by collectives that stay inside a node."""
        return sum(r.bytes_sent for r in self.records if not r.cross_node)

    def node_link_bytes(self, records: Iterable[CollectiveRecord] | None = None) -> np.ndarray:
        """Bytes through each node's network link over the step, per direction.

        Args:
          records: the records to sum (default: all of the ledger's).

        Returns:
          float array `(nodes, 2)`: column 0 the bytes leaving the node, column 1 the bytes
          entering it; `(0, 2)` when no record moves data across nodes.
        """
        records = self.records if records is None else tuple(records)
        width = max((len(r.node_out_bytes) for r in records), default=0)
        out = np.zeros((width, 2))
        for r in records:
            if r.node_out_bytes:
                out[:, 0] += np.asarray(r.node_out_bytes) * r.trip_count
                out[:, 1] += np.asarray(r.node_in_bytes) * r.trip_count
        return out

    @property
    def link_bytes(self) -> float:
        """Bytes per step through the busiest node link in its busier direction: what one
        node's network link carries each way (the emulated cluster's veth counters)."""
        per_node = self.node_link_bytes()
        return float(per_node.max()) if per_node.size else 0.0

    def link_bytes_by(self, *keys: str) -> dict[tuple[Any, ...], float]:
        """`link_bytes` of the records grouped by attributes (keys as in `bytes_by`)."""
        self.bytes_by(*keys)  # validates the keys
        groups: dict[tuple[Any, ...], list[CollectiveRecord]] = collections.defaultdict(list)
        for r in self.records:
            groups[tuple(getattr(r, k) for k in keys)].append(r)
        out = {}
        for key, records in groups.items():
            per_node = self.node_link_bytes(records)
            out[key] = float(per_node.max()) if per_node.size else 0.0
        return out

    def bytes_by(self, *keys: str) -> dict[tuple[Any, ...], float]:
        """Sums bytes sent per device, grouped by record attributes.

        Args:
          *keys: `CollectiveRecord` attribute names, e.g. `('phase', 'op', 'axes')`, or
            `'part'` (`CollectiveRecord.part`).

        Returns:
          `{tuple of attribute values: bytes}`, e.g. `{('backward', 'all-gather',
          ('local',)): 4096.0, ...}`.
        """
        valid = [f.name for f in dataclasses.fields(CollectiveRecord)] + ["part"]
        for key in keys:
            if key not in valid:
                raise ValueError(f"bytes_by: unknown key {key!r}; expected some of {valid}.")
        totals: dict[tuple[Any, ...], float] = collections.defaultdict(float)
        for r in self.records:
            totals[tuple(getattr(r, k) for k in keys)] += r.bytes_sent
        return dict(totals)

    def in_units_of_M(self, num_bytes: float) -> float:  # noqa: N802 (M is the paper's name)
        """`num_bytes / M`. Raises a ValueError when the parameter count is unknown."""
        if self.model_bytes is None:
            raise ValueError(
                "in_units_of_M: the ledger has no parameter count; pass "
                "comm_ledger(..., param_count=<number of model parameters>)."
            )
        return num_bytes / self.model_bytes

    def to_markdown(self) -> str:
        """A table with one row per (phase, op, axes, dtype), then total / cross / intra rows.

        Bytes are for one step: per device (what each device sends), and per link (what the
        busiest node link carries in its busier direction). The M columns appear only with
        a parameter count.
        """
        rows: dict[tuple[Any, ...], float] = collections.defaultdict(float)
        for r in self.records:
            rows[(r.phase, r.op, r.axes, r.dtype, r.cross_node)] += r.bytes_sent
        links = self.link_bytes_by("phase", "op", "axes", "dtype", "cross_node")

        def order(key: tuple[Any, ...]) -> tuple[Any, ...]:
            phase, op, axes, dtype, _ = key
            return PHASES.index(phase), COLLECTIVE_OPS.index(op), axes, dtype

        with_m = self.model_bytes is not None
        head = ["phase", "op", "axes", "dtype", "cross-node", "bytes/device"]
        head += ["M"] if with_m else []
        head += ["bytes/link"] + (["M (link)"] if with_m else [])
        lines = [
            "| " + " | ".join(head) + " |",
            "|" + "---|" * 5 + "---:|" * (len(head) - 5),
        ]

        def amount(num_bytes: float | None) -> list[str]:
            if num_bytes is None:
                return [""] * (2 if with_m else 1)
            cells = [_fmt_bytes(num_bytes)]
            if with_m:
                cells.append(f"{self.in_units_of_M(num_bytes):.4f}")
            return cells

        def line(cells: list[str], device: float, link: float | None) -> str:
            return "| " + " | ".join(cells + amount(device) + amount(link)) + " |"

        for key in sorted(rows, key=order):
            phase, op, axes, dtype, cross = key
            axes_text = "+".join(axes) if axes else "-"
            cells = [phase, op, axes_text, dtype, "yes" if cross else "no"]
            lines.append(line(cells, rows[key], links[key]))
        for label, value, link in (
            ("total", self.total_bytes, self.link_bytes),
            ("cross-node", self.cross_node_bytes, None),
            ("intra-node", self.intra_node_bytes, None),
        ):
            lines.append(line([f"**{label}**", "", "", "", ""], value, link))
        return "\n".join(lines) + "\n"


def _fmt_bytes(num_bytes: float) -> str:
    return f"{num_bytes:,.0f}" if float(num_bytes).is_integer() else f"{num_bytes:,.2f}"


# ------------------------------------------------------------------------- the ledger


def _arg_meshes(args: Sequence[Any], kwargs: Mapping[str, Any]) -> Iterator[Mesh]:
    """Meshes of the argument leaves that are `jax.Array`s or `jax.ShapeDtypeStruct`s with
    a `NamedSharding`."""
    for leaf in jax.tree_util.tree_leaves((args, kwargs)):
        if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct) and isinstance(
            getattr(leaf, "sharding", None), NamedSharding
        ):
            yield leaf.sharding.mesh


def _records_of(
    ins: HloInstruction,
    shapes: Mapping[str, str],
    mesh: Mesh,
    links: str,
    as_reduce_scatter: bool,
    where: tuple[str, int, str],
) -> Iterator[CollectiveRecord]:
    """One `CollectiveRecord` per dtype of one collective, for one execution.

    Args:
      ins: the collective.
      shapes: `{instruction name: HLO shape}` of its computation (for operand sizes).
      mesh: the mesh the step runs on.
      links: one of `LINK_MODELS`, for the per-node link bytes.
      as_reduce_scatter: count an all-reduce as a reduce-scatter over its groups (its
        result sliced to `1/G`, see `sliced_all_reduces`).
      where: the records' `(phase, trip_count, op_name)`.
    """
    op = ins.opcode.removesuffix("-start")
    ins_by_dtype: dict[str, int] = collections.defaultdict(int)
    for operand in ins.operands:
        if operand not in shapes:
            raise ValueError(f"comm_ledger: operand {operand!r} of {ins.name!r} not found.")
        for dtype, size in array_shapes(shapes[operand]):
            ins_by_dtype[dtype] += size
    if op == "collective-permute":
        pairs = parse_replica_groups(ins.attr("source_target_pairs") or "{}", 0)
        groups = [p for p in pairs if len(set(p)) > 1]
        size = 2 if groups else 1
    else:
        groups = parse_replica_groups(ins.attr("replica_groups") or "{}", mesh.devices.size)
        size = len(groups[0]) if groups else 1
    axes = group_axes(mesh, groups)
    cross = crosses_nodes(mesh, groups)
    outs_by_dtype: dict[str, int] = collections.defaultdict(int)
    if as_reduce_scatter:
        op = "reduce-scatter"
        outs_by_dtype.update({d: b // size for d, b in ins_by_dtype.items()})
    elif ins.opcode.endswith("-start"):  # async results bundle operands; derive outputs
        scale = {"all-gather": size, "reduce-scatter": 1 / size}.get(op, 1)
        outs_by_dtype.update({d: int(b * scale) for d, b in ins_by_dtype.items()})
    else:
        for dtype, nbytes in array_shapes(ins.shape):
            outs_by_dtype[dtype] += nbytes
    nodes = node_of(mesh)
    for dtype in sorted(set(ins_by_dtype) | set(outs_by_dtype)):
        n_in, n_out = ins_by_dtype[dtype], outs_by_dtype[dtype]
        leaving, entering = node_traffic(op, groups, n_in, n_out, nodes, links)
        yield CollectiveRecord(op, dtype, n_in, n_out, size, axes, cross, *where, leaving, entering)


def _step_mesh(mesh: Mesh | None, args: Sequence[Any], kwargs: Mapping[str, Any]) -> Mesh:
    """`mesh`, else the mesh of the first sharded argument leaf."""
    mesh = next(_arg_meshes(args, kwargs), None) if mesh is None else mesh
    if mesh is None:
        raise ValueError(
            "comm_ledger: no argument is a jax.Array (or jax.ShapeDtypeStruct) with a "
            "NamedSharding, so the mesh is unknown; pass mesh=<the jax.sharding.Mesh the step "
            "runs on>."
        )
    return mesh


def _param_count(param_count: int | None, args: Sequence[Any]) -> int | None:
    """`param_count`, else `args[0].param_count` when that is an int; checked positive."""
    found = getattr(args[0], "param_count", None) if param_count is None and args else None
    if isinstance(found, int) and not isinstance(found, bool):
        param_count = found
    if param_count is not None and (
        isinstance(param_count, bool) or not isinstance(param_count, int) or param_count < 1
    ):
        raise ValueError(f"comm_ledger: param_count={param_count!r}; expected a positive int.")
    return param_count


def _checked_options(
    mesh: Mesh, arg_meshes: Iterable[Mesh], compiled: bool, partitioned: bool, links: str | None
) -> tuple[str, str]:
    """Which of `PROGRAMS` to read and the link model; checks them and `mesh`'s devices."""
    for leaf_mesh in arg_meshes:
        if list(leaf_mesh.devices.flat) != list(mesh.devices.flat):
            raise ValueError(
                "comm_ledger: mesh= orders its devices differently from the mesh of the "
                f"arguments ({mesh.devices.tolist()} vs {leaf_mesh.devices.tolist()}); the "
                "HLO's device ids are positions in the step's own mesh, so pass that one."
            )
    if compiled and partitioned:
        raise ValueError(
            "comm_ledger: compiled=True and partitioned=True; pass one (compiled: the "
            "program XLA:CPU runs; partitioned: the partitioner's, at the 16-bit width)."
        )
    if links is None:
        links = default_links(mesh)
    elif links not in LINK_MODELS:
        raise ValueError(f"comm_ledger: links={links!r}; expected one of {LINK_MODELS}.")
    return "compiled" if compiled else "partitioned" if partitioned else "lowered", links


class _Program:
    """One program of a lowered step (one of `PROGRAMS`), parsed, and its loops' counts."""

    def __init__(self, lowered: Any, kind: str) -> None:
        self.lowered, self.kind = lowered, kind
        self.compiled_text: str | None = None  # the partitioned program's, compiled
        if kind == "compiled":
            text = lowered.compile().as_text()
        elif kind == "partitioned":
            text, self.compiled_text = partitioned_program(lowered)
        else:
            text = lowered.as_text(dialect="hlo", debug_info=True)
        self.module = parse_hlo_module(text)
        loops = known_trip_counts(self.module) if kind == "compiled" else ()
        self.known = {ins.name: count for ins, count in loops}
        self._compiled_counts: dict[LoopKey, set[int]] | None = None
        self._lowered_counts: dict[LoopKey, set[int]] | None = None

    def trip_count(self, loop: HloInstruction, comp: str, phase: str) -> int:
        """The trip count of `loop` (in computation `comp`, of `phase`); raises if unknown."""
        if self.kind == "compiled":
            if loop.name in self.known:
                return self.known[loop.name]
            raise ValueError(
                f"comm_ledger: the compiled loop {loop.name!r} holds a collective but has no "
                "known_trip_count; use compiled=False (the lowered program's loops are read "
                "from their bounds)."
            )
        count = scan_trip_count(self.module, loop, comp)
        if count is not None:
            return count
        where = self.module.locations.get(loop.frame)
        if self.kind == "partitioned":  # the partitioner keeps loop counts: read as JAX wrote them
            if self._lowered_counts is None:
                self._lowered_counts = lowered_trip_counts(self.lowered)
            found = self._lowered_counts.get((where, phase), set())
            if len(found) == 1:
                return next(iter(found))
        if self._compiled_counts is None:
            done = self.compiled_text or self.lowered.compile().as_text()
            self._compiled_counts = compiled_trip_counts(parse_hlo_module(done))
        counts = self._compiled_counts.get((where, phase), set())
        if len(counts) != 1:
            raise ValueError(
                f"comm_ledger: the loop {loop.name!r} at {where} holds a collective but its "
                f"trip count is unknown (compiled HLO gives {sorted(counts) or 'none'}); "
                "write it as lax.scan or lax.fori_loop with static bounds."
            )
        return next(iter(counts))


def _collective_records(program: _Program, mesh: Mesh, links: str) -> list[CollectiveRecord]:
    """The records of every collective of `program`, per dtype and per call path."""
    paths = call_paths(program.module)
    partitioned = program.kind == "partitioned"
    records = []
    for comp, instructions in program.module.computations.items():
        shapes = {i.name: i.shape for i in instructions}
        sliced = sliced_all_reduces(instructions, mesh) if partitioned else set()
        for ins in instructions:
            if ins.opcode.removesuffix("-start") not in COLLECTIVE_OPS:
                continue
            for path in paths.get(comp, ()):
                names = [*path_names(path), ins.op_name]
                trips = 1
                for depth, (call, caller) in enumerate(path):
                    if call.opcode == "while":
                        loop_names = [*path_names(path[:depth]), call.op_name]
                        trips *= program.trip_count(call, caller, phase_of(loop_names))
                where = (phase_of(names), trips, "/".join(n for n in names if n))
                records.extend(_records_of(ins, shapes, mesh, links, ins.name in sliced, where))
    return records


def comm_ledger(
    fn: Any,
    *args: Any,
    mesh: Mesh | None = None,
    param_count: int | None = None,
    compiled: bool = False,
    partitioned: bool = False,
    links: str | None = None,
    **kwargs: Any,
) -> CommLedger:
    """Lowers `fn(*args, **kwargs)` and accounts for every collective it runs.

    By default the ledger reads the lowered program, as JAX wrote it (fast: nothing is
    compiled): every collective of a `shard_map` body, but none that XLA's SPMD
    partitioner adds outside one. For a `zpp.shard` step those are the scalar all-reduces
    of the loss and of the finite-gradient flags, and the optimizer update's collectives
    where it is not elementwise: Muon's Newton-Schulz products, Adafactor's factored
    moments, the tensor-parallel all-reduces. To count the whole step, read
    `partitioned=True` (every collective at the width a GPU sends) or `compiled=True` (the
    program XLA:CPU runs, 16-bit collectives widened to float32, dead code removed).
    `CommLedger.program` says which program a ledger was read from.

    Args:
      fn: a jitted callable (has `.lower`), e.g. the result of `zpp.shard` or `jax.jit`.
      *args: its positional arguments (arrays, pytrees, or `jax.ShapeDtypeStruct`s).
      mesh: the mesh the step runs on; default: the mesh of the first argument leaf that
        is a `jax.Array` with a `NamedSharding`.
      param_count: number of model parameters, defining M = 2 * param_count bytes;
        default: `args[0].param_count` when that is an int, else unknown.
      compiled: read the compiled, optimised program rather than the lowered one.
      partitioned: read the program as XLA's SPMD partitioner leaves it, before the
        backend widens 16-bit collectives (`partitioned_program`), each all-reduce whose
        result is sliced to `1/G` counted as a reduce-scatter: a GPU's wire.
      links: the collective algorithms the per-link bytes follow, one of `LINK_MODELS`;
        default `default_links(mesh)` (gloo on CPU, NCCL elsewhere).
      **kwargs: its keyword arguments.

    Returns:
      A `CommLedger` of per-device bytes for one call of `fn`.

    Raises:
      TypeError: when `fn` cannot be lowered.
      ValueError: when no mesh is given or found, when the HLO does not fit the mesh,
        or when a loop around a collective has no known trip count.
    """
    if not hasattr(fn, "lower"):
        raise TypeError(f"comm_ledger: fn={fn!r} has no .lower; pass a jax.jit-wrapped callable.")
    mesh = _step_mesh(mesh, args, kwargs)
    param_count = _param_count(param_count, args)
    kind, links = _checked_options(mesh, _arg_meshes(args, kwargs), compiled, partitioned, links)
    records = _collective_records(_Program(fn.lower(*args, **kwargs), kind), mesh, links)
    return CommLedger(records=tuple(records), param_count=param_count, program=kind)
