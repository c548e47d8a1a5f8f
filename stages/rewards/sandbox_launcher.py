"""The sandbox's launcher and bootstrap, as Python source run by `python -I -S` (the launcher, root,
outside the namespaces it makes) and `python -S -s -P` (the program's interpreter): no import of
r1flow, no site-packages.
"""

# The launcher's command line, `python3.x -I -S -c LOADER r1flow-sandbox-XXXX` (the name of the
# run's directory, which the program sees anyway, so that `ps` tells the runs apart), is pid 1's
# inside the sandbox, where the program can read it (/proc/1/cmdline): so it holds no path and no
# configuration. The loader reads the launcher's code and configuration (host paths, the root
# plan, the masks) from a memfd and closes it before anything is forked.
LOADER = """import json, os
with open({fd}, "rb") as f:
    d = json.load(f)
exec(d["code"], dict(__name__="__main__", cfg=d["cfg"]))"""

# Runs in a new session, started by LOADER with `cfg` set. It has to be root for the
# namespaces, so it stays outside of them and does not count against the sandbox uid's NPROC.
LAUNCHER = r"""
import ctypes, json, os, resource, signal, sys

status_fd = cfg["status_fd"]
child_fd = None
stop_requested = False


def say(**msg):
    os.write(status_fd, json.dumps(msg).encode() + b"\n")


def stop(signum, frame):
    global stop_requested
    stop_requested = True
    if child_fd is not None:
        try:
            signal.pidfd_send_signal(child_fd, signal.SIGKILL)
        except ProcessLookupError:
            pass


signal.signal(signal.SIGUSR1, stop)
signal.signal(signal.SIGALRM, stop)
signal.alarm(cfg["backstop_s"])
libc = ctypes.CDLL(None, use_errno=True)
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 1, 38, 22, 2
CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2


def check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    check(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
          f"mount {source} on {target}")


def overlay(target, source, flags, opaque):
    # A bind's mountinfo line names its source's path in the host file system, and a mask's its mount
    # point; an overlay's line names its layers as given, here as the launcher's descriptors. The upper
    # of the two lower layers (one alone needs an upper layer) holds an opaque, empty folder at each
    # masked path, so no mask is a mount of its own.
    layer = os.path.join(cfg["layers"], str(len(os.listdir(cfg["layers"]))))
    os.mkdir(layer, 0o755)
    os.makedirs(target, 0o755, exist_ok=True)
    fds = []
    try:
        for rel in opaque:
            os.makedirs(os.path.join(layer, rel), 0o755)
            os.setxattr(os.path.join(layer, rel), "trusted.overlay.opaque", b"y")
        fds = [os.open(path, os.O_PATH | os.O_DIRECTORY) for path in (layer, source)]
        mount("r1flow", target, "overlay", flags, "lowerdir=" + ":".join(f"/proc/self/fd/{fd}" for fd in fds))
    except OSError:  # no overlayfs (or trusted xattrs) here: a bind and masks, whose mountinfo lines name them
        mount(source, target, None, MS_BIND)
        mount(None, target, None, MS_REMOUNT | MS_BIND | flags)
        for rel in opaque:
            mask(os.path.join(target, rel))
    finally:
        for fd in fds:
            os.close(fd)


def mask(target):  # an empty read-only folder over a host folder inside a bind
    mount("tmpfs", target, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,nr_inodes=16,mode=0555")


def setup_namespaces():
    # Build the sandbox's whole file tree on a fresh tmpfs (cfg["root_plan"], see sandbox_root.root_plan) and
    # pivot_root into it: the host's tree is detached from the namespace, not just read-only.
    check(libc.unshare(CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS), "unshare")
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    os.umask(0o022)
    root = cfg["root_mount"]
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, cfg["root_options"])
    for kind, path, *args in cfg["root_plan"]:
        target = root + path
        if kind == "dir":
            os.makedirs(target, 0o755, exist_ok=True)
        elif kind == "symlink":
            os.symlink(args[0], target)
        elif kind == "tmpfs":
            os.makedirs(target, 0o755, exist_ok=True)
            mount("tmpfs", target, "tmpfs", MS_NOSUID | MS_NODEV, args[0])
        elif kind == "overlay":  # source read-only, as a bind, with masked folders, and mountinfo names neither
            overlay(target, *args)
        else:  # "bind": source onto path, not recursive, then remounted with flags (read-only)
            source, flags = args
            if os.path.isdir(source):
                os.makedirs(target, 0o755, exist_ok=True)
            else:
                os.close(os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            mount(source, target, None, MS_BIND)
            mount(None, target, None, MS_REMOUNT | MS_BIND | flags)
    os.chdir(root)
    check(libc.syscall(ctypes.c_long(cfg["sys_pivot_root"]), b".", b"."), "pivot_root")
    check(libc.umount2(b".", MNT_DETACH), "umount2 of the old root")
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
    return True


def seccomp_program(hex_insns):
    # struct sock_fprog {unsigned short len; struct sock_filter *filter;} as two longs: the
    # architectures seccomp_filter knows are little-endian and 64-bit. Built before any fork
    # (a Structure subclass made in the freshly forked child cost ~0.3 ms).
    if hex_insns is None:
        return None
    data = bytes.fromhex(hex_insns)
    insns = ctypes.create_string_buffer(data, len(data))
    return (ctypes.c_ulong * 2)(len(data) // 8, ctypes.addressof(insns)), insns


def forked(main):  # the child runs main() and never returns
    pid = os.fork()
    if pid == 0:
        try:
            main()
        except BaseException as exc:
            say(error=f"{main.__name__}: {exc!r}")
        os._exit(125)
    return pid


def exec_program():
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    for name, value in cfg["rlimits"].items():
        resource.setrlimit(getattr(resource, name), tuple(value))
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setresgid(cfg["uid"], cfg["uid"], cfg["uid"])
        os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
    if seccomp is not None:  # see seccomp_filter; needs no_new_privs, and holds across execve
        check(libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, seccomp[0], 0, 0), "prctl(SECCOMP)")
    os.chdir(cfg["workdir"])
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
    os.set_inheritable(status_fd, False)  # a successful exec closes it: no message means success
    os.execve(cfg["argv"][0], cfg["argv"], cfg["env"])


def init_main():
    # pid 1 of the new pid namespace. The program must not be pid 1: init ignores every signal
    # it has no handler for (SIGXCPU included). This init reaps orphans, reports the program's
    # end and exits with it, upon which the kernel kills whatever is left in the namespace.
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    program = forked(exec_program)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    while True:
        pid, status, usage = os.wait4(-1, 0)
        if pid == program:
            say(status=status, cpu_s=usage.ru_utime + usage.ru_stime)
            os._exit(0)


try:
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    if os.getppid() != cfg["parent_pid"]:
        os._exit(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    seccomp = seccomp_program(cfg["seccomp"])
    ro_root = setup_namespaces() if cfg["namespaces"] else False
    pid = forked(init_main if cfg["namespaces"] else exec_program)
except BaseException as exc:
    say(error=f"launcher: {exc!r}")
    os._exit(125)
child_fd = os.pidfd_open(pid)
if stop_requested:
    stop(None, None)
for fd in (0, 1, 2):  # only the program may hold the pipes: their EOF means it is gone
    os.dup2(devnull, fd)
_, status, usage = os.wait4(pid, 0)
if not cfg["namespaces"]:
    say(status=status, cpu_s=usage.ru_utime + usage.ru_stime)
say(ro_root=ro_root)
"""

