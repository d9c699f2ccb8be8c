"""Lists the packages of the wheel; everything else is in pyproject.toml.

pyproject.toml's ``[tool.setuptools.package-dir]`` maps each top-level folder (``mixers`` ...) to a subpackage
of ``mixerlab``. setuptools' automatic discovery cannot follow such a mapping, so this file walks each mapped
folder and names its packages (``mixerlab.eval.ruler`` ...); a new subfolder with an ``__init__.py`` is picked
up without editing anything.
"""
import os
import tomllib

from setuptools import find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "pyproject.toml"), "rb") as f:
    PACKAGE_DIR = tomllib.load(f)["tool"]["setuptools"]["package-dir"]

packages = []
for package, folder in PACKAGE_DIR.items():
    packages.append(package)
    packages += [f"{package}.{sub}" for sub in find_packages(os.path.join(HERE, folder))]

setup(packages=sorted(packages))
