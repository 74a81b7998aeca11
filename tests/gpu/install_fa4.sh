#!/usr/bin/env bash
# Install FA4 (flash-attn-4 and the CuTe DSL) and fusionguard's missing dependencies on the device
# machine from wheels, with no network: tests/gpu/test_flash_cuda.py and benchmarks/flash_and_caps.py
# need them (#35).
#
#   tests/gpu/install_fa4.sh WHEEL_DIR [TARGET]      # TARGET: /tmp/fa4site by default
#   eval "$(tests/gpu/install_fa4.sh /tmp/fa4)"      # prints the PYTHONPATH line to use
#
# Wheels (cp312 or pure Python): flash-attn-4, quack-kernels, apache-tvm-ffi, torch-c-dlpack-ext,
# nvidia-cutlass-dsl with its libs-base, libs-core and libs-cu13 wheels (cutlass.cute is in
# libs-core), structlog, wrapt. A wheel split in parts (NAME.whl.part-aa, -ab, ...: the cu13 libs
# wheel is about 92 MB, over one call's 64 MiB) is joined first.
#
# Why unzip and not pip: the libs wheels share one top-level folder (nvidia_cutlass_dsl/), which
# `pip install --target` replaces wheel by wheel; and nvidia-cutlass-dsl's .pth file (it puts
# nvidia_cutlass_dsl/dsl_packages on sys.path) runs only in a site directory, so that folder goes
# on PYTHONPATH instead. nvidia-cutlass-dsl asks for libs-cu12; the device's torch is a cu13 build,
# so libs-cu13 is installed and dependencies are not resolved. einops, cuda-bindings, protobuf and
# typing-extensions come with the image.
set -euo pipefail
src=${1:?usage: install_fa4.sh WHEEL_DIR [TARGET]}
target=${2:-/tmp/fa4site}
for first in "$src"/*.whl.part-aa; do
  [ -e "$first" ] || continue
  whole=${first%.part-aa}
  cat "$whole".part-* > "$whole.tmp" && mv "$whole.tmp" "$whole"
done
mkdir -p "$target"
python3 - "$target" "$src"/*.whl <<'PY' >&2
import os, sys, zipfile
target, wheels = sys.argv[1], sys.argv[2:]
for wheel in wheels:
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            path = z.extract(info, target)
            mode = (info.external_attr >> 16) & 0o777
            if mode and not info.is_dir():
                os.chmod(path, mode)  # (shared libraries and tools keep their modes)
    print("installed", os.path.basename(wheel))
PY
echo "export PYTHONPATH=$target:$target/nvidia_cutlass_dsl/dsl_packages\${PYTHONPATH:+:\$PYTHONPATH}"
