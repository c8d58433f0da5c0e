"""The engines the experiments compare: one registry of names, and one function that
builds each engine's state and step.

Every engine has a display name (what results tables print: "XLA FSDP", "ZeRO-3",
"ZeRO++"), a slug (file names, worker arguments: "xla_fsdp", "zero3", "zeropp"), the
trainer's `--engine` value where it has one ("xla-fsdp", "zero3", "zeropp") and the other
spellings committed results already use for it ("zeropp_delta4", the cluster's name for
"int4-delta"). `lookup` takes any of them and raises for anything else, listing them.

`build(engine, apply_fn=, params=, tx=, mesh=)` returns `(state, make_step)`:
`make_step(train_step)` jits the user's unchanged step for that state, a fresh function
at every call. Engines (`REGISTRY`):

- "one device": flax's `TrainState` under plain `jax.jit`, nothing sharded (the mesh is
  not used); the parameters as given.
- "data parallel": every leaf of XLA FSDP's state replicated on every device, the batch
  split over them (`jax.jit` with those shardings).
- "XLA FSDP": `zeropp_jax.baselines.xla_fsdp_state` and `xla_fsdp_step` (parameters and
  optimizer state sharded over all devices, bfloat16 compute by default).
- "ZeRO-3", "ZeRO++" and the weight-delta presets: `zpp.TrainState.create` (or
  `.abstract`) with the engine's `ZeroPPConfig`, through `zpp.shard`.

The step donates its input state unless `donate=False`.

Importing this module imports neither jax nor zeropp_jax (`build` and `compiled_step`
do): name lookups are free in a parent process. Call `_common.request_cpu_devices(n)`
before the first `build` or `compiled_step` of a process.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

    from zeropp_jax import ZeroPPConfig
    from zeropp_jax.train.model import GPTConfig

KINDS = ("one device", "data parallel", "xla fsdp", "zpp")
"""How an engine runs: plain `jax.jit`; `jax.jit` with a replicated state; XLA's FSDP
(`zeropp_jax.baselines`); this library's engine (`zpp.shard`)."""
PRESETS = ("zeropp", "zero3", "beyond")
"""Where a "zpp" engine's config starts: `ZeroPPConfig()`, `.zero3()` or `.beyond()`."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Engine:
    """One engine of the registry.

    Attributes:
      name: the display name results tables print.
      slug: the identifier for file names and command lines.
      kind: how it runs, one of `KINDS`.
      preset: for kind "zpp", the `ZeroPPConfig` it starts from, one of `PRESETS`.
      fields: for kind "zpp", `ZeroPPConfig` fields set on top of the preset.
      flag: the trainer's `--engine` value for it (`zeropp-train`), or None.
      aliases: other spellings of the engine that results files use.
    """

    name: str
    slug: str
    kind: str
    preset: str | None = None
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    flag: str | None = None
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Engine {self.name!r}: kind={self.kind!r}; expected one of {KINDS}.")
        if (self.kind == "zpp") != (self.preset in PRESETS):
            raise ValueError(
                f"Engine {self.name!r}: kind={self.kind!r} with preset={self.preset!r}; a "
                f"'zpp' engine needs a preset of {PRESETS}, the others none."
            )
        object.__setattr__(self, "fields", types.MappingProxyType(dict(self.fields)))

    @property
    def spellings(self) -> tuple[str, ...]:
        """The name, the slug, the trainer's flag (where it differs) and the aliases."""
        flag = () if self.flag in (None, self.slug) else (self.flag,)
        return (self.name, self.slug, *flag, *self.aliases)

    def config(self, **overrides: Any) -> ZeroPPConfig | None:
        """The engine's `ZeroPPConfig` with `overrides` (fields) applied; None for an
        engine that is not this library's (kind other than "zpp"), which takes none."""
        if self.kind != "zpp":
            if overrides:
                raise ValueError(
                    f"engine {self.name!r} has no ZeroPPConfig; got overrides {sorted(overrides)}."
                )
            return None
        from zeropp_jax import ZeroPPConfig

        fields = {**self.fields, **overrides}
        if self.preset == "zeropp":
            return ZeroPPConfig(**fields)
        return getattr(ZeroPPConfig, self.preset)(**fields)


