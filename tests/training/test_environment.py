"""training/environment.py: a command on a machine without a GPU or TPU picks the CPU backend and a quiet libtpu
(the Makefile's PLATFORM=cpu settings) before JAX starts, and never overrides what the user set."""
import importlib
import os
import subprocess
import sys
import tomllib

import pytest

from mixerlab.training import environment
from mixerlab.training.environment import CPU_SETTINGS, detect_platform, quiet_cpu_setup

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
