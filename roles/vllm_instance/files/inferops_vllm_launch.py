# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Launch one vLLM instance from its TOML description (inferops.vllm).

Ansible renders ``/etc/vllm/<instance>.toml``; the instance's systemd unit runs
this launcher with the venv's python::

    inferops_vllm_launch.py --config /etc/vllm/NAME.toml [--check] [--vllm-bin PATH]

The launcher reads the TOML, validates it (reporting *every* problem at once,
each naming the ``section.key``, what is wrong and what to write instead),
builds the ``vllm serve`` argv and the environment variables, logs the final
command, and runs vLLM as its child, staying the unit's main process as a
subreaper (``PR_SET_CHILD_SUBREAPER``): SIGTERM/SIGINT/SIGHUP go to vLLM, and
once vLLM has exited every process it left behind (its multiprocessing
resource tracker ignores SIGTERM) is stopped and reaped before the launcher
exits with vLLM's status.  So a stop ends with an empty cgroup even where
systemd gets no cgroup-empty events (systemd in a container on cgroup v1,
where a leftover process made every stop time out and fail).  Standard
library only (``tomli`` is used on Python 3.10, which has no ``tomllib``).

Modes
    default     validate, build, log ``inferops-vllm-launch: exec: <cmd>`` and one
                ``inferops-vllm-launch: env: NAME=value`` line per variable the
                launcher sets to stderr, run vLLM.  Only the values of known-safe
                variables are shown (see SAFE_ENV_NAMES / SAFE_ENV_PREFIXES); every
                other value, and any value holding URL credentials, is ``<redacted>``.
    --check     validate and build, print the same lines to stdout followed by
                ``inferops-vllm-launch: <path>: config OK``; never starts vLLM.
``--vllm-bin`` defaults to ``vllm`` next to the running interpreter
(``Path(sys.executable).parent / "vllm"``).

Exit codes
    0    --check: configuration OK; otherwise vLLM's own exit status (a vLLM
         killed by a signal makes the launcher die of the same signal)
    1    no TOML parser available (Python 3.10 without tomli)
    2    configuration problem: file missing/unreadable/not UTF-8, TOML syntax
         error, or validation problems.  Every line on stderr reads
         ``inferops-vllm-launch: <path>: <problem>``.  (Suggested systemd
         setting: ``RestartPreventExitStatus=2`` so a bad file does not loop.)
    126  the vLLM executable exists but cannot be executed
    127  the vLLM executable does not exist

What the TOML may hold, the flag or variable each key becomes, and every check: the schema module
beside this file, _vllm_instance_schema.py (the collection's plugins/module_utils/_vllm_instance_schema.py:
SCHEMA, validate()), which imports what vLLM accepts from the vocabulary beside it (_vllm_vocabulary.py,
VOCAB). The vllm_instance role installs the three files in one directory, and this file imports the schema
by its name from there; the controller imports the same module from the collection, so the preflight refuses
what this launcher would. This file builds the command from a valid TOML and runs it.

Python API (used by the unit tests):
    schema.validate(config, environ=None) -> list[str]   all problems; environment-dependent
                                                  checks run only when environ is given
    build(config, environ) -> (args, env)         args: the argv *without* the executable,
                                                  starting with "serve"; env: only the variables
                                                  the launcher sets (the exec environment is
                                                  os.environ updated with them).  Raises
                                                  ConfigError if validate() finds problems.
    load_config(path) -> dict                     raises ConfigError / NoTomlParserError
    main(argv=None) -> int
