"""pallas_kernels/delta_rule/flops_gpu.py: counts by hand for one config, kernel names = the benchmark's breakdown, and
the Triton kernels' pl.CostEstimate against their own jaxprs."""
import json
import math
import pathlib

import jax
import jax.numpy as jnp
import pytest

from mixerlab.pallas_kernels import common
from mixerlab.pallas_kernels.delta_rule import flops_gpu
from mixerlab.pallas_kernels.delta_rule import pallas_triton as ptr

ROOT = pathlib.Path(__file__).resolve().parents[2]
RAW = ROOT / "docs/benchmarks/raw/delta_rule_h200_2026-11-30.json"


def test_counts_by_hand():
    c, d = 64, 128
    counts = flops_gpu.kernel_counts(chunk=c, leaf=16, dk=d, dv=d, block_k=32, sum_passes=1, bounded=False)
    bf16, tf32, _ = counts["K1_intra"]
    # 6 pivot levels × (A and M: C×Dk×C each) + U = P V̂ and Y = P (K̂⊙π)
    assert bf16 == 6 * 2 * (2 * c * d * c) + 2 * (2 * c * c * d)
    # decay sums: 6 levels + π, E (one TF32 pass each; Y reads K̂⊙π back); inverse: 2·(log2 16 − 1) Neumann
    # products and 2·(6 − 4) merge products of C×C×C
    assert tf32 == 8 * (2 * c * c * d) + (6 + 4) * (2 * c ** 3)
    # end_decays="difference": E's exponent is the chunk total minus π's, one decay sum fewer per key block
    by_difference = flops_gpu.kernel_counts(chunk=c, leaf=16, dk=d, dv=d, block_k=32, bounded=False,
                                            end_difference=True)
    assert (tf32 - by_difference["K1_intra"][1] == counts["B2b_key_grads"][1] - by_difference["B2b_key_grads"][1]
            == 2 * c * c * d)
    two_pass = flops_gpu.kernel_counts(chunk=c, leaf=16, dk=d, dv=d, block_k=32, sum_passes=2,
                                       bounded=False)["K1_intra"][1]
    assert two_pass - tf32 == 8 * (2 * c * c * d)
    # the factored path: one product each for A and M, one decay sum for the factors (plus π, E)
    bf16_b, tf32_b, bytes_b = flops_gpu.kernel_counts(chunk=c, leaf=16, dk=d, dv=d, block_k=32)["K1_intra"]
    assert bf16_b == 2 * (2 * c * d * c) + 2 * (2 * c * c * d)
    assert tf32_b == 3 * (2 * c * c * d) + (6 + 4) * (2 * c ** 3)
    assert bytes_b == counts["K1_intra"][2]
    assert flops_gpu.kernel_exps(c, d)["K1_intra"] == 4 * c * d + d
    assert flops_gpu.kernel_exps(c, d, bounded=False)["K1_intra"] == 8 * c * d + d
    scan = counts["K2_scan"]
    assert scan[0] == 2 * (2 * c * d * d) and scan[2] == 2 * c * d * 4 + 4 * d + 2 * d * d  # U, Y, K⊙E, Ũ; π_C; S₀
    # a forward alone: Ũ = U − Y S₀, O = (Q̂⊙π) S₀ + M Ũ, S ← … + (K⊙E)ᵀ Ũ in one kernel; reads U, Y, K⊙E,
    # Q̂⊙π, M, π_C, writes O (no S₀, no Ũ)
    fused = counts["K2_scan_output"]
    assert fused[0] == scan[0] + counts["K3_output"][0]
    assert fused[2] == 2 * c * d * 5 + 2 * c * c + 4 * d
    # fold_solve: the forward alone's K1 writes M P and Pᵀ(K⊙E) in place of M, U, Y, K⊙E: no V̂ read, no U
    # written, M P (C×C×C) in place of U = P V̂; K⊙E makes K̂⊙π's round trip
    alone = flops_gpu.kernel_counts(chunk=c, leaf=16, dk=d, dv=d, block_k=32)["K1_intra_alone"]
    without_p = flops_gpu.kernel_counts(chunk=c, leaf=16, dk=d, dv=d, block_k=32, save_matrices=False)["K1_intra"]
    assert alone[0] == bf16_b - 2 * c * c * d + 2 * c ** 3 and alone[1] == tf32_b
    assert alone[2] == without_p[2] - 2 * (2 * c * d)
    assert "K1_intra_alone" not in flops_gpu.kernel_counts(fold_solve=False)
    assert "K2_scan_output" not in flops_gpu.kernel_counts(fuse_output=False)
    assert "B0_intra_again" in flops_gpu.kernel_counts(save_matrices=False)
    assert "B0_rhs" in flops_gpu.kernel_counts(save_rhs=False) and "B0_rhs" not in flops_gpu.kernel_counts()


