"""The image's HEALTHCHECK: exit 0 when URL answers 200 (the gateway's /health: s2pro ready behind it; Triton's
/v2/health/ready for a container running tritonserver alone), 1 otherwise.

    python3 healthcheck.py URL
"""

import sys
import urllib.request

try:
    with urllib.request.urlopen(sys.argv[1], timeout=4) as r:
        sys.exit(0 if r.status == 200 else 1)
except OSError as e:  # refused, a timeout, or an HTTP error status
    print(f"{sys.argv[1]}: {e}")
    sys.exit(1)
