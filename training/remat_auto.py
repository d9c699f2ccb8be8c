"""``model.remat: auto``: the fastest activation-checkpointing policy whose compiled train step fits the device.

Recomputation trades time for memory. On an H200 at 32 × 4096 tokens (GDN-2 166M, docs/benchmarks/train_h200.md)
the policies order as none (fastest, 91.5 GiB) < dots (61.1 GiB) < kernels (36.0 GiB) < block (28.0 GiB), so
``auto`` compiles the train step with each in that order and keeps the first whose per-device program (the
compiler's memory analysis: arguments + outputs − donated aliases + temporaries + code) fits in ``HEADROOM`` of
the device's memory limit. The choice is printed. Each policy tried is one compile; the chosen one is compiled
again for the run unless JAX's persistent compilation cache is configured.

The estimate is no promise. On the H200 (32 × 4096 tokens) it put the Muir 166M step without recomputation at
110.1 GiB, which is what it peaked at, but the Transformer 166M's at 74.1 GiB, which ran out of memory at its
first step (docs/benchmarks/train_h200.md). So when a step under auto's choice
runs out of device memory before any step has finished, ``training.loop.train`` starts the run again with the
next policy of :data:`CANDIDATES` (nothing was logged or saved yet; the Transformer then runs with "dots"); an
explicit policy stops with :func:`advice_after_oom`. Since a wrong guess costs one more compile, not the run,
``HEADROOM`` is 90 %: at 80 % the Muir step above took "dots" (33 % MFU) instead of "none" (38 %).

XLA sometimes knows better than the count: when its own rematerialization pass cannot bring a program under the
memory limit it was given, it logs "Can't reduce memory use below … only reduced to … (N bytes)" while compiling.
On an H100 (80 GB, 71.3 GiB allowed) RWKV-7 166M's step under "kernels" counted 61.7 GiB, fitted the 64.1 GiB
budget, drew that line at 69.55 GiB and ran out of memory at its first step. So each candidate is compiled with
the process's stderr captured (and passed on unchanged), and the larger of N and the count is what must fit.

Where the limit is unknown (an accelerator that reports none and is not a TPU generation we know), a candidate
counts as fitting when the compiler accepts it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import sys
import tempfile
from typing import Callable, Optional

from mixerlab.training import flop_model

CANDIDATES = ("none", "dots", "kernels", "block")  # fastest first
HEADROOM = 0.9  # of the limit: the allocator also holds what compiling took (autotuning) and fragments


def program_bytes(mem) -> float:
    """Per-device bytes of a compiled program (``mem``: its ``memory_analysis()``): arguments + outputs − donated
    aliases + temporaries + code."""
    field = lambda name: float(getattr(mem, name, 0) or 0)  # noqa: E731
    return (field("argument_size_in_bytes") + field("output_size_in_bytes") - field("alias_size_in_bytes")
            + field("temp_size_in_bytes") + field("generated_code_size_in_bytes"))


def peak_note(policy: str, mem, counted: float) -> Optional[str]:
    """A line when XLA's own peak for the compiled program (``mem.peak_memory_in_bytes``, where the runtime
    reports one) is above :func:`program_bytes`' count, else None. Logged, not yet used to choose: on an H100 at 15 % of
    the GPU the Muir step of configs/lm_compare counted 10.6 GiB, fitted the 90 % headroom, and ran out of memory
    at its first step, while XLA's rematerialization pass put it at 11.58 GiB; whether this field sees that too is
    what the line is for."""
    peak = float(getattr(mem, "peak_memory_in_bytes", 0) or 0)
    if peak <= counted * 1.01:
        return None
    return (f"model.remat=auto: {policy!r}: XLA's peak for the step is {peak / 2**30:.1f} GiB, above the "
            f"{counted / 2**30:.1f} GiB counted")


_XLA_COULD_NOT_REDUCE = re.compile(r"Can't reduce memory use below .*?only reduced to [0-9.]+\s*\w+ \((\d+) bytes\)")


def xla_remat_shortfall(log: str) -> Optional[float]:
    """The bytes XLA's rematerialization pass says a program still needs when it could not bring it under its
    memory limit (the largest such figure in ``log``), else None."""
    needs = [float(m.group(1)) for m in _XLA_COULD_NOT_REDUCE.finditer(log)]
    return max(needs) if needs else None


@contextlib.contextmanager
def stderr_captured():
    """Collect what the process writes to file descriptor 2 inside the block (XLA's C++ log included) into the
    list this yields, and write it on to the real stderr afterwards, so nothing is lost."""
    sys.stderr.flush()
    saved = os.dup(2)
    captured: list = []
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            data = tmp.read()
            captured.append(data.decode(errors="replace"))
            if data:
                os.write(2, data)


def needed_bytes(policy: str, analyse: Callable, say=print) -> float:
    """Bytes the step compiled by ``analyse()`` (returning its ``memory_analysis()``) needs: :func:`program_bytes`,
    or XLA's figure when its rematerialization pass said it could not get the program under its limit and that
    figure is larger."""
    with stderr_captured() as log:
        mem = analyse()
    counted = program_bytes(mem)
    note = peak_note(policy, mem, counted)
    if note:
        say(note)
    xla = xla_remat_shortfall("".join(log))
    if xla is not None and xla > counted:
        say(f"model.remat=auto: {policy!r}: XLA's rematerialization could not bring the step under its memory "
            f"limit and puts it at {xla / 2**30:.1f} GiB (counted {counted / 2**30:.1f} GiB); taking that")
        return xla
    return counted


def device_memory_limit(device) -> Optional[float]:
    """Bytes one device may allocate: the runtime's limit (GPU, TPU; on GPU JAX's allocator limit, a share of
    the memory set by XLA_PYTHON_CLIENT_MEM_FRACTION, 0.75 by default), the HBM of a known TPU generation (the
    abstract devices of ``--compile_only``), the host's RAM for the CPU, else None."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - abstract topology devices have no runtime
        stats = {}
    if stats.get("bytes_limit"):
        return float(stats["bytes_limit"])
    if device.platform == "cpu":
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    chip = flop_model.device_chip(device)
    return float(chip.hbm_bytes) if chip and chip.hbm_bytes else None


