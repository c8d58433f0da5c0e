"""Which phase of a training step an HLO op serves, and how many times a program's loops run.

The phase is `'update'` when an op name on a collective's chain of call sites lies in the
optimizer update's named scope (`optimizer_view.UPDATE_SCOPE`), `'backward'` when one names
a `transpose(...)` (reverse-mode AD, including a `custom_vjp` backward rule) or a
`rematted_computation` (recomputation under `jax.checkpoint`), else `'forward'`. Loops are
matched across the lowered, partitioned and compiled programs by their source location and
phase (`LoopKey`); where loops share a key, those that hold a collective win: a loop
inside a `custom_vjp` backward rule carries the forward call site's location, the same as
the layer loop around it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from zeropp_jax.measure._hlo_text import (
    COLLECTIVE_OPS,
    CallPath,
    HloModule,
    Location,
    call_paths,
    known_trip_counts,
    parse_hlo_module,
    scan_trip_count,
)
from zeropp_jax.state._optimizer_view import UPDATE_SCOPE

_UPDATE_RE = re.compile(rf"(?:^|/){UPDATE_SCOPE}(?:/|$)")
_BACKWARD_RE = re.compile(r"(?:^|[/(])(?:transpose\(|rematted_computation(?:/|$))")


def phase_of(op_names: Iterable[str]) -> str:
    """`'update'` if any name lies in the optimizer update's named scope, else
    `'backward'` if any shows a `transpose(...)` or a remat recomputation, else
    `'forward'`."""
    names = list(op_names)
    if any(_UPDATE_RE.search(n) for n in names):
        return "update"
    return "backward" if any(_BACKWARD_RE.search(n) for n in names) else "forward"


def path_names(path: CallPath) -> list[str]:
    """Op-name prefixes contributed by a call chain (while ops add none: their bodies'
    op names already start with `while/body/`)."""
    return [ins.op_name for ins, _ in path if ins.opcode != "while" and ins.op_name]


LoopKey = tuple[Location | None, str]
"""A loop's source location and phase: what identifies it across the lowered, partitioned
and compiled programs."""


def loop_phase(
    module: HloModule, paths: dict[str, list[CallPath]], comp: str, loop: Any
) -> set[str]:
    """The phases of a `while` in `comp`, from the op names on each call chain down to it
    (what `comm_ledger` keys a loop by: inside a `shard_map` body op names are relative,
    so a loop's own name may not show that it serves the backward pass)."""
    chains = paths.get(comp) or [()]
    return {phase_of([*path_names(path), loop.op_name]) for path in chains}


def collective_loops(module: HloModule) -> set[str]:
    """Names of the `while` instructions whose body holds a collective, directly or through
    the computations it calls (a collective's reducer does not count)."""
    holding: set[str] = set()
    changed = True
    while changed:  # a fixpoint over the call graph (at most one pass per nesting level)
        changed = False
        for comp, instructions in module.computations.items():
            if comp in holding:
                continue
            for ins in instructions:
                op = ins.opcode.removesuffix("-start")
                if op in COLLECTIVE_OPS or any(c in holding for c in ins.called()):
                    holding.add(comp)
                    changed = True
                    break
    return {
        ins.name
        for instructions in module.computations.values()
        for ins in instructions
        if ins.opcode == "while" and (ins.attr("body") or "").lstrip("%") in holding
    }


def _counts_by_key(found: list[tuple[LoopKey, int, bool]]) -> dict[LoopKey, set[int]]:
    """The trip counts of the loops at each key (location, phase): of those that hold a
    collective where any does, else of all (a loop XLA's partitioner fills with
    collectives, e.g. XLA FSDP's layer scan, holds none as JAX wrote it)."""
    out: dict[LoopKey, set[int]] = {}
    for key in dict.fromkeys(k for k, _, _ in found):
        here = [(count, holds) for k, count, holds in found if k == key]
        holding = {count for count, holds in here if holds}
        out[key] = holding or {count for count, _ in here}
    return out


def compiled_trip_counts(module: HloModule) -> dict[LoopKey, set[int]]:
    """`known_trip_count` of each `while` in compiled HLO, keyed by (source location,
    phase); at a key shared with a loop that holds a collective, only such loops count."""
    paths = call_paths(module)
    where = {
        ins.name: comp for comp, instructions in module.computations.items() for ins in instructions
    }
    loops = collective_loops(module)
    found = [
        ((module.locations.get(ins.frame), phase), count, ins.name in loops)
        for ins, count in known_trip_counts(module)
        for phase in loop_phase(module, paths, where[ins.name], ins)
    ]
    return _counts_by_key(found)


def lowered_trip_counts(lowered: Any) -> dict[LoopKey, set[int]]:
    """The trip count of each `lax.scan` / static loop of the lowered program, keyed by
    (source location, phase), for the same loops after partitioning; at a key shared with
    a loop that holds a collective, only such loops count."""
    module = parse_hlo_module(lowered.as_text(dialect="hlo", debug_info=True))
    paths = call_paths(module)
    loops = collective_loops(module)
    found = []
    for comp, instructions in module.computations.items():
        for ins in instructions:
            if ins.opcode == "while":
                count = scan_trip_count(module, ins, comp)
                if count is not None:
                    for phase in loop_phase(module, paths, comp, ins):
                        key = (module.locations.get(ins.frame), phase)
                        found.append((key, count, ins.name in loops))
    return _counts_by_key(found)
