"""Model code that HF transformers runs with ``trust_remote_code=True`` for a ``model_type`` no installed library
defines (fla 0.6.0 has the layer ``GatedDeltaNet2`` but no GDN-2 model). The template files beside this one are
copied verbatim into the exported directory and named in config.json's ``auto_map``; they import only torch,
transformers and fla, never mixerlab, so the directory loads where mixerlab is not installed."""
from __future__ import annotations

import os
import shutil

_HERE = os.path.dirname(os.path.abspath(__file__))
# model_type -> (template files, config.json auto_map)
REMOTE_CODE = {
    "gdn2": (("configuration_mixerlab_gdn2.py", "modeling_mixerlab_gdn2.py"),
             {"AutoConfig": "configuration_mixerlab_gdn2.GDN2Config",
              "AutoModelForCausalLM": "modeling_mixerlab_gdn2.GDN2ForCausalLM"}),
}


def auto_map(model_type: str) -> dict | None:
    """config.json's ``auto_map`` for this model_type, or None where a library defines the model."""
    entry = REMOTE_CODE.get(model_type)
    return dict(entry[1]) if entry else None


def files(model_type: str) -> tuple[str, ...]:
    entry = REMOTE_CODE.get(model_type)
    return entry[0] if entry else ()


def template_path(name: str) -> str:
    return os.path.join(_HERE, name)


def write(model_type: str, out_dir: str) -> list[str]:
    """Copies this model_type's template files into ``out_dir``; returns their names (none for library models)."""
    names = files(model_type)
    for name in names:
        shutil.copyfile(template_path(name), os.path.join(out_dir, name))
    return list(names)
