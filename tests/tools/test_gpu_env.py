"""tools/gpu_env.sh's gpu_list / gpu_for: how the GPU scripts deal single-GPU processes over a host's GPUs."""
import os
import subprocess

import pytest

_ENV = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "gpu_env.sh")


def _deal(tmp_path, n_processes, gpus_listed=None, **env):
    """What gpu_for says for processes 0..n-1 (sourcing only the functions: the rest installs wheels), with a fake
    nvidia-smi listing ``gpus_listed`` (None: no nvidia-smi on PATH)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if gpus_listed is not None:
        smi = bin_dir / "nvidia-smi"
        smi.write_text("#!/bin/sh\n" + "".join(f"echo {g}\n" for g in gpus_listed))
        smi.chmod(0o755)
    script = (f'source <(sed -n "/^gpu_list()/,\\$p" {_ENV}); '
              f'for i in $(seq 0 {n_processes - 1}); do echo "[$(gpu_for $i)]"; done')
    base = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "LM_COMPARE_GPUS")}
    out = subprocess.run(["bash", "-c", script], env={**base, "PATH": f"{bin_dir}:/usr/bin:/bin", **env},
                         capture_output=True, text=True, check=True).stdout
    return [line.strip("[]") for line in out.split()]


@pytest.mark.parametrize("gpus_listed", [None, ["0"]])
def test_one_gpu_or_none_leaves_the_environment_alone(tmp_path, gpus_listed):
    assert _deal(tmp_path, 3, gpus_listed) == ["", "", ""]


def test_every_gpu_nvidia_smi_lists_round_robin(tmp_path):
    assert _deal(tmp_path, 5, ["0", "1", "2"]) == ["0", "1", "2", "0", "1"]


def test_cuda_visible_devices_wins_and_lm_compare_gpus_takes_the_first_n(tmp_path):
    assert _deal(tmp_path, 3, ["0", "1", "2", "3"], CUDA_VISIBLE_DEVICES="3, 1") == ["3", "1", "3"]
    assert _deal(tmp_path, 3, ["0", "1", "2", "3"], LM_COMPARE_GPUS="2") == ["0", "1", "0"]
    assert _deal(tmp_path, 2, ["0", "1", "2", "3"], LM_COMPARE_GPUS="1") == ["", ""]
