"""model.remat=auto (training/remat_auto.py): the fastest policy whose compiled train step fits the device."""
import pytest

from mixerlab.training import remat_auto

GIB = 2**30
SIZES = {"none": 91 * GIB, "dots": 61 * GIB, "kernels": 36 * GIB, "block": 28 * GIB}  # GDN-2 166M on the H200


def _choose(limit, sizes=SIZES, fail=()):
    tried, said = [], []

    def compile_bytes(policy):
        tried.append(policy)
        if policy in fail:
            raise RuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm")
        return sizes[policy]

    return remat_auto.choose(compile_bytes, limit, said.append), tried, said


@pytest.mark.parametrize("limit_gib, want", [(141, "none"), (80, "dots"), (50, "kernels"), (35, "block")])
def test_the_first_policy_within_the_headroom_wins(limit_gib, want):
    got, tried, said = _choose(limit_gib * GIB)
    assert got == want
    assert tried == list(remat_auto.CANDIDATES[:remat_auto.CANDIDATES.index(want) + 1])  # fastest first, no more
    assert f"-> {want!r}" in said[-1]


def test_a_compiler_refusal_means_try_the_next_and_no_limit_means_it_compiles():
    got, tried, said = _choose(None, fail=("none", "dots"))
    assert (got, tried) == ("kernels", ["none", "dots", "kernels"])
    assert "does not compile" in said[0]


def test_nothing_fits_falls_back_to_block_with_advice():
    got, _, said = _choose(10 * GIB)
    assert got == "block" and "train.batch_size" in said[-1]


def test_other_compile_errors_are_not_swallowed():
    def broken(policy):
        raise ValueError("a shape error")

    with pytest.raises(ValueError, match="shape error"):
        remat_auto.choose(broken, 100 * GIB, print)


def test_trainer_resolves_auto_on_the_cpu():
    """A real compile of the tiny model: the host has room, so 'none' (the fastest) is kept, and the model the
    trainer builds is the one for that policy."""
    from mixerlab.training import mesh as mesh_lib
    from mixerlab.training.config import load_config
    from mixerlab.training.trainer import Trainer

    cfg = load_config("configs/tiny.yaml", ["model.d_model=64", "model.num_layers=1", "train.batch_size=2",
                                            "model.remat=auto"])
    mesh = mesh_lib.make_mesh(cfg)
    said = []
    resolved = remat_auto.resolve(cfg, 256, mesh, said.append)
    assert resolved.model.remat == "none" and cfg.model.remat == "auto"
    assert "-> 'none'" in said[-1] and "GiB" in said[-1]
    assert Trainer(cfg, 256, mesh=mesh).cfg.model.remat == "none"
    assert remat_auto.device_memory_limit(mesh.devices.flat[0]) > GIB


def test_out_of_memory_advice_names_the_policy_and_the_next_steps():
    from mixerlab.training.config import load_config

    cfg = load_config("configs/tiny.yaml", ["model.remat=none", "train.batch_size=8", "data.seq_len=2048"])
    text = remat_auto.advice_after_oom(cfg, "auto")
    assert "model.remat=none (chosen by model.remat=auto" in text
    for change in ("model.remat=dots", "train.microbatches=2", "train.loss_chunk=1024", "train.batch_size=4"):
        assert change in text, change
    frugal = load_config("configs/tiny.yaml", ["model.remat=block", "train.batch_size=1"])
    tries = remat_auto.advice_after_oom(frugal, "block").split("; try ")[1]
    assert "model.remat" not in tries and "auto" not in tries and "batch_size" not in tries


def test_a_train_step_out_of_memory_raises_the_advice(tmp_path, monkeypatch):
    from mixerlab.training import loop, run_loop
    from mixerlab.training.config import load_config

    def oom(self, step):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 72.24GiB")

    monkeypatch.setattr(run_loop._Loop, "_step", oom)
    cfg = load_config("configs/tiny.yaml", [f"train.output_dir={tmp_path / 'run'}", "train.eval_every=0",
                                            "train.steps=6", "model.remat=kernels"])
    advice = r"model.remat=kernels, train.batch_size=\d+.*try model.remat=block"
    with pytest.raises(remat_auto.OutOfDeviceMemory, match=advice) as err:
        loop.train(cfg, progress=False)
    assert "72.24GiB" in str(err.value.__cause__)


