"""Stored bytes over the ideal share, per leaf and for the whole state, at N = 8 to 1024.

    python experiments/stored_share.py               # shapes only, seconds
    python experiments/stored_share.py --meshes 2x4,8x8 --out /tmp/s

For each model, from its parameter shapes alone (nothing is initialised; the layout rules
of `zeropp_jax.state._partition` and `zeropp_jax.measure._stored_share`):
the whole state's stored values
per device over its share (`size / N`), and the leaves above 1 MiB (float32) stored above
1.05x their share, with the worst of them. The goals of issue #48: every leaf above 1 MiB at
most 1.05x its share; the whole state at most 1.02x plus 1 MiB per device. Each `N` is a
`nodes x local` mesh (the layout may split a row over both mesh axes,
`partition.fit_grid`); `worst_ratio_one_axis` is the worst such leaf's factor where every
row is split on one axis (stored layout 5).

Models: a conv net (3x3 convolutions, 64 to 512 channels, as a ResNet's stages), an
unscanned `DenseGeneral` attention block (BERT-base widths: 768, 12 heads of 64), MaxText's
Llama-2-7B layout (its decoder scanned on axis 1 of every kernel: `(embed, layers, heads,
head_dim)` and the like; shapes written out from its config, not imported), Hugging
Face's Flax Llama-2-7B (unscanned: one leaf per layer), the trainer's GPT presets (as
`zeropp-train --model` builds them, scanned; `init_fn` traced with `jax.eval_shape`) and the
README's example (`Dense(16)`, `Dense(4)`).

Writes `stored_share.md` and `stored_share.csv` into `--out` (default
`experiments/results`).
"""

from __future__ import annotations

import argparse
import pathlib
from collections.abc import Sequence

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _common import machine_line, study_dir, write_table
from _library import partition as part  # noqa: E402
from _library import stored_share  # noqa: E402

MIB = 2**20


def _f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, jnp.float32)


def conv_net() -> dict:
    """A ResNet-like conv net's kernels: 3x3 convolutions at 64, 128, 256, 512 channels."""
    out = {"stem": _f32(7, 7, 3, 64)}
    for c in (64, 128, 256, 512):
        out[f"conv{c}a"] = _f32(3, 3, c, c)
        out[f"conv{c}b"] = _f32(3, 3, c, c)
        out[f"bn{c}"] = _f32(c)
    out["head"] = _f32(512, 1000)
    return out


def dense_general_attention(layers: int = 12) -> dict:
    """BERT-base's attention as `nn.DenseGeneral` leaves, unscanned (one set per layer)."""
    return {
        f"layer{i}": {
            "query": _f32(768, 12, 64),
            "key": _f32(768, 12, 64),
            "value": _f32(768, 12, 64),
            "out": _f32(12, 64, 768),
            "mlp_in": _f32(768, 3072),
            "mlp_out": _f32(3072, 768),
        }
        for i in range(layers)
    }


def maxtext_llama2_7b() -> dict:
    """MaxText's Llama-2-7B decoder: every layer's kernels stacked on axis 1 (its scan
    axis, `param_scan_axis=1`)."""
    d, L, h, hd, f = 4096, 32, 32, 128, 11008
    return {
        "token_embedder": _f32(32000, d),
        "decoder_norm": _f32(d),
        "logits_dense": _f32(d, 32000),
        "layers": {
            "query": _f32(d, L, h, hd),
            "key": _f32(d, L, h, hd),
            "value": _f32(d, L, h, hd),
            "out": _f32(h, L, hd, d),
            "wi_0": _f32(d, L, f),
            "wi_1": _f32(d, L, f),
            "wo": _f32(f, L, d),
            "pre_self_attention_layer_norm": _f32(d, L),
            "post_self_attention_layer_norm": _f32(d, L),
        },
    }


