"""The trainer's optimizers (`--optimizer`) and its weight-decay mask.

Every optimizer runs on the model's shapes (the engines hand optax the parameters as the
model declares them; see `zeropp_jax.state._optimizer_view`), so the masks below read names and
per-layer shapes the same way under `zeropp`, `zero3` and `xla-fsdp`, with or without
`--model-parallel`.
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import optax
from optax.contrib import MuonDimensionNumbers

from zeropp_jax import _distributed_muon as distributed_muon
from zeropp_jax.train.flags import OPTIMIZERS

DECAYED = ("kernel", "embedding", "wpe")
"""Names of the GPT's matrices (`zeropp_jax.train.model`): the Dense kernels, the token
embedding (tied output head) and the position embedding. Biases and LayerNorm scales and
biases, stacked by `--scan` or not, are never decayed."""


def _name(path: tuple) -> str:
    """The parameter's own name: the last dict key of its path (boxes add attribute keys
    after it)."""
    keys = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]
    return str(keys[-1]) if keys else ""


def decay_mask(params: Any) -> Any:
    """True for the leaves weight decay applies to (named in `DECAYED`), by name."""
    return jax.tree_util.tree_map_with_path(lambda path, _: _name(path) in DECAYED, params)


def muon_dims(params: Any) -> Any:
    """Muon's dimension numbers: the Dense kernels, a stacked one (`(layers, in, out)`)
    one matrix per layer; None (AdamW) for every other leaf."""

    def dims(path, p):
        if _name(path) != "kernel":
            return None
        return MuonDimensionNumbers(p.ndim - 2, p.ndim - 1)

    return jax.tree_util.tree_map_with_path(dims, params)


def make_optimizer(args: argparse.Namespace) -> optax.GradientTransformation:
    """`--optimizer` with linear warmup and cosine decay of `--lr`, global-norm clipping at
    1.0 and `--weight-decay` on the leaves `decay_mask` selects.

    adamw: b1 0.9, b2 0.95. adafactor: factored second moments (optax defaults). muon:
    Newton-Schulz on every kernel (per layer when stacked), AdamW (b1 0.9, b2 0.95, no
    decay) on the rest; `--muon-gather optax` is `optax.contrib.muon`, a format is
    `zeropp_jax.muon` with each matrix gathered once in it. lion: b1 0.9, b2 0.99
    (take a smaller --lr than for AdamW).
    """
    warmup = min(100, args.steps // 10) if args.warmup is None else args.warmup
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=args.lr,
        warmup_steps=min(warmup, args.steps),
        decay_steps=args.steps,
        end_value=args.lr * args.min_lr_ratio,
    )
    name = getattr(args, "optimizer", "adamw")
    wd = args.weight_decay
    if name == "adamw":
        tx = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=wd, mask=decay_mask)
    elif name == "adafactor":
        tx = optax.adafactor(schedule, weight_decay_rate=wd, weight_decay_mask=decay_mask)
    elif name == "muon":
        gather = getattr(args, "muon_gather", "optax")
        options = dict(
            weight_decay=wd,
            weight_decay_mask=decay_mask,
            adam_b1=0.9,
            adam_b2=0.95,
            muon_weight_dimension_numbers=muon_dims,
        )
        if gather == "optax":
            tx = optax.contrib.muon(schedule, **options)
        else:
            tx = distributed_muon.muon(schedule, **options, gather_format=gather)
    elif name == "lion":
        tx = optax.lion(schedule, b1=0.9, b2=0.99, weight_decay=wd, mask=decay_mask)
    else:
        raise ValueError(f"--optimizer {name!r}; expected one of {OPTIMIZERS}.")
    return optax.chain(optax.clip_by_global_norm(1.0), tx)
