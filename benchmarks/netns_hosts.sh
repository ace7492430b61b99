#!/usr/bin/env bash
# Run one command per "host" in H network namespaces joined by a switch: a multi-node job on one machine.
#
#   sudo benchmarks/netns_hosts.sh [-H HOSTS] [-n NICS] [-r RATE] [-m MTU] [-c COUNTERS_FILE] -- COMMAND [ARGS...]
#
# Builds namespaces <tag>h0 .. <tag>h{H-1} (tag = dxh<pid>; default H=2), each with loopback and one
# veth end "eth0" at 10.78.0.(i+1)/24, and a switch namespace <tag>sw holding a bridge with the
# other veth ends. Inter-host traffic crosses veth -> bridge -> veth; traffic between ranks of
# one host stays on that namespace's loopback (fast, unshaped). RATE (default none) shapes each
# host's link in both directions with `tc qdisc ... tbf rate RATE burst 128kb latency 50ms` on
# both veth ends (e.g. 1gbit). Then runs COMMAND once per host, at once, inside its namespace,
# with NODE_RANK=i, NNODES=H, MASTER_ADDR=10.78.0.1, HOST_ADDR=10.78.0.(i+1) and
# GLOO_SOCKET_IFNAME=eth0 in the environment; the placeholders {node}, {nnodes}, {addr} and
# {master} in COMMAND are replaced by the same. COMMAND is normally a launcher that starts this
# host's ranks (deepspeed --no_ssh --node_rank {node}, torchrun --node_rank {node}); see
# docs/multinode.md. Traffic only flows between these namespaces. The namespaces (and with them
# the veths, the bridge and the qdiscs) are ALWAYS removed on exit, also on errors and Ctrl-C.
# The bytes each host's eth0 transmitted during COMMAND are written as JSON to COUNTERS_FILE.
#
# -n NICS (default 0: the single-NIC mode above) gives every host NICS NICs, one per local rank
# (EFLOPS' multi-NIC hosts on a non-blocking switch): each rank gets a namespace <tag>h<i>r<k> of
# its own whose "eth0" (10.78.k.(i+1)/16) is its NIC on the switch, shaped at RATE like the
# single NIC, so every rank's traffic to other hosts leaves through its own link, and whose
# "hl0" is its port on the host's internal bridge (namespace <tag>h<i>, unshaped): a /32 route
# per sibling sends the traffic between ranks of one host over that bridge. COMMAND runs in the
# namespace of local rank 0 (<tag>h<i>r0), with RANK_NETNS_PREFIX=<tag>h<i>r exported; the
# launcher must start each rank through benchmarks/rank_netns.sh (`deepspeed --no_python ...
# benchmarks/rank_netns.sh python script.py`, `torchrun --no-python ... benchmarks/rank_netns.sh
# python script.py`), which moves local rank k (LOCAL_RANK) into <tag>h<i>r<k>. Run a host's
# ranks (slots) = NICS. COUNTERS_FILE then holds the bytes of every NIC (nic_tx_bytes, per host).
# Exit status: that of COMMAND (the first failing host's).
set -euo pipefail

HOSTS=2
RATE=none
COUNTERS=""
MTU=1500
NICS=0
while getopts "H:n:r:m:c:h" opt; do
  case "$opt" in
    H) HOSTS="$OPTARG" ;;
    r) RATE="$OPTARG" ;;
    m) MTU="$OPTARG" ;;
    c) COUNTERS="$OPTARG" ;;
    n) NICS="$OPTARG" ;;
    h) sed -n '2,31p' "$0"; exit 0 ;;
    *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[ "${1:-}" = "--" ] && shift
