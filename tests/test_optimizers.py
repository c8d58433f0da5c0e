"""The trainer's optimizers (`zeropp_jax.train.optimizers`): the weight-decay mask and
Muon's matrices read the model's own names and shapes, the same under every engine."""

import jax
import pytest

import zeropp_jax as zpp
from zeropp_jax.baselines import xla_fsdp_state
from zeropp_jax.state import _optimizer_view as optimizer_view
from zeropp_jax.train import optimizers
from zeropp_jax.train.flags import OPTIMIZERS, gpt_config, parse_args
from zeropp_jax.train.model import GPT, init_fn

FLAGS = ["--d-model", "32", "--n-layers", "2", "--n-heads", "2", "--seq-len", "16"]


def optimizer_tree(engine, model_parallel):
    """The parameter tree (shapes) the engine hands the optimizer, for the scanned GPT."""
    args = parse_args([*FLAGS, "--engine", engine, "--model-parallel", str(model_parallel)])
    gpt = gpt_config(args)
    assert gpt.scan
    mesh = zpp.make_mesh(2, 4 // model_parallel, model_size=model_parallel)
    tx = optimizers.make_optimizer(args)
    if engine == "xla-fsdp":
        return xla_fsdp_state(
            apply_fn=GPT(gpt).apply, params=init_fn(gpt, 0), tx=tx, mesh=mesh, abstract=True
        ).params
    config = zpp.ZeroPPConfig.zero3() if engine == "zero3" else zpp.ZeroPPConfig()
    state = zpp.TrainState.abstract(
        apply_fn=GPT(gpt).apply, params=init_fn(gpt, 0), tx=tx, mesh=mesh, config=config
    )
    return optimizer_view.view_shapes(*state.layouts)


def selected(tree):
    return {jax.tree_util.keystr(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree) if x}


def test_decayed_leaves_are_the_same_matrices_under_every_engine():
    names, muon = {}, {}
    for engine in ("zeropp", "zero3", "xla-fsdp"):
        for k in (1, 2):
            tree = optimizer_tree(engine, k)
            shapes = {
                jax.tree_util.keystr(p): x.shape
                for p, x in jax.tree_util.tree_leaves_with_path(tree)
            }
            decayed = selected(optimizers.decay_mask(tree))
            names[engine, k] = sorted(decayed)
            dims = optimizers.muon_dims(tree)
            muon[engine, k] = sorted(
                jax.tree_util.keystr(p)
                for p, d in jax.tree_util.tree_leaves_with_path(
                    dims, is_leaf=lambda x: x is None or isinstance(x, tuple)
                )
                if d is not None
            )
            for name in decayed:  # matrices: one per layer when stacked
                stacked = name.startswith("['blocks']")
                assert len(shapes[name]) == (3 if stacked else 2), (engine, k, name)
    first = names["zeropp", 1]
    assert all(v == first for v in names.values()), names
    assert first == [
        "['blocks']['block']['attn']['proj']['kernel']",
        "['blocks']['block']['attn']['qkv']['kernel']",
        "['blocks']['block']['fc']['kernel']",
        "['blocks']['block']['out']['kernel']",
        "['wpe']",
        "['wte']['embedding']",
    ]
    kernels = [n for n in first if n.endswith("['kernel']")]
    assert all(v == kernels for v in muon.values()), muon


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_make_optimizer_builds_each(name):
    args = parse_args([*FLAGS, "--optimizer", name])
    tx = optimizers.make_optimizer(args)
    params = jax.eval_shape(init_fn(gpt_config(args), 0))
    jax.eval_shape(tx.init, params)
