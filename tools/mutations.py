"""The declared mutants of tools/mutation.py: realistic one-line bugs in the critical paths, each with the
tests that must catch it.

One row per mutant: name, file, the exact ORIGINAL snippet (must occur exactly once in the file: keep it
short but distinctive), its REPLACEMENT, what the bug is, and the pytest arguments (node ids, or a file and
``-k``) that should kill it — cheapest and most specific first, since the run stops at the first failure.

After a refactor, ``python tools/mutation.py --check`` names every row whose snippet is missing or ambiguous;
update the snippet (or the file) and keep the bug the same.
"""
from __future__ import annotations

from typing import NamedTuple


class Mutant(NamedTuple):
    name: str
    file: str
    original: str
    replacement: str
    description: str
    tests: tuple


# test selections used by several rows
_T = "tests/pallas_kernels/"
CB = _T + "test_chunk_boundaries.py"
CB_DR_XLA = CB + "::test_delta_rule_xla_documents_on_chunk_boundaries"
CB_TPU = CB + "::test_delta_rule_pallas_tpu_interpret_weak_decay_documents_on_chunk_boundary"
CB_VLA = CB + "::test_vla_xla_documents_on_chunk_boundaries"
CB_IA = CB + "::test_interdomain_and_s4d_xla_documents_on_chunk_boundaries"
DR_XLA = _T + "test_delta_rule_xla.py"
DR_GRAD = _T + "test_delta_rule_grad.py::test_custom_vjp_matches_reference_grad"
DR_REF = _T + "test_delta_rule_reference.py"
TPU = _T + "test_delta_rule_pallas_tpu.py"
TPU_SEG = TPU + "::test_float32_segments_odd_length_c64"
TPU_EXTREME = TPU + "::test_extreme_decay_c64_every_head"
VLA = _T + "test_vla.py"
IA = _T + "test_interdomain.py"
DELTA_LAYERS = "tests/mixers/test_delta_layers.py"
SHORT_CONV = "tests/mixers/test_short_conv.py"
DECODER_ISOLATION = "tests/models/test_decoder.py::test_documents_in_one_row_do_not_see_each_other"
DATA = "tests/training/test_data.py"
OPTIM = "tests/training/test_optim.py"
LOSS = "tests/training/test_loss_mask.py"
RESUME = "tests/training/test_train.py::test_interrupted_and_resumed_run_matches_uninterrupted_bitwise"
ROBUST_CKPT = "tests/training/test_robustness.py::test_unreadable_newest_checkpoint_is_reported_and_an_older_one_used"

_DR = "pallas_kernels/delta_rule/"
_PT = _DR + "pallas_tpu.py"
_BWD = _DR + "pallas_tpu_bwd.py"
_VX = "pallas_kernels/vla/xla.py"
_IX = "pallas_kernels/interdomain/xla.py"

