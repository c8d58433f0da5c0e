"""Memory per device of the trainer's GPT, from shapes alone: the analytic estimate that
`zeropp-train --plan` and `experiments/memory.py` set beside XLA's memory analysis.

Every term is bytes on one device of an `N = nodes x local` mesh, for a step on `B`
sequences per device of `S` tokens, model width `d`, `L` layers, `h` heads, vocabulary
`V`, a compute dtype of `c` bytes (2 for bfloat16), AdamW behind global-norm clipping:

  state         the master parameters (float32) and the optimizer state, from the state's
                shapes and shardings (AdamW on the engine: 12 Psi_pad / N), plus the batch
  gradients     the reduced gradient, float32, 4 Psi_pad / N, filled in during the backward
  secondary     hpZ: every sharded leaf's secondary shard, held from the forward to the
                backward: (weight bits / 8) Psi_pad / local, plus one float32 scale per
                quantization block (0 without hpZ)
  whole leaves  the leaves outside the blocks (embeddings, final norm): the tied head's
                gradient of the embedding, in the compute dtype, held from the start of
                the backward to its end, c Psi_rest (0 with `shared_grad="per_use"`,
                which reduces it at the head). The lookup's gradient starts only at the
                end (its zeros wait for its cotangent), and the weight itself is not
                held: each use's backward gathers it again and drops it (the forward
                holds it from its first use to its last, before the backward's buffers
                exist)
  whole sum     the lookup's gradient, at the end of the backward, once the blocks and
                the head have freed their buffers: in the compute dtype, c Psi_rest,
                plus one of its n = `GPTConfig.loss_chunks` ranges of rows in float32,
                4 Psi_rest / n (XLA's CPU compiler widens a bfloat16 scatter-add's
                buffer; `embed_lookup`; not on a GPU). The sum with the head's
                gradient is written in place
  saved         what the backward keeps of the forward: remat "full", the L block inputs
                (c B S d each); "matmuls", L blocks' matmul outputs (16 c B S d each);
                "none", L blocks' internals
  block         the backward through one block: its weights gathered in the compute
                dtype (twice with prefetch) and its full float32 weight gradient before it
                is reduced, (c (1 + prefetch) + 4) Psi_block, plus the block's internals,
                17 w B S d + (4 + c) B Q h S (its matmuls', norms' and GELU's inputs and
                outputs in w bytes: c, but 4 on CPU, where XLA computes bfloat16 in
                float32 and keeps the results so; float32 attention scores and
                compute-dtype probabilities of Q queries), plus the softmax's backward,
                float32: the gradients of the probabilities and of the scores, 8 B Q h S.
                Q is `GPTConfig.attn_chunk` (attention in query chunks, one live at a
                time), or S without chunks
  head          the backward through the output head: the embedding gathered again for
                it, c Psi_rest (not for data parallelism, which holds every weight), and
                without vocabulary pieces float32 logits and their gradient, 8 B S V, and
                with `shared_grad="per_use"` also the head's gradient of the table,
                c Psi_rest, reduced when the head's backward ends; in
                `GPTConfig.loss_chunks` = n pieces, one piece's float32 probabilities,
                their gradient and its transpose, its target mask and its rows of the
                table in float32, (12 + 1) B S V / n + 4 Psi_rest / n, plus the float32
                input, input gradient and its update, 12 B S d, where the gradient of
                the table is written over the gathered table piece by piece
                (`head_cross_entropy`): one c Psi_rest, which is the whole leaves' term
                without `per_use`
  update        the optimizer step: the gradient and one float32 temporary of its size
                (XLA fuses clipping, the moments and the update into few passes),
                2 x 4 Psi_pad / N

  total = state + max(gradients + secondary + whole leaves + saved
                      + max(block, head, whole sum), update)

The backward's peak is at the output head, inside the block loop or at its end, whichever
is largest; the update runs after the backward has freed its activations. `Psi_pad` counts the
parameters with the engine's padding, `Psi_block` one layer's share of the stacked leaves,
`Psi_rest` the others. For plain data parallelism `N = 1`, there is no secondary shard and
no gather, and the compute-dtype copy of every weight is held throughout. What the
estimate leaves out: XLA's small temporaries, and whatever XLA's scheduler keeps alive
longer than the data dependencies need.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from zeropp_jax import _choices as choices
from zeropp_jax._config import ZeroPPConfig
from zeropp_jax.train.model import GPTConfig

FLOAT = 4
GB = 1e9


class _Unset:
    """The default of an `estimate` keyword that a `ZeroPPConfig` may supply instead."""

    def __repr__(self) -> str:
        return "<unset>"


_UNSET: Any = _Unset()

_CONFIG_DEFAULTS: dict[str, Any] = dict(
    weight_bits=None, weight_block_size=256, hierarchical=False, prefetch=True, per_use_reduce=False
)
"""The `estimate` keywords a `ZeroPPConfig` supplies, and their values without one."""


def _config_fields(config: ZeroPPConfig) -> dict[str, Any]:
    """The `estimate` keywords of an engine configuration."""
    return dict(
        weight_bits=config.weight_bits,
        weight_block_size=config.weight_block_size,
        hierarchical=config.hierarchical,
        prefetch=config.prefetch,
        # "auto" is decided in `estimate`, from the table's size and the mesh.
        per_use_reduce=None if config.shared_grad == "auto" else config.shared_grad == "per_use",
    )


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Per-device bytes of one training step, term by term (see the module docstring)."""

    state: int
    gradients: int
    secondary: int
    whole_leaves: int
    whole_sum: int
    saved: int
    block: int
    head: int
    update: int

    @property
    def backward(self) -> int:
        """The backward's peak above the state."""
        held = self.gradients + self.secondary + self.whole_leaves + self.saved
        return held + max(self.block, self.head, self.whole_sum)

    @property
    def total(self) -> int:
        return self.state + max(self.backward, self.update)

    def rows(self) -> list[tuple[str, int]]:
        """`(term, bytes)` for each term, then the backward's peak and the total."""
        return [
            *dataclasses.asdict(self).items(),
            ("backward", self.backward),
            ("total", self.total),
        ]


