"""`ZeroPPConfig`: the frozen, self-validating description of one ZeRO++ configuration.

Each field decides what one collective sends. `None` for a bit width means that collective
runs unquantized (16-bit values moved as their raw bits); "e4m3" means fp8 values with
float32 block scales (see `zeropp_jax.wire.quant`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from zeropp_jax.wire import quant

WEIGHT_BITS = (None, *quant.FORMATS)
"""The values of `ZeroPPConfig.weight_bits`: None (unquantized) or a key of `quant.FORMATS`."""
GRAD_BITS = WEIGHT_BITS
"""The values of `ZeroPPConfig.grad_bits`: the same as `WEIGHT_BITS`."""
SAME = "same"
"""A per-hop format field with this value uses the format of the first hop."""
COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
KERNELS = ("auto", "xla", "pallas", "pallas_interpret")

GRAD_REDUCE = ("auto", "ring", "reduce_scatter")
"""The values of `ZeroPPConfig.grad_reduce`."""
ERROR_FEEDBACK = (None, "node", "all")
SHARED_GRAD = ("auto", "once", "per_use")
"""The values of `ZeroPPConfig.shared_grad`."""


def _fail(field: str, value: Any, allowed: str, fix: str = "") -> None:
    msg = f"ZeroPPConfig.{field}={value!r} is not allowed; expected {allowed}."
    if fix:
        msg += f" {fix}"
    raise ValueError(msg)


_FORMATS_FIX = "The formats are the keys of zeropp_jax.wire.quant.FORMATS; None runs unquantized."


def _check_bits(field: str, value: Any, allowed: tuple[int | str | None, ...]) -> None:
    # An int (not a bool, not a float such as 8.0 that compares equal), a format name or None.
    if value is not None and (isinstance(value, bool) or not isinstance(value, int | str)):
        _fail(field, value, f"one of {allowed} (an int, a format name or None)", _FORMATS_FIX)
    if value not in allowed:
        _fail(field, value, f"one of {allowed}", _FORMATS_FIX)


def _check_block_size(field: str, value: Any, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % 8:
        _fail(
            field,
            value,
            "a positive int that is a multiple of 8 (so 2-, 4- and 8-bit values pack into "
            "whole bytes)",
            "Typical values are 64, 128, 256 or 512.",
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ZeroPPConfig:
    """What each ZeRO++ collective sends. Defaults are the paper's ZeRO++.

    The per-hop fields accept "same" (or None for a block size); the properties
    `weight_stage2_bits`, `grad_hop2_bits` and `grad_hop2_block_size` give each hop's
    resolved format, which is what everything below the config reads.

    Attributes:
      weight_bits: qwZ. Format of the weight all-gathers (bits per value, or an fp8 format;
        a key of `quant.FORMATS`), or None to gather unquantized in `compute_dtype`.
      weight_block_size: values per quantization block (one float32 scale each) on the
        weight gathers.
      weight_local_bits: format of the second (intra-node, `local`) stage of the hpZ
        gather. "same" (default) gathers the stage-1 secondary shard as it is; any other
        value (a format of `quant.FORMATS`, or None) dequantizes the secondary shard and
        re-quantizes it for stage 2, which adds a second quantization event on every
        weight value. Needs `hierarchical=True`.
      weight_delta_bits: send weight deltas across nodes instead of weights (beyond
        ZeRO++; see `zeropp_jax.wire._delta`). None (default) gathers the full quantized weights
        every step. A format of `quant.FORMATS` (4 is the intended one) keeps each device's
        secondary shard across steps as a reference in the train state and sends, across
        nodes, only the block-quantized difference between the new master shard and that
        reference (blocks of `weight_block_size`); sender and receivers apply the same
        dequantized delta, so they never drift. The reference is built with one full
        `weight_bits` gather at `TrainState.create` and after a checkpoint restore. Stage 2
        (over `local`) sends the reference in `weight_local_bits` ("same": `weight_bits`).
        Needs `hierarchical=True`.
      hierarchical: hpZ. Keep a secondary weight shard inside each node so the backward
        weight gather runs over the `local` axis only. False re-gathers over all devices.
      grad_bits: qgZ. Format of the two-hop gradient reduction (a key of `quant.FORMATS`),
        or None for an unquantized reduce-scatter.
      grad_block_size: values per quantization block on the gradient reduction (hop 1).
      grad_node_bits: format of gradient hop 2 (across nodes): a format of `quant.FORMATS`
        or None; "same" (default) uses `grad_bits`. E.g. `grad_bits=8, grad_node_bits=4` moves
        int8 inside a node and packed int4 across nodes.
      grad_node_block_size: values per quantization block on gradient hop 2; None
        (default) uses `grad_block_size`. Hop 2 then re-blocks the partial sums (blocks
        never straddle two devices' pieces).
      error_feedback: error feedback on the gradient hops (beyond ZeRO++; see
        `zeropp_jax.wire._feedback`). None (default): off. "node": the device that quantizes a
        partial sum for the cross-node hop keeps what the quantization lost and adds it to
        the next step's partial sum (memory: a float32 buffer of `num_nodes/N` of the
        model per device). "all": also on the intra-node hop, for each device's own
        gradient (memory: a float32 copy of the whole model per device). The residuals
        travel as the gradient of `state.params["zeropp_error_feedback"]`, which
        `apply_gradients` takes out before the optimizer; see the docs' concepts page.
        Needs the two-hop reduction with that hop quantized.
      grad_rotation: rotate what gradient hop 1 (over `local`) quantizes with a block
        Hadamard rotation (beyond ZeRO++, as SDP4Bit does; see `zeropp_jax.wire._rotation`), and
        rotate the float32 sum back after the hop. It spreads a block's outliers over the
        block, so the block's quantization step shrinks; each value is still quantized
        once per hop and the wire bytes do not change. Needs `grad_bits`. The rotation
        runs as XLA operations beside the quantizer, with either `kernels` choice: the
        Pallas kernels quantize the rotated blocks, they do not fuse the rotation.
      grad_node_rotation: the same for gradient hop 2 (over `node`); "same" (default)
        follows `grad_rotation`. Needs the hop quantized (`grad_node_bits`). With error
        feedback the residual is what the rotated quantization lost, rotated back.
      grad_rotation_block_size: values per rotation block, a power of two that divides
        the quantization block size of every rotated hop; None (default) rotates each
        whole quantization block (the hop's block size must then be a power of two).
        A piece smaller than a block uses a smaller block (see
        `wire.effective_block_size`) and rotates within it.
      error_feedback_decay: factor on the residual carried to the next step (LoCo's decay),
        in (0, 1]; 1 is plain error feedback.
      error_feedback_reset: zero the residuals every this many steps; 0 (default) never.
      stochastic_rounding: round the gradient hops stochastically (unbiased) instead of to
        nearest. The noise comes from a counter-based key: `rounding_seed`, the step, the
        device, the parameter leaf and the hop, so a run is reproducible. Needs a quantized
        gradient hop.
      rounding_seed: base seed of the stochastic-rounding keys.
      compute_dtype: dtype the model runs in (weights are gathered into it). Master weights
        and optimizer state stay float32.
      kernels: implementation of quantize/dequantize: "xla" (plain jnp), "pallas" (the
        kernels in `pallas_kernels`, GPU only), "pallas_interpret" (the same kernels in
        Pallas interpret mode, for CPU tests), or "auto" (Pallas on GPU, XLA elsewhere).
      grad_reduce: how an unquantized 16-bit flat gradient reduction (ZeRO-3's) runs:
        "reduce_scatter" (one `lax.psum_scatter` in the compute dtype, what NCCL runs on
        GPUs), "ring" (a ring of `G - 1` collective-permutes moving the 16-bit partial sums
        as raw bits, for a fair CPU wire: XLA:CPU would widen a bfloat16 reduce-scatter to
        float32) or "auto" (ring on CPU, reduce_scatter elsewhere). The ledger shows which
        ran (collective-permutes or a reduce-scatter). No effect on quantized or two-hop
        reductions.
      prefetch: gather each weight one use ahead: an unrolled model's next weight is
        gathered while the current one computes, a scan's layer i + 1 while layer i
        computes (forward), so a GPU can overlap the communication with compute. Costs at
        most one more layer of full weights in flight. False gathers each weight just
        before its use.
      shared_grad: how the gradient of a weight read by several equations (a tied
        embedding: the input lookup and the output head) is reduced. "once" sums the
        uses' full-size gradients on each device and reduces the sum once, so the first
        use's gradient (the head's, at the start of the backward) is held, in the compute
        dtype, until the last use's (the lookup's, at its end). "per_use" reduces each
        use's gradient as soon as it is made and holds nothing full-size: a memory saving
        of that weight's size in the compute dtype through the whole backward, for one
        more gradient reduction of the weight per extra use (more gradient bytes, shown
        in the ledger, and one more quantization event on that weight's gradient with
        qgZ); incompatible with `error_feedback`. "auto" (default) picks per weight:
        "per_use" where holding its gradient whole would cost more than
        `choices.PER_USE_ABOVE` (a fifth) of the device's stored master weights (a large
        vocabulary on a large mesh), else "once"; always "once" with `error_feedback`.
        `choices.per_use_leaves` says which weights run "per_use"; the trainer prints it.
      skip_nonfinite_updates: if True, a step whose gradients hold NaN or Inf leaves the
        parameters and optimizer state unchanged (the step counter and a skipped-step
        counter still advance) instead of writing non-finite values into the master weights.
    """

    weight_bits: int | str | None = 8
    weight_block_size: int = 256
    hierarchical: bool = True
    grad_bits: int | str | None = 4
    grad_block_size: int = 256
    compute_dtype: Any = jnp.bfloat16
    kernels: str = "auto"
    grad_reduce: str = "auto"
    prefetch: bool = True
    shared_grad: str = "auto"
    skip_nonfinite_updates: bool = False
    weight_local_bits: int | str | None = SAME
    grad_node_bits: int | str | None = SAME
    grad_node_block_size: int | None = None
    stochastic_rounding: bool = False
    rounding_seed: int = 0
    weight_delta_bits: int | str | None = None
    error_feedback: str | None = None
    error_feedback_decay: float = 1.0
    error_feedback_reset: int = 0
    grad_rotation: bool = False
    grad_node_rotation: bool | str = SAME
    grad_rotation_block_size: int | None = None

    def __post_init__(self) -> None:
        _check_bits("weight_bits", self.weight_bits, WEIGHT_BITS)
        _check_bits("grad_bits", self.grad_bits, GRAD_BITS)
        _check_block_size("weight_block_size", self.weight_block_size)
        _check_block_size("grad_block_size", self.grad_block_size)
        _check_block_size("grad_node_block_size", self.grad_node_block_size, optional=True)
        if self.weight_local_bits != SAME:
            _check_bits("weight_local_bits", self.weight_local_bits, (SAME, *WEIGHT_BITS))
            if not self.hierarchical:
                _fail(
                    "weight_local_bits",
                    self.weight_local_bits,
                    f"{SAME!r} when hierarchical=False",
                    "The second gather stage exists only with hpZ; set hierarchical=True.",
                )
        _check_bits("weight_delta_bits", self.weight_delta_bits, WEIGHT_BITS)
        if self.weight_delta_bits is not None and not self.hierarchical:
            _fail(
                "weight_delta_bits",
                self.weight_delta_bits,
                "None when hierarchical=False",
                "The weight delta is taken against the kept secondary shard, which exists "
                "only with hpZ; set hierarchical=True.",
            )
        self._check_error_feedback()
        self._check_rotation()
        if self.grad_node_bits != SAME:
            _check_bits("grad_node_bits", self.grad_node_bits, (SAME, *GRAD_BITS))
        if not isinstance(self.stochastic_rounding, bool):
            _fail("stochastic_rounding", self.stochastic_rounding, "True or False")
        if isinstance(self.rounding_seed, bool) or not isinstance(self.rounding_seed, int):
            _fail("rounding_seed", self.rounding_seed, "an int")
        if self.stochastic_rounding and self.grad_bits is None and self.grad_hop2_bits is None:
            _fail(
                "stochastic_rounding",
                True,
                "False when no gradient hop is quantized (grad_bits and grad_node_bits None)",
                "Set grad_bits (or grad_node_bits) to a format.",
            )
        if not isinstance(self.hierarchical, bool):
            _fail("hierarchical", self.hierarchical, "True or False")
        if not isinstance(self.prefetch, bool):
            _fail("prefetch", self.prefetch, "True or False")
        if not isinstance(self.skip_nonfinite_updates, bool):
            _fail("skip_nonfinite_updates", self.skip_nonfinite_updates, "True or False")
        if self.kernels not in KERNELS:
            _fail("kernels", self.kernels, f"one of {KERNELS}")
        if self.grad_reduce not in GRAD_REDUCE:
            _fail("grad_reduce", self.grad_reduce, f"one of {GRAD_REDUCE}")
        if self.shared_grad not in SHARED_GRAD:
            _fail("shared_grad", self.shared_grad, f"one of {SHARED_GRAD}")
        if self.shared_grad == "per_use" and self.error_feedback is not None:
            _fail(
                "shared_grad",
                "per_use",
                "'once' when error_feedback is on",
                "Error feedback keeps one residual per leaf and reduction; set "
                "shared_grad='once' or error_feedback=None.",
            )
        try:
            name = jnp.dtype(self.compute_dtype).name
        except TypeError:
            name = None
        if name not in COMPUTE_DTYPES:
            _fail(
                "compute_dtype",
                self.compute_dtype,
                f"one of {COMPUTE_DTYPES}",
                "Pass e.g. jnp.bfloat16.",
            )
        object.__setattr__(self, "compute_dtype", jnp.dtype(name))

    def _check_error_feedback(self) -> None:
        if self.error_feedback not in ERROR_FEEDBACK:
            _fail("error_feedback", self.error_feedback, f"one of {ERROR_FEEDBACK}")
        decay = self.error_feedback_decay
        if isinstance(decay, bool) or not isinstance(decay, int | float) or not 0 < decay <= 1:
            _fail("error_feedback_decay", decay, "a number in (0, 1]")
        reset = self.error_feedback_reset
        if isinstance(reset, bool) or not isinstance(reset, int) or reset < 0:
            _fail("error_feedback_reset", reset, "an int >= 0 (0: never reset)")
        if self.error_feedback is None:
            return
        hop2 = self.grad_hop2_bits
        if self.error_feedback == "node" and hop2 is None:
            _fail(
                "error_feedback",
                "node",
                "None when the cross-node gradient hop is unquantized",
                "Set grad_node_bits (or grad_bits) to a format.",
            )
        if self.grad_bits is None and hop2 is None:
            _fail(
                "error_feedback",
                self.error_feedback,
                "None when no gradient hop is quantized",
                "Set grad_bits (or grad_node_bits) to a format.",
            )

    def _check_rotation(self) -> None:
        if not isinstance(self.grad_rotation, bool):
            _fail("grad_rotation", self.grad_rotation, "True or False")
        if self.grad_node_rotation != SAME and not isinstance(self.grad_node_rotation, bool):
            _fail("grad_node_rotation", self.grad_node_rotation, f"True, False or {SAME!r}")
        size = self.grad_rotation_block_size
        if size is not None and (
            isinstance(size, bool) or not isinstance(size, int) or size < 2 or size & (size - 1)
        ):
            _fail(
                "grad_rotation_block_size",
                size,
                "None or a power of two >= 2 (the Hadamard matrix exists for those sizes)",
                "Typical values are 64, 128 or 256.",
            )
        hop2 = self.grad_node_rotation if self.grad_node_rotation != SAME else self.grad_rotation
        if size is not None and not (self.grad_rotation or hop2):
            _fail(
                "grad_rotation_block_size",
                size,
                "None when no gradient hop rotates",
                "Set grad_rotation=True (or grad_node_rotation=True), or leave the size None.",
            )
        hops = (
            ("grad_rotation", self.grad_rotation, self.grad_bits, "grad_bits"),
            ("grad_node_rotation", hop2, self.grad_hop2_bits, "grad_node_bits"),
        )
        for field, on, fmt, fmt_field in hops:
            if on and fmt is None:
                _fail(
                    field,
                    True,
                    f"False when that hop is unquantized ({fmt_field} resolves to None)",
                    f"Give the hop a format ({fmt_field}) or turn its rotation off.",
                )
        blocks = (
            ("grad_block_size", self.grad_rotation, self.grad_block_size),
            ("grad_node_block_size", hop2, self.grad_hop2_block_size),
        )
        for field, on, block in blocks:
            if not on:
                continue
            if size is None and block & (block - 1):
                _fail(
                    field,
                    block,
                    "a power of two when its hop rotates whole blocks "
                    "(grad_rotation_block_size=None)",
                    "Use e.g. 64, 128 or 256, or set grad_rotation_block_size to a power of "
                    "two that divides it.",
                )
            if size is not None and block % size:
                _fail(
                    field,
                    block,
                    f"a multiple of grad_rotation_block_size={size} when its hop rotates",
                    "Rotation blocks sit inside quantization blocks; pick sizes that divide.",
                )

    @classmethod
    def zero3(cls, **overrides: Any) -> ZeroPPConfig:
        """Plain ZeRO-3: unquantized flat gathers and reduce-scatter, no secondary shard."""
        fields = dict(weight_bits=None, hierarchical=False, grad_bits=None)
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def beyond(cls, **overrides: Any) -> ZeroPPConfig:
        """Beyond ZeRO++: half ZeRO++'s bytes on the node link, within 1% of ZeRO-3's loss
        on both seeds of the 4.8M-parameter study (1.3-2.3% above ZeRO++'s there).

        ZeRO++ (int8 weight gathers, hpZ, int4 two-hop gradients, no rotation) with int2
        weight deltas across nodes against the kept secondary shard: one full int8 gather
        at `TrainState.create` and after a restore onto another mesh, then only the
        block-quantized change of each step; the intra-node stage re-sends the reference
        in int8. On the emulated two-node cluster's link this sends about half of
        ZeRO++'s bytes (0.196 M per node link for the trainer's GPT against 0.384 M);
        the docs' concepts page has the measured bytes, speed and loss.
        """
        fields = dict(
            weight_bits=8,
            weight_delta_bits=2,
            hierarchical=True,
            grad_bits=4,
            grad_node_bits=SAME,
            grad_rotation=False,
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def muon(cls, **overrides: Any) -> ZeroPPConfig:
        """ZeRO++ for Muon: ZeRO++ (int8 weight gathers, hpZ) with int8 gradients on both
        hops instead of int4.

        Muon's Newton-Schulz gives every direction of an update the same weight, the
        int4 quantization noise in its small ones included: on the trainer's GPT (800
        steps, 2 x 4) ZeRO++'s int4 gradients cost Muon 4.5% in validation loss against
        XLA FSDP, int4 on the cross-node hop alone 3.0%; int8 on both hops stays within
        0.12% on two seeds, at 0.13 M more per node link (the backward's gradient bytes
        double). Pair it with `zeropp_jax.muon`, whose update gathers each matrix once
        (docs/concepts.md, "Muon"; the runs: experiments/RESULTS.md).
        """
        fields = dict(weight_bits=8, hierarchical=True, grad_bits=8, grad_node_bits=SAME)
        fields.update(overrides)
        return cls(**fields)

    def replace(self, **changes: Any) -> ZeroPPConfig:
        """A copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)

    @property
    def grad_hop2_bits(self) -> int | str | None:
        """Format of gradient hop 2 (`grad_node_bits`, with "same" resolved)."""
        return self.grad_bits if self.grad_node_bits == SAME else self.grad_node_bits

    @property
    def grad_hop2_block_size(self) -> int:
        """Values per quantization block on gradient hop 2 (`grad_node_block_size`, with
        None resolved to `grad_block_size`)."""
        if self.grad_node_block_size is None:
            return self.grad_block_size
        return self.grad_node_block_size

    @property
    def grad_hop1_rotation_block_size(self) -> int | None:
        """Rotation block of gradient hop 1: None when `grad_rotation` is off, else
        `grad_rotation_block_size` (None resolved to `grad_block_size`)."""
        if not self.grad_rotation:
            return None
        return self.grad_rotation_block_size or self.grad_block_size

    @property
    def grad_hop2_rotation_block_size(self) -> int | None:
        """Rotation block of gradient hop 2: None when `grad_node_rotation` (with "same"
        resolved to `grad_rotation`) is off, else `grad_rotation_block_size` (None
        resolved to `grad_hop2_block_size`)."""
        on = self.grad_rotation if self.grad_node_rotation == SAME else self.grad_node_rotation
        if not on:
            return None
        return self.grad_rotation_block_size or self.grad_hop2_block_size

    @property
    def weight_stage2_bits(self) -> int | str | None:
        """Format of the second hpZ gather stage (`weight_local_bits`, "same" resolved)."""
        return self.weight_bits if self.weight_local_bits == SAME else self.weight_local_bits

    @property
    def is_zero3(self) -> bool:
        """True when no ZeRO++ technique is on."""
        return (
            self.weight_bits is None
            and self.grad_bits is None
            and self.grad_hop2_bits is None
            and not self.hierarchical
            and self.weight_delta_bits is None
        )
