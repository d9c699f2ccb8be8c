"""Closed-form stationary state-row energy of the GDN-2 / Muir recurrence with fixed gates (derived here).

The Muir paper's law (its eq. (5), Prop. 3.4, used in Fig. 11 and Table 6) is not in the version of the paper
we have (it keeps only captions and tables), so the law below is derived for this input model:

    S_t = (I − k_tᵀ(b ⊙ k_t)) Diag(α) S_{t−1} + k_tᵀ(w ⊙ v_t)   (key-major, row vectors; docs/math/delta_rule.md)

* gates fixed in time: α ∈ (0,1)^{d_k} (decay), b ∈ (0,1)^{d_k} (erase), w ∈ (0,1)^{d_v} (write);
* keys i.i.d. over t, unit norm, with a law invariant under flipping the sign of any one coordinate; here
  k = (s ⊙ g)/‖s ⊙ g‖, g ~ N(0, I), fixed channel scales s (anisotropic: a few channels carry the energy);
* values v_t i.i.d., zero mean, E[vᵀv] = σ² I, independent of the keys.

Derivation. With P_t = E[S_t S_tᵀ] (d_k × d_k) and m_j = (P_t)_jj = E‖S_{t,j,:}‖², the cross term between the
write and the old state vanishes (v_t has zero mean and is independent of S_{t−1} and k_t), and k_t is
independent of S_{t−1}, so  P_t = E[M_t D P_{t−1} D M_tᵀ] + q E[k_tᵀk_t],  M_t = I − k_tᵀ(b ⊙ k_t), D = Diag(α),
q = σ²‖w‖². Flipping the sign of key coordinate i flips every off-diagonal term (i, j) of that map, so a
diagonal P stays diagonal and the stationary P is diagonal. Its diagonal solves the linear system

    m_j = Σ_a α_a² E[M_ja²] m_a + q κ_j,      E[M_ja²] = δ_ja (1 − 2 b_j κ_j) + b_a² C_ja,
    κ_j = E[k_j²],   C_ja = E[k_j² k_a²],

i.e. (I − G) m* = q κ with G_ja = α_a² (δ_ja (1 − 2 b_j κ_j) + b_a² C_ja); a stationary solution exists iff
the spectral radius of G is < 1. This is exact for the model above (no mean-field step). Dropping the
refill of row j by the erasure of the other rows (the a ≠ j terms) gives the per-row ("decoupled") law

    m_j ≈ q κ_j / (1 − α_j² (1 − 2 b_j κ_j + b_j² C_jj)),

reported as an approximation. Parallel erase rate μ = E⟨k, b ⊙ k⟩ = Σ_j b_j κ_j (Muir Table 3).

Key moments of k = (s ⊙ g)/‖s ⊙ g‖ (x_i = s_i² g_i², X = Σ x_i; 1/X = ∫₀^∞ e^{−tX} dt, 1/X² = ∫₀^∞ t e^{−tX} dt,
E[e^{−t s² g²}] = (1 + 2ts²)^{−1/2}, E[g² e^{−cg²}] = (1 + 2c)^{−3/2}, E[g⁴ e^{−cg²}] = 3(1 + 2c)^{−5/2}):

    κ_j  = ∫₀^∞ F(t) r_j(t) dt,      C_ja = (1 + 2δ_ja) ∫₀^∞ t F(t) r_j(t) r_a(t) dt,
    F(t) = Π_i (1 + 2t s_i²)^{−1/2},  r_i(t) = s_i² / (1 + 2t s_i²),

one-dimensional integrals evaluated by the trapezoid rule in u = log t (checked by the exact sum rules
Σ_j κ_j = 1 and Σ_a C_ja = κ_j, since ‖k‖ = 1).
"""
from __future__ import annotations

import dataclasses

import numpy as np

_LOG_T = np.linspace(-45.0, 45.0, 9001)  # quadrature grid in u = log t (relative to 1 / s_max²)


