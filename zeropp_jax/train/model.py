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
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from zeropp_jax._activation_sharding import constrain_to_batch
from zeropp_jax.interpreter import _dataflow as dataflow
from zeropp_jax.state._state_init import ShardedInit

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
      attn_chunk: queries per attention chunk (0, or at least the sequence length: the
        whole sequence at once). Attention then runs as a loop over query chunks, each
        recomputed in the backward, so that one chunk's (chunk x seq) scores and
        probabilities are live at a time instead of the whole (seq x seq); it must divide
        the sequence length the model is called with.
        Each query's scores, softmax and output are computed as without chunks.
      loss_chunks: pieces of the vocabulary the output head and the loss run in when the
        model is called with `targets` (1: all at once). The head then never holds the
        (batch, seq, vocab) logits: a loop over vocabulary pieces (piece j holds the rows
        j, j + n, j + 2n, ..., so that a vocabulary split over `model` splits every piece
        evenly) keeps a running log-sum-exp, and the backward recomputes each piece's
        logits. It must divide `vocab_size`. The input lookup's gradient is summed in as
        many ranges of rows (`embed_lookup`), one after the other.
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
    attn_chunk: int = 0
    loss_chunks: int = 1
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
        if isinstance(self.attn_chunk, bool) or not isinstance(self.attn_chunk, int):
            raise ValueError(f"GPTConfig.attn_chunk={self.attn_chunk!r}; expected an int >= 0.")
        if self.attn_chunk < 0:
            raise ValueError(
                f"GPTConfig.attn_chunk={self.attn_chunk}; expected an int >= 0 (0: no chunks)."
            )
        if isinstance(self.loss_chunks, bool) or not isinstance(self.loss_chunks, int):
            raise ValueError(f"GPTConfig.loss_chunks={self.loss_chunks!r}; expected an int >= 1.")
        if self.loss_chunks < 1 or self.vocab_size % self.loss_chunks:
            raise ValueError(
                f"GPTConfig.loss_chunks={self.loss_chunks} does not divide "
                f"vocab_size={self.vocab_size}; pick a divisor of the vocabulary (1: no chunks)."
            )
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


