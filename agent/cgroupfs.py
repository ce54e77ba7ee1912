"""The one module that writes cgroups (/sys/fs/cgroup) and CPU affinity, and reads what they need:
cgroup trees, ``/proc/<pid>/cgroup`` of the processes it moves, /sys/block schedulers, mounts.

Every root path is a parameter, so tests run this against small fake trees in ``tmp_path`` and, as
root on a cgroup v1 machine, against the real thing. Other modules read /proc for facts of their own,
each with its root a parameter too: ``agent.security`` (a process's stat, NSpid, children),
``agent.jobprocs`` (a registered job's processes: environ, cmdline, cgroup), ``agent.collector`` (a
rank's cgroup, to tell a cooperative job), ``agent.psi`` and ``adloader.memory`` (pressure, meminfo,
smaps_rollup), and in the training process ``adloader.autotune`` (its own CPU quota) and the loader's
workers (``/proc/self/schedstat``). None of them writes. Every ``OSError`` leaves this module as a domain
error (``CgroupError`` and its subclasses), named after what it means for the caller:

    ESRCH                   -> JobGone       (the process exited; moving it is moot)
    EACCES, EPERM, EROFS    -> NotPermitted
    ENOENT                  -> NotSupported  (controller or interface file absent) / JobGone for /proc
    EINVAL, ERANGE, ENOSPC  -> InvalidValue  (v1 cpuset: ENOSPC = cpus/mems not set before a task joins)
    EBUSY, ENOTEMPTY        -> Busy          (rmdir of a group that still has tasks or children)

Layout detection follows systemd's documented rule (systemd.io/CGROUP_DELEGATION, "Three Different
Tree Setups"): statfs(/sys/fs/cgroup) is cgroup2 -> unified; tmpfs with a cgroup2 mount at
``unified`` -> hybrid; tmpfs otherwise -> legacy.

cgroup v1 goes through cgroupspy nodes (one hierarchy per controller, e.g. /sys/fs/cgroup/cpu, found
at its mount point in ``/proc/self/mountinfo``: a joined ``cpu,cpuacct`` mount has no ``cpu`` name
unless a symlink gives it one);
cgroup v2 is a small file adapter over the unified mount. Both expose the same ``Hierarchy`` calls.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import re
from typing import Callable, Iterable, Optional

CGROUP2_SUPER_MAGIC = 0x63677270
TMPFS_MAGIC = 0x01021994
NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs",
              "fuse.sshfs", "9p", "afs", "panfs", "wekafs")


class CgroupError(Exception):
    """A cgroup or process operation failed; the message names the path and what to do."""


class JobGone(CgroupError):
    """The process (or its /proc entry) no longer exists."""


class NotPermitted(CgroupError):
    """No permission (not root, read-only mount, or a group another manager owns)."""


class NotSupported(CgroupError):
    """The controller or interface file does not exist on this machine."""


class InvalidValue(CgroupError):
    """The kernel refused the value."""


class Busy(CgroupError):
    """The group still has tasks or children."""


def domain_error(e: OSError, what: str) -> CgroupError:
    code = e.errno
    msg = f"{what}: {os.strerror(code) if code else e}"
    if code == errno.ESRCH:
        return JobGone(msg)
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        return NotPermitted(msg + " (the agent needs root, and only writes groups it created)")
    if code == errno.ENOENT:
        return NotSupported(msg)
    if code in (errno.EINVAL, errno.ERANGE, errno.ENOSPC):
        return InvalidValue(msg)
    if code in (errno.EBUSY, errno.ENOTEMPTY):
        return Busy(msg)
    return CgroupError(msg)


# -- layout -------------------------------------------------------------------------------------

class _StatFs(ctypes.Structure):
    # struct statfs on Linux: f_type is the first field, a long (__fsword_t) on every 64- and 32-bit ABI
    _fields_ = [("f_type", ctypes.c_long), ("_rest", ctypes.c_byte * 256)]


def fs_magic(path: str) -> int:
    """statfs(2) f_type of ``path``."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    buf = _StatFs()
    if libc.statfs(os.fsencode(path), ctypes.byref(buf)) != 0:
        e = ctypes.get_errno()
        raise domain_error(OSError(e, os.strerror(e)), f"statfs {path}")
    return buf.f_type & 0xFFFFFFFF


