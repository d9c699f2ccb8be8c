"""Run the delta-rule forward (K1 + scan_output) a few times at 8x4096 bf16, for ncu to profile one K1 launch."""
import sys
sys.path.insert(0, "tools")
import jax, jax.numpy as jnp, numpy as np
import bench_delta_rule_gpu as b
from mixerlab.pallas_kernels.delta_rule import pallas_triton as ptr
bsz, t, h, dk, dv = 8, 4096, 16, 128, 128
x = b.gdn2_numpy(4, bsz, t, h, dk, dv)
bf = jnp.bfloat16
core = [jnp.asarray(x["q"] * dk ** -0.5).astype(bf), jnp.asarray(x["k"]).astype(bf),
        jnp.asarray(x["b"] * x["k"]).astype(bf), jnp.asarray(x["w"] * x["v"]).astype(bf), jnp.asarray(x["g"]),
        jnp.zeros((bsz, h, dk, dv), jnp.float32), jnp.zeros((bsz, t), jnp.int32)]
f = jax.jit(lambda *a: ptr.run(*a, chunk_size=64, leaf_size=16))
for _ in range(4):
    jax.block_until_ready(f(*core))
print("done")
