#!/usr/bin/env bash
# `make demo`: bring the local stack up and run the main job on it: the example workload
# once undisturbed, then again with a real engine crash (the leader vLLM engine SIGKILLed
# at step 2) and a real sandbox crash (the container killed at step 4), and compare the
# two runs' token and environment hashes. Then a group of four trajectories forked from one
# set-up sandbox, and a branch of one of them from its step 2. Then the Harbor tasks of
# examples/tasks with their oracle (and a sandbox crash), nop, and a group. Then a short training run,
# undisturbed and with faults, whose final weights must be identical. Last, the multi-action
# task family trained with its defaults: its learning curve, train and held-out.
set -euo pipefail
cd "$(dirname "$0")/.."
BELAYER=.venv/bin/belayer
WORKLOAD=examples/workloads/build-and-serve.yaml
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

$BELAYER up
$BELAYER status
echo
echo "== 1/7: $WORKLOAD, no faults (the reference)"
$BELAYER run "$WORKLOAD" --json > "$out/reference.json"
echo "== 2/7: $WORKLOAD with an engine crash at step 2 and a sandbox crash at step 4"
$BELAYER run "$WORKLOAD" --chaos "engine-crash@step=2:build-and-serve,sandbox-crash@step=4:build-and-serve" \
  --json > "$out/chaos.json"
.venv/bin/python - "$out/reference.json" "$out/chaos.json" <<'PY'
import json, sys

reference, chaos = (json.load(open(p)) for p in sys.argv[1:3])
by_task = {t["task"]: t for t in reference["trajectories"]}
print(f"\n{'task':18} {'status':10} {'recoveries':>10}  tokens identical  env identical")
ok = True
for t in chaos["trajectories"]:
    ref = by_task[t["task"]]
    same_tokens = t["token_sha256"] == ref["token_sha256"]
    same_env = t["env_sha256"] == ref["env_sha256"]
    ok &= same_tokens and same_env and t["status"] == ref["status"] == "completed"
    print(f"{t['task']:18} {t['status']:10} {len(t['recoveries']):>10}  {str(same_tokens):16} {same_env}")
print()
faults = chaos.get("faults", [])
injected = [f for f in faults if f.get("at") is not None]
ok &= len(injected) == 2
for fault in faults:
    took = f"{fault['recovery_s']:.2f}s" if fault.get("recovery_s") is not None else "-"
    extra = f" (node ready again in {fault['node_ready_s'] * 1000:.0f} ms)" if fault.get("node_ready_s") else ""
    print(f"fault {fault['kind']:13} at step {fault['at']}: recovered by {fault['recovered_by']}, "
          f"trajectory moving again after {took}{extra}")
print(f"\nwall time: {reference['wall_s']:.1f}s undisturbed, {chaos['wall_s']:.1f}s with faults")
print("RESULT:", "every trajectory survived both failures with identical hashes" if ok
      else "FAILED: a fault was not injected or a hash differs; see above")
sys.exit(0 if ok else 1)
PY

# Groups: one sandbox set up, four forked from it; then one member branched after step 2
# with its own seed, which must replay its last step exactly.
GROUP_WORKLOAD=examples/workloads/group-setup.yaml
echo
echo "== 3/7: $GROUP_WORKLOAD as a group of 4 forked from one set-up sandbox, then a branch"
$BELAYER run "$GROUP_WORKLOAD" -n 4 --keep-checkpoints --json > "$out/group.json"
member=$(.venv/bin/python -c 'import json, sys; print(json.load(open(sys.argv[1]))["trajectories"][1]["id"])' \
  "$out/group.json")
$BELAYER fork "$member" --at-step 2 --seed 0 --json > "$out/branch.json"
.venv/bin/python - "$out/group.json" "$out/branch.json" <<'PY'
import json, sys

group, branch = (json.load(open(p)) for p in sys.argv[1:3])
(record,) = group["groups"]
members = group["trajectories"]
print(f"\ngroup of {record['size']}: {record['forked']} sandboxes forked, ready {record['ready_s']:.1f}s after the "
      f"group started (setup {record['setup_s']:.1f}s, checkpoint {record['checkpoint_s']:.1f}s, "
      f"forks {record['fork_s']:.1f}s); {group['wall_s']:.1f}s for the whole group")