def detect_layout(root: str = "/sys/fs/cgroup", magic: Callable[[str], int] = fs_magic) -> str:
    """'unified', 'hybrid' or 'legacy' (systemd's rule; see the module docstring)."""
    m = magic(root)
    if m == CGROUP2_SUPER_MAGIC:
        return "unified"
    unified = os.path.join(root, "unified")
    if m == TMPFS_MAGIC:
        if os.path.isdir(unified) and magic(unified) == CGROUP2_SUPER_MAGIC:
            return "hybrid"
        return "legacy"
    raise NotSupported(f"{root} is neither a cgroup2 mount nor a tmpfs of cgroup v1 hierarchies "
                       f"(statfs magic {m:#x}); set cgroup_mode explicitly or 'off'")


# -- hierarchies --------------------------------------------------------------------------------

class Hierarchy:
    """One cgroup hierarchy rooted at ``root``; groups are named by paths relative to it ('' = root).
    ``proc_root``: where ``move`` looks for a process that the kernel refused, to tell one that is gone."""

    version = 0

    def __init__(self, root: str, proc_root: str = "/proc") -> None:
        self.root = root
        self.proc_root = proc_root

    def path(self, rel: str, file: str = "") -> str:
        p = os.path.join(self.root, rel.strip("/")) if rel.strip("/") else self.root
        return os.path.join(p, file) if file else p

    def available(self) -> bool:
        return os.path.isfile(self.path("", "cgroup.procs"))

    def exists(self, rel: str) -> bool:
        return os.path.isdir(self.path(rel))

    def has_file(self, rel: str, file: str) -> bool:
        return os.path.exists(self.path(rel, file))

    def identity(self, rel: str) -> Optional[int]:
        """The group's inode number (None if it is gone): a group removed and made again under the same
        name (an admin's rmdir, systemd) is another group, with the kernel's defaults in its files."""
        try:
            return os.stat(self.path(rel)).st_ino
        except OSError:
            return None

    def mkdir(self, rel: str) -> bool:
        """Create the group; False if it existed already."""
        try:
            os.mkdir(self.path(rel))
            return True
        except FileExistsError:
            return False
        except OSError as e:
            raise domain_error(e, f"mkdir {self.path(rel)}") from None

    def rmdir(self, rel: str) -> None:
        try:
            os.rmdir(self.path(rel))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise domain_error(e, f"rmdir {self.path(rel)}") from None

    def read(self, rel: str, file: str) -> str:
        try:
            with open(self.path(rel, file)) as f:
                return f.read().strip()
        except OSError as e:
            raise domain_error(e, f"read {self.path(rel, file)}") from None

    def write(self, rel: str, file: str, value) -> None:
        try:
            with open(self.path(rel, file), "w") as f:
                f.write(str(value))
        except OSError as e:
            raise domain_error(e, f"write {value!r} to {self.path(rel, file)}") from None

    def children(self, rel: str) -> list[str]:
        """Every group below ``rel`` (not ``rel`` itself), as paths relative to the root."""
        out = []
        for dirpath, dirnames, _ in os.walk(self.path(rel)):
            for d in dirnames:
                out.append(os.path.relpath(os.path.join(dirpath, d), self.root))
        return out

    def procs(self, rel: str) -> list[int]:
        text = self.read(rel, "cgroup.procs")
        return [int(x) for x in text.split()]

    def move(self, rel: str, pid: int) -> None:
        """Move the whole process (every thread) into the group; JobGone if it exited."""
        try:
            self.write(rel, "cgroup.procs", int(pid))
        except InvalidValue as e:
            # v1 answers EINVAL (v2 ESRCH) for a pid that does not exist any more
            if not os.path.exists(os.path.join(self.proc_root, str(int(pid)))):
                raise JobGone(str(e)) from None
            raise


