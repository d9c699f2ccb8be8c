"""lm-evaluation-harness model ``mixerlab``: a trained run answering loglikelihood, loglikelihood_rolling and
generate_until requests (lm_eval 0.4.13, pinned in requirements/cpu.lock; it needs no torch).

Run it (same arguments as the ``lm_eval`` command; this entry point imports this module, which registers
``mixerlab``, then hands the arguments to lm_eval's own CLI):

    python -m mixerlab.eval.lm_eval_adapter --model mixerlab --model_args checkpoint=runs/base --tasks lambada_openai
    python -m mixerlab.eval.lm_eval_adapter run --model mixerlab --model_args checkpoint=runs/base,max_length=512 \\
        --include_path tests/eval/data --tasks mixerlab_tiny_choice

The bare ``lm_eval`` command cannot find ``mixerlab``: lm_eval 0.4.13 discovers no external models (no entry
points; ``--include_path`` only adds task YAML directories). From Python, ``import mixerlab.eval.lm_eval_adapter`` and
call ``lm_eval.simple_evaluate(model="mixerlab", model_args="checkpoint=runs/base", ...)``.

model_args: ``checkpoint`` (run directory or its checkpoints/ directory; required), ``step`` (default newest),
``max_length`` (context window in tokens, default the run's data.seq_len), ``batch_size`` (default 8),
``max_gen_toks`` (default 256).

Conventions: lm_eval's ``TemplateLM`` tokenizes (trailing context whitespace moves to the continuation; the
continuation is encode(context + continuation) minus encode(context); an empty context becomes the EOS id) and
builds the rolling windows (EOS prefix, ``max_length`` tokens, each token scored once). A request's last
``max_length`` + 1 tokens are scored by the parallel forward from position 0 (left truncation), padded to a
power-of-two length so a few compiled shapes serve every request. ``generate_until`` decodes through
``eval.generate`` (greedy, or sampling when ``do_sample`` and ``temperature`` > 0), with the context
left-truncated to ``max_length - max_gen_toks`` tokens (at least 1); it stops at EOS or at the first ``until``
string, which is cut from the text.
"""
from __future__ import annotations

import collections
import json
import logging
import sys

from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from mixerlab.eval.checkpoint import load_run
from mixerlab.eval.generate import bucket, greedy_generate, sample
from mixerlab.eval.perplexity import score_windows

log = logging.getLogger(__name__)
_SUPPORTED_GEN_KWARGS = {"until", "max_gen_toks", "do_sample", "temperature", "top_k", "seed"}


