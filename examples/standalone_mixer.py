"""Use a mixerlab token mixer inside your own Flax NNX model (docs/use_a_mixer.md walks through it).

    python examples/standalone_mixer.py [--mixer softmax] [--steps 3]

Builds a two-layer language model of your own around a mixer taken from the registry by name, runs a forward
pass, takes gradients and a few SGD steps on a random batch, and checks that the mixer is causal (changing
token t leaves the outputs before t alone). Runs on a CPU in seconds.
"""
from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
from flax import nnx

from mixerlab import mixers  # importing the package registers every mixer
from mixerlab.mixers.base import MixerSpec


class Block(nnx.Module):
    """Pre-norm residual block: x + mixer(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, mixer_name: str, spec: MixerSpec, options, *, rngs: nnx.Rngs):
        self.norm1 = nnx.RMSNorm(spec.d_model, rngs=rngs)
        self.mixer = mixers.registry.build(mixer_name, spec, options, rngs=rngs)
        self.norm2 = nnx.RMSNorm(spec.d_model, rngs=rngs)
        self.up = nnx.Linear(spec.d_model, 4 * spec.d_model, rngs=rngs)
        self.down = nnx.Linear(4 * spec.d_model, spec.d_model, rngs=rngs)

    def __call__(self, x, segment_ids, positions):
        x = x + self.mixer(self.norm1(x), segment_ids=segment_ids, positions=positions)
        return x + self.down(jax.nn.gelu(self.up(self.norm2(x))))


class TinyLM(nnx.Module):
    """Your model: embeddings, a stack of blocks with a mixerlab mixer in each, and a readout."""

    def __init__(self, mixer_name: str, *, vocab: int = 256, d_model: int = 64, num_heads: int = 2,
                 num_layers: int = 2, rngs: nnx.Rngs, **mixer_options):
        head_dim = d_model // num_heads
        # The mixer's own flags: its registered options dataclass (the fields are listed in docs/mixers.md).
        options = mixers.registry.get(mixer_name).options(**mixer_options)
        self.embed = nnx.Embed(vocab, d_model, rngs=rngs)
        self.blocks = nnx.List([
            Block(mixer_name, MixerSpec(d_model=d_model, num_heads=num_heads, head_dim=head_dim,
                                        value_head_dim=head_dim, layer_index=i, num_layers=num_layers),
                  options, rngs=rngs)
            for i in range(num_layers)])
        self.norm = nnx.RMSNorm(d_model, rngs=rngs)
        self.head = nnx.Linear(d_model, vocab, rngs=rngs)

    def __call__(self, tokens_BT):
        # One document per row. Packed rows would number their documents 1, 2, ... (0 marks padding) and restart
        # the positions at 0 in each; the mixers keep documents apart.
        segment_ids_BT = jnp.ones(tokens_BT.shape, jnp.int32)
        positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
        x = self.embed(tokens_BT)
        for block in self.blocks:
            x = block(x, segment_ids_BT, positions_BT)
        return self.head(self.norm(x))


def next_token_loss(model: TinyLM, tokens_BT):
    logits = model(tokens_BT[:, :-1])
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), tokens_BT[:, 1:, None], axis=-1))


@nnx.jit
def forward(model: TinyLM, tokens_BT):
    return model(tokens_BT)


@nnx.jit
def sgd_step(model: TinyLM, tokens_BT, lr: float = 0.05):
    loss, grads = nnx.value_and_grad(next_token_loss)(model, tokens_BT)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - lr * g, params, grads))
    return loss, grads


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mixer", default="softmax",
                        help=f"a registered mixer: {', '.join(mixers.registry.names())}")
    parser.add_argument("--steps", type=int, default=3, help="SGD steps on the random batch")
    args = parser.parse_args(argv)
    options = {"decay_rank": 16, "gate_rank": 16} if args.mixer == "gdn2" else {}  # low ranks for d_model 64
    model = TinyLM(args.mixer, rngs=nnx.Rngs(0), **options)
    tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, 256)

    logits = forward(model, tokens)
    print(f"{args.mixer}: logits {logits.shape} {logits.dtype}, "
          f"{sum(p.size for p in jax.tree.leaves(nnx.state(model, nnx.Param)))} parameters")

    changed = tokens.at[:, 20].set((tokens[:, 20] + 1) % 256)  # causality: outputs before 20 must not move
    before = float(jnp.max(jnp.abs(forward(model, changed)[:, :20] - logits[:, :20])))
    if before > 1e-5:
        print(f"error: {args.mixer} is not causal (outputs before the changed token moved by {before:.2e})")
        return 1

    losses = []
    for _ in range(args.steps):
        loss, grads = sgd_step(model, tokens)
        losses.append(float(loss))
    grad_norm = float(jnp.sqrt(sum(jnp.sum(g.astype(jnp.float32) ** 2) for g in jax.tree.leaves(grads))))
    print(f"losses {' -> '.join(f'{x:.4f}' for x in losses)}, last gradient norm {grad_norm:.4f}")
    if not all(map(jnp.isfinite, losses)) or grad_norm == 0.0 or (len(losses) > 1 and losses[-1] >= losses[0]):
        print("error: training on the random batch did not lower the loss")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