class V1Hierarchy(Hierarchy):
    """A cgroup v1 controller hierarchy (e.g. /sys/fs/cgroup/cpu), through cgroupspy nodes.

    ``mount``: where the hierarchy is mounted (``v1_mounts``: a joined ``cpu,cpuacct`` or a custom
    name); default ``<cgroup_root>/<controller>``. cgroupspy picks a node's controller by the name of
    the directory under its root (``Node._get_controller_type``), which a joined mount does not match,
    so the controller is set on the hierarchy's node here and its children inherit it.
    """

    version = 1

    def __init__(self, cgroup_root: str, controller: str, mount: Optional[str] = None,
                 proc_root: str = "/proc") -> None:
        from cgroupspy.nodes import Node

        mount = os.path.normpath(mount or os.path.join(cgroup_root, controller))
        super().__init__(mount, proc_root)
        self.controller = controller
        self._top = Node(os.fsencode(os.path.dirname(mount)))
        self._ctrl = Node(os.fsencode(os.path.basename(mount)), parent=self._top)
        ctype = controller.encode()
        if self._ctrl.controller_type != ctype and ctype in Node.CONTROLLERS:
            self._ctrl.controller_type = ctype
            self._ctrl.controller = Node.CONTROLLERS[ctype](self._ctrl)

    def node(self, rel: str):
        from cgroupspy.nodes import Node

        n = self._ctrl
        for part in [p for p in rel.strip("/").split("/") if p]:
            n = Node(os.fsencode(part), parent=n)     # the name's bytes, as os.walk decoded them
        return n

    # mkdir: Hierarchy's plain mkdir, not cgroupspy's Node.create_cgroup: that one remembers every child
    # it made on the parent node, and the hierarchy's top node lives as long as the agent, so a subtree
    # removed by someone else could never be made again (RuntimeError "Node ... already exists" at
    # every apply, not even a CgroupError)

    def read(self, rel: str, file: str) -> str:
        node = self.node(rel)
        try:
            return node.controller.get_property(file.encode()).strip() if node.controller else super().read(rel, file)
        except OSError as e:
            raise domain_error(e, f"read {self.path(rel, file)}") from None

    def write(self, rel: str, file: str, value) -> None:
        node = self.node(rel)
        if node.controller is None:      # a controller cgroupspy does not know (e.g. a named hierarchy)
            return super().write(rel, file, value)
        try:
            node.controller.set_property(file.encode(), value)
        except OSError as e:
            raise domain_error(e, f"write {value!r} to {self.path(rel, file)}") from None


class V2Hierarchy(Hierarchy):
    """The cgroup v2 unified hierarchy: plain interface files (no library needed)."""

    version = 2

    def controllers(self, rel: str = "") -> set[str]:
        try:
            return set(self.read(rel, "cgroup.controllers").split())
        except NotSupported:
            return set()

    def subtree_control(self, rel: str = "") -> set[str]:
        try:
            return set(self.read(rel, "cgroup.subtree_control").split())
        except NotSupported:
            return set()


# -- processes ----------------------------------------------------------------------------------

def proc_cgroups(pid: int, proc_root: str = "/proc") -> dict[str, str]:
    """Controller -> cgroup path of a process, from /proc/<pid>/cgroup ('' key = the v2 hierarchy).

    A v1 line names one or more controllers ("4:cpu,cpuacct:/a"); each gets its own key. Read this
    instead of building paths (Slurm renames its v2 job directories between releases).
    """
    path = os.path.join(proc_root, str(int(pid)), "cgroup")
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        raise JobGone(f"read {path}: process {pid} is gone") from None
    except OSError as e:
        raise domain_error(e, f"read {path}") from None
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, ctrls, cg = parts
        if not ctrls:
            out[""] = cg
        for c in ctrls.split(","):
            if c:
                out[c] = cg
    return out


def own_v2_cgroup(proc_root: str = "/proc") -> str:
    """This process's cgroup v2 path ("0::/path" line of /proc/self/cgroup), '/' when there is none.

    Under systemd with ``Delegate=yes`` this is the agent's unit (e.g. /system.slice/adloader-agent.service),
    the only subtree it owns. No such file or no "0::" line (a fake tree, a legacy-only host) reads as
    the root, '/'.
    """
    path = os.path.join(proc_root, "self", "cgroup")
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return "/"
    except OSError as e:
        raise domain_error(e, f"read {path}") from None
    for line in text.splitlines():
        if line.startswith("0::"):
            return line[3:].strip() or "/"
    return "/"


def get_affinity(pid: int) -> tuple[int, ...]:
    try:
        return tuple(sorted(os.sched_getaffinity(int(pid))))
    except OSError as e:
        raise domain_error(e, f"sched_getaffinity({pid})") from None


def set_affinity(pid: int, cpus: Iterable[int]) -> None:
    cpus = set(int(c) for c in cpus)
    try:
        os.sched_setaffinity(int(pid), cpus)
    except OSError as e:
        raise domain_error(e, f"sched_setaffinity({pid}, {sorted(cpus)})") from None


# -- IO probes ----------------------------------------------------------------------------------

def block_schedulers(sys_root: str = "/sys") -> dict[str, str]:
    """Block device -> its current IO scheduler (the bracketed name in queue/scheduler)."""
    base = os.path.join(sys_root, "block")
    out: dict[str, str] = {}
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return out
    for dev in names:
        try:
            with open(os.path.join(base, dev, "queue", "scheduler")) as f:
                text = f.read()
        except OSError:
            continue
        current = next((w[1:-1] for w in text.split() if w.startswith("[") and w.endswith("]")), text.strip())
        out[dev] = current
    return out


