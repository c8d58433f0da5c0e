"""Which equations of a program read a weight: the table the placement interpreter
(`zeropp_jax.placement`) uses to tell moves and casts of a weight from its uses, and how
many uses each weight has (a weight read once is gathered at that use; one read by several
equations is gathered once for all of them, see `placement`); and how a `scan` equation
splits its operands (`scan_counts`), which the placement of scanned layers reads."""

from __future__ import annotations

from typing import Any

import jax
from jax._src import core
from jax._src.pjit import jit_p

CHAIN_PRIMITIVES = frozenset(
    {
        "convert_element_type",
        "reshape",
        "transpose",
        "squeeze",
        "expand_dims",
        "broadcast_in_dim",
        "pcast",
        "copy",
        "copy_p",
        "slice",
        "rev",
    }
)
"""Equations of one lazy weight (and literals) that only move or cast it: they stay lazy."""

INLINED_CALLS = {jit_p: "jaxpr", core.closed_call_p: "call_jaxpr"}
"""Call-like primitives whose inner program the interpreter runs in place, and the
parameter that holds it. `count_uses` and `placement.evaluate` both read this table."""


def count_uses(jaxpr: core.Jaxpr, lazy_leaves: dict[core.Var, int]) -> dict[int, int]:
    """Per leaf, how many equations read it (layout-only equations and inlined calls
    followed through)."""
    counts: dict[int, int] = {}

    def walk(jx: core.Jaxpr, where: dict[core.Var, int]) -> None:
        for eqn in jx.eqns:
            read = [where[v] for v in eqn.invars if isinstance(v, core.Var) and v in where]
            if not read:
                continue
            name = eqn.primitive.name
            if name in CHAIN_PRIMITIVES and len(read) == 1 and len(eqn.outvars) == 1:
                where[eqn.outvars[0]] = read[0]
                continue
            if eqn.primitive in INLINED_CALLS:
                inner = eqn.params[INLINED_CALLS[eqn.primitive]]
                sub = {
                    iv: where[v]
                    for iv, v in zip(inner.jaxpr.invars, eqn.invars, strict=True)
                    if isinstance(v, core.Var) and v in where
                }
                walk(inner.jaxpr, sub)
                continue
            for leaf in set(read):
                counts[leaf] = counts.get(leaf, 0) + 1

    walk(jaxpr, dict(lazy_leaves))
    return counts


def scan_counts(eqn: Any) -> tuple[int, int, int]:
    """`(num_consts, num_carry, length)` of a `scan` equation, read from jax 0.10's scan
    parameters, which the placement of a scanned model's layers rewrites.

    Raises:
      RuntimeError: when the installed jax describes a scan otherwise (jax 0.11 replaced
        `num_consts`, `num_carry` and `linear` by `ft_in` / `ft_out`), naming the version
        and what runs on it.
    """
    p = eqn.params
    if "num_consts" in p and "num_carry" in p:
        return p["num_consts"], p["num_carry"], p["length"]
    raise RuntimeError(
        f"zeropp_jax places a scanned model's layers by rewriting jax 0.10's scan equations "
        f"(parameters num_consts, num_carry, linear), but jax {jax.__version__} describes "
        f"this scan with the parameters {sorted(p)}. Install jax 0.10.x "
        '(`pip install "jax>=0.10.2,<0.11" "jaxlib>=0.10.2,<0.11"`), or unroll the layers '
        "(e.g. the trainer's --no-scan-layers): models without a scan run on jax 0.11."
    )
