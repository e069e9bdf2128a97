#!/usr/bin/env bash
# Prepare this machine for the Slurm test (tests/deploy/test_slurm.py): install Debian's Slurm
# (slurm-wlm: slurmctld, slurmd and the clients) and munge when a program is missing, and the
# tools the test uses (ip, nsenter/unshare). Idempotent; instant when they are there. Run as
# root. It starts nothing and writes no config: the test generates its own slurm.conf (ports
# picked free), a fresh munge key and its own munged socket in a temporary directory, so the
# packages' own daemons (disabled here: no systemd) and /etc/munge/munge.key are never used.
# Fails loudly: in CI the Slurm test must run, not be skipped.
set -euo pipefail
need=()
for prog in slurmctld slurmd sbatch srun scontrol scancel squeue sinfo; do
    command -v "$prog" >/dev/null || [ -x "/usr/sbin/$prog" ] || { need+=(slurm-wlm); break; }
done
command -v munged >/dev/null || [ -x /usr/sbin/munged ] || need+=(munge)
command -v ip >/dev/null || need+=(iproute2)
command -v nsenter >/dev/null || need+=(util-linux)
if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "slurm-setup: ${need[*]} missing; run this script as root to install them." >&2
    exit 1
fi
started=$(date +%s)
echo "== slurm-setup: apt-get install ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get install -y --no-install-recommends "${need[@]}" >/dev/null 2>&1 || {
    apt-get update >/dev/null && apt-get install -y --no-install-recommends "${need[@]}" >/dev/null
}
/usr/sbin/slurmctld -V
echo "== slurm-setup: done in $(( $(date +%s) - started ))s"
