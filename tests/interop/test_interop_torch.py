"""The exported directories in the PyTorch tools themselves (skipped where torch / transformers / fla are absent):
HF transformers loads the softmax export as LlamaForCausalLM with no missing or unexpected key and its float32
logits equal mixerlab's; fla's model classes load the delta-family exports strictly, GDN-2 through the model code
copied into its directory (trust_remote_code); ``load_torch`` loads them all. fla's layers run Triton kernels
only, so their forward parity runs on a CUDA machine alone."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mixerlab.models.decoder import build_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.interop.test_interop import EXPORTABLE, LOW_RANK, V, _cfg, _randomize, make_cfg  # noqa: E402

LOGIT_TOL = 1e-5  # float32 on CPU: measured max |difference| ~2e-7 on logits of size ~1 (tiny models here)


@pytest.fixture(autouse=True)
def _full_precision_matmuls():
    """GPUs default to TF32 for float32 matmuls (errors ~1e-3 on these logits): ask for full float32."""
    with jax.default_matmul_precision("float32"):
        yield


def _load_hf(out):
    from mixerlab.interop import load_torch

    model, info = load_torch(str(out), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


@pytest.mark.parametrize("case", ["softmax", "softmax_tied_hd24"])
def test_transformers_llama_loads_the_export_and_its_logits_match(case, tmp_path):
    from mixerlab.interop import export_model

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
    from mixerlab.interop import export_model

    cfg = _cfg(case)
    model = _randomize(build_model(cfg, V, seed=2), seed=5)
    model_type = export_model(model, cfg, str(tmp_path))
    hf = _load_hf(tmp_path)
    assert type(hf).__name__ == ARCHITECTURE[model_type]
    _assert_tensors_equal(hf, tmp_path)
    if model_type == "gdn2":  # the copied model code put fla's GatedDeltaNet2 in every block
        assert {type(b.attn).__name__ for b in hf.model.layers} == {"GatedDeltaNet2"}


ARCHITECTURE = {"delta_net": "DeltaNetForCausalLM", "gated_deltanet": "GatedDeltaNetForCausalLM",
                "kda": "KDAForCausalLM", "gdn2": "GDN2ForCausalLM", "llama": "LlamaForCausalLM"}


def _assert_tensors_equal(hf, out):
    from safetensors.numpy import load_file

    state = hf.state_dict()
    for name, x in load_file(str(out / "model.safetensors")).items():
        np.testing.assert_array_equal(state[name].numpy(), x, err_msg=name)


def test_gdn2_needs_trust_remote_code(tmp_path):
    """Without trust_remote_code transformers refuses to run the copied code (it knows no gdn2 model itself)."""
    _fla()
    from mixerlab.interop import export_model

    cfg = _cfg("gdn2")
    export_model(build_model(cfg, V), cfg, str(tmp_path))
    with pytest.raises(ValueError, match="contains custom code"):
        transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), trust_remote_code=False)


def test_gdn2_hybrid_keeps_fla_attention_in_its_softmax_layers(tmp_path, monkeypatch):
    """The copied model code swaps in GatedDeltaNet2 only where fla's config has no softmax (attn) layer."""
    _fla_for("gdn2_softmax_hybrid", monkeypatch, forward=False)
    from mixerlab.interop import export_model

    cfg = make_cfg("gdn2", layer_pattern=["gdn2", "softmax"], mixer_options=LOW_RANK | {"gate_act": "sigmoid"})
    assert export_model(_randomize(build_model(cfg, V, seed=2), seed=5), cfg, str(tmp_path)) == "gdn2"
    hf = _load_hf(tmp_path)
    assert [type(b.attn).__name__ for b in hf.model.layers] == ["GatedDeltaNet2", "Attention"]
    _assert_tensors_equal(hf, tmp_path)


