#!/usr/bin/env bash
# The wheels `make test-gpu` needs on the lent GPU machine (Python 3.12, torch + transformers, no
# network): megatron-core and pytest with their small dependencies, as cp312 manylinux wheels in .whl/.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform any)
for wheel in megatron-core==0.19.2 pytest==9.2.0 pytest-timeout==2.4.0 pluggy iniconfig pygments safetensors==0.8.0 blake3==1.0.11; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$wheel"
done
du -sh .whl
