#!/usr/bin/env bash
# A SLURM cluster on this one machine for development and tests, built from Debian's packages.
#
#   slurm/local_cluster.sh start [--nodes N]   install missing packages, write configs, start daemons
#   slurm/local_cluster.sh stop                cancel running jobs, stop all daemons by PID
#   slurm/local_cluster.sh status              show daemons + sinfo; exit 0 only if all are up
#
# One node by default (named after this host). With --nodes N (N > 1) it is N nodes node1..nodeN,
# each its own slurmd (slurmd -N <node>, port 17000+i), all on this machine: node names resolve
# to 127.0.0.1 through /etc/hosts, every node has this machine's CPUs. Starting with another N
# than the running cluster's reconfigures it (running jobs are lost).
#
# Daemons: munged, MariaDB (for accounting), slurmdbd, slurmctld, one slurmd per node. All run
# as root and are started directly (the target has no systemd). Generated config, state
# and logs live under one state dir:
#
#   SLURM_LOCAL_DIR      state dir              (default /var/tmp/fsdp_research_slurm)
#   SLURM_LOCAL_CLUSTER  ClusterName            (default fsdp_local)
#   SLURM_LOCAL_DB_PORT  MariaDB TCP port       (default 13306, 127.0.0.1 only)
#
# Clients find the config through /etc/slurm/slurm.conf, a symlink into the state dir
# (made only if no real file is there); otherwise export SLURM_CONF=<state>/etc/slurm.conf.
set -euo pipefail

STATE_DIR="${SLURM_LOCAL_DIR:-/var/tmp/fsdp_research_slurm}"
CLUSTER="${SLURM_LOCAL_CLUSTER:-fsdp_local}"
DB_PORT="${SLURM_LOCAL_DB_PORT:-13306}"
ACCOUNT=default
NODE="$(hostname -s)"
START_TIMEOUT=60                       # seconds to wait for the node to become usable

ETC="$STATE_DIR/etc"
RUN="$STATE_DIR/run"
LOG="$STATE_DIR/log"
SPOOL="$STATE_DIR/spool"
MUNGE_DIR="$STATE_DIR/munge"
DB_DIR="$STATE_DIR/mysql"
MY_CNF="$ETC/my.cnf"
# Keep munge's default socket so slurm and munge clients need no extra settings.
MUNGE_SOCKET=/run/munge/munge.socket.2
SYSTEM_SLURM_CONF=/etc/slurm/slurm.conf

# Daemons and every client command below use this config; slurmdbd.conf is looked up
# next to it.
export SLURM_CONF="$ETC/slurm.conf"

PACKAGES=(slurm-wlm slurmdbd munge mariadb-server)
DAEMONS=(munged mariadbd slurmdbd slurmctld)   # start order, then one slurmd per node; stop is reversed
NODES_FILE="$STATE_DIR/nodes"                  # how many nodes the running cluster was started with
HOSTS_TAG="# fsdp_research local_cluster nodes"

# The node names of an N-node cluster: this host for one, node1..nodeN for more.
node_names() {
    local n="$1" i
    if ((n == 1)); then echo "$NODE"; return; fi
    for ((i = 1; i <= n; i++)); do echo "node$i"; done
}

configured_nodes() { cat "$NODES_FILE" 2>/dev/null || echo 1; }

die() { echo "local_cluster: error: $*" >&2; exit 1; }
say() { echo "local_cluster: $*"; }

# die, showing the end of a daemon's log (the usual place the real reason is).
die_log() {
    local log="$1"; shift
    echo "local_cluster: error: $*" >&2
    if [[ -s "$log" ]]; then
        echo "---- last lines of $log ----" >&2
        tail -n 25 "$log" >&2
    fi
    exit 1
}

pidfile() { echo "$RUN/$1.pid"; }
logfile() { echo "$LOG/$1.log"; }

# PID of a running daemon, from its pid file; checks the process name so that a
# stale file whose PID was reused by something else is never trusted. slurmd-<node> is
# the slurmd of that node.
daemon_pid() {
    local name="$1" file pid comm
    file="$(pidfile "$name")"
    [[ -r "$file" ]] || return 1
    pid="$(tr -dc '0-9' <"$file")"
    [[ -n "$pid" ]] || return 1
    comm="$(cat "/proc/$pid/comm" 2>/dev/null)" || return 1
    [[ "$comm" == "${name%%-*}" ]] || return 1
    echo "$pid"
}

