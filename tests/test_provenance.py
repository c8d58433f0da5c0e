"""Provenance: the commit, dirty flag and package versions a run records."""

import subprocess

from zeropp_jax.provenance import SOURCE, describe, provenance, same_code


def test_provenance_of_this_checkout():
    record = provenance()
    head = subprocess.run(
        ["git", "-C", str(SOURCE), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
    ).stdout.strip()
    assert record["commit"] == head and len(head) == 40
    assert isinstance(record["dirty"], bool)
    assert record["dirty"] == bool(record["changed"])
    assert record["packages"]["jax"] is not None and record["packages"]["flax"] is not None


def test_describe_and_same_code():
    clean = {"commit": "a" * 40, "dirty": False, "changed": [], "packages": {"jax": "1"}}
    dirty = dict(clean, dirty=True, changed=["x.py"])
    assert describe(clean) == "commit aaaaaaa, clean tree"
    assert describe(dirty) == "commit aaaaaaa, tree dirty (x.py)"
    assert describe({"commit": None, "git_error": "no git"}) == "commit unknown (no git)"
    assert same_code(clean, dict(clean))
    assert not same_code(clean, dirty)  # a dirty tree is never the same code
    assert not same_code(clean, dict(clean, commit="b" * 40))
    assert not same_code(clean, dict(clean, packages={"jax": "2"}))
    assert not same_code({"commit": None}, {"commit": None})
