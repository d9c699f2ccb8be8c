"""The PyTorch model of an exported directory, for parity tools and users: one call for every target."""
from __future__ import annotations


def load_torch(hf_dir: str, **kwargs):
    """``transformers.AutoModelForCausalLM`` of any directory ``export_model`` writes: Llama (transformers), fla's
    models (``import fla`` registers them with the Auto classes) and GDN-2 (the model code copied into the
    directory, hence ``trust_remote_code=True``). ``kwargs`` go to ``from_pretrained`` (``dtype=...``,
    ``output_loading_info=True``, ...). fla's kernel hub is off (``use_kernels=False``) where transformers has it."""
    import transformers

    try:
        import fla  # noqa: F401  registers fla's model classes with transformers' Auto classes
    except ImportError:
        pass
    load = transformers.AutoModelForCausalLM.from_pretrained
    kwargs = {"trust_remote_code": True} | kwargs
    try:
        return load(hf_dir, use_kernels=False, **kwargs)
    except TypeError as e:  # transformers without the use_kernels argument
        if "use_kernels" not in str(e):
            raise
        return load(hf_dir, **kwargs)
