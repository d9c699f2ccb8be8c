"""The wheel: one import package (mixerlab) holding every code folder once, the configs, the license, the console
scripts, and working when installed outside the checkout; and the checkout's mixerlab/<folder> symlinks, which give
the same names to Python and to static tools."""
from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CODE_FOLDERS = ("pallas_kernels", "mixers", "models", "training", "eval", "interop")
SCRIPTS = {
    "mixerlab-train": "mixerlab.training.cli:main",
    "mixerlab-eval": "mixerlab.eval.perplexity:main",
    "mixerlab-generate": "mixerlab.eval.generate:main",
    "mixerlab-prepare-data": "mixerlab.training.prepare_data:main",
    "mixerlab-train-tokenizer": "mixerlab.training.train_tokenizer:main",
    "mixerlab-export": "mixerlab.interop.export:main",
    "mixerlab-import": "mixerlab.interop.import_:main",
}


def test_each_folder_is_a_relative_symlink_in_the_package_tracked_by_git():
    # Static tools (basedpyright, IDEs) and Python find mixerlab.<folder> by the same file-system lookup.
    staged = subprocess.run(["git", "ls-files", "-s", "mixerlab"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    modes = {line.split("\t")[1]: line.split()[0] for line in staged.splitlines()}
    for folder in (*CODE_FOLDERS, "configs"):
        link = os.path.join(ROOT, "mixerlab", folder)
        assert os.path.islink(link) and os.readlink(link) == f"../{folder}", f"mixerlab/{folder} -> ../{folder}"
        assert modes.get(f"mixerlab/{folder}") == "120000", f"git must track mixerlab/{folder} as a symlink"


def test_checkout_imports_each_file_under_one_name_only():
    # A file importable as both mixers.x and mixerlab.mixers.x would run twice (two registries, two classes):
    # every module comes from mixerlab.*, and no two module names share a file.
    code = ("import os, sys, json; import mixerlab.training.cli, mixerlab.training.loop, mixerlab.eval.perplexity; "
            "print(json.dumps({n: os.path.realpath(m.__file__) for n, m in list(sys.modules.items()) "
            "if getattr(m, '__file__', None) and os.path.realpath(m.__file__).startswith(sys.argv[1] + os.sep) "
            "and not os.path.realpath(m.__file__).startswith(os.path.realpath(sys.prefix) + os.sep)}))")  # not the venv
    env = {**os.environ, "PYTHONPATH": ROOT, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code, ROOT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    files = json.loads(out.stdout.splitlines()[-1])
    assert "mixerlab.training.cli" in files and len(files) > 20
    assert not [name for name in files if name.split(".")[0] in CODE_FOLDERS]
    assert len(set(files.values())) == len(files), "a file imported under two names"
    assert os.path.realpath(files["mixerlab.mixers"]) == os.path.join(os.path.realpath(ROOT), "mixers", "__init__.py")


def _copy_checkout(tmp_path):
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    src = tmp_path / "src"
    for rel in filter(None, files):
        if os.path.islink(os.path.join(ROOT, rel)):  # mixerlab/<folder> -> ../<folder>, as git checks it out
            os.makedirs(os.path.dirname(src / rel), exist_ok=True)
            os.symlink(os.readlink(os.path.join(ROOT, rel)), src / rel)
        elif os.path.isfile(os.path.join(ROOT, rel)):
            os.makedirs(os.path.dirname(src / rel), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, rel), src / rel)
    return src


def _build_wheel(tmp_path, src=None):
    src = src or _copy_checkout(tmp_path)
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
    return tmp_path / "dist" / wheel


def _checkout_packages():
    """'mixers', 'pallas_kernels/delta_rule', ...: every folder with an __init__.py under the code folders."""
    out = set()
    for folder in CODE_FOLDERS:
        for path, _, files in os.walk(os.path.join(ROOT, folder)):
            if "__init__.py" in files:
                out.add(os.path.relpath(path, ROOT).replace(os.sep, "/"))
    return out


def _tracked(*patterns):
    return set(subprocess.run(["git", "ls-files", "-co", "--exclude-standard", *patterns], cwd=ROOT,
                              capture_output=True, text=True, check=True).stdout.split())


@pytest.fixture(scope="module")
def wheel_path(tmp_path_factory):
    return _build_wheel(tmp_path_factory.mktemp("wheel"))


@pytest.mark.slow
def test_wheel_has_one_import_package_the_configs_the_license_and_the_console_scripts(wheel_path):
    wheel = zipfile.ZipFile(wheel_path)
    names = wheel.namelist()
    assert len(names) == len(set(names)), "a file is in the wheel twice"
    dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
    assert {n.split("/")[0] for n in names} == {"mixerlab", dist_info}

    # every package folder of the checkout is in the wheel, under mixerlab/, once; nothing else is (tests, tools)
    in_wheel = {os.path.dirname(n)[len("mixerlab/"):] for n in names
                if n.startswith("mixerlab/") and n.endswith("/__init__.py") and n != "mixerlab/__init__.py"}
    assert in_wheel == _checkout_packages()
    packaged_py = {f"mixerlab/{rel}" for rel in _tracked(*(f"{f}/*.py" for f in CODE_FOLDERS))
                   if os.path.dirname(rel) in in_wheel}
    assert {n for n in names if n.endswith(".py")} == packaged_py | {"mixerlab/__init__.py"}
    assert not [n for n in names if n.startswith(("mixerlab/tests", "mixerlab/tools", "mixerlab/mixerlab"))]
    # the configs, every subfolder included, as package data (mixerlab-train --config paper/muir_166m)
    assert {n for n in names if n.startswith("mixerlab/configs/")} == {f"mixerlab/{rel}" for rel in
                                                                       _tracked("configs/*.yaml")}
    assert "mixerlab/configs/paper/muir_166m.yaml" in names

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


@pytest.mark.slow
def test_installed_wheel_imports_and_runs_packaged_configs_outside_the_checkout(wheel_path, tmp_path):
    target, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    os.makedirs(elsewhere)
    out = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target",
                          str(target), str(wheel_path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    # only the wheel provides mixerlab: no checkout on the path, run from a folder without configs/
    env = {**os.environ, "PYTHONPATH": str(target), "JAX_PLATFORMS": "cpu"}

    def run(*cmd):
        done = subprocess.run(cmd, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{cmd}: {done.stdout}{done.stderr}"
        return done.stdout

    script = run(str(target / "bin" / "mixerlab-train"), "--config", "tiny", "--print_config")
    assert "mixer: softmax" in script and "num_layers: 2" in script
    code = ("import mixerlab, mixerlab.mixers, mixerlab.training.cli as cli; print(mixerlab.__file__); "
            "print(mixerlab.mixers.__file__); "
            "cli.main(['--config', 'paper/muir_166m', '--print_config']); cli.main(['--print_config'])")
    printed = run(sys.executable, "-c", code)
    assert printed.splitlines()[0] == str(target / "mixerlab" / "__init__.py")
    assert printed.splitlines()[1] == str(target / "mixerlab" / "mixers" / "__init__.py")
    assert "mixer: muir" in printed  # paper/muir_166m.yaml -> _muir_common.yaml -> ../base.yaml, all packaged
    assert printed.splitlines().count("model:") == 2  # and the default, configs/base.yaml, from the package


@pytest.mark.slow
def test_sdist_holds_the_real_folders_once_and_builds_the_same_wheel(wheel_path, tmp_path):
    src = _copy_checkout(tmp_path)
    code = "import sys; from setuptools import build_meta; print(build_meta.build_sdist(sys.argv[1]))"
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "sdist")], cwd=src, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    with tarfile.open(tmp_path / "sdist" / out.stdout.split()[-1]) as sdist:
        members = sdist.getmembers()
        names = [m.name.split("/", 1)[1] for m in members if "/" in m.name]
        assert not [m.name for m in members if m.issym() or m.islnk()], "the sdist must hold files, not links"
        assert len(names) == len(set(names))
        assert "mixers/__init__.py" in names and "configs/paper/muir_166m.yaml" in names
        assert [n for n in names if n.startswith("mixerlab/")] == ["mixerlab/__init__.py"]
        sdist.extractall(tmp_path / "unpacked", filter="data")
    (unpacked,) = (tmp_path / "unpacked").iterdir()
    rebuilt = _build_wheel(tmp_path / "unpacked", src=unpacked)
    assert sorted(zipfile.ZipFile(rebuilt).namelist()) == sorted(zipfile.ZipFile(wheel_path).namelist())
