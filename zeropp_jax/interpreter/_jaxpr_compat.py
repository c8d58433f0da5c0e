"""jax's internals, in the interpreter's own words: the one module that reads them.

The placement interpreter (`placement`, `indexed_scan`, `layered_scan`, `jaxpr_reads`)
walks a traced program, rebuilds scans and binds equations again. Those are jax's private
structures, and they change between releases:

- jax 0.10 writes a `scan` with `num_consts` / `num_carry` (and took `linear` until
  0.10.0); jax 0.11 and 0.12 write `ft_in` / `ft_out`, `jax._src.flattree.FlatTree`s of
  three groups (consts, carry, xs) and two (carry, ys).
- jax 0.11 merged `Jaxpr` and `ClosedJaxpr`: a program carries its constants, and a
  hand-built one whose constvars have none attached reads them as ordinary inputs.
- jax 0.11 made saving a VJP's inputs optional in public (`jax.vjp(saveable_args=)`).
- `CallPrimitive` is gone in 0.12; `closed_call_p` is an alias of jit's call.

Every other module asks this one, in terms that hold on jax 0.10.2 through 0.12: a scan's
groups, body, length and direction (`scan_of`), a scan rebuilt with other operands
(`rebuilt_scan`), the program an inlined call runs (`inlined_call`), a remat block and its
policy (`remat_of`), a VJP whose saved inputs are dropped and put back (`vjp_dropping`,
`vjp_restored`). `check_supported` refuses, before tracing, a jax whose programs it cannot
read (`tests/test_jaxpr_compat.py` fails if another module imports `jax._src`).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.extend.core as jex
from jax._src import api as _api
from jax._src import source_info_util as _source_info
from jax._src.interpreters import partial_eval as _pe
from jax.extend.core import primitives as _prims

Var = jex.Var
Literal = jex.Literal
Jaxpr = jex.Jaxpr
ClosedJaxpr = jex.ClosedJaxpr
JaxprEqn = jex.JaxprEqn
Tracer = jax.core.Tracer
ShapedArray = jax.core.ShapedArray

scan_p = _prims.scan_p
cond_p = _prims.cond_p
while_p = _prims.while_p
remat_p = _prims.remat_p

_INLINED = {_prims.jit_p: "jaxpr", _prims.closed_call_p: "call_jaxpr"}
"""Call-like primitives whose program runs in place, and the parameter that holds it."""

_JAXPR_TAKES_CONSTS = "consts" in inspect.signature(jex.Jaxpr.__init__).parameters
"""jax 0.11+: a `Jaxpr` carries its constants (`Jaxpr` and `ClosedJaxpr` merged)."""

_VJP_TAKES_SAVEABLE = "saveable_args" in inspect.signature(jax.vjp).parameters
"""jax 0.11+: `jax.vjp(..., saveable_args=)`, the public way to drop saved inputs."""

UNSUPPORTED_FLAGS = ("jax_scan3", "jax_remat3", "jax_custom_vjp3", "jax_custom_jvp3")
"""jax's opt-in flags that write loops, remat and custom derivatives as other primitives,
which the interpreter does not read."""


def check_supported() -> None:
    """Raises `RuntimeError` when jax is configured to write programs the interpreter
    cannot read (one of `UNSUPPORTED_FLAGS` on), naming the flag and the fix."""
    on = [f for f in UNSUPPORTED_FLAGS if getattr(jax.config, f, False) is True]
    if on:
        raise RuntimeError(
            f"zeropp_jax reads scans, remat and custom derivatives as jax writes them by "
            f"default, but {', '.join(on)} is on (jax {jax.__version__}), which writes them "
            f"as other primitives. Turn it off: "
            + "; ".join(f'jax.config.update("{f}", False)' for f in on)
            + "."
        )


# ----------------------------------------------------------------------------- programs


def new_var(aval: Any) -> Var:
    """A fresh variable of abstract value `aval`."""
    return jex.Var(aval)


def jaxpr_like(
    like: Jaxpr, invars: Sequence[Var], outvars: Sequence[Any], eqns: Sequence[JaxprEqn]
) -> Jaxpr:
    """A program with `like`'s constants (constvars, and on jax 0.11+ their values) and
    effects, and the given inputs, outputs and equations."""
    consts = {"consts": like.consts} if _JAXPR_TAKES_CONSTS and like.consts else {}
    return jex.Jaxpr(
        like.constvars,
        list(invars),
        list(outvars),
        list(eqns),
        like.effects,
        like.debug_info,
        **consts,
    )


def closed(jaxpr: Jaxpr, consts: Sequence[Any]) -> ClosedJaxpr:
    """`jaxpr` closed over `consts` (its constvars' values)."""
    return jex.ClosedJaxpr(jaxpr, list(consts))


def new_eqn(
    invars: Sequence[Any],
    outvars: Sequence[Var],
    primitive: Any,
    params: dict[str, Any],
    like: JaxprEqn,
) -> JaxprEqn:
    """An equation with `like`'s source information and context."""
    return jex.new_jaxpr_eqn(
        list(invars), list(outvars), primitive, params, set(), like.source_info, like.ctx
    )


def dce(
    jaxpr: Jaxpr, used_outputs: Sequence[bool], keep_inputs: bool = False
) -> tuple[Jaxpr, list[bool]]:
    """`(program, used_inputs)`: `jaxpr` with what `used_outputs` do not need removed
    (its unused inputs too, unless `keep_inputs`)."""
    return _pe.dce_jaxpr(jaxpr, list(used_outputs), instantiate=keep_inputs)


def split_known(body: ClosedJaxpr, unknowns: Sequence[bool]) -> tuple[ClosedJaxpr, ClosedJaxpr]:
    """`(known, unknown)`: `body` split by data dependence on the inputs marked unknown;
    `known` computes from the others alone, `unknown` reads its residuals first, then the
    unknown inputs (jax's `partial_eval_jaxpr_nounits`)."""
    known, unknown, _, _ = _pe.partial_eval_jaxpr_nounits(body, list(unknowns), True)
    return known, unknown


def eval_jaxpr(jaxpr: Jaxpr, consts: Sequence[Any], *args: Any) -> list[Any]:
    """`jaxpr` evaluated on `args` with `consts` for its constvars."""
    return jax.core.eval_jaxpr(jaxpr, list(consts), *args)


def bind_params(eqn: JaxprEqn) -> dict[str, Any]:
    """The parameters to bind `eqn`'s primitive with."""
    return eqn.primitive.get_bind_params(eqn.params)


def bind(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Binds `eqn`'s primitive to `invals`, under the equation's name stack and context;
    returns its outputs as a list."""
    params = bind_params(eqn)
    name_stack = _source_info.current_name_stack() + eqn.source_info.name_stack
    with (
        _source_info.user_context(eqn.source_info.traceback, name_stack=name_stack),
        eqn.ctx.manager,
    ):
        out = eqn.primitive.bind(*invals, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def bind_plain(eqn: JaxprEqn, invals: Sequence[Any]) -> list[Any]:
    """Binds `eqn`'s primitive to `invals` with its parameters as they stand (concrete
    evaluation at trace time); returns its outputs as a list."""
    out = eqn.primitive.bind(*invals, **eqn.params)
    return list(out) if eqn.primitive.multiple_results else [out]


# ----------------------------------------------------------------------------- calls


def inlined_call(eqn: JaxprEqn) -> ClosedJaxpr | None:
    """The program a call-like equation (`jit`, `closed_call`) runs, to be run in place;
    None for any other equation."""
    key = _INLINED.get(eqn.primitive)
    return None if key is None else eqn.params[key]


@dataclasses.dataclass(frozen=True)
class Remat:
    """A `jax.checkpoint` block.

    Attributes:
      jaxpr: its program (constvars, if any, are read from `consts`).
      consts: the values of its constvars.
      policy: the user's remat policy, or None.
      prevent_cse: as the user asked.
    """

    jaxpr: Jaxpr
    consts: tuple[Any, ...]
    policy: Callable[..., Any] | None
    prevent_cse: bool


def remat_of(eqn: JaxprEqn) -> Remat | None:
    """The `jax.checkpoint` block `eqn` is, or None for any other equation."""
    if eqn.primitive is not remat_p:
        return None
    inner = eqn.params["jaxpr"]
    consts = tuple(getattr(inner, "consts", ()))
    jaxpr = inner.jaxpr if isinstance(inner, jex.ClosedJaxpr) else inner
    return Remat(jaxpr, consts, eqn.params.get("policy"), eqn.params.get("prevent_cse", True))


# ----------------------------------------------------------------------------- scans


@dataclasses.dataclass(frozen=True)
class Scan:
    """A `lax.scan` equation, read.

    Attributes:
      body: `(consts, carry, xs) -> (carry, ys)`, closed.
      num_consts: operands read by every iteration.
      num_carry: carries.
      num_xs: operands sliced along their axis 0.
      length: iterations.
      reverse: whether it runs from the last slice to the first.
    """

    body: ClosedJaxpr
    num_consts: int
    num_carry: int
    num_xs: int
    length: int
    reverse: bool

    def split(self, operands: Sequence[Any]) -> tuple[list[Any], list[Any], list[Any]]:
        """`(consts, carry, xs)` of the scan's operands."""
        nc, nk = self.num_consts, self.num_carry
        return list(operands[:nc]), list(operands[nc : nc + nk]), list(operands[nc + nk :])


def scan_of(eqn: JaxprEqn) -> Scan | None:
    """The scan `eqn` is, or None for any other equation.

    Raises:
      RuntimeError: for a scan written in a form this module does not know (a jax newer
        than those it was written for), naming the version and its parameters.
    """
    if eqn.primitive is not scan_p:
        return None
    p = eqn.params
    if "ft_in" in p:  # jax 0.11+
        nc, nk, nx = (len(g) for g in p["ft_in"].unpack())
    elif "num_consts" in p:  # jax 0.10
        nc, nk = p["num_consts"], p["num_carry"]
        nx = len(eqn.invars) - nc - nk
    else:
        raise RuntimeError(
            f"zeropp_jax reads a scan's operand groups from jax 0.10's num_consts / "
            f"num_carry or jax 0.11-0.12's ft_in, but jax {jax.__version__} writes this scan "
            f"with the parameters {sorted(p)}. Use a jax from 0.10.2 to 0.12 (the versions "
            "zeropp_jax is tested on), or unroll the layers (the trainer's --no-scan-layers)."
        )
    return Scan(p["jaxpr"], nc, nk, nx, p["length"], p["reverse"])


def rebuilt_scan(
    eqn: JaxprEqn,
    *,
    body: ClosedJaxpr | None = None,
    num_consts: int | None = None,
    num_xs: int | None = None,
    reverse: bool | None = None,
) -> JaxprEqn:
    """The scan `eqn` with another body, other operand counts (its carries and outputs
    unchanged) or another direction; unchanged what is not given."""
    scan = scan_of(eqn)
    if scan is None:
        raise ValueError(f"expected a scan equation, got {eqn.primitive.name}")
    nc = scan.num_consts if num_consts is None else num_consts
    nx = scan.num_xs if num_xs is None else num_xs
    params = dict(eqn.params)
    params["jaxpr"] = scan.body if body is None else body
    params["reverse"] = scan.reverse if reverse is None else reverse
    if "ft_in" in params:
        from jax._src import flattree

        _, carry, _ = params["ft_in"].unpack()
        params["ft_in"] = flattree.pack((flattree.nones(nc), carry, flattree.nones(nx)))
    else:
        params["num_consts"] = nc
        params.pop("linear", None)  # jax 0.10.0 and later take none
    return eqn.replace(params=params)


# ----------------------------------------------------------------------------- vjp


def vjp_dropping(
    fun: Callable[..., Any], args: Sequence[Any], saved: Sequence[bool]
) -> tuple[Any, Any]:
    """`jax.vjp(fun, *args)` whose VJP keeps none of the arguments marked False in
    `saved` (the caller keeps them, or computes them again, and hands them back with
    `vjp_restored`). The VJP is a pytree whose leaves are its residuals."""
    if _VJP_TAKES_SAVEABLE:
        out, vjp = jax.vjp(fun, *args, saveable_args=tuple(bool(s) for s in saved))
        # An argument the backward does not read is a `NotNeeded` leaf on 0.11+: one
        # without leaves instead, so that the VJP's leaves are arrays only.
        vjp.args_res = [
            _api.NotSaveable() if isinstance(r, _api.NotNeeded) else r for r in vjp.args_res
        ]
        return out, vjp
    out, vjp = jax.vjp(fun, *args)
    vjp.args_res = [r if s else _api.NotNeeded() for r, s in zip(vjp.args_res, saved, strict=True)]
    return out, vjp


def vjp_restored(vjp: Any, args: Sequence[Any], saved: Sequence[bool]) -> Any:
    """`vjp` (from `vjp_dropping` with the same `saved`) with the arguments it did not
    keep put back from `args` (entries at kept positions are ignored)."""
    vjp.args_res = [r if s else a for r, a, s in zip(vjp.args_res, args, saved, strict=True)]
    return vjp


# ----------------------------------------------------------------------------- runtime


def distributed_client() -> Any:
    """The `jax.distributed` coordination client, or None when this process runs alone."""
    from jax._src import distributed

    return distributed.global_state.client
