#!/usr/bin/env bash
# A private, throw-away three-node MariaDB Galera cluster for tests/galera.
#
#   scripts/galera.sh start        create and start the three nodes (idempotent), print the time
#   scripts/galera.sh ensure       make sure all three nodes run and are synced (restarts any
#                                  that is down); what test fixtures call before each test
#   scripts/galera.sh stop         fast shutdown of all nodes, remove the state directory
#   scripts/galera.sh kill N       SIGKILL node N (1, 2 or 3), as a crash would
#   scripts/galera.sh restart N    start node N again (it rejoins through IST or SST) and wait
#                                  until it is synced
#   scripts/galera.sh env          print the env file (shell `export` lines)
#   scripts/galera.sh status       each node: running or not, its wsrep state and cluster size
#
# The nodes listen on 127.0.0.1 ports ${SP_GALERA_PORTS:-23326 23327 23328}; node N's group
# communication (gcomm) listens on its port + 1000, its IST receiver on + 1100 and its rsync SST
# receiver on + 1200. The first node of a new cluster is bootstrapped (--wsrep-new-cluster);
# the others join it with an rsync state transfer. State lives in
# ${SP_GALERA_DIR:-/tmp/sqla-proletarian-galera}: it must be reachable by the mysql user when
# run as root (mariadbd then runs as mysql). Tuned for speed, not durability. The env file
# exports SP_TEST_GALERA_URLS (the three nodes' URLs, space separated) and SP_GALERA_SCRIPT.
set -euo pipefail

