"""A small decoder-only GPT in Flax linen, and its next-token loss.

Pre-LayerNorm blocks, causal multi-head self-attention, a learned position embedding and
an output head tied to the token embedding (GPT-2 style: the logits are
`h @ embedding.T`; one `(vocab, d_model)` matrix serves both ends, which keeps the
byte-level model small).

The model computes in the dtype of the parameters it is given: the ZeRO++ engine hands it
weights already gathered in the compute dtype (bfloat16 by default), so nothing here casts
weights. Attention scores, softmax, LayerNorm statistics, the logits and the loss run in
float32.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

REMAT = ("none", "matmuls", "full")
"""The values of `GPTConfig.remat`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the GPT.

    Attributes:
      vocab_size: number of token ids (256 for byte-level text).
      seq_len: longest sequence the learned position embedding covers.
      d_model: width of the residual stream.
      n_layers: number of transformer blocks.
      n_heads: attention heads per block; must divide `d_model`.
      mlp_ratio: hidden width of the MLP as a multiple of `d_model`.
      scan: run the blocks as one `nn.scan` over stacked weights (each leaf of the blocks
        gets a leading layer axis, as MaxText and levanter lay out LLMs) instead of
        `n_layers` separately named blocks.
      remat: what the backward pass keeps of each block's forward (`nn.remat` around the
        block): "none" keeps everything (no rematerialisation), "matmuls" keeps the matmul
        outputs and recomputes the rest (`jax.checkpoint_policies.dots_saveable`), "full"
        keeps only the block's input and recomputes the block.
      model_parallel: annotate the blocks for tensor parallelism on the mesh's `model`
        axis (Megatron-style, `nn.with_partitioning`): the attention's `qkv` and the MLP's
        `fc` split by column (whole heads per rank: `qkv`'s columns are ordered head by
        head, each head's q, k, v together), their output matrices `proj` and `out` by
        row, and the token embedding (so the tied head) by vocabulary. Without a `model`
        axis of size > 1 the annotations change nothing but that column order.
    """

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    scan: bool = False
    remat: str = "none"
    model_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("scan", "model_parallel"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"GPTConfig.{name}={getattr(self, name)!r}; expected True or False."
                )
        if self.remat not in REMAT:
            raise ValueError(f"GPTConfig.remat={self.remat!r}; expected one of {REMAT}.")
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r}; expected a positive int.")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig: n_heads={self.n_heads} does not divide d_model={self.d_model}; "
                "pick n_heads among the divisors of d_model."
            )


COLUMN = ((None, "model"), ("model",))
"""`nn.with_partitioning` names of a column-parallel Dense: kernel, bias."""
ROW = (("model", None), None)
"""`nn.with_partitioning` names of a row-parallel Dense: kernel, bias (replicated)."""


VOCAB_SPLIT = ("model", None)
"""`nn.with_partitioning` names of the token embedding (and tied head): split by vocabulary."""


def _dense(
    features: int,
    std: float,
    name: str,
    split: tuple[tuple | None, tuple | None] | None = None,
) -> nn.Dense:
    """A Dense with normal(std) kernel init; `split` (`COLUMN`, `ROW`) annotates its kernel
    and bias for tensor parallelism."""
    kernel_init, bias_init = nn.initializers.normal(std), nn.initializers.zeros_init()
    if split is not None:
        kernel_names, bias_names = split
        kernel_init = nn.with_partitioning(kernel_init, kernel_names)
        if bias_names is not None:
            bias_init = nn.with_partitioning(bias_init, bias_names)
    return nn.Dense(features, kernel_init=kernel_init, bias_init=bias_init, name=name)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        batch, seq, width = x.shape
        head_dim = width // cfg.n_heads
        tp = cfg.model_parallel
        qkv = _dense(3 * width, 0.02, "qkv", COLUMN if tp else None)(x)
        if tp:  # columns head by head, so that whole heads sit on each `model` rank
            q, k, v = jnp.unstack(qkv.reshape(batch, seq, cfg.n_heads, 3, head_dim), axis=3)
        else:
            q, k, v = jnp.split(qkv.reshape(batch, seq, 3 * cfg.n_heads, head_dim), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        scores = scores / math.sqrt(head_dim)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, seq, width)
        return _dense(width, 0.02 / math.sqrt(2 * cfg.n_layers), "proj", ROW if tp else None)(out)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        tp = cfg.model_parallel
        x = x + CausalSelfAttention(cfg, name="attn")(nn.LayerNorm(name="ln_attn")(x))
        h = nn.LayerNorm(name="ln_mlp")(x)
        h = nn.gelu(_dense(cfg.mlp_ratio * cfg.d_model, 0.02, "fc", COLUMN if tp else None)(h))
        out = _dense(cfg.d_model, 0.02 / math.sqrt(2 * cfg.n_layers), "out", ROW if tp else None)
        return x + out(h)


class ScannedBlock(nn.Module):
    """`Block` with the `(carry, xs) -> (carry, ys)` signature of `nn.scan`."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        return Block(self.config, name="block")(x), None


def _remat(block: type[nn.Module], remat: str, *, scanned: bool) -> type[nn.Module]:
    """`block` under `nn.remat` with the policy `remat` names ("none": `block` itself).
    Inside a scan the loop already keeps XLA from merging the recomputation with the
    forward, so CSE prevention is off there (as flax recommends)."""
    if remat == "none":
        return block
    policy = jax.checkpoint_policies.dots_saveable if remat == "matmuls" else None
    return nn.remat(block, policy=policy, prevent_cse=not scanned)


class GPT(nn.Module):
    """Decoder-only GPT with a tied output head.

    Call: `tokens` int array (batch, seq) with seq <= `config.seq_len` -> logits float32
    (batch, seq, vocab_size). `train` is accepted so training code reads like ordinary
    Flax code; the model has no dropout, so it changes nothing.
    """

    config: GPTConfig

    @nn.compact
    def __call__(self, tokens: jax.Array, *, train: bool = False) -> jax.Array:
        del train
        cfg = self.config
        seq = tokens.shape[-1]
        if seq > cfg.seq_len:
            raise ValueError(f"GPT: sequence length {seq} exceeds GPTConfig.seq_len={cfg.seq_len}.")
        init = nn.initializers.normal(0.02)
        if cfg.model_parallel:  # vocabulary-parallel: each model rank holds a range of rows
            init = nn.with_partitioning(init, VOCAB_SPLIT)
        embed = nn.Embed(cfg.vocab_size, cfg.d_model, embedding_init=init, name="wte")
        pos = self.param("wpe", nn.initializers.normal(0.01), (cfg.seq_len, cfg.d_model))
        x = embed(tokens) + pos[:seq].astype(embed.embedding.dtype)
        if cfg.scan:
            blocks = nn.scan(
                _remat(ScannedBlock, cfg.remat, scanned=True),
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=cfg.n_layers,
                metadata_params={nn.PARTITION_NAME: None},
            )
            x, _ = blocks(cfg, name="blocks")(x, None)
        else:
            block = _remat(Block, cfg.remat, scanned=False)
            for i in range(cfg.n_layers):
                x = block(cfg, name=f"block_{i}")(x)
        x = nn.LayerNorm(name="ln_f")(x)
        return jnp.einsum(
            "bsd,vd->bsv", x, embed.embedding.astype(x.dtype), preferred_element_type=jnp.float32
        )


VOCAB = 50304
"""The presets' vocabulary: GPT-2's 50257 tokens padded to a multiple of 128 (as nanoGPT
does), so that the embedding divides over a mesh along its vocabulary axis."""

PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(),
    "125m": GPTConfig(vocab_size=VOCAB, seq_len=2048, d_model=768, n_layers=12, n_heads=12),
    "350m": GPTConfig(vocab_size=VOCAB, seq_len=2048, d_model=1024, n_layers=24, n_heads=16),
    "1.3b": GPTConfig(vocab_size=VOCAB, seq_len=2048, d_model=2048, n_layers=24, n_heads=16),
    "6.7b": GPTConfig(vocab_size=VOCAB, seq_len=2048, d_model=4096, n_layers=32, n_heads=32),
}
"""The trainer's model sizes (`zeropp-train --model`). `tiny` is the byte-level default;
the others have the widths, depths and 2048-token context of GPT-3's models of those
names (Brown et al. 2020, table 2.1; 1.3b with 16 heads of 128 rather than 24) and GPT-2's
vocabulary (`VOCAB`), so that their parameter counts are the named ones (the byte-level
data uses token ids 0-255 of it). The widths and depths are those before `scan` and
`remat`, which the trainer sets from its own flags."""


