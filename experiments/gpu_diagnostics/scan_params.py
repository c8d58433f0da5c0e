"""The parameters of a `scan` equation in the installed jax (jax 0.10: num_consts,
num_carry; jax 0.11+: ft_in, ft_out), and what
`zeropp_jax.interpreter._jaxpr_compat.scan_of` reads of them.

    python experiments/gpu_diagnostics/scan_params.py
"""

import jax
import jax.numpy as jnp
from _library import jaxpr_compat


def f(c, xs):
    return jax.lax.scan(lambda k, x: (k + (c * x).sum(), x * c), jnp.float32(0), xs)


j = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones((5, 3)))
e = [e for e in j.eqns if e.primitive.name == "scan"][0]
print("jax", jax.__version__)
print("scan params:", {k: (v if k != "jaxpr" else "<jaxpr>") for k, v in e.params.items()})
scan = jaxpr_compat.scan_of(e)
print(
    "read: consts, carry, xs, length, reverse =",
    (scan.num_consts, scan.num_carry, scan.num_xs, scan.length, scan.reverse),
)
print(j)
