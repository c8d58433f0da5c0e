"""The trainer: model, data pipeline and the `zeropp-train` CLI."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _support import XLA_DEFAULTS

from zeropp_jax.train import data
from zeropp_jax.train import model as model_lib
from zeropp_jax.train.model import (
    GPT,
    GPTConfig,
    cross_entropy,
    embed_lookup,
    head_cross_entropy,
    init_params,
    loss_fn,
)

TINY = GPTConfig(seq_len=16, d_model=32, n_layers=1, n_heads=4)
apply = jax.jit(GPT(TINY).apply, static_argnames="train")


# --- model -----------------------------------------------------------------------------


def test_model_shapes_and_dtypes():
    params = init_params(TINY, 0)
    tokens = jnp.arange(2 * 16, dtype=jnp.int32).reshape(2, 16)
    logits = apply({"params": params}, tokens)
    assert logits.shape == (2, 16, 256) and logits.dtype == jnp.float32
    bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
    logits16 = apply({"params": bf16}, tokens[:, :8], train=True)
    assert logits16.shape == (2, 8, 256) and logits16.dtype == jnp.float32
    loss = cross_entropy(logits, tokens)
    assert loss.dtype == jnp.float32 and loss.shape == ()


def test_model_is_causal():
    params = init_params(TINY, 1)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, 16)), dtype=jnp.int32)
    changed = tokens.at[0, 10].set((tokens[0, 10] + 1) % 256)
    a = apply({"params": params}, tokens)
    b = apply({"params": params}, changed)
    np.testing.assert_array_equal(a[:, :10], b[:, :10])
    assert not np.array_equal(a[:, 10:], b[:, 10:])


def test_model_config_validates():
    with pytest.raises(ValueError, match="n_heads=3 does not divide d_model=32"):
        GPTConfig(d_model=32, n_heads=3)
    with pytest.raises(ValueError, match="attn_chunk=-1; expected an int >= 0"):
        GPTConfig(attn_chunk=-1)
    with pytest.raises(ValueError, match="loss_chunks=3 does not divide vocab_size=256"):
        GPTConfig(loss_chunks=3)
    chunked = dataclasses.replace(TINY, attn_chunk=6)
    with pytest.raises(ValueError, match="chunk=6 does not divide the sequence length 16"):
        GPT(chunked).apply({"params": init_params(TINY, 0)}, jnp.zeros((1, 16), jnp.int32))


CHUNKS_BASE = GPTConfig(
    vocab_size=96, seq_len=32, d_model=32, n_layers=2, n_heads=4, scan=True, remat="full"
)


def _loss_and_grads(cfg, params, batch):
    return jax.jit(jax.value_and_grad(lambda p: loss_fn(GPT(cfg).apply, p, batch)))(params)


@pytest.mark.parametrize(
    "chunks", [dict(attn_chunk=8), dict(loss_chunks=6), dict(attn_chunk=16, loss_chunks=4)]
)
def test_chunks_keep_the_loss_and_the_gradient(chunks):
    """Attention in query chunks and the head and loss in vocabulary pieces compute what
    the whole sequence and the whole vocabulary compute, to float summation order."""
    params = init_params(CHUNKS_BASE, 0)
    batch = jax.random.randint(jax.random.key(1), (2, 33), 0, 96)
    want_loss, want = _loss_and_grads(CHUNKS_BASE, params, batch)
    loss, got = _loss_and_grads(dataclasses.replace(CHUNKS_BASE, **chunks), params, batch)
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-7)


def test_chunks_shrink_the_compiled_step():
    """The point of the chunks: the step's temporaries no longer hold the (seq x seq)
    scores or the (seq x vocab) logits."""
    base = dataclasses.replace(CHUNKS_BASE, vocab_size=2048, seq_len=256)
    params = init_params(base, 0)
    batch = jnp.zeros((2, 257), jnp.int32)

    def temp(cfg):
        step = jax.jit(jax.grad(lambda p: loss_fn(GPT(cfg).apply, p, batch)))
        return step.lower(params).compile().memory_analysis().temp_size_in_bytes

    whole = temp(base)
    assert temp(dataclasses.replace(base, attn_chunk=32)) < whole
    assert temp(dataclasses.replace(base, loss_chunks=8)) < whole


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("pieces", [1, 3, 16])
def test_embed_lookup_is_take_with_its_gradient(dtype, pieces):
    """To the bit, also in row ranges (3 pieces of 16 rows: 0-5, 6-11 and 10-15, the last
    overlapping the one before; token 3 is summed four times)."""
    table = jax.random.normal(jax.random.key(0), (16, 8), dtype)
    tokens = jnp.array([[3, 3, 0, 15], [7, 3, 0, 1], [11, 10, 10, 6], [5, 3, 15, 12]])
    weights = jax.random.normal(jax.random.key(1), (4, 4, 8), dtype)

    def f(lookup, t):
        return (lookup(t, tokens).astype(jnp.float32) * weights).sum()

    take = functools.partial(jnp.take, axis=0)
    mine = functools.partial(embed_lookup, pieces=pieces)
    np.testing.assert_array_equal(mine(table, tokens), take(table, tokens))
    np.testing.assert_array_equal(
        jax.jit(jax.grad(functools.partial(f, mine)))(table),
        jax.jit(jax.grad(functools.partial(f, take)))(table),
    )


@pytest.mark.parametrize("pieces", [1, 2, 5])
def test_head_cross_entropy_is_optax_s_per_position_loss(pieces):
    """Per-position losses and both gradients against optax on the whole logits, with
    unequal cotangents per position (targets in every piece)."""
    x = jax.random.normal(jax.random.key(0), (2, 6, 8))
    table = jax.random.normal(jax.random.key(1), (10, 8))
    targets = jnp.array([[0, 1, 2, 3, 4, 9], [5, 6, 7, 8, 9, 0]])
    weights = jax.random.uniform(jax.random.key(2), (2, 6))

    def whole(x, table):
        logits = jnp.einsum("bsd,vd->bsv", x, table)
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets)

    def chunked(x, table):
        return head_cross_entropy(x, table, targets, pieces)

    np.testing.assert_allclose(chunked(x, table), whole(x, table), rtol=1e-6)
    for a, b in zip(
        jax.grad(lambda *xs: (chunked(*xs) * weights).sum(), argnums=(0, 1))(x, table),
        jax.grad(lambda *xs: (whole(*xs) * weights).sum(), argnums=(0, 1))(x, table),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_head_backward_writes_the_table_gradient_over_the_table():
    """The head's backward reads vocabulary piece j of the table, then writes piece j of
    the table's gradient in its place: given a table it may overwrite (the engine's
    re-gathered weight; here a donated one), its temporaries stay under two (vocab, d)
    tables at XLA's default code generation. Before, the table and a zero gradient beside
    it took more than two."""
    vocab, d, n = 32768, 64, 8
    targets = jnp.zeros((2, 16), jnp.int32)

    def backward(table, x, lse, g):
        return model_lib._head_bwd(n, (x, table, targets, lse), g)[:2]

    args = [
        jax.ShapeDtypeStruct(shape, dtype)
        for shape, dtype in [
            ((vocab, d), jnp.bfloat16),
            ((2, 16, d), jnp.bfloat16),
            ((2, 16), jnp.float32),
            ((2, 16), jnp.float32),
        ]
    ]
    lowered = jax.jit(backward, donate_argnums=0).lower(*args)
    compiled = lowered.compile(compiler_options=XLA_DEFAULTS)
    table_bytes = vocab * d * 2
    assert compiled.memory_analysis().temp_size_in_bytes < 2 * table_bytes


# --- data ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus():
    return data.load_corpus(max_bytes=2 * 2**20)


def test_split_is_deterministic_and_disjoint_by_file(corpus):
    again = data.load_corpus(max_bytes=2 * 2**20)
    assert corpus.train_files == again.train_files and corpus.val_files == again.val_files
    np.testing.assert_array_equal(corpus.val, again.val)
    assert not set(corpus.train_files) & set(corpus.val_files)
    assert all(data.is_validation(f) for f in corpus.val_files)
    assert not any(data.is_validation(f) for f in corpus.train_files)
    assert not any("site-packages" in f for f in corpus.train_files + corpus.val_files)
    assert 0.01 < len(corpus.val_files) / len(corpus.train_files) < 0.15
    assert corpus.train.dtype == np.int32 and 0 <= corpus.train.min() <= corpus.train.max() < 256
    # A byte-level model that ignores context cannot beat this; real text sits at 3-6 bits.
    assert 3.0 < data.bits(data.unigram_entropy(corpus.train)) < 6.0


def test_batch_sampler_is_a_function_of_seed_and_step(corpus):
    def batch(seed, step):
        return data.sample_batch(corpus.train, seed=seed, step=step, batch_size=8, seq_len=16)

    b = batch(0, 5)
    assert b.shape == (8, 17) and b.dtype == np.int32
    np.testing.assert_array_equal(b, batch(0, 5))
    assert not np.array_equal(b, batch(0, 6))
    assert not np.array_equal(b, batch(1, 5))
    # Rows are windows of consecutive corpus tokens.
    text = corpus.train.astype(np.uint8).tobytes()
    assert bytes(b[0].astype(np.uint8)) in text


def test_prefetcher_yields_the_direct_batches(corpus):
    def make(step):
        return data.sample_batch(corpus.train, seed=3, step=step, batch_size=4, seq_len=16)

    with data.Prefetcher(make, 2, 7) as pf:
        got = list(pf)
    assert [s for s, _ in got] == [2, 3, 4, 5, 6]
    for step, batch in got:
        np.testing.assert_array_equal(batch, make(step))
    # Stopping early still joins the thread.
    pf = data.Prefetcher(make, 0, 1000)
    next(iter(pf))
    pf.close()
    assert not pf._thread.is_alive()


def test_prefetcher_reraises_errors():
    def make(step):
        if step == 1:
            raise RuntimeError("boom")
        return step

    with data.Prefetcher(make, 0, 3) as pf, pytest.raises(RuntimeError, match="boom"):
        list(pf)


def test_global_batch_assembly(corpus):
    import zeropp_jax as zpp

    mesh = zpp.make_mesh(num_nodes=2, local_size=4)
    sharding = data.batch_sharding(mesh)
    batch = data.sample_batch(corpus.train, seed=0, step=0, batch_size=16, seq_len=16)
    local = data.local_rows(batch, sharding)  # one process: every row
    assert local.shape == batch.shape
    arr = data.make_global_batch(local, sharding, 16)
    assert arr.shape == (16, 17) and arr.sharding == sharding
    np.testing.assert_array_equal(np.asarray(arr), batch)


# --- CLI -------------------------------------------------------------------------------

TINY_FLAGS = [
    "--d-model", "32", "--n-layers", "1", "--n-heads", "4", "--seq-len", "16",
    "--batch", "8", "--max-corpus-mb", "2", "--eval-batches", "1", "--eval-every", "0",
    "--no-progress",
]  # fmt: skip


def _metrics(out):
    import json

    with open(out / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--batch", "12"], "--batch 12 is not divisible by the 8 data-parallel devices"),
        (["--nodes", "3"], "num_nodes=3 does not divide the 8 devices"),
        (["--nodes", "2", "--local", "2"], "the product must equal the device count"),
        (["--weight-bits", "3"], "invalid bit width '3'"),
        (["--n-heads", "3"], "--n-heads 3 does not divide --d-model 32"),
        (["--resume"], "run.json not found"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--zero3", "--engine", "xla-fsdp"], "--zero3 and --engine xla-fsdp disagree"),
        (["--engine", "xla-fsdp", "--resume"], "writes no checkpoints"),
        (["--engine", "fsdp"], "invalid choice: 'fsdp'"),
        (["--batch", "7"], "--batch 7 is not divisible by the 8 data-parallel devices"),
        (["--steps", "0"], "argument --steps: expected a positive integer, got '0'"),
        (["--grad-block-size", "7"], "error: --grad-block-size 7: ZeroPPConfig.grad_block_size"),
        (["--attn-chunk", "5"], "--attn-chunk 5 does not divide --seq-len 16"),
        (["--loss-chunks", "3"], "--loss-chunks 3 does not divide the vocabulary (256 tokens)"),
        (["--shared-grad", "twice"], "argument --shared-grad: invalid choice: 'twice'"),
        (
            ["--shared-grad", "per_use", "--error-feedback", "node"],
            "--shared-grad per_use: ZeroPPConfig.shared_grad='per_use' is not allowed",
        ),
        (["--preset", "beyond", "--zero3"], "--preset beyond configures this library's ZeRO++"),
        (
            ["--grad-rotation", "--grad-bits", "none", "--grad-node-bits", "4"],
            "--grad-rotation: ZeroPPConfig.grad_rotation=True is not allowed",
        ),
    ],
)
def test_cli_bad_flags_give_one_line_and_exit_2(flags, message, capsys, tmp_path):
    from zeropp_jax.train import cli

    argv = [*TINY_FLAGS, "--out", str(tmp_path / "run"), *flags]
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("zeropp-train: error: "), err
    assert message in err


def test_cli_trains_checkpoints_and_resumes_at_the_same_data_position(
    tmp_path, capsys, compile_cache
):
    import shutil

    from zeropp_jax.train import cli

    # The resumed run compiles the same programs: it finds them in `compile_cache`.
    full = tmp_path / "full"
    argv = [*TINY_FLAGS, "--steps", "4", "--save-every", "2", "--no-ledger", "--out", str(full)]
    assert cli.main(argv) == 0
    assert "val loss" in capsys.readouterr().out  # the summary
    assert (full / "checkpoints" / "step_2").is_dir()
    assert (full / "checkpoints" / "step_4").is_dir()
    assert (full / "summary.json").is_file()
    steps = [r for r in _metrics(full) if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(np.isfinite(r["loss"]) for r in steps)

    # A run interrupted after step 2, then resumed.
    cut = tmp_path / "cut"
    (cut / "checkpoints").mkdir(parents=True)
    shutil.copy(full / "run.json", cut / "run.json")
    shutil.copytree(full / "checkpoints" / "step_2", cut / "checkpoints" / "step_2")
    argv = [*TINY_FLAGS, "--steps", "4", "--out", str(cut), "--resume", "--no-ledger"]
    assert cli.main(argv) == 0
    resumed = [r for r in _metrics(cut) if "loss" in r]
    assert [r["step"] for r in resumed] == [3, 4]
    for a, b in zip(steps[2:], resumed, strict=True):
        assert a["data_crc32"] == b["data_crc32"]  # the same batches
        assert a["loss"] == b["loss"]  # from the same parameters and optimizer state
    with open(cut / "run.json") as f:
        record = json.load(f)
    assert len(record["provenance"]["commit"]) == 40
    assert record["earlier_provenance"] == [record["provenance"]]  # the same code both times


def test_cli_xla_fsdp_trains_like_zero3(tmp_path, capsys):
    # Unquantized float32, the two engines compute the same step: XLA FSDP's losses equal
    # ZeRO-3's to summation order.
    from zeropp_jax.train import cli

    exact = [*TINY_FLAGS, "--steps", "2", "--compute-dtype", "float32"]
    assert cli.main([*exact, "--engine", "xla-fsdp", "--out", str(tmp_path / "fsdp")]) == 0
    printed = capsys.readouterr().out
    assert "no checkpoint (--engine xla-fsdp)" in printed
    assert "XLA FSDP" in printed and "per node link, each way" in printed
    assert not (tmp_path / "fsdp" / "checkpoints").exists()
    assert cli.main([*exact, "--zero3", "--out", str(tmp_path / "zero3")]) == 0
    printed = capsys.readouterr().out
    assert "ZeRO-3" in printed and "per node link, each way" in printed  # its ledger
    fsdp = [r["loss"] for r in _metrics(tmp_path / "fsdp") if "loss" in r]
    zero3 = [r["loss"] for r in _metrics(tmp_path / "zero3") if "loss" in r]
    np.testing.assert_allclose(fsdp, zero3, rtol=1e-5)


def test_cli_chunks_train_like_the_whole_model(tmp_path):
    # Float32 ZeRO-3 with attention in chunks of 4 queries and the loss in 4 vocabulary
    # pieces: the same losses as without chunks, to summation order.
    from zeropp_jax.train import cli

    exact = [*TINY_FLAGS, "--steps", "2", "--compute-dtype", "float32", "--zero3"]
    chunks = ["--attn-chunk", "4", "--loss-chunks", "4"]
    assert cli.main([*exact, *chunks, "--out", str(tmp_path / "chunks")]) == 0
    assert cli.main([*exact, "--out", str(tmp_path / "whole")]) == 0
    got = [r["loss"] for r in _metrics(tmp_path / "chunks") if "loss" in r]
    want = [r["loss"] for r in _metrics(tmp_path / "whole") if "loss" in r]
    assert len(got) == len(want) == 2
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_preset_flags_give_the_config_presets():
    import zeropp_jax as zpp
    from zeropp_jax.train.flags import parse_args, zeropp_config

    assert zeropp_config(parse_args([])) == zpp.ZeroPPConfig()
    assert zeropp_config(parse_args(["--preset", "beyond"])) == zpp.ZeroPPConfig.beyond()
    # Explicit flags override the preset's defaults.
    got = zeropp_config(parse_args(["--preset", "beyond", "--grad-node-bits", "2"]))
    assert got == zpp.ZeroPPConfig.beyond(grad_node_bits=2)
    got = zeropp_config(parse_args(["--preset", "beyond", "--grad-node-rotation", "off"]))
    assert got == zpp.ZeroPPConfig.beyond(grad_node_rotation=False)
    assert zeropp_config(parse_args(["--zero3", "--grad-rotation"])) == zpp.ZeroPPConfig.zero3()


def test_docs_show_the_help_the_parser_prints(monkeypatch):
    import pathlib

    from zeropp_jax.train import flags

    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps to the terminal's width
    page = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "trainer.md").read_text()
    shown = page.split("<!-- help:start -->\n```text\n", 1)[1].split("```\n<!-- help:end -->")[0]
    assert shown == flags.build_parser().format_help(), (
        "docs/trainer.md's `zeropp-train --help` is stale: replace it with `COLUMNS=100 "
        "zeropp-train --help`"
    )
    # What the issue asked of it: what the program does, and examples of the common runs.
    assert shown.split("\n\n")[1].startswith("Train a GPT on your own text (--data)")
    for example in ("--engine zero3", "--resume", "--num-processes 2", "zeropp_jax.launch"):
        assert example in flags.EPILOG


def test_cli_muon_summary_counts_the_update_phase(tmp_path, capsys):
    """The trainer's bytes for `--optimizer muon` include Muon's update: each kernel's
    momentum gathered once in bfloat16, across nodes first, so that each node link carries
    the other node's half of every kernel (its element count, in bytes) per step."""
    from zeropp_jax.train import cli
    from zeropp_jax.train.flags import gpt_config, parse_args
    from zeropp_jax.train.model import init_fn

    argv = [*TINY_FLAGS, "--steps", "1", "--optimizer", "muon", "--save-every", "0"]
    assert cli.main([*argv, "--out", str(tmp_path / "run")]) == 0
    printed = capsys.readouterr().out
    assert "per node link, update" in printed and "read from the program" in printed
    with open(tmp_path / "run" / "summary.json") as f:
        ledger = json.load(f)["ledger"]
    ours = ledger["ZeRO++"]
    assert ours["program"] == "compiled"
    init = init_fn(gpt_config(parse_args(argv)), 0)
    shapes = jax.eval_shape(init.fn)
    kernels = [
        x.size for p, x in jax.tree_util.tree_leaves_with_path(shapes) if p[-1].key == "kernel"
    ]
    m = 2 * sum(x.size for x in jax.tree.leaves(shapes))
    # The kernels' widths divide over the 8 devices: no padding. The update's other
    # collective is the clipping's all-reduce of one float32 per leaf (448 bytes through a
    # node link here), less than the smallest kernel's gather would add.
    leaves = len(jax.tree.leaves(shapes))
    extra = ours["update_link_M"] * m - sum(kernels)
    assert 0 <= extra <= 32 * leaves < min(kernels), (ours, sum(kernels))
    whole = sum(ours[f"{p}_link_M"] for p in ("forward", "backward", "update"))
    assert ours["link_M"] == pytest.approx(whole, rel=1e-9)
    assert ledger["ZeRO-3"]["update_link_M"] == pytest.approx(ours["update_link_M"])
