"""Does one Newton step, `r + r * (1 - s * r)` in float32, make XLA's `1 / s` correctly
rounded on a GPU? Counts the block scales whose reciprocal differs from numpy's.

    PYTHONPATH=. python experiments/gpu_diagnostics/newton_recip.py

On the CPU both counts are 0; on the H200 (jax 0.11.2), 2167 and 2723 of 16387: no
(`experiments/results/gpu_h200/newton_recip.log`).
"""

import jax
import jax.numpy as jnp
import numpy as np

from zeropp_jax.wire import quant

x = jax.random.normal(jax.random.key(1), (16387, 256), jnp.float32)
s = quant.block_scales(quant.block_absmax(x), 8)
safe = jnp.where(s > 0, s, 1.0)
host = np.float32(1) / np.asarray(safe)


def newton(a):
    r = 1.0 / a
    return r + r * (1.0 - a * r)


for name, f in [("plain", lambda a: 1.0 / a), ("newton", newton)]:
    r = np.asarray(jax.jit(f)(safe))
    print(
        name,
        "differs from correctly rounded 1/s in",
        int((r.view(np.int32) != host.view(np.int32)).sum()),
        "of",
        host.size,
    )