running() { daemon_pid "$1" >/dev/null; }

# Poll a command until it succeeds, for at most $1 seconds.
wait_for() {
    local secs="$1"; shift
    local deadline=$((SECONDS + secs))
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.5
    done
}

# ---------------------------------------------------------------- packages

install_packages() {
    local missing=() p
    for p in "${PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' \
            || missing+=("$p")
    done
    ((${#missing[@]})) || return 0
    say "installing ${missing[*]} (apt-get, quiet)"
    # Without systemd the packages' maintainer scripts would start daemons through
    # init.d; a temporary policy-rc.d forbids that (we start our own copies).
    local policy=/usr/sbin/policy-rc.d made_policy=0
    if [[ ! -e "$policy" ]]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy" && chmod 755 "$policy" && made_policy=1
    fi
    local rc=0 aptlog="/tmp/local_cluster_apt.$$.log"
    {
        DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
            -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold \
            "${missing[@]}"
    } >"$aptlog" 2>&1 || rc=$?
    ((made_policy)) && rm -f "$policy"
    ((rc == 0)) || die_log "$aptlog" "apt-get install ${missing[*]} failed (rc=$rc)"
    rm -f "$aptlog"
}

# ---------------------------------------------------------------- configs

# Write $1 from stdin, touching the file only if the content changed.
write_file() {
    local dest="$1" mode="$2" tmp
    tmp="$(mktemp "$dest.XXXXXX")"
    cat >"$tmp"
    chmod "$mode" "$tmp"
    if [[ -f "$dest" ]] && cmp -s "$tmp" "$dest"; then
        rm -f "$tmp"
    else
        mv -f "$tmp" "$dest"
    fi
}

# The NodeName lines: one node as this host, several as nodeI on this host's loopback.
node_lines() {
    local n="$1" hw="$2" i=0 node
    for node in $(node_names "$n"); do
        i=$((i + 1))
        if ((n == 1)); then
            echo "NodeName=$node $hw State=UNKNOWN"
        else
            echo "NodeName=$node NodeHostname=$NODE NodeAddr=127.0.0.1 Port=$((17000 + i)) $hw State=UNKNOWN"
        fi
    done
}

# Several nodes: their names resolve to 127.0.0.1 (one tagged line in /etc/hosts, replaced each start).
write_hosts() {
    local n="$1" names
    names="$(node_names "$n" | tr '\n' ' ')"
    local rest
    rest="$(grep -v "$HOSTS_TAG" /etc/hosts || true)"
    if ((n > 1)); then
        printf '%s\n127.0.0.1 %s %s\n' "$rest" "$names" "$HOSTS_TAG" >/etc/hosts
    else
        printf '%s\n' "$rest" >/etc/hosts
    fi
}

write_configs() {
    local nodes="$1"
    mkdir -p "$ETC" "$RUN" "$LOG" "$SPOOL/ctld" "$MUNGE_DIR" "$DB_DIR"
    local node
    for node in $(node_names "$nodes"); do mkdir -p "$SPOOL/d-$node"; done
    # munged refuses group/other-writable dirs for its key, log and pid file.
    chmod 755 "$STATE_DIR" "$ETC" "$RUN" "$LOG"
    chmod 700 "$MUNGE_DIR"

    # Node hardware exactly as slurmd detects it, so slurmd never drains the node
    # for "low resources". First line of `slurmd -C` is the NodeName= line.
    local hw
    hw="$(slurmd -C 2>/dev/null | head -n1)" || true
    [[ "$hw" == NodeName=* ]] || die "'slurmd -C' gave no hardware line"
    hw="${hw#NodeName=* }"

    write_file "$ETC/slurm.conf" 644 <<EOF
# Generated by slurm/local_cluster.sh; edits are overwritten on the next start.
ClusterName=$CLUSTER
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# Credential lifetime is also the delay before a requeued job may start again
# (default 120 s); 30 s keeps requeue tests short yet is ample for a step launch.
AuthInfo=cred_expire=30
CredType=cred/munge
MpiDefault=none
# Containers have no usable cgroups: track processes via /proc, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
# Cores are consumable, memory is not (jobs need no --mem; --mem must be <= RealMemory).
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
# Re-test pending jobs every 5 s (default 60/30 s): requeued jobs start promptly.
SchedulerParameters=sched_interval=5,bf_interval=5
# Reject jobs that can never run (e.g. -n3 on 2 CPUs) at submit instead of
# leaving them pending forever with Reason=PartitionConfig.
EnforcePartLimits=ALL
# Jobs may be requeued (scontrol requeue, node failure) without --requeue.
JobRequeue=1
# A DOWN node comes back by itself as soon as slurmd registers.
ReturnToService=2
StateSaveLocation=$SPOOL/ctld
# %n: the node a slurmd runs as (slurmd -N <node>).
SlurmdSpoolDir=$SPOOL/d-%n
SlurmctldPidFile=$(pidfile slurmctld)
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$(logfile slurmctld)
SlurmdLogFile=$LOG/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# Short timeouts: a dev cluster should react fast, not ride out network blips.
SlurmctldTimeout=30
# A node whose slurmd is gone is marked DOWN after 60 s (its jobs then requeued). Not 10: on a loaded 2-core machine a
# live slurmd answered a ping too late, and the running job on it was killed (CI, twice). A lost node's job finds
# the loss itself, its step failing (slurm/common.sh: node_lost).
SlurmdTimeout=60
MessageTimeout=10
InactiveLimit=0
KillWait=5
WaitTime=0
MinJobAge=300
MailProg=/bin/true
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
AccountingStoragePort=6819
JobCompType=jobcomp/none
$(node_lines "$nodes" "$hw")
PartitionName=debug Nodes=$(node_names "$nodes" | paste -sd,) Default=YES MaxTime=INFINITE State=UP
EOF

    # Storage password: made once, kept with the database it belongs to.
    local pass_file="$DB_DIR/slurm_db.pass"
    if [[ ! -s "$pass_file" ]]; then
        (umask 077; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$pass_file")
    fi
    write_file "$ETC/slurmdbd.conf" 600 <<EOF
# Generated by slurm/local_cluster.sh.
AuthType=auth/munge
DbdHost=localhost
DbdPort=6819
SlurmUser=root
DebugLevel=info
LogFile=$(logfile slurmdbd)
PidFile=$(pidfile slurmdbd)
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort=$DB_PORT
StorageUser=slurm
StoragePass=$(cat "$pass_file")
StorageLoc=slurm_acct_db
EOF

    # --defaults-file keeps MariaDB away from Debian's /etc/mysql config and socket.
    write_file "$MY_CNF" 644 <<EOF
[mysqld]
user=root
datadir=$DB_DIR/data
socket=$DB_DIR/mysqld.sock
pid-file=$(pidfile mariadbd)
log-error=$(logfile mariadbd)
port=$DB_PORT
bind-address=127.0.0.1
skip-name-resolve
# slurmdbd's lock timeout; a small pool is plenty here (slurmdbd logs a harmless
# "not recommended" note). Native AIO is often unavailable in containers.
innodb_buffer_pool_size=256M
innodb_log_file_size=64M
innodb_lock_wait_timeout=900
innodb_use_native_aio=0

[client]
socket=$DB_DIR/mysqld.sock
port=$DB_PORT
EOF
}

# Let clients work without SLURM_CONF, but never replace a real admin config.
# Done only after a successful start, so a failed start never repoints clients.
link_system_conf() {
    if [[ ! -e "$SYSTEM_SLURM_CONF" || -L "$SYSTEM_SLURM_CONF" ]]; then
        mkdir -p "$(dirname "$SYSTEM_SLURM_CONF")"
        ln -sfn "$ETC/slurm.conf" "$SYSTEM_SLURM_CONF"
    elif [[ "$(readlink -f "$SYSTEM_SLURM_CONF")" != "$ETC/slurm.conf" ]]; then
        say "note: $SYSTEM_SLURM_CONF is not ours; clients need SLURM_CONF=$ETC/slurm.conf"
    fi
}

port_busy() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

# Ports and the munge socket are machine-wide: refuse to start next to daemons that
# are not ours (another state dir, a system slurm) instead of half-starting.
check_conflicts() {
    local d port
    if ! running munged && munge_ok >/dev/null 2>&1; then
        die "a munged not started from $STATE_DIR already serves $MUNGE_SOCKET; stop it first"
    fi
    for d in mariadbd:"$DB_PORT" slurmdbd:6819 slurmctld:6817 "slurmd-$NODE":6818; do
        port="${d#*:}"
        if ! running "${d%%:*}" && port_busy "$port"; then
            die "port $port (${d%%:*}) is in use by a process not started from $STATE_DIR; stop it first"
        fi
    done
}

# ---------------------------------------------------------------- daemons

start_munged() {
    running munged && return 0
    local key="$MUNGE_DIR/munge.key"
    if [[ ! -s "$key" ]]; then
        mungekey --create --keyfile="$key" >/dev/null 2>&1 || die "cannot create munge key $key"
    fi
    chown root:root "$key"
    chmod 600 "$key"
    mkdir -p "$(dirname "$MUNGE_SOCKET")"
    chmod 755 "$(dirname "$MUNGE_SOCKET")"
    munged --key-file="$key" --socket="$MUNGE_SOCKET" \
        --pid-file="$(pidfile munged)" --log-file="$(logfile munged)" \
        --seed-file="$MUNGE_DIR/munged.seed" </dev/null >>"$(logfile munged)" 2>&1 \
        || die_log "$(logfile munged)" "munged failed to start"
    wait_for 15 munge_ok || die_log "$(logfile munged)" "munged does not answer on $MUNGE_SOCKET"
}

munge_ok() { munge -n -S "$MUNGE_SOCKET" </dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null; }

db_sql() { mariadb --defaults-file="$MY_CNF" -uroot -e "$1"; }

start_mariadbd() {
    local log
    log="$(logfile mariadbd)"
    if ! running mariadbd; then
        if [[ ! -d "$DB_DIR/data/mysql" ]]; then
            rm -rf "$DB_DIR/data"
            mariadb-install-db --defaults-file="$MY_CNF" --user=root \
                --auth-root-authentication-method=socket --skip-test-db \
                >>"$log" 2>&1 || die_log "$log" "mariadb-install-db failed"
        fi
        # mariadbd does not daemonize itself: run it in its own session, detached
        # from our stdout so callers that capture output do not hang.
        setsid mariadbd --defaults-file="$MY_CNF" </dev/null >>"$log" 2>&1 &
        local deadline=$((SECONDS + 30))
        until mariadb-admin --defaults-file="$MY_CNF" -uroot ping >/dev/null 2>&1; do
            ((SECONDS < deadline)) || die_log "$log" "MariaDB did not come up in 30 s"
            kill -0 $! 2>/dev/null || die_log "$log" "MariaDB exited during startup"
            sleep 0.5
        done
        wait_for 10 running mariadbd || die_log "$log" "MariaDB wrote no pid file"
    fi
    # Idempotent: database + user for slurmdbd (both host forms, see skip-name-resolve).
    local pass
    pass="$(cat "$DB_DIR/slurm_db.pass")"
    db_sql "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
            CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$pass';
            CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
            ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$pass';
            ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
            GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
            GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';" >>"$log" 2>&1 \
        || die_log "$log" "cannot create the slurm database/user in MariaDB"
}

dbd_ok() { sacctmgr -n -P show cluster format=cluster; }

start_slurmdbd() {
    if ! running slurmdbd; then
        slurmdbd </dev/null >>"$(logfile slurmdbd)" 2>&1 \
            || die_log "$(logfile slurmdbd)" "slurmdbd failed to start"
    fi
    # The first start creates the accounting tables, which takes a few seconds.
    wait_for 45 dbd_ok || die_log "$(logfile slurmdbd)" "slurmdbd does not answer"
    # Register cluster, account and root so accounting (sacct) has somewhere to go.
    if ! dbd_ok | grep -qx "$CLUSTER"; then
        sacctmgr -i add cluster "$CLUSTER" >/dev/null \
            || die_log "$(logfile slurmdbd)" "sacctmgr add cluster $CLUSTER failed"
    fi
    if [[ -z "$(sacctmgr -n -P show account "$ACCOUNT" format=account)" ]]; then
        sacctmgr -i add account "$ACCOUNT" Cluster="$CLUSTER" \
            Description="local dev account" Organization=fsdp_research >/dev/null \
            || die_log "$(logfile slurmdbd)" "sacctmgr add account $ACCOUNT failed"
    fi
    if [[ -z "$(sacctmgr -n -P show user root format=user)" ]]; then
        sacctmgr -i add user root DefaultAccount="$ACCOUNT" Cluster="$CLUSTER" >/dev/null \
            || die_log "$(logfile slurmdbd)" "sacctmgr add user root failed"
    fi
}

ctld_ok() { scontrol ping | grep -q 'is UP'; }

start_slurmctld() {
    if ! running slurmctld; then
        # -c: a cluster of another node count starts from a clean controller state.
        slurmctld ${1:-} </dev/null >>"$(logfile slurmctld)" 2>&1 \
            || die_log "$(logfile slurmctld)" "slurmctld failed to start"
    fi
    wait_for 30 ctld_ok || die_log "$(logfile slurmctld)" "slurmctld does not answer"
}

# slurmd of one node: slurmd -N <node> (the host's own name for a single node).
start_slurmd() {
    local node="$1"
    running "slurmd-$node" && return 0
    slurmd -N "$node" </dev/null >>"$(logfile "slurmd-$node")" 2>&1 \
        || die_log "$(logfile "slurmd-$node")" "slurmd of $node failed to start"
    wait_for 15 running "slurmd-$node" || die_log "$(logfile "slurmd-$node")" "slurmd of $node exited during startup"
}

# Node state without the */~/# suffixes ("idle*" = not responding).
node_state() { sinfo -h -n "$1" -o '%T' 2>/dev/null | head -n1; }

node_usable() {
    case "$(node_state "$1")" in
        idle | mixed | allocated | completing) return 0 ;;
        *) return 1 ;;
    esac
}

wait_node() {
    local node="$1" deadline=$((SECONDS + START_TIMEOUT)) resumed=0 st
    until node_usable "$node"; do
        st="$(node_state "$node")"
        # A drain or down left over from an earlier run (e.g. a killed job, a lost node) is not wanted here.
        if [[ "$st" == drain* || "$st" == down* ]] && ((resumed == 0)); then
            scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true
            resumed=1
        fi
        ((SECONDS < deadline)) \
            || die_log "$(logfile "slurmd-$node")" "node $node not usable after ${START_TIMEOUT}s (state: ${st:-unknown})"
        running "slurmd-$node" || die_log "$(logfile "slurmd-$node")" "slurmd of $node died"
        sleep 0.5
    done
}

healthy() {
    local d node
    for d in "${DAEMONS[@]}"; do running "$d" || return 1; done
    ctld_ok >/dev/null 2>&1 || return 1
    for node in $(node_names "$(configured_nodes)"); do
        running "slurmd-$node" && node_usable "$node" || return 1
    done
}

summary() {
    local ver cpus mem n
    n="$(configured_nodes)"
    ver="$(sinfo -V 2>/dev/null | awk '{print $2}')"
    read -r cpus mem < <(sinfo -h -n "$(node_names "$n" | head -n1)" -o '%c %m' | head -n1)
    echo "local_cluster: $CLUSTER up (slurm $ver): $n node(s) $(node_names "$n" | paste -sd,), ${cpus} CPUs and ${mem} MB each, partition debug; state $STATE_DIR"
}

# Stop every slurmd of this state dir, whatever node count it ran with.
stop_slurmds() {
    local file
    for file in "$RUN"/slurmd-*.pid; do
        [[ -e "$file" ]] || continue
        file="${file##*/}"
        stop_daemon "${file%.pid}"
    done
}

cmd_start() {
    local nodes=1
    while (($#)); do
        case "$1" in
            --nodes) nodes="${2:-}"; shift 2 ;;
            *) die "unknown option $1 (usage: start [--nodes N])" ;;
        esac
    done
    [[ "$nodes" =~ ^[1-9][0-9]*$ ]] || die "--nodes takes a positive number, not '$nodes'"
    if [[ "$(configured_nodes)" == "$nodes" ]] && healthy 2>/dev/null; then
        say "already running"
        link_system_conf
        summary
        return 0
    fi
    local clean=""
    if [[ "$(configured_nodes)" != "$nodes" ]]; then
        # Another node count: the controller and every slurmd start again with the new node list.
        stop_slurmds
        stop_daemon slurmctld
        clean=-c
    fi
    install_packages
    check_conflicts
    write_configs "$nodes"
    write_hosts "$nodes"
    echo "$nodes" >"$NODES_FILE"
    start_munged
    start_mariadbd
    start_slurmdbd
    start_slurmctld $clean
    local node
    for node in $(node_names "$nodes"); do start_slurmd "$node"; done
    for node in $(node_names "$nodes"); do wait_node "$node"; done
    link_system_conf
    summary
}

# ---------------------------------------------------------------- stop / status

# SIGTERM, wait, then SIGKILL. Only PIDs from our pid files are touched.
stop_daemon() {
    local name="$1" pid i
    pid="$(daemon_pid "$name")" || { rm -f "$(pidfile "$name")"; return 0; }
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 40; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.25
    done
    if kill -0 "$pid" 2>/dev/null; then
        kill -KILL "$pid" 2>/dev/null || true
        sleep 0.25
    fi
    rm -f "$(pidfile "$name")"
    say "stopped $name (pid $pid)"
}

# slurmstepd processes of this cluster (their environment carries our SLURM_CONF).
our_stepds() {
    local p
    for p in /proc/[0-9]*; do
        [[ "$(cat "$p/comm" 2>/dev/null)" == slurmstepd ]] || continue
        tr '\0' '\n' <"$p/environ" 2>/dev/null | grep -qx "SLURM_CONF=$SLURM_CONF" \
            && echo "${p#/proc/}"
    done
    return 0
}

no_active_jobs() { [[ -z "$(squeue -h -t RUNNING,CONFIGURING,COMPLETING -o %i 2>/dev/null)" ]]; }

cmd_stop() {
    # Cancel running jobs first so no job processes outlive the cluster.
    if running slurmctld && ctld_ok >/dev/null 2>&1 && ! no_active_jobs; then
        say "cancelling running jobs"
        scancel --state=RUNNING >/dev/null 2>&1 || true
        scancel --state=CONFIGURING >/dev/null 2>&1 || true
        wait_for 20 no_active_jobs || say "warning: jobs still active after 20 s"
    fi
    stop_slurmds
    local i
    for ((i = ${#DAEMONS[@]} - 1; i >= 0; i--)); do
        stop_daemon "${DAEMONS[i]}"
    done
    local pid
    for pid in $(our_stepds); do
        kill -KILL "$pid" 2>/dev/null && say "killed leftover slurmstepd (pid $pid)"
    done
    say "stopped"
}

cmd_status() {
    local d pid all=0
    for d in "${DAEMONS[@]}" $(node_names "$(configured_nodes)" | sed 's/^/slurmd-/'); do
        if pid="$(daemon_pid "$d")"; then
            printf '%-10s running (pid %s)\n' "$d" "$pid"
        else
            printf '%-10s stopped\n' "$d"
            all=1
        fi
    done
    if running slurmctld && ctld_ok >/dev/null 2>&1; then
        sinfo
        local node
        for node in $(node_names "$(configured_nodes)"); do node_usable "$node" || all=1; done
    else
        all=1
    fi
    echo "SLURM_CONF=$SLURM_CONF"
    return "$all"
}

# ---------------------------------------------------------------- main

main() {
    [[ $EUID -eq 0 ]] || die "must run as root (daemons run as root with SlurmUser=root)"
    case "${1:-}" in
        start) shift; cmd_start "$@" ;;
        stop) cmd_stop ;;
        status) cmd_status ;;
        *) echo "usage: $0 start [--nodes N]|stop|status" >&2; exit 2 ;;
    esac
}

main "$@"