def state_bytes(state: Any) -> int:
    """Bytes of `state`'s array leaves on one device, from their shapes and shardings
    (arrays or `jax.ShapeDtypeStruct`s with a `NamedSharding`)."""
    import jax
    import numpy as np

    total = 0
    for x in jax.tree_util.tree_leaves(state):
        if not hasattr(x, "shape") or not hasattr(x, "sharding"):
            continue
        local = x.sharding.shard_shape(tuple(x.shape))
        total += math.prod(local) * np.dtype(x.dtype).itemsize
    return total


def attention_rows(gpt: GPTConfig, seq: int) -> int:
    """Queries whose scores are live at once: `gpt.attn_chunk`, or the whole sequence."""
    return gpt.attn_chunk if 0 < gpt.attn_chunk < seq else seq


def internal_bytes_for(platform: str, compute_bytes: int) -> int:
    """Bytes per value of a block's internals on `platform`: XLA's CPU compiler computes
    16-bit matmuls and elementwise ops in float32 and keeps their results so (4); other
    platforms keep the compute dtype."""
    return FLOAT if platform == "cpu" else compute_bytes


def block_internals(gpt: GPTConfig, batch: int, seq: int, c: int, w: int | None = None) -> int:
    """One block's activations for `batch` sequences of `seq` tokens, its matmuls' and
    elementwise values in `w` bytes (default `c`; module docstring)."""
    d, h, q = gpt.d_model, gpt.n_heads, attention_rows(gpt, seq)
    w = c if w is None else w
    return batch * seq * 17 * w * d + batch * q * (FLOAT + c) * h * seq


def head_bytes(
    gpt: GPTConfig,
    batch: int,
    seq: int,
    c: int,
    rest: int,
    *,
    replicated: bool = False,
    per_use: bool = False,
) -> int:
    """The backward through the output head (module docstring); `per_use`: the head's
    gradient of the table is reduced at the head (`shared_grad="per_use"`)."""
    n, tokens = gpt.loss_chunks, batch * seq
    table = 0 if replicated else c * rest
    if n == 1:  # the gathered table, per use its gradient beside it, the whole logits
        return table * (2 if per_use else 1) + 2 * FLOAT * tokens * gpt.vocab_size
    # In pieces the gradient is written over the gathered table: per use that one buffer;
    # otherwise it is the whole leaves' term.
    per_piece = (3 * FLOAT + 1) * tokens * gpt.vocab_size // n + FLOAT * rest // n
    return (table if per_use else 0) + per_piece + 3 * FLOAT * tokens * gpt.d_model


def saved_bytes(gpt: GPTConfig, batch: int, seq: int, c: int, w: int | None = None) -> int:
    """What the backward keeps of the forward, by `gpt.remat` (module docstring)."""
    if gpt.remat == "full":
        return gpt.n_layers * c * batch * seq * gpt.d_model
    if gpt.remat == "matmuls":
        return gpt.n_layers * 16 * c * batch * seq * gpt.d_model
    return gpt.n_layers * block_internals(gpt, batch, seq, c, w)


