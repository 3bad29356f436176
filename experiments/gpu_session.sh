#!/bin/bash
# The GPU runs of issue 34 (experiments/results/gpu-todo.md) in one call, most wanted first: a lent GPU's
# time is short, so each step runs only if the time it needs is left of BUDGET seconds, and every log and
# JSON is packed into $OUT/gpu.tar.gz after each step (what a call that runs out of time still returns).
#
#   bash experiments/gpu_session.sh               # on the GPU machine, from the repository root
#   SCALE=tiny bash experiments/gpu_session.sh    # the same commands on a tiny model (a CPU dry run)
#
# Needs DeepSpeed and baft's requirements importable (PYTHONPATH); `baft` is `python3 -m baft.cli`.
set -u
OUT=${OUT:-/tmp/gpu-session-out}
BUDGET=${BUDGET:-540}
WORK=/tmp/gpu-session
mkdir -p "$OUT" "$WORK"
export PYTHONUNBUFFERED=1
BAFT="python3 -m baft.cli"
T0=$(date +%s)

if [ "${SCALE:-}" = tiny ]; then
    BIG="--stages 1 --precision bf16 --d-model 64 --layers 2 --heads 2 --seq 32 --micro-batch-size 2"
    SMALL="$BIG"; KILL_MODEL="$BIG"; ROUNDS_AA=2; ROUNDS_PROFILE=2; ROUNDS_BIG=1; ROUNDS_SMALL=2; M_LOW=2; M_HIGH=4
else
    # 0.82B parameters, 11.5 GB of state (gpu.md section 4); and 2.2 GB of state (160M parameters)
    BIG="--stages 1 --precision bf16 --d-model 2048 --layers 16 --heads 16 --seq 512 --micro-batch-size 4"
    SMALL="--stages 1 --precision bf16 --d-model 1024 --layers 12 --heads 16 --seq 512 --micro-batch-size 4"
    KILL_MODEL="--stages 1 --precision bf16"  # the example's own size, as in gpu.md section 1
    ROUNDS_AA=10; ROUNDS_PROFILE=${ROUNDS_PROFILE:-6}; ROUNDS_BIG=3; ROUNDS_SMALL=${ROUNDS_SMALL:-6}; M_LOW=8; M_HIGH=32
fi
# baft at the planner's period beside baft/1 only on the 2.2 GB state: two baft policies' four slots of
# 11.5 GB each and sync-copy's buffer would not fit one 128 GiB host at once
POLICIES=none,none/1,sync-copy,baft/1
ONLY=${ONLY:-.}  # a regular expression: run only the steps whose names match

left() { echo $((BUDGET - ($(date +%s) - T0))); }

# step NAME SECONDS_NEEDED COMMAND...: run it with what is left as its limit, its output in NAME.log
step() {
    local name=$1 need=$2 t
    shift 2
    if ! [[ $name =~ $ONLY ]]; then
        return
    fi
    if [ "$(left)" -lt "$need" ]; then
        echo "SKIP $name: $(left) s left, it needs about $need"
        return
    fi
    t=$(date +%s)
    echo "== $name ($(date +%T), $(left) s left)"
    timeout --kill-after=5 $(($(left) - 10)) "$@" >"$WORK/$name.log" 2>&1
    echo "rc=$? $name took $(($(date +%s) - t)) s"
    # the GPU's clock-event counters (power capping slowed section 6's arms) after each step
    { echo "after $name"; nvidia-smi -q -d PERFORMANCE | grep -E "SW Power Capping|Thermal|Power Braking"; } \
        >>"$WORK/clocks.txt" 2>&1
    # the overhead table, pytest's verdict, the checksum rates, recovery reports, errors
    grep -v WARNING "$WORK/$name.log" | sed -n -e '/^policy /,/^$/p' -e '/^| arm/,/^$/p' -e '/chunk\|GB\/s\|agree\|passed\|failed/p' \
        -e '/kind\|T[0-4]\|resumed\|rror\|fork/p' | tail -n 30
    (cd "$WORK" && find . -type f \( -name '*.log' -o -name '*.json' -o -name '*.jsonl' -o -name '*.txt' -o -name '*.md' \) \
        -size -20M | tar -czf "$OUT/gpu.tar.gz" -T -)
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.max,pcie.link.width.max --format=csv
  python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)"
  lscpu | grep -E "Model name|^CPU\(s\)"; uname -r
  # the device's copy of the work tree may sit on an older .git: name the files' content, not HEAD
  echo "baft tree $(git ls-files -z baft experiments tests | xargs -0 sha1sum | sha1sum | cut -c1-12)"
  nvidia-smi -q -d CLOCK,PERFORMANCE | grep -E "Graphics|SM|Memory|Idle|Thermal|Power|Active"; } >"$WORK/machine.txt" 2>&1
