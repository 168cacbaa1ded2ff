#!/usr/bin/env bash
# Set up and run the test suite (unit tests, then integration tests with real genie-daemon processes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec python3 -m pytest "$@"
