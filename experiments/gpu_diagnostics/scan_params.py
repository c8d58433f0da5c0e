"""The parameters of a `scan` equation in the installed jax (jax 0.10: num_consts,
num_carry, linear; jax 0.11: ft_in, ft_out), for `zeropp_jax.jaxpr_reads.scan_counts`.

    python experiments/gpu_diagnostics/scan_params.py
"""

import jax
import jax.numpy as jnp


def f(c, xs):
    return jax.lax.scan(lambda k, x: (k + (c * x).sum(), x * c), jnp.float32(0), xs)


j = jax.make_jaxpr(f)(jnp.ones(3), jnp.ones((5, 3)))
e = [e for e in j.eqns if e.primitive.name == "scan"][0]
print("scan params:", {k: (v if k != "jaxpr" else "<jaxpr>") for k, v in e.params.items()})
print(j)