# Runs as `python -S -s -P -c BOOTSTRAP HOOKS PROGRAM`; leaves no names behind in __main__.
BOOTSTRAP = r"""
def _boot():
    import builtins, sys

    def exit(code=None):
        raise SystemExit(code)

    builtins.exit = builtins.quit = exit
    if sys.argv[1] == "1":
        blocked = frozenset({
            "socket.__new__", "socket.connect", "socket.bind", "socket.getaddrinfo",
            "socket.gethostbyname", "socket.gethostbyaddr", "socket.sendto", "socket.sendmsg",
            "ctypes.dlopen", "ctypes.dlsym", "ctypes.cdata", "subprocess.Popen", "os.system",
            "os.fork", "os.forkpty", "os.kill", "os.killpg", "pty.spawn",
        })
        prefixes = ("os.exec", "os.spawn", "os.posix_spawn")

        def hook(event, args):
            if event in blocked or event.startswith(prefixes):
                raise PermissionError(f"{event} is blocked by the r1flow sandbox")

        sys.addaudithook(hook)
    sys.argv[:] = sys.argv[2:]
    main = sys.modules["__main__"].__dict__
    main["__file__"] = sys.argv[0]
    del main["_boot"]
    with open(sys.argv[0], "rb") as f:
        return compile(f.read(), sys.argv[0], "exec")


exec(_boot())
"""
