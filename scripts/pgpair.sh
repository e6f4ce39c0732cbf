#!/usr/bin/env bash
# A throw-away PostgreSQL 15 primary with a streaming standby, for the failover and
# read-replica tests.
#
#   scripts/pgpair.sh start      make and start a fresh pair if none runs (idempotent); prints the time
#   scripts/pgpair.sh ensure     make sure a healthy pair runs (primary read-write on the primary
#                                port, standby streaming on the standby port); rebuilds the pair
#                                after a failover. Fast (one query) when healthy
#   scripts/pgpair.sh failover   stop the primary (pg_ctl stop -m immediate), promote the standby,
#                                wait until it accepts writes
#   scripts/pgpair.sh stop       stop both, remove the state directory
#   scripts/pgpair.sh status     show which server runs, in which role
#   scripts/pgpair.sh env        print the env file (shell `export` lines)
#
# State lives in ${SP_PGPAIR_DIR:-/tmp/sqla-proletarian-pgpair} (reachable by the postgres
# user when run as root). The servers listen on 127.0.0.1 only: the first primary on
# ${SP_PGPAIR_PRIMARY_PORT:-25452}, its standby on ${SP_PGPAIR_STANDBY_PORT:-25453}; user
# postgres, trust authentication. Tuned for speed (fsync off) but with synchronous
# replication (synchronous_standby_names='*', synchronous_commit=on): a commit returns once
# the standby has it. SP_PGPAIR_SYNC=0 makes the replication asynchronous (`start`/`ensure`
# rebuild a pair made with the other setting). The standby never waits for a standby of its
# own, so it takes writes at once once promoted.
set -euo pipefail

STATE="${SP_PGPAIR_DIR:-/tmp/sqla-proletarian-pgpair}"
PRIMARY_PORT=${SP_PGPAIR_PRIMARY_PORT:-25452}
STANDBY_PORT=${SP_PGPAIR_STANDBY_PORT:-25453}
SYNC=${SP_PGPAIR_SYNC:-1}
BINDIR=${SP_PGPAIR_BINDIR:-/usr/lib/postgresql/15/bin}

TEMPLATE="$STATE/template"   # an initdb'd data dir, copied for each new primary
PRIMARY="$STATE/primary"     # data dir: $PRIMARY/data, socket dir: $PRIMARY
STANDBY="$STATE/standby"     # the same for the standby
FAILED_OVER="$STATE/failed-over"   # written by `failover`: the next `ensure` rebuilds
ENV_FILE="$STATE/env"
LOCK_FILE="$STATE.lock"      # beside the state dir, which `stop` removes

SCRIPT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
IS_ROOT=0; [[ $(id -u) -eq 0 ]] && IS_ROOT=1

log() { echo "pgpair: $*" >&2; }
die() { echo "pgpair: ERROR: $*" >&2; exit 1; }
# shellcheck source=scripts/ports.sh
source "$(dirname "$SCRIPT")/ports.sh"

# ---------------------------------------------------------------- helpers --

# A PostgreSQL program, as the postgres user when root (from $STATE, which it can read),
# without the lock's descriptor (a server started here would hold the lock for good).
pg() {
    if ((IS_ROOT)); then (cd "$STATE" && runuser -u postgres -- "$BINDIR/$1" "${@:2}") 9>&-
    else (cd "$STATE" && "$BINDIR/$1" "${@:2}") 9>&-; fi
}

# sql PORT QUERY: one value-only query over TCP (no retry, 2 s connect timeout).
sql() {
    PGCONNECT_TIMEOUT=2 "$BINDIR/psql" -X -q -A -t -w -v ON_ERROR_STOP=1 \
        -h 127.0.0.1 -p "$1" -U postgres -d postgres -c "$2" 2>/dev/null
}

# alive PID [COMM]: PID runs (not a zombie) and, if given, is the program COMM.
alive() {
    local st comm
    read -r st comm < <(ps -o stat=,comm= -p "$1" 2>/dev/null) || return 1
    [[ $st != Z* && ( -z ${2:-} || $comm == "$2" ) ]]
}

# pg_running DIR: its postmaster runs (not `pg_ctl status`, which takes a zombie for alive).
pg_running() {
    local pid
    pid=$(head -n1 "$1/data/postmaster.pid" 2>/dev/null || true)
    [[ $pid =~ ^[0-9]+$ ]] && alive "$pid" postgres
}

# pg_start DIR PORT
pg_start() {
    local dir=$1 port=$2
    pg_running "$dir" && return 0
    rm -f "$dir/data/postmaster.pid"
    bind_retry "$port" "$dir/server.log" pg pg_ctl -D "$dir/data" -l "$dir/server.log" -w -t 60 start >/dev/null \
        || { tail -n 30 "$dir/server.log" >&2 || true; die "PostgreSQL in $dir did not start on port $port"; }
}

