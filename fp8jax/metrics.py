"""Metrics: jsonl + TensorBoard events under the run directory, a progress bar, and a PNG plot at the end."""

from __future__ import annotations

import json
import logging
import os

import numpy as np

log = logging.getLogger(__name__)


def _scalar(v):
  try:
    return float(np.asarray(v))
  except (TypeError, ValueError):
    return None


class MetricsWriter:
  """Writes {step, metrics} rows. Values are fetched to the host here, i.e. only when logging."""

  def __init__(self, workdir: str, total_steps: int, *, enable_tb: bool = True, progress: bool = True):
    os.makedirs(workdir, exist_ok=True)
    self.workdir = workdir
    self.path = os.path.join(workdir, "metrics.jsonl")
    self._f = open(self.path, "a")
    self._tb = None
    if enable_tb:
      try:
        from tensorboardX import SummaryWriter  # noqa: PLC0415

        self._tb = SummaryWriter(os.path.join(workdir, "tb"))
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
    self._f.close()


def read_jsonl(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


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
