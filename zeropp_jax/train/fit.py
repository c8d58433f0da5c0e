"""Whether a compiled step fits the devices it will run on: XLA's memory analysis of the
program against what each device has, checked before the first step."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Need:
    """Bytes one device needs to run a compiled program (from `memory_analysis()`)."""

    arguments: int
    outputs: int  # those not aliased to (donated) arguments
    temp: int
    code: int

    @property
    def total(self) -> int:
        return self.arguments + self.outputs + self.temp + self.code


def need_of(compiled: Any) -> Need:
    """The per-device bytes of a `jax.stages.Compiled`: its arguments, the outputs that do not
    reuse a donated argument's buffer, its temporaries and its generated code."""
    m = compiled.memory_analysis()
    return Need(
        arguments=int(m.argument_size_in_bytes),
        outputs=int(m.output_size_in_bytes - m.alias_size_in_bytes),
        temp=int(m.temp_size_in_bytes),
        code=int(m.generated_code_size_in_bytes),
    )


def device_capacity(device: Any, local_devices: int) -> tuple[int, str] | None:
    """`(bytes, where they come from)` one device can hold, or None where it does not say.

    An accelerator reports its own limit (`memory_stats()['bytes_limit']`). Emulated CPU
    devices share the host's physical memory: each gets `1 / local_devices` of it.
    """
    if device.platform == "cpu":
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        share = total // local_devices
        return share, f"{total / GB:.1f} GB of host memory shared by {local_devices} CPU devices"
    stats = device.memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        return None
    return int(limit), f"the memory limit {device.device_kind} reports"


def fit_error(needs: dict[str, Need], capacity: tuple[int, str]) -> str | None:
    """One line saying which program does not fit and how to shrink it, or None if all fit."""
    limit, where = capacity
    name, worst = max(needs.items(), key=lambda kv: kv[1].total)
    if worst.total <= limit:
        return None
    return (
        f"the {name} needs {worst.total / GB:.2f} GB per device (arguments "
        f"{worst.arguments / GB:.2f} GB, temporaries {worst.temp / GB:.2f} GB, by XLA's memory "
        f"analysis) but a device has {limit / GB:.2f} GB ({where}); shrink it with --batch, "
        "--seq-len, --d-model, --n-layers or --model, keep less for the backward with "
        "--remat full, or spread it over more devices (--nodes, --local); "
        "--no-memory-check runs it anyway"
    )
