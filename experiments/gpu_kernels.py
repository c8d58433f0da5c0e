"""Checks the Pallas quantization kernels against the jnp reference on a GPU, then times them.

    python experiments/gpu_kernels.py            # on a GPU host: checks, then the table
    python experiments/gpu_kernels.py --smoke    # anywhere: tiny sizes, interpret mode, CPU

Checks: every kernel (compiled, Triton backend) on fresh random data of every kind (normal,
heavy-tailed, zero, -0.0, NaN, +-Inf, exact ties, near float32 max, subnormal), with a block
count that is not a multiple of the tile and outputs that start poisoned (NaN, -128 or 255
buffers aliased into the kernel), compared bit for bit with `zeropp_jax.wire.quant` compiled by
XLA on the same device. A mismatch names the kinds of block it hit and, for round-to-nearest
quantization, which side a host float32 computation of the contract (`x * fl(1 / scale)`,
ties to even) agrees with. On an H200 with jax 0.11.2 the kernels agreed with the host on
every differing value and XLA did not: XLA:GPU's float32 `1 / s` is not correctly rounded
(`experiments/results/gpu_h200/`, RESULTS.md "GPU kernels").

Timing: median of several runs after warm-up (`block_until_ready`), as bytes read plus bytes
written per second, next to a device-to-device copy (`x + 1` on a float32 array of the same
size, 2x its bytes), and the gradient hops' Hadamard rotation (`zeropp_jax.wire._rotation`, XLA
operations, float32 in and out). Sizes are the float32 side of each kernel (its input for
quantize, its output for the others). Designed to finish in under 3 minutes on an H200,
compile included; `--budget-s` stops timing early rather than overrun. Exit status 1 if any
check failed.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import statistics
import sys
import time
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _library import rotation  # noqa: E402

import pallas_kernels as pk  # noqa: E402
from zeropp_jax.wire import quant  # noqa: E402

MIB = 1 << 20
KINDS = ["x1e3", "x1e-3", "heavy", "heavy", "zero", "-0.0", "nan", "+-inf", "ties", "x1e37"]
KINDS += ["nan+inf", "subnormal"]
# XLA:CPU's reduce-max drops NaN from 64 blocks up (openxla/xla#21461) and XLA:CPU flushes
# subnormals, so the CPU reference is wrong on those blocks at these sizes; the smoke run
# leaves them out (the unit tests cover them at sizes where XLA:CPU gets them right).
NOT_ON_CPU = ("nan", "+-inf", "nan+inf", "subnormal")


def make_blocks(seed: int, num_blocks: int, block_size: int, bits: int, kinds=KINDS) -> jax.Array:
    """float32 `(num_blocks, block_size)`: one block of each of `kinds`, then normal ones."""
    key = jax.random.key(seed)
    x = jax.random.normal(key, (num_blocks, block_size), jnp.float32)
    special = np.array(x[: len(KINDS)])
    heavy = np.array(jax.random.cauchy(jax.random.fold_in(key, 1), (2, block_size)))
    m = quant.qmax(bits)
    special[0] *= 1e3
    special[1] *= 1e-3
    special[2:4] = heavy
    special[4] = 0.0
    special[5] = -0.0
    special[6, 1] = np.nan
    special[7, 0], special[7, -1] = np.inf, -np.inf
    special[8] = [float(m)] + [(j % (2 * m)) - m + 0.5 for j in range(block_size - 1)]
    special[9] *= 1e37
    special[10, 2], special[10, 3] = np.nan, np.inf
    special[11] *= 1e-39
    special = special[[i for i, k in enumerate(KINDS) if k in kinds]]
    return x.at[: len(special)].set(jnp.asarray(special))


def compare(got, want, kinds, bits: int = 8) -> str | None:
    """None if equal bit for bit (NaN where the reference has NaN), else a description with
    the size of the differences: float32 ulps, or quantization steps for packed `bits`."""
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"shape/dtype {got.shape} {got.dtype} != {want.shape} {want.dtype}"
    if got.dtype.kind == "f" or got.dtype == jnp.bfloat16:
        gnan, wnan = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
        bits_view = f"i{got.itemsize}"
        bad = (gnan != wnan) | (~wnan & (got.view(bits_view) != want.view(bits_view)))
        both = bad & ~gnan & ~wnan
        diff = np.abs(got.view(bits_view)[both].astype(np.int64) - want.view(bits_view)[both])
        size = f"max {int(diff.max()) if diff.size else 0} ulp"
    else:
        bad = got != want
        q_got = np.asarray(quant.unpack(jnp.asarray(got), bits), np.int32)
        q_want = np.asarray(quant.unpack(jnp.asarray(want), bits), np.int32)
        size = f"max {int(np.abs(q_got - q_want).max())} steps"
    if not bad.any():
        return None
    rows = np.nonzero(bad.reshape(bad.shape[0], -1).any(axis=1))[0]
    hit = sorted({kinds[r] if r < len(kinds) else "normal" for r in rows})
    return f"{int(bad.sum())} elements in {len(rows)} blocks ({', '.join(hit)}), {size}"


def host_round(x, scales, bits: int) -> np.ndarray:
    """The round-to-nearest codes of float32 blocks `x` `(blocks, n)` with the given
    scales, computed on the host in numpy float32 as the contract spells it:
    `clip(round_half_even(x * fl(1 / scale)), -qmax, qmax)` (numpy's float32 division and
    product are correctly rounded). The arbiter when kernel and XLA reference differ."""
    x, s = np.asarray(x, np.float32), np.asarray(scales, np.float32)
    safe = np.where(s > 0, s, np.float32(1))
    with np.errstate(all="ignore"):
        y = x * (np.float32(1) / safe)[:, None]
        m = np.float32(quant.qmax(bits))
        q = np.round(np.clip(y, -m, m))
    return np.where(np.isnan(y), 0, q).astype(np.int32)


def arbitrate(x, got, want, bits: int) -> str:
    """Which side agrees with `host_round` where the packed values of kernel (`got`) and
    reference (`want`) differ: `got = (values, scales)`, `want` the same."""
    q_got = np.asarray(quant.unpack(got[0], bits), np.int32).reshape(np.shape(x))
    q_want = np.asarray(quant.unpack(want[0], bits), np.int32).reshape(np.shape(x))
    diff = q_got != q_want
    if not diff.any() or not np.array_equal(
        np.asarray(got[1]), np.asarray(want[1]), equal_nan=True
    ):
        return ""
    host = host_round(x, want[1], bits)
    xs = np.asarray(x, np.float32)[diff]
    y = xs * (np.float32(1) / np.asarray(want[1], np.float32)[np.nonzero(diff)[0]])
    return (
        f" [host float32 agrees with the kernel on {int((q_got == host)[diff].sum())} and "
        f"with XLA on {int((q_want == host)[diff].sum())} of {int(diff.sum())}; "
        f"x / scale there: {', '.join(f'{v:.7f}' for v in y[:4])}]"
    )


def _stack(seed, groups, num_blocks, block_size, bits, kinds):
    ref = jax.jit(functools.partial(quant.quantize_blocks, bits=bits))
    sets = [ref(make_blocks(seed + g, num_blocks, block_size, bits, kinds)) for g in range(groups)]
    return jnp.stack([v for v, _ in sets]), jnp.stack([s for _, s in sets])


def _quantize_case(bits, n, seed, elements, opts, kinds):
    x = make_blocks(1, elements // n + 3, n, bits, kinds)
    key = None if seed is None else jax.random.key(seed)
    kern = jax.jit(functools.partial(pk.quantize_blocks, bits=bits, **opts))
    ref = jax.jit(functools.partial(quant.quantize_blocks, bits=bits))
    got, want = kern(x, key=key), ref(x, key=key)
    return got, want, bits, (x if key is None else None)


def _dequantize_case(bits, n, dtype, elements, opts, kinds):
    quantize = jax.jit(functools.partial(quant.quantize_blocks, bits=bits))
    v, s = quantize(make_blocks(2, elements // n + 3, n, bits, kinds))
    kern = jax.jit(functools.partial(pk.dequantize_blocks, bits=bits, dtype=dtype, **opts))
    ref = jax.jit(functools.partial(quant.dequantize_blocks, bits=bits, dtype=dtype))
    return kern(v, s), ref(v, s), bits, None


def _sum_case(bits, n, groups, elements, opts, kinds):
    v, s = _stack(3, groups, elements // n + 3, n, bits, kinds)
    kern = jax.jit(functools.partial(pk.dequantize_sum_blocks, bits=bits, **opts))
    ref = jax.jit(functools.partial(quant.dequantize_sum_blocks, bits=bits))
    return kern(v, s), ref(v, s), bits, None


def _fused_case(bits, out_bits, n, seed, groups, elements, opts, kinds):
    v, s = _stack(5, groups, elements // n + 3, n, bits, kinds)
    key = None if seed is None else jax.random.key(seed)
    kern = pk.dequantize_sum_quantize_blocks
    kern = jax.jit(functools.partial(kern, bits=bits, out_bits=out_bits, **opts))
    ref = quant.dequantize_sum_quantize_blocks
    ref = jax.jit(functools.partial(ref, bits=bits, out_bits=out_bits))
    x = None
    if key is None:  # the float32 sum the kernel quantizes (every product q * s is exact)
        x = quant.dequantize_sum_blocks(v, s, bits=bits)  # in order g = 0, 1, ..., as both
    return kern(v, s, key=key), ref(v, s, key=key), out_bits, x


def kinds(smoke: bool) -> list[str]:
    """The special blocks a run checks."""
    return [k for k in KINDS if k not in NOT_ON_CPU] if smoke else KINDS


def check_cases(smoke: bool):
    """(name, thunk returning (kernel result, reference result)) for every check."""
    if smoke:
        q_cases = [(2, 64, 7)]
        d_cases = [(8, 8, jnp.float32)]
        s_cases = [(4, 64)]
        f_cases = [(8, 4, 64, None)]
    else:
        q_cases = [(b, n, None) for b in (8, 4, 2) for n in (8, 64, 256)]
        q_cases += [(b, 256, 7) for b in (8, 4, 2)]
        d_cases = [(b, n, jnp.float32) for b in (8, 4, 2) for n in (8, 256)]
        d_cases += [(4, 256, jnp.bfloat16)]
        s_cases = [(b, n) for b in (8, 4, 2) for n in (8, 256)]
        f_cases = [(b, o, 256, None) for b in (8, 4, 2) for o in (8, 4, 2)]
        f_cases += [(4, 4, 8, None), (4, 4, 256, 11)]
    # G = 4 is the engine's case (4 devices per node). XLA contracts `acc + q * s` into an
    # FMA and, on XLA:CPU, fuses either product into the first add depending on G (the
    # product of G = 2, 3 and 8, the other one for G = 4 and 5), while a kernel always fuses
    # the first. Scales have at most 16 significant bits (`quant.SCALE_BITS`), so every
    # product is exact and no contraction changes a bit: any G matches.
    groups = 4
    common = dict(
        elements=1 << (12 if smoke else 22),
        opts=dict(interpret=smoke, poison_outputs=True),
        kinds=kinds(smoke),
    )
    cases = []
    for bits, n, seed in q_cases:
        name = f"quantize_blocks bits={bits} block={n}" + (" stochastic" if seed else "")
        cases.append((name, functools.partial(_quantize_case, bits, n, seed, **common)))
    for bits, n, dtype in d_cases:
        name = f"dequantize_blocks bits={bits} block={n} {jnp.dtype(dtype).name}"
        cases.append((name, functools.partial(_dequantize_case, bits, n, dtype, **common)))
    for bits, n in s_cases:
        name = f"dequantize_sum_blocks bits={bits} block={n} G={groups}"
        cases.append((name, functools.partial(_sum_case, bits, n, groups, **common)))
    for bits, out_bits, n, seed in f_cases:
        name = f"dequantize_sum_quantize bits={bits}->{out_bits} block={n} G={groups}"
        name += " stochastic" if seed else ""
        case = functools.partial(_fused_case, bits, out_bits, n, seed, groups, **common)
        cases.append((name, case))
    return cases


def run_checks(smoke: bool) -> int:
    failures = 0
    for name, case in check_cases(smoke):
        try:
            got, want, bits, x = jax.block_until_ready(case())
            pair = (got, want) if isinstance(got, tuple) else ((got,), (want,))
            found = [compare(g, w, kinds(smoke), bits) for g, w in zip(*pair, strict=True)]
            problems = [p for p in found if p]
            status = "ok" if not problems else "MISMATCH: " + "; ".join(problems)
            if problems and x is not None:
                status += arbitrate(x, got, want, bits)
        except Exception as e:  # report and keep checking the other kernels
            status = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
        failures += status != "ok"
        print(f"  {name:55s} {status}", flush=True)
    return failures


def _median_seconds(fn, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timing_rows(size_mib: float, block_size: int, smoke: bool):
    """(kernel, bits, callable, args, bytes moved) for one float32 size."""
    n = int(size_mib * MIB) // 4
    nb = n // block_size
    x = jax.random.normal(jax.random.key(0), (nb, block_size), jnp.float32)
    opts = dict(interpret=smoke)
    # The gradient hops' Hadamard rotation (`ZeroPPConfig.grad_rotation`) runs as XLA
    # operations beside the kernels: timed here as float32 in and out (bits: 32).
    rot = jax.jit(functools.partial(rotation.rotate_blocks, block_size=block_size))
    rows = [("rotate (Hadamard, XLA)", 32, rot, (x,), 8 * n)]
    for bits in (4,) if smoke else (8, 4, 2):
        packed = nb * block_size * bits // 8 + 4 * nb
        v, s = jax.jit(functools.partial(quant.quantize_blocks, bits=bits))(x)
        vg, sg = jnp.stack([v] * 4), jnp.stack([s] * 4)
        q = jax.jit(functools.partial(pk.quantize_blocks, bits=bits, **opts))
        d = jax.jit(functools.partial(pk.dequantize_blocks, bits=bits, **opts))
        ds = jax.jit(functools.partial(pk.dequantize_sum_blocks, bits=bits, **opts))
        f = jax.jit(
            functools.partial(pk.dequantize_sum_quantize_blocks, bits=bits, out_bits=bits, **opts)
        )
        rows.append(("quantize", bits, q, (x,), 4 * n + packed))
        rows.append(("dequant_sum_quant G=4", bits, f, (vg, sg), 5 * packed))
        if not smoke:  # the smoke run times two kernels: enough to exercise the table
            rows.append(("dequantize", bits, d, (v, s), packed + 4 * n))
            rows.append(("dequantize_sum G=4", bits, ds, (vg, sg), 4 * packed + 4 * n))
    return x, rows


def run_timing(sizes_mib, block_size: int, reps: int, smoke: bool, deadline: float) -> None:
    print(f"\n{'kernel':24s} {'bits':>4s} {'MiB':>8s} {'ms':>9s} {'GB/s':>8s} {'of copy':>8s}")
    copy = jax.jit(lambda a: a + 1)
    for size in sizes_mib:
        if time.perf_counter() > deadline:
            print(f"{size:g} MiB and larger: skipped (time budget)")
            return
        x, rows = timing_rows(size, block_size, smoke)
        t_copy = _median_seconds(copy, (x,), reps)
        copy_gbps = 2 * x.nbytes / t_copy / 1e9
        print(
            f"{'copy (x + 1)':24s} {'':>4s} {size:8g} {t_copy * 1e3:9.3f} {copy_gbps:8.1f} {1:8.2f}"
        )
        for name, bits, fn, args, nbytes in rows:
            if time.perf_counter() > deadline:
                print(f"{name:24s} {bits:4d} {size:8g}  skipped (time budget)")
                continue
            t = _median_seconds(fn, args, reps)
            gbps = nbytes / t / 1e9
            print(
                f"{name:24s} {bits:4d} {size:8g} {t * 1e3:9.3f} {gbps:8.1f} "
                f"{gbps / copy_gbps:8.2f}",
                flush=True,
            )
        del x, rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, interpret mode, tiny sizes")
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--block-size", type=int, default=256)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=165.0, help="stop timing after this")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    warnings.filterwarnings("ignore", message=".*[Tt]riton.*deprecated.*")
    if args.smoke:
        args.sizes_mib, args.reps = [1 / 16], 1
    else:
        try:
            gpus = jax.devices("gpu")
        except RuntimeError:
            gpus = []
        if not gpus:
            print(
                "gpu_kernels.py: no GPU visible to JAX (backend: "
                f"{jax.default_backend()}); nothing to check or time. "
                "Run with --smoke for the CPU interpret-mode check."
            )
            return 0
        print(f"device: {gpus[0].device_kind}; jax {jax.__version__}")
    print("checks (kernel vs jnp reference, bit for bit, poisoned outputs):", flush=True)
    failures = run_checks(args.smoke)
    print(f"checks done in {time.perf_counter() - start:.1f} s, {failures} failed", flush=True)
    run_timing(args.sizes_mib, args.block_size, args.reps, args.smoke, start + args.budget_s)
    print(f"\ntotal {time.perf_counter() - start:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
