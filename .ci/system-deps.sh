#!/usr/bin/env bash
# System packages the service tests use as real components: PostgreSQL (storage), Prometheus (scrapes the
# service and the sidecar), Chromium + ChromeDriver (the decisions page in a headless browser). `make test`
# runs this first. As root (CI) it installs whatever is missing from Debian's packages; otherwise it only
# reports what is missing, and the tests that need it are skipped with that reason.
set -euo pipefail
need=()
command -v chromium >/dev/null 2>&1 || need+=(chromium chromium-driver)
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
if [ ${#need[@]} -eq 0 ]; then exit 0; fi
if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "system-deps: installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -q >/dev/null
  # The packages' own services are not wanted (tests start their own servers on free ports).
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
  apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
  rm -f /usr/sbin/policy-rc.d
else
  echo "system-deps: missing ${need[*]} (not root: the tests that need them will be skipped)" >&2
fi