class MixerlabLM(TemplateLM):
    def __init__(self, checkpoint: str | None = None, step: int | None = None, max_length: int | None = None,
                 batch_size: int | str | None = 8, max_gen_toks: int = 256, device: str | None = None,
                 max_batch_size: int | None = None, **unknown):
        super().__init__()
        if unknown:
            raise ValueError(f"mixerlab model_args: unknown {', '.join(sorted(unknown))}; valid: checkpoint, step, "
                             f"max_length, batch_size, max_gen_toks")
        if not checkpoint:
            raise ValueError("mixerlab model_args: checkpoint=<run directory> is required "
                             "(e.g. --model_args checkpoint=runs/base)")
        del device, max_batch_size  # JAX places the model on its default device; batches are fixed-size
        run = load_run(str(checkpoint), None if step is None else int(step))
        self.run, self.model, self._tokenizer = run, run.model, run.tokenizer
        self.max_length = int(max_length or run.cfg.data.seq_len)
        if batch_size in (None, "auto") or str(batch_size).startswith("auto"):
            batch_size = 8
        self.batch_size = int(batch_size)
        self.max_gen_toks = int(max_gen_toks)
        for key, value in {"max_length": self.max_length, "batch_size": self.batch_size,
                           "max_gen_toks": self.max_gen_toks}.items():
            if value < 1:
                raise ValueError(f"mixerlab model_args: {key} must be >= 1, got {value}")

    # -- TemplateLM hooks
    @property
    def eot_token_id(self) -> int:
        return self._tokenizer.eos_id

    @property
    def tokenizer_name(self) -> str:
        return self._tokenizer.name

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self._tokenizer.encode(string)  # our tokenizers add no special tokens

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        """(sum of log p(continuation token), whether every continuation token is the argmax) per request of
        ((context, continuation) or None, context tokens, continuation tokens)."""
        windows, spans = [], []
        for i, (_, ctx, cont) in enumerate(requests):
            if not cont:
                raise ValueError(f"loglikelihood request {i}: the continuation encodes to no token")
            if len(cont) > self.max_length:
                raise ValueError(f"loglikelihood request {i}: the continuation has {len(cont)} tokens, more than "
                                 f"max_length={self.max_length}; raise max_length in --model_args")
            whole = (list(ctx) + list(cont))[-(self.max_length + 1):]
            windows.append((whole[:-1], whole[1:]))
            spans.append(len(cont))
        by_length = collections.defaultdict(list)
        for i, (x, _) in enumerate(windows):
            by_length[min(bucket(len(x)), self.max_length)].append(i)
        results: list[tuple[float, bool] | None] = [None] * len(requests)
        for length, idx in sorted(by_length.items()):
            scored = score_windows(self.model, [windows[i] for i in idx], length, self.batch_size)
            for i, (logp, greedy) in zip(idx, scored):
                n = spans[i]
                results[i] = (float(logp[-n:].astype("float64").sum()), bool(greedy[-n:].all()))
        for (args, _, _), answer in zip(requests, results):
            if args is not None:
                self.cache_hook.add_partial("loglikelihood", args, answer)
        return results

    # -- LM requests
    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        pieces, owner = [], []
        for r, req in enumerate(requests):
            (text,) = req.args
            for ctx, cont in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                pieces.append((None, ctx, cont))
                owner.append(r)
        totals = [0.0] * len(requests)
        for r, (logp, _) in zip(owner, self._loglikelihood_tokens(pieces)):
            totals[r] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups = collections.defaultdict(list)
        for i, req in enumerate(requests):
            context, gen_kwargs = req.args
            groups[json.dumps(gen_kwargs or {}, sort_keys=True, default=str)].append(i)
        outputs: list[str | None] = [None] * len(requests)
        for key, idx in groups.items():
            kwargs = json.loads(key)
            unsupported = sorted(set(kwargs) - _SUPPORTED_GEN_KWARGS)
            if unsupported:
                log.warning("mixerlab: ignoring generation kwargs %s (supported: %s)", unsupported,
                            sorted(_SUPPORTED_GEN_KWARGS))
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            keep = max(1, self.max_length - max_new)
            generate = self._generator(kwargs)
            for lo in range(0, len(idx), self.batch_size):
                batch = idx[lo:lo + self.batch_size]
                prompts = [(self.tok_encode(requests[i].args[0]) or [self.prefix_token_id])[-keep:] for i in batch]
                for i, new in zip(batch, generate(self.model, prompts, max_new, stop_tokens=(self.eot_token_id,))):
                    text = self._tokenizer.decode(new)
                    for stop in until:
                        if stop and stop in text:
                            text = text[:text.index(stop)]
                    outputs[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return outputs

    @staticmethod
    def _generator(kwargs: dict):
        temperature = float(kwargs.get("temperature", 0.0) or 0.0)
        if kwargs.get("do_sample") and temperature > 0:
            top_k, seed = int(kwargs.get("top_k", 0) or 0), int(kwargs.get("seed", 0) or 0)
            return lambda model, prompts, n, stop_tokens: sample(model, prompts, n, temperature=temperature,
                                                                 top_k=top_k, seed=seed, stop_tokens=stop_tokens)
        return greedy_generate


def _table_headers_compat() -> None:
    """lm_eval sets ``MarkdownTableWriter.headers``; the pinned pytablewriter 0.38.0 (the newest that resolves
    next to the lock's python-dateutil 4.0.0) calls it ``header_list``. Without this alias the printed results
    table has the column names A, B, C, ..."""
    import pytablewriter

    for cls in (pytablewriter.MarkdownTableWriter, pytablewriter.LatexTableWriter):
        if not hasattr(cls, "headers") and hasattr(cls, "header_list"):
            cls.headers = property(lambda self: self.header_list,
                                   lambda self, value: setattr(self, "header_list", value))


if __name__ == "__main__":
    # Register the importable class (not this __main__ copy), then run lm_eval's CLI with our arguments.
    import mixerlab.eval.lm_eval_adapter  # noqa: F401
    from lm_eval.__main__ import cli_evaluate

    _table_headers_compat()
    sys.exit(cli_evaluate())
else:
    register_model("mixerlab")(MixerlabLM)
