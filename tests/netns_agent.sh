#!/bin/sh
# Open MPI rsh agent for the namespace hosts of tests/netns.py: "agent [options] HOST command..."
# runs the command inside HOST's namespace with its hostname (and only on its CPUs, when given).
# RP_NETNS_MAP="ADDR=NS:NAME:CPUS ..." (CPUS may be empty).
while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done
host=$1; shift
for pair in $RP_NETNS_MAP; do
  addr=${pair%%=*}; rest=${pair#*=}; ns=${rest%%:*}; rest=${rest#*:}; name=${rest%%:*}; cpus=${rest#*:}
  if [ "$addr" = "$host" ]; then
    if [ -n "$cpus" ] && [ "$cpus" != "$rest" ]; then
      exec ip netns exec "$ns" taskset -c "$cpus" unshare --uts sh -c "hostname $name; exec sh -c \"\$0\"" "$*"
    fi
    exec ip netns exec "$ns" unshare --uts sh -c "hostname $name; exec sh -c \"\$0\"" "$*"
  fi
done
echo "agent: unknown host $host" >&2; exit 1
