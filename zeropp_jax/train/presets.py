"""The trainer's presets: the flag defaults each `--preset` gives, the preset `--optimizer`
chooses when none is given, and the lines the trainer prints about those choices."""

from __future__ import annotations

import argparse


def preset_defaults(preset: str) -> dict[str, object]:
    """The flag values (as `argparse` destinations) that give `ZeroPPConfig`'s preset
    `preset` ("zeropp": the defaults, "beyond": `ZeroPPConfig.beyond()`, "muon":
    `ZeroPPConfig.muon()`)."""
    from zeropp_jax._config import ZeroPPConfig

    cfg = {"zeropp": ZeroPPConfig, "beyond": ZeroPPConfig.beyond, "muon": ZeroPPConfig.muon}[
        preset
    ]()
    return dict(
        weight_bits=cfg.weight_bits,
        weight_block_size=cfg.weight_block_size,
        no_hierarchical=not cfg.hierarchical,
        grad_bits=cfg.grad_bits,
        grad_block_size=cfg.grad_block_size,
        grad_node_bits=cfg.grad_node_bits,
        weight_delta_bits=cfg.weight_delta_bits,
        weight_local_bits=cfg.weight_local_bits,
        error_feedback=cfg.error_feedback or "none",
        grad_rotation=cfg.grad_rotation,
        grad_node_rotation={True: "on", False: "off"}.get(cfg.grad_node_rotation, "same"),
        grad_rotation_block_size=cfg.grad_rotation_block_size,
    )


def default_preset(args: argparse.Namespace) -> str:
    """The preset when `--preset` is not given: `muon` for `--optimizer muon` on the ZeRO++
    engine (int4 gradients cost Muon 4.5% in loss; `ZeroPPConfig.muon`), else `zeropp`."""
    zeropp = not args.zero3 and args.engine in (None, "zeropp")
    return "muon" if zeropp and args.optimizer == "muon" else "zeropp"


def preset_note(args: argparse.Namespace) -> str | None:
    """The line the trainer prints when `--optimizer` chose the preset, else None."""
    if args.preset_given or args.preset == "zeropp":
        return None
    return (
        f"--optimizer {args.optimizer} chose --preset {args.preset} (ZeroPPConfig."
        f"{args.preset}(): int8 gradients on both hops, which Muon tolerates; ZeRO++'s int4 "
        "costs it 4.5% in loss); --preset zeropp gives ZeRO++'s defaults"
    )


def muon_note(args: argparse.Namespace) -> str | None:
    """The line the trainer prints for `--optimizer muon` (which Muon runs), else None."""
    if args.optimizer != "muon":
        return None
    if args.muon_gather == "optax":
        return (
            "--optimizer muon: optax.contrib.muon (XLA gathers rows at every Newton-Schulz "
            "product, in float32); --muon-gather bfloat16 gathers each matrix once"
        )
    return (
        f"--optimizer muon: zeropp_jax.muon (each matrix's momentum gathered once, in "
        f"{args.muon_gather}, for Newton-Schulz); --muon-gather optax runs optax.contrib.muon"
    )
