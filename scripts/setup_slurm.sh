#!/usr/bin/env bash
# A real two-node Slurm 22.05 cluster on loopback, for xfw's Slurm contract tests (docs/slurm.md).
#
#   scripts/setup_slurm.sh          install (if missing) and start munge, slurmctld, slurmd n1 and n2; idempotent
#   scripts/setup_slurm.sh --stop   stop only the daemons this script started (their pid files)
#
# Run as root. Everything lives under $XFW_SLURM_DIR (default /var/lib/xfw-slurm): slurm.conf, state, logs,
# pid files. The client commands find the config through SLURM_CONF=$XFW_SLURM_DIR/slurm.conf; when
# /etc/slurm/slurm.conf does not exist it is linked there too (removed by --stop), so a bare `sinfo` works.
# xfw itself keeps no cluster configuration: it uses whatever cluster the Slurm client commands see.
set -euo pipefail

DIR=${XFW_SLURM_DIR:-/var/lib/xfw-slurm}
CONF=$DIR/slurm.conf
export SLURM_CONF=$CONF

stop() {
    for pidfile in "$DIR"/run/slurmd-n1.pid "$DIR"/run/slurmd-n2.pid "$DIR"/run/slurmctld.pid "$DIR"/run/munged.pid; do
        [ -f "$pidfile" ] || continue
        pid=$(cat "$pidfile")
        if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; then
            kill "$pid"
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
        fi
        rm -f "$pidfile"
    done
    if [ -L /etc/slurm/slurm.conf ] && [ "$(readlink /etc/slurm/slurm.conf)" = "$CONF" ]; then
        rm -f /etc/slurm/slurm.conf
    fi
    echo "slurm (loopback): stopped"
}

if [ "${1:-}" = "--stop" ]; then stop; exit 0; fi
if [ "$(id -u)" != 0 ]; then echo "scripts/setup_slurm.sh: run as root (it starts munged, slurmctld, slurmd)" >&2; exit 2; fi

if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
        || ! command -v sbatch >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q slurm-wlm munge >/dev/null 2>&1 || { apt-get update -q >/dev/null; apt-get install -y -q slurm-wlm munge >/dev/null; }
fi

mkdir -p "$DIR"/state "$DIR"/spool "$DIR"/log "$DIR"/run
CPUS=$(nproc)
# memory is not a consumable here (CR_Core); RealMemory is what this host has, so a --mem request is sane
MEM_MB=$(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo)
cat > "$CONF.new" <<CONF
# written by xfw's scripts/setup_slurm.sh: a two-node cluster on one host (multiple-slurmd), for tests
ClusterName=xfwloop
SlurmctldHost=localhost
SlurmctldPort=16817
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
SlurmdTimeout=10
SlurmctldTimeout=10
MessageTimeout=10
KillWait=5
InactiveLimit=0
MinJobAge=3600
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmdParameters=config_overrides
NodeName=n1 NodeHostname=localhost NodeAddr=127.0.0.1 Port=17001 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
NodeName=n2 NodeHostname=localhost NodeAddr=127.0.0.1 Port=17002 CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
CONF
mv "$CONF.new" "$CONF"
if [ ! -e /etc/slurm/slurm.conf ]; then mkdir -p /etc/slurm; ln -s "$CONF" /etc/slurm/slurm.conf; fi

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

if ! alive "$DIR/run/munged.pid"; then
    if [ ! -s /etc/munge/munge.key ]; then
        (command -v mungekey >/dev/null && mungekey --create --force) || dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 2>/dev/null
        chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
    fi
    mkdir -p /run/munge /var/log/munge /var/lib/munge; chown munge:munge /run/munge /var/log/munge /var/lib/munge
    if pgrep -x munged >/dev/null; then  # a munged of the host's own: use it, do not own it
        :
    else
        runuser -u munge -- /usr/sbin/munged
        for _ in $(seq 50); do [ -f /run/munge/munged.pid ] && break; sleep 0.1; done
        cp /run/munge/munged.pid "$DIR/run/munged.pid"
    fi
fi
if ! alive "$DIR/run/slurmctld.pid"; then slurmctld -f "$CONF"; fi
for node in n1 n2; do
    if ! alive "$DIR/run/slurmd-$node.pid"; then slurmd -f "$CONF" -N "$node"; fi
done
for _ in $(seq 60); do
    idle=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 == "idle" || $2 == "mix" || $2 == "alloc"' | wc -l)
    [ "$idle" -ge 2 ] && { echo "slurm (loopback): n1 n2 up (SLURM_CONF=$CONF)"; exit 0; }
    # a node left down by an earlier run (slurmd killed in a test) is resumed
    for node in $(sinfo -h -N -t down,drain -o '%N' 2>/dev/null); do scontrol update NodeName="$node" State=RESUME 2>/dev/null || true; done
    sleep 0.5
done
echo "scripts/setup_slurm.sh: the nodes did not come up; see $DIR/log/" >&2
sinfo -N >&2 || true
exit 1
