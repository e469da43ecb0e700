# One device call: start-up from an on-disk Llama-3-8B checkpoint, the baseline tree's kiln
# ($2, default the working tree) and this tree's ($1), cold and warm, each start's main-thread
# stack sampled with SAMPLE=1 (benchmarks/stack_sampler.py), then this tree's GPU tests of $TESTS.
# usage: [PYTHONPATH=<extra packages>] bash benchmarks/startup_device.sh THIS_TREE [BASE_TREE]
# EXTRA: more startup.py arguments (e.g. --then-batch 64,64), NEW_EXTRA: for this tree's starts only
# (e.g. --build background); BASE_ENV / NEW_ENV: environment settings (NAME=value ...) for one tree's
# starts only; DEADLINE: seconds since the script began
# by which the GPU tests must end (their timeout is what is left).
set -u
THIS=$1; BASE=${2:-$PWD}
mkdir -p $OUT/logs/base $OUT/logs/new
BASE_COPY=$(mktemp -d)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/summary.txt
# The baseline's kiln with this tree's benchmark scripts (the same timing code for both).
cp -r $BASE/kiln $BASE_COPY/kiln && cp -r $THIS/benchmarks $BASE_COPY/benchmarks
run() {  # tree name timeout [more startup.py arguments] [environment settings]
  echo "== $2 ${5:-}" | tee -a $OUT/summary.txt
  env ${5:-} KILN_STARTUP_LOG_DIR=$OUT/logs/$2 PYTHONPATH=$1${PYTHONPATH:+:$PYTHONPATH} timeout $3 python $1/benchmarks/startup.py \
    --checkpoint llama3-8b --checkpoint-dir ${CKPT:-/tmp/ckpt} --mode auto --cudagraph auto --out $OUT/logs/$2 \
    ${SAMPLE:+--sample-stacks $OUT/logs/$2} ${EXTRA:-} ${4:-} 2> $OUT/logs/$2/err.txt | grep -v "^wrote\|^ *\[" | tee -a $OUT/summary.txt
  tail -2 $OUT/logs/$2/err.txt >> $OUT/summary.txt
}
run $BASE_COPY base ${BASE_TIMEOUT:-120} "" "${BASE_ENV:-}"
run $THIS new ${NEW_TIMEOUT:-100} "${NEW_EXTRA:-}" "${NEW_ENV:-}"
[ -n "${DEADLINE:-}" ] && TEST_TIMEOUT=$((DEADLINE - SECONDS))
if [ -n "${TESTS:-}" ] && [ "${TEST_TIMEOUT:-45}" -gt 20 ]; then
  (cd $THIS && PYTHONPATH=$THIS${PYTHONPATH:+:$PYTHONPATH} timeout ${TEST_TIMEOUT:-45} python -m pytest -m gpu -q -p no:cacheprovider -rs $TESTS \
    > $OUT/logs/gpu_tests.txt 2>&1); tail -4 $OUT/logs/gpu_tests.txt | tee -a $OUT/summary.txt
fi
tar czf $OUT/logs.tgz -C $OUT logs && rm -rf $OUT/logs
