"""MQAR in the VLA paper's own setup: the config without short convs, the OOD-key generator (Table 13), seed
lists per n merged with mean ± std, and the GPU script's job list (tools/gpu_mqar_paper.sh, dry run)."""
import dataclasses
import json
import os
import shlex
import subprocess

import numpy as np
import pytest
from flax import nnx

from mixerlab.eval.synthetic import generators as gen
from mixerlab.eval.synthetic.generators import IGNORE, SEP
from mixerlab.eval.synthetic.task import TaskConfig, load_eval_config, validate_task

PAPER = "configs/eval/mqar_vla_paper.yaml"
PAPER_MIXERS = ("softmax", "linear_attention", "paper_deltanet", "vla")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _conv_params(cfg, name):
    """Paths of the parameters of mixer ``name`` built from ``cfg`` that belong to a convolution."""
    from mixerlab.mixers import registry
    from mixerlab.mixers.base import MixerSpec

    spec = MixerSpec(d_model=cfg.model.d_model, num_heads=cfg.model.num_heads, head_dim=cfg.head_dim,
                     value_head_dim=cfg.head_dim, layer_index=0, num_layers=cfg.model.num_layers)
    layer = registry.build(name, spec, cfg.mixer_options(name), rngs=nnx.Rngs(0))
    paths = [".".join(str(k) for k in path) for path, _ in nnx.to_flat_state(nnx.state(layer))]
    return [p for p in paths if "conv" in p]


def test_paper_config_is_mqar_vla_without_short_convs():
    cfg, task = load_eval_config(PAPER)
    base, _ = load_eval_config("configs/eval/mqar_vla.yaml")
    base_task = load_eval_config("configs/eval/mqar_vla.yaml")[1]
    assert cfg.model == base.model and cfg.optim == base.optim
    assert task == dataclasses.replace(base_task, eval_every=200)  # learning curves on Table 8's step grid
    assert (cfg.train.steps, cfg.optim.warmup_steps, cfg.train.batch_size) == (2000, 200, 64)
    from mixerlab.mixers import registry

    for name in registry.names():
        opts = cfg.mixer_options(name)
        if hasattr(opts, "use_short_conv"):
            assert not opts.use_short_conv, name
    for name in PAPER_MIXERS:
        assert _conv_params(cfg, name) == [], name  # the flag really removes the conv's parameters
    assert _conv_params(base, "vla")  # ... which the other config has (the check can fail)


def test_ood_keys_come_from_the_range_and_values_avoid_them():
    n, rows = 16, 400
    b = gen.mqar_vla_contiguous(np.random.default_rng(1), rows, num_kv_pairs=n, key_range=(64, 127))
    x, y = b["inputs"], b["labels"]
    keys, values = x[:, 0:2 * n:2], x[:, 1:2 * n:2]
    assert keys.min() >= 64 and keys.max() <= 126 and values.min() >= 64 and values.max() <= 127
    assert len(np.unique(keys)) > 55  # the whole range is used, not a corner of it
    for r in range(rows):
        assert len(set(keys[r])) == n and len(set(values[r])) == n
        assert not set(keys[r]) & set(values[r]), r  # no token is both a key and a value of one row
        lookup = dict(zip(keys[r], values[r]))
        queries = x[r, 2 * n + 1:]
        assert sorted(queries) == sorted(keys[r]) and x[r, 2 * n] == SEP
        assert list(y[r, 2 * n + 1:]) == [lookup[k] for k in queries]
    assert np.all(y[:, :2 * n + 1] == IGNORE)
    plain = gen.mqar_vla_contiguous(np.random.default_rng(1), rows, num_kv_pairs=n)  # the default is unchanged
    assert plain["inputs"][:, 0:2 * n:2].max() <= 63


@pytest.mark.parametrize("key_range, n, match", [
    ((0, 64), 8, r"1 <= low < high"),
    ((64, 129), 8, r"high <= vocab_size"),
    ((100, 104), 8, r"holds 4 tokens, fewer than num_kv_pairs=8"),
    ((64, 127), 40, r"only 24 value tokens"),
    ((64,), 8, r"two integers"),
])
def test_ood_key_range_errors_name_the_range(key_range, n, match):
    with pytest.raises(ValueError, match=r"key_range: .*" + match):
        gen.mqar_vla_contiguous(np.random.default_rng(0), 2, num_kv_pairs=n, key_range=key_range)


def test_ood_task_switch_is_validated():
    validate_task(TaskConfig(num_kv_pairs=24, ood_key_range=(64, 127)), 128)
    with pytest.raises(ValueError, match=r"task.ood_key_range: .*vla_contiguous"):
        validate_task(TaskConfig(layout="zoology", seq_len=64, ood_key_range=(64, 127)), 128)
    with pytest.raises(ValueError, match=r"task.ood_key_range: .*fewer than num_kv_pairs=40"):
        validate_task(TaskConfig(num_kv_pairs=40, ood_key_range=(64, 127)), 128)


