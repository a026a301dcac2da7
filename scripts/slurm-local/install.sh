#!/usr/bin/env bash
# Install the Debian packages the local SLURM cluster needs, where missing (start.sh
# calls this; .ci/run calls it up front). Needs root and apt-get.
#
#   usage: install.sh [accounting]     accounting: also slurmdbd + mariadb-server (for sacct)
set -euo pipefail
log() { echo "slurm-local: $*" >&2; }

PKGS=(slurmctld slurmd slurm-client munge)
[[ ${1:-} == accounting ]] && PKGS+=(slurmdbd mariadb-server)
missing=()
for p in "${PKGS[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'ok installed' || missing+=("$p"); done
((${#missing[@]})) || exit 0
[[ $(id -u) == 0 ]] || { log "ERROR: installing ${missing[*]} needs root"; exit 1; }
command -v apt-get >/dev/null || { log "ERROR: ${missing[*]} missing and no apt-get to install them"; exit 1; }
log "installing ${missing[*]} (apt)"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >&2
apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
