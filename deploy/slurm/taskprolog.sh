#!/bin/bash -p
# Slurm TaskProlog: point the job's training processes at this node's A-Dloader agent.
#   slurm.conf:  TaskProlog=/opt/adloader/slurm/taskprolog.sh     (see docs/operations.md, "Slurm")
#
# slurmstepd runs this as the job's user before each task and reads its stdout: every line
# `export NAME=value` is added to the task's environment. It prints:
#   export ADLOADER_ENDPOINT=<the agent's socket>   (unless the job already set its own)
#   export ADLOADER_JOB_ID=<SLURM_JOB_ID>           (the id the prolog registered the job under)
# Nothing else is printed on stdout. Always exits 0; no PATH assumed; calls no program at all.
# A job opts out with ADLOADER_DISABLE=1 in its environment: then nothing is printed.
# `bash -p` (the first line): slurmstepd runs this with the job's environment, from which bash would
# otherwise source the file named by BASH_ENV (module systems set it) and import exported functions
# (one named `echo` included) before a line of this script runs; whatever they print on stdout
# would be read as the task's export lines. -p skips both, and ignores SHELLOPTS and BASHOPTS.
#
# The endpoint has one source of truth, the agent's config file (AGENT_CONFIG, mode 0644): its
# `endpoint` key, read here with bash alone in the forms `endpoint = "..."` and `endpoint = '...'`
# (a comment may follow) before any `[table]` header (a key after one is the table's), else the
# agent's default. A key in another form (escapes, a quoted key)
# is reported on stderr and no endpoint is exported (the client then uses its own default); so is a
# file the job's user cannot read, or one in a directory the user cannot search (it may be there).

# Install-time line, set by `adloader install-service`:
AGENT_CONFIG=/etc/adloader/agent.toml
# The agent's default endpoint (the systemd unit's RuntimeDirectory=adloader: /run/adloader).
DEFAULT_ENDPOINT=ipc:///run/adloader/agent.sock

# Print the endpoint key's value from AGENT_CONFIG, or DEFAULT_ENDPOINT when the file or the key is
# absent; return 1 (and say why on stderr) when the key is there in a form this reader does not take.
config_endpoint() {
    local line
    local basic='^[[:space:]]*endpoint[[:space:]]*=[[:space:]]*"([^"\\]*)"[[:space:]]*(#.*)?$'
    local literal="^[[:space:]]*endpoint[[:space:]]*=[[:space:]]*'([^']*)'[[:space:]]*(#.*)?\$"
    local any='^[[:space:]]*["'"'"']?endpoint["'"'"']?[[:space:]]*='
    local table='^[[:space:]]*\['      # a [table] header: every key after it is the table's, not top-level
    local dir=${AGENT_CONFIG%/*}
    if [ -e "$AGENT_CONFIG" ] && [ ! -r "$AGENT_CONFIG" ]; then
        # the job's user cannot read it (mode 0600?): its endpoint may not be the default, so guess nothing
        echo "adloader-taskprolog: cannot read $AGENT_CONFIG as uid $UID (it must be readable by job users, mode 0644): no endpoint exported" >&2
        return 1
    fi
    if [ ! -e "$AGENT_CONFIG" ] && [ -n "$dir" ] && [ -e "$dir" ] && [ ! -x "$dir" ]; then
        # its directory is closed to the job's user (mode 0700?): the file looks absent but may be
        # there with another endpoint, so guess nothing either
        echo "adloader-taskprolog: cannot look into $dir as uid $UID (it must be searchable by job users, mode 0755): no endpoint exported" >&2
        return 1
    fi
    if [ -e "$AGENT_CONFIG" ] && [ ! -f "$AGENT_CONFIG" ]; then
        # a FIFO would block the read below for ever (and the task's launch with it); a directory,
        # a device: not a config file either, so guess nothing (the agent refuses such a file too)
        echo "adloader-taskprolog: $AGENT_CONFIG is not a regular file: no endpoint exported" >&2
        return 1
    fi
    if [ -r "$AGENT_CONFIG" ]; then
        while IFS= read -r line || [ -n "$line" ]; do
            [[ $line =~ $table ]] && break
            if [[ $line =~ $basic ]] || [[ $line =~ $literal ]]; then
                echo "${BASH_REMATCH[1]}"
                return 0
            fi
            if [[ $line =~ $any ]]; then
                echo "adloader-taskprolog: cannot read the endpoint in $AGENT_CONFIG: $line" >&2
                return 1
            fi
        done <"$AGENT_CONFIG"
    fi
    echo "$DEFAULT_ENDPOINT"
}

disable=${ADLOADER_DISABLE:-}
disable=${disable//[[:space:]]/}
case "${disable,,}" in      # any case, blanks aside, as the client reads it (adloader.env.disabled)
    1|true|yes|on) exit 0 ;;
esac
if [ -z "${ADLOADER_ENDPOINT:-}" ]; then
    if ep=$(config_endpoint) && [ -n "$ep" ]; then
        echo "export ADLOADER_ENDPOINT=$ep"
    fi
fi
case "${SLURM_JOB_ID:-}" in
    ''|*[!0-9]*) ;;   # not a job number: print nothing rather than a bad id
    *) echo "export ADLOADER_JOB_ID=$SLURM_JOB_ID" ;;
esac
exit 0
