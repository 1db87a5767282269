# Sourced by the perf/ shell scripts: strict mode, the repository root ($ROOT) as the working directory, and $RES:
# the results folder ($OUT, default perf/out), made and absolute.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
RES="${OUT:-perf/out}"
mkdir -p "$RES"
RES="$(cd "$RES" && pwd)"
