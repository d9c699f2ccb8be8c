"""Lists the packages of the wheel and its package data; everything else is in pyproject.toml.

pyproject.toml's ``[tool.setuptools.package-dir]`` maps each top-level folder (``mixers`` ...) to a subpackage
of ``mixerlab``. setuptools' automatic discovery cannot follow such a mapping, so this file walks each mapped
folder and names its packages (``mixerlab.eval.ruler`` ...); a new subfolder with an ``__init__.py`` is picked
up without editing anything. ``configs`` holds no Python: its folders are data-only packages
(``mixerlab.configs.paper`` ...) whose YAML files are package data, so a new config folder ships too.
"""
import os
import tomllib

from setuptools import find_namespace_packages, find_packages, setup

HERE = os.path.dirname(os.path.abspath(__file__))
DATA_ONLY = {"mixerlab.configs": "*.yaml"}  # package -> the files it ships (in it and every subfolder)
with open(os.path.join(HERE, "pyproject.toml"), "rb") as f:
    PACKAGE_DIR = tomllib.load(f)["tool"]["setuptools"]["package-dir"]

packages, package_data = [], {}
for package, folder in PACKAGE_DIR.items():
    if package in DATA_ONLY:
        subs = [f"{package}.{sub}" for sub in find_namespace_packages(os.path.join(HERE, folder))]
        packages += [package, *subs]
        package_data.update({name: [DATA_ONLY[package]] for name in (package, *subs)})
    else:
        packages.append(package)
        packages += [f"{package}.{sub}" for sub in find_packages(os.path.join(HERE, folder))]

setup(packages=sorted(packages), package_data=package_data)
