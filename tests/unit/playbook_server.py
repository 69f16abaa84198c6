"""The unit stage's ansible-playbook runs, forked from a process that imported Ansible once.

The unit stage runs ansible-playbook about 250 times, and each run spends ~0.4 s of CPU importing Ansible
before it reads a playbook (measured on the 2-core CI machine: 8 preflight inventories, 14.8 s of CPU run one by
one, 11.7 s forked). conftest.py writes a small ``ansible-playbook`` client into the session's directory and
test_preflight_inventories.ANSIBLE_PLAYBOOK (which every test imports) names it. The client does what the real
command would, through a server:

- The server is started by the second run with a given environment and working directory (the variables that
  Ansible reads when it is imported: every ``ANSIBLE_*``, HOME, PATH, PYTHONPATH, the locale, TMPDIR, USER), with
  that environment, and imports Ansible; that run itself runs the real command, as the first did (a server for
  one run would cost more than it saves). Later runs with the same
  environment connect to it. A run with any other environment starts its own server: nothing read at import
  time can differ from what a real run would read.
- Per run the server forks a runner, the runner forks the run: it takes the client's stdin, stdout and stderr,
  working directory, umask, environment and arguments, and calls ansible-playbook's own ``main()``. The client
  exits with the run's exit status.
- The client forwards SIGINT and SIGTERM; when the client dies (subprocess.run's timeout kills it), the runner
  sends the run SIGTERM (ansible-playbook then ends its workers' process groups), then SIGKILL to its group.
- Anything else (no server directory, the server not there yet or gone, a refused request) runs the real
  command: a failure of this shortcut can cost time, never a result.

The server ends when its directory is removed (conftest.py, at the end of the session) or after 10 minutes
without a run.
"""

from __future__ import annotations

import array
import hashlib
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time

# Read by Ansible (or Python) when it is imported: a server serves only runs whose values are its own.
KEYED = ("HOME", "PATH", "PYTHONPATH", "PYTHONHASHSEED", "LANG", "LC_ALL", "LC_CTYPE", "LANGUAGE", "TMPDIR", "USER")
IDLE_SECONDS = 600
# sun_path holds 108 bytes on Linux, the final NUL included.
MAX_SOCKET_PATH = 100
STATUS = struct.Struct("!i")


def server_key(environ: dict[str, str], cwd: str) -> str:
    """Which server may run a command started in ``cwd`` with ``environ`` (the directory holds ansible.cfg when
    ANSIBLE_CONFIG is not set)."""
    keyed = sorted((k, v) for k, v in environ.items() if k.startswith("ANSIBLE_") or k in KEYED)
    return hashlib.sha256(json.dumps([cwd, keyed]).encode()).hexdigest()[:20]


def _note(how: str, key: str) -> None:
    """With INFEROPS_PLAYBOOK_SERVER_LOG set, a line per run: how it ran (served, or why the real command) and
    the server key."""
    log = os.environ.get("INFEROPS_PLAYBOOK_SERVER_LOG")
    if log:
        with open(log, "a", encoding="utf-8") as f:
            f.write(f"{how} {key} {os.getpid()}\n")


def _run_real(real: str, argv: list[str], why: str = "real", key: str = "-") -> None:
    _note(why, key)
    os.execv(real, [real, *argv[1:]])


