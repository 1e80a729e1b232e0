#!/usr/bin/env bash
# A real single-node SLURM on this machine, for the tests of examples/slurm/ (tests/e2e/
# test_slurm.py): munge, slurmctld and slurmd on localhost, one partition holding this node.
#
#   sudo tools/slurm_local.sh install   # apt-get install slurm-wlm munge (Debian/Ubuntu)
#   sudo tools/slurm_local.sh start     # write /etc/slurm/slurm.conf, start the daemons
#   tools/slurm_local.sh status         # sinfo
#   sudo tools/slurm_local.sh stop      # stop the daemons this script started
#
# It runs the daemons as root (SlurmUser=root) with no cgroups (proctrack/linuxproc): enough
# for a test machine or a container, not a production setup. The node's CPUs and memory come
# from `slurmd -C`. Logs: /var/log/slurm/.
set -euo pipefail

CONF_DIR=/etc/slurm
STATE=/var/spool/slurm-jaxnitro
LOGS=/var/log/slurm

need_root() {
  if [ "$(id -u)" != 0 ]; then
    echo "slurm_local.sh $1: run as root (sudo); the SLURM daemons need it" >&2
    exit 1
  fi
}

write_conf() {
  local node
  node=$(slurmd -C | head -1)           # NodeName=<host> CPUs=... RealMemory=...
  mkdir -p "$CONF_DIR" "$STATE/ctld" "$STATE/d" "$LOGS"
  cat > "$CONF_DIR/slurm.conf" <<CONF
# Written by jaxnitro tools/slurm_local.sh: a single-node SLURM for tests.
ClusterName=jaxnitro-local
SlurmctldHost=$(hostname -s)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job waits out its old credential (default 120 s) before it starts again.
AuthInfo=cred_expire=20
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
JobRequeue=1
KillWait=30
$node State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE
CONF
  echo "wrote $CONF_DIR/slurm.conf ($node)"
}

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

case "${1:-}" in
  install)
    need_root install
    apt-get update -q
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge
    ;;
  start)
    need_root start
    command -v slurmctld >/dev/null || { echo "no slurmctld: run '$0 install' first" >&2; exit 1; }
    write_conf
    if ! pgrep -u munge -x munged >/dev/null; then
      mkdir -p /run/munge && chown munge:munge /run/munge
      runuser -u munge -- munged
    fi
    running "$STATE/slurmctld.pid" || slurmctld
    running "$STATE/slurmd.pid" || slurmd
    for _ in $(seq 60); do            # until the node takes jobs
      if sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
        sinfo
        exit 0
      fi
      sleep 1
    done
    echo "SLURM did not come up; see $LOGS/slurmctld.log and $LOGS/slurmd.log" >&2
    exit 1
    ;;
  stop)
    need_root stop
    for pidfile in "$STATE/slurmd.pid" "$STATE/slurmctld.pid"; do
      if running "$pidfile"; then kill "$(cat "$pidfile")"; fi
    done
    ;;
  status)
    sinfo
    ;;
  *)
    echo "usage: $0 install|start|stop|status" >&2
    exit 2
    ;;
esac
