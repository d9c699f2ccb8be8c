"""Run outputs: metrics.jsonl (one JSON object per logged step/eval), TensorBoard events and a loss-curve PNG."""
from __future__ import annotations

import json
import math
import os

import jax

from mixerlab.training import storage

JSONL = "metrics.jsonl"
TENSORBOARD = "tensorboard"


class MetricsWriter:
    """Writes only on process 0; every other process gets a no-op writer.

    For a gs:// / s3:// run directory the files are written in a local staging copy (object stores cannot
    append): the bucket's metrics.jsonl is downloaded first, and ``sync()`` uploads both files.
    """

    def __init__(self, run_dir: str, staging: storage.Staging | None = None):
        self.enabled = jax.process_index() == 0
        self.run_dir = run_dir
        self.staging = staging if staging is not None else storage.Staging(run_dir)
        self.jsonl_path = self.staging.path(JSONL)  # the local file (the run directory's own when local)
        self.jsonl_url = storage.join(run_dir, JSONL)  # where it lives
        self.tb_dir = self.staging.path(TENSORBOARD)
        self._tb = None
        if self.enabled:
            storage.makedirs(run_dir, "train.output_dir")
            self.staging.pull(JSONL)
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(self.tb_dir, flush_secs=10)

    def write(self, step: int, split: str, values: dict) -> None:
        if not self.enabled:
            return
        row = {"step": int(step), "split": split, **{k: float(v) for k, v in values.items()}}
        with open(self.jsonl_path, "a") as f:
            f.write(json.dumps(row) + "\n")
        for k, v in values.items():
            self._tb.add_scalar(f"{split}/{k}", float(v), int(step))

    def write_event(self, step: int, split: str, fields: dict) -> None:
        """A row that is not a scalar (e.g. ``config_change`` with the settings a resumed run changed): in
        metrics.jsonl only, where readers select rows by ``split``."""
        if not self.enabled:
            return
        with open(self.jsonl_path, "a") as f:
            f.write(json.dumps({"step": int(step), "split": split, **fields}) + "\n")

    def truncate_after(self, step: int) -> int:
        """On resume, drop rows logged after the checkpoint we restart from (they will be logged again, and
        rows of an attempt that never reached a checkpoint belong to no run). Returns the rows dropped."""
        if not self.enabled or not os.path.exists(self.jsonl_path):
            return 0
        with open(self.jsonl_path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        kept = [row for row in rows if row["step"] <= step]
        tmp = self.jsonl_path + ".tmp"
        with open(tmp, "w") as f:
            for row in kept:
                f.write(json.dumps(row) + "\n")
        os.replace(tmp, self.jsonl_path)  # a kill during the rewrite leaves the old file, not half of it
        return len(rows) - len(kept)

    def resume_at(self, step: int) -> int:
        """truncate_after(step), and TensorBoard rebuilt from the kept rows when rows were dropped, so that
        both show the same run. Returns the rows dropped."""
        dropped = self.truncate_after(step)
        if dropped and self._tb is not None:
            import shutil

            from tensorboardX import SummaryWriter

            self._tb.close()
            shutil.rmtree(self.tb_dir, ignore_errors=True)
            if self.staging.remote:
                storage.remove(self.staging.remote_path(TENSORBOARD), "train.output_dir")
            self._tb = SummaryWriter(self.tb_dir, flush_secs=10)
            for row in read_metrics(self.jsonl_path):
                for k, v in row.items():
                    if k not in ("step", "split") and isinstance(v, (int, float)):  # scalars (not events)
                        self._tb.add_scalar(f"{row['split']}/{k}", float(v), int(row["step"]))
            self._tb.flush()
        return dropped

    def sync(self, *, strict: bool = True) -> None:
        """Uploads metrics.jsonl and the TensorBoard events (remote run directories; a no-op locally)."""
        if not (self.enabled and self.staging.remote):
            return
        if self._tb is not None:
            self._tb.flush()
        self.staging.push(JSONL, strict=strict)
        self.staging.push(TENSORBOARD, strict=strict)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        self.sync(strict=False)


def read_metrics(path: str) -> list[dict]:
    """The rows of a metrics.jsonl (a local path or a URL)."""
    return [json.loads(line) for line in storage.read_text(path).splitlines() if line.strip()]


def plot_loss_curve(jsonl_path: str, png_path: str, title: str = "") -> str:
    """Training loss per logged step and validation loss per eval, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(jsonl_path)
    train = [(r["step"], r["loss"]) for r in rows if r["split"] == "train" and math.isfinite(r.get("loss", math.nan))]
    val = [(r["step"], r["loss"]) for r in rows if r["split"] == "val"]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return png_path