def _start_server(path: str) -> None:
    """Start the server for ``path`` in the background, once (an exclusive file marks it as starting), and only at
    the second run of its environment: a server costs more CPU than the one run it would save."""
    try:
        fd = os.open(path + ".seen", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        return
    except FileExistsError:
        pass
    except OSError:
        return
    try:
        fd = os.open(path + ".starting", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError:
        return
    os.close(fd)
    subprocess.Popen(  # noqa: S603 - this file, with this interpreter
        [sys.executable, os.path.abspath(__file__), "serve", path],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True, close_fds=True,
    )


def client(real: str, directory: str) -> None:
    """The ``ansible-playbook`` the tests run: through the server for this environment, else ``real``."""
    argv = list(sys.argv)
    cwd = os.getcwd()
    if not os.path.isdir(directory):
        _run_real(real, argv, "real:no-directory")
    key = server_key(dict(os.environ), cwd)
    path = os.path.join(directory, key + ".sock")
    if len(path.encode()) > MAX_SOCKET_PATH:
        _run_real(real, argv, "real:path-too-long", key)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:
        conn.close()
        _start_server(path)
        _run_real(real, argv, "real:no-server", key)
    umask = os.umask(0)
    os.umask(umask)
    request = json.dumps({"argv": argv, "cwd": cwd, "env": dict(os.environ), "umask": umask}).encode()
    try:
        # The descriptors with one byte (sendmsg may send less than a long body), then the body.
        conn.sendall(STATUS.pack(len(request)))
        conn.sendmsg([b"F"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
        conn.sendall(request)
        answer = conn.recv(1)
    except OSError:
        answer = b""
    if answer != b"+":
        # Refused before the run started (or the server went away): nothing ran, run the real command.
        conn.close()
        _run_real(real, argv, "real:refused", key)
    _note("served", key)

    def forward(signum, _frame):
        try:
            conn.sendall(bytes([signum]))
        except OSError:
            pass

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)
    data = b""
    while len(data) < STATUS.size:
        try:
            chunk = conn.recv(STATUS.size - len(data))
        except InterruptedError:
            continue
        if not chunk:
            sys.stderr.write("playbook_server: the server's runner ended without the run's exit status\n")
            os._exit(70)
        data += chunk
    code = STATUS.unpack(data)[0]
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def write_client(directory: str, real: str) -> str:
    """Write the ``ansible-playbook`` client for ``directory`` (its servers' sockets) into it; return its path."""
    path = os.path.join(directory, "ansible-playbook")
    here = os.path.dirname(os.path.abspath(__file__))
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {here!r})\nfrom playbook_server import client\n"
                f"client({real!r}, {directory!r})\n")
    os.chmod(path, 0o755)
    return path


def _recv_exactly(conn: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = conn.recv(size - len(data))
        if not chunk:
            raise ConnectionError("truncated request")
        data += chunk
    return data


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    size = STATUS.unpack(_recv_exactly(conn, STATUS.size))[0]
    fds = array.array("i")
    data, ancdata, _flags, _addr = conn.recvmsg(1, socket.CMSG_LEN(3 * fds.itemsize))
    if data != b"F":
        raise ConnectionError("no descriptors")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    try:
        return json.loads(_recv_exactly(conn, size)), list(fds)
    except (OSError, ValueError, ConnectionError):
        for fd in fds:
            os.close(fd)
        raise


def _run(main, request: dict, fds: list[int]) -> None:
    """In the forked run: become the client's ansible-playbook, then exit with its status."""
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.umask(request["umask"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = request["argv"]
    code = 0
    try:
        code = main()
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:  # noqa: BLE001 - as the real command, a traceback and status 1
        import traceback

        traceback.print_exc()
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code or 0)


def _end(child: int) -> None:
    """The client is gone (a test's timeout killed it): end its run. SIGTERM first: ansible-playbook then ends the
    process groups of its workers (each worker calls setsid), which a SIGKILL of it alone would leave running;
    then SIGKILL to the run's own group."""
    try:
        os.kill(child, signal.SIGTERM)
    except ProcessLookupError:
        pass
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if os.waitpid(child, os.WNOHANG)[0]:
            break
        time.sleep(0.05)
    try:
        os.killpg(child, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        os.waitpid(child, 0)
    except ChildProcessError:
        pass


def _runner(main, conn: socket.socket, request: dict, fds: list[int]) -> None:
    """In the forked runner: fork the run, forward the client's signals, kill the run if the client dies, send
    the exit status."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    child = os.fork()
    if child == 0:
        conn.close()
        _run(main, request, fds)
    for fd in fds:
        os.close(fd)
    conn.sendall(b"+")
    while True:
        readable = select.select([conn], [], [], 0.05)[0]
        if readable:
            data = conn.recv(16)
            if not data:
                _end(child)
                os._exit(0)
            for signum in data:
                try:
                    os.killpg(child, signum)
                except ProcessLookupError:
                    pass
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            try:
                conn.sendall(STATUS.pack(os.waitstatus_to_exitcode(status)))
            except OSError:
                pass
            os._exit(0)


def serve(path: str) -> None:
    """Import Ansible with this process's environment, then fork a run per client until the directory goes."""
    try:
        # ansible-playbook's main, and what every run imports next: once here.
        import ansible.executor.playbook_executor  # noqa: F401
        import ansible.executor.task_queue_manager  # noqa: F401
        import ansible.plugins.loader  # noqa: F401
        import ansible.template  # noqa: F401
        from ansible.cli.playbook import main

        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            os.unlink(path)  # a server that died (one starts at a time: the .starting file)
        except FileNotFoundError:
            pass
        listener.bind(path)
        listener.listen(16)
    finally:
        try:
            os.unlink(path + ".starting")
        except OSError:
            pass
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the runners are reaped by the kernel
    directory = os.path.dirname(path)
    last = time.monotonic()
    while os.path.exists(path) and os.path.isdir(directory) and time.monotonic() - last < IDLE_SECONDS:
        readable = select.select([listener], [], [], 1.0)[0]
        if not readable:
            continue
        conn = listener.accept()[0]
        last = time.monotonic()
        conn.settimeout(10)  # a client that stops half way does not hold up the others
        try:
            request, fds = _recv_request(conn)
        except (OSError, ValueError, ConnectionError):
            conn.close()
            continue
        conn.settimeout(None)
        if server_key(dict(request["env"]), request["cwd"]) != os.path.basename(path)[: -len(".sock")] or len(fds) != 3:
            for fd in fds:
                os.close(fd)
            conn.close()  # refused: the client runs the real command
            continue
        if os.fork() == 0:
            listener.close()
            _runner(main, conn, request, fds)
        for fd in fds:
            os.close(fd)
        conn.close()
    listener.close()
    try:
        if os.path.exists(path):
            os.unlink(path)
    except OSError:
        pass


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "serve":
        serve(sys.argv[2])
    else:
        sys.exit(f"usage: {sys.argv[0]} serve SOCKET")
