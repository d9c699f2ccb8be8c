"""Optional Weights & Biases logging (``logging.wandb: true``): the scalars of metrics.jsonl, at the same steps.

``open_tracker(cfg, run_dir)`` returns a ``WandbTracker`` on process 0 when ``logging.wandb`` is on, else a
no-op ``NullTracker``; both have ``write(step, split, values)`` (called next to ``MetricsWriter.write``, so
W&B shows ``train/loss``, ``val/perplexity``... exactly as TensorBoard does) and ``close()``.

The W&B run id is kept in ``<output_dir>/wandb_id.txt``: a resumed training run appends to the same W&B run
(``resume="allow"``). Rows logged after the restored checkpoint by the interrupted attempt stay in W&B (it
does not rewrite history), while metrics.jsonl and TensorBoard drop them. Files go to ``$WANDB_DIR`` if set,
else to the run's output directory (``<output_dir>/wandb/``); ``wandb_mode: offline`` writes there only (upload
later with ``wandb sync``).
"""
from __future__ import annotations

import os
import uuid

ID_FILE = "wandb_id.txt"


class NullTracker:
    def write(self, step: int, split: str, values: dict) -> None:
        pass

    def close(self) -> None:
        pass


class WandbTracker:
    def __init__(self, cfg, run_dir: str):
        try:
            import wandb
        except ImportError:
            raise RuntimeError("logging.wandb: true needs the wandb package (pip install wandb), or set "
                               "logging.wandb=false") from None
        self._wandb = wandb
        log_cfg = cfg.logging
        id_path = os.path.join(run_dir, ID_FILE)
        if os.path.exists(id_path):
            with open(id_path) as f:
                run_id = f.read().strip()
        else:
            run_id = uuid.uuid4().hex[:12]
            os.makedirs(run_dir, exist_ok=True)
            with open(id_path, "w") as f:
                f.write(run_id + "\n")
        directory = os.environ.get("WANDB_DIR") or run_dir
        try:
            self.run = wandb.init(project=log_cfg.wandb_project,
                                  name=log_cfg.wandb_run_name or os.path.basename(os.path.normpath(run_dir)),
                                  mode=log_cfg.wandb_mode, dir=directory, id=run_id, resume="allow",
                                  config=cfg.to_dict())
        except Exception as e:  # no login, no network in online mode, bad project name
            raise RuntimeError(f"logging.wandb: wandb.init failed ({type(e).__name__}: {e}); run `wandb login`, or "
                               f"set logging.wandb_mode=offline (upload later with `wandb sync`), or "
                               f"logging.wandb=false") from e

    def write(self, step: int, split: str, values: dict) -> None:
        self.run.log({f"{split}/{k}": float(v) for k, v in values.items()}, step=int(step))

    def close(self) -> None:
        self.run.finish()


def open_tracker(cfg, run_dir: str):
    import jax

    if not cfg.logging.wandb or jax.process_index() != 0:
        return NullTracker()
    return WandbTracker(cfg, run_dir)