TINY = ["task.eval_batches=1", "train.batch_size=8", "model.d_model=32", "model.num_heads=2", "model.head_dim=16",
        "model.ffn_dim=32"]


def test_seed_lists_per_n_label_ood_and_merge_with_mean_std(tmp_path, capsys):
    """A labelled sweep with OOD keys (3 steps; one run, to stay fast), merged with another sweep of a different
    n, seed list and step count: mean ± sample std per cell, step counts in the column names, the OOD table."""
    from mixerlab.eval import mqar

    a = mqar.main(["--config", PAPER, "--mixers", "softmax", "--label", "softmax (tiny)", "--n", "2",
                   "--seeds", "1", "--out", str(tmp_path / "a"), "train.steps=3", "task.ood_key_range=[64,127]",
                   *TINY])
    assert [(r["setting"], r["seed"], r["train_steps"]) for r in a] == [("n=2", 1, 3)]
    assert all(r["mixer"] == "softmax (tiny)" and r["mixer_entry"] == "softmax" for r in a)
    assert all(0.0 <= r["ood_accuracy"] <= 1.0 and r["ood_held_out"]["rows"] == 8 for r in a)
    assert "OOD-key accuracy" in capsys.readouterr().out
    other = [{"mixer": "softmax (tiny)", "setting": "n=4", "x": 4.0, "seed": seed, "train_steps": 2,
              "accuracy": acc, "ood_accuracy": None} for seed, acc in ((42, 0.5), (123, 0.7), (999, 0.9))]
    (tmp_path / "b.json").write_text(json.dumps({"results": other}))
    # b first: the columns still come in order of n
    mqar.main(["--merge", str(tmp_path / "b.json"), str(tmp_path / "a" / "results.json"), "--out", str(tmp_path / "m")])
    text = (tmp_path / "m" / "table.md").read_text()
    header, row = [line for line in text.splitlines() if line.startswith("| ")][:2]
    assert [c.strip() for c in header.split("|")[1:-1]] == ["mixer", "n=2 (3 steps)", "n=4 (2 steps)"]
    cells = [c.strip() for c in row.split("|")[2:-1]]
    assert cells[0] == f"{a[0]['accuracy']:.3f}"  # one seed: the value alone
    assert cells[1] == "0.700 ± 0.200 [0.500,0.900]"  # sample std (ddof 1), as the VLA paper's Table 9
    assert "out-of-distribution keys from [64, 127]" in text
    with pytest.raises(SystemExit, match="--label names one mixer"):
        mqar.main(["--config", PAPER, "--mixers", "softmax,vla", "--label", "x", "--out", str(tmp_path / "c")])


