"""Parameter accounting reproduces the Muir paper's tables (Tables 11 and 18) exactly, through the real decoder.

Hand derivation ("matrices only", models/param_count.py), V = 32,000, untied embeddings, d_k = d_v = 128, so
H d_k = H d_v = d, and a 2-matrix FFN (2 d d_ffn):
  embeddings + head        2 V d
  Transformer mixer        4 d^2                               (q, k, v, o)           d_ffn = 4d
  GDN-2 mixer              4 d^2 + 2 d^2 + 2 (2 128 d)         (+ dense b, w; f, g rank 128)   d_ffn = 3d - 256
  Muir mixer (any gamma)   4 d^2 + d 512 + 512 d               (fused down d x 512; ups r_m x d, sum r_m = 512)
                           + d for static / dynamic gamma      (gamma_stat)           d_ffn = 4d - 512
166M: L = 8, d = 1024:   embeddings 65,536,000
  Transformer  33,554,432 + 67,108,864 (FFN 4096)             = 166,199,296
  GDN-2        54,525,952 + 46,137,344 (FFN 2816)             = 166,199,296
  Muir no-g    41,943,040 + 58,720,256 (FFN 3584)             = 166,199,296
  Muir static  41,951,232 + 58,720,256                        = 166,207,488   (dynamic: the same)
406M: L = 11, d = 1536:  embeddings 98,304,000
  Transformer 103,809,024 + 207,618,048; GDN-2 164,364,288 + 147,062,784; Muir 121,127,424 + 190,316,544
  total 409,731,072 (Muir with gamma: 409,747,968)
1.34B: L = 24, d = 2048: embeddings 131,072,000
  Transformer 402,653,184 + 805,306,368; GDN-2 629,145,600 + 578,813,952; Muir 453,033,984 + 754,974,720
  total 1,339,031,552 (Muir with gamma: 1,339,080,704)
"""
from __future__ import annotations

import jax.numpy as jnp
import pytest
from flax import nnx

from mixerlab import mixers  # noqa: F401  (registration)
from mixerlab.models.decoder import abstract_model
from mixerlab.models.param_count import count_params, is_matrix_param
from mixerlab.training.config import load_config

# config file -> (mixer+gates matrices, FFN matrices, embeddings + head, total matrices, table value in M)
TABLE = {
    "transformer_166m": (33_554_432, 67_108_864, 65_536_000, 166_199_296, "166.20"),
    "gdn2_166m": (54_525_952, 46_137_344, 65_536_000, 166_199_296, "166.20"),
    "muir_no_gamma_166m": (41_943_040, 58_720_256, 65_536_000, 166_199_296, "166.20"),
    "muir_static_gamma_166m": (41_951_232, 58_720_256, 65_536_000, 166_207_488, "166.21"),
    "muir_166m": (41_951_232, 58_720_256, 65_536_000, 166_207_488, "166.21"),
    "transformer_406m": (103_809_024, 207_618_048, 98_304_000, 409_731_072, "409.73"),
    "gdn2_406m": (164_364_288, 147_062_784, 98_304_000, 409_731_072, "409.73"),
    "muir_406m": (121_127_424, 190_316_544, 98_304_000, 409_747_968, "409.75"),
    "transformer_1p34b": (402_653_184, 805_306_368, 131_072_000, 1_339_031_552, "1339.03"),
    "gdn2_1p34b": (629_145_600, 578_813_952, 131_072_000, 1_339_031_552, "1339.03"),
    "muir_1p34b": (453_033_984, 754_974_720, 131_072_000, 1_339_080_704, "1339.08"),
}


def _formula(mixer: str, L: int, d: int, d_ffn: int, V: int = 32_000, gamma: bool = False) -> tuple[int, int, int]:
    per_layer = {"transformer": 4 * d * d, "gdn2": 6 * d * d + 512 * d, "muir": 4 * d * d + 2 * 512 * d}[mixer]
    per_layer += d if gamma else 0
    return L * per_layer, L * 2 * d * d_ffn, 2 * V * d


def test_hand_table_matches_the_closed_forms():
    """The literal integers above follow from the module docstring's closed forms (guards against typos)."""
    scales = {"166m": (8, 1024), "406m": (11, 1536), "1p34b": (24, 2048)}
    ffn = {"transformer": lambda d: 4 * d, "gdn2": lambda d: 3 * d - 256, "muir": lambda d: 4 * d - 512}
    for name, (mix, f, emb, total, _) in TABLE.items():
        kind = "transformer" if name.startswith("transformer") else "gdn2" if name.startswith("gdn2") else "muir"
        L, d = scales[name.rsplit("_", 1)[1]]
        gamma = kind == "muir" and "no_gamma" not in name
        assert _formula(kind, L, d, ffn[kind](d), gamma=gamma) == (mix, f, emb), name
        assert mix + f + emb == total, name


_CACHE: dict = {}


def _count(name: str) -> dict:
    if name not in _CACHE:
        cfg = load_config(f"configs/paper/{name}.yaml")
        _CACHE[name] = count_params(abstract_model(cfg, cfg.model.vocab_size))
    return _CACHE[name]


@pytest.mark.parametrize("name", list(TABLE))
def test_paper_models_matrices_only(name):
    mix, ffn, emb, total, table_m = TABLE[name]
    c = _count(name)
    g = c["matrices_by_group"]
    assert g["mixer"] == mix
    assert g["ffn"] == ffn
    assert g["embed"] + g["lm_head"] == emb
    assert c["matrices"] == total
    assert f"{c['matrices'] / 1e6:.2f}" == table_m


def test_all_parameters_of_muir_166m():
    """'all' adds, per layer, the 3 short-conv kernels (3 * 4 d), A_log (H), c_f, c_b, c_g, c_w, c_q (5 d),
    omega (d_v) and the two block RMSNorms (2 d); plus the final norm (d)."""
    d, L, H = 1024, 8, 8
    extra = L * (3 * 4 * d + H + 5 * d + 128 + 2 * d) + d
    assert extra == 157_760
    assert _count("muir_166m")["all"] == 166_207_488 + 157_760 == 166_365_248


def test_rule_is_by_type():
    from mixerlab.mixers.base import DynamicsParam
    from mixerlab.mixers.gates import ReadoutGain
    from mixerlab.mixers.short_conv import ShortConvKernel

    assert is_matrix_param(nnx.Param(jnp.zeros((3, 4))))
    assert not is_matrix_param(nnx.Param(jnp.zeros((4,))))  # bias / norm scale
    assert not is_matrix_param(ShortConvKernel(jnp.zeros((4, 8))))
    assert not is_matrix_param(DynamicsParam(jnp.zeros((8, 4))))
    assert is_matrix_param(ReadoutGain(jnp.ones((8,))))