(b,) = branch["trajectories"]
(start,) = b["recoveries"]
same = (b["token_sha256"], b["env_sha256"]) == (members[1]["token_sha256"], members[1]["env_sha256"])
print(f"branch {b['id']}: sandbox from {start['source']} + {start['replayed_steps']} steps replayed; "
      f"tokens and files {'identical to' if same else 'DIFFERENT from'} {members[1]['id']}'s")
ok = record["forked"] == 4 and all(m["status"] == "completed" for m in members) and same
print("GROUPS:", "forked, completed, and the branch replayed its parent exactly" if ok else "FAILED: see above")
sys.exit(0 if ok else 1)
PY

# Harbor tasks: the shipped dataset run with each task's reference solution (the oracle
# agent) and the sandbox of one killed after the oracle's action, then with nothing done
# (nop: every sound task scores 0), then one task as a group of 4 forked from one sandbox.
HARBOR=examples/tasks
echo
echo "== 4/7: the Harbor dataset $HARBOR: oracle with a sandbox crash at step 1, nop, a group of 4"
$BELAYER run "$HARBOR" --agent oracle --chaos "sandbox-crash@step=1" --json > "$out/harbor-oracle.json"
$BELAYER run "$HARBOR" --agent nop --json > "$out/harbor-nop.json"
$BELAYER run "$HARBOR/http-inventory-api" --agent oracle -n 4 --json > "$out/harbor-group.json"
.venv/bin/python - "$out/harbor-oracle.json" "$out/harbor-nop.json" "$out/harbor-group.json" <<'PY'
import json, sys

oracle, nop, group = (json.load(open(p)) for p in sys.argv[1:4])
nop_reward = {t["task"]: t["reward"] for t in nop["trajectories"]}
print(f"\n{'task':24} {'oracle':>6} {'nop':>5}  recoveries")
ok = True
for t in oracle["trajectories"]:
    ok &= t["status"] == "completed" and t["reward"] == 1.0 and nop_reward[t["task"]] == 0.0
    print(f"{t['task']:24} {t['reward']:>6} {nop_reward[t['task']]:>5}  {len(t['recoveries'])}")
faults = oracle.get("faults", [])
for fault in faults:
    print(f"fault {fault['kind']} at step {fault['at']} on {fault['trajectory']}: recovered by "
          f"{fault['recovered_by']} in {fault['recovery_s']:.2f}s")
(record,) = group["groups"]
members = group["trajectories"]
print(f"group of {record['size']} on {record['task']}: {record['forked']} sandboxes forked from one, "
      f"rewards {[m['reward'] for m in members]}")
ok &= len(faults) == 1 and faults[0]["recovered_by"] == "restore+replay"
ok &= record["forked"] == 4 and all(m["reward"] == 1.0 for m in members)
print("HARBOR:", "every oracle scored 1 through the crash, every nop 0, the group forked" if ok
      else "FAILED: see above")
sys.exit(0 if ok else 1)
PY

# Training: a few GRPO iterations of the warm-started model on the learn tasks (published
# into the running engines), undisturbed and then with an engine crash, a sandbox crash
# and the trainer's death; the two runs must end on the same weights.
TRAIN_WORKLOAD=examples/workloads/learn.yaml
TRAIN_ARGS=(--iterations 3 --tasks-per-iteration 4 --group-size 2 --seed 5 --no-heldout --json)
TRAIN_FAULTS="engine-crash@iteration=0,sandbox-crash@iteration=1,trainer-crash@iteration=1"
echo
echo "== 5/7: belayer train $TRAIN_WORKLOAD, 3 iterations, no faults (the reference)"
$BELAYER train "$TRAIN_WORKLOAD" "${TRAIN_ARGS[@]}" > "$out/train-reference.json"
echo "== 6/7: the same run with $TRAIN_FAULTS"
$BELAYER train "$TRAIN_WORKLOAD" "${TRAIN_ARGS[@]}" --chaos "$TRAIN_FAULTS" > "$out/train-chaos.json"
.venv/bin/python - "$out/train-reference.json" "$out/train-chaos.json" <<'PY'
import json, sys

