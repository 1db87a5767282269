#!/usr/bin/env bash
# Builds the software that a GPU machine without package access lacks, as the git-ignored folders .whl/ and .gpu/ to
# copy there with the working tree (see perf/README.md; scripts/gpu_env.sh and perf/run_gpu.sh set it up there).
# Run from anywhere, on a development machine (x86-64 Linux with python3 + pip, readelf, xz, tar; apt-get as root
# only for the libb64 fallback below), with access to the package registry and Debian's packages:
#
#   bash scripts/make_gpu_bundle.sh
#
#   .whl/                           cp312 manylinux x86-64 wheels, one version each, installed with --no-deps:
#                                   tritonclient 2.51.0 (ships perf_analyzer) and what the GPU machine lacks of its
#                                   and s2tts' imports: python-rapidjson, soundfile, cffi, pycparser, soxr
#                                   (grpcio, protobuf, packaging, urllib3, numpy are there already)
#   .gpu/np/                        numpy 1.26.4 cp312 (the 24.10 python backend stub mis-reads BYTES tensors under numpy 2)
#   .gpu/tritonserver-min.tar.xz    tritonserver 2.51 from the nvidia-pytriton 0.7.0 wheel, trimmed, extracting to
#                                   s2tts_triton/ = $S2TTS_TRITON_HOME for s2tts.server.find_server: bin/tritonserver,
#                                   backends/python/{libtriton_python.so,triton_python_backend_utils.py},
#                                   python_backend_stubs/<$STUBS>/triton_python_backend_stub, lib/ (the wheel's
#                                   bundled libraries that those need, libcudart-*.so.12* and libb64-*.so.0d among them)
#   .gpu/libb64-0d_*.deb            Debian's libb64 for perf_analyzer, only if that lib/ has no libb64
#
# Idempotent: present wheels are kept (other versions and unlisted files in .whl/ and .gpu/np/ are removed), the
# tarball is rebuilt only when its inputs change (FORCE=1 rebuilds it). Downloads are cached in .cache/gpu_bundle/.
# Then it checks the result (VERIFY=0 skips): the wheels are intact, the tarball extracts with its executable bits,
# `tritonserver --help` runs, perf_analyzer finds its libraries, and, where the tarball has a stub for the local
# python version, s2tts.server.find_server/backend_dir accept the layout. It prints what it wrote and the total size,
# and fails if .whl + .gpu exceed MAX_MIB.
#
# Knobs (environment):        default
#   TRITONCLIENT_VERSION      2.51.0
#   RAPIDJSON_VERSION         1.25
#   SOUNDFILE_VERSION         0.14.0
#   CFFI_VERSION              2.1.1
#   PYCPARSER_VERSION         3.12
#   SOXR_VERSION              1.1.0
#   NUMPY_VERSION             1.26.4
#   PYTRITON_VERSION          0.7.0
#   STUBS                     "3.12 3.11"     python backend stubs to keep (3.12: the GPU machine; 3.11: a local smoke test)
#   PYTHON                    python3         runs pip
#   VENV_PYTHON               .venv/bin/python   the find_server check (skipped if missing)
#   MAX_MIB                   60              limit for .whl + .gpu (small enough to copy with the working tree)
#   FORCE                     0               1: rebuild the tarball even if its inputs are unchanged
#   VERIFY                    1               0: skip the checks
set -euo pipefail
shopt -s inherit_errexit
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

TRITONCLIENT_VERSION="${TRITONCLIENT_VERSION:-2.51.0}"
RAPIDJSON_VERSION="${RAPIDJSON_VERSION:-1.25}"
SOUNDFILE_VERSION="${SOUNDFILE_VERSION:-0.14.0}"
CFFI_VERSION="${CFFI_VERSION:-2.1.1}"
PYCPARSER_VERSION="${PYCPARSER_VERSION:-3.12}"
SOXR_VERSION="${SOXR_VERSION:-1.1.0}"
NUMPY_VERSION="${NUMPY_VERSION:-1.26.4}"
PYTRITON_VERSION="${PYTRITON_VERSION:-0.7.0}"
STUBS="${STUBS:-3.12 3.11}"
PY="${PYTHON:-python3}"
VENV_PY="${VENV_PYTHON:-.venv/bin/python}"
MAX_MIB="${MAX_MIB:-60}"
FORCE="${FORCE:-0}"
VERIFY="${VERIFY:-1}"
LAYOUT=2  # bump when the tarball's layout or trimming changes, so that an old tarball is rebuilt

