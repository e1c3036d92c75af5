#!/usr/bin/env bash
# A real single-node SLURM cluster for testing moesub's `profiles/slurm` (Debian/Ubuntu, root).
#
#   scripts/slurm_cluster.sh install   # apt-get install slurmctld slurmd slurm-client munge
#   scripts/slurm_cluster.sh start     # write /etc/slurm/{slurm,gres}.conf, start munged,
#                                      # slurmctld and slurmd, wait until the node is idle
#   scripts/slurm_cluster.sh stop      # shut the cluster down, remove the config start wrote
#   scripts/slurm_cluster.sh status    # exit 0 if the cluster answers, print sinfo
#   scripts/slurm_cluster.sh up        # install + start
#
# Every command is idempotent. Partitions: `cpu` (default) and `gpu`, both on this node; the node
# advertises one fake GPU (GRES `gpu:1` backed by /dev/null), so `--gpus=1` / `--gres=gpu:1`
# jobs schedule (one at a time) without real hardware. No accounting daemon: `sacct` does not
# work here, so Snakemake must poll with `squeue` (profiles/slurm sets that) and MinJobAge is
# long enough for squeue to still see finished jobs. No cgroups or systemd are needed.
# Measured facts behind these settings: see shared notes "slurm-local.md".
#
# The config must live in /etc/slurm: Snakemake's jobstep plugin strips SLURM_CONF before srun.
# A config in /etc/slurm that this script did not write is never overwritten.
set -euo pipefail

MARK="# written by moesub scripts/slurm_cluster.sh"
CONF_DIR=/etc/slurm
CONF="$CONF_DIR/slurm.conf"
GRES="$CONF_DIR/gres.conf"
STATE_DIR=/var/spool/slurmctld-moesub
SPOOL_DIR=/var/spool/slurmd-moesub
LOG_DIR=/var/log/slurm
START_TIMEOUT=${SLURM_START_TIMEOUT:-60}

log() { echo "[slurm_cluster] $*" >&2; }
die() { log "error: $*"; exit 1; }

need_root() {
    [ "$(id -u)" -eq 0 ] || die "must run as root (installs packages and starts daemons)"
}

installed() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null \
        && command -v sbatch >/dev/null && command -v munged >/dev/null
}

cmd_install() {
    if installed; then
        log "SLURM already installed: $(slurmctld -V)"
        return 0
    fi
    need_root
    command -v apt-get >/dev/null || die "apt-get not found: install slurmctld, slurmd, \
slurm-client and munge with your package manager"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq -o DPkg::Lock::Timeout=300
    apt-get install -y -qq -o DPkg::Lock::Timeout=300 --no-install-recommends \
        slurmctld slurmd slurm-client munge
    installed || die "packages installed but SLURM binaries still missing"
    log "installed $(slurmctld -V)"
}

write_config() {
    local node cpus mem_mb
    node=$(hostname -s)
    # the node's CPUs, not the caller's OpenMP limit (nproc honours OMP_NUM_THREADS)
    cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)
    mem_mb=$(awk '/^MemTotal:/ {printf "%d", $2 / 1024}' /proc/meminfo)
    mem_mb=$((mem_mb > 4000 ? mem_mb - 2000 : mem_mb / 2))
    if [ -e "$CONF" ] && ! head -n 1 "$CONF" | grep -qF "$MARK"; then
        die "$CONF exists and was not written by this script; refusing to overwrite it"
    fi
    install -d "$CONF_DIR" "$STATE_DIR" "$SPOOL_DIR" "$LOG_DIR"
    local tmp
    tmp=$(mktemp "$CONF_DIR/.slurm.conf.XXXXXX")
    cat >"$tmp" <<EOF
$MARK
ClusterName=moesub
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
GresTypes=gpu
DefMemPerCPU=1000
ReturnToService=2
MailProg=/bin/true
# No accounting daemon: keep finished jobs visible to squeue and scontrol for an hour.
MinJobAge=3600
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
StateSaveLocation=$STATE_DIR
SlurmdSpoolDir=$SPOOL_DIR
SlurmctldPidFile=/run/slurmctld-moesub.pid
SlurmdPidFile=/run/slurmd-moesub.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SchedulerType=sched/backfill
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=10
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem_mb Gres=gpu:1 State=UNKNOWN
PartitionName=cpu Nodes=$node Default=YES MaxTime=INFINITE State=UP
PartitionName=gpu Nodes=$node Default=NO MaxTime=INFINITE State=UP
EOF
    mv -f "$tmp" "$CONF"
    chmod 644 "$CONF"
    printf '%s\nAutoDetect=off\nNodeName=%s Name=gpu File=/dev/null\n' "$MARK" "$node" >"$GRES"
    chmod 644 "$GRES"
}

running() { pgrep -x "$1" >/dev/null; }

cluster_up() {
    timeout 5 sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'
}

cmd_start() {
    need_root
    installed || cmd_install
    write_config
    if ! running munged; then
        install -d -o munge -g munge -m 0755 /run/munge
        runuser -u munge -- /usr/sbin/munged
    fi
    running slurmctld || /usr/sbin/slurmctld -i
    running slurmd || /usr/sbin/slurmd
    local waited=0
    until cluster_up; do
        if [ "$waited" -ge "$START_TIMEOUT" ]; then
            log "cluster did not become idle in ${START_TIMEOUT}s; last log lines:"
            tail -n 20 "$LOG_DIR/slurmctld.log" "$LOG_DIR/slurmd.log" >&2 || true
            die "SLURM did not start"
        fi
        # A node left DOWN/DRAIN by an earlier unclean stop: resume it.
        scontrol update NodeName="$(hostname -s)" State=RESUME >/dev/null 2>&1 || true
        sleep 1
        waited=$((waited + 1))
    done
    log "cluster up after ${waited}s:"
    sinfo >&2
}

cmd_stop() {
    if running slurmctld || running slurmd; then
        scontrol shutdown >/dev/null 2>&1 || true
        local waited=0
        while { running slurmctld || running slurmd; } && [ "$waited" -lt 30 ]; do
            sleep 1
            waited=$((waited + 1))
        done
    fi
    if running munged; then
        runuser -u munge -- /usr/sbin/munged --stop >/dev/null 2>&1 || true
    fi
    remove_config
    log "cluster stopped"
}

# A stopped cluster leaves no config behind: while /etc/slurm/slurm.conf names a controller that
# is down, every SLURM client waits MessageTimeout (10 s) before failing, and so does every
# `snakemake` command (even --version: the SLURM executor plugin runs `scontrol show config` when
# Snakemake loads it). Without a config, scontrol fails at once. `start` writes it again.
remove_config() {
    local f
    for f in "$CONF" "$GRES"; do
        if [ -e "$f" ] && head -n 1 "$f" | grep -qF "$MARK"; then
            rm -f "$f"
        fi
    done
}

cmd_status() {
    if cluster_up; then
        sinfo
    else
        log "cluster not running"
        return 1
    fi
}

case "${1:-}" in
install) cmd_install ;;
start) cmd_start ;;
up) cmd_install && cmd_start ;;
stop) cmd_stop ;;
status) cmd_status ;;
*)
    echo "usage: $0 install|start|up|stop|status" >&2
    exit 2
    ;;
esac