STATE="${SP_GALERA_DIR:-/tmp/sqla-proletarian-galera}"
read -r -a PORTS <<<"${SP_GALERA_PORTS:-23326 23327 23328}"
((${#PORTS[@]} == 3)) || { echo "galera: ERROR: SP_GALERA_PORTS needs three ports" >&2; exit 2; }
MY_USER=root   # root@127.0.0.1: no password, ALL PRIVILEGES WITH GRANT OPTION
PROVIDER=${SP_GALERA_PROVIDER:-/usr/lib/galera/libgalera_smm.so}
ENV_FILE="$STATE/env"

SCRIPT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
IS_ROOT=0; [[ $(id -u) -eq 0 ]] && IS_ROOT=1

log() { echo "galera: $*" >&2; }
die() { echo "galera: ERROR: $*" >&2; exit 1; }
# shellcheck source=scripts/ports.sh
source "$(dirname "$SCRIPT")/ports.sh"

# ---------------------------------------------------------------- helpers --

my_prog() {
    local p
    for p in "$(command -v "$1" 2>/dev/null || true)" "/usr/sbin/$1" "/usr/bin/$1"; do
        if [[ -n $p && -x $p ]]; then echo "$p"; return 0; fi
    done
    return 1
}

as_mysql() {
    if ((IS_ROOT)); then (cd "$STATE" && runuser -u mysql -- "$@")
    else (cd "$STATE" && "$@"); fi
}

node_dir() { echo "$STATE/node$1"; }
node_port() { echo "${PORTS[$(($1 - 1))]}"; }
gcomm_port() { echo $(($(node_port "$1") + 1000)); }
node_sock() { echo "$(node_dir "$1")/mysqld.sock"; }
# The pid of the mariadbd we launched (its own pid file appears only after a state transfer).
node_pid() { cat "$(node_dir "$1")/launch.pid" 2>/dev/null || true; }

check_node() { [[ ${1:-} =~ ^[123]$ ]] || die "usage: $0 ${2:-kill|restart} 1|2|3"; }

alive() {
    local st comm
    read -r st comm < <(ps -o stat=,comm= -p "$1" 2>/dev/null) || return 1
    [[ $st != Z* && ( -z ${2:-} || $comm == "$2" ) ]]
}

# sql N STATEMENT: run a statement on node N over its socket, tab-separated output.
sql() {
    "$(my_prog mariadb)" --no-defaults --protocol=socket --socket="$(node_sock "$1")" -uroot \
        --connect-timeout=2 -N -B -e "$2" 2>/dev/null
}

running() {
    local pid
    pid=$(node_pid "$1")
    [[ $pid =~ ^[0-9]+$ ]] && alive "$pid" mariadbd
}

# wsrep_var N NAME: a wsrep status variable of node N (empty when it does not answer).
wsrep_var() { sql "$1" "SHOW GLOBAL STATUS LIKE '$2'" | cut -f2 || true; }

synced() {
    running "$1" || return 1
    [[ $(wsrep_var "$1" wsrep_local_state_comment) == Synced &&
       $(wsrep_var "$1" wsrep_ready) == ON ]]
}

running_nodes() {
    local n
    for n in 1 2 3; do running "$n" && echo "$n"; done
    return 0
}

# ------------------------------------------------------------------ nodes --

node_init() {
    local dir
    dir=$(node_dir "$1")
    [[ -d $dir/data ]] && return 0
    mkdir -p "$dir/data"
    ((IS_ROOT)) && chown -R mysql:mysql "$dir"
    # Only the first node gets a system database of its own: the others receive the
    # cluster's in their first state transfer.
    if (($1 == 1)); then
        local user_opt=(); ((IS_ROOT)) && user_opt=(--user=mysql)
        as_mysql "$(my_prog mariadb-install-db)" --no-defaults "${user_opt[@]}" \
            --datadir="$dir/data" --auth-root-authentication-method=normal \
            --skip-test-db --skip-name-resolve >"$dir/install.log" 2>&1 \
            || { cat "$dir/install.log" >&2; die "mariadb-install-db failed"; }
    fi
}

# node_launch N [--wsrep-new-cluster]: start node N's mariadbd in the background.
node_launch() {
    local n=$1 dir port gport peers="" m
    dir=$(node_dir "$n"); port=$(node_port "$n"); gport=$(gcomm_port "$n")
    for m in 1 2 3; do peers+="${peers:+,}127.0.0.1:$(gcomm_port "$m")"; done
    rm -f "$dir/mysqld.sock" "$dir/mysqld.sock.lock"
    free_port "$port" "$STATE"
    free_port "$gport" "$STATE"
    local user_opt=(); ((IS_ROOT)) && user_opt=(--user=mysql)
    # Failure detection in seconds rather than the default 15: a killed node is dropped from
    # the group quickly, so the others go on committing.
    local provider_options="base_host=127.0.0.1;base_port=$gport"
    provider_options+=";gmcast.listen_addr=tcp://127.0.0.1:$gport"
    provider_options+=";ist.recv_addr=127.0.0.1:$((port + 1100))"
    provider_options+=";evs.keepalive_period=PT0.5S;evs.inactive_check_period=PT0.5S"
    provider_options+=";evs.suspect_timeout=PT2S;evs.inactive_timeout=PT5S"
    provider_options+=";evs.install_timeout=PT3S;gcache.size=128M;pc.recovery=false"
    (cd "$STATE" && exec setsid "$(my_prog mariadbd)" --no-defaults "${user_opt[@]}" \
        --datadir="$dir/data" --socket="$dir/mysqld.sock" --pid-file="$dir/mysqld.pid" \
        --port="$port" --bind-address=127.0.0.1 --skip-name-resolve \
        --log-error="$dir/server.log" --max-connections=500 \
        --character-set-server=utf8mb4 --collation-server=utf8mb4_general_ci \
        --innodb-flush-log-at-trx-commit=0 --innodb-doublewrite=0 \
        --innodb-buffer-pool-size=128M --innodb-log-file-size=48M --sync-binlog=0 \
        --binlog-format=ROW --default-storage-engine=InnoDB --innodb-autoinc-lock-mode=2 \
        --performance-schema=OFF \
        --wsrep-on=ON --wsrep-provider="$PROVIDER" --wsrep-cluster-name=sqla_proletarian \
        --wsrep-cluster-address="gcomm://$peers" --wsrep-node-name="node$n" \
        --wsrep-node-address="127.0.0.1:$gport" --wsrep-node-incoming-address="127.0.0.1:$port" \
        --wsrep-sst-method=rsync --wsrep-sst-receive-address="127.0.0.1:$((port + 1200))" \
        --wsrep-provider-options="$provider_options" --wsrep-slave-threads=2 \
        "${@:2}" </dev/null >/dev/null 2>&1 & echo $! >"$dir/launch.pid")
}

# wait_synced N [SECONDS]: until node N is synced, or die showing its log.
wait_synced() {
    local n=$1 limit=${2:-120} i pid
    for ((i = 0; i < limit * 10; i++)); do
        synced "$n" && return 0
        # A joiner whose state transfer failed exits: no use waiting.
        if ((i > 20)); then
            pid=$(node_pid "$n")
            if [[ ! $pid =~ ^[0-9]+$ ]] || ! alive "$pid" mariadbd; then break; fi
        fi
        sleep 0.1
    done
    tail -n 40 "$(node_dir "$n")/server.log" >&2 || true
    die "node $n (port $(node_port "$n"), holding it: $(port_holders "$(node_port "$n")")) did not become synced"
}

primary() { [[ $(wsrep_var "$1" wsrep_cluster_status) == Primary ]]; }

# Before a node starts again: the running nodes have dropped its old self from the group
# (their cluster size counts only them) and form the primary component. A node that joined
# while the others still wait for its killed self can leave them split up, non-primary.
# Running nodes stuck without a primary component (all others died at once) are made one
# again: pc.bootstrap on the first.
wait_group_settled() {
    local up=() n i size ok
    for n in 1 2 3; do running "$n" && up+=("$n"); done
    ((${#up[@]})) || return 0
    for ((i = 0; i < 300; i++)); do   # up to 30 s
        ok=1
        for n in "${up[@]}"; do
            size=$(wsrep_var "$n" wsrep_cluster_size)
            if ! primary "$n" || [[ $size != "${#up[@]}" ]]; then ok=0; break; fi
        done
        ((ok)) && return 0
        # Still no primary component after 10 s: make one of the first running node.
        if ((i == 100)) && ! primary "${up[0]}"; then
            log "no primary component; bootstrapping it on node ${up[0]}"
            sql "${up[0]}" "SET GLOBAL wsrep_provider_options='pc.bootstrap=YES'" || true
        fi
        sleep 0.1
    done
    log "the running nodes (${up[*]}) did not settle into one primary component"
}

# A bootstrap from an existing data directory needs it marked safe (throw-away data).
mark_safe_to_bootstrap() {
    local grastate
    grastate="$(node_dir "$1")/data/grastate.dat"
    [[ -f $grastate ]] && sed -i 's/^safe_to_bootstrap: 0/safe_to_bootstrap: 1/' "$grastate"
    return 0
}

setup_users() {
    sql 1 "SELECT 1" >/dev/null || die "node 1 does not answer"
    "$(my_prog mariadb)" --no-defaults --protocol=socket --socket="$(node_sock 1)" -uroot <<EOF
DELETE FROM mysql.global_priv
 WHERE User = '' OR (User = 'root' AND Host NOT IN ('localhost', '127.0.0.1', '::1'));
DELETE FROM mysql.proxies_priv WHERE Host NOT IN ('localhost', '127.0.0.1', '::1');
FLUSH PRIVILEGES;
CREATE USER IF NOT EXISTS '$MY_USER'@'127.0.0.1';
GRANT ALL PRIVILEGES ON *.* TO '$MY_USER'@'127.0.0.1' WITH GRANT OPTION;
FLUSH PRIVILEGES;
EOF
}

# node_stop N SIGNAL: send SIGNAL to node N and wait until it is gone.
node_stop() {
    local pid i
    pid=$(node_pid "$1")
    [[ $pid =~ ^[0-9]+$ ]] && alive "$pid" mariadbd || return 0
    kill "-$2" "$pid" 2>/dev/null || true
    for ((i = 0; i < 600; i++)); do   # up to 30 s
        alive "$pid" mariadbd || return 0
        sleep 0.05
    done
    log "node $1 ($pid) did not stop; killing it"
    kill -KILL "$pid" 2>/dev/null || true
    sleep 0.2
}

write_env() {
    local urls="" n
    for n in 1 2 3; do urls+="${urls:+ }mysql+pymysql://$MY_USER@127.0.0.1:$(node_port "$n")/"; done
    cat >"$ENV_FILE" <<EOF
export SP_TEST_GALERA_URLS="$urls"
export SP_GALERA_SCRIPT=$SCRIPT
export SP_GALERA_DIR=$STATE
export SP_GALERA_PORTS="${PORTS[*]}"
EOF
}

ensure_state_dir() {
    mkdir -p "$STATE"
    chmod 755 "$STATE"
    if ((IS_ROOT)); then
        runuser -u mysql -- test -x "$STATE" \
            || die "$STATE is not reachable by user mysql; set SP_GALERA_DIR elsewhere (e.g. under /tmp)"
    fi
}

# --------------------------------------------------------------- commands --

# Start whatever is down: with no node running, node 1 bootstraps a new cluster; the others
# (or every node, when some are up) join the running ones, one at a time (one donor each).
bring_up() {
    my_prog mariadbd >/dev/null || die "mariadbd not found (apt-get install mariadb-server)"
    [[ -f $PROVIDER ]] || die "Galera provider $PROVIDER not found (apt-get install galera-4)"
    command -v rsync >/dev/null || die "rsync not found (apt-get install rsync)"
    ensure_state_dir
    local n
    for n in 1 2 3; do node_init "$n"; done
    if [[ -z $(running_nodes) ]]; then
        mark_safe_to_bootstrap 1
        node_launch 1 --wsrep-new-cluster
        wait_synced 1
        setup_users
    fi
    for n in 1 2 3; do
        running "$n" && continue
        wait_group_settled
        node_launch "$n"
        wait_synced "$n"
    done
    for n in 1 2 3; do synced "$n" || wait_synced "$n"; done
    write_env
}

cmd_start() {
    local t0=${EPOCHREALTIME/[.,]/} tenths
    bring_up
    tenths=$(((${EPOCHREALTIME/[.,]/} - t0) / 100000))
    log "three nodes on 127.0.0.1:${PORTS[*]} ($((tenths / 10)).$((tenths % 10)) s); env in $ENV_FILE"
}

cmd_ensure() {
    [[ -f $ENV_FILE ]] || die "not started (no $ENV_FILE); run '$0 start' first"
    local n
    for n in 1 2 3; do synced "$n" || { bring_up; return 0; }; done
}

cmd_stop() {
    [[ -d $STATE ]] || return 0
    local n
    for n in 3 2 1; do node_stop "$n" TERM || log "node $n stop failed"; done
    rm -rf "$STATE"
}

cmd_kill() {
    check_node "${1:-}" kill
    running "$1" || die "node $1 is not running"
    node_stop "$1" KILL
}

cmd_restart() {
    check_node "${1:-}" restart
    [[ -f $ENV_FILE ]] || die "not started (no $ENV_FILE); run '$0 start' first"
    node_stop "$1" TERM
    if [[ -z $(running_nodes) ]]; then bring_up; return 0; fi
    wait_group_settled
    node_launch "$1"
    wait_synced "$1"
}

cmd_env() {
    [[ -f $ENV_FILE ]] || die "not started (no $ENV_FILE); run '$0 start' first"
    cat "$ENV_FILE"
}

cmd_status() {
    local rc=0 n
    for n in 1 2 3; do
        if running "$n"; then
            echo "node$n: running on 127.0.0.1:$(node_port "$n")," \
                "$(wsrep_var "$n" wsrep_local_state_comment), cluster size $(wsrep_var "$n" wsrep_cluster_size)"
            synced "$n" || rc=1
        else echo "node$n: stopped"; rc=1; fi
    done
    echo "state: $STATE"
    return $rc
}

case "${1:-}" in
    start)   cmd_start ;;
    ensure)  cmd_ensure ;;
    stop)    cmd_stop ;;
    kill)    cmd_kill "${2:-}" ;;
    restart) cmd_restart "${2:-}" ;;
    env)     cmd_env ;;
    status)  cmd_status ;;
    *) echo "usage: $0 start|ensure|stop|kill N|restart N|env|status" >&2; exit 2 ;;
esac