def test_roofline_and_names_match_the_benchmark():
    roof = flops_gpu.roofline_ms(flops_gpu.kernel_counts(), 8 * 4096 * 16, 64)
    assert all(t_f > 0 and t_b > 0 for t_f, t_b in roof.values())
    measured = json.loads(RAW.read_text())["timings"]["8x4096"]["ours"]["breakdown"]
    assert set(flops_gpu.kernel_counts(fuse_output=False)) <= set(measured)
    assert set(flops_gpu.kernel_counts()) - set(measured) == set(flops_gpu.FORWARD_ALONE)  # timed since


def test_cli_with_measured_times(capsys):
    assert flops_gpu.main(["--measured", str(RAW)]) == 0
    out = capsys.readouterr().out
    assert "| B2b_key_grads |" in out and "| total (forward + backward) |" in out


# ---------------------------------------------------------------------------------------------------------
# the kernels' pl.CostEstimate against their own jaxprs: every dot_general and exp the kernel body executes,
# loops unrolled by their trip counts, times the grid


def _executed(jaxpr, scale=1):
    """(matmul FLOPs, exp elements) of one program of a kernel jaxpr; scan bodies count ``length`` times.
    A while loop (the bounded-cut search, and the exact levels from a traced cut) counts as on the factored
    path the estimates declare: its condition once, its body never."""
    flops = exps = 0
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name == "dot_general":
            (contract, _), _ = eqn.params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            flops += scale * 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
        elif name == "exp":
            exps += scale * math.prod(eqn.outvars[0].aval.shape)
        assert name != "cond", f"{name}: branch unknown to this counter"  # (search passes are checked apart)
        inner = scale * (eqn.params["length"] if name == "scan" else 1)
        if name == "while":
            f, e = _executed(eqn.params["cond_jaxpr"].jaxpr, scale)
            flops, exps = flops + f, exps + e
            continue
        for value in eqn.params.values():
            sub = getattr(value, "jaxpr", value)
            if hasattr(sub, "eqns"):
                f, e = _executed(sub, inner)
                flops, exps = flops + f, exps + e
    return flops, exps


def _pallas_calls(fn, *args):
    """The pallas_call equations of ``fn``'s jaxpr in order, inside nested jaxprs (custom_vjp calls) too."""
    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "pallas_call":
                yield eqn
                continue
            for value in eqn.params.values():
                sub = getattr(value, "jaxpr", value)
                if hasattr(sub, "eqns"):
                    yield from walk(sub)

    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


@pytest.mark.parametrize("dtype_name, leaf, block_k, save, span, save_rhs, fuse, end, fold, two", [
    ("bfloat16", 16, 32, True, 60.0, True, True, "sums", True, True),
    ("float32", 8, 64, True, 60.0, False, True, "sums", False, True),
    ("bfloat16", 16, 32, False, 60.0, True, False, "difference", True, True),
    ("bfloat16", 16, 32, True, 60.0, True, True, "sums", True, False),  # one pass: the cut search in K1 and B2b
    ("bfloat16", 16, 32, True, None, False, False, "difference", False, True)])
