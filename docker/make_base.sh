#!/usr/bin/env bash
# Make a plain Debian image from Debian's own packages, for a machine that reaches Debian's archive but no container
# registry (where Docker Hub is reachable, `debian:bookworm-slim` does the same job):
#   bash docker/make_base.sh [NAME]          # default s2tts-debian:bookworm; kept if the daemon has it already
# Needs root, debootstrap and a running Docker daemon. DEBIAN_MIRROR picks the archive (default deb.debian.org).
set -euo pipefail
NAME=${1:-s2tts-debian:bookworm}
SUITE=${SUITE:-bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if docker image inspect "$NAME" >/dev/null 2>&1; then
  echo "make_base: $NAME is there already"
  exit 0
fi
command -v debootstrap >/dev/null || { echo "make_base: needs debootstrap (apt-get install debootstrap)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "make_base: debootstrap needs root" >&2; exit 1; }
root=$(mktemp -d)
trap 'rm -rf --one-file-system "$root"' EXIT
echo "make_base: debootstrap --variant=minbase $SUITE from $MIRROR"
debootstrap --variant=minbase "$SUITE" "$root" "$MIRROR" >"$root.log" 2>&1 \
  || { tail -n 30 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
# as Debian's own images: no services started by package installs, no downloaded packages or indexes kept
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"
chmod +x "$root/usr/sbin/policy-rc.d"
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import --change 'CMD ["bash"]' - "$NAME" >/dev/null
echo "make_base: $NAME made ($(docker image inspect -f '{{.Size}}' "$NAME" | awk '{printf "%.0f MB", $1/1e6}'))"
