"""Shared fixtures: the package under test is the build's (PYTHONPATH), the
CLI the build's (DELTASYNC_CLI)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


@pytest.fixture
def cli() -> str:
    path = os.environ.get("DELTASYNC_CLI")
    if not path or not os.path.exists(path):
        pytest.skip("DELTASYNC_CLI is not set (run through ctest)")
    return path


@pytest.fixture
def rendezvous(tmp_path) -> str:
    return "file:" + str(tmp_path / "rendezvous")
