"""Checkpoint interop: a mixerlab model <-> an HF transformers / flash-linear-attention model directory.

``export_model(model, cfg, out_dir, tokenizer_path=None) -> model_type`` and ``import_model(hf_dir) -> (cfg,
model)`` work on in-memory models; ``load_torch(hf_dir, **kwargs)`` is the exported directory's PyTorch model
(transformers + fla, imported inside); ``export_run`` / ``import_run`` on run directories (config.yaml + orbax
checkpoints); the console scripts are ``mixerlab-export`` and ``mixerlab-import``. docs/interop.md has the
mapping tables (code: ``tables.py``), the targets and every refused setting.
"""
from mixerlab.interop.errors import InteropRefused
from mixerlab.interop.hf_dir import export_model, import_model
from mixerlab.interop.run_dir import export_run, import_run
from mixerlab.interop.torch_load import load_torch

__all__ = ["InteropRefused", "export_model", "import_model", "export_run", "import_run", "load_torch"]
