#!/usr/bin/env bash
# A single-node SLURM and a loopback sshd on this machine, for tests and for trying the cluster
# paths of README "Running on a cluster" without a cluster. Needs root and Debian's packages:
#
#   apt-get install -y --no-install-recommends slurmctld slurmd slurm-client munge openssh-server pdsh
#   launch/dev/local_cluster.sh up       # start munged, slurmctld, slurmd, sshd (idempotent)
#   source /tmp/mode-local-cluster/env.sh   # SLURM_CONF, MODE_SSH_PORT, MODE_SSH_HOSTS for clients
#   launch/dev/local_cluster.sh status
#   launch/dev/local_cluster.sh down     # stop exactly the daemons `up` started (by PID), undo its edits
#
# Everything lives in $MODE_CLUSTER_DIR (default /tmp/mode-local-cluster): a private munge key and
# socket, slurm.conf (one node, CPUs=$MODE_CLUSTER_CPUS (2), MODE_CLUSTER_GPUS (2) fake GPUs that only
# jobs asking for GPUs get, partition `cpu`, no accounting) and gres.conf, sshd
# listening on 127.0.0.1 and 127.0.0.2 port $MODE_SSH_PORT (2222) for the two "nodes" mode-node0
# and mode-node1. Outside it, `up` adds two marked lines to /etc/hosts and the ssh client file
# /etc/ssh/ssh_config.d/mode-local-cluster.conf (key, known_hosts; no port: pass --ssh_port);
# `down` removes only those.
set -euo pipefail
DIR="${MODE_CLUSTER_DIR:-/tmp/mode-local-cluster}"
PORT="${MODE_SSH_PORT:-2222}"
CPUS="${MODE_CLUSTER_CPUS:-2}"
GPUS="${MODE_CLUSTER_GPUS:-2}"
CTLD_PORT="${MODE_SLURMCTLD_PORT:-16817}"
MARK="# mode-local-cluster"
SSH_CLIENT_CONF=/etc/ssh/ssh_config.d/mode-local-cluster.conf
NODE="$(hostname -s)"

