"""Test setup: 8 emulated CPU devices, configured before JAX initialises its backends; and
`compile_cache` / `module_compile_cache`, fixtures for a test / a module whose runs compile
the same programs several times."""

import os
import subprocess
import sys


def _xla_knows(flag: str) -> bool:
    """Whether the installed jaxlib's XLA accepts `flag` in XLA_FLAGS.

    XLA aborts a process whose XLA_FLAGS hold a flag it does not know, and reads XLA_FLAGS
    once per process, so a child process tries it: building compile options parses the
    flags and starts no backend (about 0.2 s). Where the probe itself fails, the flag is
    left out, which only makes the compiles slower."""
    probe = "from jaxlib import _jax; _jax.CompileOptions()"
    env = {**os.environ, "XLA_FLAGS": flag}
    child = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True)
    return child.returncode == 0


# The tests' programs are small and run a few steps, so compiling them is most of the
# suite's time: the tests compile without LLVM's optimisations and, where XLA still has
# them (jaxlib 0.10 and 0.11.0; 0.11.2 and 0.12 always use the fusion emitters), with XLA's
# older elemental CPU emitters (on a 2-core machine with jax 0.10.2: tests/test_beyond.py's
# two-hop bound test 43 s -> 12 s, the suite 1035 s -> 558 s). Both sides of every
# comparison (sharded and unsharded, one process and several) are compiled alike: the
# subprocesses the tests start inherit these flags.
TEST_XLA_FLAGS = "--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
if _xla_knows("--xla_cpu_use_fusion_emitters=false"):
    TEST_XLA_FLAGS += " --xla_cpu_use_fusion_emitters=false"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_platforms", "cpu")


def _use_compile_cache(directory):
    """Points JAX's persistent compilation cache at `directory` (every compile is kept);
    returns what puts the previous settings back."""
    from jax.experimental.compilation_cache import compilation_cache

    def use(directory, min_secs):
        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", min_secs)
        compilation_cache.reset_cache()

    old = (
        jax.config.jax_compilation_cache_dir,
        jax.config.jax_persistent_cache_min_compile_time_secs,
    )
    use(str(directory), 0.0)
    return lambda: use(*old)


@pytest.fixture
def compile_cache(tmp_path, request):
    """A persistent compilation cache in this test's own folder, for the in-process runs
    of one test that compile the same programs (a run, then its resumption); the previous
    settings come back afterwards."""
    request.addfinalizer(_use_compile_cache(tmp_path / "jax-cache"))


@pytest.fixture(scope="module")
def module_compile_cache(tmp_path_factory):
    """`compile_cache` for a whole module: its tests and module fixtures compile the same
    programs."""
    restore = _use_compile_cache(tmp_path_factory.mktemp("jax-cache"))
    yield
    restore()
