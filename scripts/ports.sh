# Sourced by testdb.sh, pgpair.sh and galera.sh (each defines `log`): making way on a TCP
# port for one of their servers.
#
# Their default ports lie below 32768, outside Linux's range for the local ports of outgoing
# connections (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by default): a client's
# connection, for instance one a Galera node opens to another while the PostgreSQL pair
# starts beside it, cannot hold a port that one of these servers is about to listen on.

# port_holders PORT: the sockets on PORT, listening or connected, with their processes (as
# root: every user's), on one line.
port_holders() {
    { ss -Hltnp "sport = :$1"; ss -Htnp "sport = :$1"; } 2>/dev/null | tr -s ' \n' ' '
}

# free_port PORT STATE [SIGNAL]: before a server of ours starts on PORT. A server that an
# earlier run left listening there (its command line names a path under STATE, e.g. one whose
# state directory was removed while it ran) is sent SIGNAL (TERM by default), then killed
# after 10 s. Anything else on the port is left alone: the start fails and says what holds it.
free_port() {
    local port=$1 state=$2 signal=${3:-TERM} pid cmd i
    for pid in $(ss -Hltnp "sport = :$port" 2>/dev/null | grep -o 'pid=[0-9]*' | cut -d= -f2 | sort -u); do
        cmd=$(tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null || true)
        [[ $cmd == *"$state/"* ]] || continue
        log "port $port: stopping a server an earlier run left there (pid $pid: $cmd)"
        kill "-$signal" "$pid" 2>/dev/null || true
        for ((i = 0; i < 100; i++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
    done
    return 0
}

# bind_retry PORT LOG COMMAND...: run COMMAND, which starts a server logging to LOG. When it
# fails because PORT is taken, log what holds the port and try again, up to 3 times, 2 s
# apart (a connection on it may be closing). Returns COMMAND's status.
bind_retry() {
    local port=$1 logf=$2 try lines
    shift 2
    for try in 1 2 3; do
        lines=0
        [[ -f $logf ]] && lines=$(wc -l <"$logf")
        "$@" && return 0
        tail -n "+$((lines + 1))" "$logf" 2>/dev/null | grep -q "Address already in use" || return 1
        log "port $port is taken (try $try of 3): $(port_holders "$port")"
        ((try < 3)) && sleep 2
    done
    return 1
}
