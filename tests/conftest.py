"""Test-wide settings: CPU JAX, quiet libtpu, and the repo root as the working directory."""
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5litepod-4")
os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")  # several test workers may load libtpu at once

import pytest  # noqa: E402

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _repo_root_cwd(monkeypatch):
    """Configs use repo-relative paths (data/embedded/...): run every test from the repo root."""
    monkeypatch.chdir(REPO_ROOT)
