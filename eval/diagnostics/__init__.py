"""The papers' diagnostics, each a command that prints a table and writes JSON and a PNG
(docs/evaluation.md, "Diagnostics"):

* ``vla_state``        VLA ‖S_t‖_F, ‖A_t‖_F, ‖J_t‖₂ and ‖∏₂₅J‖₂ on random inputs vs linear attention and DeltaNet.
* ``muir_row_energy``  Muir/GDN-2 stationary state-row energy: closed form vs the measured recurrence.
* ``muir_gates``       gate SVD-rank truncation, gate freezing and erase-rate statistics of a trained model.

Helpers: ``report`` (table / JSON / PNG output), ``trajectory`` (state statistics along a sequence through the
delta-rule op), ``gate_hooks`` (capture or replace a delta-rule layer's gates), ``gate_factors`` (the low-rank
gate factors of Muir and GDN-2 layers and their SVD truncation), ``nll`` (masked validation NLL with hooks).
"""
