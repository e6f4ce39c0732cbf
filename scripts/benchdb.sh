#!/usr/bin/env bash
# Private, throw-away PostgreSQL and MariaDB servers for the benchmark (make bench).
#
#   scripts/benchdb.sh start    install missing servers (root only), create + start both
#   scripts/benchdb.sh stop     fast shutdown of both, remove the state directory
#   scripts/benchdb.sh env      print the env file (shell `export` lines)
#   scripts/benchdb.sh status   show whether each server is running
#
# Unlike the test servers (scripts/testdb.sh), these are DURABLE: every commit waits for
# the disk (PostgreSQL fsync, synchronous_commit and full_page_writes on; MariaDB
# innodb_flush_log_at_trx_commit=1 with the doublewrite buffer), as in production.
# State lives in ${SP_BENCHDB_DIR:-/tmp/sqla-proletarian-benchdb}; the servers listen
# on 127.0.0.1 only (PostgreSQL 25442, MariaDB 23316: below the ephemeral ports, which a
# client socket may hold; SP_BENCHDB_PG_PORT and SP_BENCHDB_MY_PORT
# move them), apart from the test servers.
set -euo pipefail

STATE="${SP_BENCHDB_DIR:-/tmp/sqla-proletarian-benchdb}"
PG_PORT="${SP_BENCHDB_PG_PORT:-25442}"
MY_PORT="${SP_BENCHDB_MY_PORT:-23316}"

PG_DIR="$STATE/pg"        # data dir: $PG_DIR/data, socket dir: $PG_DIR
MY_DIR="$STATE/mariadb"   # data dir: $MY_DIR/data, socket/pid/log in $MY_DIR
MY_SOCK="$MY_DIR/mysqld.sock"
MY_PID="$MY_DIR/mysqld.pid"
ENV_FILE="$STATE/env"

IS_ROOT=0; [[ $(id -u) -eq 0 ]] && IS_ROOT=1

log() { echo "benchdb: $*" >&2; }
die() { echo "benchdb: ERROR: $*" >&2; exit 1; }

pg_bindir() {
    local d
    d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1 || true)
    if [[ -n $d && -x $d/initdb ]]; then echo "$d"; fi
}

my_prog() {
    local p
    for p in "$(command -v "$1" 2>/dev/null || true)" "/usr/sbin/$1" "/usr/bin/$1"; do
        if [[ -n $p && -x $p ]]; then echo "$p"; return 0; fi
    done
    return 1
}

# Run as the server's OS user when root, from $STATE so that user can read the cwd.
as_user() {
    local user=$1; shift
    if ((IS_ROOT)); then (cd "$STATE" && runuser -u "$user" -- "$@")
    else (cd "$STATE" && "$@"); fi
}

pg() { as_user postgres "$(pg_bindir)/$1" "${@:2}"; }

alive() {
    local st comm
    read -r st comm < <(ps -o stat=,comm= -p "$1" 2>/dev/null) || return 1
    [[ $st != Z* && ( -z ${2:-} || $comm == "$2" ) ]]
}

pg_running() {
    local pid
    pid=$(head -n1 "$PG_DIR/data/postmaster.pid" 2>/dev/null || true)
    [[ $pid =~ ^[0-9]+$ ]] && alive "$pid" postgres
}

my_admin() {
    "$(my_prog mariadb-admin)" --no-defaults --protocol=socket --socket="$MY_SOCK" -uroot "$@"
}

my_running() {
    [[ -S $MY_SOCK ]] || return 1
    my_admin --connect-timeout=2 ping >/dev/null 2>&1
}

