"""What the trainer prints (zeropp_jax/train/report.py): the engine line; the `--plan`
report itself is checked against XLA's memory analysis in tests/test_plan.py."""

import zeropp_jax as zpp
from zeropp_jax.train.report import config_text


def test_config_text_names_the_engine():
    assert config_text(None).startswith("XLA FSDP (jax.jit")
    once = zpp.ZeroPPConfig.zero3(shared_grad="once")
    assert config_text(once) == "ZeRO-3 (bfloat16)"
    assert config_text(zpp.ZeroPPConfig(shared_grad="once")) == (
        "ZeRO++ (weights 8-bit, hpZ on, gradients 4-bit, bfloat16)"
    )
    assert config_text(zpp.ZeroPPConfig()).endswith(
        "bfloat16, tied gradients reduced once or per use (auto))"
    )
    assert "weights unquantized" in config_text(zpp.ZeroPPConfig(weight_bits=None))