reference, chaos = (json.load(open(p)) for p in sys.argv[1:3])
print(f"\n{'iteration':>9}  {'reward':>6} {'with faults':>11}  weights sha256 (reference / with faults)")
for ref, hit in zip(reference["iterations"], chaos["iterations"], strict=True):
    print(f"{ref['iteration']:>9}  {ref['mean_reward']:>6.3f} {hit['mean_reward']:>11.3f}  "
          f"{ref['weights_sha256'][:12]} / {hit['weights_sha256'][:12]}")
for fault in chaos.get("faults", []):
    took = f" after {fault['recovery_s']:.1f}s" if fault.get("recovery_s") is not None else ""
    print(f"fault {fault['kind']:13} in iteration {fault['at']}: recovered by {fault['recovered_by']}{took}")
injected = [f for f in chaos.get("faults", []) if not str(f["recovered_by"]).startswith("not injected")]
same = reference["final_weights_sha256"] == chaos["final_weights_sha256"]
first, last = reference["iterations"][0]["mean_reward"], reference["iterations"][-1]["mean_reward"]
ok = same and len(injected) == len(chaos.get("faults", [])) == 3
print(f"\nTRAINING: final weights {'identical' if same else 'DIFFERENT'} with {len(injected)} faults injected "
      f"(sha256 {chaos['final_weights_sha256'][:16]}); mean reward moved {first:.3f} -> {last:.3f} "
      f"({last - first:+.3f}) in {len(reference['iterations'])} iterations")
sys.exit(0 if ok else 1)
PY
# Learning: the multi-action task family trained with its workload's defaults (the curve the
# README reports): each trajectory must list ./in, list the folder it saw, and compute from
# the file it saw. The mean reward over the first 4 and the last 4 iterations, train and
# held-out (tasks whose names no train task with their prompt uses).
MULTISTEP=examples/workloads/learn-multistep.yaml
echo
echo "== 7/7: belayer train $MULTISTEP with its defaults (the model learns a three-action task)"
$BELAYER train "$MULTISTEP" --json > "$out/multistep.json"
.venv/bin/python - "$out/multistep.json" <<'PY'
import json, sys

report = json.load(open(sys.argv[1]))
iterations = report["iterations"]


def mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else float("nan")


print(f"\n{'iterations':>10}  {'train':>5}  {'held-out':>8}  {'actions':>7}  {'at':>6}")
for start in range(0, len(iterations), 4):
    block = iterations[start : start + 4]
    print(f"{block[0]['iteration']:>4}-{block[-1]['iteration']:<5}  {mean(i['mean_reward'] for i in block):>5.2f}  "
          f"{mean(i['heldout_reward'] for i in block):>8.2f}  "
          f"{mean(i['mean_actions_per_trajectory'] for i in block):>7.1f}  {block[-1]['elapsed_s']:>5.0f}s")
first, last = iterations[:4], iterations[-4:]
train = mean(i["mean_reward"] for i in first), mean(i["mean_reward"] for i in last)
heldout = mean(i["heldout_reward"] for i in first), mean(i["heldout_reward"] for i in last)
print(f"\nLEARNING: train {train[0]:.2f} -> {train[1]:.2f}, held-out {heldout[0]:.2f} -> {heldout[1]:.2f} "
      f"(first 4 -> last 4 iterations) in {iterations[-1]['elapsed_s']:.0f}s; "
      f"{report['mean_actions_per_trajectory']:.1f} actions per trajectory "
      f"(the goal: at most 0.5 over the first 4, at least 0.8 over the last 4)")
sys.exit(0 if report["status"] == "completed" else 1)
PY
echo
echo "The stack keeps running: Temporal UI on http://127.0.0.1:8233. Stop it with 'make down'."
