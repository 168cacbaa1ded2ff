#!/usr/bin/env bash
# Set up (CPU torch, Genie) and run the demo: a GPT-style decoder generating on remote_accelerator.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
exec python -m genie.examples.demo "$@"
