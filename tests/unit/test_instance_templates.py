"""The vllm_instance role's per-instance files, rendered by the real ansible-playbook on localhost.

A playbook runs the role's own preflight (argument spec, publish, launcher check) on every prefill and
decode host of a small inventory (all on localhost, connection local, nothing outside a temporary
directory is written), then renders each instance's config.toml and the unit drop-in with the role's
own tasks from tasks/configure.yml (read from the file, only their destination moved into the
temporary directory). Two inventories, the second with one more prefill and one more decode host: the
files of the instances that exist in both must be byte for byte the same, so adding (or removing) a
peer restarts no running instance. The role and the preflight render the TOML with one function
(plugins/plugin_utils/_instance_toml.py); what the role gives it on a host and what the preflight gives it
from the published record must make the same TOML, which the launcher accepts.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import yaml
from ansible_collections.inferops.vllm.plugins.plugin_utils import _preflight as pf
from ansible_collections.inferops.vllm.tests.unit.plugins.filter.utils import launcher
from ansible_collections.inferops.vllm.tests.unit.test_preflight_inventories import ANSIBLE_PLAYBOOK

REPO = Path(__file__).resolve().parents[2]
ROLE = REPO / "roles" / "vllm_instance"
API_KEY = "template-test-instance-key-0001"


pytestmark = pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed")


def _collections_path() -> str:
    # conftest.py put a root holding ansible_collections/inferops/vllm -> this checkout on sys.path.
    ours = next(p for p in sys.path if (Path(p) / "ansible_collections" / "inferops" / "vllm").is_dir())
    extra = os.environ.get("ANSIBLE_COLLECTIONS_PATH") or str(REPO / ".ansible" / "collections")
    return os.pathsep.join([ours, extra])


def flat(tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tasks of a tasks file, those of its blocks (block, rescue, always) included."""
    out = []
    for task in tasks:
        out.append(task)
        for part in ("block", "rescue", "always"):
            out += flat(task.get(part) or [])
    return out


def _config_files_task(tasks: list[dict[str, Any]], name: str, only: str = "true") -> dict[str, Any]:
    """The inferops.vllm.config_files task of tasks/configure.yml called ``name``, writing the entries ``f`` the Jinja
    test ``only`` keeps into the test's directory (under the host's directory, without /etc/systemd/system/ or
    the configuration directory; no owner or group, no validation by
    the launcher on the host, no handlers)."""
    (task,) = [t for t in tasks if t.get("name") == name]
    files = task["inferops.vllm.config_files"]["files"]
    rehomed = (
        "{%- set ns = namespace(out=[]) -%}{%- for f in __files if " + only + " -%}"
        "{%- set ns.out = ns.out + [f | combine({'owner': None, 'group': None, 'validate': None, 'path': out ~ '/'"
        " ~ inventory_hostname ~ '/' ~ (f.path | regex_replace('^/etc/systemd/system/', '')"
        " | regex_replace('^' ~ vllm_instance_config_dir ~ '/', ''))})"
        f" | combine({{'template': '{ROLE}/templates/' ~ f.template}} if f.template is defined else {{}})] -%}}"
        "{%- endfor -%}{{ ns.out }}"
    )
    return {"name": name, "vars": {"__files": files}, "inferops.vllm.config_files": {"files": rehomed}}


# The role's tasks that write the instances' files (tasks/configure.yml).
FILES_TASK = "Write each instance's config.toml and its environment file (secrets)"
UNIT_TASK = ("Install the systemd unit template and give each instance's unit its stop timeout (drain + the "
             "launcher's cleanup)")


