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

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax


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
    """

    vocab_size: int = 256
    seq_len: int = 128
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    mlp_ratio: int = 4
    scan: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.scan, bool):
            raise ValueError(f"GPTConfig.scan={self.scan!r}; expected True or False.")
        for name in ("vocab_size", "seq_len", "d_model", "n_layers", "n_heads", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r}; expected a positive int.")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"GPTConfig: n_heads={self.n_heads} does not divide d_model={self.d_model}; "
                "pick n_heads among the divisors of d_model."
            )


def _dense(features: int, std: float, name: str) -> nn.Dense:
    return nn.Dense(features, kernel_init=nn.initializers.normal(std), name=name)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t sees positions <= t."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        batch, seq, width = x.shape
        head_dim = width // cfg.n_heads
        qkv = _dense(3 * width, 0.02, "qkv")(x)
        q, k, v = jnp.split(qkv.reshape(batch, seq, 3 * cfg.n_heads, head_dim), 3, axis=2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        scores = scores / math.sqrt(head_dim)
        causal = jnp.tril(jnp.ones((seq, seq), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(batch, seq, width)
        return _dense(width, 0.02 / math.sqrt(2 * cfg.n_layers), "proj")(out)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        x = x + CausalSelfAttention(cfg, name="attn")(nn.LayerNorm(name="ln_attn")(x))
        h = nn.LayerNorm(name="ln_mlp")(x)
        h = nn.gelu(_dense(cfg.mlp_ratio * cfg.d_model, 0.02, "fc")(h))
        return x + _dense(cfg.d_model, 0.02 / math.sqrt(2 * cfg.n_layers), "out")(h)


class ScannedBlock(nn.Module):
    """`Block` with the `(carry, xs) -> (carry, ys)` signature of `nn.scan`."""

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array, _: None) -> tuple[jax.Array, None]:
        return Block(self.config, name="block")(x), None


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
        embed = nn.Embed(
            cfg.vocab_size, cfg.d_model, embedding_init=nn.initializers.normal(0.02), name="wte"
        )
        pos = self.param("wpe", nn.initializers.normal(0.01), (cfg.seq_len, cfg.d_model))
        x = embed(tokens) + pos[:seq].astype(embed.embedding.dtype)
        if cfg.scan:
            blocks = nn.scan(
                ScannedBlock,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                length=cfg.n_layers,
            )
            x, _ = blocks(cfg, name="blocks")(x, None)
        else:
            for i in range(cfg.n_layers):
                x = Block(cfg, name=f"block_{i}")(x)
        x = nn.LayerNorm(name="ln_f")(x)
        return jnp.einsum(
            "bsd,vd->bsv", x, embed.embedding.astype(x.dtype), preferred_element_type=jnp.float32
        )


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


def init_params(config: GPTConfig, seed: int) -> dict:
    """Float32 parameters of a `GPT(config)` from an integer seed."""
    tokens = jnp.zeros((1, config.seq_len), dtype=jnp.int32)
    return jax.jit(GPT(config).init)(jax.random.key(seed), tokens)["params"]
