"""A run directory belongs to one run: checks made before a step is computed.

* ``check_writable``: the output and checkpoint folders accept files (not discovered at the first save).
* ``compare_with_checkpoint``: on resume, the requested config against the one stored with the newest
  checkpoint. A change to the model, the optimizer or the data order is refused (``RunDirError``, nothing
  in the directory is touched); a change of length, cadence, logging, checkpointing, profiling or layout is
  allowed and returned as notes.
"""
from __future__ import annotations

import json
import os
import tempfile
import uuid

import yaml

from mixerlab.training import storage


class RunDirError(ValueError):
    """The run directory cannot be used as requested; the message says why and what to do, in one line."""


# Keys a resumed run may change: they do not alter the model, the optimizer state or the data order.
# The optimizer's schedule and decay keys only change the update from the resumed step on (its state, the
# moments and the step count, has the same shape and meaning): lowering optim.lr after a divergence is allowed.
SAFE_KEYS = ("train.steps", "train.log_every", "train.eval_every", "train.eval_batches", "train.output_dir",
             "train.resume", "train.max_consecutive_skips", "train.microbatches", "train.loss_chunk", "train.prefetch",
             "checkpoint.", "profile.", "logging.", "mesh.", "data.val_path", "model.remat",
             "optim.lr", "optim.min_lr_ratio", "optim.warmup_steps", "optim.weight_decay")
# Changes that alter which batches follow the saved data position. The position is grain's iterator state per
# batch row (each row reads its own slice of the documents) and per packed sequence, so it has no meaning for
# another batch size, sequence length, file set, tokenizer, shuffle seed or worker layout: refused, not remapped.
DATA_KEYS = ("train.batch_size", "train.seed", "data.")
NOTES = {"train.steps": "the cosine schedule now decays over the new number of steps",
         "optim.lr": "the schedule's peak and floor (optim.lr x optim.min_lr_ratio) change from the resumed step on",
         "optim.min_lr_ratio": "the cosine schedule now decays to the new floor",
         "optim.warmup_steps": "the schedule is recomputed from the resumed step on"}


def check_writable(path: str, key: str) -> None:
    """Creates ``path`` if needed and writes a probe file into it; RunDirError naming ``key`` if it cannot.
    For a gs:// / s3:// URL the probe is a small object, written and deleted (credentials, bucket, permission)."""
    if storage.is_url(path):
        probe = storage.join(path, f".write-check-{uuid.uuid4().hex}")
        try:
            storage.write_text(probe, "", key)
            storage.remove(probe, key)
        except storage.StorageError as e:  # named by the folder, not the probe: credentials, bucket, ...
            raise RunDirError(f"{storage.describe(e.__cause__ or e, path, key)} (a test object could not be "
                              f"written)") from None
        return
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as e:
        raise RunDirError(f"{key}: cannot write to {path} ({e.strerror or e}); fix its permissions or free "
                          f"space, or choose another train.output_dir") from None


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _newest_stored_config(run_dir: str) -> tuple[int | None, dict | None]:
    """(newest checkpoint step, the config stored with it). Older checkpoints have no config in their
    metadata; then config.yaml of the run directory (written by the run that saved them) is used."""
    ckpt_dir = storage.join(run_dir, "checkpoints")
    steps = sorted((int(n) for n in storage.listdir(ckpt_dir, "train.output_dir") if n.isdigit()), reverse=True) \
        if storage.isdir(ckpt_dir, "train.output_dir") else []
    if not steps:
        return None, None
    for step in steps:
        try:
            meta = json.loads(storage.read_text(storage.join(ckpt_dir, str(step), "meta", "metadata")))
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict) and isinstance(meta.get("config"), dict):
            return steps[0], meta["config"]
    try:
        return steps[0], yaml.safe_load(storage.read_text(storage.join(run_dir, "config.yaml")))
    except (OSError, yaml.YAMLError):
        return steps[0], None


def _kind(key: str) -> str:
    if any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_KEYS):
        return "safe"
    if any(key == s or (s.endswith(".") and key.startswith(s)) for s in DATA_KEYS):
        return "data"
    return "state"


_MISSING = "<not set>"
_LEADING = ("model.mixer", "model.layer_pattern")  # the changes that bring other keys with them


def changed_settings(cfg, run_dir: str) -> dict:
    """{key: (value stored with the newest checkpoint, value now)} of every key that differs; {} without a
    checkpoint (or without a stored config)."""
    _step, stored = _newest_stored_config(run_dir)
    if stored is None:
        return {}
    old, new = _flatten(stored), _flatten(cfg.to_dict())
    return {k: (old.get(k, _MISSING), new.get(k, _MISSING)) for k in sorted(set(old) | set(new))
            if old.get(k, _MISSING) != new.get(k, _MISSING)}


def _describe_refused(refused: dict) -> str:
    """The user's changes first (keys set on both sides with different values; the mixer first), then the keys
    they brought or removed (e.g. the old mixer's mixers.<name>.* options), grouped by section."""
    both = {k: v for k, v in refused.items() if _MISSING not in v}
    order = sorted(both, key=lambda k: (k not in _LEADING, k))
    parts = [f"{k}: {both[k][0]!r} in the checkpoint, {both[k][1]!r} now" for k in order]
    groups: dict = {}
    for k, (a, _b) in refused.items():
        if k not in both:
            groups.setdefault((k.rsplit(".", 1)[0], a == _MISSING), []).append(k)
    for (section, added), keys in sorted(groups.items()):
        where = "set now, not in the checkpoint" if added else "in the checkpoint, not set now"
        names = ", ".join(k.rsplit(".", 1)[1] for k in keys)
        parts.append(f"{section}.* ({len(keys)} keys: {names}) {where}" if len(keys) > 1 else f"{keys[0]}: {where}")
    return "; ".join(parts)


def _new_output_dir(cfg, run_dir: str) -> str:
    """A train.output_dir next to ``run_dir`` that holds nothing yet (named after the new mixer when it changed)."""
    base = f"{run_dir.rstrip('/')}-{cfg.model.mixer}"
    candidate, n = base, 2
    while storage.exists(candidate, "train.output_dir"):
        candidate, n = f"{base}-{n}", n + 1
    return candidate


def compare_with_checkpoint(cfg, run_dir: str) -> list[str]:
    """Notes on the allowed changes; RunDirError naming every refused key with both values."""
    step, _stored = _newest_stored_config(run_dir)
    changed = changed_settings(cfg, run_dir) if step is not None else {}
    refused = {k: v for k, v in changed.items() if _kind(k) != "safe"}
    if refused:
        what = _describe_refused(refused)
        why = []
        if any(_kind(k) == "state" for k in refused):
            why.append("the model or optimizer state would differ")
        if any(_kind(k) == "data" for k in refused):
            why.append("the saved data position belongs to the old data pipeline (batch size, sequence length, "
                       "files, tokenizer, order, workers) and cannot be remapped to the new one")
        raise RunDirError(
            f"{run_dir} holds checkpoints (newest step {step}) of a run with a different config: {what}. Refused "
            f"because {' and '.join(why)}; nothing in the directory was changed. Start the new run in a new "
            f"directory (train.output_dir={_new_output_dir(cfg, run_dir)}), resume with the old values, or start "
            f"over here with train.resume=false (the old files are kept as *.previous-N)")
    return [f"{k}: {a!r} in the checkpoint, {b!r} now" + (f" ({NOTES[k]})" if k in NOTES else "")
            for k, (a, b) in changed.items() if k not in ("train.output_dir", "train.resume")]
