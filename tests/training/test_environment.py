"""training/environment.py: a command on a machine without a GPU or TPU picks the CPU backend and a quiet libtpu
(the Makefile's PLATFORM=cpu settings) before JAX starts, and never overrides what the user set."""
import importlib
import os
import shutil
import subprocess
import sys
import tomllib

import pytest

from mixerlab.training import environment
from mixerlab.training.environment import CPU_SETTINGS, detect_platform, quiet_cpu_setup, select_test_platform

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _scripts() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["scripts"]


@pytest.mark.parametrize("files, platform", [
    ([], "cpu"), (["dev/nvidia0", "dev/nvidiactl"], "cuda"), (["proc/driver/nvidia/gpus/0000:01:00.0"], "cuda"),
    (["dev/nvidiactl"], "cpu"),  # the control device alone: a driver without a GPU
    (["dev/accel0"], "tpu"), (["dev/vfio/0"], "tpu"), (["dev/vfio/vfio"], "cpu"),
])
def test_platform_from_device_files(tmp_path, files, platform):
    for f in files:
        os.makedirs(os.path.dirname(tmp_path / f), exist_ok=True)
        (tmp_path / f).write_text("")
    assert detect_platform(str(tmp_path)) == platform


def test_cpu_machine_gets_the_makefile_settings():
    env = {}
    assert quiet_cpu_setup(env, platform="cpu") == CPU_SETTINGS and env == CPU_SETTINGS
    assert env["JAX_PLATFORMS"] == "cpu" and env["TPU_WORKER_HOSTNAMES"] == "localhost"


def test_what_the_user_set_is_kept():
    env = {"JAX_PLATFORMS": "", "TPU_ACCELERATOR_TYPE": "v6e-8"}
    made = quiet_cpu_setup(env, platform="cpu")
    assert env["JAX_PLATFORMS"] == "" and env["TPU_ACCELERATOR_TYPE"] == "v6e-8"
    assert made == {"TPU_WORKER_HOSTNAMES": "localhost", "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_nothing_is_set_on_an_accelerator_host(platform):
    env = {"HOME": "/root"}
    assert quiet_cpu_setup(env, platform=platform) == {} and env == {"HOME": "/root"}


@pytest.mark.parametrize("script", sorted(_scripts()))
def test_every_console_script_sets_the_environment_first(script, monkeypatch):
    """Each [project.scripts] main calls quiet_cpu_setup before it parses its arguments (--help exits there)."""
    calls = []
    monkeypatch.setattr(environment, "quiet_cpu_setup", lambda *a, **k: calls.append(script) or {})
    module, func = _scripts()[script].split(":")
    main = getattr(importlib.import_module(module), func)
    with pytest.raises(SystemExit) as ended:
        main(["--help"])
    assert ended.value.code == 0 and calls == [script]


def test_a_command_on_a_cpu_machine_is_quiet_without_the_makefile(tmp_path):
    """The libtpu start-up errors ("unexpected worker hostname") are gone when none of the settings is exported.
    Only meaningful on a CPU machine with libtpu installed (the CPU lock's venv)."""
    if detect_platform() != "cpu":
        pytest.skip("an accelerator is present: the CPU settings are not made")
    env = {k: v for k, v in os.environ.items() if k not in CPU_SETTINGS}
    code = ("import sys; from mixerlab.training.environment import quiet_cpu_setup; quiet_cpu_setup(); "
            "import jax; print(jax.devices()[0].platform)")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0 and out.stdout.strip() == "cpu", out.stderr[-2000:]
    assert "unexpected worker hostname" not in out.stderr and "E0000" not in out.stderr, out.stderr[-2000:]


# ------------------------------------------------------------------------------------------------ test sessions
@pytest.mark.parametrize("platform, jax_platforms, why", [
    ("cpu", "cpu", "no GPU or TPU found"),
    ("cuda", "cuda,cpu", "a GPU found"),  # the gpu tests run on it; CPU stays available by name
    ("tpu", "tpu,cpu", "a TPU found"),
])
def test_a_test_session_runs_on_the_machines_platform(platform, jax_platforms, why):
    env = {}
    assert select_test_platform(env, platform=platform) == (jax_platforms, why)
    assert env["JAX_PLATFORMS"] == jax_platforms
    assert ("TPU_WORKER_HOSTNAMES" in env) == (platform == "cpu")  # libtpu quieting only on CPU
    assert env.get("XLA_PYTHON_CLIENT_PREALLOCATE") == ("false" if platform == "cuda" else None)


def test_jax_platforms_set_by_the_user_or_the_makefile_wins():
    env = {"JAX_PLATFORMS": "cuda"}
    assert select_test_platform(env, platform="cpu") == ("cuda", "JAX_PLATFORMS is set") and env == {
        "JAX_PLATFORMS": "cuda"}
    env = {"JAX_PLATFORMS": "cpu"}
    assert select_test_platform(env, platform="cuda") == ("cpu", "JAX_PLATFORMS is set")
    assert env["TPU_WORKER_HOSTNAMES"] == "localhost"  # CPU sessions still quiet libtpu


def test_the_pytest_summary_names_the_platform(tmp_path):
    """tests/conftest.py prints the session's platform in the header and after the results (make test runs -q)."""
    env = {k: v for k, v in os.environ.items() if k not in CPU_SETTINGS and not k.startswith("PYTEST_XDIST")}
    out = subprocess.run([sys.executable, "-m", "pytest", "tests/test_house.py", "-p", "no:cacheprovider", "-n", "0",
                          "-k", "nothing_matches_this"], env=env, capture_output=True, text=True, timeout=120,
                         cwd=REPO)
    expected = f"mixerlab: JAX platform {detect_platform()}"
    lines = [line for line in out.stdout.splitlines() if line.startswith(expected)]
    assert len(lines) == 2, out.stdout[-3000:]  # header and summary
    if detect_platform() == "cpu":
        assert lines[0] == "mixerlab: JAX platform cpu (no GPU or TPU found)"


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("platform, jax_platforms, markers, workers", [
    ("cpu", "cpu", "not extended", "2"),
    ("cuda", "cuda,cpu", "gpu and not extended", "1"),
])
def test_make_test_runs_the_platforms_tests(platform, jax_platforms, markers, workers):
    """`make test PLATFORM=...`: the pytest line and its JAX_PLATFORMS (the venv and lint are stubbed out)."""
    env = {k: v for k, v in os.environ.items() if k not in CPU_SETTINGS and k not in ("MAKEFLAGS", "MAKELEVEL")}
    out = subprocess.run(["make", "-s", "test", f"PLATFORM={platform}", "STAMP=/dev/null",
                          "PY=env | grep ^JAX_PLATFORMS= ; echo"], env=env, capture_output=True, text=True,
                         timeout=60, cwd=REPO)
    lines = out.stdout.splitlines()
    assert f"JAX_PLATFORMS={jax_platforms}" in lines, out.stdout + out.stderr
    assert any(f"-m pytest -n {workers} " in line and f"-m {markers}" in line for line in lines), out.stdout