def estimate(
    gpt: GPTConfig,
    *,
    state: Any,
    layouts: Any,
    batch: int,
    seq: int,
    mesh_shape: tuple[int, int],
    compute_bytes: int = 2,
    config: ZeroPPConfig | None = None,
    weight_bits: int | None = _UNSET,
    weight_block_size: int = _UNSET,
    hierarchical: bool = _UNSET,
    prefetch: bool = _UNSET,
    replicated: bool = False,
    per_use_reduce: bool = _UNSET,
    internal_bytes: int | None = None,
    platform: str | None = None,
) -> Estimate:
    """The analytic per-device memory of one training step of `GPT(gpt)`.

    Args:
      gpt: the model's shape (its `remat` picks the activations term).
      state: the train state (or its `jax.ShapeDtypeStruct`s): its per-device bytes are
        the state term.
      layouts: the engine's `LeafLayout`s, in leaf order (`state.layouts[1]`); None for
        a state that is not the engine's (the parameter counts then come from `gpt`).
      batch: sequences per device.
      seq: tokens per sequence.
      mesh_shape: `(nodes, local)`.
      compute_bytes: bytes per value of the compute dtype.
      config: the engine's configuration; it supplies `weight_bits`,
        `weight_block_size`, `hierarchical`, `prefetch` and `per_use_reduce`
        (`shared_grad="per_use"`), which are then not to be given. None: those
        keywords, or their defaults (a state that is not the engine's).
      weight_bits: bits of the weight gathers (None: the compute dtype). Default None.
      weight_block_size: values per quantization block of the weight gathers.
        Default 256.
      hierarchical: hpZ (a secondary shard per leaf). Default False.
      prefetch: the next layer's weights are gathered while this one runs. Default True.
      replicated: plain data parallelism (every device holds everything).
      per_use_reduce: `ZeroPPConfig.shared_grad="per_use"`: the tied embedding's
        gradient is reduced per use, so the head's is not held through the backward.
        Default False.
      internal_bytes: bytes per value of a block's matmul outputs and elementwise values
        (None: `internal_bytes_for(platform)`, or `compute_bytes` without a platform).
      platform: the platform XLA compiles for (`jax.default_backend()`, e.g. "cpu" or
        "gpu"). Besides the internals' width it decides the lookup gradient's sum: XLA's
        CPU compiler widens that bfloat16 scatter-add's buffer to float32 (one range of
        rows at a time), a GPU keeps it in the compute dtype. None: as on the CPU.

    Returns:
      The estimate, term by term.

    Raises:
      TypeError: `config` given together with a keyword it supplies.
    """
    from zeropp_jax.train.model import param_count

    given = dict(
        weight_bits=weight_bits,
        weight_block_size=weight_block_size,
        hierarchical=hierarchical,
        prefetch=prefetch,
        per_use_reduce=per_use_reduce,
    )
    given = {k: v for k, v in given.items() if v is not _UNSET}
    if config is not None and given:
        raise TypeError(
            f"estimate() got config and {', '.join(given)}: a ZeroPPConfig supplies "
            f"{', '.join(_CONFIG_DEFAULTS)}. Pass either config or those keywords, not both."
        )
    fields = _config_fields(config) if config is not None else {**_CONFIG_DEFAULTS, **given}
    weight_bits, weight_block_size = fields["weight_bits"], fields["weight_block_size"]
    hierarchical, prefetch = fields["hierarchical"], fields["prefetch"]
    per_use_reduce = fields["per_use_reduce"]
    nodes, local = mesh_shape
    n = 1 if replicated else nodes * local
    c = compute_bytes
    if internal_bytes is None and platform is not None:
        internal_bytes = internal_bytes_for(platform, c)
    if layouts is not None:
        padded = sum(lo.padded_size for lo in layouts if lo.sharded)
        block_params = sum(lo.padded_size // lo.lead for lo in layouts if lo.stacked)
        rest = sum(lo.size for lo in layouts if lo.sharded and not lo.stacked)
    else:
        padded = param_count(gpt)
        rest = (gpt.vocab_size + gpt.seq_len + 2) * gpt.d_model
        block_params = (padded - rest) // gpt.n_layers
    if per_use_reduce is None:  # shared_grad="auto": as `choices.per_use_leaves` decides
        table = gpt.vocab_size * gpt.d_model
        per_use_reduce = config.error_feedback is None and (
            c * table > choices.PER_USE_ABOVE * FLOAT * padded / n
        )
    secondary = 0
    if hierarchical and not replicated:
        bits = 8 * c if weight_bits is None else weight_bits
        scales = FLOAT * padded // weight_block_size if weight_bits is not None else 0
        secondary = (bits * padded // 8 + scales) // local
    inner = block_internals(gpt, batch, seq, c, internal_bytes)
    softmax = 2 * FLOAT * batch * attention_rows(gpt, seq) * gpt.n_heads * seq
    if replicated:
        block, whole = inner + softmax, c * padded + c * rest
    else:
        block = (c * (2 if prefetch else 1) + FLOAT) * block_params + inner + softmax
        whole = 0 if per_use_reduce else c * rest
    head = head_bytes(gpt, batch, seq, c, rest, replicated=replicated, per_use=per_use_reduce)
    return Estimate(
        state=state_bytes(state) + FLOAT * batch * (seq + 1),
        gradients=FLOAT * padded // n,
        secondary=secondary,
        whole_leaves=whole,
        whole_sum=c * rest + (FLOAT * rest // gpt.loss_chunks if platform in (None, "cpu") else 0),
        saved=saved_bytes(gpt, batch, seq, c, internal_bytes),
        block=block,
        head=head,
        update=2 * FLOAT * padded // n,
    )