def hf_flax_llama2_7b() -> dict:
    """Hugging Face's `FlaxLlamaForCausalLM` at Llama-2-7B: one leaf per layer."""
    d, f = 4096, 11008
    layer = {
        "q_proj": _f32(d, d),
        "k_proj": _f32(d, d),
        "v_proj": _f32(d, d),
        "o_proj": _f32(d, d),
        "gate_proj": _f32(d, f),
        "up_proj": _f32(d, f),
        "down_proj": _f32(f, d),
        "input_layernorm": _f32(d),
        "post_attention_layernorm": _f32(d),
    }
    out = {f"layers_{i}": dict(layer) for i in range(32)}
    out.update(embed_tokens=_f32(32000, d), norm=_f32(d), lm_head=_f32(d, 32000))
    return out


def trainer_gpt(name: str) -> dict:
    """`zeropp-train --model <name>`'s GPT as the trainer builds it (scanned layers)."""
    from zeropp_jax.train.flags import gpt_config, parse_args
    from zeropp_jax.train.model import init_fn

    return jax.eval_shape(init_fn(gpt_config(parse_args(["--model", name])), 0).fn)


def readme_example() -> dict:
    return {
        "Dense_0": {"kernel": _f32(6, 16), "bias": _f32(16)},
        "Dense_1": {"kernel": _f32(16, 4), "bias": _f32(4)},
    }


MODELS = {
    "conv net": conv_net,
    "DenseGeneral attention (unscanned)": dense_general_attention,
    "MaxText Llama-2-7B (scan axis 1)": maxtext_llama2_7b,
    "HF Flax Llama-2-7B": hf_flax_llama2_7b,
    **{f"trainer GPT {k}": (lambda k=k: trainer_gpt(k)) for k in ("tiny", "125m", "1.3b", "6.7b")},
    "README example": readme_example,
}


def rows_for(name: str, tree: dict, nodes: int, local: int) -> dict:
    n = nodes * local
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    paths = [jax.tree_util.keystr(p) for p, _ in flat]
    layouts = [
        part.leaf_layout(p, x, n, local_size=local) for p, (_, x) in zip(paths, flat, strict=True)
    ]
    one_axis = [part.leaf_layout(p, x, n) for p, (_, x) in zip(paths, flat, strict=True)]
    big = stored_share.over_share(paths, layouts, n, exempt_bytes=MIB)
    big_one = stored_share.over_share(paths, one_axis, n, exempt_bytes=MIB)
    size = sum(lo.size for lo in layouts)
    ratio = stored_share.state_ratio(layouts, n)
    excess_mib = (ratio - 1) * 4 * size / n / MIB
    share_mib = 4 * size / n / MIB
    worst = big[0] if big else None
    return {
        "model": name,
        "mesh": f"{nodes}x{local}",
        "N": n,
        "params_M": round(size / 1e6, 2),
        "state_ratio": round(ratio, 4),
        "state_excess_MiB_per_device": round(excess_mib, 3),
        "state_goal_met": excess_mib <= 0.02 * share_mib + 1,
        "leaves_over_1MiB_above_1.05x": len(big),
        "worst_leaf": "" if worst is None else f"{worst.path} {worst.shape}",
        "worst_ratio": "" if worst is None else round(worst.ratio, 3),
        "worst_ratio_one_axis": round(big_one[0].ratio, 3) if big_one else "",
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--meshes",
        default="2x4,8x8,16x8,128x8",
        help="comma-separated nodes x local meshes (N = 8, 64, 128, 1024)",
    )
    p.add_argument("--out", type=pathlib.Path, default=study_dir("stored_share"))
    args = p.parse_args(argv)
    rows = [
        rows_for(name, make(), *map(int, mesh.split("x")))
        for name, make in MODELS.items()
        for mesh in args.meshes.split(",")
    ]
    head = (
        "<!-- generated by experiments/stored_share.py -->\n\n"
        "# Stored bytes over the ideal share, per model and device count\n\n"
        f"Machine: {machine_line()}.\n\n"
        + __doc__.split("\n\n", 2)[2].split("\n\nWrites")[0]
        + "\n\n"
    )
    write_table(args.out, "stored_share", head, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