def playbook() -> list[dict[str, Any]]:
    tasks = flat(yaml.safe_load((ROLE / "tasks" / "configure.yml").read_text(encoding="utf-8")))
    (place,) = [t for t in tasks if t.get("name") == "Give each instance its GPUs and its KV path"]
    return [{
        "name": "Render the vllm_instance role's per-instance files into a temporary directory",
        "hosts": "prefill:decode",
        # The role's argument spec resolves vllm_instance_host_address's default, which needs network facts.
        "gather_facts": True,
        "gather_subset": ["network"],
        "tasks": [
            # The role's preflight: the argument spec, the launcher's verdict, and what the host publishes.
            {"name": "The role's preflight", "ansible.builtin.include_role": {
                "name": "inferops.vllm.vllm_instance", "tasks_from": "preflight", "public": True}},
            {"name": "The host's directory", "ansible.builtin.file": {
                "path": "{{ out }}/{{ inventory_hostname }}", "state": "directory", "mode": "0700"}},
            place,
            # Each instance's config.toml (not the environment files).
            _config_files_task(tasks, FILES_TASK, only="f.path.endswith('.toml')"),
            # The unit template the host's instances share, and each instance's drop-in.
            _config_files_task(tasks, UNIT_TASK),
            # What the preflight renders the TOML from (as the role's preflight passes it).
            {"name": "What the host published", "ansible.builtin.copy": {
                "dest": "{{ out }}/{{ inventory_hostname }}/published.json", "mode": "0600",
                "content": "{{ {'published': vllm_instance_published, 'variables': {"
                           "'vllm_instance_instances': vllm_instance_instances,"
                           " 'vllm_instance_environment': vllm_instance_environment,"
                           " 'vllm_instance_extra_args': vllm_instance_extra_args,"
                           " 'vllm_instance_bind_host': vllm_instance_bind_host,"
                           " 'vllm_instance_models_dir': vllm_instance_models_dir,"
                           " 'vllm_instance_host_address': vllm_instance_host_address}} | to_json }}"}},
        ],
    }]


def _host(address: str, **extra: Any) -> dict[str, Any]:
    return {"ansible_connection": "local", "ansible_python_interpreter": sys.executable,
            "vllm_instance_host_address": address, **extra}


DECODE_1_INSTANCES = [
    {"name": "decode-0", "port": 8200, "kv_transfer_port": 5700},
    # A longer drain, the other KV load failure policy and its own UCX transports for this instance only.
    {"name": "decode-1", "port": 8201, "kv_transfer_port": 5701,
     "overrides": {"shutdown_timeout": 600, "kv_load_failure_policy": "fail", "ucx_tls": "tcp,sm,self"}},
]


def inventory(peers: bool) -> dict[str, Any]:
    """p1 and d1 (two instances); with ``peers``, p2 and d2 as well."""
    prefill = {"p1": _host("10.0.0.11")}
    decode = {"d1": _host("10.0.0.21", vllm_instance_instances=DECODE_1_INSTANCES)}
    if peers:
        prefill["p2"] = _host("10.0.0.12")
        decode["d2"] = _host("10.0.0.22")
    return {
        "all": {"vars": {
            "vllm_install_variant": "cpu",
            "vllm_instance_model": "HuggingFaceTB/SmolLM2-135M-Instruct",
            # A hub model needs a commit (the role refuses a branch); a well-formed stand-in.
            "vllm_instance_model_revision": "0123456789abcdef0123456789abcdef01234567",
            "vllm_instance_kv_cache_memory_bytes": 1073741824,
            "vllm_instance_kv_buffer_device": "cpu",
            "vllm_instance_max_model_len": 512,
            "vllm_instance_api_key": API_KEY,
        }},
        "prefill": {"hosts": prefill},
        "decode": {"hosts": decode},
    }


def _render(tmp: Path, peers: bool) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp / ("with-peers" if peers else "alone")
    out.mkdir()
    (tmp / f"hosts-{out.name}.yml").write_text(yaml.safe_dump(inventory(peers)), encoding="utf-8")
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible.cfg"), "ANSIBLE_COLLECTIONS_PATH": _collections_path(),
           "ANSIBLE_NOCOLOR": "1", "ANSIBLE_FORCE_COLOR": "0", "ANSIBLE_LOCALHOST_WARNING": "0",
           "ANSIBLE_STDOUT_CALLBACK": "ansible.builtin.default"}
    run = subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", str(tmp / f"hosts-{out.name}.yml"), "-e", json.dumps({"out": str(out)}),
         str(tmp / "render.yml")],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300, check=False,
    )
    return run, out


@pytest.fixture(scope="module")
def renders(tmp_path_factory) -> dict[bool, Path]:
    tmp = tmp_path_factory.mktemp("instance-templates")
    (tmp / "render.yml").write_text(yaml.safe_dump(playbook(), sort_keys=False), encoding="utf-8")
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {peers: pool.submit(_render, tmp, peers) for peers in (False, True)}
        results = {peers: future.result() for peers, future in futures.items()}
    for run, _out in results.values():
        assert run.returncode == 0, run.stdout + run.stderr
    return {peers: out for peers, (_run, out) in results.items()}


EXISTING = [("p1", "prefill-0"), ("d1", "decode-0"), ("d1", "decode-1")]
DROPIN = "inferops-stop-timeout.conf"


