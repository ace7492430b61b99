#!/usr/bin/env bash
# Start one rank in its own network namespace (benchmarks/netns_hosts.sh -n NICS: one NIC per rank).
#
#   rank_netns.sh [--local_rank=K] PROGRAM [ARGS...]
#
# The launcher's per-rank command (deepspeed --no_python, torchrun --no-python): execs PROGRAM in
# the namespace ${RANK_NETNS_PREFIX}${LOCAL_RANK}, where the rank's NIC is eth0 (GLOO_SOCKET_IFNAME
# stays eth0). A leading --local_rank=K (DeepSpeed's launcher adds it) is dropped: LOCAL_RANK is in
# the environment under both launchers. Without RANK_NETNS_PREFIX (not under netns_hosts.sh -n) the
# program runs where it is.
set -euo pipefail
case "${1:-}" in --local_rank=*) shift ;; esac
[ $# -gt 0 ] || { echo "rank_netns.sh: no program given" >&2; exit 2; }
if [ -z "${RANK_NETNS_PREFIX:-}" ]; then exec "$@"; fi
: "${LOCAL_RANK:?rank_netns.sh: LOCAL_RANK is not set (start it from a launcher)}"
exec ip netns exec "${RANK_NETNS_PREFIX}${LOCAL_RANK}" "$@"
