# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Action of inferops.vllm.config_files: render the templates and read the files on the controller, then write
them all on the host in one module run (see the module's documentation for why)."""

from __future__ import annotations

import datetime
import os
import pwd
import time

from ansible import constants as C
from ansible.errors import AnsibleActionFail, AnsibleError
from ansible.module_utils.common.text.converters import to_text
from ansible.module_utils.parsing.convert_bool import boolean
from ansible.plugins.action import ActionBase
from ansible.template import trust_as_template

_ENTRY_KEYS = frozenset(
    ("path", "state", "content", "template", "vars", "src", "owner", "group", "mode", "key", "secret", "validate")
)


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _supports_check_mode = True
    _supports_diff = True

    def _template_vars(self, task_vars, name, fullpath, dest):
        """The variables a template sees: the task's, and those M(ansible.builtin.template) adds."""
        stat = os.stat(fullpath)
        try:
            uid = pwd.getpwuid(stat.st_uid).pw_name
        except KeyError:
            uid = stat.st_uid
        variables = dict(task_vars)
        variables.update(
            template_host=os.uname()[1],
            template_path=name,
            template_mtime=datetime.datetime.fromtimestamp(stat.st_mtime),
            template_uid=uid,
            template_run_date=datetime.datetime.now(),
            template_destpath=dest,
            template_fullpath=fullpath,
        )
        if "ansible_managed" not in task_vars:
            managed = C.config.get_config_value("DEFAULT_MANAGED_STR").format(
                host="{{ template_host }}", uid="{{ template_uid }}", file="{{ template_path }}"
            )
            variables["ansible_managed"] = trust_as_template(time.strftime(managed, time.localtime(stat.st_mtime)))
        return variables

    def _render(self, task_vars, name, dest, extra):
        try:
            fullpath = self._find_needle("templates", name)
        except AnsibleError as error:
            raise AnsibleActionFail(f"{dest}: {to_text(error)}") from error
        data = trust_as_template(self._loader.get_text_file_contents(fullpath))
        searchpath = []
        for path in list(task_vars.get("ansible_search_path", [])) + [self._loader._basedir, os.path.dirname(fullpath)]:
            searchpath.extend([os.path.join(path, "templates"), path])
        templar = self._templar.copy_with_new_env(
            searchpath=searchpath,
            available_variables=self._template_vars(dict(task_vars, **extra), name, fullpath, dest),
        )
        rendered = templar.template(data, escape_backslashes=False)
        return "" if rendered is None else to_text(rendered)

    def _read(self, name, dest):
        try:
            fullpath = self._find_needle("files", name)
        except AnsibleError as error:
            raise AnsibleActionFail(f"{dest}: {to_text(error)}") from error
        with open(fullpath, "rb") as handle:
            data = handle.read()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise AnsibleActionFail(f"{dest}: {fullpath} is not UTF-8 text; use ansible.builtin.copy") from error

    def run(self, tmp=None, task_vars=None):
        task_vars = task_vars or {}
        result = super().run(tmp, task_vars)
        del tmp
        entries = self._task.args.get("files")
        unknown = sorted(set(self._task.args) - {"files"})
        if unknown:
            raise AnsibleActionFail(f"config_files: unsupported options {', '.join(unknown)} (only files)")
        if not isinstance(entries, list) or not all(isinstance(entry, dict) for entry in entries):
            raise AnsibleActionFail("config_files: files must be a list of dictionaries")
        resolved = []
        for entry in entries:
            dest = entry.get("path")
            extra = sorted(set(entry) - _ENTRY_KEYS)
            if extra:
                raise AnsibleActionFail(f"config_files: {dest}: unsupported keys {', '.join(extra)}")
            sources = [key for key in ("content", "template", "src") if entry.get(key) is not None]
            if len(sources) > 1:
                raise AnsibleActionFail(
                    f"config_files: {dest}: give one of content, template and src, not {' and '.join(sources)}"
                )
            entry = dict(entry)
            extra = entry.pop("vars", None) or {}
            if not isinstance(extra, dict):
                raise AnsibleActionFail(f"config_files: {dest}: vars must be a dictionary")
            if extra and entry.get("template") is None:
                raise AnsibleActionFail(f"config_files: {dest}: vars are for a template")
            if entry.get("template") is not None:
                entry["content"] = self._render(task_vars, entry.pop("template"), dest, extra)
            elif entry.get("src") is not None:
                entry["content"] = self._read(entry.pop("src"), dest)
            try:
                secret = boolean(entry.get("secret", False), strict=True)
            except TypeError as error:
                raise AnsibleActionFail(f"config_files: {dest}: secret must be true or false") from error
            if secret and entry.get("content") is not None:
                # The module's secret_content is no_log: Ansible masks the text in every output from here on.
                entry["secret_content"] = entry.pop("content")
            resolved.append(entry)
        result.update(
            self._execute_module(
                module_name="inferops.vllm.config_files", module_args={"files": resolved}, task_vars=task_vars
            )
        )
        return result
