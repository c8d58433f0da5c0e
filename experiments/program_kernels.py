"""The kernels of a compiled GPU program, as the GPU runs them per step (for
`experiments/gpu_overhead.py`).

A *kernel* is a top-level instruction of the entry computation or of a loop body (a
fusion, a custom-call, a copy), counted once per execution (a loop body times its known
trip count). Its *bytes* are what it writes plus what it reads: a fused parameter counts
only the elements the fusion's outputs need (a slice of an elementwise chain reads the
sliced elements). GEMM flops are `2 x output elements x contracted size` of each `dot`.
"""

from __future__ import annotations

import collections
import json
import math
import re
from typing import Any, NamedTuple

NOT_KERNELS = frozenset(
    "parameter constant get-tuple-element tuple bitcast after-all partition-id replica-id "
    "while call conditional".split()
)
"""Top-level opcodes that launch nothing (a loop's body is read as its own computation)."""
ELEMENTWISE = frozenset(
    "add subtract multiply divide maximum minimum abs negate convert select compare "
    "exponential exponential-minus-one log log-plus-one logistic tanh sqrt rsqrt cbrt power "
    "and or not xor clamp sign floor ceil round-nearest-even round-nearest-afz is-finite "
    "copy remainder shift-left shift-right-logical shift-right-arithmetic cosine sine tan "
    "atan2 erf bitcast-convert popcnt real imag stochastic-convert reduce-precision".split()
)
"""Opcodes whose output element i reads element i of each operand."""
SLICING = ("slice", "dynamic-slice", "gather", "broadcast")
"""Opcodes that read, of their first operand, about as many elements as they write."""
_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")


def elements(shape: str) -> int:
    """Elements of every array in an HLO shape (a tuple's summed; tokens none)."""
    return sum(
        math.prod(int(d) for d in dims.split(",") if d)
        for t, dims in _ARRAY_RE.findall(shape)
        if t != "token"
    )


def nbytes(shape: str) -> int:
    """Bytes of every array in an HLO shape (a tuple's summed; tokens none)."""
    from _library import array_shapes

    return sum(b for _, b in array_shapes(shape))


class Kernel(NamedTuple):
    """One top-level instruction of a compiled program, as the GPU runs it per step.

    Attributes:
      computation: the computation it is scheduled in (the entry or a loop body).
      name: its instruction name.
      kind: `gemm`, `pallas`, `loop fusion`, `input fusion` (a reduction),
        `triton fusion` (XLA's own Triton kernels), `custom fusion`, `copy`, ...
      launches: executions per step (its loop's trip counts multiplied).
      bytes: bytes written plus bytes read, per execution.
      whole_bytes: bytes written plus every operand read whole, as XLA's `HloCostAnalysis`
        counts a fusion.
      flops: GEMM flops per execution (0 for a kernel without a `dot`).
      shape: its output shape.
      op_name: its metadata's `op_name`.
      source: `(file, function, line, column)` of its metadata's innermost stack frame,
        or None.
      ops: opcodes inside it (a fusion's fused instructions, nested fusions included).
    """

    computation: str
    name: str
    kind: str
    launches: int
    bytes: int
    whole_bytes: int
    flops: int
    shape: str
    op_name: str
    source: tuple[str, str, int, int] | None
    ops: collections.Counter


def fused_ops(module: Any, computation: str) -> collections.Counter:
    """Opcodes of a fused computation, nested fusions included."""
    out: collections.Counter = collections.Counter()
    for ins in module.computations.get(computation, ()):
        out[ins.opcode] += 1
        if ins.opcode == "fusion":
            for callee in ins.called():
                out += fused_ops(module, callee)
    return out


def read_bytes(module: Any, computation: str) -> int:
    """Bytes a fused computation reads from its parameters: per parameter, the elements
    its outputs need (`ELEMENTWISE` passes a demand through, `SLICING` cuts it to its
    output; anything else reads its operand whole)."""
    instructions = module.computations[computation]
    users = collections.defaultdict(list)
    for ins in instructions:
        for operand in ins.operands:
            users[operand].append(ins)
    need: dict[str, int] = {}
    for ins in reversed(instructions):
        size = elements(ins.shape)
        if ins is instructions[-1]:
            need[ins.name] = size
            continue
        total = 0
        for user in users.get(ins.name, ()):
            wanted = need.get(user.name, 0)
            if not wanted:
                continue
            if user.opcode in ELEMENTWISE or user.opcode in ("bitcast", "reshape"):
                total += wanted
            elif user.opcode in SLICING and user.operands[0] == ins.name:
                total += wanted
            else:
                total = size
                break
        need[ins.name] = min(total, size)
    return sum(
        nbytes(p.shape) * need.get(p.name, 0) // max(elements(p.shape), 1)
        for p in instructions
        if p.opcode == "parameter"
    )


