"""The flags of `zeropp-train`: the parser and the checks that need no devices.

A bad flag or flag combination raises `UsageError`, which the CLI prints as one line
(`zeropp-train: error: ...`) with exit status 2.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence

from zeropp_jax._config import KERNELS, SHARED_GRAD
from zeropp_jax.train.data_flags import add_data_flags, check_data, resolve_vocab_size
from zeropp_jax.train.flag_types import (
    UsageError,
    bit_width,
    hop_bit_width,
    non_negative_int,
    positive_int,
)
from zeropp_jax.train.presets import default_preset, preset_defaults

PROG = "zeropp-train"

ENGINES = ("zeropp", "zero3", "xla-fsdp")
"""The values of `--engine`."""
OPTIMIZERS = ("adamw", "adafactor", "muon", "lion")
"""The values of `--optimizer` (`zeropp_jax.train.optimizers`)."""
MUON_GATHERS = ("bfloat16", "float32", "int8", "optax")
"""The values of `--muon-gather`: `zeropp_jax.muon`'s gather formats, or optax's own Muon."""
MODELS = ("tiny", "125m", "350m", "1.3b", "6.7b")
"""The values of `--model` (the keys of `zeropp_jax.train.model.PRESETS`)."""
PRESETS = ("zeropp", "beyond", "muon")
"""The values of `--preset` (`ZeroPPConfig()`, `ZeroPPConfig.beyond()`, `ZeroPPConfig.muon()`)."""
REMATS = ("none", "matmuls", "full")
"""The values of `--remat` (`zeropp_jax.train.model.REMAT`)."""


DESCRIPTION = """\
Train a GPT on your own text (--data), or by default a byte-level GPT on the source files
of the Python standard library (read from this interpreter's install; nothing is
downloaded), with ZeRO++: int8 weight gathers, a
secondary weight shard inside each node (hpZ) and int4 two-hop gradient reduction, over a
('node', 'local') mesh. Without an accelerator it emulates 8 CPU devices as a 2 x 4 mesh.
At the end it prints the losses, the throughput and one step's communication ledger
against plain ZeRO-3. Under --out it writes run.json (the flags and the code's commit),
metrics.jsonl, summary.json and checkpoints/step_<n>."""

EPILOG = """\
examples:
  zeropp-train                                   the embedded default (minutes on a CPU)
  zeropp-train --engine zero3 --out runs/zero3   the same run with plain ZeRO-3
  zeropp-train --engine xla-fsdp                 XLA's own FSDP (jax.jit, sharded state)
  zeropp-train --preset beyond                   ZeRO++ with int2 weight deltas across
                                                 nodes (ZeroPPConfig.beyond())
  zeropp-train --data my_texts/ --out runs/mine  train on a folder of your own text files
  zeropp-sample --out runs/mine --prompt "Once"  sample from that run's last checkpoint
  zeropp-tokenize --data my_texts/ --vocab-size 4096 --out tok
                                                 a BPE learned offline, and token files:
                                                 --data tok/train.bin --val-data tok/val.bin
                                                 --tokenizer tok/tokenizer.json
  zeropp-train --model 1.3b --remat full --batch 8 --plan
                                                 memory per device and bytes per step of a
                                                 1.3B-parameter step, compiled from shapes
  zeropp-train --out runs/zero3 --resume --engine zero3
                                                 continue a run from its last checkpoint
  zeropp-train --coordinator host0:1234 --num-processes 2 --process-id 0 --out /shared/r
                                                 host 0 of a two-host job (host 1: id 1)
  python -m zeropp_jax.launch --nodes 2 --local 4 -- zeropp-train --out runs/rehearsal
                                                 the two-host job rehearsed on this machine

exit status: 0 done; 1 a checkpoint could not be written; 2 a bad flag (one line on
stderr); 3 stopped by SIGTERM or SIGINT after checkpointing the step (continue with
--resume)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage block
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    """The flags of `zeropp-train`."""
    p = _Parser(
        prog=PROG,
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_flags(p.add_argument_group("model"))
    _add_training_flags(p.add_argument_group("training"))
    add_data_flags(p)
    g = p.add_argument_group("mesh and ZeRO++")
    _add_mesh_flags(g)
    _add_wire_flags(g)
    _add_engine_flags(g)
    _add_output_flags(p.add_argument_group("output and checkpoints"))
    g = p.add_argument_group("multi-host (jax.distributed)")
    g.add_argument("--coordinator", default=None, help="coordinator address host:port")
    g.add_argument("--num-processes", type=positive_int, default=None, help="processes in the job")
    g.add_argument("--process-id", type=non_negative_int, default=None, help="this process's id")
    g.add_argument(
        "--distributed",
        action="store_true",
        help="call jax.distributed.initialize() with cluster auto-detection",
    )
    return p


def _add_model_flags(g: argparse._ArgumentGroup) -> None:
    """The GPT's size and shape: `--model` and the flags that override it."""
    g.add_argument(
        "--model",
        choices=MODELS,
        default="tiny",
        help="GPT size: tiny (0.8M parameters with bytes) or GPT-3's shapes: 125m, 350m, "
        "1.3b, 6.7b (tiny); the four flags below override its width, depth, heads and "
        "context; the vocabulary follows the tokenizer (see --vocab-size)",
    )
    g.add_argument("--d-model", type=positive_int, default=None, help="residual width (tiny: 128)")
    g.add_argument(
        "--n-layers", type=positive_int, default=None, help="transformer blocks (tiny: 4)"
    )
    g.add_argument("--n-heads", type=positive_int, default=None, help="attention heads (tiny: 4)")
    g.add_argument(
        "--seq-len",
        type=positive_int,
        default=None,
        help="tokens per sequence, and the learned position table's length (tiny: 128, "
        "others 2048)",
    )
    g.add_argument(
        "--scan-layers",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run the blocks as one nn.scan over stacked weights, each layer gathered inside "
        "the loop (on); --no-scan-layers: separately named blocks",
    )
    g.add_argument(
        "--remat",
        choices=REMATS,
        default="none",
        help="what the backward keeps of each block: none (everything, no recomputation), "
        "matmuls (the matmul outputs) or full (only the block's input) (none)",
    )
    g.add_argument(
        "--attn-chunk",
        type=non_negative_int,
        default=None,
        help="queries per attention chunk, each recomputed in the backward so that one "
        "chunk's scores are live at a time; 0 (or at least --seq-len): the whole sequence "
        "(tiny: 0, others 256)",
    )
    g.add_argument(
        "--loss-chunks",
        type=positive_int,
        default=None,
        help="vocabulary pieces the output head and loss run in, never holding the whole "
        "logits (and row ranges of the lookup's gradient); must divide the vocabulary "
        "(tiny: 1, others 16)",
    )


def _add_training_flags(g: argparse._ArgumentGroup) -> None:
    """Steps, batch, learning rate, optimizer, seed and evaluation."""
    g.add_argument("--steps", type=positive_int, default=200, help="optimizer steps (200)")
    g.add_argument("--batch", type=positive_int, default=32, help="global batch, sequences (32)")
    g.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (3e-3)")
    g.add_argument(
        "--warmup",
        type=non_negative_int,
        default=None,
        help="warmup steps (default: min(100, steps // 10))",
    )
    g.add_argument(
        "--min-lr-ratio",
        type=float,
        default=0.1,
        help="final learning rate as a fraction of --lr (0.1)",
    )
    g.add_argument(
        "--optimizer",
        choices=OPTIMIZERS,
        default="adamw",
        help="adamw, adafactor, muon (Newton-Schulz on the kernels, AdamW on the rest) or "
        "lion; each sees the model's own shapes under every engine (adamw)",
    )
    g.add_argument(
        "--muon-gather",
        choices=MUON_GATHERS,
        default=None,
        help="how --optimizer muon reaches whole matrices: bfloat16, float32 or int8 "
        "(zeropp_jax.muon: each matrix's momentum gathered once, in that format) or optax "
        "(optax.contrib.muon: XLA gathers rows at every Newton-Schulz product, in float32) "
        "(bfloat16 under zeropp and zero3; optax under xla-fsdp, what its users run)",
    )
    g.add_argument(
        "--weight-decay",
        type=float,
        default=0.1,
        help="weight decay on the matrices (kernels, token and position embeddings), "
        "never on biases or LayerNorm parameters (0.1)",
    )
    g.add_argument("--seed", type=int, default=0, help="parameter init and data order (0)")
    g.add_argument(
        "--eval-every",
        type=non_negative_int,
        default=100,
        help="steps between validation passes, 0 = only at the end (100)",
    )
    g.add_argument(
        "--eval-batches", type=positive_int, default=8, help="validation batches per pass (8)"
    )
    g.add_argument(
        "--max-corpus-mb",
        type=positive_int,
        default=16,
        help="MB of stdlib source read at start-up, for the built-in corpus (16)",
    )


def _add_mesh_flags(g: argparse._ArgumentGroup) -> None:
    """The mesh's axis sizes and the `--preset` of the ZeRO++ flags."""
    g.add_argument(
        "--nodes",
        type=positive_int,
        default=None,
        help="size of the 'node' axis (default: 2 on emulated CPU devices, one per process "
        "under zeropp_jax.launch, else one per host)",
    )
    g.add_argument(
        "--local",
        type=positive_int,
        default=None,
        help="size of the 'local' axis (default: devices / nodes)",
    )
    g.add_argument(
        "--model-parallel",
        type=positive_int,
        default=1,
        metavar="K",
        help="tensor parallelism: split the GPT Megatron-style over a 'model' axis of K "
        "devices inside each node (attention heads and the MLP's first matrix by column, "
        "their output matrices by row, the token embedding by vocabulary); --local then "
        "counts data-parallel ranks per node (1)",
    )
    g.add_argument(
        "--preset",
        choices=PRESETS,
        default=None,
        help="the defaults of the flags below: zeropp (the paper's ZeRO++), beyond "
        "(ZeroPPConfig.beyond(): ZeRO++ with int2 weight deltas across nodes, half its bytes "
        "on the node link) or muon (ZeroPPConfig.muon(): ZeRO++ with int8 gradients, which "
        "Muon tolerates); flags given explicitly still override it (muon with --optimizer "
        "muon, else zeropp; the trainer prints which)",
    )


def _add_wire_flags(g: argparse._ArgumentGroup) -> None:
    """Bits, rotation and error feedback on the weight gathers and gradient hops."""
    g.add_argument(
        "--weight-bits",
        type=bit_width,
        default=8,
        help="qwZ: bits on the weight all-gathers, 8/4/2/none (8)",
    )
    g.add_argument(
        "--grad-bits",
        type=bit_width,
        default=4,
        help="qgZ: bits on the gradient reduction, 8/4/2/none (4)",
    )
    g.add_argument(
        "--grad-node-bits",
        type=hop_bit_width,
        default="same",
        help="bits on gradient hop 2 (across nodes), 8/4/2/none/same (same: --grad-bits)",
    )
    g.add_argument(
        "--weight-delta-bits",
        type=bit_width,
        default=None,
        help="send int weight deltas across nodes against the kept secondary shard, "
        "8/4/2/none (none: full weights every step)",
    )
    g.add_argument(
        "--weight-local-bits",
        type=hop_bit_width,
        default="same",
        help="bits on the intra-node weight gather stage, 8/4/2/none/same (same: as sent)",
    )
    g.add_argument(
        "--grad-rotation",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="rotate each gradient hop's quantization blocks with a block Hadamard "
        "rotation before quantizing, and back after the sum (off)",
    )
    g.add_argument(
        "--grad-node-rotation",
        choices=("same", "on", "off"),
        default="same",
        help="the rotation on gradient hop 2 (across nodes): on, off or same (same: "
        "--grad-rotation)",
    )
    g.add_argument(
        "--grad-rotation-block-size",
        type=positive_int,
        default=None,
        help="values per rotation block, a power of two dividing each rotated hop's block "
        "size (default: the whole quantization block)",
    )
    g.add_argument(
        "--error-feedback",
        choices=("none", "node", "all"),
        default="none",
        help="error feedback on the gradient hops: none, node (cross-node hop) or all (none)",
    )
    g.add_argument(
        "--error-feedback-decay",
        type=float,
        default=1.0,
        help="factor on the carried residual, in (0, 1] (1.0)",
    )
    g.add_argument(
        "--error-feedback-reset",
        type=non_negative_int,
        default=0,
        help="zero the residuals every this many steps, 0 = never (0)",
    )


def _add_engine_flags(g: argparse._ArgumentGroup) -> None:
    """hpZ, block sizes, dtype, kernels and the engine choice."""
    g.add_argument(
        "--shared-grad",
        choices=SHARED_GRAD,
        default="auto",
        help="gradient of the tied embedding (read by the lookup and the head): once (sum "
        "the uses, reduce once; holds the head's full gradient through the backward), "
        "per_use (reduce each use's as it is made: less memory, one more reduction of "
        "the table per step), or auto (per_use where the held gradient would exceed a "
        "fifth of the device's master weights, else once) (auto)",
    )
    g.add_argument(
        "--no-hierarchical",
        action="store_true",
        help="hpZ off: no secondary weight shard inside each node",
    )
    g.add_argument(
        "--weight-block-size",
        type=positive_int,
        default=256,
        help="values per quantization block on weight gathers (256)",
    )
    g.add_argument(
        "--grad-block-size",
        type=positive_int,
        default=256,
        help="values per quantization block on the gradient reduction (256)",
    )
    g.add_argument(
        "--compute-dtype",
        choices=("bfloat16", "float32", "float16"),
        default="bfloat16",
        help="dtype the model runs in (bfloat16)",
    )
    g.add_argument(
        "--kernels",
        choices=KERNELS,
        default="auto",
        help="quantizer implementation (auto: Pallas on GPU, XLA elsewhere)",
    )
    g.add_argument(
        "--zero3",
        action="store_true",
        help="plain ZeRO-3 baseline: no quantization, no secondary shard "
        "(overrides --weight-bits, --grad-bits, --grad-node-bits, --weight-local-bits, "
        "--weight-delta-bits, --error-feedback, --grad-rotation, --no-hierarchical); the "
        "same as --engine zero3",
    )
    g.add_argument(
        "--engine",
        choices=ENGINES,
        default=None,
        help="zeropp (this library, as the flags above configure it), zero3 (this "
        "library's plain ZeRO-3) or xla-fsdp (the same train_step under jax.jit with "
        "parameters and optimizer state sharded over all devices, XLA's collectives; "
        "writes no checkpoints) (zeropp)",
    )


def _add_output_flags(g: argparse._ArgumentGroup) -> None:
    """The run directory, checkpoints, ledger, progress bar and `--plan`."""
    g.add_argument("--out", default=None, help="output directory (default: runs/<--name>)")
    g.add_argument(
        "--name",
        default=None,
        help="run name under runs/ when --out is not given (default: a timestamp)",
    )
    g.add_argument(
        "--resume", action="store_true", help="continue the run in --out from its latest checkpoint"
    )
    g.add_argument(
        "--save-every",
        type=non_negative_int,
        default=100,
        help="steps between checkpoints, 0 = only at the end (100)",
    )
    g.add_argument(
        "--no-ledger", action="store_true", help="skip the communication ledger in the summary"
    )
    g.add_argument("--no-progress", action="store_true", help="no progress bar")
    g.add_argument(
        "--plan",
        action="store_true",
        help="train nothing: compile the step from shapes alone and print its memory per "
        "device (XLA's memory analysis beside the analytic estimate) and its bytes per step",
    )
    g.add_argument(
        "--no-memory-check",
        action="store_true",
        help="run even when XLA's memory analysis says a step needs more than a device has",
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parses and checks flags that need no devices. Raises `UsageError`."""
    parser = build_parser()
    known = parser.parse_known_args(argv)[0]
    preset = known.preset or default_preset(known)
    parser.set_defaults(**preset_defaults(preset))
    args = parser.parse_args(argv)
    args.preset_given = args.preset is not None
    args.preset = preset
    if (
        args.preset_given
        and args.preset != "zeropp"
        and (args.zero3 or args.engine not in (None, "zeropp"))
    ):
        raise UsageError(
            f"--preset {args.preset} configures this library's ZeRO++ engine; drop --zero3 "
            "or --engine, or the preset"
        )
    if args.zero3 and args.engine not in (None, "zero3"):
        raise UsageError(f"--zero3 and --engine {args.engine} disagree; give one of them")
    args.engine = "zero3" if args.zero3 else (args.engine or "zeropp")
    args.zero3 = args.engine == "zero3"
    if args.engine == "xla-fsdp" and args.resume:
        raise UsageError(
            "--engine xla-fsdp is a comparison baseline and writes no checkpoints, so there "
            "is nothing to --resume; use --engine zeropp or zero3"
        )
    if args.zero3:
        args.weight_bits, args.grad_bits, args.no_hierarchical = None, None, True
        args.grad_node_bits, args.weight_delta_bits = "same", None
        args.weight_local_bits, args.error_feedback = "same", "none"
        args.grad_rotation, args.grad_node_rotation = False, "same"
        args.grad_rotation_block_size = None
    if args.muon_gather is None:
        args.muon_gather = "optax" if args.engine == "xla-fsdp" else "bfloat16"
    check_data(args)
    _resolve_model(args)
    if args.d_model % args.n_heads:
        raise UsageError(f"--n-heads {args.n_heads} does not divide --d-model {args.d_model}")
    _check_model_parallel(args)
    if not args.lr > 0 or not math.isfinite(args.lr):
        raise UsageError(f"--lr must be a positive number, got {args.lr}")
    if not 0 <= args.min_lr_ratio <= 1:
        raise UsageError(f"--min-lr-ratio must lie in [0, 1], got {args.min_lr_ratio}")
    if args.resume and args.out is None:
        raise UsageError("--resume needs --out DIR, the directory of the run to continue")
    multi = (args.coordinator, args.num_processes, args.process_id)
    if any(v is not None for v in multi) and any(v is None for v in multi):
        raise UsageError("--coordinator, --num-processes and --process-id go together")
    if args.num_processes is not None and args.process_id >= args.num_processes:
        raise UsageError(
            f"--process-id {args.process_id} must be below --num-processes {args.num_processes}"
        )
    if args.distributed and args.coordinator is not None:
        raise UsageError("give either --distributed (auto-detect) or --coordinator, not both")
    return args


def _check_model_parallel(args: argparse.Namespace) -> None:
    """Raises `UsageError` for a `--model-parallel` the model or the flags cannot take."""
    k = args.model_parallel
    if k == 1:
        return
    if args.n_heads % k:
        raise UsageError(
            f"--model-parallel {k} does not divide --n-heads {args.n_heads}; each model rank "
            "holds whole heads, so pick a divisor of the head count"
        )
    if args.weight_delta_bits is not None or args.error_feedback != "none":
        raise UsageError(
            f"--model-parallel {k} cannot yet be combined with --weight-delta-bits or "
            "--error-feedback; leave them at none"
        )
    if args.plan:
        raise UsageError(
            f"--plan's analytic estimate does not model --model-parallel {k} yet; without "
            "--plan the trainer still checks XLA's memory analysis before the first step"
        )


def _resolve_model(args: argparse.Namespace) -> None:
    """Fills the model flags left unset from the `--model` preset and sets `vocab_size`
    (`resolve_vocab_size`): `--vocab-size`, else the tokenizer's rounded up to
    `VOCAB_MULTIPLE`; with the built-in
    corpus in bytes, the preset's (GPT-2's 50304 for the GPT-3 sizes, 256 for tiny)."""
    from zeropp_jax.train.model import PRESETS

    preset = PRESETS[args.model]
    for name in ("d_model", "n_layers", "n_heads", "seq_len", "attn_chunk", "loss_chunks"):
        if getattr(args, name) is None:
            setattr(args, name, getattr(preset, name))
    resolve_vocab_size(args, preset.vocab_size)
    if 0 < args.attn_chunk < args.seq_len and args.seq_len % args.attn_chunk:
        raise UsageError(
            f"--attn-chunk {args.attn_chunk} does not divide --seq-len {args.seq_len}; pick "
            "a divisor of the sequence length, or 0 for no chunks"
        )
    if args.vocab_size % args.loss_chunks:
        raise UsageError(
            f"--loss-chunks {args.loss_chunks} does not divide the vocabulary "
            f"({args.vocab_size} tokens); pick a divisor of it, or 1 for no chunks"
        )


def gpt_config(args: argparse.Namespace):
    """The `GPTConfig` the (parsed) model flags describe."""
    from zeropp_jax.train.model import GPTConfig

    return GPTConfig(
        vocab_size=args.vocab_size,
        seq_len=args.seq_len,
        d_model=args.d_model,
        n_layers=args.n_layers,
        n_heads=args.n_heads,
        scan=args.scan_layers,
        remat=args.remat,
        attn_chunk=args.attn_chunk,
        loss_chunks=args.loss_chunks,
        model_parallel=args.model_parallel > 1,
    )


# ZeroPPConfig fields whose flag is not `--<field>`.
_FIELD_FLAGS = {"hierarchical": "--no-hierarchical"}


def _flags_named_in(message: str, args: argparse.Namespace) -> str:
    """`--flag value` for each `ZeroPPConfig.<field>` a config error names, e.g.
    `--grad-block-size 7`; empty when it names none."""
    import re

    named = []
    for field in dict.fromkeys(re.findall(r"ZeroPPConfig\.(\w+)", message)):
        flag = _FIELD_FLAGS.get(field, "--" + field.replace("_", "-"))
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            named.append(flag if isinstance(value, bool) else f"{flag} {value}")
    return ", ".join(named)


def zeropp_config(args: argparse.Namespace):
    """The `ZeroPPConfig` the flags describe; a config error names the flags it came from."""
    try:
        return _config(args)
    except ValueError as e:
        flags = _flags_named_in(str(e), args)
        raise UsageError(f"{flags}: {e}" if flags else str(e)) from None


def _config(args: argparse.Namespace):
    import zeropp_jax as zpp

    return zpp.ZeroPPConfig(
        weight_bits=args.weight_bits,
        weight_block_size=args.weight_block_size,
        hierarchical=not args.no_hierarchical,
        grad_bits=args.grad_bits,
        grad_block_size=args.grad_block_size,
        grad_node_bits=args.grad_node_bits,
        weight_delta_bits=args.weight_delta_bits,
        weight_local_bits=args.weight_local_bits,
        error_feedback=None if args.error_feedback == "none" else args.error_feedback,
        error_feedback_decay=args.error_feedback_decay,
        error_feedback_reset=args.error_feedback_reset,
        compute_dtype=args.compute_dtype,
        kernels=args.kernels,
        shared_grad=args.shared_grad,
        grad_rotation=args.grad_rotation,
        grad_node_rotation={"on": True, "off": False}.get(args.grad_node_rotation, "same"),
        grad_rotation_block_size=args.grad_rotation_block_size,
    )