def network_mounts(proc_root: str = "/proc") -> list[tuple[str, str]]:
    """(mount point, fs type) of network file systems, which no block IO weight reaches."""
    try:
        with open(os.path.join(proc_root, "self", "mounts")) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 3 and (parts[2] in NETWORK_FS or parts[2].split(".")[0] in NETWORK_FS):
            out.append((parts[1], parts[2]))
    return out


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0-2,5' -> (0, 1, 2, 5)."""
    out: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            out.extend(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return tuple(sorted(set(out)))


def format_cpu_list(cpus: Iterable[int]) -> str:
    """(0, 1, 2, 5) -> '0-2,5'."""
    ids = sorted(set(int(c) for c in cpus))
    runs: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        runs.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(runs)


def _unescape_mount(field: str) -> str:
    """A mountinfo path field: space, tab, newline and backslash are written as octal (\\040 ...)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def v1_mounts(proc_root: str = "/proc") -> Optional[list[tuple[str, str, frozenset[str]]]]:
    """Every cgroup v1 mount this process sees, as (mount point, root within the hierarchy, the super
    options: its controllers, e.g. {'rw', 'cpu', 'cpuacct'}), from ``<proc_root>/self/mountinfo``
    (proc(5): field 4 is the root, field 5 the mount point; after the ' - ' separator come the fs type,
    the source and the super options). None when mountinfo cannot be read."""
    path = os.path.join(proc_root, "self", "mountinfo")
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = []
    for line in lines:
        fields = line.split()
        try:
            sep = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) < sep + 4 or fields[sep + 1] != "cgroup":
            continue
        out.append((_unescape_mount(fields[4]), _unescape_mount(fields[3]),
                    frozenset(fields[sep + 3].split(","))))
    return out


def v1_mount(cgroup_root: str, controller: str, proc_root: str = "/proc",
             mounts: Optional[list] = None) -> str:
    """Where the v1 ``controller`` hierarchy is: the mount of it under ``cgroup_root`` that mountinfo
    lists (a joined ``cpu,cpuacct``, ``net_cls,net_prio`` or a custom name; the mount of the whole
    hierarchy, root '/', first), else ``<cgroup_root>/<controller>`` (the usual name or its symlink;
    also what is used when mountinfo cannot be read, and for fake trees no mount lists). A mount
    outside ``cgroup_root`` is never taken: it may be a container's view of another tree; set
    ``cgroup_root`` to the directory that holds the hierarchies."""
    if controller == "memory":
        raise ValueError("the agent never touches the memory hierarchy")
    fallback = os.path.join(cgroup_root, controller)
    mounts = v1_mounts(proc_root) if mounts is None else mounts
    root = os.path.normpath(os.path.abspath(cgroup_root))
    found = [(mroot != "/", mp) for mp, mroot, opts in mounts or ()
             if controller in opts and (os.path.normpath(mp) == root or os.path.normpath(mp).startswith(root + os.sep))]
    return min(found)[1] if found else fallback


def v1_hierarchy(cgroup_root: str, controller: str, proc_root: str = "/proc",
                 mounts: Optional[list] = None) -> V1Hierarchy:
    """The v1 ``controller`` hierarchy at its mount point (``v1_mount``); ``available()`` says whether
    it is mounted. What every command and test that writes a v1 hierarchy uses, never a built path."""
    return V1Hierarchy(cgroup_root, controller, v1_mount(cgroup_root, controller, proc_root, mounts), proc_root)


def open_hierarchies(cgroup_root: str, version: int,
                     controllers: Iterable[str] = ("cpu", "cpuset", "blkio"),
                     proc_root: str = "/proc") -> dict[str, Hierarchy]:
    """v1: controller -> its hierarchy (at its mount point, ``v1_mount``), for those mounted;
    v2: {'': the unified hierarchy}."""
    if version == 2:
        return {"": V2Hierarchy(cgroup_root, proc_root)}
    out: dict[str, Hierarchy] = {}
    mounts = v1_mounts(proc_root)
    for c in controllers:
        if c == "memory":
            raise ValueError("the agent never touches the memory hierarchy")
        h = v1_hierarchy(cgroup_root, c, proc_root, mounts)
        if h.available():
            out[c] = h
    return out


def v1_controller_available(cgroup_root: str, controller: str, proc_root: str = "/proc") -> Optional[str]:
    """None when the v1 controller is mounted and writable here, else why not (for skip reasons)."""
    h = v1_mount(cgroup_root, controller, proc_root)
    if not os.path.isfile(os.path.join(h, "cgroup.procs")):
        return f"no cgroup v1 {controller} hierarchy at {h} (nor under {cgroup_root} in {proc_root}/self/mountinfo)"
    if not os.access(h, os.W_OK):
        return f"{h} is not writable (need root)"
    return None
