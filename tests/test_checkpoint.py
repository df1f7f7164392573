"""Run directories that cannot lose or mix data: the workdir lock, --noresume on a used workdir, metrics rows on
resume (jsonl and TensorBoard), corrupt checkpoints (named, and the previous one used), resuming another model shape.

All on CPU without a train step: checkpoints of tiny pytrees, or of an RLTrainer's initial state.
"""

import fp8jax

import glob
import json
import logging
import os
import struct
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax import checkpoint, metrics
from fp8jax.rl import trainer as trainer_lib

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_trainer import small_config  # noqa: E402

# ------------------------------------------------------------------------------------------------------------------
# The workdir lock
# ------------------------------------------------------------------------------------------------------------------

HOLDER = r"""
import fcntl, os, sys, time
f = open(sys.argv[1], "a+")
fcntl.flock(f, fcntl.LOCK_EX)
f.seek(0); f.truncate(); f.write(f"pid {os.getpid()} on testhost\n"); f.flush()
print("locked", flush=True)
time.sleep(120)
"""


def test_second_holder_is_refused_naming_workdir_and_holder(tmp_path):
  with checkpoint.WorkdirLock(str(tmp_path)):
    with pytest.raises(checkpoint.WorkdirLocked, match=rf"{tmp_path} is in use by another process \(pid "
                       rf"{os.getpid()} on "):
      checkpoint.WorkdirLock(str(tmp_path)).acquire()
  with checkpoint.WorkdirLock(str(tmp_path)):  # released cleanly: free again, no stale-lock warning
    pass
  assert open(tmp_path / ".lock").read() == ""


def test_lock_of_a_live_process_then_of_a_dead_one(tmp_path, caplog):
  """Another process holds the lock: refused, naming its pid. Once it is killed, its file still names it, but the
  kernel released the flock: the next run takes it over with a warning."""
  lock = str(tmp_path / ".lock")
  proc = subprocess.Popen([sys.executable, "-c", HOLDER, lock], stdout=subprocess.PIPE, text=True)
  try:
    assert proc.stdout.readline().strip() == "locked"
    with pytest.raises(checkpoint.WorkdirLocked, match=rf"pid {proc.pid} on testhost"):
      checkpoint.WorkdirLock(str(tmp_path)).acquire()
  finally:
    proc.kill()
    proc.wait()
  with caplog.at_level(logging.WARNING, logger="fp8jax.checkpoint"):
    with checkpoint.WorkdirLock(str(tmp_path)):
      assert open(lock).read().startswith(f"pid {os.getpid()} ")
  assert f"stale lock of a process that is gone (pid {proc.pid} on testhost)" in caplog.text


def test_run_holds_the_lock(tmp_path):
  tr = trainer_lib.RLTrainer(small_config(), str(tmp_path))
  with checkpoint.WorkdirLock(str(tmp_path)):
    with pytest.raises(checkpoint.WorkdirLocked, match=str(tmp_path)):
      tr.run(progress=False)


# ------------------------------------------------------------------------------------------------------------------
# --noresume and metrics rows
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("what", ["checkpoint", "metrics"])
def test_noresume_refuses_a_used_workdir(tmp_path, what):
  if what == "checkpoint":
    checkpoint.Checkpointer(str(tmp_path / "checkpoints")).save(3, {"x": jnp.zeros(2)}, {"step": 3})
  else:
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n')
  tr = trainer_lib.RLTrainer(small_config(**{"checkpoint.resume": False}), str(tmp_path))
  tr.warmstart = lambda: pytest.fail("work started")
  match = r"checkpoints of steps \[3\]" if what == "checkpoint" else r"holds a run \(metrics\.jsonl\)"
  with pytest.raises(trainer_lib.RunDirInUse, match=match + r".*--noresume.*Use a new --workdir"):
    tr.run(progress=False)


def _rows(path):
  return [json.loads(ln) for ln in open(path)]