def dot_flops(module: Any, computation: str) -> int:
    """`2 x output elements x contracted size` of every `dot` in a fused computation."""
    total = 0
    for ins in module.computations.get(computation, ()):
        if ins.opcode == "fusion":
            total += sum(dot_flops(module, c) for c in ins.called())
        elif ins.opcode == "dot":
            shapes = {i.name: i.shape for i in module.computations[computation]}
            lhs = [
                int(d) for d in _ARRAY_RE.search(shapes[ins.operands[0]]).group(2).split(",") if d
            ]
            dims = (ins.attr("lhs_contracting_dims") or "{}").strip("{}")
            contracted = math.prod(lhs[int(d)] for d in dims.split(",") if d)
            total += 2 * elements(ins.shape) * contracted
    return total


def kind_of(module: Any, ins: Any) -> str:
    """A kernel's kind (see `Kernel`)."""
    if ins.opcode == "custom-call":
        target = (ins.attr("custom_call_target") or "").strip('"')
        if "triton" in target:
            return "pallas"
        return "gemm" if re.search(r"gemm|cublas|matmul", target) else f"custom-call {target}"
    if ins.opcode != "fusion":
        return ins.opcode
    if any(fused_ops(module, c)["dot"] for c in ins.called()):
        return "gemm"
    backend = re.search(r'"kind":"__(\w+?)"', ins.attr("backend_config") or "")
    if backend and backend.group(1) == "triton":
        return "triton fusion"
    if backend and backend.group(1) == "custom_fusion":
        return "custom fusion"
    kind = re.search(r"kind=k(\w+)", ins.attrs)
    return f"{kind.group(1).lower() if kind else 'other'} fusion"


def kernels(text: str) -> list[Kernel]:
    """Every kernel of a compiled program's HLO text (see `Kernel`)."""
    from _library import hlo_text

    module = hlo_text.parse_hlo_module(text)
    shapes = {(c, i.name): i.shape for c, ins in module.computations.items() for i in ins}
    runs = {module.entry: 1}
    todo = [module.entry]
    out = []
    while todo:
        comp = todo.pop(0)
        for ins in module.computations[comp]:
            times = 1
            if ins.opcode == "while":
                config = json.loads(ins.attr("backend_config") or "{}")
                times = int(config.get("known_trip_count", {}).get("n", 1))
            if ins.opcode in ("while", "call", "conditional", "async-start"):
                for callee in ins.called():
                    runs[callee] = runs.get(callee, 0) + runs[comp] * times
                    todo.append(callee)
            if ins.opcode in NOT_KERNELS:
                continue
            ops: collections.Counter = collections.Counter()
            whole = sum(nbytes(shapes.get((comp, o), "")) for o in ins.operands)
            if ins.opcode == "fusion":
                read = sum(read_bytes(module, c) for c in ins.called())
                flops = sum(dot_flops(module, c) for c in ins.called())
                for callee in ins.called():
                    ops += fused_ops(module, callee)
            else:
                read, flops = whole, 0
            out.append(
                Kernel(
                    computation=comp,
                    name=ins.name,
                    kind=kind_of(module, ins),
                    launches=runs[comp],
                    bytes=nbytes(ins.shape) + read,
                    whole_bytes=nbytes(ins.shape) + whole,
                    flops=flops,
                    shape=ins.shape,
                    op_name=ins.op_name,
                    source=module.locations.get(ins.frame),
                    ops=ops,
                )
            )
    return out


def static_counts(text: str) -> dict[str, int]:
    """Instructions in the program text: top-level fusions, custom-calls, copies, loops;
    and inside fusions, the opcodes that move or reshape data."""
    from _library import hlo_text

    module = hlo_text.parse_hlo_module(text)
    fused = set()
    for instructions in module.computations.values():
        for ins in instructions:
            if ins.opcode == "fusion":
                fused.update(ins.called())
    top: collections.Counter = collections.Counter()
    inner: collections.Counter = collections.Counter()
    for comp, instructions in module.computations.items():
        for ins in instructions:
            (inner if comp in fused else top)[ins.opcode] += 1
    names = ("convert", "transpose", "copy", "pad", "slice", "dynamic-slice")
    names += ("dynamic-update-slice",)
    out = {f"top {k}": top[k] for k in ("fusion", "custom-call", "copy", "transpose", "while")}
    out |= {f"fused {k}": inner[k] for k in names}
    out["collectives"] = sum(
        n for op, n in (top + inner).items() if op.removesuffix("-start") in hlo_text.COLLECTIVE_OPS
    )
    return out
