#!/usr/bin/env bash
set -u
# CPU threads per rank on a 16-core machine (benchmarks/RESULTS.md, session 20): the quickstart,
# 40 steps, one process (TP=1) and two (TP=2), OMP_NUM_THREADS unset or set. Run from the repo root
# on the GPU machine with CUDA hidden, after the kit's wheels (all but Transformer Engine):
#   bash benchmarks/cpu_threads.sh      (OUT: where threads.jsonl goes)
# "last_bar" is the progress bar's last it/s (the final epoch's rate).
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
W=$(ls .gpu/kit/*.whl | grep -v transformer_engine)
pip install -q --no-deps --target /tmp/site $W 2>&1 | tail -2
export PYTHONPATH=$PWD:/tmp/site CUDA_VISIBLE_DEVICES= TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp}
nproc; python -c "import torch, megatron.core; print(torch.__version__, megatron.core.__version__, torch.get_num_threads())"
run() {  # label devices tp threads
  rm -rf /tmp/w && mkdir -p /tmp/w && cp -r configs /tmp/w/ && cd /tmp/w
  if [ "$4" = unset ]; then E="env -u OMP_NUM_THREADS"; else E="env OMP_NUM_THREADS=$4"; fi
  s=$(date +%s%N)
  $E python -m lightning_mcore.cli fit --config configs/quickstart.yaml --trainer.devices $2 \
    --trainer.strategy.init_args.tensor_model_parallel_size $3 --trainer.max_steps 40 > /tmp/w/out.txt 2>&1
  rc=$?; e=$(date +%s%N)
  it=$(grep -o "[0-9.]*it/s" /tmp/w/out.txt | tail -1)
  echo "{\"label\": \"$1\", \"devices\": $2, \"tp\": $3, \"omp\": \"$4\", \"rc\": $rc, \"wall_s\": $(( (e - s) / 1000000 ))e-3, \"last_bar\": \"$it\"}" | tee -a $OUT/threads.jsonl
  [ $rc = 0 ] || tail -5 /tmp/w/out.txt
  cd - > /dev/null
}
for t in unset 1 2 4 8; do run one 1 1 $t; done
for t in unset 1 2 4; do run two 2 2 $t; done
