#!/usr/bin/env bash
# The GPU study (issue 11): the bench's policy comparison with a real model step on a CUDA GPU (ResNet-18
# forward/backward per step, see evaluation/jobproc.py --device cuda) and the agent reading NVML from the
# real driver, on a node of many cores. As root on a GPU node with a CUDA build of torch:
#
#     evaluation/gpu_study.sh OUT [adloader bench options...]
#
# Writes OUT/bench.{json,md}, OUT/catalog.toml (the catalogue it ran), OUT/dmon.log (nvidia-smi dmon,
# one line a second) and OUT/runs.tgz (every job's progress and the agents' logs).
#
# The catalogue: the packaged one with images twice as wide (4x the decode work per sample, nearer
# ImageNet's ~400x350 than 256 px) and min_step_s 0.01 instead of 0.03. Calibration makes the heaviest
# kind want all loader cores at any node size, so on 16 cores the default images give 7-13 ms steps,
# which the 0.03 s floor would clamp (and the demand with it) and a real model step would not fit in.
#
# cgroup v2: the script moves itself into a fresh group at the top (adl-study-PID), so the agent's group
# (which it must turn into a parent: it moves its processes to a leaf, DESIGN "cgroups") has no other
# processes and only the root above it. Removed at the end. The unified layout is the one with
# cgroup.controllers at /sys/fs/cgroup (a hybrid or legacy host has a tmpfs there): a v1 hierarchy's
# name is not looked for, since a joined cpu,cpuacct mount has no "cpu" one.
set -euo pipefail
usage="usage: evaluation/gpu_study.sh OUT [adloader bench options...]"
case "${1:-}" in
  -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  "") echo "$usage" >&2; exit 2 ;;
  -*) echo "$usage (OUT first, got option $1)" >&2; exit 2 ;;
esac
out=$1
shift
mkdir -p "$out"
here=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
v2=/sys/fs/cgroup
if [ "$(id -u)" = 0 ] && [ -f $v2/cgroup.controllers ]; then
    g=$v2/adl-study-$$      # this run's own: a group left by a run killed before its cleanup cannot block it
    mkdir -p "$g"
    echo $$ > "$g/cgroup.procs"
    trap 'echo $$ > '"$v2"'/cgroup.procs 2>/dev/null; rmdir '"$g"'/agent '"$g"'/adloader '"$g"' 2>/dev/null || true' EXIT
fi
"$py" - "$here/evaluation/catalog.toml" "$out/catalog.toml" <<'PY'
import re, sys
s = open(sys.argv[1]).read()
s = re.sub(r"(?m)^image_px = (\d+)", lambda m: f"image_px = {2 * int(m.group(1))}", s)
s = re.sub(r"(?m)^min_step_s = [0-9.]+", "min_step_s = 0.01", s)
open(sys.argv[2], "w").write(s)
PY
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/dmon.log" || true
nvidia-smi dmon -s u -d 1 >> "$out/dmon.log" 2>&1 &
dmon=$!
set +e
# in the background, so that a TERM (timeout, kill) reaches the bench and this script waits for its cleanup
# (every agent, job and cgroup it started) rather than exiting under it
(cd "$here" && exec "$py" -m agent bench --device cuda --catalog "$out/catalog.toml" --out "$out/bench" "$@") &
bench=$!
trap 'kill -TERM $bench 2>/dev/null' TERM INT
wait $bench
rc=$?
while kill -0 $bench 2>/dev/null; do wait $bench; rc=$?; done
kill $dmon 2>/dev/null
cp "$out/bench/bench.json" "$out/bench/bench.md" "$out/" 2>/dev/null
tar -czf "$out/runs.tgz" -C "$out/bench" runs 2>/dev/null
exit $rc