"""

import argparse
import ctypes
import json
import os
import re
import shlex
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    try:
        import tomli as tomllib
    except ModuleNotFoundError:
        tomllib = None

try:  # a host: the schema beside this file (this file's directory is sys.path[0])
    import _vllm_instance_schema as schema
except ImportError as beside:
    try:  # the controller (the unit tests): the collection's module
        from ansible_collections.inferops.vllm.plugins.module_utils import _vllm_instance_schema as schema
    except ImportError:
        raise ImportError(
            f"inferops-vllm-launch: its schema and vocabulary (_vllm_instance_schema.py, _vllm_vocabulary.py) must be "
            f"beside it in {os.path.dirname(os.path.abspath(__file__))} ({beside}); reinstall the launcher with the "
            "vllm_instance role, which copies the three files"
        ) from beside

PROG = "inferops-vllm-launch"
# The launcher's API (the unit tests use it): validate() and its error are the schema's.
ConfigError = schema.ConfigError
validate = schema.validate

EXIT_OK = 0
EXIT_NO_TOML_PARSER = 1
EXIT_CONFIG = 2
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127

PR_SET_CHILD_SUBREAPER = 36
# Seconds the processes vLLM leaves behind get after SIGTERM before SIGKILL.
ORPHAN_GRACE_SECONDS = 5.0

# The instance key on every route but /health (inferops_vllm_auth.py, beside this file, on vLLM's
# PYTHONPATH): vLLM's own --api-key guards /v1, /v2, /inference and /cohere only.
AUTH_MIDDLEWARE = "inferops_vllm_auth.InstanceKeyMiddleware"
AUTH_MODULE_DIR = Path(__file__).resolve().parent
REDACTED = "<redacted>"

# The log shows the values of these variables only; every other value is <redacted> (an
# [environment] entry may carry a token or a proxy URL with a password under any name).
SAFE_ENV_NAMES = frozenset({
    "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
    "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY",
    "HF_HOME", "HF_HUB_CACHE", "PYTORCH_CUDA_ALLOC_CONF", "PYTHONUNBUFFERED", "PYTHONPATH", "TZ", "LANG", "LC_ALL",
})
# ... and of these families (vLLM's own settings, the KV transfer and collective libraries), unless
# the name looks secret (SECRET_NAME_RE).
SAFE_ENV_PREFIXES = ("VLLM_", "UCX_", "NIXL_", "NCCL_", "GLOO_")
SECRET_NAME_RE = re.compile(r"KEY|TOKEN|SECRET|PASSW|CREDENTIAL|AUTH")
# user:password@ in a URL (http://user:pw@proxy:3128): never logged, whatever the variable.
URL_CREDENTIALS_RE = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/@\s]*@")


class NoTomlParserError(Exception):
    """Neither tomllib (Python 3.11+) nor tomli is importable."""


# --------------------------------------------------------------------------- loading


def load_config(path: Path) -> dict[str, Any]:
    """Read and parse the TOML file; every failure is a ConfigError with one clear message."""
    if tomllib is None:
        raise NoTomlParserError(
            f"no TOML parser: Python {sys.version_info.major}.{sys.version_info.minor} has no tomllib and the "
            f"tomli package is not installed for {sys.executable}; install tomli into this venv "
            "(pip install tomli) or use Python 3.11+"
        )
    try:
        data = path.read_bytes()
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigError([f"cannot read config file: {reason}; check the path and its permissions"]) from exc
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError([f"config file is not valid UTF-8 ({exc}); save it as UTF-8"]) from exc
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError([f"TOML syntax error: {exc}; fix the syntax"]) from exc


# --------------------------------------------------------------------------- building


def _format(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _flags(config: Mapping[str, Any]) -> list[str]:
    """The flags of the TOML's keys, in the schema's order."""
    args: list[str] = []
    for section in schema.FLAG_SECTIONS:
        table = config.get(section, {})
        for key, spec in schema.SCHEMA[section].items():
            if not spec.flag or key not in table or spec.kind == "str_list":
                continue
            value = table[key]
            if spec.kind == "bool":
                if value:
                    args.append(spec.flag)
                elif spec.negatable:
                    args.append("--no-" + spec.flag[2:])
            else:
                args += [spec.flag, _format(value)]
    return args


def _kv_transfer_config(pd: Mapping[str, Any]) -> str:
    """--kv-transfer-config's compact JSON for an enabled [pd_disaggregation]."""
    backend = pd.get("kv_transfer_backend", "nixl")
    transfer = {
        "kv_connector": schema.VOCAB.KV_TRANSFER_BACKENDS[backend],
        "kv_role": schema.VOCAB.PD_ROLES[pd["role"]],
        "kv_buffer_device": pd.get("kv_buffer_device", "cuda"),
    }
    # Only a consumer loads KV; on a producer the policy would have nothing to act on.
    if pd["role"] == "decode" and "kv_load_failure_policy" in pd:
        transfer["kv_load_failure_policy"] = pd["kv_load_failure_policy"]
    return json.dumps(transfer, sort_keys=True, separators=(",", ":"))


def _pin(config: Mapping[str, Any]) -> str | None:
    """Run the launcher, and so every process of the instance (API server, engine core, workers), on the cores of
    cpu.omp_threads_bind. vLLM binds only its OMP threads there; its other processes would float onto the cores of
    the host's other instances. Returns a problem, or None."""
    bind = str(config.get("cpu", {}).get("omp_threads_bind", ""))
    cpus = schema.bound_cpus(bind)
    if not cpus:
        return None
    try:
        os.sched_setaffinity(0, cpus)
    except OSError as exc:
        return (f"cpu.omp_threads_bind = {json.dumps(bind)}: cannot run on those CPUs ({exc.strerror or exc}); this "
                f"host lets it use CPUs {_ranges(os.sched_getaffinity(0))}. Fix the instance's cpus in the inventory.")
    print(f"{PROG}: the instance runs on CPUs {bind} (cpu.omp_threads_bind)", file=sys.stderr)
    return None


