"""Test setup: 8 emulated CPU devices, configured before JAX initialises its backends, and
one persistent compilation cache for the whole session.

The cache is a fresh temporary folder per `pytest` run, shared by the xdist workers and by
the subprocesses the tests start (through the environment, which they inherit). Many tests
compile the same programs (the trainer's GPT step, the documented commands run twice);
with the cache XLA compiles each once per session. It changes no result: a cache hit is
the executable XLA would have built.
"""

import os
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # set once, by the controller
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="zeropp_tests_cache_")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
