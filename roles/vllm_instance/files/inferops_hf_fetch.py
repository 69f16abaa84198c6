# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""Download one revision of a Hugging Face model into a directory, once, for inferops.vllm.vllm_instance.

Run on the vLLM host with the vLLM venv's Python (huggingface_hub is a dependency of vLLM):

    inferops_hf_fetch.py --model ORG/NAME --revision COMMIT --dest DIR [--token-file FILE] [--endpoint URL]

- The token is read from --token-file (the role writes it 0600 into a private temporary directory and
  removes it afterwards), never from the command line, and it is never printed.
- Before downloading, the hub's API is asked for the model at that revision
  (GET <endpoint>/api/models/<model>/revision/<revision>), so that an unreachable hub, a refused or
  missing token, a gated model, or a model or revision that does not exist is one clear line naming the
  model, the revision and the hub, and exit status 3 (unreachable) or 4 (refused or not found).
- Then huggingface_hub's snapshot_download fetches the files into a directory beside --dest,
  `<dest>.inferops-download-<revision>` (a failure there is exit status 5), never into --dest itself: the
  instances load --dest, and a download stopped halfway, or a new revision over an older one, would leave
  them a mix of two revisions' files. A download stopped halfway is resumed from there by the next run;
  the directories of other revisions' stopped downloads are removed.
- Done: a marker `.inferops-complete-<revision>` in the download's directory, which then takes the place
  of --dest (two renames; running instances keep the files they opened, the older revision's directory is
  removed). With the marker in --dest, nothing is asked or downloaded (exit 0, "changed": false), so a
  re-run works without the hub.

The last line of standard output is JSON: {"changed": bool, "model", "revision", "commit", "files", "bytes"}.
Standard library only, besides huggingface_hub for the download itself.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shutil
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

DEFAULT_ENDPOINT = "https://huggingface.co"
EXIT_UNREACHABLE, EXIT_REFUSED, EXIT_DOWNLOAD = 3, 4, 5


def marker(dest: Path, revision: str) -> Path:
    return dest / (".inferops-complete-" + revision.replace("/", "_"))


def staging(dest: Path, revision: str) -> Path:
    """Where a revision is downloaded before it takes the place of `dest`."""
    return dest.with_name(dest.name + ".inferops-download-" + revision.replace("/", "_"))


def put_in_place(new: Path, dest: Path) -> None:
    """`new` takes the place of `dest`: the instances find either the whole old revision or the whole new one."""
    previous = dest.with_name(dest.name + ".inferops-previous")
    shutil.rmtree(previous, ignore_errors=True)
    if dest.exists():
        dest.rename(previous)
    new.rename(dest)
    shutil.rmtree(previous, ignore_errors=True)


def redact(text: str, token: str) -> str:
    text = str(text)
    if token:
        text = text.replace(token, "<token>")
    return re.sub(r"\bhf_[A-Za-z0-9]{8,}\b", "<token>", text)


