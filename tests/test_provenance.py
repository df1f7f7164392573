"""fp8jax.diagnostics.provenance: the record each script's JSON starts with (command, date, device, versions, commit)."""

import datetime
import json
import os
import subprocess

import jax
import numpy as np

from fp8jax.diagnostics import provenance as prov

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(cwd, *args):
  return subprocess.run(["git", "-c", "user.email=t@example.com", "-c", "user.name=t", *args], cwd=cwd,
                        capture_output=True, text=True, check=True).stdout.strip()


def test_record_names_command_date_device_and_versions():
  rec = prov.provenance("python scripts/x.py --a=1", packages=("numpy", "no-such-package-fp8jax"))
  assert rec["command"] == "python scripts/x.py --a=1"
  assert rec["device"] == getattr(jax.devices()[0], "device_kind", jax.devices()[0].platform)
  assert rec["device_count"] == len(jax.devices()) and rec["platform"] == jax.devices()[0].platform
  assert rec["jax"] == jax.__version__
  assert rec["versions"] == {"numpy": np.__version__, "no-such-package-fp8jax": None}
  when = datetime.datetime.fromisoformat(rec["date"])
  assert when.tzinfo is not None and abs(datetime.datetime.now(datetime.timezone.utc) - when).total_seconds() < 600
  assert rec["cpu"] and isinstance(rec["cpu"], str)
  assert json.loads(json.dumps(rec)) == rec  # plain JSON
  if os.path.isdir(os.path.join(REPO, ".git")):
    assert rec["git_commit"].split("-")[0] == _git(REPO, "rev-parse", "HEAD")


def test_git_commit_is_none_outside_a_checkout_and_marks_changed_files(tmp_path):
  assert prov.git_commit(str(tmp_path)) is None
  _git(tmp_path, "init", "-q")
  (tmp_path / "f.txt").write_text("a\n")
  _git(tmp_path, "add", "f.txt")
  _git(tmp_path, "commit", "-q", "-m", "c")
  head = _git(tmp_path, "rev-parse", "HEAD")
  assert prov.git_commit(str(tmp_path)) == head
  (tmp_path / "new.txt").write_text("untracked files do not count\n")
  assert prov.git_commit(str(tmp_path)) == head
  (tmp_path / "f.txt").write_text("b\n")
  assert prov.git_commit(str(tmp_path)) == head + "-dirty"
