#!/bin/bash
# Slurm TaskProlog: point the job's training processes at this node's A-Dloader agent.
#   slurm.conf:  TaskProlog=/opt/adloader/slurm/taskprolog.sh     (see docs/operations.md, "Slurm")
#
# slurmstepd runs this as the job's user before each task and reads its stdout: every line
# `export NAME=value` is added to the task's environment. It prints:
#   export ADLOADER_ENDPOINT=<the agent's socket>   (unless the job already set its own)
#   export ADLOADER_JOB_ID=<SLURM_JOB_ID>           (the id the prolog registered the job under)
# Nothing else is printed on stdout. Always exits 0; no PATH assumed; calls no program at all.
# A job opts out with ADLOADER_DISABLE=1 in its environment: then nothing is printed.

# The agent's endpoint on this node (the systemd unit's RuntimeDirectory=adloader: /run/adloader).
AGENT_ENDPOINT=ipc:///run/adloader/agent.sock

case "${ADLOADER_DISABLE:-}" in
    1|true|yes|on) exit 0 ;;
esac
if [ -z "${ADLOADER_ENDPOINT:-}" ]; then
    echo "export ADLOADER_ENDPOINT=$AGENT_ENDPOINT"
fi
case "${SLURM_JOB_ID:-}" in
    ''|*[!0-9]*) ;;   # not a job number: print nothing rather than a bad id
    *) echo "export ADLOADER_JOB_ID=$SLURM_JOB_ID" ;;
esac
exit 0