def _ranges(cpus: set[int]) -> str:
    out: list[list[int]] = []
    for cpu in sorted(cpus):
        if out and cpu == out[-1][1] + 1:
            out[-1][1] = cpu
        else:
            out.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in out)


def _build_env(config: Mapping[str, Any], environ: Mapping[str, str] | None) -> dict[str, str]:
    """The variables the launcher sets: the API key's, those of the TOML's keys, then [environment]."""
    env: dict[str, str] = {}
    api_key_env = config["server"].get("api_key_env")
    if api_key_env:
        env[schema.API_KEY_VAR] = (environ or {}).get(api_key_env, "")
    if config["server"].get("api_keys_file"):
        env[schema.KEYS_FILE_VAR] = config["server"]["api_keys_file"]
    pd = config.get("pd_disaggregation", {})
    for section in ("pd_disaggregation", "cpu", "devices", "kv_fabric"):
        if section == "pd_disaggregation" and not pd.get("enabled"):
            continue
        table = config.get(section, {})
        for key, spec in schema.SCHEMA[section].items():
            if spec.env and key in table:
                env[spec.env] = _format(table[key])
    env.update(config.get("environment", {}))
    return env


def build(config: Mapping[str, Any], environ: Mapping[str, str] | None) -> tuple[list[str], dict[str, str]]:
    """Build the vLLM command line and environment from a configuration.

    Returns ``(args, env)``: ``args`` is the argv *without* the executable, i.e.
    ``["serve", <model.name>, <flags>..., <extra.args>...]``; ``env`` holds only the
    variables the launcher sets (exec with ``{**os.environ, **env}``).  When
    server.api_key_env is set, env contains VLLM_API_KEY (a secret: never log it).
    ``environ=None`` (--check) skips the API key's presence: systemd loads it from the
    EnvironmentFile only when the service starts.
    Raises ConfigError listing every problem if the configuration is invalid.
    """
    problems = validate(config, environ)
    if problems:
        raise ConfigError(problems)

    args = ["serve", config["model"]["name"], *_flags(config)]
    env = _build_env(config, environ)
    pd = config.get("pd_disaggregation", {})
    if pd.get("enabled"):
        args += ["--kv-transfer-config", _kv_transfer_config(pd)]
    args += config.get("extra", {}).get("args", [])
    args += _security_flags(config)
    if config["server"].get("allowed_media_domains"):
        # vLLM follows redirects of a media URL by default: an allowed host could send it to an internal one.
        env.setdefault("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "0")
    if _has_key(config):
        env["PYTHONPATH"] = os.pathsep.join(
            [str(AUTH_MODULE_DIR), *filter(None, [env.get("PYTHONPATH", (environ or {}).get("PYTHONPATH", ""))])]
        )
    return args, env


def _security_flags(config: Mapping[str, Any]) -> list[str]:
    """Last on argv, after extra.args (which may not set them): the media domains vLLM may fetch from
    (none unless server.allowed_media_domains lists some) and, with an API key, the middleware that
    requires it on every route but /health."""
    domains = config["server"].get("allowed_media_domains") or [schema.NO_MEDIA_DOMAIN]
    args = ["--allowed-media-domains", *domains]
    if _has_key(config):
        args += ["--middleware", AUTH_MIDDLEWARE]
    return args


def _has_key(config: Mapping[str, Any]) -> bool:
    """Whether the instance requires a key (the middleware and its module's directory on PYTHONPATH)."""
    return bool(config["server"].get("api_key_env") or config["server"].get("api_keys_file"))


# --------------------------------------------------------------------------- command line


def loggable(name: str, value: str, api_key_env: str | None = None) -> bool:
    """Whether the log may show this variable's value: a known-safe name, and no URL credentials."""
    if name in (schema.API_KEY_VAR, api_key_env) or URL_CREDENTIALS_RE.search(value):
        return False
    if name in SAFE_ENV_NAMES or name == schema.KEYS_FILE_VAR:  # the keys file's path, not a key
        return True
    return name.startswith(SAFE_ENV_PREFIXES) and not SECRET_NAME_RE.search(name)


def report_lines(argv: Sequence[str], env: Mapping[str, str], api_key_env: str | None = None) -> list[str]:
    """The log lines for a launch: the shell-quoted command, then one line per variable (only known-safe
    values shown, the others redacted)."""
    lines = [f"{PROG}: exec: {shlex.join(argv)}"]
    for name, value in env.items():
        shown = shlex.quote(value) if loggable(name, value, api_key_env) else REDACTED
        lines.append(f"{PROG}: env: {name}={shown}")
    return lines


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="inferops_vllm_launch.py",
        description="Validate a vLLM instance TOML, build the `vllm serve` command and exec it.",
    )
    parser.add_argument("--config", required=True, type=Path, help="instance TOML, e.g. /etc/vllm/NAME.toml")
    parser.add_argument("--check", action="store_true", help="validate and print the command; do not exec")
    parser.add_argument(
        "--vllm-bin",
        type=Path,
        default=None,
        help="vLLM executable (default: the vllm script next to this Python interpreter)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    options = _parse_args(argv)
    path: Path = options.config

    def fail(problems: Sequence[str]) -> int:
        for problem in problems:
            print(f"{PROG}: {path}: {problem}", file=sys.stderr)
        return EXIT_CONFIG

    try:
        config = load_config(path)
    except NoTomlParserError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return EXIT_NO_TOML_PARSER
    except ConfigError as exc:
        return fail(exc.problems)

    environ = dict(os.environ)
    try:
        # --check runs where the service's EnvironmentFile is not loaded (Ansible's validate
        # step): the key's presence is checked at start, not here.
        args, env = build(config, None if options.check else environ)
    except ConfigError as exc:
        return fail(exc.problems)

    vllm_bin = options.vllm_bin or Path(sys.executable).parent / "vllm"
    exec_argv = [str(vllm_bin), *args]
    lines = report_lines(exec_argv, env, config["server"].get("api_key_env"))

    if options.check:
        for line in lines:
            print(line)
        print(f"{PROG}: {path}: config OK")
        return EXIT_OK

    for line in lines:
        print(line, file=sys.stderr)
    problem = _pin(config)
    if problem:
        return fail([problem])
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        child_env = {**environ, **env}
        if config["server"].get("api_keys_file"):
            # vLLM's own check would accept this one key only (and refuse the others of a rotation): the middleware
            # alone checks keys, from the file.
            child_env.pop(schema.API_KEY_VAR, None)
        return supervise(str(vllm_bin), exec_argv, child_env)
    except OSError as exc:
        print(
            f"{PROG}: cannot exec {vllm_bin}: {exc.strerror or exc}; install vLLM into this venv or pass --vllm-bin",
            file=sys.stderr,
        )
        return EXIT_NOT_FOUND if isinstance(exc, FileNotFoundError) else EXIT_NOT_EXECUTABLE


# --------------------------------------------------------------------------- supervision


def _become_subreaper() -> None:
    """Orphans of vLLM's process tree become the launcher's children (Linux), so it can reap them."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    except (OSError, AttributeError) as exc:
        print(f"{PROG}: warning: cannot become a subreaper ({exc}); processes vLLM leaves behind are "
              "left to systemd", file=sys.stderr)


def _children() -> list[int]:
    """PIDs whose parent is this process (zombies included), from /proc."""
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == me:
            found.append(int(entry))
    return found


def _reap_nohang() -> bool:
    """Reap every child that has exited; False once no child is left at all."""
    while True:
        try:
            pid = os.waitpid(-1, os.WNOHANG)[0]
        except ChildProcessError:
            return False
        if pid == 0:
            return True


def _stop_leftovers(grace: float) -> None:
    """SIGTERM, then after ``grace`` seconds SIGKILL, to every process left in vLLM's tree, until none is."""
    deadline = time.monotonic() + grace
    while _reap_nohang():
        left = _children()
        if not left:
            return
        sig = signal.SIGTERM if time.monotonic() < deadline else signal.SIGKILL
        for pid in left:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        time.sleep(0.1)


def supervise(path: str, argv: list[str], env: Mapping[str, str], grace: float = ORPHAN_GRACE_SECONDS) -> int:
    """Run vLLM as a child, forward stop signals to it, and return its exit status once it and every
    process it left behind are gone. A vLLM killed by a signal is reported as the launcher dying of it."""
    _become_subreaper()
    state: dict[str, Any] = {"pid": None}

    def forward(signum, _frame):
        if state["pid"] is not None:
            try:
                os.kill(state["pid"], signum)
            except ProcessLookupError:
                pass

    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
    for signum in stop_signals:
        signal.signal(signum, forward)
    state["pid"] = os.posix_spawn(path, argv, dict(env))
    while True:
        pid, status = os.waitpid(-1, 0)
        if pid == state["pid"]:
            break
    code = os.waitstatus_to_exitcode(status)
    state["pid"] = None
    _stop_leftovers(grace)
    if code < 0:
        # Die of the same signal, as systemd would have seen vLLM do (SIGTERM on stop counts as clean).
        if -code in stop_signals:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        time.sleep(1)
        return 128 - code
    return code


if __name__ == "__main__":
    sys.exit(main())