def _tb_events(tb_dir):
  """(file, step, kind) of every event in tb_dir's TFRecord files: kind 'purge' for a SessionLog START."""
  from tensorboardX.proto import event_pb2  # noqa: PLC0415

  out = []
  for path in sorted(glob.glob(os.path.join(tb_dir, "events.*")), key=os.path.getmtime):
    data = open(path, "rb").read()
    i = 0
    while i < len(data):
      (n,) = struct.unpack("<Q", data[i:i + 8])
      ev = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
      i += 12 + n + 4
      if ev.HasField("session_log"):
        out.append((path, ev.step, "purge" if ev.session_log.status == event_pb2.SessionLog.START else "log"))
      elif ev.HasField("summary"):
        out.append((path, ev.step, "scalar"))
  return out


def test_resume_truncates_metrics_and_purges_tensorboard(tmp_path, caplog):
  w = metrics.MetricsWriter(str(tmp_path), 5, progress=False)
  for step in range(5):
    w.write(step, {"loss": float(step)})
  w.close()
  with caplog.at_level(logging.WARNING, logger="fp8jax.metrics"):
    w = metrics.MetricsWriter(str(tmp_path), 2, progress=False, keep_through=2)  # resumed from checkpoint 2
  assert "dropped 2 rows with step > 2" in caplog.text
  assert [r["step"] for r in _rows(tmp_path / "metrics.jsonl")] == [0, 1, 2]
  w.write(3, {"loss": 30.0})
  w.close()
  assert [(r["step"], r["loss"]) for r in _rows(tmp_path / "metrics.jsonl")] == [(0, 0.), (1, 1.), (2, 2.), (3, 30.)]
  ev = _tb_events(str(tmp_path / "tb"))
  files = sorted({e[0] for e in ev}, key=os.path.getmtime)
  assert len(files) == 2
  # TensorBoard hides the first file's events with step >= 3 because the second starts with a purge at step 3.
  assert [(s, k) for f, s, k in ev if f == files[1] and k != "log"][:2] == [(3, "purge"), (3, "scalar")]
  # A run starting over from step 0 (no checkpoint survived) rewrites every row.
  metrics.MetricsWriter(str(tmp_path), 1, progress=False, enable_tb=False, keep_through=-1).close()
  assert _rows(tmp_path / "metrics.jsonl") == []


# ------------------------------------------------------------------------------------------------------------------
# Corrupt checkpoints
# ------------------------------------------------------------------------------------------------------------------

STATE = {"w": jnp.arange(4096.0).reshape(64, 64), "q": jnp.ones((4, 4), jnp.float8_e4m3fn)}


def _biggest_data_file(step_dir):
  files = glob.glob(os.path.join(step_dir, "state", "**", "d", "*"), recursive=True)
  return max(files, key=os.path.getsize)


