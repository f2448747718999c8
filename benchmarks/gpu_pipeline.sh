#!/usr/bin/env bash
# Eyrie's GPU paths on the lent H200 (or any GPU node with vLLM 0.26's kit): benchmarks/gpu_pipeline.py for one
# GPU-sized tiny target per contract (llama: native; gpt2: Eyrie's compatibility layer; kimi: the Kimi-K2.5 wrapper
# with MLA at (128, 64, 128)), through preflight, extraction (checked against transformers) and serving with EAGLE-3.
#
# Here, once, from the repository root (about 65-95 s; .gpu/ is ignored):
#   bash ../shared/gpu/build-vllm-bundle.sh          # vLLM 0.26.0 for the image's torch 2.11, in 3 pieces
# Then the device calls back to back (the machine goes back ~30 s after a call returns, and a cold one has lost
# /tmp: start again at call 1). eyrie.egg-info (ignored, made by `make .venv/.installed`) carries Eyrie's vLLM
# plugin entry point, which vLLM finds on PYTHONPATH.
#   1. carry [.gpu/pieces/1]:  mkdir -p /tmp/gpu-pieces && cp .gpu/pieces/1/* /tmp/gpu-pieces/
#   2. carry [.gpu/pieces/2]:  mkdir -p /tmp/gpu-pieces && cp .gpu/pieces/2/* /tmp/gpu-pieces/
#   3. carry [.gpu/pieces/3, .gpu/kit, eyrie.egg-info], timeout 600:
#        bash benchmarks/gpu_pipeline.sh --stages preflight,extract
#   4. carry [.gpu/kit, eyrie.egg-info], timeout 600 (the install is found in /tmp/gpu-site):
#        bash benchmarks/gpu_pipeline.sh --stages serve
#    Other stages, each its own call on the warm machine: `--stages preflight,proof` (the capture proof and six planted
#    wrong captures per target), `--targets llama --stages throughput --throughput-samples 96 --repeats 2`
#    (extraction throughput against a bare client and speculators), `--targets llama --stages regen-throughput`
#    (regeneration throughput against a bare client, ~200 s), `--targets llama --stages restart` (a server's
#    second start on a persistent vLLM cache).
# Results accumulate in $GPU_PIPELINE_WORK/gpu-pipeline.json (default /tmp/gpu-pipeline) across calls on one warm
# machine; each call copies it and the servers' logs to $OUT. benchmarks/results/gpu-pipeline-*.json keep them.
#   5. the whole chain (prepare, extraction into shards, vocab, training on cuda, export, evaluation with CUDA graphs)
#      needs speculators and the packages the image and the kit lack, as wheels in .gpu/whl (below), and the demo's
#      taught target built here into .gpu/work/targets/llama-chat (python benchmarks/gpu_pipeline.py --cpu --targets
#      llama --stages chain builds it, and runs the chain on the CPU build). With piece 3, one call
#      (GPU_PIPELINE_TIMEOUT stops the script in time for its results to come back):
#      carry [.gpu/pieces/3, .gpu/kit, eyrie.egg-info, .gpu/whl, .gpu/work/targets/llama-chat], timeout 600:
#        GPU_PIPELINE_TIMEOUT=540 bash benchmarks/gpu_pipeline.sh --targets llama,kimi --stages chain --budget-s 330
# The wheels, once, here (1.2 MiB; the kit already holds pydantic, loguru, openai and the rest speculators needs):
#   for p in speculators==0.9.0 hs-connectors==0.9.0 datasets==5.1.0 multiprocess==0.70.19 fsspec==2026.7.0; do
#     python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform any -d .gpu/whl "$p"; done
set -u
source .gpu/kit/device-install.sh || exit $?
if [ -d .gpu/whl ] && ! python3 -c "import speculators" 2>/dev/null; then
  t=$(date +%s)
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/gpu-whl .gpu/whl/*.whl || exit 1
  export PYTHONPATH=/tmp/gpu-whl${PYTHONPATH:+:$PYTHONPATH}
  echo "wheels installed in $(( $(date +%s) - t )) s"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export GPU_PIPELINE_WORK=${GPU_PIPELINE_WORK:-/tmp/gpu-pipeline}
OUT=${OUT:-$GPU_PIPELINE_WORK/out}
mkdir -p "$OUT" "$GPU_PIPELINE_WORK"
start=$(date +%s)
timeout -s INT -k 20 "${GPU_PIPELINE_TIMEOUT:-100000}" \
  python3 benchmarks/gpu_pipeline.py --work "$GPU_PIPELINE_WORK" --out "$GPU_PIPELINE_WORK/gpu-pipeline.json" "$@"
rc=$?
echo "gpu_pipeline.py: exit $rc after $(( $(date +%s) - start )) s"
cp "$GPU_PIPELINE_WORK/gpu-pipeline.json" "$OUT/" 2>/dev/null
# the servers' logs, one archive (what comes back from $OUT is at most 8 files)
(cd "$GPU_PIPELINE_WORK" && find servers chain \( -name '*.log' -o -name '*.jsonl' -o -name 'manifest.json' \) \
  -print0 2>/dev/null | tar --null -czf "$OUT/server-logs.tgz" -T -) 2>/dev/null
exit $rc