# pg_stop DIR MODE
pg_stop() {
    pg_running "$1" || return 0
    pg pg_ctl -D "$1/data" -m "$2" -w -t 60 stop >/dev/null \
        || pg pg_ctl -D "$1/data" -m immediate -w -t 60 stop >/dev/null || true
}

# wait_for PORT QUERY EXPECTED SECONDS: poll until QUERY on PORT returns EXPECTED.
wait_for() {
    local i n=$(($4 * 20))
    for ((i = 0; i < n; i++)); do
        [[ $(sql "$1" "$2" || true) == "$3" ]] && return 0
        sleep 0.05
    done
    return 1
}

# elapsed T0: seconds since T0 (microseconds from ${EPOCHREALTIME/./}), one decimal.
elapsed() {
    local us=$((${EPOCHREALTIME/./} - $1))
    printf '%d.%d' $((us / 1000000)) $((us / 100000 % 10))
}

new_dir() {
    rm -rf "$1"
    mkdir -p "$1"
    ((IS_ROOT)) && chown postgres:postgres "$1"
    return 0
}

# -------------------------------------------------------------- the pair --

# The template data dir, made once per state dir (a copy is faster than initdb).
make_template() {
    [[ -f $TEMPLATE/data/PG_VERSION ]] && return 0
    new_dir "$TEMPLATE"
    pg initdb -D "$TEMPLATE/data" -A trust -U postgres -E UTF8 --locale=C.UTF-8 --no-sync \
        >"$TEMPLATE/initdb.log" 2>&1 || { cat "$TEMPLATE/initdb.log" >&2; die "initdb failed"; }
    local sync_names="'*'"
    [[ $SYNC == 0 ]] && sync_names="''"
    # initdb's pg_hba.conf already trusts 127.0.0.1/32, replication included.
    cat >>"$TEMPLATE/data/postgresql.conf" <<EOF

# --- sqla-proletarian primary/standby pair ---
port = $PRIMARY_PORT
listen_addresses = '127.0.0.1'
unix_socket_directories = '$PRIMARY'
max_connections = 200
shared_buffers = 64MB
fsync = off
full_page_writes = off
logging_collector = off
wal_level = replica
wal_keep_size = 256MB
hot_standby = on
wal_receiver_status_interval = 1s
synchronous_standby_names = $sync_names
synchronous_commit = on
EOF
}

# A fresh pair: the primary and its standby are both copies of the template, a cluster
# shut down cleanly and never started since (as a base backup of it would be, without the
# backup's checkpoint and copy through the server): the standby streams from there.
build_pair() {
    pg_stop "$STANDBY" immediate
    pg_stop "$PRIMARY" immediate
    free_port "$STANDBY_PORT" "$STATE" QUIT
    free_port "$PRIMARY_PORT" "$STATE" QUIT
    rm -f "$FAILED_OVER" "$ENV_FILE"
    make_template
    rm -rf "$PRIMARY" "$STANDBY"
    cp -a "$TEMPLATE" "$PRIMARY" & cp -a "$TEMPLATE" "$STANDBY"; wait
    rm -f "$PRIMARY/initdb.log" "$STANDBY/initdb.log"
    touch "$STANDBY/data/standby.signal"
    ((IS_ROOT)) && chown postgres:postgres "$STANDBY/data/standby.signal"
    # Later lines win. A promoted standby has no standby of its own to wait for.
    cat >>"$STANDBY/data/postgresql.conf" <<EOF

# --- the standby ---
port = $STANDBY_PORT
unix_socket_directories = '$STANDBY'
primary_conninfo = 'host=127.0.0.1 port=$PRIMARY_PORT user=postgres application_name=standby'
synchronous_standby_names = ''
EOF
    pg_start "$PRIMARY" "$PRIMARY_PORT"
    pg_start "$STANDBY" "$STANDBY_PORT"
    wait_for "$PRIMARY_PORT" \
        "SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming'" 1 60 \
        || { tail -n 30 "$STANDBY/server.log" >&2 || true; die "the standby did not start streaming"; }
    write_env
}

# Healthy: the first primary takes writes and its standby streams to it (one query).
healthy() {
    [[ ! -e $FAILED_OVER && -f $ENV_FILE ]] || return 1
    grep -qx "export SP_PGPAIR_SYNC=$SYNC" "$ENV_FILE" || return 1  # made with the other mode
    [[ $(sql "$PRIMARY_PORT" "SELECT pg_is_in_recovery()::text || ':' || (SELECT count(*) FROM pg_stat_replication WHERE state = 'streaming')" || true) == false:1 ]]
}