def test_cost_estimates_match_the_kernel_jaxprs(dtype_name, leaf, block_k, save, span, save_rhs, fuse, end, fold,
                                                two):
    """Each Triton pallas_call of forward+backward (six to eight) and of a forward alone (two or three)
    declares the FLOPs and exps its body executes (traced, not run: interpret=False, nothing is lowered on the
    CPU), and the bytes of flops_gpu.kernel_counts."""
    dtype = jnp.dtype(dtype_name)
    b, t, h, dk, dv, c = 2, 192, 3, 128, 64, 64
    cfg = ptr.make_config(c, leaf, dk, dv, dtype, batch_heads=b * h, block_k=block_k, save_matrices=save,
                          bounded_span=span, save_rhs=save_rhs, fuse_output=fuse, end_decays=end, fold_solve=fold,
                          two_pass=two)
    rng = jax.random.split(jax.random.PRNGKey(0), 4)
    q, k, e = (jax.random.normal(r, (b, t, h, dk), dtype) for r in rng[:3])
    v = jax.random.normal(rng[3], (b, t, h, dv), dtype)
    lam = -jnp.ones((b, t, h, dk), jnp.float32)
    doc = jnp.zeros((b, t), jnp.int32)
    _, carry = common.chunk_documents(doc, c)
    state = jnp.zeros((b, h, dk, dv), jnp.float32)

    def forward(q, k, e, v, lam, state):
        out, final = ptr._delta_rule(cfg, q, k, e, v, lam, state, doc, carry)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(final)

    args = (q, k, e, v, lam, state)
    # with bounded_span and two_pass, K1 and B2b are two pallas_calls each: the whole-chunk pass and the search
    two_kernels = span is not None and two
    k1 = ["delta_rule_intra"] + (["delta_rule_intra_search"] if two_kernels else [])
    backward_rhs = [] if save and save_rhs else (["delta_rule_rhs"] if save else k1)
    key_grads = ["delta_rule_key_grads"] + (["delta_rule_key_grads_search"] if two_kernels else [])
    training = [*k1, "delta_rule_scan", "delta_rule_output", *backward_rhs, "delta_rule_scan_bwd",
                "delta_rule_cotangents", *key_grads]
    k1_alone = [name.replace("intra", "intra_alone") for name in k1] if fuse and fold else k1
    alone = [*k1_alone, *(["delta_rule_scan_output"] if fuse else ["delta_rule_scan", "delta_rule_output"])]
    kernel_of = {"delta_rule_intra": "K1_intra", "delta_rule_intra_alone": "K1_intra_alone",
                 "delta_rule_scan": "K2_scan", "delta_rule_output": "K3_output",
                 "delta_rule_scan_output": "K2_scan_output",
                 "delta_rule_rhs": "B0_rhs", "delta_rule_scan_bwd": "B1_scan_bwd",
                 "delta_rule_cotangents": "B2a_cotangents", "delta_rule_key_grads": "B2b_key_grads"}
    passes = 2 if dtype == jnp.float32 else 1
    chunks = b * h * (t // c)
    for fn, expected, with_backward in ((jax.grad(forward, argnums=(0, 1, 2, 3, 4, 5)), training, True),
                                        (forward, alone, False)):
        calls = _pallas_calls(fn, *args)
        assert [eqn.params["name"] for eqn in calls] == expected
        for i, eqn in enumerate(calls):
            est = eqn.params["cost_estimate"]
            programs = math.prod(eqn.params["grid_mapping"].grid)
            if eqn.params["name"].endswith("_search"):  # runs its body only for a flagged chunk: declares the
                # flag reads (the common path, as every estimate here); its body is the one-pass kernel's, which
                # the row with two=False counts
                body = [e.primitive.name for e in eqn.params["jaxpr"].eqns]
                assert "cond" in body, body
                assert (est.flops, est.transcendentals, est.bytes_accessed) == (0, 0, 4 * programs)
                # (B2b's grid is per chunk and key block: one flag read per program)
                continue
            flops, exps = _executed(eqn.params["jaxpr"])
            assert (est.flops, est.transcendentals) == (programs * flops, programs * exps), eqn.params["name"]
            # bytes: flops_gpu's count; K1 writes P when the backward keeps it (save) or recomputes it (its
            # second run); a forward alone writes no P
            writes_p = with_backward and (save or i > len(k1) - 1)
            flagged = span is not None and two
            counts = flops_gpu.kernel_counts(c, leaf, dk, dv, block_k, passes, writes_p, dtype.itemsize,
                                             span is not None, save_rhs, fuse, end == "difference", fold, flagged)
            # K1's first pass writes one int32 flag per chunk
            name = eqn.params["name"]
            flag_bytes = 4 * programs if flagged and name.startswith("delta_rule_intra") else 0
            assert est.bytes_accessed == chunks * counts[kernel_of[name]][2] + flag_bytes, name
