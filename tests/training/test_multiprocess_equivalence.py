"""N jax.distributed processes train exactly what one process does, and a lost process ends the run.

One uninterrupted run of 2 processes × 2 CPU devices (FSDP over all 4) is the reference for everything:
1 process × 4 devices and 1 process × 1 device with the same config must consume the same rows per step
(MIXERLAB_BATCH_TRACE) and log the same losses; a run whose process 1 is SIGKILLed at step 5 must end
process 0 with one error line, and restarting both must resume from step 3 and log the reference losses.
All runs start at once (they are compile-bound, one core each).
"""
import collections
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 6
TIMEOUT_S = 60  # --distributed_timeout of these runs
# Float32 sums in a different order: 1 device sums a batch in one piece, 4 devices in shards then an all-reduce
# (in-process, or gloo across processes). Measured here: at most 2.2e-7 relative (2 float32 ulps at a loss of 9)
# over the 6 steps; 1e-5 leaves room for another CPU's vector width. Resuming is compared bitwise.
LOSS_RTOL = 1e-5
CONFIG = ["--config", "configs/tiny.yaml", f"train.steps={STEPS}", "train.log_every=1", "checkpoint.every=3",
          "checkpoint.async_save=false", "train.prefetch=0", "train.eval_every=0", "optim.warmup_steps=2",
          "model.num_layers=1", "mesh.data=1", "mesh.fsdp=-1"]
# process 1 SIGKILLs itself when it draws the batch of step 5 (train.prefetch=0: drawn when step 5 starts, after
# step 3's synchronous checkpoint and step 4)
KILL_AT_BATCH = 5
_KILLER = """
import os, signal, sys
from mixerlab.training import data
make = data.train_iterator
def train_iterator(*a, **k):
    it = make(*a, **k)
    class Killer:
        n = 0
        def __iter__(self): return self
        def __next__(self):
            self.n += 1
            if self.n == {n}:
                os.kill(os.getpid(), signal.SIGKILL)
            return next(it)
        def __getattr__(self, name): return getattr(it, name)
    return Killer()
data.train_iterator = train_iterator
from mixerlab.training.cli import main
sys.exit(main(sys.argv[1:]))
""".replace("{n}", str(KILL_AT_BATCH))


_PORTS_GIVEN: set = set()