def _files(host: str, name: str) -> list[str]:
    return [f"{host}/{name}.toml", f"{host}/vllm@{name}.service.d/{DROPIN}"]


def test_the_role_renders_every_instances_files(renders):
    for peers, out in renders.items():
        found = {str(f.relative_to(out)) for f in out.rglob("*") if f.is_file()}
        instances = [*EXISTING, *([("p2", "prefill-0"), ("d2", "decode-0")] if peers else [])]
        expected = {f for host, name in instances for f in _files(host, name)}
        expected |= {f"{host}/{name}" for host, _name in instances for name in ("published.json", "vllm@.service")}
        assert found == expected


def test_adding_a_peer_changes_no_existing_instances_config(renders):
    alone, with_peers = renders[False], renders[True]
    for host, name in EXISTING:
        for path in _files(host, name):
            before = (alone / path).read_text(encoding="utf-8")
            assert before == (with_peers / path).read_text(encoding="utf-8"), path
            assert "prefill_instances" not in before and "decode_instances" not in before
            assert "10.0.0.12" not in before and "10.0.0.22" not in before


def test_the_role_and_the_preflight_render_the_same_toml_and_the_launcher_accepts_it(renders):
    launch = launcher()
    for peers, out in renders.items():
        for host in ("p1", "p2", "d1", "d2"):
            if not (out / host).is_dir():
                continue
            given = json.loads((out / host / "published.json").read_text(encoding="utf-8"))
            published = given["published"]
            group = "decode" if published["pd_role"] == "decode" else "prefill"
            inv = pf._Inventory(groups={"prefill": [], "decode": [], "router": []})
            inv.variables[host] = given["variables"]
            for inst in pf._instances(host, group, published, None):
                toml = launch.tomllib.loads((out / host / f"{inst.name}.toml").read_text(encoding="utf-8"))
                assert toml == pf._launcher_config(inv, inst)[0], f"{peers}: {host}/{inst.name}"
                assert launch.validate(toml) == [], f"{host}/{inst.name}"


def test_the_drain_and_the_kv_load_failure_policy_per_instance(renders):
    out = renders[True]
    launch = launcher()

    def toml(host: str, name: str) -> dict[str, Any]:
        return launch.tomllib.loads((out / host / f"{name}.toml").read_text(encoding="utf-8"))

    assert toml("p1", "prefill-0")["server"]["shutdown_timeout"] == 60
    assert "kv_load_failure_policy" not in toml("p1", "prefill-0")["pd_disaggregation"]
    assert toml("d1", "decode-0")["server"]["shutdown_timeout"] == 60
    assert toml("d1", "decode-0")["pd_disaggregation"]["kv_load_failure_policy"] == "recompute"
    assert toml("d1", "decode-1")["server"]["shutdown_timeout"] == 600
    assert toml("d1", "decode-1")["pd_disaggregation"]["kv_load_failure_policy"] == "fail"
    args = launch.build(toml("d1", "decode-1"), None)[0]
    assert args[args.index("--shutdown-timeout") + 1] == "600"
    assert json.loads(args[args.index("--kv-transfer-config") + 1])["kv_load_failure_policy"] == "fail"


def test_the_kv_path_of_a_cpu_build_is_tcp_and_an_instance_may_set_its_ucx_transports(renders):
    """The cpu build's `auto` transport is tcp: the TOML says so and sets no UCX variable unless asked."""
    out = renders[True]
    launch = launcher()
    for host, name in (("p1", "prefill-0"), ("p2", "prefill-0"), ("d1", "decode-0"), ("d2", "decode-0")):
        config = launch.tomllib.loads((out / host / f"{name}.toml").read_text(encoding="utf-8"))
        assert config["kv_fabric"] == {"transport": "tcp"}, (host, name)
        assert not [var for var in launch.build(config, None)[1] if var.startswith("UCX_")]
    config = launch.tomllib.loads((out / "d1" / "decode-1.toml").read_text(encoding="utf-8"))
    assert config["kv_fabric"] == {"transport": "tcp", "tls": "tcp,sm,self"}
    assert launch.build(config, None)[1]["UCX_TLS"] == "tcp,sm,self"


