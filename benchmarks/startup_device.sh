# One device call: per-call op cost, then start-up from an on-disk Llama-3-8B checkpoint, baseline
# tree ($BASE, default the working tree) and this tree, cold and warm, in the same call.
# usage: bash benchmarks/startup_device.sh THIS_TREE [BASE_TREE]
set -u
THIS=$1; BASE=${2:-$PWD}
mkdir -p $OUT/logs/base $OUT/logs/new
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/summary.txt
PYTHONPATH=$THIS:/tmp/site timeout 30 python $THIS/benchmarks/op_dispatch.py --calls 1000 --out $OUT/logs 2>&1 | tee -a $OUT/summary.txt
run() {  # tree name
  echo "== $2" | tee -a $OUT/summary.txt
  KILN_STARTUP_LOG_DIR=$OUT/logs/$2 PYTHONPATH=$1:/tmp/site timeout ${3:-200} python $1/benchmarks/startup.py \
    --checkpoint llama3-8b --checkpoint-dir /tmp/ckpt --mode auto --cudagraph auto --out $OUT/logs/$2 \
    2> $OUT/logs/$2/err.txt | grep -v "^wrote\|^ *\[" | tee -a $OUT/summary.txt
  tail -2 $OUT/logs/$2/err.txt >> $OUT/summary.txt
}
run $BASE base 150
run $THIS new 95
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
