"""The built-in corpus (the Python standard library's own `.py` files, as bytes) and the
batches of every corpus.

Every machine with Python has it, so convergence runs need no download. Files are read at
run time from the running interpreter's stdlib directory (site-packages excluded), in
sorted order, up to a byte budget. Tokens are bytes (ids 0..255). The validation split is
chosen per file by a stable hash of its relative path, so it never shares a file with the
training split and does not move when the budget changes.

Batches are a pure function of `(seed, step)`: a resumed run continues at the same data
position without replaying anything, and every process of a multi-host job draws the same
window starts for the global batch and reads only its own rows. The user's own corpus
(`--data`) is read by `zeropp_jax.train.corpus`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import queue
import sysconfig
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DEFAULT_MAX_BYTES = 16 * 2**20
VAL_PERCENT = 5
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}
_EVAL_STREAM = 2**31 - 1  # seeds the validation batches apart from the training steps


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Token ids of the two splits, each the concatenation of its files.

    Attributes:
      train: ids, shape (n_train,): an int32 array, or `zeropp_jax.train.corpus.Tokens`.
      val: ids, shape (n_val,), likewise.
      train_files: relative paths in the training split.
      val_files: relative paths in the validation split.
      unit: what one id is, "byte" or "token" (for the messages).
      bytes_per_token: UTF-8 bytes of validation text per id (for bits per byte), or None
        where unknown (token files read without a tokenizer).
      description: where the corpus came from, for the start-up line.
    """

    train: Any
    val: Any
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    unit: str = "byte"
    bytes_per_token: float | None = 1.0
    description: str = "the standard library's .py files"


def stdlib_dir() -> str:
    """The running interpreter's standard library directory."""
    return sysconfig.get_paths()["stdlib"]


def list_source_files(root: str) -> list[str]:
    """Relative paths of the `.py` files under `root`, sorted; site-packages skipped."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                found.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(found)


def is_validation(relpath: str, val_percent: int = VAL_PERCENT) -> bool:
    """Whether a file belongs to the validation split (stable across runs and machines)."""
    digest = hashlib.sha256(relpath.replace(os.sep, "/").encode()).digest()
    return int.from_bytes(digest[:8], "little") % 100 < val_percent


def load_corpus(
    root: str | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES, val_percent: int = VAL_PERCENT
) -> Corpus:
    """Reads the corpus: files in sorted order until `max_bytes` have been read.

    Args:
      root: directory to read (default: the stdlib of the running interpreter).
      max_bytes: budget of bytes read over both splits; keeps start-up fast.
      val_percent: share of files, in percent, that go to the validation split.

    Raises:
      ValueError: when either split comes out empty.
    """
    root = stdlib_dir() if root is None else root
    parts: dict[bool, list[bytes]] = {False: [], True: []}
    names: dict[bool, list[str]] = {False: [], True: []}
    total = 0
    for rel in list_source_files(root):
        if total >= max_bytes:
            break
        try:
            with open(os.path.join(root, rel), "rb") as f:
                data = f.read()
        except OSError:
            continue
        if not data:
            continue
        split = is_validation(rel, val_percent)
        parts[split].append(data)
        names[split].append(rel)
        total += len(data)
    if not parts[False] or not parts[True]:
        raise ValueError(
            f"load_corpus: {root!r} gave {len(names[False])} training and {len(names[True])} "
            f"validation files within max_bytes={max_bytes}; both splits need at least one "
            "file. Raise max_bytes or point root at a larger directory."
        )

    def tokens(chunks: list[bytes]) -> np.ndarray:
        return np.frombuffer(b"".join(chunks), dtype=np.uint8).astype(np.int32)

    return Corpus(
        tokens(parts[False]), tokens(parts[True]), tuple(names[False]), tuple(names[True])
    )


ENTROPY_SAMPLE = 2**24
"""Tokens of a `Tokens` corpus (its first ones) that `unigram_entropy` counts."""


def unigram_entropy(tokens: Any, vocab_size: int = 256) -> float:
    """Entropy of the token frequencies, in nats per token (the loss of the best model that
    ignores context). Divide by ln 2 for bits. Of a `Tokens` corpus, its first
    `ENTROPY_SAMPLE` tokens are counted."""
    if not isinstance(tokens, np.ndarray):
        tokens = tokens.slice(0, min(len(tokens), ENTROPY_SAMPLE))
    counts = np.bincount(tokens, minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def check_windows(corpus: Corpus, seq_len: int) -> None:
    """Raises `ValueError` unless both splits hold a window of `seq_len + 1` tokens."""
    for name, tokens in (("training", corpus.train), ("validation", corpus.val)):
        if len(tokens) < seq_len + 1:
            raise ValueError(
                f"--seq-len {seq_len}: the {name} split holds {len(tokens)} {corpus.unit}"
                f"{'s' * (len(tokens) != 1)}, "
                f"fewer than one sequence of seq_len + 1 = {seq_len + 1}; give more data or a "
                "shorter --seq-len"
            )


def batch_starts(num_tokens: int, *, seed: int, step: int, batch_size: int, seq_len: int):
    """Where each window of one step's global batch starts: int64 (batch_size,), a pure
    function of `(seed, step)` and the corpus length."""
    span = seq_len + 1
    if num_tokens < span:
        raise ValueError(
            f"sample_batch: {num_tokens} tokens cannot hold a window of seq_len + 1 = {span}."
        )
    rng = np.random.default_rng([seed, step])
    return rng.integers(0, num_tokens - span + 1, size=batch_size)


def windows(tokens: Any, starts: np.ndarray, span: int) -> np.ndarray:
    """int32 (len(starts), span): the `span` tokens from each start (an array or `Tokens`)."""
    if isinstance(tokens, np.ndarray):
        return tokens[starts[:, None] + np.arange(span)].astype(np.int32)
    return tokens.windows(starts, span)


def sample_batch(
    tokens: Any,
    *,
    seed: int,
    step: int,
    batch_size: int,
    seq_len: int,
    rows: slice = slice(None),
) -> np.ndarray:
    """The batch for one step: `batch_size` windows of `seq_len + 1` consecutive tokens.

    A pure function of `(seed, step)` (and the corpus): window starts are drawn from a
    generator seeded by both, so any step's batch can be computed without the ones before.
    Only the windows of `rows` are read (a process of a multi-host job reads its own).

    Returns:
      int32 array of shape (batch_size, seq_len + 1) — the global batch — or its `rows`.
    """
    starts = batch_starts(len(tokens), seed=seed, step=step, batch_size=batch_size, seq_len=seq_len)
    return windows(tokens, starts[rows], seq_len + 1)


def eval_batches(
    tokens: Any,
    *,
    seed: int,
    num_batches: int,
    batch_size: int,
    seq_len: int,
    rows: slice = slice(None),
) -> list[np.ndarray]:
    """A fixed list of validation batches (the same at every evaluation of a run); of
    each, the `rows` only."""
    return [
        sample_batch(
            tokens,
            seed=seed,
            step=_EVAL_STREAM - i,
            batch_size=batch_size,
            seq_len=seq_len,
            rows=rows,
        )
        for i in range(num_batches)
    ]


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows of the batch split over all devices, node-major: `P(('node', 'local'))`."""
    return NamedSharding(mesh, PartitionSpec(("node", "local")))