class OutOfDeviceMemory(MemoryError):
    """A train step ran out of device memory; the message names the policy and what to change."""


def out_of_memory(err: Exception) -> bool:
    text = str(err)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()


def more_frugal(policy: str) -> Optional[str]:
    """The policy after ``policy`` in :data:`CANDIDATES` (slower, less memory); None after "block" or for a policy
    outside the list ("mixer")."""
    later = CANDIDATES[CANDIDATES.index(policy) + 1:] if policy in CANDIDATES else ()
    return later[0] if later else None


def advice_after_oom(cfg, requested: str) -> str:
    """What to change after a train step under ``cfg`` (its remat policy resolved; ``requested`` is what the
    config asked for) ran out of device memory: the next more frugal policy, then smaller live batches."""
    policy, t, seq = cfg.model.remat, cfg.train, cfg.data.seq_len
    frugal = more_frugal(policy)
    tries = [f"model.remat={frugal}"] if frugal else []
    if t.batch_size % (2 * t.microbatches) == 0:
        tries.append(f"train.microbatches={2 * t.microbatches}")
    if not t.loss_chunk and seq % 1024 == 0 and seq > 1024:
        tries.append("train.loss_chunk=1024")
    if t.batch_size > 1:
        tries.append(f"train.batch_size={t.batch_size // 2}")
    how = (" (chosen by model.remat=auto from the compiler's estimate, which the runtime exceeded)"
           if requested == "auto" else "")
    return (f"the train step ran out of device memory with model.remat={policy}{how}, "
            f"train.batch_size={t.batch_size}, train.microbatches={t.microbatches}, data.seq_len={seq}; try "
            + (", or ".join(tries) if tries else "a device with more memory or more devices"))


def choose(compile_bytes: Callable[[str], float], limit: Optional[float], say=print) -> str:
    """The first of :data:`CANDIDATES` whose program fits ``HEADROOM · limit`` (``compile_bytes(policy)``: the
    compiled step's bytes; it may raise the compiler's out-of-memory error). When none fits, the most frugal
    policy, "block", with a warning (the run then fails with the compiler's or the allocator's own message)."""
    gib = lambda b: f"{b / 2**30:.1f} GiB"  # noqa: E731
    budget = None if limit is None else HEADROOM * limit
    for policy in CANDIDATES:
        try:
            need = compile_bytes(policy)
        except Exception as err:  # noqa: BLE001 - only the compiler's out-of-memory refusal means "try the next"
            if not out_of_memory(err):
                raise
            say(f"model.remat=auto: {policy!r} does not compile within the device's memory; trying the next")
            continue
        if budget is None or need <= budget:
            where = "" if budget is None else f" of {gib(budget)} ({HEADROOM:.0%} of {gib(limit)})"
            say(f"model.remat=auto -> {policy!r}: the train step needs {gib(need)}{where}")
            return policy
        say(f"model.remat=auto: {policy!r} needs {gib(need)}, more than {gib(budget)}; trying the next")
    say("model.remat=auto: no policy fits; using 'block' (the most frugal). Lower train.batch_size, raise "
        "train.microbatches or set train.loss_chunk")
    return CANDIDATES[-1]


def resolve(cfg, vocab_size: int, mesh, say=print):
    """``cfg`` with ``model.remat`` "auto" replaced by :func:`choose`'s policy for this mesh's devices (cfg
    unchanged otherwise). Each candidate is compiled on abstract arguments (no parameters are drawn)."""
    if cfg.model.remat != "auto":
        return cfg
    from mixerlab.training.trainer import Trainer

    def with_policy(policy):
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=policy))

    def compile_bytes(policy):
        trainer = Trainer(with_policy(policy), vocab_size, mesh=mesh)
        return needed_bytes(policy, lambda: trainer.lower_abstract_step().compile().memory_analysis(), say)

    return with_policy(choose(compile_bytes, device_memory_limit(mesh.devices.flat[0]), say))
