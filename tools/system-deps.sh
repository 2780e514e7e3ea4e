#!/usr/bin/env bash
# System packages the tests need beyond Python: libaio's headers, so DeepSpeed's async_io op (NVMe
# offload) can be JIT-built. Installs them with apt-get when running as root on Debian/Ubuntu (CI);
# elsewhere it says what is missing and the NVMe tests skip with that reason.
set -euo pipefail
if [ -e /usr/include/libaio.h ]; then
    exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "system-deps: installing libaio-dev (NVMe offload)"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q libaio-dev >/dev/null \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libaio-dev >/dev/null; }
else
    echo "system-deps: libaio-dev is missing (install it as root: apt-get install libaio-dev); NVMe tests will skip" >&2
fi