[ $# -gt 0 ] || { echo "netns_hosts.sh: no command given (see -h)" >&2; exit 2; }
[ "$(id -u)" = 0 ] || { echo "netns_hosts.sh: needs root (ip netns, tc)" >&2; exit 2; }
command -v ip >/dev/null || { echo "netns_hosts.sh: needs iproute2 (ip)" >&2; exit 2; }
[ "$HOSTS" -ge 1 ] && [ "$HOSTS" -le 200 ] || { echo "netns_hosts.sh: -H $HOSTS: allowed 1..200" >&2; exit 2; }
[ "$NICS" -ge 0 ] && [ "$NICS" -le 64 ] || { echo "netns_hosts.sh: -n $NICS: allowed 0..64" >&2; exit 2; }

TAG="dxh$$"
SW="${TAG}sw"
NS=()
PIDS=()
RANKNS=()  # -n: every rank's namespace, host-major
for ((i = 0; i < HOSTS; i++)); do
  NS+=("${TAG}h$i")
  for ((k = 0; k < NICS; k++)); do RANKNS+=("${TAG}h${i}r$k"); done
done
MASTER="10.78.0.1"

cleanup() {
  for pid in "${PIDS[@]}"; do kill -- "-$pid" 2>/dev/null || kill "$pid" 2>/dev/null || true; done
  for ns in "${RANKNS[@]}" "${NS[@]}" "$SW"; do ip netns del "$ns" 2>/dev/null || true; done
}
trap cleanup EXIT
trap 'exit 130' INT TERM

ip netns add "$SW"
ip -n "$SW" link add br0 type bridge
ip -n "$SW" link set br0 up
shape() {  # shape NAMESPACE DEVICE: tbf at RATE (nothing when unshaped)
  [ "$RATE" = "none" ] || tc -n "$1" qdisc replace dev "$2" root tbf rate "$RATE" burst 128kb latency 50ms
}
sysctl_ns() { ip netns exec "$1" sysctl -qw "$2" >/dev/null; }

for ((i = 0; i < HOSTS; i++)); do
  ns="${NS[$i]}"
  ip netns add "$ns"
  ip -n "$ns" link set lo up
  if [ "$NICS" = 0 ]; then  # one NIC per host; its ranks share the namespace and its loopback
    ip -n "$SW" link add "p$i" type veth peer name eth0 netns "$ns"
    ip -n "$SW" link set "p$i" master br0 mtu "$MTU" up
    ip -n "$ns" addr add "10.78.0.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 mtu "$MTU" up
    shape "$ns" eth0
    shape "$SW" "p$i"
    continue
  fi
  ip -n "$ns" link add hbr type bridge  # the host's internal bus (unshaped)
  ip -n "$ns" link set hbr up
  for ((k = 0; k < NICS; k++)); do  # rank k of host i: its NIC on the switch, its port on the host bus
    rns="${TAG}h${i}r$k"
    ip netns add "$rns"
    ip -n "$rns" link set lo up
    sysctl_ns "$rns" net.ipv4.conf.all.rp_filter=0
    sysctl_ns "$rns" net.ipv4.conf.default.rp_filter=0
    ip -n "$SW" link add "p${i}_$k" type veth peer name eth0 netns "$rns"
    ip -n "$SW" link set "p${i}_$k" master br0 mtu "$MTU" up
    ip -n "$rns" addr add "10.78.$k.$((i + 1))/16" dev eth0
    ip -n "$rns" link set eth0 mtu "$MTU" up
    ip -n "$ns" link add "q$k" type veth peer name hl0 netns "$rns"
    ip -n "$ns" link set "q$k" master hbr mtu "$MTU" up
    ip -n "$rns" link set hl0 mtu "$MTU" up
    shape "$rns" eth0
    shape "$SW" "p${i}_$k"
  done
  for ((k = 0; k < NICS; k++)); do  # siblings' addresses over the host bus, not the switch
    for ((j = 0; j < NICS; j++)); do
      [ "$j" = "$k" ] || ip -n "${TAG}h${i}r$k" route add "10.78.$j.$((i + 1))/32" dev hl0 src "10.78.$k.$((i + 1))"
    done
  done
done

nic_ns() { if [ "$NICS" = 0 ]; then echo "${NS[$1]}"; else echo "${TAG}h${1}r$2"; fi; }  # nic_ns HOST NIC
tx_bytes() { ip netns exec "$(nic_ns "$1" "$2")" cat /sys/class/net/eth0/statistics/tx_bytes; }
NPER=$(( NICS > 0 ? NICS : 1 ))
before=()
for ((i = 0; i < HOSTS; i++)); do for ((k = 0; k < NPER; k++)); do before+=("$(tx_bytes "$i" "$k")"); done; done

for ((i = 0; i < HOSTS; i++)); do
  args=()
  for a in "$@"; do
    a="${a//\{node\}/$i}"; a="${a//\{nnodes\}/$HOSTS}"; a="${a//\{addr\}/10.78.0.$((i + 1))}"
    args+=("${a//\{master\}/$MASTER}")
  done
  extra=()
  [ "$NICS" = 0 ] || extra=(RANK_NETNS_PREFIX="${TAG}h${i}r")
  setsid ip netns exec "$(nic_ns "$i" 0)" env NODE_RANK="$i" NNODES="$HOSTS" MASTER_ADDR="$MASTER" \
    HOST_ADDR="10.78.0.$((i + 1))" GLOO_SOCKET_IFNAME=eth0 "${extra[@]}" "${args[@]}" &
  PIDS+=("$!")
done
status=0
for pid in "${PIDS[@]}"; do
  wait "$pid" || { rc=$?; [ "$status" = 0 ] && status=$rc; }
done
PIDS=()

if [ -n "$COUNTERS" ]; then
  tx=()
  nic=()
  for ((i = 0; i < HOSTS; i++)); do
    host=0
    per=()
    for ((k = 0; k < NPER; k++)); do
      d=$(( $(tx_bytes "$i" "$k") - before[i * NPER + k] ))
      host=$(( host + d ))
      per+=("$d")
    done
    tx+=("$host")
    nic+=("[$(IFS=,; echo "${per[*]}")]")
  done
  (IFS=,; printf '{"rate": "%s", "hosts": %d, "nics": %d, "tx_bytes": [%s], "nic_tx_bytes": [%s]}\n' \
    "$RATE" "$HOSTS" "$NICS" "${tx[*]}" "${nic[*]}") > "$COUNTERS"
fi
exit "$status"