def test_load_torch_drops_use_kernels_where_transformers_lacks_it(monkeypatch):
    calls = []

    def old_from_pretrained(hf_dir, **kwargs):  # an older transformers: no use_kernels argument
        calls.append(kwargs)
        if "use_kernels" in kwargs:
            raise TypeError("__init__() got an unexpected keyword argument 'use_kernels'")
        return "model"

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", old_from_pretrained)
    from mixerlab.interop import load_torch

    assert load_torch("dir", dtype=torch.float32) == "model"
    assert calls == [{"use_kernels": False, "trust_remote_code": True, "dtype": torch.float32},
                     {"trust_remote_code": True, "dtype": torch.float32}]


@pytest.mark.parametrize("case", ["softmax", "gdn2_tied"])
def test_load_torch_loads_the_export(case, tmp_path):
    if case != "softmax":
        _fla()
    from mixerlab.interop import export_model, load_torch

    cfg = _cfg(case)
    model = _randomize(build_model(cfg, V, seed=2), seed=5)
    model_type = export_model(model, cfg, str(tmp_path))
    hf, info = load_torch(str(tmp_path), dtype=torch.float32, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(hf).__name__ == ARCHITECTURE[model_type]
    _assert_tensors_equal(hf, tmp_path)


FLA_LOGIT_TOL = 2e-3  # fla's chunked Triton kernels (TF32 dots inside) against mixerlab's float32 forward


@pytest.mark.parametrize("case", FLA_CASES)
def test_fla_logits_match_on_cuda(case, tmp_path, monkeypatch):
    _fla_for(case, monkeypatch, forward=True)
    if not torch.cuda.is_available():
        pytest.skip("fla's layers run Triton kernels only: forward parity needs a CUDA device")
    from mixerlab.interop import export_model

    cfg = _cfg(case)
    model = _randomize(build_model(cfg, V, seed=2), seed=5)
    export_model(model, cfg, str(tmp_path))
    hf = _load_hf(tmp_path).cuda()
    tokens = np.random.default_rng(1).integers(0, V, (2, 64))
    ours = np.asarray(model(jnp.asarray(tokens, jnp.int32)))
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens).cuda()).logits.float().cpu().numpy()
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=FLA_LOGIT_TOL)


GDN2_PARITY = r'''
import json, os, sys
sys.path.insert(0, os.path.join(sys.argv[1], "tools"))
import jax, jax.numpy as jnp, numpy as np, torch
import parity_torch
from mixerlab import interop
from mixerlab.models.decoder import build_model
from tests.interop.test_interop import LOW_RANK, V, _randomize, make_cfg

parity_torch.limit_triton_autotune(1)
parity_torch.use_naive_gdn2_core()
cfg = make_cfg("gdn2", mixer_options=LOW_RANK | {"gate_act": "sigmoid"})
model = _randomize(build_model(cfg, V, seed=2), seed=5)
interop.export_model(model, cfg, sys.argv[2])
hf = interop.load_torch(sys.argv[2], dtype=torch.float32).train()  # train(): fla's layer takes its chunk path
tokens = np.random.default_rng(1).integers(0, V, (2, 80))
with jax.default_matmul_precision("float32"):
    ours = np.asarray(model(jnp.asarray(tokens, jnp.int32)))
with torch.no_grad():
    theirs = hf(torch.tensor(tokens)).logits.numpy()
print(json.dumps({"max_abs": float(np.abs(ours - theirs).max()), "scale": float(np.abs(ours).max())}))
'''


def test_gdn2_logits_equal_fla_gdn2_layer_around_its_naive_recurrence(tmp_path):
    """GDN-2 on CPU: fla's whole model (its GatedDeltaNet2 layer: projections, short convolutions, gates, gated
    norm) with fla's own token-by-token ``naive_recurrent_gdn2`` in place of the chunk kernel, which the Triton
    interpreter cannot run; fla's other Triton kernels run interpreted (TRITON_INTERPRET=1, set before triton is
    imported, hence the subprocess). Same logits as mixerlab's float32 forward."""
    import json
    import os
    import subprocess
    import sys

    _fla()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TRITON_INTERPRET": "1", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, "-c", GDN2_PARITY, root, str(tmp_path / "hf")], env=env, cwd=root,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    err = json.loads(run.stdout.strip().splitlines()[-1])
    assert err["max_abs"] <= LOGIT_TOL * max(1.0, err["scale"]), err