CACHE="$ROOT/.cache/gpu_bundle"
TARBALL=.gpu/tritonserver-min.tar.xz
mkdir -p .whl .gpu/np "$CACHE"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

log() { echo "[make_gpu_bundle] $*"; }
die() { echo "[make_gpu_bundle] ERROR: $*" >&2; exit 1; }
for tool in readelf xz tar; do command -v "$tool" >/dev/null || die "$tool is needed (Debian: binutils, xz-utils, tar)"; done
"$PY" -m pip --version >/dev/null 2>&1 || die "$PY has no pip"

# cp312 manylinux x86-64, whatever this machine is
PLATFORM_ARGS=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

# fetch_wheel DIR SPEC: NAME[extras]==VERSION into DIR unless that version is there; other versions of NAME go
# afterwards (a wheel's file name starts with NAME normalised: lower case, runs of -_. as _). Prints the file name.
fetch_wheel() {
  local dir="$1" spec="$2" name version norm have f base
  name="${spec%%==*}" version="${spec##*==}"
  name="${name%%\[*}"
  norm="$(wheel_norm "$name")"
  have=""
  for f in "$dir"/*.whl; do
    [ -e "$f" ] || continue
    base="$(basename "$f")"
    [ "$(wheel_norm "${base%%-*}")" = "$norm" ] && [ "$(echo "$base" | cut -d- -f2)" = "$version" ] && { have="$base"; break; }
  done
  if [ -z "$have" ]; then
    log "downloading $spec from the package registry" >&2
    "$PY" -m pip download -q "${PLATFORM_ARGS[@]}" -d "$TMP/dl" "$spec" 2>&1 | grep -v "is ignored" >&2 || true
    f="$(ls "$TMP/dl"/*.whl 2>/dev/null | head -1 || true)"
    [ -n "$f" ] || die "no cp312 manylinux x86-64 wheel of $spec"
    have="$(basename "$f")"
    mv "$f" "$dir/$have"
    rm -rf "$TMP/dl"
  fi
  for f in "$dir"/*.whl; do  # one version of each
    base="$(basename "$f")"
    if [ "$base" != "$have" ] && [ "$(wheel_norm "${base%%-*}")" = "$norm" ]; then
      log "removing $dir/$base (not $norm $version)" >&2; rm -f "$f"
    fi
  done
  echo "$have"
}
wheel_norm() { echo "$1" | tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/_/g'; }

# keep_only DIR FILE...: remove the other files of DIR (a folder only this script fills)
keep_only() {
  local dir="$1" f keep k
  shift
  for f in "$dir"/* "$dir"/.[!.]*; do
    [ -e "$f" ] || continue
    [ -d "$f" ] && [ "$dir" = .gpu ] && [ "$(basename "$f")" = np ] && continue
    keep=0
    for k in "$@"; do [ "$(basename "$f")" = "$k" ] && keep=1; done
    [ $keep = 1 ] || { log "removing $f (not made by this script)"; rm -rf "$f"; }
  done
}

# ------------------------------------------------------------------------------------------------ .whl/
WHL=()
for spec in "tritonclient[grpc]==$TRITONCLIENT_VERSION" "python-rapidjson==$RAPIDJSON_VERSION" \
            "soundfile==$SOUNDFILE_VERSION" "cffi==$CFFI_VERSION" "pycparser==$PYCPARSER_VERSION" \
            "soxr==$SOXR_VERSION"; do
  WHL+=("$(fetch_wheel .whl "$spec")")
done
keep_only .whl "${WHL[@]}"

# ------------------------------------------------------------------------------------------------ .gpu/np/
NP="$(fetch_wheel .gpu/np "numpy==$NUMPY_VERSION")"
keep_only .gpu/np "$NP"

# ------------------------------------------------------------------------------------------------ .gpu/tritonserver-min.tar.xz
# the wheel is tagged py3-none-manylinux_2_35_x86_64: the same tritonserver for every python
PYT_DIR="$CACHE/pytriton"
mkdir -p "$PYT_DIR"
PYT_WHL="$(ls "$PYT_DIR"/nvidia_pytriton-"$PYTRITON_VERSION"-*manylinux*x86_64.whl 2>/dev/null | head -1 || true)"
if [ -z "$PYT_WHL" ]; then
  log "downloading nvidia-pytriton==$PYTRITON_VERSION from the package registry (~55 MB, cached in ${CACHE#"$ROOT"/})"
  rm -f "$PYT_DIR"/*.whl
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 -d "$PYT_DIR" "nvidia-pytriton==$PYTRITON_VERSION" 2>&1 | grep -v "is ignored" || true
  PYT_WHL="$(ls "$PYT_DIR"/nvidia_pytriton-"$PYTRITON_VERSION"-*manylinux*x86_64.whl 2>/dev/null | head -1 || true)"
  [ -n "$PYT_WHL" ] || die "no manylinux x86-64 wheel of nvidia-pytriton==$PYTRITON_VERSION"
fi

KEY="layout=$LAYOUT wheel=$(basename "$PYT_WHL") size=$(stat -c %s "$PYT_WHL") stubs=$STUBS"
KEYFILE="$CACHE/tritonserver-min.key"
if [ "$FORCE" != 1 ] && [ -f "$TARBALL" ] && [ -f "$KEYFILE" ] \
   && [ "$(head -1 "$KEYFILE")" = "$KEY" ] && [ "$(sed -n 2p "$KEYFILE")" = "$(sha256sum "$TARBALL" | cut -d' ' -f1)" ]; then
  log "$TARBALL is up to date ($KEY)"
else
  log "building $TARBALL from $(basename "$PYT_WHL") (stubs: $STUBS)"
  STAGE="$TMP/stage"
  mkdir -p "$STAGE"
  # extract the members we keep, with their modes (python's zipfile drops them) and times
  "$PY" - "$PYT_WHL" "$STAGE/s2tts_triton" $STUBS <<'EOF'
import os, sys, time, zipfile
whl, dst, stubs = sys.argv[1], sys.argv[2], sys.argv[3:]
ts = "pytriton/tritonserver/"
want = {ts + "bin/tritonserver": "bin/tritonserver",
        ts + "backends/python/libtriton_python.so": "backends/python/libtriton_python.so",
        ts + "backends/python/triton_python_backend_utils.py": "backends/python/triton_python_backend_utils.py"}
for v in stubs:
    want[f"{ts}python_backend_stubs/{v}/triton_python_backend_stub"] = f"python_backend_stubs/{v}/triton_python_backend_stub"
with zipfile.ZipFile(whl) as z:
    names = z.namelist()
    for n in names:
        if n.startswith("nvidia_pytriton.libs/") and not n.endswith("/"):
            want[n] = "lib/" + n.split("/", 1)[1]
    missing = [n for n in want if n not in names]
    if missing:
        sys.exit(f"not in {os.path.basename(whl)}: {missing}")
    for src, rel in want.items():
        info = z.getinfo(src)
        out = os.path.join(dst, rel)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with z.open(info) as f, open(out, "wb") as g:
            g.write(f.read())
        mode = (info.external_attr >> 16) & 0o777
        if rel.startswith("bin/") or rel.endswith("_stub"):
            mode |= 0o755  # executables, whatever the zip says
        os.chmod(out, (mode or 0o644) & 0o755)  # no group/other write bits (some members have them)
        t = time.mktime(info.date_time + (0, 0, -1))
        os.utime(out, (t, t))
EOF
  # lib/: only what the kept programs load (the NEEDED closure; the wheel's libraries were all grafted in by
  # auditwheel for its own programs, e.g. the 3.13 stub's libpython3.13), plus libcudart and libb64 for perf_analyzer
  H="$STAGE/s2tts_triton"
  needed() { readelf -d "$1" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'; }
  declare -A KEEP=()
  queue=("$H/bin/tritonserver" "$H/backends/python/libtriton_python.so")
  for v in $STUBS; do queue+=("$H/python_backend_stubs/$v/triton_python_backend_stub"); done
  for f in "$H"/lib/libcudart-*.so.12* "$H"/lib/libb64-*.so.0d*; do [ -e "$f" ] && queue+=("$f"); done
  while [ ${#queue[@]} -gt 0 ]; do
    f="${queue[0]}"; queue=("${queue[@]:1}")
    for n in $(needed "$f"); do
      if [ -e "$H/lib/$n" ] && [ -z "${KEEP[$n]:-}" ]; then KEEP[$n]=1; queue+=("$H/lib/$n"); fi
    done
  done
  for f in "$H"/lib/libcudart-*.so.12* "$H"/lib/libb64-*.so.0d*; do [ -e "$f" ] && KEEP[$(basename "$f")]=1; done
  for f in "$H"/lib/*; do
    n="$(basename "$f")"
    [ -n "${KEEP[$n]:-}" ] || { log "  leaving out lib/$n ($(du -h "$f" | cut -f1), not needed by what is kept)"; rm -f "$f"; }
  done
  # unresolved libraries must be the system's own (glibc, libstdc++, libz, the interpreter's libpython)
  for f in "$H"/bin/tritonserver "$H"/backends/python/libtriton_python.so "$H"/python_backend_stubs/*/* "$H"/lib/*; do
    for n in $(needed "$f"); do
      [ -e "$H/lib/$n" ] || case "$n" in
        libc.so.6|libm.so.6|libdl.so.2|libpthread.so.0|librt.so.1|libresolv.so.2|ld-linux-x86-64.so.2|libgcc_s.so.1|libstdc++.so.6|libz.so.1|libpython3.*.so.1.0) ;;
        *) die "$(basename "$f") needs $n, which is neither in lib/ nor a system library" ;;
      esac
    done
  done
  EPOCH="$(stat -c %Y "$H/bin/tritonserver")"
  tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$EPOCH" -C "$STAGE" -cf - s2tts_triton \
    | xz -9 -T1 >"$TMP/tritonserver-min.tar.xz"
  mv "$TMP/tritonserver-min.tar.xz" "$TARBALL"
  printf '%s\n%s\n' "$KEY" "$(sha256sum "$TARBALL" | cut -d' ' -f1)" >"$KEYFILE"
  log "wrote $TARBALL ($(du -sh "$STAGE/s2tts_triton" | cut -f1) unpacked)"
fi

# ------------------------------------------------------------------------------------------------ .gpu/libb64-0d_*.deb
GPU_KEEP=("$(basename "$TARBALL")")
LISTING="$(tar -tJf "$TARBALL")"
if grep -q '^s2tts_triton/lib/libb64[-.].*so\.0d' <<<"$LISTING"; then
  log "the tarball's lib/ has libb64: no .deb needed"
else
  DEB="$(ls .gpu/libb64-0d_*.deb 2>/dev/null | head -1 || true)"
  if [ -z "$DEB" ]; then
    log "the tarball's lib/ has no libb64: fetching libb64-0d from Debian's packages"
    command -v apt-get >/dev/null || die "apt-get is needed for libb64-0d"
    apt-get update -qq
    (cd .gpu && apt-get download -q libb64-0d)
    DEB="$(ls .gpu/libb64-0d_*.deb | head -1)"
  fi
  GPU_KEEP+=("$(basename "$DEB")")
fi
keep_only .gpu "${GPU_KEEP[@]}"

# ------------------------------------------------------------------------------------------------ checks
if [ "$VERIFY" = 1 ]; then
  log "checking"
  for f in .whl/*.whl .gpu/np/*.whl; do "$PY" -m zipfile -t "$f" >/dev/null || die "$f is not a valid zip"; done
  V="$TMP/verify"
  mkdir -p "$V"
  tar -xJf "$TARBALL" -C "$V"
  H="$V/s2tts_triton"
  for f in bin/tritonserver backends/python/libtriton_python.so backends/python/triton_python_backend_utils.py; do
    [ -f "$H/$f" ] || die "the tarball has no s2tts_triton/$f"
  done
  for f in "$H"/bin/tritonserver "$H"/python_backend_stubs/*/triton_python_backend_stub; do
    [ -x "$f" ] || die "${f#"$V"/} lost its executable bit"
  done
  log "tarball: $(tar -tvJf "$TARBALL" | awk '$1 ~ /^-/ {n++} END {print n}') files; executable: $(cd "$V" && find s2tts_triton -type f -perm -u+x | sort | tr '\n' ' ')"
  rc=0
  out="$(LD_LIBRARY_PATH="$H/lib" "$H/bin/tritonserver" --help 2>&1)" || rc=$?
  head -3 <<<"$out" | sed 's/^/  tritonserver --help: /'
  # tritonserver 2.51 exits 1 after printing its usage (the wheel's own copy does the same)
  [ $rc -le 1 ] && grep -q '^Usage: tritonserver' <<<"$out" || die "tritonserver --help failed (exit $rc)"
  log "tritonserver --help: printed its usage ($(wc -l <<<"$out") lines, exit $rc)"
  for f in "$H"/bin/tritonserver "$H"/backends/python/libtriton_python.so; do
    miss="$(LD_LIBRARY_PATH="$H/lib" ldd "$f" | grep 'not found' || true)"
    [ -z "$miss" ] || die "${f#"$H"/} misses: $miss"
  done
  log "ldd: bin/tritonserver and backends/python/libtriton_python.so find all their libraries"
  # perf_analyzer (in the tritonclient wheel) with the libraries gpu_env.sh links for it
  TCW="$(ls .whl/tritonclient-*.whl | head -1)"
  "$PY" -c "import sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); n = [m for m in z.namelist() if m.endswith('/bin/perf_analyzer')][0]; open(sys.argv[2], 'wb').write(z.read(n))" "$TCW" "$V/perf_analyzer"
  chmod +x "$V/perf_analyzer"
  mkdir -p "$V/pa_libs"
  for f in "$H"/lib/libcudart-*.so.12*; do [ -e "$f" ] && ln -sf "$f" "$V/pa_libs/libcudart.so.12"; done
  for f in "$H"/lib/libb64-*.so.0d; do [ -e "$f" ] && ln -sf "$f" "$V/pa_libs/libb64.so.0d"; done
  if [ ! -e "$V/pa_libs/libb64.so.0d" ] && compgen -G ".gpu/libb64-0d_*.deb" >/dev/null; then
    dpkg -x .gpu/libb64-0d_*.deb "$V/b64" && ln -sf "$(find "$V/b64" -name 'libb64.so.0d*' | head -1)" "$V/pa_libs/libb64.so.0d"
  fi
  miss="$(LD_LIBRARY_PATH="$V/pa_libs" ldd "$V/perf_analyzer" | grep 'not found' || true)"
  [ -z "$miss" ] || die "perf_analyzer misses: $miss"
  log "perf_analyzer: all libraries found (libcudart.so.12, libb64.so.0d from the bundle)"
  # find_server / backend_dir on the layout, with a python whose stub is in the tarball
  if [ -x "$VENV_PY" ]; then
    pyver="$("$VENV_PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
    if [ -f "$H/python_backend_stubs/$pyver/triton_python_backend_stub" ]; then
      S2TTS_TRITON_HOME="$H" "$VENV_PY" - "$V/work" <<'EOF'
import sys
from pathlib import Path
from s2tts.server import backend_dir, find_server
binary, src, libs = find_server()
bd = backend_dir(Path(sys.argv[1]))
files = sorted(p.name for p in (bd / "python").iterdir())
print(f"  find_server: binary={binary.name} src={src.name} libs={libs.name if libs else None}; backend_dir: python/{files}")
assert libs is not None and binary.is_file() and "triton_python_backend_stub" in files
EOF
      log "find_server/backend_dir (python $pyver): ok"
    else
      log "no stub for $VENV_PY's python $pyver in the tarball: find_server check skipped"
    fi
  else
    log "no $VENV_PY: find_server check skipped"
  fi
fi

# ------------------------------------------------------------------------------------------------ what was written
echo
log "contents:"
(find .whl .gpu -type f -printf '%s %p\n' | sort -k2 | awk '{printf "  %8.2f MiB  %s\n", $1 / 1048576, $2}')
total="$(find .whl .gpu -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')"
repo="$( (git ls-files -z --cached --others --exclude-standard 2>/dev/null | xargs -0 -r stat -c %s 2>/dev/null || true) | awk '{s += $1} END {print s + 0}')"
log "total .whl + .gpu: $(awk -v t="$total" 'BEGIN {printf "%.2f MiB (%d bytes)", t / 1048576, t}'); with the working tree's other files (~$(awk -v r="$repo" 'BEGIN {printf "%.1f", r / 1048576}') MiB): $(awk -v t="$total" -v r="$repo" 'BEGIN {printf "%.2f", (t + r) / 1048576}') MiB in all"
[ "$total" -le $((MAX_MIB * 1048576)) ] || die ".whl + .gpu exceed MAX_MIB=$MAX_MIB MiB"
