"""The exported directories in the PyTorch tools themselves (skipped where torch / transformers / fla are absent):
HF transformers loads the softmax export as LlamaForCausalLM with no missing or unexpected key and its float32
logits equal mixerlab's; fla's model classes load the delta-family exports strictly. fla's layers run Triton
kernels only, so their forward parity runs on a CUDA machine alone."""
import json

import jax.numpy as jnp
import numpy as np
import pytest

from mixerlab.models.decoder import build_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.models.test_interop import EXPORTABLE, V, _cfg, _randomize  # noqa: E402

LOGIT_TOL = 1e-5  # float32 on CPU: measured max |difference| ~2e-7 on logits of size ~1 (tiny models here)


def _load_hf(out):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        str(out), dtype=torch.float32, use_kernels=False, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


@pytest.mark.parametrize("case", ["softmax", "softmax_tied_hd24"])
def test_transformers_llama_loads_the_export_and_its_logits_match(case, tmp_path):
    from mixerlab.models.interop import export_model

    cfg = _cfg(case)
    model = _randomize(build_model(cfg, V, seed=2), seed=5)
    assert export_model(model, cfg, str(tmp_path)) == "llama"
    hf = _load_hf(tmp_path)
    assert type(hf).__name__ == "LlamaForCausalLM"
    tokens = np.random.default_rng(1).integers(0, V, (3, 24))
    ours = np.asarray(model(jnp.asarray(tokens, jnp.int32)))
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=LOGIT_TOL)


def _fla():
    return pytest.importorskip("fla", reason="flash-linear-attention (fla) is not installed")


def _gdn2_model(out):
    """fla 0.6.0 has GatedDeltaNet2 as a layer only: its KDA model (same block layout) with that layer in
    every block, from the exported config.json."""
    from fla.layers.gdn2 import GatedDeltaNet2
    from fla.models import KDAConfig, KDAForCausalLM

    hf = json.load(open(out / "config.json"))
    fields = {k: v for k, v in hf.items() if k not in ("model_type", "architectures", "mixerlab")}
    config = KDAConfig(**fields)
    model = KDAForCausalLM(config)
    for i, block in enumerate(model.model.layers):
        block.attn = GatedDeltaNet2(hidden_size=config.hidden_size, expand_v=config.expand_v,
                                    head_dim=config.head_dim, num_heads=config.num_heads,
                                    use_short_conv=config.use_short_conv, allow_neg_eigval=config.allow_neg_eigval,
                                    conv_size=config.conv_size, norm_eps=config.norm_eps, layer_idx=i)
    from safetensors.torch import load_file

    state = load_file(str(out / "model.safetensors"))
    if config.tie_word_embeddings:
        model.tie_weights()
        state["lm_head.weight"] = state["model.embeddings.weight"]
    result = model.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    return model.eval()


FLA_CASES = sorted(c for c in EXPORTABLE if set(_cfg(c).model.layer_mixers) != {"softmax"})


def _no_flash_attn(*args, **kwargs):
    raise RuntimeError("flash-attn is not installed: this fla attention layer was built for loading only")


def _fla_for(case, monkeypatch, *, forward: bool):
    """fla, and for a hybrid (fla's attn setting) its Attention layer: it refuses to be built without flash-attn
    (a CUDA build), so where that is absent a loading test builds it with a stand-in that fails if called."""
    _fla()
    if "hybrid" in case:
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            if forward:
                pytest.skip("fla's attention layers run flash-attn, which is not installed")
            import fla.layers.attn

            monkeypatch.setattr(fla.layers.attn, "flash_attn_func", _no_flash_attn)
            monkeypatch.setattr(fla.layers.attn, "flash_attn_varlen_func", _no_flash_attn, raising=False)


@pytest.mark.parametrize("case", FLA_CASES)
def test_fla_loads_the_export_strictly(case, tmp_path, monkeypatch):
    _fla_for(case, monkeypatch, forward=False)
    from mixerlab.models.interop import export_model

    cfg = _cfg(case)
    model = _randomize(build_model(cfg, V, seed=2), seed=5)
    model_type = export_model(model, cfg, str(tmp_path))
    hf = _gdn2_model(tmp_path) if model_type == "gdn2" else _load_hf(tmp_path)
    state = hf.state_dict()
    from safetensors.numpy import load_file

    for name, x in load_file(str(tmp_path / "model.safetensors")).items():
        np.testing.assert_array_equal(state[name].numpy(), x, err_msg=name)


FLA_LOGIT_TOL = 2e-3  # fla's chunked Triton kernels (TF32 dots inside) against mixerlab's float32 forward


@pytest.mark.parametrize("case", FLA_CASES)
def test_fla_logits_match_on_cuda(case, tmp_path, monkeypatch):
    _fla_for(case, monkeypatch, forward=True)
    if not torch.cuda.is_available():
        pytest.skip("fla's layers run Triton kernels only: forward parity needs a CUDA device")
    from mixerlab.models.interop import export_model

    cfg = _cfg(case)
    model = _randomize(build_model(cfg, V, seed=2), seed=5)
    model_type = export_model(model, cfg, str(tmp_path))
    hf = (_gdn2_model(tmp_path) if model_type == "gdn2" else _load_hf(tmp_path)).cuda()
    tokens = np.random.default_rng(1).integers(0, V, (2, 64))
    ours = np.asarray(model(jnp.asarray(tokens, jnp.int32)))
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens).cuda()).logits.float().cpu().numpy()
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=FLA_LOGIT_TOL)