def test_each_instances_unit_waits_for_its_drain(renders):
    """A drop-in per instance, vllm@NAME.service.d/: TimeoutStopSec = its shutdown_timeout + 15 s."""
    margin = pf.STOP_TIMEOUT_MARGIN_SECONDS  # what the preflight's drain warning tells systemd waits
    assert margin == 15
    expected = {("p1", "prefill-0"): 60 + margin, ("d1", "decode-0"): 60 + margin, ("d1", "decode-1"): 600 + margin,
                ("d2", "decode-0"): 60 + margin}
    for (host, name), seconds in expected.items():
        dropin = (renders[True] / host / f"vllm@{name}.service.d" / DROPIN).read_text(encoding="utf-8")
        assert dropin.endswith(f"\n[Service]\nTimeoutStopSec={seconds}\n"), dropin
        assert f'vLLM instance "{name}"' in dropin
    unit = (ROLE / "templates" / "vllm@.service.j2").read_text(encoding="utf-8")
    # The shared unit keeps a fallback for an instance without a drop-in, and names the drop-in.
    assert "\nTimeoutStopSec=20\n" in unit and "{{ _vllm_instance_stop_dropin }}" in unit


def test_the_unit_has_no_line_outside_its_comments_and_sections(renders):
    """Every line of the rendered unit is blank, a comment, a [section] or a Key=value inside a section: the runtime
    comment once wrapped, and systemd warned "Assignment outside of section" at every daemon-reload."""
    for out in renders.values():
        for unit in out.glob("*/vllm@.service"):
            section = None
            for number, line in enumerate(unit.read_text(encoding="utf-8").splitlines(), 1):
                if not line.strip() or line.startswith(("#", ";")):
                    continue
                if re.fullmatch(r"\[[A-Za-z]+\]", line):
                    section = line
                    continue
                assert section and re.match(r"[A-Za-z][A-Za-z0-9]*=", line), f"{unit}:{number}: {line!r}"
            text = unit.read_text(encoding="utf-8")
            assert "# Runtime: vLLM " in text and "revision 0123456789abcdef" in text.split("# Runtime: ", 1)[1].split(
                "\n", 1)[0], text[:800]


def test_the_units_runtime_line_names_every_field_of_the_install_fingerprint():
    """Each field of vllm_install's install fingerprint makes another venv version directory, which a running
    instance only uses once it restarts; the unit's `# Runtime:` line is what restarts (or marks) the instances
    when what they loaded changes. A field missing from the line switched the venv under running instances and
    restarted none, and a later prune could remove the version they still ran from: the install source was,
    until molecule's upgrade test (tests/test_fallback.py, last) found it."""
    fingerprint = yaml.safe_load((REPO / "roles" / "vllm_install" / "vars" / "main.yml").read_text(
        encoding="utf-8"))["_vllm_install_fingerprint"]
    runtime = yaml.safe_load((ROLE / "vars" / "main.yml").read_text(encoding="utf-8"))["_vllm_instance_runtime"]
    assert fingerprint, "vllm_install's fingerprint moved: see roles/vllm_install/vars/main.yml"
    for field, value in fingerprint.items():
        variable = re.fullmatch(r"\{\{ (vllm_install_\w+) \}\}", value)
        assert variable, f"{field}: {value!r} is not one of vllm_install's variables"
        assert re.search(rf"\b{variable.group(1)}\b", runtime), f"{field} ({variable.group(1)}) not in the runtime line"


def test_the_router_units_runtime_line_names_every_field_of_its_install_fingerprint():
    """The same rule for vllm-router: its unit's `# Runtime:` line restarts the replicas (one at a time) when what
    they loaded changes. vllm_router_prometheus_client_version, a field of the router's fingerprint, was missing
    from it: a new pin made another version directory and switched the link under replicas that kept running
    from the old one (found while reviewing the vLLM case above)."""
    fingerprint = yaml.safe_load((REPO / "roles" / "vllm_router" / "vars" / "main.yml").read_text(
        encoding="utf-8"))["_vllm_router_fingerprint"]
    template = (REPO / "roles" / "vllm_router" / "templates" / "vllm-router@.service.j2").read_text(encoding="utf-8")
    runtime = next(line for line in template.splitlines() if line.startswith("# Runtime:"))
    assert fingerprint, "vllm_router's fingerprint moved: see roles/vllm_router/vars/main.yml"
    for field, value in fingerprint.items():
        variable = re.fullmatch(r"\{\{ (vllm_router_\w+) \}\}", value)
        assert variable, f"{field}: {value!r} is not one of vllm_router's variables"
        assert re.search(rf"\b{variable.group(1)}\b", runtime), f"{field} ({variable.group(1)}) not in the runtime line"
