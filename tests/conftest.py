"""Shared fixtures: the libcuda stand-in, tiny MoE checkpoints, their AP conversions, a live CPU server."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.cpu_engine import CPU_SERVER_FLAGS, build_fake_libcuda, cpu_server_env


@pytest.fixture(scope="session")
def work_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("pagedweight")


@pytest.fixture(scope="session")
def server_env(work_dir) -> dict[str, str]:
    if os.environ.get("PW_PROBE_DEVICE", "cpu") != "cpu":  # GPU machine: tests/support/logprob_probe.py
        return dict(os.environ)
    return cpu_server_env(build_fake_libcuda(work_dir / "libcuda"))


@pytest.fixture(scope="session")
def tiny_qwen2_moe(work_dir) -> Path:
    from pagedweight.tools.tiny_model import make_tiny_moe

    return make_tiny_moe(work_dir / "tiny-qwen2-moe", arch="qwen2_moe", seed=0)


@pytest.fixture(scope="session")
def tiny_mixtral(work_dir) -> Path:
    from pagedweight.tools.tiny_model import make_tiny_moe

    return make_tiny_moe(work_dir / "tiny-mixtral", arch="mixtral", seed=0)


@pytest.fixture(scope="session")
def ap_qwen2_moe(work_dir, tiny_qwen2_moe) -> Path:
    """The tiny Qwen2-MoE converted to a servable AP checkpoint (binary-coded tables, 2..8 bits)."""
    from pagedweight.tools.convert import convert_checkpoint

    return convert_checkpoint(tiny_qwen2_moe, work_dir / "ap-qwen2-moe", bits_min=2, bits_max=8, seed=0)


@pytest.fixture(scope="session")
def ap_qwen2_moe_g32(work_dir, tiny_qwen2_moe) -> Path:
    """The same with bcq group size 32, so `--tp 2` can split the experts' intermediate size (64) into whole
    groups on each rank."""
    from pagedweight.tools.convert import convert_checkpoint

    return convert_checkpoint(tiny_qwen2_moe, work_dir / "ap-qwen2-moe-g32", bits_min=2, bits_max=8, seed=0,
                              group_size=32)


@pytest.fixture(scope="session")
def cpu_server_flags() -> list[str]:
    return list(CPU_SERVER_FLAGS)