def process_rows(sharding: NamedSharding, global_batch: int) -> slice:
    """The contiguous rows of the global batch that this process's devices hold.

    Raises:
      ValueError: when the rows of this process are not contiguous (a mesh that interleaves
        processes), which `jax.make_array_from_process_local_data` cannot assemble.
    """
    rows = set()
    for index in sharding.addressable_devices_indices_map((global_batch,)).values():
        rows.update(range(*index[0].indices(global_batch)))
    lo, hi = min(rows), max(rows) + 1
    if len(rows) != hi - lo:
        raise ValueError(
            f"process {jax.process_index()} holds rows that are not contiguous in the global "
            "batch; build the mesh with zeropp_jax.make_mesh so each node holds whole processes."
        )
    return slice(lo, hi)


def local_rows(global_batch_array: np.ndarray, sharding: NamedSharding) -> np.ndarray:
    """This process's rows of a global batch (all rows in a single-process job)."""
    return global_batch_array[process_rows(sharding, global_batch_array.shape[0])]


def make_global_batch(local: np.ndarray, sharding: NamedSharding, global_batch: int) -> jax.Array:
    """Assembles the global batch array from each process's rows.

    Args:
      local: this process's rows, shape (rows_here, seq_len + 1).
      sharding: the batch sharding (see `batch_sharding`).
      global_batch: number of rows over all processes.
    """
    shape = (global_batch,) + tuple(local.shape[1:])
    return jax.make_array_from_process_local_data(sharding, local, shape)


class Prefetcher:
    """Computes the batches of steps `start, start + 1, ..., stop - 1` on a background
    thread, at most `depth` ahead of the consumer.

    Iterate over it to get `(step, batch)` pairs in order; `close()` (or leaving the `with`
    block) stops and joins the thread even if the consumer stopped early. An exception in
    `make_batch` is re-raised in the consumer.
    """

    def __init__(
        self, make_batch: Callable[[int], object], start: int, stop: int, *, depth: int = 1
    ):
        if depth < 1:
            raise ValueError(f"Prefetcher: depth={depth}; expected a positive int.")
        self._make_batch = make_batch
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._range = range(start, stop)
        self._thread = threading.Thread(target=self._run, name="zeropp-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            for step in self._range:
                if not self._put(("ok", step, self._make_batch(step))):
                    return
        except BaseException as e:  # handed to the consumer
            self._put(("error", None, e))
            return
        self._put(("done", None, None))

    def __iter__(self) -> Iterator[tuple[int, object]]:
        while True:
            kind, step, value = self._queue.get()
            if kind == "done":
                return
            if kind == "error":
                raise value
            yield step, value

    def close(self) -> None:
        """Stops the thread and waits for it."""
        self._stop.set()
        self._thread.join()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def bits(nats: float) -> float:
    """Nats to bits."""
    return nats / math.log(2)


def eval_set(
    tokens: Any, mesh: Mesh, *, seed: int, num_batches: int, batch_size: int, seq_len: int
) -> list[jax.Array]:
    """The validation batches as global arrays sharded over the batch (each process reads
    only its own rows of `tokens`), in the order `eval_batches` gives."""
    sharding = batch_sharding(mesh)
    return [
        make_global_batch(rows, sharding, batch_size)
        for rows in eval_batches(
            tokens,
            seed=seed,
            num_batches=num_batches,
            batch_size=batch_size,
            seq_len=seq_len,
            rows=process_rows(sharding, batch_size),
        )
    ]