cat "$WORK/machine.txt"

# the device checksums of tests/test_checksum.py first (of_many is new since section 7), then gpu-todo.md in order
step checksum 30 sh -c "python3 -m pytest -q -p no:cacheprovider tests/test_checksum.py && \
    python3 experiments/checksum_throughput.py --gpu-gib 4"
# gpu-todo.md item 1: baft/1 against none at m=32, and one profiled iteration (the host's work per snapshot)
step profile-big-m$M_HIGH 120 torchrun --nproc-per-node 1 experiments/snapshot_profile.py --out "$WORK/profile-big" \
    --rounds $ROUNDS_PROFILE --block 3 $BIG --micro-batches $M_HIGH
# then period 1 at m=32 resolved to a point (ten rounds: overhead_report's interval)
step compare-big-m$M_HIGH-aa 300 $BAFT compare $BIG --micro-batches $M_HIGH --policies none,none/1,baft/1 \
    --leftovers start --none-between --rounds $ROUNDS_AA --block 4 --out "$WORK/compare-big-m$M_HIGH-aa.json"
nvidia-smi -q -d PERFORMANCE | grep -A12 "Clocks Event Reasons" >"$WORK/clocks-after.txt" 2>&1
# item 2: the one-stage kill in place and warm (gpu.md section 7, cold in place: T1 4.83 s, T2 7.04 s); then
# items 3 and 4, the 11.5 GB state at m=8 and the 2.2 GB state; the kill test of section 5 as a regression
KILL="--example gpt $KILL_MODEL --iters 10 --policy baft --period 1 --max-restarts 1 \
    --fault rank=0,step=6,phase=backward"
step in-place 45 $BAFT train $KILL --in-place --run-dir "$WORK/in-place"
step warm-relaunch 45 $BAFT train $KILL --run-dir "$WORK/warm-relaunch"
step compare-big-m$M_LOW 90 $BAFT compare $BIG --micro-batches $M_LOW --policies $POLICIES --leftovers start \
    --none-between --rounds $((ROUNDS_BIG + 1)) --block 3 --out "$WORK/compare-big-m$M_LOW.json"
step compare-small-m$M_HIGH 60 $BAFT compare $SMALL --micro-batches $M_HIGH --policies $POLICIES,baft,dcp-async/10 \
    --leftovers start --none-between --rounds $ROUNDS_SMALL --block 3 --out "$WORK/compare-small-m$M_HIGH.json"
step compare-small-m$M_LOW 50 $BAFT compare $SMALL --micro-batches $M_LOW --policies $POLICIES,baft,dcp-async/10 \
    --leftovers start --none-between --rounds $ROUNDS_SMALL --block 3 --out "$WORK/compare-small-m$M_LOW.json"
step kill-gpu 60 python3 -m pytest -q -p no:cacheprovider tests/test_precision.py -k gpu-bf16
# the restore's weights check (checksums on the device, changed tensors read again from the slot) against the host
# copy it replaced (README: restored weights), on the device
step restored-weights 20 python3 experiments/restored_weights_cost.py --device cuda
# which call in the warm fork server's full import list starts a thread (DeepSpeed's NVML probe on the H200: the
# server imports torch alone there since), with the Python stack where it started
step warm-threads 40 env OMP_NUM_THREADS=1 PYTORCH_NVML_BASED_CUDA_CHECK=1 python3 experiments/warm_threads.py
echo "done in $(($(date +%s) - T0)) s"
