#!/usr/bin/env bash
# What the lent GPU machine lacks, downloaded here into .whl/ (git-ignored) to be carried there.
#
# That machine has Python 3.12, torch, transformers, accelerate, peft, tensorboard, tokenizers and
# nvcc, but no package index and no deepspeed or datasets. This fetches, at the versions this
# checkout's .venv runs, the wheels of datasets and its missing needs, DeepSpeed's needs, transformers
# (to match CI), DeepSpeed's source archive (built there, against that machine's torch and CUDA) and TRL
# (pure Python; the peer bench's other side).
#
#   bash scripts/device_wheels.sh            # here, once (~50 MB)
# and each device command, with .whl carried, starts with
#   python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/site .whl/* \
#     && export PYTHONPATH=/tmp/site:. || exit;
# then runs e.g. python3 bench/bench_gpu_recipe.py --work /tmp/recipe --hh .data/harmless-base-test.jsonl.gz
# (copy the HH-RLHF file from ../shared into a git-ignored .data/ and carry it too).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p .git/info .whl
for ignored in /.whl/ /.data/; do
  grep -qxF "$ignored" .git/info/exclude 2>/dev/null || echo "$ignored" >> .git/info/exclude
done
version() { "$PY" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$1"; }
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
for package in datasets dill multiprocess hjson pydantic pydantic-core annotated-types typing-inspection transformers; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$package==$(version "$package")"
done
python3 -m pip download -q --no-deps --no-binary :all: -d .whl "deepspeed==$(version deepspeed)"
# TRL, the peer bench's other side (bench/bench_peers.py --peer-python python3), at the bench's pinned version
trl=$(sed -n 's/^TRL_VERSION = "\(.*\)"/\1/p' bench/bench_peers.py)
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl "trl==$trl"
ls -1 .whl
du -sh .whl