def test_auto_starts_again_with_the_next_policy_when_its_choice_runs_out_of_memory(tmp_path, monkeypatch, capsys):
    """auto chose 'none' (the CPU host has room); the first step 'runs out of memory' under 'none' and 'dots'
    only: the run starts again with 'kernels' and finishes, and it says so. An explicit policy is not retried."""
    from mixerlab.training import loop, run_loop
    from mixerlab.training.config import load_config

    real_step, failed = run_loop._Loop._step, []

    def step(self, n):
        policy = self.trainer.cfg.model.remat
        if policy in ("none", "dots"):
            failed.append(policy)
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 72.24GiB")
        real_step(self, n)

    monkeypatch.setattr(run_loop._Loop, "_step", step)
    base = [f"train.output_dir={tmp_path / 'run'}", "train.eval_every=0", "train.steps=6", "checkpoint.every=0",
            "model.d_model=64", "model.num_layers=1", "train.batch_size=2"]
    run = loop.train(load_config("configs/tiny.yaml", base + ["model.remat=auto"]), progress=False)
    assert failed == ["none", "dots"] and run.final_step == 6 and len(run.train_losses) == 6
    said = "".join(capsys.readouterr())
    assert "'none' ran out of device memory" in said and "starting again with 'kernels'" in said
    failed.clear()
    with pytest.raises(remat_auto.OutOfDeviceMemory, match="try model.remat=kernels"):
        loop.train(load_config("configs/tiny.yaml", base + ["model.remat=dots", "train.resume=false"]),
                   progress=False)
    assert failed == ["dots"]


def _stats(peak):
    return type("Stats", (), {"peak_memory_in_bytes": peak})()


def test_xla_peak_above_the_count_is_said_and_not_otherwise():
    note = remat_auto.peak_note("none", _stats(11.58 * GIB), 10.6 * GIB)
    assert note == "model.remat=auto: 'none': XLA's peak for the step is 11.6 GiB, above the 10.6 GiB counted"
    assert remat_auto.peak_note("none", _stats(10.6 * GIB), 10.6 * GIB) is None
    assert remat_auto.peak_note("none", _stats(0), 10.6 * GIB) is None  # the runtime reports no peak


XLA_LINE = ("W1207 21:53:07.100602     992 hlo_rematerialization.cc:3363] Can't reduce memory use below 67.78GiB "
            "(72778903616 bytes) by rematerialization; only reduced to 69.55GiB (74683696388 bytes), down from "
            "70.00GiB (75157652780 bytes) originally\n")  # RWKV-7 166M, "kernels", on an H100 (2026-12-07)


def test_xlas_could_not_reduce_line_gives_the_bytes_it_still_needs():
    assert remat_auto.xla_remat_shortfall(XLA_LINE) == 74683696388
    assert remat_auto.xla_remat_shortfall("I1207 compiled\n" + XLA_LINE.replace("74683696388", "1") + XLA_LINE) \
        == 74683696388  # the largest of several
    assert remat_auto.xla_remat_shortfall("nothing about memory\n") is None


def _analysis(counted):
    return type("Mem", (), {"temp_size_in_bytes": counted})()


def test_needed_bytes_takes_xlas_larger_figure_from_the_compile_log_and_passes_the_log_on(capfd):
    import os

    said = []

    def compile_that_logs():  # C++ writes to file descriptor 2, not to sys.stderr
        os.write(2, XLA_LINE.encode())
        return _analysis(61.7 * GIB)

    assert remat_auto.needed_bytes("kernels", compile_that_logs, said.append) == 74683696388
    assert "puts it at 69.6 GiB (counted 61.7 GiB)" in said[0]
    assert XLA_LINE in capfd.readouterr().err  # nothing swallowed
    assert remat_auto.needed_bytes("kernels", lambda: _analysis(61.7 * GIB), said.append) == 61.7 * GIB
    assert len(said) == 1