def _dry_run(parts, mixers=None):
    args = ["bash", "tools/gpu_mqar_paper.sh", "/tmp/out", parts] + ([mixers] if mixers else [])
    done = subprocess.run(args, cwd=REPO, env={**os.environ, "DRY_RUN": "1"}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    jobs = {}
    for line in done.stdout.splitlines():
        name, command = line.split(":", 1)
        jobs[name] = shlex.split(command)
    return jobs


def test_gpu_script_runs_the_papers_protocol():
    """Every job's command line parses with the CLI's own parser; together they are the protocol: per mixer
    n = 4,8,16,24 x seeds {42,123,999} at 2000 steps and n = 32,48 x seed 42 at 1000 steps; the ablations
    and OOD runs at 1000 steps."""
    from mixerlab.eval import mqar

    jobs = _dry_run("seed42,seeds,ablation,ood")
    runs = set()
    for name, argv in jobs.items():
        assert argv[:3] == ["python3", "-m", "mixerlab.eval.mqar"], name
        args = mqar.sweep_parser().parse_args(argv[3:])
        assert args.config == "configs/eval/mqar_vla_paper.yaml" and args.out == f"/tmp/out/{name}"
        steps = dict(o.split("=", 1) for o in args.overrides).get("train.steps", "2000")
        for n in args.n.split(","):
            for seed in args.seeds.split(","):
                runs.add((name.split("_")[0], args.label or args.mixers, int(n), int(seed), int(steps),
                          tuple(o for o in args.overrides if not o.startswith("train.steps"))))
    main = {r[1:5] for r in runs if r[0] == "main"}
    want = {(m, n, s, 2000) for m in PAPER_MIXERS for n in (4, 8, 16, 24) for s in (42, 123, 999)}
    want |= {(m, n, 42, 1000) for m in PAPER_MIXERS for n in (32, 48)}
    assert main == want
    ablation = {(r[1], r[2], r[5]) for r in runs if r[0] == "ablation"}
    assert {o for *_, o in ablation} == {(), ("mixers.vla.penalty_update=fixed",),
                                         ("mixers.vla.normalize_write_direction=false",),
                                         ("mixers.vla.normalize_key=false",)}
    assert {r[2] for r in runs if r[0] == "ablation"} == {8, 16, 32}
    ood = {(r[1], r[2], r[4], r[5]) for r in runs if r[0] == "ood"}
    assert ood == {(m, n, 1000, ("task.ood_key_range=[64,127]",)) for m in PAPER_MIXERS for n in (8, 16, 24)}
    assert set(_dry_run("seed42", "vla")) == {"main_vla_s42", "main_vla_overload"}
    bad = subprocess.run(["bash", "tools/gpu_mqar_paper.sh", "/tmp/out", "everything"], cwd=REPO,
                         env={**os.environ, "DRY_RUN": "1"}, capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown part 'everything'" in bad.stderr


def test_copy_paper_config_is_copy_without_short_convs():
    cfg, task = load_eval_config("configs/eval/copy_vla_paper.yaml")
    base, base_task = load_eval_config("configs/eval/copy.yaml")
    assert cfg.model == base.model and cfg.optim == base.optim and task == base_task
    assert (cfg.train.steps, cfg.train.batch_size) == (base.train.steps, base.train.batch_size)
    for name in PAPER_MIXERS:
        assert _conv_params(cfg, name) == [], name
    assert _conv_params(base, "vla")  # the base copy config keeps them (the check can fail)


def test_gpu_script_long_context_and_copy_parts():
    """Fig. 6: n = 8 at T = 64 ... 512, one labelled job per mixer and T; the copy task: one job per mixer on
    the no-short-conv copy config. Every command parses with its CLI's parser and its config loads."""
    from mixerlab.eval import mqar

    jobs = _dry_run("longctx,copy")
    lengths = {}
    for name, argv in jobs.items():
        if name.startswith("longctx_"):
            assert argv[:3] == ["python3", "-m", "mixerlab.eval.mqar"], name
            args = mqar.sweep_parser().parse_args(argv[3:])
            assert (args.n, args.seeds, args.config) == ("8", "42", PAPER)
            (t,) = [o.split("=")[1] for o in args.overrides if o.startswith("task.seq_len=")]
            assert args.label == f"{args.mixers}, T = {t}"
            _, task = load_eval_config(args.config, args.overrides)
            lengths.setdefault(args.mixers, set()).add(task.seq_len)
        else:
            assert name.startswith("copy_") and argv[:3] == ["python3", "-m", "mixerlab.eval.copy_task"], name
            assert argv[argv.index("--config") + 1] == "configs/eval/copy_vla_paper.yaml"
            assert argv[argv.index("--mixers") + 1] == name[len("copy_"):]
    assert lengths == {m: {64, 128, 256, 512} for m in PAPER_MIXERS}
    assert sorted(n for n in jobs if n.startswith("copy_")) == sorted(f"copy_{m}" for m in PAPER_MIXERS)


def test_muir_table7_script_configurations_load():
    """tools/gpu_muir_mqar.sh: every gate configuration's overrides give a valid config (ranks agree with the
    gamma variant), the two seed lists split as asked, and the labels name distinct rows."""
    from mixerlab.eval import mqar

    done = subprocess.run(["bash", "tools/gpu_muir_mqar.sh", "/tmp/out", "0,1", "2"], cwd=REPO,
                          env={**os.environ, "DRY_RUN": "1"}, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    labels, seeds, gammas = set(), {}, {}
    for line in done.stdout.splitlines():
        name, command = line.split(":", 1)
        args = mqar.sweep_parser().parse_args(shlex.split(command)[3:])
        cfg, task = load_eval_config(args.config, args.overrides)
        assert (task.seq_len, task.num_kv_pairs) == (256, 16)
        opts = cfg.mixer_options(args.mixers)
        if args.mixers == "muir":
            gammas[name[:-2]] = (opts.gamma, tuple(opts.ranks))
        labels.add(args.label)
        seeds.setdefault(name[:-2], []).append(args.seeds)
    assert len(labels) == 5 and all(v == ["0,1", "2"] for v in seeds.values())
    assert gammas == {"muir_rb1": ("none", (64, 1, 64, 64, 0)), "muir_rb4": ("none", (64, 4, 64, 64, 0)),
                      "muir_static": ("static", (64, 4, 64, 4, 0)), "muir_dynamic": ("dynamic", (64, 4, 64, 4, 8))}