@dataclasses.dataclass(frozen=True)
class KeyMoments:
    second: np.ndarray  # κ_j = E[k_j²], [d_k]
    fourth: np.ndarray  # C_ja = E[k_j² k_a²], [d_k, d_k]

    @property
    def participation_ratio_of_mean(self) -> float:
        """1/Σ_j κ_j²: the participation ratio of the mean key energy (≥ the per-key one)."""
        return float(1.0 / np.sum(self.second ** 2))

    @property
    def mean_inverse_l4(self) -> float:
        """1/E[‖k‖₄⁴] = 1/Σ_j C_jj (Muir Table 3's η̄_eff)."""
        return float(1.0 / np.trace(self.fourth))


def normalized_gaussian_key_moments(scales) -> KeyMoments:
    """κ and C of k = (s ⊙ g)/‖s ⊙ g‖, g ~ N(0, I) (module docstring), float64."""
    s2 = np.asarray(scales, np.float64) ** 2
    if s2.ndim != 1 or s2.size < 2 or not np.all(s2 > 0):
        raise ValueError(f"scales: expected a vector of >= 2 positive numbers, got shape {s2.shape}")
    t = np.exp(_LOG_T)[:, None] / s2.max()  # [N, 1]
    r = s2[None, :] / (1.0 + 2.0 * t * s2[None, :])  # [N, d]
    log_f = -0.5 * np.sum(np.log1p(2.0 * t * s2[None, :]), axis=1, keepdims=True)
    weight = np.exp(log_f) * t  # F(t) · dt/du
    du = _LOG_T[1] - _LOG_T[0]
    trap = np.full(len(_LOG_T), du)
    trap[[0, -1]] = du / 2
    kappa = np.einsum("n,nj->j", trap * weight[:, 0], r)
    fourth = np.einsum("n,nj,na->ja", trap * weight[:, 0] * t[:, 0], r, r)
    fourth = fourth * (1.0 + 2.0 * np.eye(len(s2)))
    return KeyMoments(kappa, fourth)


def transition_matrix(moments: KeyMoments, alpha, b):
    """G with m_{t} = G m_{t−1} + q κ for the row energies (module docstring)."""
    alpha2 = np.asarray(alpha, np.float64) ** 2
    b = np.asarray(b, np.float64)
    kappa, fourth = moments.second, moments.fourth
    return alpha2[None, :] * (np.diag(1.0 - 2.0 * b * kappa) + b[None, :] ** 2 * fourth)


def stationary_row_energy(moments: KeyMoments, alpha, b, write_energy: float):
    """m* solving (I − G) m* = q κ, with q = write_energy = σ²‖w‖²; raises if no stationary point exists."""
    G = transition_matrix(moments, alpha, b)
    radius = float(np.max(np.abs(np.linalg.eigvals(G))))
    if radius >= 1.0:
        raise ValueError(f"row-energy map has spectral radius {radius:.4f} >= 1: no stationary state "
                         f"(decays alpha too close to 1 for this erase gate b?)")
    return np.linalg.solve(np.eye(len(G)) - G, write_energy * moments.second)


def decoupled_row_energy(moments: KeyMoments, alpha, b, write_energy: float):
    """The per-row approximation q κ_j / (1 − α_j²(1 − 2 b_j κ_j + b_j² C_jj)) (no cross-row refill)."""
    alpha2 = np.asarray(alpha, np.float64) ** 2
    b = np.asarray(b, np.float64)
    kappa, c_diag = moments.second, np.diag(moments.fourth)
    return write_energy * kappa / (1.0 - alpha2 * (1.0 - 2.0 * b * kappa + b ** 2 * c_diag))


def erase_rate(moments: KeyMoments, b) -> float:
    """μ = E⟨k, b ⊙ k⟩ = Σ_j b_j κ_j."""
    return float(np.dot(np.asarray(b, np.float64), moments.second))
