"""A Hugging Face Flax model under `zpp.shard`: GPT-2 and Llama as `transformers` builds them.

    pip install --target /tmp/hf transformers==4.46.3 && rm -r /tmp/hf/numpy*
    python experiments/hf_flax_probe.py --hf /tmp/hf

`transformers` is not a dependency of this project; this probe is run by hand (its last
release with Flax models is 4.x). It builds `FlaxGPT2LMHeadModel` and
`FlaxLlamaForCausalLM` from small configs (no download: random weights from the seed;
d_model 64, 2 layers, 4 heads, vocabulary 256, sequence 16, float32) and trains 3 steps of
next-token cross-entropy under `zpp.shard` (ZeRO-3 unquantized, float32 compute, 2 x 4 mesh
of emulated CPU devices) against `jax.jit` on one device, with SGD, Adam and Adafactor
(a shape-reading optimizer: its factored moments need the model's shapes). It records the
largest relative difference of the trained values and of the losses, and any warning of a
weight gathered whole. Then one ZeRO++ run (the defaults: int8 weights, int4 gradients)
gives the loss after 3 steps beside the reference's.

`/tmp/hf` goes first on `sys.path` (transformers 4.46 wants its own tokenizers), less the
numpy pip put there (this environment's serves). Writes `hf_flax_probe.md` into `--out` (default
`experiments/results`).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import warnings

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import _common  # noqa: E402

_common.request_cpu_devices(8)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

VOCAB, SEQ, BATCH, STEPS = 256, 16, 8, 3
OPTIMIZERS = {
    "sgd": lambda: optax.sgd(0.1),
    "adam": lambda: optax.adam(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=32),
}


def build(name: str):  # noqa: ANN201
    """The model's Flax module and its parameters (float32, from seed 0)."""
    import transformers as tf

    if name == "gpt2":
        config = tf.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4)
        model = tf.FlaxGPT2LMHeadModel(config, seed=0, dtype=jnp.float32)
    else:
        config = tf.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=4 * SEQ,  # its rotary table wants >= 2 x head_dim
        )
        model = tf.FlaxLlamaForCausalLM(config, seed=0, dtype=jnp.float32)
    return model.module, model.params


def train_step(state, batch):  # noqa: ANN001, ANN201
    def loss(p):  # noqa: ANN001, ANN202
        logits = state.apply_fn({"params": p}, batch["tokens"], batch["mask"], batch["positions"])
        logits = logits.logits if hasattr(logits, "logits") else logits[0]
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), {"loss": value}


def batches() -> list[dict[str, np.ndarray]]:
    mask = np.ones((BATCH, SEQ), np.int32)
    return [dict(b, mask=mask) for b in _common.random_token_batches(STEPS, BATCH, SEQ, VOCAB)]


def run(module, params, tx_name: str, quantized: bool = False) -> dict:  # noqa: ANN001
    """Trains `STEPS` steps under `zpp.shard` and under `jax.jit`; returns the whole-gather
    warnings, the losses and the largest relative differences."""
    from flax.training import train_state

    import zeropp_jax as zpp

    def apply(variables, tokens, mask, positions):  # noqa: ANN001, ANN202
        return module.apply(variables, tokens, mask, positions, deterministic=True)

    tx = OPTIMIZERS[tx_name]()
    if quantized:
        config = zpp.ZeroPPConfig(compute_dtype=jnp.float32)
    else:
        config = zpp.ZeroPPConfig(weight_bits=None, grad_bits=None, compute_dtype=jnp.float32)
    mesh = zpp.make_mesh(2, 4)
    state = zpp.TrainState.create(apply_fn=apply, params=params, tx=tx, mesh=mesh, config=config)
    ref = train_state.TrainState.create(apply_fn=apply, params=params, tx=tx)
    step, ref_step = zpp.shard(train_step), jax.jit(train_step)
    loss_err, losses = 0.0, None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for b in batches():
            state, m = step(state, b)
            ref, rm = ref_step(ref, b)
            losses = (float(m["loss"]), float(rm["loss"]))
            loss_err = max(loss_err, abs(losses[0] / losses[1] - 1))
    whole = [str(w.message) for w in caught if "gather" in str(w.message).lower()]
    got = jax.tree_util.tree_flatten_with_path(zpp.gather_params(state))[0]
    want = jax.tree_util.tree_leaves(ref.params)
    errs = {
        jax.tree_util.keystr(k): (
            float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / np.max(np.abs(np.asarray(b)))),
            np.ndim(b),
        )
        for (k, a), b in zip(got, want, strict=True)
    }
    return {"warnings": whole, "loss_err": loss_err, "errs": errs, "losses": losses}


def error_cells(errs: dict) -> dict:
    """The largest relative difference over the matrices, and the leaf with the largest."""
    worst = max(errs, key=lambda k: errs[k][0])
    matrices = max(e for e, ndim in errs.values() if ndim >= 2)
    return {
        "max rel err, matrices": f"{matrices:.1e}",
        "max rel err, any leaf": f"{errs[worst][0]:.1e} ({worst})",
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hf", required=True, help="folder transformers 4.x is installed into")
    p.add_argument("--out", default=str(_common.study_dir("hf_flax_probe")))
    args = p.parse_args(argv)
    machine = _common.machine_line()
    sys.path.insert(0, args.hf)
    import importlib.metadata

    version = importlib.metadata.version("transformers")
    rows = []
    for name in ("gpt2", "llama"):
        module, params = build(name)
        shapes = sorted({tuple(x.shape) for x in jax.tree_util.tree_leaves(params)}, key=len)
        for tx_name in OPTIMIZERS:
            r = run(module, params, tx_name)
            rows.append(
                {
                    "model": name,
                    "engine": "ZeRO-3 unquantized",
                    "optimizer": tx_name,
                    **error_cells(r["errs"]),
                    "max rel err, loss": f"{r['loss_err']:.1e}",
                    "whole-gather warnings": len(r["warnings"]),
                }
            )
            print(rows[-1], flush=True)
        r = run(module, params, "adam", quantized=True)
        rows.append(
            {
                "model": name,
                "engine": "ZeRO++ defaults",
                "optimizer": "adam",
                **error_cells(r["errs"]),
                "max rel err, loss": f"{r['loss_err']:.1e} (loss {r['losses'][0]:.4f} "
                f"against {r['losses'][1]:.4f})",
                "whole-gather warnings": len(r["warnings"]),
            }
        )
        print(rows[-1], f"leaf shapes {shapes}", flush=True)
    head = (
        "# Hugging Face Flax models under zpp.shard\n\n"
        f"{machine}; transformers {version}\n\n"
        "`FlaxGPT2LMHeadModel` and `FlaxLlamaForCausalLM` (d_model 64, 2 layers, 4 heads, "
        f"vocabulary {VOCAB}, sequence {SEQ}, batch {BATCH}, float32, random weights from "
        f"seed 0), {STEPS} steps of next-token cross-entropy under `zpp.shard` on a 2 x 4 "
        "mesh against `jax.jit` on one device; the largest relative difference of the "
        "trained values (over the leaf's largest magnitude), over the matrices and over every "
        "leaf (naming it), and of the losses. Command: "
        "`python experiments/hf_flax_probe.py --hf /tmp/hf`.\n\n"
    )
    out = pathlib.Path(args.out)
    table = _common.markdown_table(list(rows[0]), [list(r.values()) for r in rows])
    _common.write_text(out / "hf_flax_probe.md", head + table)
    _common.say_written([out / "hf_flax_probe.md"])


if __name__ == "__main__":
    main()