def _free_port() -> int:
    """A port nothing listens on, never the same twice here (several launches start at once)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


def _env(devices: int, trace=None) -> dict:
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"  # + the session's
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
    # The session's compile cache (tests/conftest.py), which the module fixture below starts before the per-test
    # fixture sets it: the restarted processes of the killed run load the programs that run compiled (~8 s of CPU).
    if "MIXERLAB_TEST_XLA_CACHE" in os.environ:
        env.update(JAX_COMPILATION_CACHE_DIR=os.environ["MIXERLAB_TEST_XLA_CACHE"],
                   JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.1", JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
    env.pop("MIXERLAB_BATCH_TRACE", None)
    if trace is not None:
        env["MIXERLAB_BATCH_TRACE"] = str(trace)
    return env


def _start(run_dir, *, processes: int, devices: int, trace=None, kill_process=None, extra=()):
    """Popen of every process of one launch (train.py, or the self-killing driver for ``kill_process``)."""
    port = _free_port()
    procs = []
    for i in range(processes):
        entry = ["-c", _KILLER] if i == kill_process else ["train.py"]
        dist = (["--coordinator_address", f"127.0.0.1:{port}", "--num_processes", str(processes), "--process_id",
                 str(i), "--distributed_timeout", str(TIMEOUT_S)] if processes > 1 else [])
        procs.append(subprocess.Popen([sys.executable, *entry, *dist, *CONFIG, f"train.output_dir={run_dir}", *extra],
                                      cwd=REPO, env=_env(devices, trace), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    return procs


def _finish(procs, expect=0):
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == expect, out + err
    return outs


def _losses(run_dir) -> dict:
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}


def _rows_per_batch(trace) -> dict:
    """batch number -> the multiset of row hashes over every process."""
    out = collections.defaultdict(collections.Counter)
    for name in os.listdir(trace):
        for line in open(os.path.join(trace, name)):
            rec = json.loads(line)
            out[rec["batch"]].update(rec["rows"])
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mp")
    launches = {
        "2x2": _start(root / "2x2", processes=2, devices=2, trace=root / "trace-2x2"),
        "1x4": _start(root / "1x4", processes=1, devices=4, trace=root / "trace-1x4"),
        "1x1": _start(root / "1x1", processes=1, devices=1, trace=root / "trace-1x1"),
        "killed": _start(root / "killed", processes=2, devices=2, kill_process=1),
    }
    killed = launches.pop("killed")
    killed[1].wait(timeout=600)
    died = time.monotonic()
    try:
        out0, err0 = killed[0].communicate(timeout=TIMEOUT_S + 120)
    except subprocess.TimeoutExpired:
        killed[0].kill()
        out0, err0 = killed[0].communicate()
        pytest.fail(f"process 0 still ran {TIMEOUT_S + 120} s after process 1 was killed:\n{out0}{err0}")
    survivor = {"rc": killed[0].returncode, "seconds": time.monotonic() - died, "out": out0, "err": err0,
                "victim_rc": killed[1].returncode}
    # restart both processes of the killed run: they resume from its newest complete checkpoint
    resumed = _finish(_start(root / "killed", processes=2, devices=2))
    outs = {name: _finish(procs) for name, procs in launches.items()}
    return {"root": root, "outs": outs, "survivor": survivor, "resumed": resumed}


# the tests of the `runs` fixture share one worker (it starts 8 processes; on two workers it ran twice, 87 + 89 s)
ON_THE_RUNS = pytest.mark.xdist_group("multiprocess_runs")


@pytest.mark.slow
@ON_THE_RUNS
def test_two_processes_consume_the_rows_of_one_process_per_step(runs):
    root = runs["root"]
    assert "4 cpu device(s), mesh {'data': 1, 'fsdp': 4, 'tensor': 1}" in runs["outs"]["2x2"][0][0]
    assert "4 cpu device(s), mesh {'data': 1, 'fsdp': 4, 'tensor': 1}" in runs["outs"]["1x4"][0][0]
    assert "1 cpu device(s)" in runs["outs"]["1x1"][0][0]
    ref = _rows_per_batch(root / "trace-1x1")
    two = _rows_per_batch(root / "trace-2x2")
    assert sorted(os.listdir(root / "trace-2x2")) == ["batches.0.jsonl", "batches.1.jsonl"]
    for step in range(1, STEPS + 1):
        assert sum(ref[step].values()) == 4 and len(ref[step]) == 4  # 4 distinct rows (train.batch_size)
        assert two[step] == ref[step], step
        assert _rows_per_batch(root / "trace-1x4")[step] == ref[step], step
    halves = [[json.loads(line)["rows"] for line in open(root / "trace-2x2" / f"batches.{p}.jsonl")] for p in (0, 1)]
    assert all(len(rows) == 2 for rows in halves[0][:STEPS] + halves[1][:STEPS])  # each process: its 2 rows


@pytest.mark.slow
@ON_THE_RUNS
def test_two_processes_log_the_losses_of_one_process(runs):
    root = runs["root"]
    two, four, one = _losses(root / "2x2"), _losses(root / "1x4"), _losses(root / "1x1")
    assert sorted(two) == sorted(four) == sorted(one) == list(range(1, STEPS + 1))
    for step in two:
        assert two[step] == pytest.approx(one[step], rel=LOSS_RTOL), step
        assert four[step] == pytest.approx(one[step], rel=LOSS_RTOL), step
    assert len(set(two.values())) == STEPS  # the losses move: equal by training, not by a constant


@pytest.mark.slow
@ON_THE_RUNS
def test_a_killed_process_ends_the_other_with_one_line_and_both_resume(runs):
    s = runs["survivor"]
    assert s["victim_rc"] == -signal.SIGKILL
    assert s["rc"] == 1, s["out"] + s["err"]
    assert s["seconds"] < TIMEOUT_S, s  # the broken connection is noticed at the next collective, not by a timeout
    errors = [line for line in s["err"].splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "another process of this run" in errors[0], s["err"]
    assert "Check failure stack trace" not in s["err"]  # no abort at JAX's exit barrier

    root, run = runs["root"], runs["root"] / "killed"
    (out0, _), (out1, _) = runs["resumed"]
    assert "resuming at step 3" in out0
    assert "mixerlab:" not in out1  # only process 0 prints and logs
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    # the killed run's row of step 4 was dropped on resume and logged again, once
    assert [r["step"] for r in rows if r["split"] == "train"] == list(range(1, STEPS + 1))
    ref, resumed = _losses(root / "2x2"), _losses(run)
    assert resumed == ref  # bitwise: the same program on the same devices from the same checkpoint
    assert sorted(os.listdir(run / "checkpoints")) == ["3", "6"]
    assert not (run / "mixerlab.lock").exists()  # process 0 took the run lock and released it
    state = json.load(open(run / "checkpoints" / "6" / "data" / "metadata"))
    assert len(state["per_process"]) == 2 and state["per_process"][0] != state["per_process"][1]


def _one_process(args, devices=1, timeout=300):
    flags = [a for a in args if "=" not in a or a.startswith("-")]
    overrides = [a for a in args if a not in flags]
    return subprocess.run([sys.executable, "train.py", *flags, *CONFIG, *overrides], cwd=REPO, env=_env(devices),
                          capture_output=True, text=True, timeout=timeout)


def test_a_process_id_out_of_range_is_named(tmp_path):
    r = _one_process(["--coordinator_address", "127.0.0.1:1", "--num_processes", "2", "--process_id", "2",
                      f"train.output_dir={tmp_path}"])
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [
        "mixerlab-train: error: --process_id: 2 is not in [0, --num_processes=2): process ids are 0 .. 1, one per "
        "process"]


def test_an_unreachable_coordinator_is_named_within_the_timeout(tmp_path):
    port = _free_port()  # nothing listens there
    start = time.monotonic()
    r = _one_process(["--coordinator_address", f"127.0.0.1:{port}", "--num_processes", "2", "--process_id", "1",
                      "--distributed_timeout", "3", f"train.output_dir={tmp_path}"])
    assert r.returncode == 1, r.stderr
    assert time.monotonic() - start < 120
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"mixerlab-train: error: --coordinator_address=127.0.0.1:{port}: nothing accepted a connection there "
        f"within --distributed_timeout=3 s"), r.stderr


def test_a_missing_process_is_named_within_the_timeout(tmp_path):
    """Process 0 of 2 alone: the other never joins; one line instead of JAX's abort after its own deadline."""
    r = _one_process(["--coordinator_address", f"127.0.0.1:{_free_port()}", "--num_processes", "2", "--process_id",
                      "0", "--distributed_timeout", "3", f"train.output_dir={tmp_path}"])
    assert r.returncode == 1, r.stderr
    lines = [line for line in r.stderr.strip().splitlines() if "error" in line.lower()]
    assert lines == [f"mixerlab-train: error: --num_processes=2 processes did not all join the coordinator at "
                     f"--coordinator_address={r.args[3]} within --distributed_timeout=3 s "
                     f"(this is --process_id=0); start every process id 0 .. 1 with the same address"], r.stderr


@pytest.mark.slow
def test_a_mesh_the_world_size_does_not_fit_is_named_by_every_process(tmp_path):
    outs = _finish(_start(tmp_path / "run", processes=2, devices=2, extra=["mesh.fsdp=3"]), expect=2)
    for _out, err in outs:
        assert err.strip().splitlines()[-1] == (
            "mixerlab-train: error: mesh: data×fsdp×tensor = 1×3×1 = 3 does not match the 4 devices per slice; set "
            "one axis to -1 to fill (2 process(es) × 2 device(s) each = 4 devices)")
    assert not (tmp_path / "run").exists()  # refused before the run directory was touched