die() { echo "local_cluster: $*" >&2; exit 1; }
# alive PIDFILE: its process runs, is the daemon the file is named after and was started on this
# directory's files. A PID file left by a reboot or a killed container can name a PID some other
# process has since taken: read as alive, the daemon was not started (and `down` killed that process).
alive() {
  local pid
  [[ -f $1 ]] && pid="$(cat "$1")" && [[ $pid =~ ^[0-9]+$ ]] && kill -0 "$pid" 2>/dev/null || return 1
  [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$(basename "$1" .pid)" ]] \
    && tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$DIR/"
}
wait_for() {  # wait_for SECONDS CMD...: poll until CMD succeeds
  local end=$((SECONDS + $1)); shift
  until "$@" >/dev/null 2>&1; do ((SECONDS < end)) || return 1; sleep 0.5; done
}

up() {
  [[ $(id -u) == 0 ]] || die "needs root (the daemons run as root)"
  for b in munged slurmctld slurmd sbatch sshd pdsh; do
    command -v "$b" >/dev/null || [[ -x /usr/sbin/$b ]] || die "$b not installed (apt-get install slurmctld slurmd slurm-client munge openssh-server pdsh)"
  done
  mkdir -p "$DIR"/{munge,slurmctld,slurmd,ssh}
  chmod 700 "$DIR" "$DIR/munge" "$DIR/ssh"

  # munge: a private key and socket, so an existing munged (if any) is left alone.
  [[ -f $DIR/munge/munge.key ]] || { head -c 1024 /dev/urandom > "$DIR/munge/munge.key"; chmod 400 "$DIR/munge/munge.key"; }
  if ! alive "$DIR/munge/munged.pid"; then
    /usr/sbin/munged --force --socket="$DIR/munge/munge.socket.2" --key-file="$DIR/munge/munge.key" \
      --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed"
    wait_for 10 test -S "$DIR/munge/munge.socket.2" || die "munged did not start (see $DIR/munge/munged.log)"
  fi

  # $GPUS fake GPUs: SLURM allocates them (and sets CUDA_VISIBLE_DEVICES) as it would real ones; their
  # "device files" are links to /dev/null (slurmd wants a character device). Only jobs that ask for
  # GPUs (--gpus-per-node, --gpus-per-task, --gres=gpu:N, ...) get any.
  [[ $GPUS =~ ^[0-9]+$ ]] || die "MODE_CLUSTER_GPUS=$GPUS: a count >= 0"
  mkdir -p "$DIR/gpu"
  : > "$DIR/gres.conf"
  for ((i = 0; i < GPUS; i++)); do
    ln -sfn /dev/null "$DIR/gpu/fake$i"
    echo "Name=gpu File=$DIR/gpu/fake$i" >> "$DIR/gres.conf"
  done
  cat > "$DIR/slurm.conf" <<EOF
# written by launch/dev/local_cluster.sh
ClusterName=modelocal
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$((CTLD_PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket.2
StateSaveLocation=$DIR/slurmctld
SlurmdSpoolDir=$DIR/slurmd
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SchedulerParameters=sched_interval=2
KillWait=5
MinJobAge=600
Waittime=0
GresTypes=gpu
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS $( ((GPUS)) && echo "Gres=gpu:$GPUS") State=UNKNOWN
PartitionName=cpu Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF
  export SLURM_CONF="$DIR/slurm.conf"
  # With both daemons dead (a reboot, a killed container, `down`), the jobs slurmctld saved have no
  # processes left, but restarting on that state revives them as RUNNING: they hold the node's CPUs
  # and every new job stays PENDING. -c starts both from a clean state.
  local clean=()
  alive "$DIR/slurmctld.pid" || alive "$DIR/slurmd.pid" || clean=(-c)
  alive "$DIR/slurmctld.pid" || /usr/sbin/slurmctld -f "$SLURM_CONF" "${clean[@]}"
  alive "$DIR/slurmd.pid" || /usr/sbin/slurmd -f "$SLURM_CONF" -N "$NODE" "${clean[@]}"
  wait_for 30 bash -c "sinfo -h -o %t | grep -qE '^(idle|mix|alloc)'" \
    || die "SLURM node not idle after 30 s: $(sinfo -h -o '%t %E' 2>&1) (see $DIR/slurmctld.log, $DIR/slurmd.log)"

  # sshd on two loopback addresses = two "nodes"; root logs in with a key only this directory holds.
  [[ -f $DIR/ssh/host_key ]] || ssh-keygen -q -t ed25519 -N '' -f "$DIR/ssh/host_key"
  [[ -f $DIR/ssh/id_ed25519 ]] || ssh-keygen -q -t ed25519 -N '' -f "$DIR/ssh/id_ed25519"
  cp "$DIR/ssh/id_ed25519.pub" "$DIR/ssh/authorized_keys"
  cat > "$DIR/ssh/sshd_config" <<EOF
Port $PORT
ListenAddress 127.0.0.1
ListenAddress 127.0.0.2
HostKey $DIR/ssh/host_key
PidFile $DIR/ssh/sshd.pid
AuthorizedKeysFile $DIR/ssh/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
MaxStartups 100
EOF
  mkdir -p /run/sshd
  alive "$DIR/ssh/sshd.pid" || /usr/sbin/sshd -f "$DIR/ssh/sshd_config" -E "$DIR/ssh/sshd.log"
  cat > "$SSH_CLIENT_CONF" <<EOF
$MARK: written by launch/dev/local_cluster.sh up, removed by down
Host mode-node0 mode-node1
  IdentityFile $DIR/ssh/id_ed25519
  UserKnownHostsFile $DIR/ssh/known_hosts
  StrictHostKeyChecking no
  BatchMode yes
EOF
  grep -q "mode-node0 $MARK" /etc/hosts || printf '127.0.0.1 mode-node0 %s\n127.0.0.2 mode-node1 %s\n' "$MARK" "$MARK" >> /etc/hosts
  for h in mode-node0 mode-node1; do
    wait_for 10 ssh -p "$PORT" -o ConnectTimeout=5 "$h" true || die "ssh -p $PORT $h fails (see $DIR/ssh/sshd.log)"
  done

  cat > "$DIR/env.sh" <<EOF
export SLURM_CONF=$DIR/slurm.conf
export MODE_SSH_PORT=$PORT
export MODE_SSH_HOSTS="mode-node0 mode-node1"
EOF
  echo "local cluster up: SLURM partition cpu ($CPUS CPUs, $GPUS fake GPUs on $NODE), ssh -p $PORT mode-node0|mode-node1; source $DIR/env.sh"
}

down() {
  local f
  for f in "$DIR/ssh/sshd.pid" "$DIR/slurmd.pid" "$DIR/slurmctld.pid" "$DIR/munge/munged.pid"; do
    if alive "$f"; then
      local pid; pid="$(cat "$f")"
      kill "$pid"
      wait_for 15 bash -c "! kill -0 $pid" || kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$f"
  done
  [[ -f $SSH_CLIENT_CONF ]] && grep -q "^$MARK" "$SSH_CLIENT_CONF" && rm -f "$SSH_CLIENT_CONF"
  if grep -q "$MARK\$" /etc/hosts; then  # rewrite in place: /etc/hosts may be a bind mount
    local kept; kept="$(grep -v "$MARK\$" /etc/hosts || true)"
    printf '%s\n' "$kept" > /etc/hosts
  fi
  echo "local cluster down"
}

status() {
  local f ok=0
  for f in "$DIR/munge/munged.pid" "$DIR/slurmctld.pid" "$DIR/slurmd.pid" "$DIR/ssh/sshd.pid"; do
    if alive "$f"; then echo "$(basename "$f" .pid): running (pid $(cat "$f"))"; else echo "$(basename "$f" .pid): stopped"; ok=1; fi
  done
  return $ok
}

case "${1:-}" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "usage: $0 up|down|status" >&2; exit 2 ;;
esac