REGISTRY: tuple[Engine, ...] = (
    Engine(name="one device", slug="one_device", kind="one device"),
    Engine(name="data parallel", slug="data_parallel", kind="data parallel"),
    Engine(name="XLA FSDP", slug="xla_fsdp", kind="xla fsdp", flag="xla-fsdp"),
    Engine(name="ZeRO-3", slug="zero3", kind="zpp", preset="zero3", flag="zero3"),
    Engine(name="ZeRO++", slug="zeropp", kind="zpp", preset="zeropp", flag="zeropp"),
    Engine(
        name="int4-delta",
        slug="int4_delta",
        kind="zpp",
        preset="zeropp",
        fields={"weight_delta_bits": 4},
        aliases=("zeropp_delta4",),
    ),
    Engine(
        name="int2-delta",
        slug="int2_delta",
        kind="zpp",
        preset="beyond",
        aliases=("zeropp_delta2",),
    ),
    Engine(
        name="int2-delta rotated",
        slug="int2_delta_rotated",
        kind="zpp",
        preset="zeropp",
        fields={"weight_delta_bits": 2, "grad_bits": 8, "grad_node_bits": 4, "grad_rotation": True},
        aliases=("beyond_d2",),
    ),
)
"""Every engine. "int4-delta": ZeRO++ with int4 weight deltas across nodes;
"int2-delta": `ZeroPPConfig.beyond()` (ZeRO++ with int2 weight deltas); "int2-delta
rotated": int2 weight deltas with int8 / int4 rotated gradient hops."""

_BY_SPELLING = {s: e for e in REGISTRY for s in e.spellings}
if len(_BY_SPELLING) != sum(len(e.spellings) for e in REGISTRY):
    raise ValueError("_engines.REGISTRY: two engines share a spelling.")


def lookup(engine: str | Engine) -> Engine:
    """The engine any spelling of it names (display name, slug or alias); an `Engine` is
    returned as it is.

    Raises:
      ValueError: for a name no engine has, listing the valid ones.
    """
    if isinstance(engine, Engine):
        return engine
    found = _BY_SPELLING.get(engine) if isinstance(engine, str) else None
    if found is None:
        valid = "; ".join(", ".join(map(repr, e.spellings)) for e in REGISTRY)
        raise ValueError(
            f"engine {engine!r}: expected one of the registry's engines, each by its name, "
            f"slug or alias: {valid}."
        )
    return found


def config_of(engine: str | Engine, **overrides: Any) -> ZeroPPConfig | None:
    """`lookup(engine).config(**overrides)`: the engine's `ZeroPPConfig` with `overrides`
    applied (None for an engine that has none)."""
    return lookup(engine).config(**overrides)


def build(
    engine: str | Engine,
    *,
    apply_fn: Callable[..., Any],
    params: Any,
    tx: Any,
    mesh: Any,
    overrides: Mapping[str, Any] | None = None,
    config: ZeroPPConfig | None = None,
    abstract: bool = False,
    donate: bool = True,
) -> tuple[Any, Callable[[Callable[..., Any]], Any]]:
    """`(state, make_step)` of `engine` for a model.

    Args:
      engine: any spelling `lookup` takes.
      apply_fn: the model's apply function (`model.apply`).
      params: the parameter tree (global shapes), or a `zpp.ShardedInit` returning it
        (not under "one device").
      tx: an optax transformation.
      mesh: a `zpp.make_mesh` mesh; not used by "one device" (may be None there).
      overrides: `ZeroPPConfig` fields over the engine's preset; for "data parallel" and
        "XLA FSDP" only `compute_dtype` (and for "XLA FSDP" `gpu_wire`; `xla_fsdp_state`'s);
        "one device" takes none.
      config: instead of the preset and `overrides`, the whole `ZeroPPConfig` of a "zpp"
        engine (e.g. the trainer's, from its flags).
      abstract: the state as `jax.ShapeDtypeStruct`s (shardings set), nothing computed.
      donate: whether the step donates its input state.

    Returns:
      The state (global shapes; concrete, or abstract), and `make_step(train_step)`: the
      jitted `(state, batch) -> (state, metrics)` of the user's unchanged `train_step`
      for it (a new function at every call; `.lower` works).

    Raises:
      ValueError: for an unknown engine, overrides the engine does not take, or both
        `overrides` and `config`.
    """
    engine = lookup(engine)
    overrides = dict(overrides or {})
    if engine.kind == "zpp":
        return _build_zpp(engine, apply_fn, params, tx, mesh, overrides, config, abstract, donate)
    if config is not None:
        raise ValueError(f"engine {engine.name!r} takes no ZeroPPConfig; got config={config}.")
    allowed = {"one device": (), "xla fsdp": ("compute_dtype", "gpu_wire")}.get(
        engine.kind, ("compute_dtype",)
    )
    unknown = sorted(set(overrides) - set(allowed))
    if unknown:
        raise ValueError(
            f"engine {engine.name!r}: overrides {unknown}; it takes only {list(allowed)}."
        )
    if engine.kind == "one device":
        return _build_one_device(apply_fn, params, tx, abstract, donate)
    return _build_xla(engine, apply_fn, params, tx, mesh, overrides, abstract, donate)


