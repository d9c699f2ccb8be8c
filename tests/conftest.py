"""Test-wide settings: the JAX platform (the machine's: CPU with a quiet libtpu, or its GPU/TPU; JAX_PLATFORMS
wins), the repo root as the working directory, a rerun of a test whose xdist worker crashed, and (opt-in) one
persistent XLA compile cache per test session."""
import importlib.util
import os
import shutil
import tempfile

from mixerlab.training.environment import select_test_platform

# Before JAX is imported. On a CPU machine: JAX_PLATFORMS=cpu and libtpu's quieting variables (several test
# workers may load libtpu at once); on a GPU/TPU host its platform first, so that the gpu tests run there.
PLATFORM, PLATFORM_WHY = select_test_platform()

# On CPU the tests are compile-bound: thousands of small programs, each compiled once and run a few times, where
# LLVM's optimisation passes cost more than they save. Without them (-O0, the expensive passes off) a sample of
# 136 model and kernel tests took 168 s instead of 285 s here. XLA's CPU fast-math is off at either level (LLVM may
# not reorder float arithmetic): no tolerance changed. Set in XLA_FLAGS, which the workers and the processes the tests
# start inherit (a test that starts one with flags of its own appends them). MIXERLAB_TEST_XLA_OPT=1 keeps XLA's
# default optimisation.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if PLATFORM == "cpu" and os.environ.get("MIXERLAB_TEST_XLA_OPT") != "1" \
        and FAST_COMPILE_FLAGS not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_COMPILE_FLAGS}".strip()

import pytest  # noqa: E402
# A test whose xdist worker crashes is run again alone at the end (tests/xdist_crash_retry.py says why); pytest finds
# the two hooks here by name. The plugin is a file beside this one, imported from there (tests/ is no package).
_spec = importlib.util.spec_from_file_location(
    "xdist_crash_retry", os.path.join(os.path.dirname(os.path.abspath(__file__)), "xdist_crash_retry.py"))
_crash_retry = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_crash_retry)
pytest_handlecrashitem, pytest_sessionfinish = _crash_retry.pytest_handlecrashitem, _crash_retry.pytest_sessionfinish

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The session's compile cache, with MIXERLAB_TEST_XLA_CACHE_ON=1 only: made by the first process that loads this
# file (the xdist controller, or the only process) and inherited by the workers and the subprocesses the tests
# start, so a program that several tests compile (the tiny trainer's step, the eval step) is compiled once per
# session instead of once per test; a fresh folder every session. Off by default since a clean-clone run lost an
# xdist worker to a segmentation fault inside the cache's write (jax 0.10.2 serialising a CPU executable), after
# which pytest-xdist's loadgroup scheduler waited for ever; for 6 % of the time of the trainer and evaluation
# tests (135 s with it, 144 s without: tests/training/test_train.py and tests/eval, 2 workers).
CACHE_ON = os.environ.get("MIXERLAB_TEST_XLA_CACHE_ON") == "1"
_CACHE_ENV = "MIXERLAB_TEST_XLA_CACHE"
_OWN_CACHE = None
if CACHE_ON and _CACHE_ENV not in os.environ:
    _OWN_CACHE = os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="mixerlab-xla-cache-")
XLA_CACHE_SETTINGS = {  # the JAX option -> its value; the environment variable is the option's name in capitals
    "jax_compilation_cache_dir": os.environ.get(_CACHE_ENV, ""),
    "jax_persistent_cache_min_compile_time_secs": 0.1,  # not the many tiny eager-mode programs
    "jax_persistent_cache_min_entry_size_bytes": 0,
}


def pytest_report_header(config):
    return f"mixerlab: JAX platform {PLATFORM} ({PLATFORM_WHY})"


def pytest_terminal_summary(terminalreporter):
    # also after the results: make test runs pytest -q, which leaves the header out
    if not hasattr(terminalreporter.config, "workerinput"):
        terminalreporter.write_line(f"mixerlab: JAX platform {PLATFORM} ({PLATFORM_WHY})")


def pytest_configure(config):
    # pytest-xdist registers this marker; declare it too for runs without xdist (-p no:xdist, --strict-markers).
    config.addinivalue_line("markers", "xdist_group(name): keep these tests on one xdist worker (--dist loadgroup)")


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)


def _uses_xla_cache(node) -> bool:
    """Kernel tests and TPU-topology compiles stay off the cache: they read cost and HLO text off compiled
    executables and compile each program once anyway; the model, trainer and evaluation tests share programs."""
    in_kernels = os.sep + os.path.join("tests", "pallas_kernels") + os.sep in str(node.path)
    return not in_kernels and node.get_closest_marker("tpu_compile") is None


_cache_on = False  # what this process's JAX is set to now
_jax_defaults: dict = {}  # the options as they were before the first test turned the cache on


def _set_xla_cache(on: bool) -> None:
    global _cache_on
    if on == _cache_on:
        return
    import jax
    from jax._src import compilation_cache

    if not _jax_defaults:
        _jax_defaults.update({key: getattr(jax.config, key) for key in XLA_CACHE_SETTINGS})
    compilation_cache.reset_cache()  # the cache reads its settings once; make it read them again
    for key, value in XLA_CACHE_SETTINGS.items():
        jax.config.update(key, value if on else _jax_defaults[key])
    _cache_on = on


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Make ``xdist_group`` work under ``--dist loadgroup``: pytest-xdist 3.8 marks a group by appending
    ``@<group>`` to ``item._nodeid``, which pytest 9 no longer reads (the node id lives in ``item._id``), so the
    scheduler saw no groups and spread every group over both workers (each then built the group's shared
    fixture and compiled its programs itself). Runs in the workers, after pytest-xdist's own hook."""
    if not getattr(config.option, "loadgroup", False):  # pytest-xdist sets it in each worker for loadgroup
        return
    for item in items:
        marks = item.iter_markers("xdist_group")
        names = {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks}
        suffix = "@" + "_".join(sorted(names))
        if not names or item.nodeid.endswith(suffix):  # no group, or a pytest-xdist that already named it
            continue
        from _pytest.nodeid import coerce_node_id  # pytest >= 9: the node id is a structured object

        item._id = coerce_node_id(item.nodeid + suffix)


@pytest.fixture(autouse=True)
def _repo_root_cwd(monkeypatch):
    """Configs use repo-relative paths (data/embedded/...): run every test from the repo root."""
    monkeypatch.chdir(REPO_ROOT)


@pytest.fixture(autouse=True)
def _shared_xla_cache(request, monkeypatch):
    """The session's compile cache for this test and the processes it starts (see ``_uses_xla_cache``)."""
    on = CACHE_ON and _uses_xla_cache(request.node)
    _set_xla_cache(on)
    for key, value in XLA_CACHE_SETTINGS.items():
        if on:
            monkeypatch.setenv(key.upper(), str(value))
        else:
            monkeypatch.delenv(key.upper(), raising=False)
