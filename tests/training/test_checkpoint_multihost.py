"""Staged (s3://) checkpoints are written by one host: a multi-process run is refused with one line, at once."""
import jax
import pytest

pytest.importorskip("s3fs", reason="s3fs is not installed (runtime extra mixerlab[cloud])")

from mixerlab.training import checkpoint  # noqa: E402


def test_a_multi_process_run_is_refused_on_s3(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(checkpoint.CheckpointError) as err:
        checkpoint.Checkpointer("s3://bucket/run/checkpoints", keep=2, async_save=False)
    assert str(err.value) == (
        "checkpoint directory s3://bucket/run/checkpoints: s3:// checkpoints are staged on one host and uploaded; a "
        "run of 2 processes needs gs:// or a folder every host shares (train.output_dir)")
