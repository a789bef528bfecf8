#!/usr/bin/env bash
# Short headless Locust mix against a running mg-server (make loadtest).
# Writes loadtest/report/mg_{stats,failures,exceptions,stats_history}.csv, mg.html,
# determinism.json and locust.log. Exit code: Locust's (1 when any request or check failed,
# determinism mismatches included; 2 when the target is refused or unreachable).
#
#   loadtest/run.sh                               # 6 users, 60 s, http://127.0.0.1:30000
#   HOST=http://127.0.0.1:30100 USERS=4 RUN_TIME=30s loadtest/run.sh
#   loadtest/run.sh --max-tokens 64               # extra args go to locust
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO"

HOST=${HOST:-http://127.0.0.1:30000}
USERS=${USERS:-6}
SPAWN_RATE=${SPAWN_RATE:-$USERS}
RUN_TIME=${RUN_TIME:-60s}
REPORT=${REPORT:-loadtest/report}
LOCUST=${LOCUST:-locust}
if ! command -v "$LOCUST" > /dev/null && [[ -x .venv/bin/locust ]]; then
    LOCUST=.venv/bin/locust
fi

mkdir -p "$REPORT"
export MG_LOADTEST_REPORT_DIR=$REPORT
if ! curl -fsS -m 5 "$HOST/health" > /dev/null; then
    echo "no healthy mg-server at $HOST (start one with: make serve)" >&2
    exit 2
fi

exec "$LOCUST" -f loadtest/locustfile.py --headless \
    --host "$HOST" -u "$USERS" -r "$SPAWN_RATE" --run-time "$RUN_TIME" --stop-timeout 10 \
    --csv "$REPORT/mg" --csv-full-history --html "$REPORT/mg.html" \
    --logfile "$REPORT/locust.log" --only-summary "$@"
