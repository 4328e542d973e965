#!/usr/bin/env bash
# Deletes the kind cluster ./up.sh made (KIND: the kind binary, default kind on PATH).
set -euo pipefail
"${KIND:-kind}" delete cluster --name "${CLUSTER:-bootstrap-controller}"
