# GPU machine (one H100 80GB this time, JAX 0.11.2, torch 2.11, fla-core 0.6.0 from .whl/), repo root, carry [".whl"].
SETS="--set mixers.gdn2.gate_act=sigmoid --set model.norm_eps=1e-5 --set mixers.gdn2.decay_rank=64 --set mixers.gdn2.gate_rank=64"
# call 1: the three processes of the pair; ours and seed1 finished (parity_ours.json, parity_seed1.json, 435 s in
# all), torch's process ran out of GPU memory beside the two JAX processes (38 and 35 GiB)
PARITY_TIMEOUT=510 bash tools/h200_parity.sh pair gdn2 $OUT/pair_gdn2 $SETS
# call 2, the same warm machine: torch's side alone (parity_torch.json, 335 s)
python3 tools/parity_torch.py --mixer gdn2 --steps 300 --out /tmp/pair_torch --runs torch_f32,torch_autocast \
    --torch-autotune 1 --torch-f32-dots tf32x3 $SETS
# here: the three joined (parity.json, docs/images/parity_gdn2_h100.png)
python tools/parity_torch.py --mixer gdn2 --steps 300 --out OUT --merge parity_torch.json parity_ours.json parity_seed1.json