def _truncate(path):
  with open(path, "r+b") as f:
    f.truncate(os.path.getsize(path) // 2)
  return path


CORRUPTIONS = {
    "truncated data file": lambda d: _truncate(_biggest_data_file(d)),
    "missing state/_METADATA": lambda d: os.remove(os.path.join(d, "state", "_METADATA")) or "state/_METADATA",
    "truncated meta/metadata": lambda d: _truncate(os.path.join(d, "meta", "metadata")),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_latest_checkpoint_is_named_and_the_previous_one_used(tmp_path, caplog, corruption):
  ck = checkpoint.Checkpointer(str(tmp_path), keep=3)
  for step in (1, 2):
    ck.save(step, {k: v + step if k == "w" else v for k, v in STATE.items()}, {"step": step})
  bad = CORRUPTIONS[corruption](ck.step_dir(2))
  rel = os.path.relpath(bad, ck.step_dir(2)) if os.path.isabs(bad) else bad
  with pytest.raises(checkpoint.CheckpointCorrupt, match=rf"{ck.step_dir(2)}: file {rel} "):
    ck.verify(2)
  ck = checkpoint.Checkpointer(str(tmp_path), keep=3)  # a new process
  with caplog.at_level(logging.WARNING, logger="fp8jax.checkpoint"):
    step, (state, meta) = ck.restore_latest(lambda s: ck.restore(s, STATE))
  assert step == 1 and meta == {"step": 1}
  np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(STATE["w"]) + 1)
  assert f"checkpoint step 2 is corrupt: {ck.step_dir(2)}: file {rel}" in caplog.text
  assert "falling back to the previous checkpoint" in caplog.text
  # The corrupt step was set aside, so the resumed run can save step 2 again.
  assert os.path.isdir(ck.step_dir(2) + ".corrupt") and ck.all_steps() == [1]
  ck.save(2, STATE, {"step": 2})
  assert ck.restore(2, STATE)[1] == {"step": 2}


def test_an_orbax_failure_on_complete_files_moves_nothing_and_says_how(tmp_path):
  """A restore error with every file intact may be transient (memory, file system): name the step, move nothing."""
  ck = checkpoint.Checkpointer(str(tmp_path), keep=3)
  ck.save(1, STATE, {"step": 1})
  wrong = {k: jnp.zeros((v.shape[0] + 1, *v.shape[1:]), v.dtype) if k == "w" else v for k, v in STATE.items()}
  with pytest.raises(checkpoint.CheckpointUnreadable, match=rf"{ck.step_dir(1)}: the state cannot be restored.*"
                     rf"mv {ck.step_dir(1)} {ck.step_dir(1)}.corrupt"):
    ck.restore_latest(lambda s: ck.restore(s, wrong))
  assert ck.all_steps() == [1] and not os.path.exists(ck.step_dir(1) + ".corrupt")


def test_every_checkpoint_corrupt_raises_listing_them(tmp_path):
  ck = checkpoint.Checkpointer(str(tmp_path), keep=3)
  for step in (1, 2):
    ck.save(step, STATE, {"step": step})
    _truncate(os.path.join(ck.step_dir(step), "meta", "metadata"))
  with pytest.raises(checkpoint.CheckpointCorrupt, match=r"no readable checkpoint .*2: file meta/metadata.*1: file "
                     r"meta/metadata"):
    ck.restore_latest(lambda s: ck.restore(s, STATE))


def test_trainer_resumes_from_the_previous_checkpoint(tmp_path, caplog):
  tr = trainer_lib.RLTrainer(small_config(), str(tmp_path))
  tr.save(1)
  tr.save(2)
  _truncate(_biggest_data_file(tr.ckpt.step_dir(2)))
  tr2 = trainer_lib.RLTrainer(small_config(), str(tmp_path))
  with caplog.at_level(logging.WARNING):
    assert tr2.restore() == 1
  assert "checkpoint step 2 is corrupt" in caplog.text and "were written (truncated or changed)" in caplog.text


def test_resume_with_another_model_shape_names_the_keys(tmp_path):
  trainer_lib.RLTrainer(small_config(), str(tmp_path)).save(1)
  tr = trainer_lib.RLTrainer(small_config(**{"model.ffn_dim": 384, "model.n_layers": 3}), str(tmp_path))
  with pytest.raises(trainer_lib.CheckpointMismatch, match=r"model\.n_layers=2 in the checkpoint, 3 now; "
                     r"model\.ffn_dim=512 in the checkpoint, 384 now"):
    tr.restore()
  assert tr.ckpt.all_steps() == [1]  # a mismatch is not corruption: the checkpoint is left where it is


def test_kl_run_refuses_a_checkpoint_without_reference(tmp_path):
  trainer_lib.RLTrainer(small_config(), str(tmp_path)).save(1)  # kl_beta = 0: no reference saved
  tr = trainer_lib.RLTrainer(small_config(**{"grpo.kl_beta": 0.01}), str(tmp_path))
  with pytest.raises(trainer_lib.CheckpointMismatch, match="holds no KL reference policy"):
    tr.restore()


def test_a_checkpoint_of_the_old_layout_is_refused_naming_its_directory(tmp_path):
  """Layout 1 (before the train state held the KV scales, the KL reference and the data position): its state item
  is {params, opt_state, step} and its metadata has no "layout". Not restored into the wrong structure, not moved
  aside as corrupt: an error naming the step directory."""
  ck = checkpoint.Checkpointer(str(tmp_path / "checkpoints"))
  ck.save(3, {"params": {"x": jnp.zeros(2)}, "step": jnp.zeros((), jnp.int32)},
          {"step": 3, "seed": 0, "warm_done": True, "prompt_batch": 3, "kv_scales": None, "kl_reference": False})
  tr = trainer_lib.RLTrainer(small_config(), str(tmp_path))
  with pytest.raises(trainer_lib.CheckpointMismatch, match=rf"{tmp_path}/checkpoints/3 was written by an older "
                     r"fp8jax \(checkpoint layout 1"):
    tr.restore()
  assert tr.ckpt.all_steps() == [3]