class Failure(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def ask_hub(endpoint: str, model: str, revision: str, token: str, timeout: float) -> dict:
    """The hub's answer about the model at the revision (its JSON), or a Failure that says what went wrong."""
    url = (f"{endpoint.rstrip('/')}/api/models/{urllib.parse.quote(model, safe='/')}/revision/"
           f"{urllib.parse.quote(revision, safe='')}")
    what = f"model {model} at revision {revision} from {endpoint}"
    request = urllib.request.Request(url, headers={"User-Agent": "inferops.vllm hf fetch"})
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:  # noqa: S310 - http(s) endpoint
            return json.loads(response.read().decode("utf-8") or "{}")
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            why = ("the hub refused the token (HTTP 401): check vllm_instance_hf_token" if token else
                   "the hub answered HTTP 401: the model is private or gated, or does not exist; a gated or private "
                   "model needs vllm_instance_hf_token (in Ansible Vault)")
        elif exc.code == 403:
            why = ("the hub answered HTTP 403: the token's account has no access to this model (a gated model: accept "
                   "its conditions on the model's page with that account, or use a token with access)")
        elif exc.code == 404:
            why = ("the hub answered HTTP 404: no such model, or no such revision (vllm_instance_model, "
                   "vllm_instance_model_revision)")
        else:
            why = f"the hub answered HTTP {exc.code} {exc.reason}"
        raise Failure(EXIT_REFUSED, f"cannot download {what}: {why}.") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise Failure(EXIT_UNREACHABLE,
                      f"cannot download {what}: the hub cannot be reached ({type(exc).__name__}: "
                      f"{redact(reason, token)}; timeout {timeout:g} s). Check the host's network, DNS and proxy "
                      "variables, or vllm_instance_hf_endpoint; or copy the model from the controller instead "
                      "(vllm_instance_model: an absolute directory).") from None
    except ValueError as exc:
        raise Failure(EXIT_REFUSED, f"cannot download {what}: the hub's answer is not JSON ({exc}).") from None


def download(model: str, revision: str, dest: Path, token: str, endpoint: str) -> None:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise Failure(EXIT_DOWNLOAD, f"cannot download model {model}: huggingface_hub is not importable by "
                                     f"{sys.executable} ({exc}); it comes with vLLM (vllm_install).") from None
    try:
        snapshot_download(repo_id=model, revision=revision, local_dir=str(dest), token=token or None,
                          endpoint=endpoint)
    except Exception as exc:  # noqa: BLE001 - every failure is reported the same way, token removed
        raise Failure(EXIT_DOWNLOAD, f"cannot download model {model} at revision {revision} from {endpoint}: "
                                     f"{type(exc).__name__}: {redact(exc, token)}") from None


def fetch(args: argparse.Namespace) -> dict:
    dest = Path(args.dest)
    done = marker(dest, args.revision)
    result = {"changed": False, "model": args.model, "revision": args.revision, "dest": str(dest)}
    if done.exists():
        return result
    token = Path(args.token_file).read_text().strip() if args.token_file else ""
    endpoint = (args.endpoint or os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")
    info = ask_hub(endpoint, args.model, args.revision, token, args.timeout)
    commit = str(info.get("sha") or "")
    if re.fullmatch(r"[0-9a-f]{40}", args.revision) and commit and commit != args.revision:
        raise Failure(EXIT_REFUSED, f"cannot download model {args.model}: the hub answered commit {commit} for "
                                    f"revision {args.revision}.")
    new = staging(dest, args.revision)
    for other in dest.parent.glob(glob.escape(dest.name) + ".inferops-download-*"):
        if other != new:
            shutil.rmtree(other, ignore_errors=True)
    new.mkdir(parents=True, exist_ok=True)
    # The parent's mode and group (the role's models directory) keep the files from other users.
    download(args.model, args.revision, new, token, endpoint)
    files = [p for p in new.rglob("*") if p.is_file() and ".cache" not in p.relative_to(new).parts]
    size = sum(p.stat().st_size for p in files)
    for old in new.glob(".inferops-complete-*"):
        old.unlink()
    marker(new, args.revision).write_text(
        json.dumps({"model": args.model, "revision": args.revision, "commit": commit}) + "\n")
    put_in_place(new, dest)
    result.update(changed=True, commit=commit, files=len(files), bytes=size)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Download one revision of a Hugging Face model, once.")
    parser.add_argument("--model", required=True)
    parser.add_argument("--revision", required=True)
    parser.add_argument("--dest", required=True)
    parser.add_argument("--token-file", default="")
    parser.add_argument("--endpoint", default="")
    parser.add_argument("--timeout", type=float, default=20.0)
    args = parser.parse_args(argv)
    try:
        result = fetch(args)
    except Failure as failure:
        print(f"inferops_hf_fetch: {failure}", file=sys.stderr)
        return failure.status
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