def param_count(config: GPTConfig) -> int:
    """Parameters of `GPT(config)`, from its shapes (nothing is initialised)."""
    d, f, L = config.d_model, config.mlp_ratio * config.d_model, config.n_layers
    per_block = (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
    return config.vocab_size * d + config.seq_len * d + L * per_block + 2 * d


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats, computed in float32.

    Args:
      logits: (batch, seq, vocab) scores.
      targets: (batch, seq) integer ids.

    Returns:
      A float32 scalar.
    """
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), targets.astype(jnp.int32)
    )
    return losses.mean()


def loss_fn(apply_fn, params, batch: jax.Array, *, train: bool = False) -> jax.Array:
    """Next-token loss of a (batch, seq_len + 1) token array: inputs are `batch[:, :-1]`,
    targets `batch[:, 1:]`."""
    logits = apply_fn({"params": params}, batch[:, :-1], train=train)
    return cross_entropy(logits, batch[:, 1:])


def init_fn(config: GPTConfig, seed: int) -> Callable[[], dict]:
    """A zero-argument callable returning the float32 parameters of a `GPT(config)` from
    an integer seed: what `zpp.TrainState.create(params=...)` takes for sharded init
    (with `config.model_parallel`, leaves boxed in their `nn.Partitioned` annotations)."""

    def init() -> dict:
        tokens = jnp.zeros((1, config.seq_len), dtype=jnp.int32)
        return GPT(config).init(jax.random.key(seed), tokens)["params"]

    return init


def init_params(config: GPTConfig, seed: int) -> dict:
    """Float32 parameters of a `GPT(config)` from an integer seed, materialised on one
    device (the same values `init_fn` gives under sharded init), without annotation boxes."""
    return nn.meta.unbox(jax.jit(init_fn(config, seed))())
