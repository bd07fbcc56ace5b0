#!/usr/bin/env bash
# Makes .gpu/ (ignored through .git/info/exclude): what `scripts/gpu_check.py --e2e` needs
# on a GPU machine that reaches no package registry and whose own Python (3.12) holds
# torch with CUDA, aiohttp, anyio and yarl, but no vLLM (docs/development.md, "A GPU
# machine without registries"):
#   - vllm.tgz: the installed vllm(-cpu) package's Python sources and dist-info (vLLM's
#     weight-transfer engines are plain Python over torch; its compiled parts stay here);
#   - whl/: cp312 wheels, at this environment's versions, of what vLLM's engines import
#     and that machine lacks.
# Usage: scripts/gpu_bundle.sh PYTHON   (the interpreter of an environment with vLLM 0.32)
# Then, on the GPU machine (the device tool's `run`, carry [".gpu"]):
#   bash .gpu/run.sh    (installs into /tmp/site and runs the check; results in $OUT)
set -euo pipefail
python=${1:?usage: scripts/gpu_bundle.sh PYTHON (an environment with vLLM installed)}
root=$(cd "$(dirname "$0")/.." && pwd)
grep -qx '/.gpu/' "$root/.git/info/exclude" 2>/dev/null || echo '/.gpu/' >>"$root/.git/info/exclude"
out=$root/.gpu
rm -rf "$out" && mkdir -p "$out/whl"
site=$("$python" -c 'import pathlib, vllm; print(pathlib.Path(vllm.__file__).parent.parent)')
dist=$(cd "$site" && ls -d vllm*-*.dist-info | grep -v router | head -1)
tar czf "$out/vllm.tgz" -C "$site" --exclude='*.so' --exclude=__pycache__ vllm "$dist"
for name in annotated-types cbor2 dill distro httpcore2 httpx2 jiter msgspec openai orjson \
    oss-harmony pybase64 pydantic pydantic-core pyzmq sniffio truststore typing-inspection; do
    version=$("$python" -m pip show "$name" 2>/dev/null | sed -n 's/^Version: //p' || true)
    spec=$name${version:+==$version}
    "$python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp -d "$out/whl" \
        --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 "$spec" 2>&1 | grep -v WARNING || true
done
cat >"$out/run.sh" <<'RUN'
#!/bin/bash
# on the GPU machine, from the checkout's root: install what .gpu/ carries, run the checks
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpu/whl/*.whl || exit 3
tar xzf .gpu/vllm.tgz -C /tmp/site || exit 3
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 VLLM_ALLOW_INSECURE_SERIALIZATION=1
out=${OUT:-.}
nvidia-smi --query-gpu=name,driver_version --format=csv 2>&1 | tee "$out/machine.txt"
timeout 240 python3 scripts/gpu_check.py --e2e --unfrozen --json "$out/e2e.json" \
    --markdown "$out/e2e.md" 2>&1 | tee "$out/e2e.log" | grep -v -e '^INFO' -e '^{' | tail -30
timeout 120 python3 scripts/gpu_check.py --e2e --no-lag --json "$out/nolag.json" \
    --markdown "$out/nolag.md" 2>&1 | tee "$out/nolag.log" | grep -v -e '^INFO' -e '^{' | tail -20
timeout 90 python3 scripts/gpu_check.py --json "$out/pieces.json" 2>&1 | tail -8
RUN
chmod +x "$out/run.sh"
ls "$out/whl" | wc -l
du -sh "$out"
