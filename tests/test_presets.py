"""`zeropp_jax.train.presets`: the preset `--optimizer` picks, its flag defaults, and the
lines the trainer prints about both."""

import zeropp_jax as zpp
from zeropp_jax.train.flags import parse_args, zeropp_config
from zeropp_jax.train.presets import muon_note, preset_defaults, preset_note


def test_each_preset_gives_its_config():
    for name, make in (
        ("zeropp", zpp.ZeroPPConfig),
        ("beyond", zpp.ZeroPPConfig.beyond),
        ("muon", zpp.ZeroPPConfig.muon),
    ):
        assert preset_defaults(name)["grad_bits"] == make().grad_bits
        assert zeropp_config(parse_args(["--preset", name])) == make()


def test_muon_picks_its_profile_and_gather_and_says_so():
    args = parse_args(["--optimizer", "muon"])
    assert zeropp_config(args) == zpp.ZeroPPConfig.muon()
    assert zpp.ZeroPPConfig.muon().grad_hop2_bits == 8
    assert args.muon_gather == "bfloat16"
    assert "chose --preset muon" in preset_note(args)
    assert "gathered once, in bfloat16" in muon_note(args)
    # Given explicitly, the preset and the flags win, and nothing is announced as chosen.
    args = parse_args(["--optimizer", "muon", "--preset", "zeropp"])
    assert zeropp_config(args) == zpp.ZeroPPConfig() and preset_note(args) is None
    got = zeropp_config(parse_args(["--optimizer", "muon", "--grad-node-bits", "4"]))
    assert got == zpp.ZeroPPConfig.muon(grad_node_bits=4)
    # Other engines and optimizers keep their defaults; XLA FSDP runs optax's Muon.
    assert zeropp_config(parse_args(["--optimizer", "muon", "--zero3"])) == zpp.ZeroPPConfig.zero3()
    fsdp = parse_args(["--optimizer", "muon", "--engine", "xla-fsdp"])
    assert fsdp.muon_gather == "optax" and "optax.contrib.muon" in muon_note(fsdp)
    assert preset_note(parse_args([])) is None and muon_note(parse_args([])) is None
