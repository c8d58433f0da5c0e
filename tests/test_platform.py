"""The trainer's process set-up: emulated CPU devices and the mesh its flags describe
(zeropp_jax/train/platform.py)."""

import argparse
import os

import jax
import pytest

from zeropp_jax.train import platform

FLAG = "--xla_force_host_platform_device_count"


def _args(**kw):
    base = dict(num_processes=None, local=None, nodes=None, coordinator=None, distributed=False)
    return argparse.Namespace(**(base | kw))


@pytest.mark.parametrize(
    "kw, count",
    [
        ({}, 8),
        (dict(nodes=3, local=2), 6),
        (dict(num_processes=2), 4),
        (dict(num_processes=2, local=3), 3),
    ],
)
def test_configure_host_devices_asks_for_the_job_s_devices(monkeypatch, kw, count):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/x")
    platform.configure_host_devices(_args(**kw))
    assert os.environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/x {FLAG}={count}"


def test_configure_host_devices_leaves_a_user_s_count_and_other_platforms(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", f"{FLAG}=2")
    platform.configure_host_devices(_args())
    assert os.environ["XLA_FLAGS"] == f"{FLAG}=2"
    monkeypatch.setenv("JAX_PLATFORMS", "cuda")
    monkeypatch.setenv("XLA_FLAGS", "")
    assert not platform.will_run_on_cpu()
    platform.configure_host_devices(_args())
    assert os.environ["XLA_FLAGS"] == ""


def test_make_mesh_defaults_to_two_nodes_of_the_cpu_devices():
    mesh = platform.make_mesh(_args())
    assert dict(mesh.shape) == {"node": 2, "local": jax.device_count() // 2}
    mesh = platform.make_mesh(_args(nodes=1, local=8))
    assert dict(mesh.shape) == {"node": 1, "local": 8}