def _attend(q: jax.Array, k: jax.Array, v: jax.Array, start: jax.Array | int) -> jax.Array:
    """Causal attention of the queries at positions `start`, `start + 1`, ... (q: batch,
    rows, heads, head_dim) to all keys (k, v: batch, seq, heads, head_dim); float32
    scores and softmax, probabilities in `v`'s dtype."""
    rows, seq = q.shape[1], k.shape[1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(q.shape[-1])
    causal = jnp.arange(seq)[None, :] <= (start + jnp.arange(rows))[:, None]
    scores = scores + jnp.where(causal, 0.0, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, chunk: int = 0) -> jax.Array:
    """Causal multi-head attention, position t seeing positions <= t.

    Args:
      q, k, v: (batch, seq, heads, head_dim), per shard.
      chunk: queries per chunk; 0 (or >= seq) attends all queries at once. Otherwise a
        `lax.scan` over `seq // chunk` query chunks, each under `jax.checkpoint`, so the
        forward and the backward hold one chunk's (batch, heads, chunk, seq) scores at a
        time. Must divide seq.

    Returns:
      (batch, seq, heads, head_dim) in `v`'s dtype.
    """
    batch, seq, heads, head_dim = q.shape
    if not chunk or chunk >= seq:
        return _attend(q, k, v, 0)
    if seq % chunk:
        raise ValueError(
            f"causal_attention: chunk={chunk} does not divide the sequence length {seq}; "
            "set GPTConfig.attn_chunk (zeropp-train --attn-chunk) to a divisor of it, or 0."
        )
    n = seq // chunk
    pieces = q.reshape(batch, n, chunk, heads, head_dim).swapaxes(0, 1)
    attend = jax.checkpoint(lambda q_c, start: _attend(q_c, k, v, start))
    _, out = jax.lax.scan(lambda _, xs: (None, attend(*xs)), None, (pieces, jnp.arange(n) * chunk))
    return out.swapaxes(0, 1).reshape(batch, seq, heads, head_dim)


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
        out = causal_attention(q, k, v, cfg.attn_chunk).reshape(batch, seq, width)
        return _dense(width, 0.02 / math.sqrt(2 * cfg.n_layers), "proj", ROW if tp else None)(out)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x)).

    Its input and output are constrained to the batch (`constrain_to_batch`, as MaxText
    constrains activations), which pins XLA's FSDP to gathering weights; a no-op without
    a mesh and inside the ZeRO++ engine's island.
    """

    config: GPTConfig

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        tp = cfg.model_parallel
        x = constrain_to_batch(x)
        x = x + CausalSelfAttention(cfg, name="attn")(nn.LayerNorm(name="ln_attn")(x))
        h = nn.LayerNorm(name="ln_mlp")(x)
        h = nn.gelu(_dense(cfg.mlp_ratio * cfg.d_model, 0.02, "fc", COLUMN if tp else None)(h))
        out = _dense(cfg.d_model, 0.02 / math.sqrt(2 * cfg.n_layers), "out", ROW if tp else None)
        return constrain_to_batch(x + out(h))


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


def _as_bits(table: jax.Array) -> jax.Array:
    """The table's bits as unsigned integers of its width, for the head's loops to slice
    and the backward loops to update.

    XLA's CPU compiler computes bfloat16 dots in float32 and moves the widening convert
    from a loop's slice onto the whole loop-invariant table, holding a float32 copy of it
    (twice the table) through the loop; a convert cannot move through a bitcast, so the
    loops carry the bits and each piece is bitcast back after slicing. It also widens a
    bfloat16 dynamic-update-slice to float32 (convert, update, convert back), which then
    cannot update the loop's carry in place: a second copy of a whole gradient carry.
    Free elsewhere."""
    bits = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[table.dtype.itemsize]
    return jax.lax.bitcast_convert_type(table, bits)


def _piece(bits: jax.Array, j: jax.Array, n: int, dtype) -> jax.Array:
    """Rows j, j + n, j + 2n, ... of a (vocab, d) table held as `_as_bits`, in `dtype`:
    the j-th of n vocabulary pieces. `bits` may also be the (vocab / n, n, d) view."""
    piece = jax.lax.dynamic_index_in_dim(
        bits.reshape(-1, n, bits.shape[-1]), j, axis=1, keepdims=False
    )
    return jax.lax.bitcast_convert_type(piece, dtype)


def _zeros(shape: tuple[int, ...], dtype, *like: jax.Array) -> jax.Array:
    """Zeros of `shape` whose type varies over the same manual mesh axes as the arrays
    `like` (inside `shard_map`, a loop's carry must keep its type through the body)."""
    z = jnp.zeros(shape, dtype)
    for ref in like:
        z = z + jnp.zeros_like(ref, shape=(), dtype=dtype)
    return z


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def embed_lookup(table: jax.Array, tokens: jax.Array, pieces: int = 1) -> jax.Array:
    """Rows `tokens` of `table`: `jnp.take(table, tokens, axis=0)`, as `nn.Embed` computes
    it, with its gradient: a scatter-add of the cotangent into zeros of the table's shape
    and dtype, in `pieces` ranges of rows.

    The backward's zeros wait for the cotangent (`interpreter._dataflow.tie`): without that
    XLA allocates them, a whole (vocab, d) buffer, at the start of the backward and holds
    them through every block's backward until the lookup's gradient is finally added in.
    Each range of rows is its own scatter-add in the table's dtype, so the sums are those
    of one scatter-add over the whole table, to the bit; XLA's CPU compiler widens a 16-bit
    scatter-add's buffer to float32, which in ranges is one range's size, not the table's.

    Args:
      table: (vocab, d) embedding, per shard as the model sees it.
      tokens: integer ids of any shape.
      pieces: ranges of rows the gradient is summed in, one after the other (1: at once).

    Returns:
      tokens.shape + (d,), in the table's dtype.
    """
    return jnp.take(table, tokens, axis=0)


def _lookup_fwd(table, tokens, pieces):
    saved = (jnp.zeros_like(table, shape=(0,)), table.shape, tokens)
    return embed_lookup(table, tokens, pieces), saved


def _lookup_bwd(pieces, residuals, g):
    like, shape, tokens = residuals
    out = dataflow.tie(g, _zeros(shape, like.dtype, like))
    updates = g.astype(like.dtype)
    if pieces == 1:
        return out.at[tokens].add(updates), None
    rows = shape[0]
    size = -(-rows // pieces)

    def body(out, k):
        # The last range ends at the last row (it may overlap the one before: the rows of
        # both get the same sums twice).
        start = jnp.minimum(k * size, rows - size)
        local = tokens - start
        local = jnp.where((local >= 0) & (local < size), local, size)  # size: dropped
        piece = _zeros((size, *shape[1:]), like.dtype, g, like)
        piece = piece.at[local].add(updates, mode="drop")
        return jax.lax.dynamic_update_slice_in_dim(out, _as_bits(piece), start, 0), None

    out, _ = jax.lax.scan(body, _as_bits(out), jnp.arange(pieces))  # bits: see `_as_bits`
    return jax.lax.bitcast_convert_type(out, like.dtype), None


embed_lookup.defvjp(_lookup_fwd, _lookup_bwd)


def _head_forward(x, table, targets, n):
    """(per-position losses, their log-sum-exp): a loop over the n vocabulary pieces with
    a running maximum and sum of exponentials, picking each target's logit in its piece."""
    batch, seq = targets.shape
    in_piece, index = targets % n, targets // n
    bits = _as_bits(table)

    def body(carry, j):
        top, total, picked = carry
        piece = _piece(bits, j, n, table.dtype)
        logits = jnp.einsum("bsd,vd->bsv", x, piece, preferred_element_type=jnp.float32)
        new_top = jnp.maximum(top, logits.max(axis=-1))
        total = total * jnp.exp(top - new_top) + jnp.exp(logits - new_top[..., None]).sum(-1)
        mine = jnp.take_along_axis(logits, index[..., None], axis=-1)[..., 0]
        return (new_top, total, jnp.where(in_piece == j, mine, picked)), None

    zeros = _zeros((batch, seq), jnp.float32, x, table, targets)
    start = (zeros - jnp.inf, zeros, zeros)
    (top, total, picked), _ = jax.lax.scan(body, start, jnp.arange(n))
    lse = top + jnp.log(total)
    return lse - picked, lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def head_cross_entropy(x: jax.Array, table: jax.Array, targets: jax.Array, n: int) -> jax.Array:
    """Per-position cross-entropy (nats, float32) of the tied output head `x @ table.T`,
    never holding the (batch, seq, vocab) logits.

    Args:
      x: (batch, seq, d) final hidden states, per shard.
      table: (vocab, d) output embedding, in the compute dtype.
      targets: (batch, seq) integer ids.
      n: vocabulary pieces; must divide vocab. Piece j holds rows j, j + n, j + 2n, ...

    Returns:
      (batch, seq) float32 losses. The forward keeps only the log-sum-exp per position;
      the backward recomputes each piece's logits, adds its share of the input's gradient
      into a float32 sum and writes its rows of the table's gradient.
    """
    return _head_forward(x, table, targets, n)[0]


def _head_fwd(x, table, targets, n):
    losses, lse = _head_forward(x, table, targets, n)
    return losses, (x, table, targets, lse)


def _head_bwd(n, residuals, g):
    x, table, targets, lse = residuals
    vocab, d = table.shape
    in_piece, index = targets % n, targets // n

    def body(carry, j):
        # `carry[1]`: the table's bits, piece by piece overwritten by the gradient's. Piece j
        # is read before its rows are written and never read again.
        dx, bits = carry
        piece = _piece(bits, j, n, table.dtype)
        logits = jnp.einsum("bsd,vd->bsv", x, piece, preferred_element_type=jnp.float32)
        probs = jnp.exp(logits - lse[..., None])
        hit = (in_piece == j)[..., None] & (jnp.arange(vocab // n) == index[..., None])
        dlogits = (probs - hit) * g[..., None]
        dx = dx + jnp.einsum("bsv,vd->bsd", dlogits, piece.astype(jnp.float32))
        rows = jnp.einsum("bsv,bsd->vd", dlogits, x.astype(jnp.float32)).astype(table.dtype)
        # The rows wait for every read of the piece (dx's too): then XLA writes them in
        # place, not into a copy of the whole carry.
        rows = dataflow.tie(dx, rows)
        bits = jax.lax.dynamic_update_index_in_dim(bits, _as_bits(rows), j, axis=1)
        return (dx, bits), None

    # The table waits for the log-sum-exp: else XLA makes the loop's copy of it while
    # the forward still holds its own.
    start = (
        _zeros(x.shape, jnp.float32, x, table, targets, g),
        _as_bits(dataflow.tie(lse, table)).reshape(vocab // n, n, d),
    )
    (dx, dtable), _ = jax.lax.scan(body, start, jnp.arange(n))
    dtable = jax.lax.bitcast_convert_type(dtable, table.dtype)
    return dx.astype(x.dtype), dtable.reshape(vocab, d), None


head_cross_entropy.defvjp(_head_fwd, _head_bwd)


class GPT(nn.Module):
    """Decoder-only GPT with a tied output head.

    Call: `tokens` int array (batch, seq) with seq <= `config.seq_len` -> logits float32
    (batch, seq, vocab_size); with `targets` (batch, seq) ids, the per-position
    cross-entropy float32 (batch, seq) instead, computed in `config.loss_chunks` vocabulary
    pieces (`head_cross_entropy`) without the logits. `train` is accepted so training code
    reads like ordinary Flax code; the model has no dropout, so it changes nothing.
    """

    config: GPTConfig

    @nn.compact
    def __call__(
        self, tokens: jax.Array, *, targets: jax.Array | None = None, train: bool = False
    ) -> jax.Array:
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
        x = embed_lookup(embed.embedding, tokens, cfg.loss_chunks)
        x = x + pos[:seq].astype(embed.embedding.dtype)
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
        table = embed.embedding.astype(x.dtype)
        if targets is not None and cfg.loss_chunks > 1:
            return head_cross_entropy(x, table, targets.astype(jnp.int32), cfg.loss_chunks)
        logits = jnp.einsum("bsd,vd->bsv", x, table, preferred_element_type=jnp.float32)
        if targets is None:
            return logits
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets.astype(jnp.int32))


VOCAB = 50304
"""The presets' vocabulary: GPT-2's 50257 tokens padded to a multiple of 128 (as nanoGPT
does), so that the embedding divides over a mesh along its vocabulary axis."""

_LARGE = dict(vocab_size=VOCAB, seq_len=2048, attn_chunk=256, loss_chunks=16)

PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(),
    "125m": GPTConfig(**_LARGE, d_model=768, n_layers=12, n_heads=12),
    "350m": GPTConfig(**_LARGE, d_model=1024, n_layers=24, n_heads=16),
    "1.3b": GPTConfig(**_LARGE, d_model=2048, n_layers=24, n_heads=16),
    "6.7b": GPTConfig(**_LARGE, d_model=4096, n_layers=32, n_heads=32),
}
"""The trainer's model sizes (`zeropp-train --model`). `tiny` is the byte-level default;
the others have the widths, depths and 2048-token context of GPT-3's models of those
names (Brown et al. 2020, table 2.1; 1.3b with 16 heads of 128 rather than 24) and GPT-2's
vocabulary (`VOCAB`), so that their parameter counts are the named ones (the byte-level
data uses token ids 0-255 of it), attention in chunks of 256 queries and the head and loss
in 16 vocabulary pieces (3144 rows each), so that neither the (seq x seq) scores nor the
(seq x vocab) logits are held whole. The widths and depths are those before `scan` and
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
    """Mean next-token loss (float32 nats) of a (batch, seq_len + 1) token array: inputs
    are `batch[:, :-1]`, targets `batch[:, 1:]`; the model computes the per-position
    losses itself (`GPT(targets=...)`), in `GPTConfig.loss_chunks` vocabulary pieces."""
    return apply_fn({"params": params}, batch[:, :-1], targets=batch[:, 1:], train=train).mean()


def init_fn(config: GPTConfig, seed: int) -> ShardedInit:
    """Sharded init of a `GPT(config)` from an integer seed: a `zpp.ShardedInit` whose
    callable returns the float32 parameters (with `config.model_parallel`, leaves boxed in
    their `nn.Partitioned` annotations), what `zpp.TrainState.create(params=...)` takes."""

    def init() -> dict:
        tokens = jnp.zeros((1, config.seq_len), dtype=jnp.int32)
        return GPT(config).init(jax.random.key(seed), tokens)["params"]

    return ShardedInit(init)


def init_params(config: GPTConfig, seed: int) -> dict:
    """Float32 parameters of a `GPT(config)` from an integer seed, materialised on one
    device (the same values `init_fn` gives under sharded init), without annotation boxes."""
    return nn.meta.unbox(jax.jit(init_fn(config, seed))())
