#!/usr/bin/env bash
# The real-GPU check for a session that is lent the device machine (one NVIDIA GPU, the driver's files
# read-only under /usr/local/nvidia, no network). Run from the repository root there, with the venv,
# a runc binary and the test rootfs carried over:
#   run(command="bash integration/device_check.sh", carry=[".venv", ".cache/rootfs", "build/runc"])
# after `mkdir -p build && cp /usr/sbin/runc build/runc && make venv relay` here (and one test run,
# which builds .cache/rootfs). It prints `gpuhook info`, `gpuhook doctor`, then starts a real busybox
# container under runc with NVIDIA_VISIBLE_DEVICES=0 five times with the hook in-process, five
# times through a gpuhookd and five times with gpuhook-relay (.venv/bin) through that gpuhookd, and
# shows what it sees (GPU 0 is exclusive: each run takes and gives back its lease; `gpuhook status`
# after the runs must show no holder). Where GPU 0 is in MIG mode already, five runs ask for an
# instance of its smallest profile on demand (made at the start, destroyed at poststop); then five runs
# with GPU 0 under `sharing: mps` (gpuhook's MPS daemon up for each, told its limits, quit after); figures
# go to $OUT.
set -u
OUT=${OUT:-/tmp/gpuhook-device-check}
# Overridable to rehearse the script on a simulated host: DRIVER_ROOT=DIR DEV_ROOT=DIR PROC_ROOT=DIR.
DRIVER_ROOT=${DRIVER_ROOT:-/usr/local/nvidia}
DEV_ROOT=${DEV_ROOT:-/}
PROC_ROOT=${PROC_ROOT:-/}
mkdir -p "$OUT"
PY=$PWD/.venv/bin/python
RUNC=$PWD/build/runc
ROOTFS_SRC=$(ls -d "$PWD"/.cache/rootfs/*/ 2>/dev/null | head -n 1)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

cat > "$WORK/gpuhook.yaml" <<CFG
driver_root: $DRIVER_ROOT
dev_root: $DEV_ROOT
proc_root: $PROC_ROOT
log_file: $OUT/gpuhook.log
log_level: debug
cache_dir: $WORK/cache
state_dir: $WORK/state
gpus:
  - device: "0"
    sharing: exclusive
CFG

echo "== gpuhook info"; "$PY" -I -m gpuhook --config "$WORK/gpuhook.yaml" info 2>&1 | tee "$OUT/info.txt"
echo "== gpuhook doctor"; "$PY" -I -m gpuhook --config "$WORK/gpuhook.yaml" doctor 2>&1 | tee "$OUT/doctor.txt"
echo "== nvidia-smi on the host"; ("$DRIVER_ROOT/bin/nvidia-smi" -L 2>/dev/null || "$DRIVER_ROOT/usr/bin/nvidia-smi" -L 2>/dev/null || nvidia-smi -L) 2>&1 | tee "$OUT/smi.txt"
echo "== NVIDIA's names on a real driver: nvidia-ctk cdi list, gpuhook config show"
GPUHOOK_CONFIG="$WORK/gpuhook.yaml" "$(dirname "$PY")/nvidia-ctk" cdi list 2>&1 | tee "$OUT/nvctk-cdi-list.txt"
"$PY" -I -m gpuhook --config "$WORK/gpuhook.yaml" config show 2>&1 | tee "$OUT/config-show.txt"

if [ -z "$ROOTFS_SRC" ] || [ ! -x "$RUNC" ]; then
  echo "no rootfs or runc carried over; skipping the container part" | tee "$OUT/container.txt"
  exit 0
fi
mkdir -p "$WORK/bundle"
cp -a "$ROOTFS_SRC" "$WORK/bundle/rootfs"
write_spec() {  # $1: the hook's --daemon-socket (none: in-process); $2: "relay" for gpuhook-relay; $3: devices
"$PY" - "$WORK" "$PY" "$1" "${2:-}" "${3:-0}" <<'PYEOF'
import json, sys
from integration.engines import default_spec
work, py, socket, relay, devices = sys.argv[1:6]
argv = ["--config", f"{work}/gpuhook.yaml", "--daemon-socket", socket, "prestart"]
program = [py.removesuffix("python") + "gpuhook-relay"] if relay else [py, "-I", "-m", "gpuhook"]
hook = {"path": program[0], "args": program + argv, "env": ["PATH=/usr/sbin:/usr/bin:/sbin:/bin"]}
script = ("ls -l /dev/nvidia*; devopen /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm; "
          "dltest -p libcuda.so.1 libnvidia-ml.so.1; nvidia-smi -L; grep Modify /proc/driver/nvidia/params || echo no /proc/driver/nvidia; "
          "ls -l /tmp/nvidia-mps 2>&1 | head -n 8")
spec = default_spec("rootfs", ["/bin/sh", "-c", script],
                    ["PATH=/usr/local/bin:/usr/bin:/bin", f"NVIDIA_VISIBLE_DEVICES={devices}",
                     "NVIDIA_DRIVER_CAPABILITIES=compute,utility"],
                    hooks={"prestart": [hook], "poststop": [{**hook, "args": hook["args"][:-1] + ["poststop"]}]},
                    annotations={})
json.dump(spec, open(f"{work}/bundle/config.json", "w"))
PYEOF
}
runs() {  # $1: label
  for i in 1 2 3 4 5; do
    start=$(date +%s%N)
    "$RUNC" run --bundle "$WORK/bundle" "gpuhook-check-$1-$i" > "$OUT/container-$1-$i.txt" 2>&1
    echo "$1 run $i: rc=$? $(( ($(date +%s%N) - start) / 1000000 )) ms" | tee -a "$OUT/timings.txt"
  done
  cat "$OUT/container-$1-1.txt"
}
echo "== runc run with the hook, in-process"
write_spec none && runs hook
echo "== runc run with the hook, through gpuhookd"
mkdir -m 0700 "$WORK/gpuhookd"
"$PY" -I -m gpuhook --config "$WORK/gpuhook.yaml" daemon --socket "$WORK/gpuhookd/gpuhookd.sock" > "$OUT/gpuhookd.txt" 2>&1 &
DAEMON=$!
for _ in $(seq 100); do [ -S "$WORK/gpuhookd/gpuhookd.sock" ] && break; sleep 0.1; done
sleep 1  # the spare workers prepare
write_spec "$WORK/gpuhookd/gpuhookd.sock" && runs gpuhookd
echo "== runc run with gpuhook-relay, through gpuhookd"
write_spec "$WORK/gpuhookd/gpuhookd.sock" relay && runs relay
echo "== the lease ledger after the runs (every holder exited: gpuhookd released them all)"
"$PY" -I -m gpuhook --config "$WORK/gpuhook.yaml" status 2>&1 | tee "$OUT/status.txt"
kill "$DAEMON"; wait "$DAEMON" 2>/dev/null
grep -c '"served_by": "gpuhookd"' "$OUT/gpuhook.log" | sed 's/^/log events served by gpuhookd: /' | tee -a "$OUT/timings.txt"
# load_kmods: a driver whose nodes exist makes gpuhook run no nvidia-modprobe (0 expected)
grep -c '"event": "node_created"' "$OUT/gpuhook.log" | sed 's/^/nodes made by nvidia-modprobe: /' | tee -a "$OUT/timings.txt"
grep '"event": "request_served"' "$OUT/gpuhook.log" | tail -n 1 | tee -a "$OUT/timings.txt"

echo "== MIG on demand (only where GPU 0 is already in MIG mode: gpuhook never changes MIG mode)"
MIG_MODE=$("$DRIVER_ROOT/bin/nvidia-smi" -i 0 --query-gpu=mig.mode.current --format=csv,noheader 2>/dev/null \
           || nvidia-smi -i 0 --query-gpu=mig.mode.current --format=csv,noheader 2>/dev/null)
if [ "$MIG_MODE" = "Enabled" ]; then
  PROFILE=$("$PY" -I -m gpuhook --config "$WORK/gpuhook.yaml" info --json 2>/dev/null | "$PY" -c \
            'import json, sys; print(json.load(sys.stdin)["gpus"][0]["mig_profiles"][0]["name"])')
  write_spec none "" "0,mig=$PROFILE" && runs mig
  echo "== NVML's MIG devices after the runs (gpuhook's are destroyed by poststop)"
  (nvidia-smi -L 2>&1; "$PY" -I -m gpuhook --config "$WORK/gpuhook.yaml" status 2>&1) | tee "$OUT/mig.txt"
  grep -E '"event": "mig_(created|destroyed)"' "$OUT/gpuhook.log" | tee -a "$OUT/mig.txt"
else
  echo "GPU 0's MIG mode: ${MIG_MODE:-unknown}; MIG on demand not exercised" | tee "$OUT/mig.txt"
fi

echo "== MPS: GPU 0 under sharing: mps (replicas 2): gpuhook's daemon comes up for each run and quits after it"
sed 's/sharing: exclusive/sharing: mps\n    replicas: 2/' "$WORK/gpuhook.yaml" > "$WORK/gpuhook-mps.yaml"
write_spec none "" 0 && sed -i "s#$WORK/gpuhook.yaml#$WORK/gpuhook-mps.yaml#g" "$WORK/bundle/config.json" && runs mps
"$PY" -I -m gpuhook --config "$WORK/gpuhook-mps.yaml" status 2>&1 | tee "$OUT/mps.txt"
grep -E '"event": "mps_daemon' "$OUT/gpuhook.log" | tee -a "$OUT/mps.txt"
cat "$WORK"/state/mps/*/log/control.log 2>/dev/null | tail -n 20 | tee -a "$OUT/mps.txt"
pgrep -a nvidia-cuda-mps || echo "no MPS daemon left running" | tee -a "$OUT/mps.txt"

echo "== the metrics text (gpuhook status --prometheus): GPUs, holders, and NVML's process lists on a real driver"
"$PY" -I -m gpuhook --config "$WORK/gpuhook.yaml" status --prometheus 2>&1 | grep -v '^#' | tee "$OUT/metrics.txt"
