"""The wheel: one import package (mixerlab) holding every code folder, the license, the console scripts; and the
checkout's mixerlab/__init__.py, which maps the same names onto the repository's folders."""
from __future__ import annotations

import configparser
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE_FOLDERS = ("pallas_kernels", "mixers", "models", "training", "eval")
SCRIPTS = {
    "mixerlab-train": "mixerlab.training.cli:main",
    "mixerlab-eval": "mixerlab.eval.perplexity:main",
    "mixerlab-generate": "mixerlab.eval.generate:main",
    "mixerlab-prepare-data": "mixerlab.training.prepare_data:main",
    "mixerlab-train-tokenizer": "mixerlab.training.train_tokenizer:main",
    "mixerlab-export": "mixerlab.models.interop.export:main",
    "mixerlab-import": "mixerlab.models.interop.import_:main",
}


def _load_shim(folder):
    """Runs <folder>/mixerlab/__init__.py as a fresh package and returns it (nothing is added to sys.modules)."""
    init = os.path.join(folder, "mixerlab", "__init__.py")
    spec = importlib.util.spec_from_file_location("mixerlab_shim_under_test", init,
                                                  submodule_search_locations=[os.path.dirname(init)])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checkout_shim_searches_the_repository_root():
    assert ROOT in _load_shim(ROOT).__path__


@pytest.mark.parametrize("pyproject", [None, '[project]\nname = "someone-else"\n'])
def test_shim_outside_a_mixerlab_checkout_searches_only_its_own_folder(tmp_path, pyproject):
    # An installed wheel sits in site-packages: the folder above it is no checkout of this project.
    os.makedirs(tmp_path / "mixerlab")
    shutil.copy(os.path.join(ROOT, "mixerlab", "__init__.py"), tmp_path / "mixerlab" / "__init__.py")
    if pyproject is not None:
        (tmp_path / "pyproject.toml").write_text(pyproject)
    assert _load_shim(str(tmp_path)).__path__ == [str(tmp_path / "mixerlab")]


def _build_wheel(tmp_path):
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    src = tmp_path / "src"
    for rel in filter(None, files):
        if os.path.isfile(os.path.join(ROOT, rel)):
            os.makedirs(os.path.dirname(src / rel), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, rel), src / rel)
    cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "-q", "-w", str(tmp_path / "dist")]
    try:  # the venvs built from the locks have a new enough setuptools: no download needed
        from setuptools import __version__ as setuptools_version

        if int(setuptools_version.split(".")[0]) >= 77:
            cmd.append("--no-build-isolation")
    except ImportError:
        pass
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    (wheel,) = os.listdir(tmp_path / "dist")
    return zipfile.ZipFile(tmp_path / "dist" / wheel)


def _checkout_packages():
    """'mixers', 'pallas_kernels/delta_rule', ...: every folder with an __init__.py under the code folders."""
    out = set()
    for folder in CODE_FOLDERS:
        for path, _, files in os.walk(os.path.join(ROOT, folder)):
            if "__init__.py" in files:
                out.add(os.path.relpath(path, ROOT).replace(os.sep, "/"))
    return out


@pytest.mark.slow
def test_wheel_has_one_import_package_the_license_and_the_console_scripts(tmp_path):
    wheel = _build_wheel(tmp_path)
    names = wheel.namelist()
    dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
    assert {n.split("/")[0] for n in names} == {"mixerlab", dist_info}

    # every package folder of the checkout is in the wheel, under mixerlab/; nothing else is (tests, tools)
    in_wheel = {os.path.dirname(n)[len("mixerlab/"):] for n in names
                if n.startswith("mixerlab/") and n.endswith("/__init__.py") and n != "mixerlab/__init__.py"}
    assert in_wheel == _checkout_packages()
    assert not [n for n in names if n.startswith(("mixerlab/tests", "mixerlab/tools", "mixerlab/configs"))]

    assert wheel.read(f"{dist_info}/licenses/LICENSE") == open(os.path.join(ROOT, "LICENSE"), "rb").read()
    metadata = wheel.read(f"{dist_info}/METADATA").decode()
    assert "License-Expression: Apache-2.0" in metadata and "Name: mixerlab" in metadata

    entry_points = configparser.ConfigParser()
    entry_points.read_string(wheel.read(f"{dist_info}/entry_points.txt").decode())
    assert dict(entry_points["console_scripts"]) == SCRIPTS
    for script in ("mixerlab-train", "mixerlab-eval"):  # the ones whose modules exist on every branch
        module, function = SCRIPTS[script].split(":")
        source = wheel.read(module.replace(".", "/") + ".py").decode()
        assert f"def {function}(" in source, f"{script}: {module} has no {function}()"
