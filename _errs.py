import sys; sys.path.insert(0, "tests/pallas_kernels")
import jax, jax.numpy as jnp, numpy as np
import test_vla_pallas_triton as T
for case in sorted(T.A_PASS_CASES):
    args, weights = T._a_pass_inputs(1, **T.A_PASS_CASES[case])
    grads, (al, a) = T._kernel_a_pass(*args, *[jnp.asarray(x, jnp.float32) for x in weights])
    rg, (ral, ra) = T._reference_a_pass(*args, *weights); rg[2] = T._sym(rg[2])
    print(case, "alpha %.1e A %.1e" % (T._rel_rms(al, ral), T._rel_rms(a, ra)), " ".join("%.1e" % T._rel_rms(g, r) for g, r in zip(grads, rg)))
for dtype in (jnp.float32, jnp.bfloat16):
    args, segments, ip, weights = T._op_inputs(dtype)
    kr = lambda *a, **kw: T.api._run_pallas_triton(*a, **kw, interpret=True)
    w32 = [jnp.asarray(w, jnp.float32) for w in weights]
    grads, (o, s, a) = jax.jit(jax.grad(lambda *x: T._op_loss(kr, *x, segments, ip, w32), argnums=tuple(range(6)), has_aux=True))(*args)
    with jax.enable_x64(True):
        wide = [jnp.asarray(np.asarray(x.astype(jnp.float32)), jnp.float64) for x in args]
        rg, (ro, rs, ra) = jax.grad(lambda *x: T._op_loss(T.api._run_reference, *x, segments, ip, weights), argnums=tuple(range(6)), has_aux=True)(*wide)
    print(dtype.__name__, "o %.1e S %.1e A %.1e" % (T._rel_rms(o.astype(jnp.float32), ro), T._rel_rms(s, rs), T._rel_rms(a, ra)),
          " ".join("%s %.1e" % (n, T._rel_rms(g.astype(jnp.float32), r)) for n, g, r in zip(T.OP_NAMES, grads, rg)))
