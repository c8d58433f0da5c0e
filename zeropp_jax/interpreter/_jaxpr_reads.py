"""Which equations of a program read a weight: the table the placement interpreter
(`_placement`) uses to tell moves and casts of a weight from its uses, and how
many uses each weight has (a weight read once is gathered at that use; one read by several
equations is gathered once for all of them, see `placement`)."""

from __future__ import annotations

from zeropp_jax.interpreter import _jaxpr_compat as jaxpr_compat

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


def count_uses(
    jaxpr: jaxpr_compat.Jaxpr, lazy_leaves: dict[jaxpr_compat.Var, int]
) -> dict[int, int]:
    """Per leaf, how many equations read it (layout-only equations and inlined calls
    followed through)."""
    counts: dict[int, int] = {}

    def walk(jx: jaxpr_compat.Jaxpr, where: dict[jaxpr_compat.Var, int]) -> None:
        for eqn in jx.eqns:
            read = [where[v] for v in eqn.invars if isinstance(v, jaxpr_compat.Var) and v in where]
            if not read:
                continue
            name = eqn.primitive.name
            if name in CHAIN_PRIMITIVES and len(read) == 1 and len(eqn.outvars) == 1:
                where[eqn.outvars[0]] = read[0]
                continue
            inner = jaxpr_compat.inlined_call(eqn)
            if inner is not None:
                sub = {
                    iv: where[v]
                    for iv, v in zip(inner.jaxpr.invars, eqn.invars, strict=True)
                    if isinstance(v, jaxpr_compat.Var) and v in where
                }
                walk(inner.jaxpr, sub)
                continue
            for leaf in set(read):
                counts[leaf] = counts.get(leaf, 0) + 1

    walk(jaxpr, dict(lazy_leaves))
    return counts


def computed_from(jaxpr: jaxpr_compat.Jaxpr, inputs: set[jaxpr_compat.Var]) -> list[bool]:
    """Per output of `jaxpr`, whether it is computed from any of `inputs` (an equation's
    outputs count as computed from every input it reads; its inner programs are not
    looked into, so the answer errs on the side of True)."""
    seen = set(inputs)
    for eqn in jaxpr.eqns:
        if any(isinstance(v, jaxpr_compat.Var) and v in seen for v in eqn.invars):
            seen.update(eqn.outvars)
    return [isinstance(v, jaxpr_compat.Var) and v in seen for v in jaxpr.outvars]