ensure_installed() {
    local pkgs=()
    [[ -n $(pg_bindir) ]] || pkgs+=(postgresql)
    my_prog mariadbd >/dev/null && my_prog mariadb-install-db >/dev/null || pkgs+=(mariadb-server)
    my_prog mariadb-admin >/dev/null && my_prog mariadb >/dev/null || pkgs+=(mariadb-client)
    ((${#pkgs[@]})) || return 0
    ((IS_ROOT)) || die "missing database servers; install them first, e.g.:
    sudo apt-get install -y --no-install-recommends ${pkgs[*]}"
    log "installing ${pkgs[*]} (apt-get) ..."
    # Keep the packages' default clusters from being started (no systemd here).
    local made_policy=0
    if [[ ! -e /usr/sbin/policy-rc.d ]]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        made_policy=1
    fi
    local rc=0
    { DEBIAN_FRONTEND=noninteractive apt-get update -q &&
      DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${pkgs[@]}"
    } >&2 || rc=$?
    ((made_policy)) && rm -f /usr/sbin/policy-rc.d
    ((rc == 0)) || die "apt-get install ${pkgs[*]} failed (exit $rc)"
    [[ -n $(pg_bindir) ]] || die "PostgreSQL still not found under /usr/lib/postgresql/*/bin"
    my_prog mariadbd >/dev/null || die "mariadbd still not found"
}

pg_start() {
    pg_running && return 0
    if [[ ! -f $PG_DIR/data/PG_VERSION ]]; then
        rm -rf "$PG_DIR"
        mkdir -p "$PG_DIR"
        ((IS_ROOT)) && chown postgres:postgres "$PG_DIR"
        pg initdb -D "$PG_DIR/data" -A trust -U postgres -E UTF8 --locale=C.UTF-8 \
            >"$PG_DIR/initdb.log" 2>&1 || { cat "$PG_DIR/initdb.log" >&2; die "initdb failed"; }
        cat >>"$PG_DIR/data/postgresql.conf" <<EOF

# --- sqla-proletarian benchmark server: durable, as in production ---
port = $PG_PORT
listen_addresses = '127.0.0.1'
unix_socket_directories = '$PG_DIR'
max_connections = 200
shared_buffers = 512MB
fsync = on
synchronous_commit = on
full_page_writes = on
max_wal_size = 4GB
logging_collector = off
EOF
    fi
    # Server time per statement (benchmarks.statements): loaded always, counting only while
    # that benchmark turns pg_stat_statements.track on, so the other figures do not pay for it.
    if ! grep -q '^shared_preload_libraries' "$PG_DIR/data/postgresql.conf"; then
        cat >>"$PG_DIR/data/postgresql.conf" <<EOF
shared_preload_libraries = 'pg_stat_statements'
pg_stat_statements.track = none
pg_stat_statements.max = 1000
EOF
    fi
    rm -f "$PG_DIR/data/postmaster.pid" "$PG_DIR/.s.PGSQL.$PG_PORT.lock"
    pg pg_ctl -D "$PG_DIR/data" -l "$PG_DIR/server.log" -w -t 60 start >/dev/null \
        || { tail -n 30 "$PG_DIR/server.log" >&2 || true; die "PostgreSQL did not start (port $PG_PORT in use?)"; }
}

pg_stop() {
    pg_running || return 0
    pg pg_ctl -D "$PG_DIR/data" -m fast -w -t 60 stop >/dev/null
}

my_start() {
    my_running && return 0
    local user_opt=(); ((IS_ROOT)) && user_opt=(--user=mysql)
    if [[ ! -d $MY_DIR/data/mysql ]]; then
        rm -rf "$MY_DIR"
        mkdir -p "$MY_DIR"
        ((IS_ROOT)) && chown mysql:mysql "$MY_DIR"
        as_user mysql "$(my_prog mariadb-install-db)" --no-defaults "${user_opt[@]}" \
            --datadir="$MY_DIR/data" --auth-root-authentication-method=normal \
            --skip-test-db --skip-name-resolve >"$MY_DIR/install.log" 2>&1 \
            || { cat "$MY_DIR/install.log" >&2; die "mariadb-install-db failed"; }
    fi
    ((IS_ROOT)) && install -d -o mysql -g mysql /run/mysqld
    (cd "$STATE" && exec setsid "$(my_prog mariadbd)" --no-defaults "${user_opt[@]}" \
        --datadir="$MY_DIR/data" --socket="$MY_SOCK" --pid-file="$MY_PID" \
        --port="$MY_PORT" --bind-address=127.0.0.1 --skip-name-resolve \
        --log-error="$MY_DIR/server.log" --max-connections=300 \
        --character-set-server=utf8mb4 --collation-server=utf8mb4_general_ci \
        --innodb-flush-log-at-trx-commit=1 --innodb-doublewrite=1 \
        --innodb-buffer-pool-size=1G --innodb-log-file-size=512M --skip-log-bin \
        </dev/null >/dev/null 2>&1 &)
    local i
    for ((i = 0; i < 600; i++)); do   # up to 60 s
        if my_running; then
            "$(my_prog mariadb)" --no-defaults --protocol=socket --socket="$MY_SOCK" -uroot <<EOF
DELETE FROM mysql.global_priv
 WHERE User = '' OR (User = 'root' AND Host NOT IN ('localhost', '127.0.0.1', '::1'));
FLUSH PRIVILEGES;
CREATE USER IF NOT EXISTS 'root'@'127.0.0.1';
GRANT ALL PRIVILEGES ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION;
FLUSH PRIVILEGES;
EOF
            return 0
        fi
        sleep 0.1
    done
    tail -n 30 "$MY_DIR/server.log" >&2 || true
    die "MariaDB did not start (port $MY_PORT in use?)"
}

my_stop() {
    local pid i
    pid=$(cat "$MY_PID" 2>/dev/null || true)
    if [[ ! $pid =~ ^[0-9]+$ ]] || ! alive "$pid" mariadbd; then
        if my_running; then my_admin shutdown >/dev/null 2>&1 || true; fi
        return 0
    fi
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 1200; i++)); do   # up to 60 s
        alive "$pid" mariadbd || return 0
        sleep 0.05
    done
    log "mariadbd ($pid) did not shut down; killing it"
    kill -KILL "$pid" 2>/dev/null || true
}

cmd_start() {
    local t0=$SECONDS
    ensure_installed
    mkdir -p "$STATE"
    chmod 755 "$STATE"
    if ((IS_ROOT)); then
        runuser -u postgres -- test -x "$STATE" \
            || die "$STATE is not reachable by user postgres; set SP_BENCHDB_DIR elsewhere (e.g. under /tmp)"
    fi
    pg_start
    my_start
    cat >"$ENV_FILE" <<EOF
export SP_BENCH_POSTGRESQL_URL=postgresql+psycopg://postgres@127.0.0.1:$PG_PORT/postgres
export SP_BENCH_MARIADB_URL=mysql+pymysql://root@127.0.0.1:$MY_PORT/mysql
EOF
    log "durable PostgreSQL on 127.0.0.1:$PG_PORT, MariaDB on 127.0.0.1:$MY_PORT ($((SECONDS - t0)) s); env in $ENV_FILE"
}

cmd_stop() {
    [[ -d $STATE ]] || return 0
    pg_stop || log "PostgreSQL stop failed"
    my_stop || log "MariaDB stop failed"
    rm -rf "$STATE"
}

cmd_status() {
    local rc=0
    if pg_running; then echo "postgresql: running on 127.0.0.1:$PG_PORT"
    else echo "postgresql: stopped"; rc=1; fi
    if my_running; then echo "mariadb: running on 127.0.0.1:$MY_PORT"
    else echo "mariadb: stopped"; rc=1; fi
    echo "state: $STATE"
    return $rc
}

case "${1:-}" in
    start)  cmd_start ;;
    stop)   cmd_stop ;;
    env)    [[ -f $ENV_FILE ]] || die "not started; run '$0 start' first"; cat "$ENV_FILE" ;;
    status) cmd_status ;;
    *) echo "usage: $0 start|stop|env|status" >&2; exit 2 ;;
esac
