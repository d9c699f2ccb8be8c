"""logging.wandb: a 2-step tiny run in W&B offline mode writes the same scalars as metrics.jsonl, at the same
steps, into its offline run directory (read back from the run's .wandb transaction log)."""
import glob
import json
import os
import struct

import pytest

from mixerlab.training.config import ConfigError, load_config

BLOCK = 32768  # the .wandb file is a LevelDB-style log: 32 KiB blocks of (crc32, length, type, data) records
HEADER = 7  # ":W&B", magic 0xBEE1, version 1


def _records(path):
    """The protobuf payloads of a .wandb log (full records and first/middle/last fragments joined)."""
    with open(path, "rb") as f:
        raw = f.read()
    assert raw[:4] == b":W&B", "not a W&B transaction log"
    out, pending, pos = [], b"", HEADER
    while pos + 7 <= len(raw):
        left = BLOCK - pos % BLOCK
        if left < 7:  # the tail of a block too short for a record header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        data = raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        if kind == 1:
            out.append(data)
        elif kind == 2:
            pending = data
        elif kind == 3:
            pending += data
        elif kind == 4:
            out.append(pending + data)
            pending = b""
    return out


def _history(path) -> dict:
    """{step: {key: value}} of the history records."""
    from wandb.proto import wandb_internal_pb2

    rows = {}
    for data in _records(path):
        rec = wandb_internal_pb2.Record()
        rec.ParseFromString(data)
        if rec.WhichOneof("record_type") != "history":
            continue
        items = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
        step = rec.history.step.num if rec.history.HasField("step") else items.get("_step")
        rows.setdefault(int(step), {}).update({k: v for k, v in items.items() if not k.startswith("_")})
    return rows


@pytest.mark.slow  # ~25 s: a 2-step training run (compile) and the W&B service start-up
def test_offline_run_holds_the_logged_history(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install wandb); W&B logging is optional")
    from mixerlab.training.loop import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb_dir").mkdir()
    out = tmp_path / "run"
    cfg = load_config("configs/tiny.yaml", [
        f"train.output_dir={out}", "train.steps=2", "train.log_every=1", "train.eval_every=2", "train.eval_batches=1",
        "optim.warmup_steps=1", "checkpoint.every=0", "logging.wandb=true", "logging.wandb_mode=offline",
        "logging.wandb_project=mixerlab-test"])
    result = train(cfg, progress=False)
    logs = glob.glob(str(tmp_path / "wandb_dir" / "wandb" / "offline-run-*" / "run-*.wandb"))
    assert len(logs) == 1, os.listdir(tmp_path / "wandb_dir")
    history = _history(logs[0])
    rows = [json.loads(line) for line in open(result.metrics_path)]
    assert {r["step"] for r in rows} == set(history) == {1, 2}
    for r in rows:
        for k, v in r.items():
            if k not in ("step", "split"):
                assert history[r["step"]][f"{r['split']}/{k}"] == pytest.approx(v, rel=1e-6), (r["step"], k)
    assert "val/loss" in history[2] and "train/loss" in history[1]
    run_id = (out / "wandb_id.txt").read_text().strip()
    assert run_id in logs[0]  # the id a resumed run reuses


def test_logging_keys_are_checked():
    with pytest.raises(ConfigError, match="logging.wandb_mode"):
        load_config("configs/tiny.yaml", ["logging.wandb_mode=sometimes"])
    with pytest.raises(ConfigError, match="logging.wandb_project"):
        load_config("configs/tiny.yaml", ["logging.wandb=true", "logging.wandb_project= "])
    with pytest.raises(ConfigError, match="logging.wandb:"):
        load_config("configs/tiny.yaml", ["logging.wandb=yes please"])
    assert load_config("configs/tiny.yaml").logging.wandb is False
