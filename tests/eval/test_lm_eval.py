"""eval/lm_eval_adapter.py: lm_eval's simple_evaluate runs the registered ``mixerlab`` model offline on the
three tiny tasks of tests/eval/data (multiple choice -> loglikelihood, perplexity -> loglikelihood_rolling,
generate_until), and every answer equals the model's own numbers: token log-probs summed from one parallel
forward per request (lm_eval's context/continuation split and rolling windows rebuilt here from their
definitions), and greedy decoding through eval.generate."""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from mixerlab import eval
from mixerlab.eval.checkpoint import load_run
from mixerlab.eval.generate import greedy_generate

pytest.importorskip("lm_eval", reason="lm-evaluation-harness is not installed (extra mixerlab[eval])")
import mixerlab.eval.lm_eval_adapter  # noqa: E402, F401  (registers "mixerlab")
from lm_eval import simple_evaluate  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402

TASKS = ["mixerlab_tiny_choice", "mixerlab_tiny_rolling", "mixerlab_tiny_generate"]
DATA = "tests/eval/data"
WIDTH = 80  # the reference forward's fixed input width (every request here is shorter)
TOL = 1e-4
pytestmark = pytest.mark.xdist_group("eval_tiny_run")


@pytest.fixture(autouse=True)
def _full_precision_matmuls():
    with jax.default_matmul_precision("float32"):
        yield


@pytest.fixture(autouse=True)
def _datasets_cache_in_tmp(tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")  # lm_eval's own dependency

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_datasets")


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens_BT):
    return nnx.merge(graphdef, state)(tokens_BT)


def _token_logprobs(model, seq):
    """log p(seq[i+1] | seq[:i+1]) and is-argmax for every i, from one parallel forward of seq[:-1] alone (right
    padded to WIDTH: causal, so the padding is never read)."""
    assert len(seq) - 1 <= WIDTH
    x = np.zeros((1, WIDTH), np.int32)
    x[0, :len(seq) - 1] = seq[:-1]
    logits = np.asarray(_forward(*nnx.split(model), jnp.asarray(x))[0, :len(seq) - 1], np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    targets = np.asarray(seq[1:])
    return logits[np.arange(len(targets)), targets] - logz, logits.argmax(-1) == targets


def _split(tok, context, continuation):
    """lm_eval's causal-LM encoding: trailing context whitespace moves to the continuation, which is
    encode(context + continuation) minus encode(context); an empty context is EOS."""
    if context == "":
        return [tok.eos_id], tok.encode(continuation)
    stripped = context.rstrip()
    continuation = context[len(stripped):] + continuation
    ctx = tok.encode(stripped)
    return ctx, tok.encode(stripped + continuation)[len(ctx):]


def _reference_loglikelihood(model, tok, context, continuation):
    ctx, cont = _split(tok, context, continuation)
    logp, greedy = _token_logprobs(model, ctx + cont)
    return logp[-len(cont):].sum(), bool(greedy[-len(cont):].all())


def _reference_rolling(model, tok, text, max_length):
    """Every token predicted once: windows of max_length predictions, the first conditioned on EOS, each on the
    tokens just before it; the last (partial) window gets a full max_length context."""
    seq = [tok.eos_id] + tok.encode(text)
    n, total = len(seq) - 1, 0.0
    for s in range(0, n, max_length):
        end = min(s + max_length, n)
        lo = s if (s == 0 or end - s == max_length) else end - max_length
        logp, _ = _token_logprobs(model, seq[lo:end + 1])
        total += logp[-(end - s):].sum()
    return total


def _args(sample):
    return [tuple(a) for a in sample["arguments"]]


def test_simple_evaluate_answers_equal_the_models_own_numbers(tiny_run):
    out = simple_evaluate(model="mixerlab", model_args=f"checkpoint={tiny_run}", tasks=TASKS, batch_size=4,
                          task_manager=TaskManager(include_path=DATA, include_defaults=False), log_samples=True,
                          bootstrap_iters=0)
    run = load_run(tiny_run)
    model, tok, max_length = run.model, run.tokenizer, run.cfg.data.seq_len
    samples = out["samples"]

    choice = samples["mixerlab_tiny_choice"]
    assert len(choice) == 4 and any(_args(s)[0][0] == "" for s in choice)  # one request has an empty context
    for s in choice:
        for (context, continuation), (ll, greedy) in zip(_args(s), s["filtered_resps"]):
            ref_ll, ref_greedy = _reference_loglikelihood(model, tok, context, continuation)
            assert math.isclose(ll, ref_ll, abs_tol=TOL, rel_tol=1e-5), (context, continuation, ll, ref_ll)
            assert greedy == ref_greedy

    rolling = samples["mixerlab_tiny_rolling"]
    lengths = [len(tok.encode(_args(s)[0][0])) for s in rolling]
    assert max(lengths) > max_length  # one document spans two windows
    for s in rolling:
        (text,) = _args(s)[0]
        ref = _reference_rolling(model, tok, text, max_length)
        assert math.isclose(s["filtered_resps"][0], ref, abs_tol=TOL, rel_tol=1e-5), (text[:40], ref)
    bpb = out["results"]["mixerlab_tiny_rolling"]["bits_per_byte,none"]
    ref_total = sum(_reference_rolling(model, tok, _args(s)[0][0], max_length) for s in rolling)
    n_bytes = sum(len(_args(s)[0][0].encode("utf-8")) for s in rolling)
    assert math.isclose(bpb, -ref_total / n_bytes / math.log(2), rel_tol=1e-5)

    generated = samples["mixerlab_tiny_generate"]
    for s in generated:
        context, gen_kwargs = _args(s)[0]
        assert gen_kwargs["until"] == ["\n"] and gen_kwargs["max_gen_toks"] == 8
        new = greedy_generate(model, [tok.encode(context)], 8, stop_tokens=(tok.eos_id,))[0]
        text = tok.decode(new).split("\n")[0]
        assert s["filtered_resps"][0] == text

    assert set(out["results"]) == set(TASKS)


def test_model_args_are_checked(tiny_run):
    from lm_eval.api.registry import get_model

    cls = get_model("mixerlab")
    assert cls is eval.lm_eval_adapter.MixerlabLM
    with pytest.raises(ValueError, match="unknown pretrained; valid: checkpoint, step"):
        cls.create_from_arg_string(f"checkpoint={tiny_run},pretrained=gpt2")
    with pytest.raises(ValueError, match="checkpoint=<run directory> is required"):
        cls.create_from_arg_string("")
    lm = cls.create_from_arg_string(f"checkpoint={tiny_run},step=1,max_length=32", {"batch_size": 2})
    assert (lm.run.step, lm.max_length, lm.batch_size) == (1, 32, 2)