write_env() {
    local hosts="host=127.0.0.1:$PRIMARY_PORT&host=127.0.0.1:$STANDBY_PORT"
    cat >"$ENV_FILE" <<EOF
export SP_TEST_PGPAIR_PRIMARY_URL=postgresql+psycopg://postgres@127.0.0.1:$PRIMARY_PORT/postgres
export SP_TEST_PGPAIR_STANDBY_URL=postgresql+psycopg://postgres@127.0.0.1:$STANDBY_PORT/postgres
export SP_TEST_PGPAIR_MULTIHOST_URL='postgresql+psycopg://postgres@/postgres?$hosts&target_session_attrs=read-write'
export SP_PGPAIR_SCRIPT=$SCRIPT
export SP_PGPAIR_DIR=$STATE
export SP_PGPAIR_PRIMARY_PORT=$PRIMARY_PORT
export SP_PGPAIR_STANDBY_PORT=$STANDBY_PORT
export SP_PGPAIR_SYNC=$SYNC
EOF
}

ensure_state_dir() {
    [[ -x $BINDIR/initdb ]] || die "PostgreSQL 15 not found in $BINDIR (apt-get install postgresql-15, or set SP_PGPAIR_BINDIR)"
    mkdir -p "$STATE"
    chmod 755 "$STATE"
    if ((IS_ROOT)); then
        runuser -u postgres -- test -x "$STATE" \
            || die "$STATE is not reachable by user postgres; set SP_PGPAIR_DIR elsewhere (e.g. under /tmp)"
    fi
}

# --------------------------------------------------------------- commands --

cmd_ensure() {
    local quiet=$1 t0
    healthy && { ((quiet)) || log "pair already running; env in $ENV_FILE"; return 0; }
    t0=${EPOCHREALTIME/./}
    ensure_state_dir
    build_pair
    log "primary on 127.0.0.1:$PRIMARY_PORT, standby on 127.0.0.1:$STANDBY_PORT ($( [[ $SYNC == 0 ]] && echo asynchronous || echo synchronous) replication), started in $(elapsed "$t0") s; env in $ENV_FILE"
}

cmd_failover() {
    [[ -f $ENV_FILE ]] || die "not started (no $ENV_FILE); run '$0 start' first"
    [[ -e $FAILED_OVER ]] && die "already failed over; run '$0 ensure' for a fresh pair"
    pg_running "$STANDBY" || die "the standby is not running"
    touch "$FAILED_OVER"
    pg pg_ctl -D "$PRIMARY/data" -m immediate -w -t 60 stop >/dev/null \
        || die "could not stop the primary"
    pg pg_ctl -D "$STANDBY/data" -w -t 60 promote >/dev/null || die "promotion failed"
    wait_for "$STANDBY_PORT" "SELECT pg_is_in_recovery()" f 60 \
        || die "the promoted standby does not accept writes"
    log "primary on 127.0.0.1:$PRIMARY_PORT stopped; 127.0.0.1:$STANDBY_PORT promoted and accepts writes"
}

cmd_stop() {
    [[ -d $STATE ]] || return 0
    pg_stop "$STANDBY" fast
    pg_stop "$PRIMARY" fast
    rm -rf "$STATE"
}

cmd_status() {
    local rc=0 dir port role
    for dir in "$PRIMARY" "$STANDBY"; do
        port=$PRIMARY_PORT; [[ $dir == "$STANDBY" ]] && port=$STANDBY_PORT
        if pg_running "$dir"; then
            role=$(sql "$port" "SELECT CASE WHEN pg_is_in_recovery() THEN 'standby' ELSE 'primary (read-write)' END" || echo "not answering")
            echo "$(basename "$dir"): running on 127.0.0.1:$port as $role"
        else
            echo "$(basename "$dir"): stopped"; rc=1
        fi
    done
    [[ -e $FAILED_OVER ]] && echo "failed over: the next 'ensure' rebuilds the pair"
    echo "state: $STATE"
    return $rc
}

cmd_env() {
    [[ -f $ENV_FILE ]] || die "not started (no $ENV_FILE); run '$0 start' first"
    cat "$ENV_FILE"
}

# One command at a time per state dir (parallel test workers call `ensure` together).
locked() {
    exec 9>"$LOCK_FILE"
    flock -w 300 9 || die "another pgpair.sh holds $LOCK_FILE"
    "$@"
}

case "${1:-}" in
    start)    locked cmd_ensure 0 ;;
    ensure)   locked cmd_ensure 1 ;;
    failover) locked cmd_failover ;;
    stop)     locked cmd_stop ;;
    status)   cmd_status ;;
    env)      cmd_env ;;
    *) echo "usage: $0 start|ensure|failover|stop|status|env" >&2; exit 2 ;;
esac
