"""The step as XLA's SPMD partitioner leaves it: the program `comm_ledger(...,
partitioned=True)` reads, the wire a GPU would carry.

For `jax.jit` steps whose collectives only XLA chooses (XLA's FSDP), the partitioner's
program holds the collectives at the width the program gives them, before XLA:CPU widens
16-bit collectives to float32 (`AllReducePromotion`, float normalisation); and an
all-reduce whose one user keeps a `1/G` slice of it is the reduce-scatter a GPU compiler
makes of it (XLA's `ReduceScatterCreator`).
"""

from __future__ import annotations

import collections
import glob
import math
import os
import re
import tempfile
from collections.abc import Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from zeropp_jax.measure._hlo_text import HloInstruction, parse_replica_groups


def _elements(shape: str) -> int:
    """Elements of an array-shaped HLO type, e.g. `bf16[384,16]{1,0}` -> 6144."""
    m = re.match(r"\w+\[([\d,]*)\]", shape)
    if m is None:
        return -1
    return math.prod(int(d) for d in m.group(1).split(",") if d)


def sliced_all_reduces(instructions: Sequence[HloInstruction], mesh: Mesh) -> set[str]:
    """Names of the all-reduces of one computation whose only user is a (dynamic-)slice
    that keeps `1/G` of the result: what a GPU compiler turns into a reduce-scatter."""
    users: dict[str, list[HloInstruction]] = collections.defaultdict(list)
    for ins in instructions:
        for operand in ins.operands:
            users[operand].append(ins)
    out = set()
    for ins in instructions:
        if ins.opcode != "all-reduce" or len(users[ins.name]) != 1:
            continue
        (user,) = users[ins.name]
        groups = parse_replica_groups(ins.attr("replica_groups") or "{}", mesh.devices.size)
        size = len(groups[0]) if groups else 1
        whole = _elements(ins.shape)
        if user.opcode in ("slice", "dynamic-slice") and size > 1 and whole > 0:
            if _elements(user.shape) * size == whole:
                out.add(ins.name)
    return out


def partitioned_program(lowered: Any) -> tuple[str, str]:
    """`(partitioned, compiled)`: the HLO text of `lowered` as XLA's SPMD partitioner leaves
    it (the pass's own dump, before the backend's passes), and the compiled program's.

    Args:
      lowered: a `jax.stages.Lowered` (e.g. `jax.jit(f).lower(...)`).

    Raises:
      ValueError: when the compiler wrote no dump after the partitioner.
    """
    with tempfile.TemporaryDirectory(prefix="zeropp_partitioned_") as folder:
        options = {
            "xla_dump_to": folder,
            "xla_dump_hlo_pass_re": "spmd-partitioning",
            "xla_dump_hlo_as_text": True,
        }
        # A persistent-cache hit compiles nothing and dumps nothing (JAX leaves the dump
        # options out of its cache key): compile this one afresh.
        cached = jax.config.jax_enable_compilation_cache
        jax.config.update("jax_enable_compilation_cache", False)
        try:
            compiled = lowered.compile(compiler_options=options)
        finally:
            jax.config.update("jax_enable_compilation_cache", cached)
        found = sorted(glob.glob(os.path.join(folder, "*after_spmd-partitioning*.txt")))
        if not found:
            raise ValueError(
                "comm_ledger(partitioned=True): XLA wrote no dump after its SPMD partitioner "
                f"into {folder} (files: {sorted(os.listdir(folder))[:5]}); this XLA may "
                "name the pass differently: read the program with compiled=True instead."
            )
        with open(found[-1]) as f:
            text = f.read()
    return text, compiled.as_text()