M = Mutant
MUTANTS = [
    # ---- delta rule, chunkwise xla forward ------------------------------------------------------------------
    M("common_carried_document_off_by_one", "pallas_kernels/common.py",
      "chunks[:, :-1, -1]], axis=1)", "chunks[:, 1:, 0]], axis=1)",
      "carried-in document = the chunk's own first token (no reset when a document starts at a chunk start); "
      "one shared helper, so every chunked op must catch it",
      (CB_DR_XLA, CB_TPU, CB_IA)),
    M("common_document_index_boundary_inverted", "pallas_kernels/common.py",
      "boundary = (segment_ids[:, 1:] != segment_ids[:, :-1])",
      "boundary = (segment_ids[:, 1:] == segment_ids[:, :-1])",
      "a document boundary counted where the segment id stays the same",
      ("tests/pallas_kernels/test_common.py", CB_DR_XLA)),
    M("attention_mask_not_causal", "pallas_kernels/attention/reference.py",
      "return (same & jnp.tril(jnp.ones((t, t), bool)))[:, None]", "return same[:, None]",
      "the dense attention mask lets a token read later tokens",
      ("tests/pallas_kernels/test_attention.py",)),
    M("attention_splash_causal_mask_dropped", "pallas_kernels/attention/pallas_tpu.py",
      "masks.CausalMask((length, length))", "masks.FullMask((length, length))",
      "splash attention without its causal mask (documents still separated)",
      ("tests/pallas_kernels/test_attention.py",)),
    M("dr_xla_start_mask_dropped", _DR + "xla.py",
      "start_decay = jnp.where(carried,", "start_decay = jnp.where(True,",
      "S0 rows (Q̂⊙π, K̂⊙π) applied to every document of the chunk, not only the carried-in one",
      (DR_XLA + "::test_random_segments_against_reference",)),
    M("dr_xla_end_mask_first_doc", _DR + "xla.py",
      "in_last = (document_B1NC == document_B1NC[..., -1:])", "in_last = (document_B1NC == document_B1NC[..., :1])",
      "chunk-end rows E masked to the chunk's first document instead of its last",
      (DR_XLA + "::test_random_segments_against_reference",)),
    M("dr_xla_no_boundary_first_token", _DR + "xla.py",
      "no_boundary = (document_B1NC[..., -1] ==", "no_boundary = (document_B1NC[..., 0] ==",
      "Diag(π_C)S₀ kept when the chunk's FIRST token is in the carried document (reset missed mid-chunk)",
      (CB_DR_XLA,)),
    M("dr_xla_chunk_decay_misses_last_token", _DR + "xla.py",
      "jnp.exp(jnp.sum(log_decay, axis=-2))", "jnp.exp(jnp.sum(log_decay[..., :-1, :], axis=-2))",
      "chunk-end decay π_C of the carried state misses the chunk's last λ",
      (CB_DR_XLA,)),
    M("dr_xla_leaf_window_off_by_one", _DR + "xla.py",
      "window = window + shift_rows(log_decay_BHNCK, offset - 1)",
      "window = window + shift_rows(log_decay_BHNCK, offset)",
      "leaf decay window Σ_{j<s≤i} λ shifted one token (Σ_{j≤s<i})",
      (DR_XLA + "::test_random_segments_against_reference",)),
    M("dr_xla_kappa_inclusive", _DR + "xla.py",
      "kappa = jnp.exp(exclusive_reverse_cumsum(lam_left))", "kappa = jnp.exp(reverse_inclusive_cumsum(lam_left))",
      "pivot factor κ_j includes λ_j (Σ_{j≤s≤p} instead of Σ_{j<s≤p})",
      (DR_XLA + "::test_random_segments_against_reference",)),
    M("dr_xla_neumann_sign", _DR + "xla.py",
      "inverse = eye - strict_lower_LNN", "inverse = eye + strict_lower_LNN",
      "Neumann leaf inverse (I − N)… with the wrong sign",
      (DR_XLA + "::test_recursive_inverse",)),
    M("dr_xla_merge_sign", _DR + "xla.py",
      "-matmul(matmul(right, b), left)", "matmul(matmul(right, b), left)",
      "block inverse merge −T_b⁻¹ B T_a⁻¹ missing its minus",
      (DR_XLA + "::test_recursive_inverse",)),
    M("dr_xla_query_eff_sign", _DR + "xla.py",
      "query_eff = q * start_decay - matmul(readout, state_reads)",
      "query_eff = q * start_decay + matmul(readout, state_reads)",
      "Q_eff = Q̂⊙π − M Y with the wrong sign",
      (DR_XLA + "::test_no_initial_state_default_tiling", DR_XLA + "::test_random_segments_against_reference")),
    M("dr_xla_scan_transposed", _DR + "xla.py",
      "return matmul(transition, state) + write, state", "return matmul(transpose(transition), state) + write, state",
      "chunk-state scan applies Fᵀ instead of F",
      (CB_DR_XLA,)),
    # ---- delta rule, custom VJP -------------------------------------------------------------------------------
    M("dr_vjp_state_scan_untransposed", _DR + "vjp.py",
      "out_to_state + matmul(transpose(transition), d_end)", "out_to_state + matmul(transition, d_end)",
      "reverse state scan uses F instead of Fᵀ",
      (DR_GRAD,)),
    M("dr_vjp_da_crosses_documents", _DR + "vjp.py",
      "jnp.where(strict & t.same_doc,", "jnp.where(strict,",
      "dA keeps cross-document pairs (A is zero there)",
      (DR_GRAD,)),
    M("dr_vjp_chunk_decay_term_dropped", _DR + "vjp.py",
      "chunk_end = jnp.sum(end_terms, axis=-2) + d_chunk_decay * t.chunk_decay",
      "chunk_end = jnp.sum(end_terms, axis=-2)",
      "dΛ_C loses π_C ⊙ rowsum(S₀⊙dS_C) (the carried state's chunk-end decay)",
      (CB_DR_XLA, DR_GRAD)),
    M("dr_vjp_dk_start_decay", _DR + "vjp.py",
      "d_k = d_key_eff * t.end_decay", "d_k = d_key_eff * t.start_decay",
      "dK through K_eff = K⊙E uses π instead of E",
      (DR_GRAD,)),
    M("dr_vjp_dlambda_wrong_direction", _DR + "vjp.py",
      "d_log_decay = xla.reverse_inclusive_cumsum(d_cum_log_decay)",
      "d_log_decay = xla.inclusive_cumsum(d_cum_log_decay)",
      "dλ = forward cumsum of dΛ instead of the reverse cumsum",
      (DR_GRAD,)),
    # ---- delta rule, float64 reference ------------------------------------------------------------------------
    M("dr_reference_no_reset", _DR + "reference.py",
      "jnp.zeros_like(state_BHKV), state_BHKV)", "state_BHKV, state_BHKV)",
      "reference scan never resets the state at a document boundary",
      (DR_XLA + "::test_reused_segment_id_is_a_new_document",)),
    M("dr_reference_erase_sign", _DR + "reference.py",
      "pseudo_value_BHV = v_BHV - read_BHV", "pseudo_value_BHV = v_BHV + read_BHV",
      "delta-rule correction v − k̂S with the wrong sign",
      (DR_REF,)),
    # ---- delta rule, Pallas TPU forward kernel (interpret mode) -----------------------------------------------
    M("dr_tpu_chunk_end_decay_early", _PT,
      "cum_log_decay[c - 8:c, :]))[:, 7:8]", "cum_log_decay[c - 8:c, :]))[:, 6:7]",
      "forward: chunk-end decay π_C of the carried state read one token early",
      (CB_TPU,)),
    M("dr_tpu_start_mask_every_document", _PT,
      "start = doc_col == 0", "start = doc_col >= 0",
      "S₀ rows (Q̂⊙π, K̂⊙π) applied to every document of the chunk, not only the carried-in one",
      (CB_TPU,)),
    M("dr_tpu_end_mask_carried_doc", _PT,
      "end = doc_col == last", "end = doc_col == 0",
      "E rows masked to the carried-in document instead of the chunk's last",
      (CB_TPU,)),
    M("dr_tpu_leaf_mask_strict", _PT,
      "(r & (leaf - 1)) >= d, expo, 0.0)", "(r & (leaf - 1)) > d, expo, 0.0)",
      "leaf decay masked one row too many before the exp (e = 1 on the diagonal d = i mod n0)",
      (CB_TPU,)),
    M("dr_tpu_readout_diagonal_dropped", _PT,
      "m_d = jnp.sum(qf * w, axis=1, keepdims=True)", "m_d = jnp.sum(qf * w, axis=1, keepdims=True) * (d > 0)",
      "M loses its diagonal (q̂_i·k_i)",
      (CB_TPU,)),
    M("dr_tpu_tile_inverse_sign", _PT,
      "p_rl = -bmm(bmm(p_rr, blk[:, :h], cdt), p_ll, cdt)", "p_rl = bmm(bmm(p_rr, blk[:, :h], cdt), p_ll, cdt)",
      "tree inverse 2×2 merge P[R,L] = −P[R,R] A[R,L] P[L,L] with the wrong sign",
      (CB_TPU,)),
    M("dr_tpu_output_carried_mask_dropped", _PT,
      "out = mm(ch.qf * ch.start_decay, start_state, cdt)", "out = mm(ch.qf, start_state, cdt)",
      "output reads S₀ undecayed and in every document of the chunk",
      (CB_TPU,)),
    # ---- delta rule, Pallas TPU backward kernel ---------------------------------------------------------------
    M("dr_tpu_bwd_chunk_end_decay_early", _PT,
      "neg_exp(cum_log_decay[c - 1:c, :])", "neg_exp(cum_log_decay[c - 2:c - 1, :])",
      "backward: chunk-end decay π_C (row form, used for dλ) read one token early",
      (CB_TPU,)),
    M("dr_tpu_bwd_ds_prev_sign", _BWD,
      "- mm_tn(ch.state_reads, du, cdt)", "+ mm_tn(ch.state_reads, du, cdt)",
      "dS_prev = … − Yᵀ dŨ with the wrong sign",
      (CB_TPU,)),
    M("dr_tpu_bwd_dm_diagonal_dropped", _BWD,
      "dm = jnp.where(same & (j <= i)", "dm = jnp.where(same & (j < i)",
      "dM loses its diagonal",
      (CB_TPU,)),
    M("dr_tpu_bwd_state_term_dropped", _BWD,
      "+ ch.chunk_decay_row * state_term", "",
      "dΛ_C loses π_C ⊙ rowsum(S₀⊙dS)",
      (CB_TPU,)),
    M("dr_tpu_bwd_de_start_decay_dropped", _BWD,
      "(de_p + dr * ch.start_decay)", "(de_p + dr)",
      "dK̂ through K̂⊙π misses the π factor",
      (CB_TPU,)),
    # ---- vla ---------------------------------------------------------------------------------------------------
    M("vla_xla_chunk_start_reset_dropped", _VX,
      "A0 = jnp.where(starts_document[:, None, None, None], eye_k / lambda0, A0)", "A0 = A0",
      "A-pass does not restart at I/λ₀ when a document starts at a chunk's first token",
      (CB_VLA,)),
    M("vla_xla_prev_doc_first_token", _VX,
      "jnp.zeros((b, 1), doc.dtype), doc[:, :-1, -1]]", "jnp.zeros((b, 1), doc.dtype), doc[:, :-1, 0]]",
      "previous chunk's document read from its first token instead of its last",
      (CB_VLA,)),
    M("vla_xla_refresh_count_inclusive", _VX,
      "cnt = jnp.cumsum(f, axis=1) - f", "cnt = jnp.cumsum(f, axis=1)",
      "refresh counted from the refreshing token itself (off by one: piece split one token early)",
      (VLA + "::test_xla_matches_reference_float64",)),
    M("vla_xla_end_base_swapped", _VX,
      "A0, eye_k / lambda0))", "eye_k / lambda0, A0))",
      "state after the chunk built on the wrong base (carried vs new document swapped)",
      (CB_VLA,)),
    M("vla_reference_no_reset", "pallas_kernels/vla/reference.py",
      "eye / lambda0, A)", "A, A)",
      "reference scan does not reset A at a document boundary",
      (CB_VLA, VLA + "::test_xla_matches_reference_float64")),
    # ---- interdomain / s4d ---------------------------------------------------------------------------------------
    M("ia_xla_carry_doc_unused", _IX,
      "doc, carry_doc = common.chunk_documents(", "doc, _ = common.chunk_documents(",
      "the interdomain chunked form ignores the carried document (its own first token instead)",
      (CB_IA,)),
    M("ia_xla_end_mask_first_doc", _IX,
      "same_end = (doc_BNK == doc_BNK[..., -1:])", "same_end = (doc_BNK == doc_BNK[..., :1])",
      "chunk-end coefficients masked to the chunk's first document",
      (CB_IA,)),
    M("ia_xla_carry_phase_off_by_one", _IX,
      "(pos + 1.0)[:, None] * theta)", "pos[:, None] * theta)",
      "carry-in phase θ·s instead of θ·(s+1)",
      (CB_IA,)),
    M("ia_xla_pair_mask_strict", _IX,
      "causal = pos[:, None] >= pos[None, :]", "causal = pos[:, None] > pos[None, :]",
      "in-chunk pairs lose the diagonal j = s",
      (CB_IA,)),
    M("ia_xla_unrotate_sign", _IX,
      "ang = -float(pad) * phase_HM", "ang = float(pad) * phase_HM",
      "padded-tail rotation of the final state undone in the wrong direction",
      (IA + "::test_chunked_equals_reference_float64",)),
    M("ia_xla_sub_chunk_phase_off_by_one", _IX,
      "(pos - first + 1).astype(dtype)", "(pos - first).astype(dtype)",
      "sub-chunk query phase θ·(s−p) off by one",
      (CB_IA,)),
    # ---- mixers: short convolution and delta-rule packing -----------------------------------------------------
    M("short_conv_segment_shift_off_by_one", "mixers/short_conv.py",
      "jnp.pad(segment_ids_BT, ((0, 0), (i, 0))", "jnp.pad(segment_ids_BT, ((0, 0), (i + 1, 0))",
      "segment mask of tap i compares with token t−i−1",
      (SHORT_CONV, DELTA_LAYERS + "::test_decode_matches_parallel_over_packed_documents")),
    M("short_conv_cache_first_segment", "mixers/short_conv.py",
      "seg == segment_ids_BT[:, -1:]", "seg == segment_ids_BT[:, :1]",
      "prefill cache keeps the first document's inputs instead of the last one's",
      (SHORT_CONV,)),
    M("short_conv_step_cache_stale", "mixers/short_conv.py",
      "new_cache = window[:, 1:]", "new_cache = window[:, :-1]",
      "decode cache drops the new token instead of the oldest",
      (SHORT_CONV, DELTA_LAYERS + "::test_decode_matches_parallel_over_packed_documents")),
    M("delta_common_decode_no_reset", "mixers/delta_common.py",
      "reset = positions_B == 0", "reset = positions_B < 0",
      "decode never resets the cache at a new document",
      (DELTA_LAYERS + "::test_decode_matches_parallel_over_packed_documents",)),
    M("delta_common_segments_dropped", "mixers/delta_common.py",
      "segment_ids=segment_ids, chunk_size=", "segment_ids=None, chunk_size=",
      "the delta-rule core ignores the packed documents",
      (DELTA_LAYERS + "::test_packed_equals_separate",)),
    M("delta_common_q_conv_segments_dropped", "mixers/delta_common.py",
      "self.q_conv(q, segment_ids)", "self.q_conv(q)",
      "query short conv mixes tokens across documents",
      (DELTA_LAYERS + "::test_packed_equals_separate",)),
    M("interdomain_layer_segments_dropped", "mixers/interdomain.py",
      "initial_state=initial_state, segment_ids=segment_ids,", "initial_state=initial_state, segment_ids=None,",
      "the interdomain core ignores the packed documents",
      ("tests/mixers/test_interdomain_layer.py::test_decode_and_packing_match_forward",)),
    M("interdomain_layer_decode_no_reset", "mixers/interdomain.py",
      "reset = positions_B == 0", "reset = positions_B < 0",
      "interdomain decode never resets its state and conv caches at a new document",
      ("tests/mixers/test_interdomain_layer.py::test_decode_of_a_packed_row_resets_at_each_document",)),
    M("vla_layer_segments_dropped", "mixers/vla.py",
      "penalty_key=p, segment_ids=segment_ids,", "penalty_key=p, segment_ids=None,",
      "the VLA core ignores the packed documents",
      ("tests/mixers/test_vla_layer.py::test_decode_equals_packed_forward_and_packing_equals_separate",)),
    M("vla_layer_decode_no_reset", "mixers/vla.py",
      "reset = (positions_B == 0)", "reset = (positions_B < 0)",
      "VLA decode never resets S, A and the conv caches at a new document",
      ("tests/mixers/test_vla_layer.py::test_decode_equals_packed_forward_and_packing_equals_separate",)),
    # ---- data packing and loss masks -----------------------------------------------------------------------------
    M("data_loss_mask_crosses_documents", "training/data.py",
      "valid = (seg[:-1] == seg[1:]) & (seg[:-1] != 0)", "valid = seg[:-1] != 0",
      "loss on the last token of a document (its target is the next document's first token)",
      (DATA + "::test_packing_invariants",)),
    M("data_loss_mask_on_padding", "training/data.py",
      "valid = (seg[:-1] == seg[1:]) & (seg[:-1] != 0)", "valid = seg[:-1] == seg[1:]",
      "loss on padding tokens (segment 0)",
      (LOSS, DATA + "::test_packing_invariants", DATA + "::test_eval_batches")),
    M("data_targets_not_shifted", "training/data.py",
      '"targets": tokens[1:]', '"targets": tokens[:-1]',
      "targets equal the inputs (no next-token shift)",
      (DATA + "::test_packing_invariants",)),
    M("data_positions_shifted", "training/data.py",
      '"positions": pos[:-1]', '"positions": pos[1:]',
      "positions taken from the target row (one token late)",
      (DATA + "::test_packing_invariants",)),
    M("data_segment_ids_shifted", "training/data.py",
      '"segment_ids": seg[:-1]', '"segment_ids": seg[1:]',
      "segment ids taken from the target row (one token late)",
      (DATA + "::test_packing_invariants",)),
    M("loss_mask_ignored", "models/decoder.py",
      "nll = token_nll(logits_BTV, targets_BT) * mask_BT", "nll = token_nll(logits_BTV, targets_BT)",
      "cross entropy sums the NLL of masked positions too",
      (LOSS,)),
    # ---- optimizer parameter groups ------------------------------------------------------------------------------
    M("optim_decay_mask_inverted", "training/optim.py",
      "or v.ndim < 2:", "or v.ndim >= 2:",
      "weight decay on vectors (norms, biases) instead of matrices",
      (OPTIM,)),
    M("optim_no_decay_group_decayed", "training/optim.py",
      '"no_decay": adam(lr, 0.0)', '"no_decay": adam(lr, o.weight_decay)',
      "the no-decay group is weight-decayed",
      (OPTIM,)),
    M("optim_ssm_cap_is_a_floor", "training/optim.py",
      "jax.numpy.minimum(lr(step), o.ssm_lr_cap)", "jax.numpy.maximum(lr(step), o.ssm_lr_cap)",
      "SSM learning rate max(schedule, cap) instead of min",
      (OPTIM,)),
    M("optim_ssm_group_uncapped", "training/optim.py",
      '"ssm": adam(ssm_lr, 0.0)', '"ssm": adam(lr, 0.0)',
      "SSM group ignores its LR cap",
      (OPTIM,)),
    # ---- checkpoint and resume -----------------------------------------------------------------------------------
    M("ckpt_restore_oldest_first", "training/checkpoint.py",
      "sorted(self.manager.all_steps(), reverse=True)", "sorted(self.manager.all_steps())",
      "resume restores the oldest checkpoint instead of the newest",
      (ROBUST_CKPT,)),
    M("ckpt_data_state_swapped", "training/checkpoint.py",
      "return out.params, out.opt_state, out.data, out.meta", "return out.params, out.opt_state, out.meta, out.data",
      "restore returns the metadata as the data-iterator state",
      (ROBUST_CKPT,)),
    M("resume_data_state_not_restored", "training/loop.py",
      "data_iter.set_state(_own_data_state(data_state))", "_own_data_state(data_state)",
      "resume restarts the data iterator from the beginning",
      (RESUME,)),
    M("resume_repeats_a_step", "training/loop.py",
      "range(self.start_step + 1, t_cfg.steps + 1)", "range(self.start_step, t_cfg.steps + 1)",
      "resume repeats the checkpointed step",
      (RESUME,)),
]
