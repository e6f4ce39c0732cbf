#!/usr/bin/env bash
# Run a command beside the servers of the cluster tests, then stop them:
#
#   scripts/clusters.sh COMMAND ARGS...
#
# The servers: a PostgreSQL primary with a synchronous streaming standby (scripts/pgpair.sh,
# for tests/failover and tests/replica) and a three-node MariaDB Galera cluster
# (scripts/galera.sh, for tests/galera). Both start together; their env files are loaded into
# COMMAND's environment. Servers that ran before (someone else's session) are left running.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PAIR_DIR="${SP_PGPAIR_DIR:-/tmp/sqla-proletarian-pgpair}"
GALERA_DIR="${SP_GALERA_DIR:-/tmp/sqla-proletarian-galera}"

stops=()
[[ -e $PAIR_DIR/env ]] || stops+=(pgpair)
[[ -e $GALERA_DIR/env ]] || stops+=(galera)
cleanup() {
    local script
    for script in "${stops[@]}"; do bash "$HERE/$script.sh" stop >/dev/null 2>&1 || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

started=$SECONDS
bash "$HERE/pgpair.sh" start &
pair=$!
bash "$HERE/galera.sh" start
wait "$pair"
echo "clusters: the PostgreSQL pair and the Galera cluster are up ($((SECONDS - started)) s)" >&2
set -a
# shellcheck disable=SC1091
source "$PAIR_DIR/env"
# shellcheck disable=SC1091
source "$GALERA_DIR/env"
set +a
"$@"
