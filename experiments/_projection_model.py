"""The cost model of `projection.py`: alpha-beta seconds of one training step on a cluster.

What it assumes (the cluster, the rates, the models, the quantization cost, the overlap) is
set out in `projection.py`'s docstring. Volumes come in as `volume_table.ledger_terms`
carried to the target mesh (`projection.rescale_terms`), in units of M.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import volume_table as vt  # sets up the emulated CPU devices before jax starts

import zeropp_jax as zpp

GBPS = (100, 200, 400, 800)
TOKENS = (1024, 2048)


@dataclasses.dataclass(frozen=True)
class PaperModel:
    """A model size of the projection (`layers` only sets the message count)."""

    name: str
    params: float
    layers: int
    hidden: int


MODELS = (
    PaperModel("10B", 10e9, 50, 4096),
    PaperModel("18B", 18e9, 40, 6144),
    PaperModel("50B", 50e9, 62, 8192),
    PaperModel("100B", 100e9, 124, 8192),
    PaperModel("138B", 138e9, 76, 12288),
)

REPORTED = {
    100: "about 2x on average, up to 2.16x (reported)",
    400: "1.28-1.36x at 1k tokens/GPU, 1.24-1.29x at 2k (reported)",
}
"""Speedups of ZeRO++ over ZeRO-3 on 384 GPUs as reported: up to 2.16x at 384 GPUs and
about 2x at 100 Gbps, 1.28-1.36x at 400 Gbps (as quoted in the task); 1.24-1.29x at 2k
tokens per GPU at 400 Gbps from DeepSpeed's ZeRO++ blog, which also reports that ZeRO++ at
200 Gbps matches ZeRO-3 at 800 Gbps for the 18B and 138B models."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    """The target cluster and the rates of the model (bandwidths in bytes per second)."""

    num_nodes: int = 24
    local_size: int = 16
    intra_gbytes: float = 100.0
    alpha_inter_us: float = 5.0
    alpha_intra_us: float = 2.0
    link_efficiency: float = 1.0
    tflops: float = 50.0
    quant_gbps: float = 500.0
    flat_as_ring: bool = True

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "flat_as_ring":
                if not isinstance(value, bool):
                    raise ValueError(f"Cluster.flat_as_ring={value!r}; expected True or False.")
            elif not value > 0:
                raise ValueError(f"Cluster.{f.name}={value!r}; expected a positive number.")

    @property
    def devices(self) -> int:
        return self.num_nodes * self.local_size


# ------------------------------------------------------------------------ the model


def term_seconds(
    term: Mapping[str, Any], model_bytes: float, cluster: Cluster, inter_bytes_s: float
) -> float:
    """Bandwidth seconds of one term per step on `cluster` (latency: `latency_seconds`)."""
    axes = tuple(term["axes"])
    if not axes:
        return 0.0
    v = term["M"] * model_bytes
    ll = cluster.local_size
    intra = cluster.intra_gbytes * 1e9
    n = cluster.devices
    if axes == ("local",):
        seconds = v / intra
    elif axes == ("node",):
        seconds = ll * v / inter_bytes_s
    elif term["op"] == "all-to-all" and not cluster.flat_as_ring:
        cross = (n - ll) / (n - 1)
        seconds = max(ll * v * cross / inter_bytes_s, v * (1 - cross) / intra)
    else:  # ring-type collective over all devices in node-major order
        seconds = max(v / inter_bytes_s, v / intra)
    return seconds


def node_crossing_M(terms: Sequence[Mapping[str, Any]], cluster: Cluster) -> float:
    """Bytes through one node's NICs per step, in units of M, as `term_seconds` counts
    them (each GPU's stream for collectives over `node`, one ring's volume for flat ones)."""
    n, ll = cluster.devices, cluster.local_size
    total = 0.0
    for t in terms:
        axes = tuple(t["axes"])
        if "node" not in axes:
            continue
        if axes == ("node",):
            total += ll * t["M"]
        elif t["op"] == "all-to-all" and not cluster.flat_as_ring:
            total += ll * t["M"] * (n - ll) / (n - 1)
        else:
            total += t["M"]
    return total


def latency_seconds(terms: Sequence[Mapping[str, Any]], layers: int, cluster: Cluster) -> float:
    """alpha * messages: one coalesced collective per layer per payload term, G-1 messages."""
    total = 0.0
    for t in terms:
        if t["kind"] != "payload" or not t["axes"] or t["part"] == "other":
            continue
        alpha = cluster.alpha_inter_us if "node" in t["axes"] else cluster.alpha_intra_us
        total += layers * (t["group_size"] - 1) * alpha * 1e-6
    return total


def quant_bytes(config: zpp.ZeroPPConfig, params: float, local_size: int, devices: int) -> float:
    """Bytes the quantization kernels read and write per GPU per step (scales ignored).

    Weights (qwZ): each gather dequantizes the whole model into 16 bits (read b/8, write 2
    bytes per value) and quantizes the own shard first (read 4, write b/8 per value of the
    shard); forward and backward (with hpZ the backward dequantizes the saved secondary
    shard, without it the shard is quantized again). Gradients (qgZ, two hops): quantize
    the 16-bit gradient (2 + b/8), dequantize-sum the received L pieces into a float32
    slice (b/8 per value in, 4 per value out), quantize that slice (4 + b/8) and
    dequantize-sum the node hop (b/8 in, 4 per output).
    """
    p = params
    total = 0.0
    if config.weight_bits is not None:
        b = config.weight_bits / 8
        dequant = p * (b + 2)
        quant_shard = (p / devices) * (4 + b)
        total += 2 * dequant + (1 if config.hierarchical else 2) * quant_shard
    if config.grad_bits is not None:
        b = config.grad_bits / 8
        total += p * (2 + b) + p * b + 4 * p / local_size  # hop 1
        total += (p / local_size) * (4 + b) + (p / local_size) * b + 4 * p / devices  # hop 2
    return total


def project_step(
    terms: Sequence[Mapping[str, Any]],
    config: zpp.ZeroPPConfig | None,
    model: PaperModel,
    tokens: int,
    gbps: float,
    cluster: Cluster,
) -> dict[str, float]:
    """Seconds of one step: compute, communication (bandwidth + latency), quantization."""
    inter = gbps * 1e9 / 8 * cluster.link_efficiency
    model_bytes = 2 * model.params
    bandwidth = sum(term_seconds(t, model_bytes, cluster, inter) for t in terms)
    latency = latency_seconds(terms, model.layers, cluster)
    compute = 6 * model.params * tokens / (cluster.tflops * 1e12)
    # config None: XLA's FSDP, which quantizes nothing.
    qbytes = (
        0.0
        if config is None
        else quant_bytes(config, model.params, cluster.local_size, cluster.devices)
    )
    quant = qbytes / (cluster.quant_gbps * 1e9)
    comm = bandwidth + latency
    return dict(
        compute_s=compute,
        comm_s=comm,
        latency_s=latency,
        quant_s=quant,
        step_s=compute + quant + comm,
        step_overlap_s=max(compute + quant, comm),
    )


def projection_rows(
    terms_by_variant: Mapping[str, Sequence[Mapping[str, Any]]],
    cluster: Cluster,
    models: Sequence[PaperModel] = MODELS,
    tokens_list: Sequence[int] = TOKENS,
    gbps_list: Sequence[float] = GBPS,
    calibrated_efficiency: float | None = None,
) -> list[dict[str, Any]]:
    """One row per (model, tokens, Gbps): ZeRO-3 and ZeRO++ step times and speedups.

    `terms_by_variant` holds target-mesh terms for "ZeRO-3" and "ZeRO++", and optionally
    for XLA's FSDP (`vt.XLA_FSDP`: then the columns `fsdp_comm_s`, `fsdp_step_s` and
    `speedup_vs_fsdp`). With `calibrated_efficiency`, a column `speedup_calibrated` repeats
    the no-overlap speedup with the inter-node links at that efficiency.
    """
    rows = []
    for model in models:
        for tokens in tokens_list:
            for gbps in gbps_list:
                z3 = project_step(
                    terms_by_variant["ZeRO-3"], vt.VARIANTS["ZeRO-3"], model, tokens, gbps, cluster
                )
                zp = project_step(
                    terms_by_variant["ZeRO++"], vt.VARIANTS["ZeRO++"], model, tokens, gbps, cluster
                )
                rows.append(
                    dict(
                        model=model.name,
                        tokens_per_gpu=tokens,
                        gbps=gbps,
                        compute_s=z3["compute_s"],
                        zero3_comm_s=z3["comm_s"],
                        zeropp_comm_s=zp["comm_s"],
                        zeropp_quant_s=zp["quant_s"],
                        zero3_step_s=z3["step_s"],
                        zeropp_step_s=zp["step_s"],
                        speedup=z3["step_s"] / zp["step_s"],
                        speedup_full_overlap=z3["step_overlap_s"] / zp["step_overlap_s"],
                        zero3_tflops=6 * model.params * tokens / z3["step_s"] / 1e12,
                        zeropp_tflops=6 * model.params * tokens / zp["step_s"] / 1e12,
                        reported=REPORTED.get(int(gbps), ""),
                    )
                )
                if vt.XLA_FSDP in terms_by_variant:
                    fsdp = project_step(
                        terms_by_variant[vt.XLA_FSDP], None, model, tokens, gbps, cluster
                    )
                    rows[-1].update(
                        fsdp_comm_s=fsdp["comm_s"],
                        fsdp_step_s=fsdp["step_s"],
                        speedup_vs_fsdp=fsdp["step_s"] / zp["step_s"],
                    )
                if calibrated_efficiency is not None:
                    slow = dataclasses.replace(cluster, link_efficiency=calibrated_efficiency)
                    cz3, czp = (
                        project_step(terms_by_variant[v], vt.VARIANTS[v], model, tokens, gbps, slow)
                        for v in ("ZeRO-3", "ZeRO++")
                    )
                    rows[-1]["speedup_calibrated"] = cz3["step_s"] / czp["step_s"]
    return rows
