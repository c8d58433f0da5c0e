"""Reading HLO text: instructions, computations, call chains, shapes, replica groups, loops.

Pure text helpers for `zeropp_jax.measure._ledger`. They read both the lowered, pre-optimisation
HLO (`lowered.as_text(dialect='hlo', debug_info=True)`) and compiled HLO
(`compiled.as_text()`, whose names carry a `%`). Only what the ledger needs is parsed: an
instruction's name, shape, opcode, operand names, raw attributes, `op_name` and stack frame.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
import re
from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

COLLECTIVE_OPS = ("all-gather", "reduce-scatter", "all-to-all", "all-reduce", "collective-permute")

_COMMENT_RE = re.compile(r"/\*.*?\*/")
_CALLED_ATTRS = ("to_apply", "calls", "body", "condition", "true_computation", "false_computation")
_ARRAY_RE = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_OP_NAME_RE = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_FRAME_RE = re.compile(r"stack_frame_id=(\d+)")
_MESH_GROUPS_RE = re.compile(
    r"^mesh\[([^\]]*)\](?:,\s*device_ids=\(((?:[^()]|\([^()]*\))*)\))?\s*\{([^}]*)\}$"
)
_IOTA_RE = re.compile(r"^\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?$")

Location = tuple[str, str, int, int]


@dataclasses.dataclass(frozen=True)
class HloInstruction:
    """One parsed HLO instruction (only what the ledger needs)."""

    name: str
    shape: str
    opcode: str
    operands: tuple[str, ...]
    attrs: str
    op_name: str
    frame: int | None

    def attr(self, key: str) -> str | None:
        """The raw value of `key=...` (a name, a `{...}` or `[...]...` group), or None."""
        m = re.search(rf"(?:^|[\s,]){re.escape(key)}=", self.attrs)
        if m is None:
            return None
        rest = self.attrs[m.end() :]
        mesh_form = _MESH_GROUPS_RE.pattern[1:-1]  # mesh[...], device_ids=(...) {axes}
        if rest.startswith("mesh[") and (found := re.match(mesh_form, rest)):
            return found.group(0)
        return _balanced_prefix(rest)

    def called(self) -> tuple[str, ...]:
        """Names of the computations this instruction calls."""
        names = [v.lstrip("%") for k in _CALLED_ATTRS if (v := self.attr(k))]
        branches = self.attr("branch_computations")
        if branches:
            names += [b.strip().lstrip("%") for b in branches.strip("{}").split(",") if b.strip()]
        return tuple(names)


@dataclasses.dataclass(frozen=True)
class HloModule:
    """Computations of an HLO module and its source-location table.

    Attributes:
      computations: `{name: instructions}`, in text order.
      entry: name of the entry computation.
      locations: `{stack_frame_id: (file, function, line, column)}` of each frame's
        innermost location.
    """

    computations: Mapping[str, tuple[HloInstruction, ...]]
    entry: str
    locations: Mapping[int, Location]


def _balanced_prefix(text: str) -> str:
    """The leading token of `text`: up to a top-level `,` or space, brackets balanced."""
    depth = 0
    for i, ch in enumerate(text):
        if ch in "{[(":
            depth += 1
        elif ch in "}])":
            depth -= 1
        elif depth == 0 and ch in ", ":
            return text[:i]
        if depth < 0:
            return text[:i]
    return text


def _split_top(text: str) -> list[str]:
    """Splits on top-level commas."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "{[(":
            depth += 1
        elif ch in "}])":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _closing(text: str, start: int) -> int:
    """Index of the bracket closing the one at `text[start]`."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "{[(":
            depth += 1
        elif text[i] in "}])":
            depth -= 1
            if depth == 0:
                return i
    raise ValueError(f"unbalanced brackets in HLO text: {text[:200]!r}")


def parse_instruction(line: str) -> HloInstruction | None:
    """Parses one HLO instruction line (pre-optimisation or compiled text), else None."""
    text = line.strip()
    if text.startswith("ROOT "):
        text = text[5:]
    name, sep, rest = text.partition(" = ")
    if not sep or " " in name:
        return None
    if rest.startswith("("):
        end = _closing(rest, 0)
        shape, rest = rest[: end + 1], rest[end + 1 :].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    opcode, paren, rest = rest.partition("(")
    if not paren:
        return None
    end = _closing("(" + rest, 0) - 1
    operands = tuple(o.split()[-1].lstrip("%") for o in _split_top(rest[:end]))
    attrs = rest[end + 1 :].lstrip(", ")
    op_name = _OP_NAME_RE.search(attrs)
    frame = _FRAME_RE.search(attrs)
    return HloInstruction(
        name=name.lstrip("%"),
        shape=shape,
        opcode=opcode.strip(),
        operands=operands,
        attrs=attrs,
        op_name=op_name.group(1) if op_name else "",
        frame=int(frame.group(1)) if frame else None,
    )


def parse_hlo_module(text: str) -> HloModule:
    """Parses HLO text (as from `as_text(dialect='hlo', debug_info=True)` or compiled)."""
    computations: dict[str, tuple[HloInstruction, ...]] = {}
    tables: dict[str, dict[int, str]] = collections.defaultdict(dict)
    entry, current, body, section = "", None, [], None
    for raw in text.splitlines():
        line = _COMMENT_RE.sub("", raw).strip()  # compiled HLO marks tuples `/*index=5*/`
        if current is not None:
            if line == "}":
                computations[current] = tuple(body)
                current, body = None, []
            elif (ins := parse_instruction(line)) is not None:
                body.append(ins)
            continue
        if not line:
            section = None
        elif line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            section = line
        elif section is not None:
            key, _, value = line.partition(" ")
            tables[section][int(key)] = value
        elif line.endswith("{") and " = " not in line and not line.startswith("HloModule"):
            head = line[:-1].strip()
            is_entry = head.startswith("ENTRY ")
            current = head.removeprefix("ENTRY ").split()[0].split("(")[0].lstrip("%")
            entry = current if is_entry else entry
    if not entry:
        raise ValueError("parse_hlo_module: no ENTRY computation found in the HLO text.")
    return HloModule(computations, entry, _locations(tables))


def _locations(tables: Mapping[str, Mapping[int, str]]) -> dict[int, Location]:
    def fields(text: str) -> dict[str, str]:
        return dict(kv.split("=", 1) for kv in text.strip("{}").split())

    out = {}
    for frame_id, frame in tables.get("StackFrames", {}).items():
        loc = fields(tables["FileLocations"][int(fields(frame)["file_location_id"])])
        out[frame_id] = (
            tables["FileNames"].get(int(loc["file_name_id"]), "").strip('"'),
            tables["FunctionNames"].get(int(loc["function_name_id"]), "").strip('"'),
            int(loc.get("line", 0)),
            int(loc.get("column", 0)),
        )
    return out


def hlo_dtype_name(hlo_type: str) -> str:
    """Numpy dtype name of an HLO element type: `s8` -> `int8`, `bf16` -> `bfloat16`."""
    if hlo_type == "pred":
        return "bool"
    if hlo_type == "bf16":
        return "bfloat16"
    for prefix, name in (("s", "int"), ("u", "uint"), ("c", "complex")):
        if hlo_type.startswith(prefix) and hlo_type[1:].isdigit():
            return name + hlo_type[1:]
    if hlo_type.startswith("f") and hlo_type[1:].isdigit():
        return "float" + hlo_type[1:]
    m = re.fullmatch(r"f(\d)(e\d+m\d+\w*)", hlo_type)
    if m:
        return f"float{m.group(1)}_{m.group(2)}"
    raise ValueError(f"hlo_dtype_name: unknown HLO element type {hlo_type!r}.")


def array_shapes(shape: str) -> list[tuple[str, int]]:
    """`(dtype name, bytes)` of every array in an HLO shape (tuples flattened; tokens skipped)."""
    out = []
    for hlo_type, dims in _ARRAY_RE.findall(shape):
        if hlo_type == "token":
            continue
        dtype = hlo_dtype_name(hlo_type)
        count = math.prod(int(d) for d in dims.split(",") if d)
        out.append((dtype, count * jnp.dtype(dtype).itemsize))
    return out


def parse_replica_groups(text: str, num_devices: int) -> tuple[tuple[int, ...], ...]:
    """Replica groups from their HLO text.

    Args:
      text: `{{0,1},{2,3}}`, `{}` (one group of all devices), the iota form
        `[G,S]<=[d0,d1,...]` / `[G,S]<=[d0,d1,...]T(p0,p1,...)` (iota over the dims,
        transposed by the permutation, reshaped to G groups of S), or the mesh-axes form
        of compiled HLO, `mesh['a'=2,'b'=4] {'b'}` (one group per position on the axes
        not listed, ordered over the listed axes; the id at a mesh position is the
        position itself, or with `, device_ids=([2,4]T(1,0))` the entry of that iota).
      num_devices: device count, for the `{}` form.

    Returns:
      The groups as tuples of logical device ids.
    """
    text = text.strip()
    m = _IOTA_RE.match(text)
    if m:
        shape = [int(d) for d in m.group(1).split(",")]
        dims = [int(d) for d in m.group(2).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose([int(p) for p in m.group(3).split(",")])
        return tuple(tuple(int(i) for i in g) for g in ids.reshape(shape[0], -1))
    m = _MESH_GROUPS_RE.match(text)
    if m:
        axes = [(name, int(n)) for name, n in re.findall(r"'([^']*)'=(\d+)", m.group(1))]
        names = [name for name, _ in axes]
        listed = re.findall(r"'([^']*)'", m.group(3))
        if any(name not in names for name in listed):
            raise ValueError(f"parse_replica_groups: {text!r} groups over an unknown axis.")
        size = math.prod(n for _, n in axes)
        ids = np.arange(size) if m.group(2) is None else _device_ids(m.group(2), size)
        ids = ids.reshape([n for _, n in axes])
        order = [i for i, n in enumerate(names) if n not in listed]
        order += [names.index(n) for n in listed]
        group = math.prod(axes[names.index(n)][1] for n in listed)
        return tuple(tuple(int(i) for i in g) for g in ids.transpose(order).reshape(-1, group))
    if not (text.startswith("{") and text.endswith("}")):
        raise ValueError(f"parse_replica_groups: cannot read {text!r}.")
    inner = text[1:-1].strip()
    if not inner:
        return (tuple(range(num_devices)),)
    groups = re.findall(r"\{([\d,\s]*)\}", inner)
    return tuple(tuple(int(i) for i in g.split(",") if i.strip()) for g in groups)


def _device_ids(text: str, size: int) -> np.ndarray:
    """Device ids of `device_ids=(...)`: an iota `[d0,d1]T(p0,p1)` or a plain id list."""
    m = re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip())
    if m:
        ids = np.arange(size).reshape([int(d) for d in m.group(1).split(",")])
        if m.group(2):
            ids = ids.transpose([int(p) for p in m.group(2).split(",")])
        return ids.reshape(-1)
    ids = np.array([int(i) for i in text.replace("[", "").replace("]", "").split(",")])
    if ids.size != size:
        raise ValueError(f"parse_replica_groups: device_ids=({text}) do not fill the mesh.")
    return ids


CallPath = tuple[tuple[HloInstruction, str], ...]


def call_paths(module: HloModule) -> dict[str, list[CallPath]]:
    """Every chain of call sites from the entry to each reachable computation.

    Returns:
      `{computation: [((call instruction, calling computation), ...), ...]}`, each chain
      ordered from the entry downwards; the entry maps to one empty chain. Computations
      only reachable as reducers of collectives are left out.
    """
    callers: dict[str, list[tuple[HloInstruction, str]]] = collections.defaultdict(list)
    for comp, instructions in module.computations.items():
        for ins in instructions:
            if ins.opcode.removesuffix("-start") in COLLECTIVE_OPS:
                continue
            for callee in ins.called():
                callers[callee].append((ins, comp))
    memo: dict[str, list[CallPath]] = {module.entry: [()]}

    def paths_to(comp: str) -> list[CallPath]:
        if comp not in memo:
            memo[comp] = [p + (site,) for site in callers.get(comp, ()) for p in paths_to(site[1])]
        return memo[comp]

    return {comp: paths_to(comp) for comp in module.computations if paths_to(comp)}


def scan_trip_count(module: HloModule, loop: HloInstruction, comp: str) -> int | None:
    """Trip count of a scan-shaped `while` in pre-optimisation HLO, else None.

    Recognises the loops `lax.scan` and static `lax.fori_loop` emit: a counter at tuple
    index k that starts at a constant s, grows by constant 1 in the body, and is compared
    `LT` against a constant N in the condition; the count is `max(N - s, 0)`. Sharding
    annotations (`custom-call` to `Sharding`, which a mesh with automatic axes puts on
    the counter, the bound and the increment) are looked through.
    """
    by_name = {i.name: i for i in module.computations[comp]}
    cond = _AnnotationsSkipped(
        {i.name: i for i in module.computations.get(loop.attr("condition") or "", ())}
    )
    body = _AnnotationsSkipped(
        {i.name: i for i in module.computations.get(loop.attr("body") or "", ())}
    )
    if not cond or not body:
        return None
    root_c = list(cond.values())[-1]
    root_b = list(body.values())[-1]
    if root_c.opcode != "compare" or root_c.attr("direction") != "LT":
        return None
    counter, limit = (cond.get(o) for o in root_c.operands)
    if counter is None or limit is None or counter.opcode != "get-tuple-element":
        return None
    if limit.opcode != "constant":
        return None
    k = int(counter.attr("index") or -1)
    init = by_name.get(loop.operands[0])
    if init is None or init.opcode != "tuple" or root_b.opcode != "tuple":
        return None
    start = by_name.get(init.operands[k])
    step = body.get(root_b.operands[k])
    if start is None or start.opcode != "constant" or step is None or step.opcode != "add":
        return None
    step_ops = [body.get(o) for o in step.operands]
    if not any(
        o is not None and o.opcode == "get-tuple-element" and o.attr("index") == str(k)
        for o in step_ops
    ) or not any(
        o is not None and o.opcode == "constant" and o.operands == ("1",) for o in step_ops
    ):
        return None
    return max(int(limit.operands[0]) - int(start.operands[0]), 0)


class _AnnotationsSkipped(dict):
    """Instructions by name, where `get` follows a `Sharding` custom-call to its operand."""

    def get(self, name: str, default: HloInstruction | None = None) -> HloInstruction | None:
        ins = super().get(name, default)
        while (
            ins is not None
            and ins.opcode == "custom-call"
            and ins.attr("custom_call_target") == '"Sharding"'
            and len(ins.operands) == 1
        ):
            ins = super().get(ins.operands[0], default)
        return ins


def known_trip_counts(module: HloModule) -> list[tuple[HloInstruction, int]]:
    """Each `while` of compiled HLO with the `known_trip_count` in its backend config."""
    out = []
    for instructions in module.computations.values():
        for ins in instructions:
            config = ins.attr("backend_config") if ins.opcode == "while" else None
            if not config:
                continue
            try:
                out.append((ins, int(json.loads(config)["known_trip_count"]["n"])))
            except (ValueError, KeyError, TypeError):
                continue
    return out


# ----------------------------------------------------------------- scheduled (compiled) HLO

COMPUTE_OPS = ("fusion", "custom-call", "dot", "convolution", "while", "call", "conditional")
"""Opcodes that do work on a device, as opposed to moving names around (`bitcast`,
`get-tuple-element`, `tuple`, `parameter`, `constant`, `copy`, collectives)."""

_SYNC_RE = re.compile(r'"is_sync"\s*:\s*true')
_GEMM_RE = re.compile(r"gemm|cublas|dot|matmul", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class ScheduledCollective:
    """One collective of a compiled, scheduled HLO module, where it sits in its schedule.

    Attributes:
      op: `'all-gather'`, `'reduce-scatter'`, `'all-to-all'`, `'all-reduce'` or
        `'collective-permute'`.
      computation: the computation it is scheduled in (a loop body, the entry, ...).
      name: the instruction that starts it (the collective itself when synchronous).
      asynchronous: a `-start` / `-done` pair (or `async-start` / `async-done` around the
        collective) that the compiler left asynchronous; False for a plain collective and
        for a pair marked `is_sync` (XLA runs it in line).
      dtypes: numpy names of its operands' element types, each once, in operand order:
        the dtypes it sends.
      shapes: its operands' HLO shapes (per device), in operand order.
      between: names of the compute instructions (`COMPUTE_OPS`) scheduled between its
        start and its done, in schedule order; empty when synchronous.
      matmuls: how many of `between` are matrix multiplications (a `dot`, a GEMM fusion or
        a cuBLAS call).
      op_name: its `op_name` metadata.
      replica_groups: the raw `replica_groups` (or `source_target_pairs`) text.
    """

    op: str
    computation: str
    name: str
    asynchronous: bool
    dtypes: tuple[str, ...]
    shapes: tuple[str, ...]
    between: tuple[str, ...]
    matmuls: int
    op_name: str
    replica_groups: str

    @property
    def overlapped(self) -> bool:
        """Whether the schedule lets compute run while it is in flight."""
        return self.asynchronous and bool(self.between)


def _collective_inside(module: HloModule, ins: HloInstruction) -> HloInstruction | None:
    """The collective an `async-start` wraps (its called computation's), else None."""
    for callee in ins.called():
        for inner in module.computations.get(callee, ()):
            if inner.opcode in COLLECTIVE_OPS:
                return inner
    return None


def _is_matmul(module: HloModule, ins: HloInstruction) -> bool:
    if ins.opcode in ("dot", "convolution"):
        return True
    if ins.opcode == "custom-call":
        return bool(_GEMM_RE.search(ins.attr("custom_call_target") or ""))
    if ins.opcode == "fusion":
        if _GEMM_RE.search(ins.name) or _GEMM_RE.search(ins.attr("backend_config") or ""):
            return True
        return any(
            inner.opcode in ("dot", "convolution")
            for callee in ins.called()
            for inner in module.computations.get(callee, ())
        )
    return False


def scheduled_collectives(module: HloModule) -> list[ScheduledCollective]:
    """Every collective of a compiled, scheduled module (`compiled.as_text()` of a GPU
    program, `is_scheduled=true`), with what is scheduled between its start and its done.

    A scheduled module lists each computation's instructions in the order they run, so
    the compute between a `-start` and its `-done` is what the schedule lets overlap with
    the transfer. This is the overlap the program allows, not a measured time. Collectives
    inside fusions or reducers are not counted (there are none on GPU).

    Raises:
      ValueError: when a `-start` has no matching `-done` in its computation.
    """
    wrapped = {  # the computations async-starts run: their collective is read at the start
        callee
        for instructions in module.computations.values()
        for ins in instructions
        if ins.opcode == "async-start"
        for callee in ins.called()
    }
    out = []
    for comp, instructions in module.computations.items():
        if comp in wrapped:
            continue
        shapes = {i.name: i.shape for i in instructions}
        for k, ins in enumerate(instructions):
            inner = None
            if ins.opcode in COLLECTIVE_OPS:
                op, done_opcode = ins.opcode, None
            elif ins.opcode.removesuffix("-start") in COLLECTIVE_OPS:
                op, done_opcode = ins.opcode.removesuffix("-start"), ins.opcode[:-6] + "-done"
            elif ins.opcode == "async-start" and (inner := _collective_inside(module, ins)):
                op, done_opcode = inner.opcode, "async-done"
            else:
                continue
            between: list[HloInstruction] = []
            if done_opcode is not None:
                chain = {ins.name}  # the start, then any async-update of it
                for later in instructions[k + 1 :]:
                    continues = bool(later.operands) and later.operands[0] in chain
                    if later.opcode == done_opcode and continues:
                        break
                    if later.opcode == "async-update" and continues:
                        chain.add(later.name)
                        continue
                    if later.opcode in COMPUTE_OPS:
                        between.append(later)
                else:
                    raise ValueError(
                        f"scheduled_collectives: {ins.name!r} in {comp!r} has no "
                        f"{done_opcode!r}; expected a scheduled module (compiled.as_text())."
                    )
            synchronous = done_opcode is None or bool(_SYNC_RE.search(ins.attrs))
            dtypes = [
                hlo_dtype_name(t)
                for o in ins.operands
                for t, _ in _ARRAY_RE.findall(shapes.get(o, ""))
                if t != "token"
            ]
            source = inner or ins
            groups = source.attr("replica_groups") or source.attr("source_target_pairs") or ""
            out.append(
                ScheduledCollective(
                    op=op,
                    computation=comp,
                    name=ins.name,
                    asynchronous=not synchronous,
                    dtypes=tuple(dict.fromkeys(dtypes)),
                    shapes=tuple(shapes.get(o, "") for o in ins.operands),
                    between=() if synchronous else tuple(b.name for b in between),
                    matmuls=0 if synchronous else sum(_is_matmul(module, b) for b in between),
                    op_name=ins.op_name or source.op_name,
                    replica_groups=groups,
                )
            )
    return out


def loop_bodies(module: HloModule) -> dict[str, tuple[HloInstruction, int | None]]:
    """`{body computation: (its while instruction, known_trip_count or None)}` of every
    `while` in the module."""
    counts = {ins.name: n for ins, n in known_trip_counts(module)}
    out = {}
    for instructions in module.computations.values():
        for ins in instructions:
            if ins.opcode == "while" and (body := ins.attr("body")):
                out[body.lstrip("%")] = (ins, counts.get(ins.name))
    return out
