"""Ahead-of-time compile of the real train step for a TPU topology, without the hardware.

    python train.py --config configs/muir_166m.yaml --compile_only --topology v5e:16x16

libtpu (``jax[tpu]``) compiles for a named topology (``jax.experimental.topologies``); the report gives the
per-chip parameter / optimizer / activation memory, whether it fits the chip's HBM, FLOPs per step (ours
and the compiler's), the compiler's estimated step time, a roofline step time from the compiler's FLOPs and
bytes and the chip's peaks, and the MFU those imply — to compare mixers on a slice before renting it. Without
data, our FLOPs count softmax attention as one document per row (flop_model.full_row_pairs: the most a step
can do; a step on packed short documents does less).
"""
from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from mixerlab.pallas_kernels import chips
from mixerlab.training import flop_model


@dataclasses.dataclass
class CompileReport:
    topology: str
    chips: int
    mesh: dict
    params: int
    param_bytes_per_chip: float
    opt_bytes_per_chip: float
    temp_bytes_per_chip: float
    total_bytes_per_chip: float
    hbm_bytes_per_chip: float | None
    model_flops_per_step: float
    compiler_flops_per_chip: float | None
    compiler_bytes_per_chip: float | None
    compiler_seconds: float | None
    compile_seconds: float

    @property
    def roofline_seconds(self) -> float | None:
        """max(compiler FLOPs / peak FLOP/s, compiler bytes / HBM bandwidth) per chip: a lower bound on the
        step time on this chip generation (the compiler counts each Pallas kernel by its CostEstimate)."""
        chip = chips.by_name(chip_generation(self.topology))
        if chip is None or not chip.hbm_bandwidth or not self.compiler_flops_per_chip:
            return None
        return max(self.compiler_flops_per_chip / chip.roofline_flops,
                   (self.compiler_bytes_per_chip or 0.0) / chip.hbm_bandwidth)

    @property
    def estimated_seconds(self) -> float | None:
        """The step-time estimate: the compiler's own when it gives one, else the roofline bound."""
        return self.compiler_seconds or self.roofline_seconds

    def estimated_mfu(self) -> float | None:
        """Model FLOPs over the estimated step time against the datasheet dense bf16 peak (None when either is
        unknown); raises flop_model.ImpossibleMFU above 100 %."""
        chip, seconds = chips.by_name(chip_generation(self.topology)), self.estimated_seconds
        if chip is None or not seconds:
            return None
        return flop_model.utilisation(self.model_flops_per_step, seconds, self.chips, chip,
                                      f"--compile_only for {self.topology}")["mfu"]

    def _mfu_line(self) -> str:
        try:
            mfu = self.estimated_mfu()
        except flop_model.ImpossibleMFU as err:
            return f"refused: {err}"
        if mfu is None:
            return "n/a"
        chip = chips.by_name(chip_generation(self.topology))
        return (f"{100 * mfu:.1f} % of the {chip.bf16_peak / 1e12:.0f} TFLOP/s dense bf16 peak (model FLOPs over the "
                f"estimated step time; real steps are slower)")

    @property
    def fits(self) -> bool | None:
        return None if self.hbm_bytes_per_chip is None else self.total_bytes_per_chip <= self.hbm_bytes_per_chip

    def table(self) -> str:
        gib = lambda b: f"{b / 2**30:8.3f} GiB"
        hbm = "unknown" if self.hbm_bytes_per_chip is None else gib(self.hbm_bytes_per_chip)
        fits = {None: "unknown", True: "yes", False: "NO"}[self.fits]
        rows = [
            ("topology", f"{self.topology} ({self.chips} chips), mesh {self.mesh}"),
            ("parameters", f"{self.params:,} ({self.params / 1e6:.2f}M)"),
            ("params / chip", gib(self.param_bytes_per_chip)),
            ("optimizer / chip", gib(self.opt_bytes_per_chip)),
            ("activations+temp / chip", gib(self.temp_bytes_per_chip)),
            ("total / chip", f"{gib(self.total_bytes_per_chip)} of {hbm} HBM: fits {fits}"),
            ("model FLOPs / step", f"{self.model_flops_per_step:.4e} (analytic, training/flop_model.py; softmax "
                                   f"attention as one document per row)"),
            ("compiler FLOPs / chip", "n/a" if self.compiler_flops_per_chip is None
             else f"{self.compiler_flops_per_chip:.4e} (cost_analysis; Pallas kernels count their CostEstimate)"),
            ("compiler step time", "n/a" if self.compiler_seconds is None
             else f"{self.compiler_seconds * 1e3:.2f} ms (cost_analysis 'optimal_seconds', an estimate)"),
            ("roofline step time", "n/a" if self.roofline_seconds is None
             else f"{self.roofline_seconds * 1e3:.2f} ms (max of compiler FLOPs / peak and bytes / HBM bandwidth)"),
            ("estimated MFU", self._mfu_line()),
            ("compile time", f"{self.compile_seconds:.1f} s"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def _bytes_per_chip(abstract, shardings) -> float:
    total = 0.0
    for x, sh in zip(jax.tree.leaves(abstract), jax.tree.leaves(shardings)):
        shard = sh.shard_shape(x.shape) if hasattr(sh, "shard_shape") else x.shape
        total += float(np.prod(shard)) * np.dtype(x.dtype).itemsize
    return total


def chip_generation(topology: str) -> str:
    return topology.split(":", 1)[0].strip().lower()


def hbm_bytes(topology: str) -> float | None:
    """HBM per chip of the topology's generation (pallas_kernels/chips.py), None when unknown."""
    chip = chips.by_name(chip_generation(topology))
    return chip.hbm_bytes if chip else None


def compile_train_step(cfg, topology: str, vocab_size: int):
    """(compiled train step, trainer, abstract optimizer state) for a TPU topology, without the hardware.
    ``compiled.as_text()`` is the per-chip program (tests look at its buffer shapes)."""
    from jax.experimental import topologies

    from mixerlab.training import mesh as mesh_lib
    from mixerlab.training.trainer import Trainer

    topo = topologies.get_topology_desc(topology, "tpu")
    mesh = mesh_lib.make_mesh(cfg, list(topo.devices))
    trainer = Trainer(cfg, vocab_size, mesh=mesh)
    opt_abstract = jax.eval_shape(trainer.tx.init, trainer.abstract_params)
    try:
        # The step traces its ops under the topology's mesh, so they pick their TPU kernels (dispatch.target_backend).
        compiled = trainer.lower_abstract_step().compile()
    except Exception as e:  # the TPU compiler refuses programs that cannot fit in HBM
        if "RESOURCE_EXHAUSTED" in str(e) or "Ran out of memory" in str(e):
            remat = trainer.cfg.model.remat  # model.remat=auto resolved
            remat = "" if remat == "block" else f", model.remat=block (now {remat!r})"
            raise MemoryError(f"does not fit on {topology} with mesh {dict(mesh.shape)}: {e}. Try "
                              f"train.loss_chunk=512 (now {cfg.train.loss_chunk}), more chips, "
                              f"train.microbatches (gradient accumulation; now {cfg.train.microbatches}){remat}, "
                              f"a smaller train.batch_size, or another mesh.fsdp / mesh.tensor split") from None
        raise
    return compiled, trainer, opt_abstract


def compile_for_topology(cfg, topology: str, vocab_size: int) -> CompileReport:
    start = time.perf_counter()
    compiled, trainer, opt_abstract = compile_train_step(cfg, topology, vocab_size)
    compile_seconds = time.perf_counter() - start
    mesh = trainer.mesh
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else (cost or {})
    param_b = _bytes_per_chip(trainer.abstract_params, trainer.param_shardings)
    opt_b = _bytes_per_chip(opt_abstract, trainer.opt_shardings)
    temp_b = float(getattr(mem, "temp_size_in_bytes", 0) or 0)
    args_b = float(getattr(mem, "argument_size_in_bytes", 0) or 0)
    out_b = float(getattr(mem, "output_size_in_bytes", 0) or 0)
    alias_b = float(getattr(mem, "alias_size_in_bytes", 0) or 0)
    code_b = float(getattr(mem, "generated_code_size_in_bytes", 0) or 0)
    total_b = args_b + out_b - alias_b + temp_b + code_b
    flops = flop_model.training_flops(cfg, trainer.abstract_params, vocab_size)
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(trainer.abstract_params))
    return CompileReport(
        topology=topology, chips=int(mesh.devices.size), mesh=dict(mesh.shape), params=n_params,
        param_bytes_per_chip=param_b, opt_bytes_per_chip=opt_b, temp_bytes_per_chip=temp_b,
        total_bytes_per_chip=total_b, hbm_bytes_per_chip=hbm_bytes(topology),
        model_flops_per_step=flops.step_flops(cfg.train.batch_size * cfg.data.seq_len,
                                              flop_model.full_row_pairs(cfg.train.batch_size, cfg.data.seq_len)),
        compiler_flops_per_chip=cost.get("flops"), compiler_bytes_per_chip=cost.get("bytes accessed"),
        compiler_seconds=(cost.get("optimal_seconds") or 0) > 0 and cost.get("optimal_seconds") or None,
        compile_seconds=compile_seconds)
