"""Provenance: the commit, dirty flag and package versions a run records."""

import subprocess

from zeropp_jax.measure._provenance import SOURCE, describe, provenance, same_code


def test_provenance_of_this_checkout():
    record = provenance()
    head = subprocess.run(
        ["git", "-C", str(SOURCE), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
    ).stdout.strip()
    assert record["commit"] == head and len(head) == 40
    assert isinstance(record["dirty"], bool)
    code = [p for p in record["changed"] if not p.startswith("experiments/results/")]
    assert record["dirty"] == bool(code)
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


def test_results_files_are_not_code():
    # A study writes its tracked results as it goes: its later runs still ran clean code.
    clean = {"commit": "a" * 40, "dirty": False, "changed": [], "packages": {"jax": "1"}}
    results = dict(clean, changed=["experiments/results/convergence/convergence.md"])
    assert describe(results) == "commit aaaaaaa, clean code (results files changed: 1)"
    assert same_code(clean, results)
    # Records from before this rule called such a tree dirty; they count as clean code.
    assert same_code(clean, dict(results, dirty=True))
    mixed = dict(clean, dirty=True, changed=["experiments/results/a.md", "zeropp_jax/x.py"])
    assert not same_code(clean, mixed)
    assert describe(mixed) == "commit aaaaaaa, tree dirty (zeropp_jax/x.py)"