def _build_zpp(engine, apply_fn, params, tx, mesh, overrides, config, abstract, donate):
    import zeropp_jax as zpp

    if config is not None and overrides:
        raise ValueError(
            f"engine {engine.name!r}: both config and overrides {sorted(overrides)}; give "
            "the whole config, or overrides of the engine's preset."
        )
    config = engine.config(**overrides) if config is None else config
    make = zpp.TrainState.abstract if abstract else zpp.TrainState.create
    state = make(apply_fn=apply_fn, params=params, tx=tx, mesh=mesh, config=config)

    def make_step(train_step):
        return zpp.shard(train_step, mesh=mesh, config=config, donate_state=donate)

    return state, make_step


def _build_one_device(apply_fn, params, tx, abstract, donate):
    import jax
    from flax.training import train_state

    def create():
        return train_state.TrainState.create(apply_fn=apply_fn, params=params, tx=tx)

    state = jax.eval_shape(create) if abstract else create()

    def make_step(train_step):
        return jax.jit(train_step, donate_argnums=(0,) if donate else ())

    return state, make_step


def _build_xla(engine, apply_fn, params, tx, mesh, overrides, abstract, donate):
    import jax
    from _library import BATCH_SPEC
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from zeropp_jax import baselines

    state = baselines.xla_fsdp_state(
        apply_fn=apply_fn, params=params, tx=tx, mesh=mesh, abstract=abstract, **overrides
    )
    if engine.kind == "xla fsdp":
        return state, lambda train_step: baselines.xla_fsdp_step(
            train_step, state, mesh, donate_state=donate
        )
    replicated = NamedSharding(mesh, P())
    if abstract:
        state = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), state
        )
    else:
        state = jax.device_put(state, replicated)
    shardings = jax.tree.map(lambda x: x.sharding, state)

    def make_step(train_step):
        return jax.jit(
            train_step,
            in_shardings=(shardings, NamedSharding(mesh, BATCH_SPEC)),
            out_shardings=(shardings, replicated),
            donate_argnums=(0,) if donate else (),
        )

    return state, make_step


# ----------------------------------------------------------- the trainer's GPT, compiled

COMPARED = ("one device", "XLA FSDP", "ZeRO-3", "ZeRO++")
"""The engines `compiled_step` compares (`layer_memory.py`, `remat_table.py`)."""
NODES, LOCAL = 2, 4


def train_step(state: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
    """The user's unchanged step: next-token loss of `batch` (tokens, `(B, seq + 1)`)."""
    import jax

    from zeropp_jax.train.model import loss_fn

    loss, grads = jax.value_and_grad(lambda p: loss_fn(state.apply_fn, p, batch))(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss}


def compiled_step(engine: str, cfg: GPTConfig, batch_size: int) -> tuple[Any, Any, np.ndarray]:
    """`(compiled step, state, batch)` of `engine` (one of `COMPARED`) for `GPT(cfg)` on a
    2 x 4 mesh: AdamW, the same `GPTConfig` (so the same remat policy) under every engine;
    `batch_size` is the global batch (random tokens, seed 0). Under "one device" the batch
    is one device's share of it (`batch_size / 8`) and the parameters are in bfloat16
    (the others keep float32 master weights and compute in bfloat16). The state's
    parameters are `GPT(cfg)`'s initialisation (seed 0); the step donates the state."""
    if engine not in COMPARED:
        raise ValueError(f"engine={engine!r}; expected one of {COMPARED}.")
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    import zeropp_jax as zpp
    from zeropp_jax.train.model import GPT

    model = GPT(cfg)
    tokens = jnp.zeros((1, cfg.seq_len), jnp.int32)
    params = model.init(jax.random.key(0), tokens)["params"]
    rs = np.random.RandomState(0)
    batch = rs.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len + 1)).astype(np.int32)
    mesh = None
    if engine == "one device":
        params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
        batch = batch[: batch_size // (NODES * LOCAL)]
    else:
        mesh = zpp.make_mesh(NODES, LOCAL)
    state, make_step = build(
        engine, apply_fn=model.apply, params=params, tx=optax.adamw(1e-3), mesh=mesh
    )
    compiled = make_step(train_step).lower(state, batch).compile()
    return compiled, state, batch
