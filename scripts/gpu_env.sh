# Source on a GPU machine with python3 3.12 and torch but no package access:
#   source scripts/gpu_env.sh
# Needs, copied beside the working tree (see perf/README.md) and built on a development machine by
# `bash scripts/make_gpu_bundle.sh`: .whl/ (tritonclient, python-rapidjson, soundfile, cffi, pycparser, soxr
# wheels for cp312), .gpu/tritonserver-min.tar.xz (tritonserver 2.51 from the nvidia-pytriton wheel: bin/,
# backends/python, the 3.12 stub, lib/), .gpu/np/numpy-1.26.4 (the 24.10 python backend stub mis-reads
# BYTES tensors under numpy 2: "unpack_from requires a buffer of at least 134744076 bytes"), and, only if
# the tarball's lib/ has no libb64, .gpu/libb64-0d_*.deb for perf_analyzer.
set -e
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/np1 .gpu/np/*.whl
_sp=$(python3 -c "import site; print(site.getsitepackages()[0])")
printf "import sys; sys.path.insert(0, '/tmp/np1')\n/tmp/site\n%s\n" "$PWD" > "$_sp/s2tts_dev.pth"
[ -x /tmp/s2tts_triton/bin/tritonserver ] || tar xJf .gpu/tritonserver-min.tar.xz -C /tmp
export S2TTS_TRITON_HOME=/tmp/s2tts_triton
mkdir -p /tmp/pa_libs
ln -sf /tmp/s2tts_triton/lib/libcudart-*.so.12* /tmp/pa_libs/libcudart.so.12
ln -sf /tmp/s2tts_triton/lib/libb64-*.so.0d /tmp/pa_libs/libb64.so.0d
export LD_LIBRARY_PATH=/tmp/pa_libs:${LD_LIBRARY_PATH:-}
export PATH=/tmp/site/bin:$PATH
export PYTHONUNBUFFERED=1
python3 -c "import numpy, torch, tritonclient.grpc, soundfile, soxr, s2tts; print('gpu env ok: numpy', numpy.__version__, 'torch', torch.__version__)"
set +e
