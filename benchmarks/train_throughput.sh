#!/usr/bin/env bash
# GPU-machine driver for benchmarks/train_throughput.py: installs speculators and its needs from the wheels in the
# ignored folder .whl/ (no index, no network, bytecode compiled) unless speculators is already importable, puts the
# run folder on a disk-backed filesystem, and kills any trainer left behind. From the repository root:
#
#   bash benchmarks/train_throughput.sh all                 # gen, bare step, Eyrie's command with adamw and muon
#   bash benchmarks/train_throughput.sh all --optimizers adamw --iters 250  # bare step over as long as the window
#   bash benchmarks/train_throughput.sh all --optimizers adamw --iters 250 --profile 30,3  # + kernel-by-kernel compare
#   bash benchmarks/train_throughput.sh eyrie --tag stock --off GPU_FEED --profile 30,3  # one switch off, profiled
#   bash benchmarks/train_throughput.sh loader              # the loader alone
#   bash benchmarks/train_throughput.sh eyrie --optimizer adamw --tag retry   # again: compile cache now warm
#   bash benchmarks/train_throughput.sh step --master fp32 --clip --opt adamw # the trainer's own math
#   bash benchmarks/train_throughput.sh ab --ab-epochs 10   # optimizer A/B on a carried demo run (runs/gpu-ab/)
#   bash benchmarks/train_throughput.sh ab --optimizers adamw --ab-lr 0.01,0.001 --ab-warm-start CKPT  # warm-start rates
#
# Fetch the wheels once on a machine with an index (python 3.12, manylinux x86_64), into .whl/:
#   for p in speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 dill==0.4.1 multiprocess==0.70.19 \
#            loguru==0.7.3 pydantic==2.12.5 pydantic-core==2.41.5 pydantic-settings==2.16.3 python-dotenv==1.2.4 \
#            annotated-types==0.8.0 typing-inspection==0.4.5 openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 \
#            truststore==0.10.5 sniffio==1.3.1 jiter==0.19.0 distro==1.9.0; do
#     pip download --no-deps --python-version 3.12 --only-binary=:all: -d .whl "$p"; done
#
# Results: $OUT/results.jsonl (one JSON line per measurement), $OUT/logs/ (trainer logs; with --profile the traces,
# kernels_*.json, keyavg_*.txt and compare_*.txt), $OUT/env.txt.
set -u
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/eyrie-train-throughput-out}
PY=${PY:-python3}
mkdir -p "$OUT/logs"
if ! "$PY" -c "import speculators" 2>/dev/null; then
  if [ ! -d /tmp/eyrie-site/speculators ]; then  # once per machine
    # with their bytecode compiled, as pip installs by default: the image sets PYTHONDONTWRITEBYTECODE=1, so a
    # --no-compile install made every process compile speculators, datasets, pydantic and openai from source
    "$PY" -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/eyrie-site \
      .whl/*.whl || exit 1
  fi
  export PYTHONPATH=/tmp/eyrie-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # eyrie itself, for the trainer subprocess and its workers
# The image's torch has no bytecode (0 .pyc for its 2,141 modules: installed without it) and PYTHONDONTWRITEBYTECODE=1
# keeps any process from writing it, so every trainer compiled torch's _dynamo and _inductor from source again, at
# import and inside the first compile. Compiled once per machine, as pip compiles at install (EYRIE_SOURCE_ONLY=1
# leaves the image as it is, to measure that cost). Python reads .pyc files whatever PYTHONDONTWRITEBYTECODE says.
if [ "${EYRIE_SOURCE_ONLY:-0}" != 1 ] && [ ! -e /tmp/eyrie-site/.bytecode ]; then
  start=$(date +%s)
  "$PY" -m compileall -q -j 0 "$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1
  mkdir -p /tmp/eyrie-site && touch /tmp/eyrie-site/.bytecode
  echo "bytecode compiled for the image's site-packages in $(( $(date +%s) - start )) s" >> "$OUT/env.txt"
fi

ROOT=${ROOT:-}
if [ -z "$ROOT" ]; then
  for d in "$HOME" /var/tmp "$PWD/.."; do
    t=$(stat -f -c %T "$d" 2>/dev/null)
    if [ -n "$t" ] && [ "$t" != tmpfs ] && [ "$t" != ramfs ]; then ROOT=$(cd "$d" && pwd)/eyrie-train-throughput; break; fi
  done
fi
cleanup() {
  for p in $(cat /tmp/eyrie-train-throughput-pids 2>/dev/null); do kill -9 -- "-$p" 2>/dev/null; done
  rm -f /tmp/eyrie-train-throughput-pids
}
trap cleanup EXIT
{ date -u; nvidia-smi -L; nvidia-smi --query-gpu=driver_version,memory.total,clocks.max.sm --format=csv; nproc
  free -g; df -hT "$ROOT/.." 2>/dev/null
  "$PY" -c 'import importlib.metadata as m; print([(k, m.version(k)) for k in ("torch", "transformers", "speculators", "datasets", "pydantic")])'
} >> "$OUT/env.txt" 2>&1
"$PY" benchmarks/train_throughput.py "$@" --root "$ROOT" --results "$OUT/results.jsonl" --log-dir "$OUT/logs"
