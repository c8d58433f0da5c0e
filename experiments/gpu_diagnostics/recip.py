"""Why XLA's quantize reference rounds some ties differently from the kernels on a GPU.

    PYTHONPATH=. python experiments/gpu_diagnostics/recip.py

Prints how many of 16387 block scales' reciprocals `1 / s`, computed by XLA on the default
device, differ in any bit from numpy's correctly rounded float32 reciprocal; how many
products `x * (1 / s)` differ from the host's, computed plainly, with an
`optimization_barrier` on the reciprocal, and with the host's reciprocal; then the tail of
the compiled program. On the CPU every count is 0. Output of the H200 (jax 0.11.2):
`experiments/results/gpu_h200/recip.log`.
"""

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))
import jax
import jax.numpy as jnp
import numpy as np

from zeropp_jax.wire import quant

x = jax.random.normal(jax.random.key(1), (16387, 256), jnp.float32)
s = quant.block_scales(quant.block_absmax(x), 8)
safe = jnp.where(s > 0, s, 1.0)
r_dev = np.asarray(jax.jit(lambda a: 1.0 / a)(safe))
r_host = np.float32(1) / np.asarray(safe)
print(
    "1/s on device vs host: bitwise differing",
    int((r_dev.view(np.int32) != r_host.view(np.int32)).sum()),
    "of",
    r_host.size,
)
xh = np.asarray(x)
y_host = xh * r_host[:, None]
plain = jax.jit(lambda a, b: a * (1.0 / b)[:, None])
barrier = jax.jit(lambda a, b: a * jax.lax.optimization_barrier(1.0 / b)[:, None])
given = jax.jit(lambda a, r: a * r[:, None])
for name, y in [
    ("x*(1/s)", plain(x, safe)),
    ("barrier", barrier(x, safe)),
    ("host recip", given(x, jnp.asarray(r_host))),
]:
    y = np.asarray(y)
    print(
        name,
        "differs from host product in",
        int((y.view(np.int32) != y_host.view(np.int32)).sum()),
        "values",
    )
print(plain.lower(x, safe).compile().as_text()[-2500:])
