#!/usr/bin/env bash
# Spot interruptions end to end, on one machine: 3 agents (one worker each) on an embedded etcd train
# examples/train_ddp.py --deterministic; then
#   1. node C gets a preemption notice (SIGTERM to its agent): the group agrees on a step, commits it,
#      C leaves with exit 0 and A+B go on from that very step (0 steps lost);
#   2. node B is lost without notice (SIGKILL to its agent and worker): A goes back to the last periodic
#      checkpoint and re-trains the steps after it;
#   3. node C comes back: the group grows to 2 at an agreed, committed step (0 steps lost);
#   4. the whole job is preempted (SIGTERM to A and C): both commit the same step and exit 0.
# Then it prints the timeline from events.jsonl and compares the final weights with an uninterrupted
# single-process run to the same step: PASS when every model and optimizer tensor is bit-identical
# (--deterministic makes the world-size changes bit-exact), FAIL (exit 1) otherwise.
#
# Run (from the repository root, with spotrun installed or PYTHONPATH=.):
#   bash examples/spot_demo.sh                    # work files in a temporary directory
#   OUT=runs/demo STEP_TIME=0.05 bash examples/spot_demo.sh
# Takes ~1-2 min on a quiet 2-core machine (most of it starting Python + torch for each new worker group).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
PY="${PYTHON:-python}"
OUT="${OUT:-$(mktemp -d -t spot-demo.XXXXXX)}"
STEP_TIME="${STEP_TIME:-0.05}"
TIMEOUT="${TIMEOUT:-300}"          # seconds any one phase may take
mkdir -p "$OUT"
rm -rf "$OUT/ckpt" "$OUT/ref" "$OUT"/*.jsonl "$OUT"/*.log
export PYTHONUNBUFFERED=1 LOGLEVEL="${LOGLEVEL:-WARNING}"

pids=()     # every process this script started (agents run in their own session: kill -- -PID is the node)
cleanup() {
  for pid in "${pids[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap cleanup EXIT

say() { printf '\n== %s\n' "$*"; }
report() { "$PY" examples/spot_report.py "$@"; }

say "embedded etcd"
setsid "$PY" -m elastic.etcd_server ${ETCD_PORT:+--port "$ETCD_PORT"} > "$OUT/etcd.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 300); do  # up to 60 s: etcd answers /health
  grep -q "etcd endpoint:" "$OUT/etcd.log" && break
  kill -0 "${pids[0]}" 2>/dev/null || break
  sleep 0.2
done
endpoint="$(sed -n 's/^etcd endpoint: //p' "$OUT/etcd.log" | head -n1)"
[ -n "$endpoint" ] || { echo "etcd did not start:"; cat "$OUT/etcd.log"; exit 1; }
echo "etcd at $endpoint; work files in $OUT"

train() {  # train STEPS CKPT_DIR: the example's command line (the reference run uses the same one)
  echo examples/train_ddp.py --steps "$1" --ckpt-dir "$2" --deterministic --global-batch 48 --shards 6 \
    --ckpt-every 40 --preempt-sync-every 2 --log-every 100000
}
declare -A agent_pid
agent() {  # agent NAME: one node (one worker), in its own session so it can be killed as a whole
  setsid "$PY" -m elastic.cli --nnodes 1:3 --nproc-per-node 1 --rdzv-endpoint "$endpoint" --rdzv-id demo \
    --rdzv-conf lease_ttl=2,last_call_timeout=1,join_timeout=120 --max-restarts 3 --monitor-interval 0.1 \
    --stop-grace 2 --log-dir "$OUT/logs-$1" --events-file "$OUT/events.jsonl" \
    $(train 100000 "$OUT/ckpt") --step-time "$STEP_TIME" --progress-file "$OUT/progress.jsonl" > "$OUT/agent-$1.log" 2>&1 &
  pids+=($!)
  agent_pid[$1]=$!
  echo "node $1: agent pid $!"
}
wait_world() {  # wait_world WORLD [MIN_STEP [SINCE]]: until WORLD ranks train at world size WORLD; prints the step
  report wait --progress "$OUT/progress.jsonl" --world "$1" --min-step "${2:-0}" --since "${3:-0}" --timeout "$TIMEOUT"
}
now() { date +%s.%N; }
reap() {  # reap NAME: wait for node NAME's agent and say how it exited
  local rc=0; wait "${agent_pid[$1]}" || rc=$?
  echo "node $1 exited with status $rc"
}

say "3 nodes start"
agent A; agent B; agent C
step="$(wait_world 3)"; echo "training at world size 3 (step $step)"

say "node C is preempted (SIGTERM to its agent)"
t="$(now)"; kill -TERM "${agent_pid[C]}"
reap C
step="$(wait_world 2 0 "$t")"; echo "A+B train at world size 2 (step $step)"
# Past the next periodic checkpoint, so the crash below has something to go back to.
step="$(wait_world 2 $(( (step / 40 + 1) * 40 + 5 )))"

say "node B is lost without notice (SIGKILL to its agent and worker)"
t="$(now)"; kill -KILL -- "-${agent_pid[B]}"
reap B
step="$(wait_world 1 0 "$t")"; echo "A trains alone (step $step)"

say "node C comes back"
first_c="${agent_pid[C]}"
t="$(now)"; agent C
step="$(wait_world 2 0 "$t")"; echo "A+C train at world size 2 (step $step)"
step="$(wait_world 2 $((step + 10)))"

say "the whole job is preempted (SIGTERM to A and C)"
kill -TERM "${agent_pid[A]}" "${agent_pid[C]}"
reap A; reap C
final="$("$PY" -c 'import sys; from elastic.events import read_events
leaves = [e for e in read_events(sys.argv[1]) if e["event"] == "planned_leave" and e.get("saved")]
print(leaves[-1]["step"] if leaves else "")' "$OUT/events.jsonl")"
[ -n "$final" ] || { echo "FAIL: no step was committed at the final preemption"; exit 1; }

say "timeline (events.jsonl + progress)"
report timeline --events "$OUT/events.jsonl" --progress "$OUT/progress.jsonl" \
  --name "${agent_pid[A]}=A" --name "${agent_pid[B]}=B" --name "$first_c=C" --name "${agent_pid[C]}=C-again"

say "uninterrupted reference: one process, $final steps"
"$PY" $(train "$final" "$OUT/ref") > "$OUT/reference.log" 2>&1
report compare "$OUT/ckpt" "$OUT/ref"
