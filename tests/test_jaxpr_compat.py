"""jax's internals in one module (`zeropp_jax.interpreter._jaxpr_compat`): what it reads of scans,
calls and remat on the installed jax, what it rebuilds, and that no other module of the
library reads them."""

import ast
import pathlib
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeropp_jax.interpreter import _jaxpr_compat as jaxpr_compat

ROOT = pathlib.Path(__file__).resolve().parents[1]

CONTROL_FLOW_PARAMS = frozenset(
    {
        # scan (jax 0.10 and 0.11+), while, cond
        "num_consts",
        "num_carry",
        "linear",
        "ft_in",
        "ft_out",
        "length",
        "reverse",
        "unroll",
        "jaxpr",
        "body_jaxpr",
        "cond_jaxpr",
        "body_nconsts",
        "cond_nconsts",
        "branches",
        # calls, remat, custom derivatives
        "call_jaxpr",
        "inline",
        "policy",
        "prevent_cse",
        "differentiated",
        "jvp_jaxpr_fun",
        "jvp_jaxpr_thunk",
        "fwd_jaxpr_thunk",
        "bwd",
        "symbolic_zeros",
    }
)


def _scan_eqn(f, *args):
    jaxpr = jax.make_jaxpr(f)(*args)
    [eqn] = [e for e in jaxpr.eqns if e.primitive.name == "scan"]
    return eqn


def _offences(path: pathlib.Path) -> list[str]:
    """Where `path` imports `jax._src`, or reads or writes a control-flow primitive's
    parameter by name (`x.params["length"]`, `params.get("policy")`, `p["ft_in"]`,
    `dict(p, num_consts=...)`)."""
    tree = ast.parse(path.read_text(), str(path))
    out = []
    for node in ast.walk(tree):
        where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            out += [
                f"{where} imports {a.name}" for a in node.names if a.name.startswith("jax._src")
            ]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("jax._src"):
            out.append(f"{where} imports from {node.module}")
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            if node.slice.value in CONTROL_FLOW_PARAMS:
                out.append(f"{where} indexes [{node.slice.value!r}]")
        elif isinstance(node, ast.Call):
            func = node.func
            if (
                isinstance(func, ast.Attribute)
                and func.attr == "get"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and node.args[0].value in CONTROL_FLOW_PARAMS
            ):
                out.append(f"{where} reads .get({node.args[0].value!r})")
            if isinstance(func, ast.Name) and func.id == "dict":
                out += [
                    f"{where} writes {k.arg}="
                    for k in node.keywords
                    if k.arg in CONTROL_FLOW_PARAMS
                ]
    return out


def test_no_other_module_reads_jax_internals():
    modules = sorted((ROOT / "zeropp_jax").rglob("*.py")) + sorted(
        (ROOT / "pallas_kernels").rglob("*.py")
    )
    assert len(modules) > 40
    owner = ROOT / "zeropp_jax" / "interpreter" / "_jaxpr_compat.py"
    found = [o for m in modules if m != owner for o in _offences(m)]
    assert found == []
    assert any("imports from jax._src" in o for o in _offences(owner))


def test_the_grep_catches_what_it_is_for(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from jax._src import core\n"
        "import jax._src.api\n"
        "n = eqn.params['num_consts']\n"
        "p = eqn.params\n"
        "k = p['ft_in']\n"
        "q = p.get('policy')\n"
        "r = dict(p, linear=())\n"
        "ok = lo.params['permutation']\n"
    )
    found = [o.split(" ", 1)[1] for o in _offences_at(bad, tmp_path)]
    assert found == [
        "imports from jax._src",
        "imports jax._src.api",
        "indexes ['num_consts']",
        "indexes ['ft_in']",
        "reads .get('policy')",
        "writes linear=",
    ]


def _offences_at(path, root):
    global ROOT
    old, ROOT = ROOT, root
    try:
        return sorted(_offences(path), key=lambda o: int(o.split(":")[1].split(" ")[0]))
    finally:
        ROOT = old


def test_scan_of_reads_groups_length_and_direction():
    def f(c, xs):
        return jax.lax.scan(lambda k, x: (k + (c * x).sum(), x * c), jnp.float32(0), xs)

    scan = jaxpr_compat.scan_of(_scan_eqn(f, jnp.ones(3), jnp.ones((5, 3))))
    assert (scan.num_consts, scan.num_carry, scan.num_xs, scan.length) == (1, 1, 1, 5)
    assert scan.reverse is False
    assert scan.split(["c", "k", "x"]) == (["c"], ["k"], ["x"])
    g = lambda xs: jax.lax.scan(lambda k, x: (k + x, k), 0.0, xs, reverse=True)  # noqa: E731
    assert jaxpr_compat.scan_of(_scan_eqn(g, jnp.ones(4))).reverse is True
    other = jax.make_jaxpr(jnp.sin)(1.0).eqns[0]
    assert jaxpr_compat.scan_of(other) is None


