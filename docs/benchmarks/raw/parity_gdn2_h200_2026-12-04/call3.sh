set -u
source tools/gpu_env.sh parity
export TRITON_CACHE_AUTOTUNING=1
O=/tmp/pgdn2; mkdir -p $O; T0=$(date +%s)
SETS="--set mixers.gdn2.gate_act=sigmoid --set model.norm_eps=1e-5 --set mixers.gdn2.decay_rank=64 --set mixers.gdn2.gate_rank=64"
run() {  # name timeout args...: parity_torch under faulthandler (a stack every 100 s while it runs)
  local name=$1 t=$2; shift 2
  timeout $t python3 -c "
import faulthandler, runpy, sys
faulthandler.dump_traceback_later(100, repeat=True, file=sys.stderr)
sys.argv = ['tools/parity_torch.py'] + sys.argv[1:]
runpy.run_path('tools/parity_torch.py', run_name='__main__')" "$@" 2>&1 | grep -v -i warn | grep -v Loading > $O/$name.log
  echo "rc ${PIPESTATUS[0]} at $(( $(date +%s) - T0 )) s" >> $O/$name.log
}
run torch 560 --mixer gdn2 --steps 300 --runs torch_f32,torch_autocast --torch-autotune 1 --out /tmp/pA $SETS &
sleep 15
run ours 545 --mixer gdn2 --steps 300 --runs ours_f32,ours_bf16 --out /tmp/pB $SETS &
wait
for d in pA pB; do cp /tmp/$d/parity.json $O/parity_$d.json 2>/dev/null || cp /tmp/$d/parity_partial.json $O/parity_partial_$d.json; done
grep -v "^  File\|^    " $O/torch.log | tail -30; tail -8 $O/ours.log
tar czf $OUT/pgdn2.tgz -C /tmp pgdn2
