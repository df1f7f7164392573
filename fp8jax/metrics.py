"""Metrics: jsonl + TensorBoard events under the run directory, a progress bar, and a PNG plot at the end."""

from __future__ import annotations

import json
import logging
import os
import time

import numpy as np

log = logging.getLogger(__name__)


def _scalar(v):
  try:
    return float(np.asarray(v))
  except (TypeError, ValueError):
    return None


class MetricsWriter:
  """Writes {step, metrics} rows. Values are fetched to the host here, i.e. only when logging.

  ``keep_through``: a resumed run passes the step it resumed from. Rows of metrics.jsonl with a larger step were
  written by the interrupted run after that checkpoint and are about to be written again, so they are dropped
  (the file is rewritten atomically, with a warning); ``-1`` drops every row (a run starting from step 0); None
  appends. TensorBoard event files cannot be edited: the new event file starts with a purge event at
  ``keep_through + 1``, which makes TensorBoard hide the older files' events from that step on (tensorboardX's
  ``purge_step``), so no step is shown twice.
  """

  def __init__(self, workdir: str, total_steps: int, *, enable_tb: bool = True, progress: bool = True,
               keep_through: int | None = None, enabled: bool = True):
    self.workdir = workdir
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._f = self._tb = self._bar = None
    if not enabled:  # another process of a multi-process run writes (fp8jax.distributed): rows are only returned
      return
    os.makedirs(workdir, exist_ok=True)
    if keep_through is not None:
      truncate_jsonl(self.path, keep_through)
    self._f = open(self.path, "a")
    self._tb = None
    if enable_tb:
      try:
        from tensorboardX import SummaryWriter  # noqa: PLC0415

        tb_dir = os.path.join(workdir, "tb")
        purge = None if keep_through is None or not os.path.isdir(tb_dir) else keep_through + 1
        # A unique suffix: two writers started in the same second (same default file name) never share a file.
        self._tb = SummaryWriter(tb_dir, purge_step=purge, filename_suffix=f".{os.getpid()}.{time.time_ns()}")
      except ImportError:
        log.warning("tensorboardX is not installed: no TensorBoard events (metrics.jsonl is still written)")
    self._bar = None
    if progress:
      from tqdm import tqdm  # noqa: PLC0415

      self._bar = tqdm(total=total_steps, desc="grpo", dynamic_ncols=True)

  def write(self, step: int, metrics: dict):
    row = {"step": int(step)}
    for k, v in metrics.items():
      s = _scalar(v)
      if s is not None:
        row[k] = s
    if self._f is not None:
      self._f.write(json.dumps(row) + "\n")
      self._f.flush()
    if self._tb is not None:
      for k, v in row.items():
        if k != "step":
          self._tb.add_scalar(k, v, step)
    if self._bar is not None:
      show = {k: f"{row[k]:.3g}" for k in ("reward_mean", "val_accuracy", "token_mult_prob_error", "loss") if k in row}
      self._bar.set_postfix(show, refresh=False)
      self._bar.update(1)
    return row

  def close(self):
    if self._bar is not None:
      self._bar.close()
    if self._tb is not None:
      self._tb.close()
    if self._f is not None:
      self._f.close()


def read_jsonl(path: str) -> list[dict]:
  """The rows of a metrics.jsonl; a torn last line (the writer was killed mid-line) is skipped with a warning."""
  with open(path) as f:
    lines = [ln for ln in f if ln.strip()]
  rows = []
  for i, line in enumerate(lines):
    try:
      rows.append(json.loads(line))
    except json.JSONDecodeError as e:
      if i != len(lines) - 1:
        raise ValueError(f"{path}:{i + 1}: not a JSON row ({e})") from None
      log.warning("%s: the last line is incomplete (a killed writer?); skipped", path)
  return rows


def truncate_jsonl(path: str, keep_through: int) -> int:
  """Keeps the rows with step <= ``keep_through`` (atomic rewrite); returns how many were dropped."""
  if not os.path.isfile(path):
    return 0
  rows = read_jsonl(path)
  kept = [r for r in rows if r.get("step", -1) <= keep_through]
  dropped = len(rows) - len(kept)
  with open(path) as f:
    torn = sum(1 for ln in f if ln.strip()) - len(rows)
  if dropped or torn:
    log.warning("%s: dropped %d rows with step > %d (written after the checkpoint this run resumes from)%s", path,
                dropped, keep_through, " and a torn last line" if torn else "")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
      f.writelines(json.dumps(r) + "\n" for r in kept)
    os.replace(tmp, path)
  return dropped


def plot(workdir: str, keys=("reward_mean", "val_accuracy", "token_mult_prob_error")) -> str | None:
  """PNG of reward, validation accuracy and sampler/trainer mismatch over steps; returns its path."""
  try:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
  except ImportError:
    log.warning("matplotlib is not installed: no plot")
    return None
  rows = read_jsonl(os.path.join(workdir, "metrics.jsonl"))
  fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.5))
  for ax, k in zip(axes, keys):
    pts = [(r["step"], r[k]) for r in rows if k in r]
    if pts:
      ax.plot(*zip(*pts), marker="o", markersize=3)
    ax.set_title(k)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
  fig.tight_layout()
  out = os.path.join(workdir, "metrics.png")
  fig.savefig(out, dpi=100)
  plt.close(fig)
  return out