def test_scan_of_a_form_it_does_not_know_names_the_version_and_the_fix():
    eqn = types.SimpleNamespace(
        primitive=jaxpr_compat.scan_p,
        invars=[],
        params=dict(reverse=False, length=5, jaxpr=None, groups=(), unroll=1),
    )
    with pytest.raises(RuntimeError, match=rf"jax {jax.__version__}.*groups.*--no-scan-layers"):
        jaxpr_compat.scan_of(eqn)


def test_rebuilt_scan_moves_a_const_to_xs_and_runs_forward():
    """A scan whose constant `w` becomes an `xs` operand (what `indexed_scan` does to a
    stacked weight read by the counter), and a reversed scan run forward over reversed
    `xs`: each bound again, against the original."""

    def f(w, xs):
        return jax.lax.scan(lambda k, x: (k * 0.5 + x @ w[0], k), jnp.zeros(3), xs)

    w, xs = jnp.arange(9.0).reshape(1, 3, 3), jnp.arange(12.0).reshape(4, 3)
    eqn = _scan_eqn(f, w, xs)
    scan = jaxpr_compat.scan_of(eqn)
    body = scan.body.jaxpr
    # The body with the constant read last, as an `xs` operand of one row per iteration.
    c, k, x = body.invars
    new = jaxpr_compat.jaxpr_like(body, [k, x, c], body.outvars, body.eqns)
    moved = jaxpr_compat.rebuilt_scan(
        eqn, body=jaxpr_compat.closed(new, scan.body.consts), num_consts=0, num_xs=2
    )
    got = jaxpr_compat.bind(moved, [jnp.zeros(3), xs, jnp.broadcast_to(w, (4, 3, 3))])
    want = f(w, xs)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])
    assert jaxpr_compat.scan_of(moved).num_consts == 0

    def r(xs):
        return jax.lax.scan(lambda k, x: (k + x, k * x), jnp.ones(3), xs, reverse=True)

    eqn = _scan_eqn(r, xs)
    fwd = jaxpr_compat.rebuilt_scan(eqn, reverse=False)
    carry, ys = jaxpr_compat.bind(fwd, [jnp.ones(3), xs[::-1]])
    want = r(xs)
    np.testing.assert_array_equal(carry, want[0])
    np.testing.assert_array_equal(ys[::-1], want[1])


def test_inlined_call_and_remat_are_read():
    policy = jax.checkpoint_policies.dots_saveable

    def f(x):
        y = jax.jit(jnp.sin)(x)
        return jax.checkpoint(jnp.cos, policy=policy, prevent_cse=False)(y)

    eqns = jax.make_jaxpr(f)(1.0).eqns
    call, remat = eqns
    inner = jaxpr_compat.inlined_call(call)
    assert [e.primitive.name for e in inner.jaxpr.eqns] == ["sin"]
    assert jaxpr_compat.inlined_call(remat) is None
    block = jaxpr_compat.remat_of(remat)
    assert block.policy is policy and block.prevent_cse is False
    assert [e.primitive.name for e in block.jaxpr.eqns] == ["cos"]
    assert jaxpr_compat.eval_jaxpr(block.jaxpr, block.consts, 0.5) == [jnp.cos(0.5)]
    assert jaxpr_compat.remat_of(call) is None


def test_vjp_dropping_keeps_no_dropped_input_and_restores_it():
    def f(a, b, c):
        return jnp.sin(a) * b + c * c

    a, b, c = jnp.arange(3.0), jnp.arange(3.0) + 1, jnp.arange(3.0) + 2
    out, vjp = jaxpr_compat.vjp_dropping(f, [a, b, c], [True, False, False])
    leaves = jax.tree_util.tree_leaves(vjp)
    # All leaves are arrays (a VJP crosses a scan as its residuals); neither b nor c is one.
    assert all(isinstance(x, jax.Array) for x in leaves)
    assert not any(x is b or x is c for x in leaves)
    vjp = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(vjp), leaves)
    vjp = jaxpr_compat.vjp_restored(vjp, [None, b, c], [True, False, False])
    got = vjp(jnp.ones(3))
    want = jax.vjp(f, a, b, c)[1](jnp.ones(3))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)
    np.testing.assert_array_equal(out, f(a, b, c))


@pytest.mark.parametrize("flag", ["jax_scan3", "jax_remat3", "jax_custom_vjp3"])
def test_an_opt_in_primitive_flag_is_refused_naming_it_and_the_fix(flag):
    jaxpr_compat.check_supported()
    jax.config.update(flag, True)
    try:
        with pytest.raises(
            RuntimeError, match=rf'{flag} is on.*jax.config.update\("{flag}", False'
        ):
            jaxpr_compat.check_supported()
    finally:
        jax.config.update(flag, False)
    jaxpr_compat.check_supported()


def test_shard_refuses_an_opt_in_primitive_flag_before_tracing():
    import zeropp_jax as zpp

    jax.config.update("jax_scan3", True)
    try:
        with pytest.raises(RuntimeError, match="jax_scan3 is on"):
            zpp.shard(lambda state, batch: (state, {}))
    finally:
        jax.config.update("jax_scan3", False)
