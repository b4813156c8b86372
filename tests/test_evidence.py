"""agents.evidence: what the host copies out of a checks' evidence folder, and what it refuses
(links to host files, screenshots outside ``screenshots/``, oversized or malformed files)."""

import json
import os

import pytest

from agents import evidence as ev
from agents.evidence import Evidence


@pytest.fixture
def box(tmp_path):
    e = Evidence.for_run(tmp_path / "run")
    e.prepare()
    return e


def quality(shots, **counts):
    q = {"kind": "kanban_quality", "passed": 1, "failed": 1, "blocked": 0, "total": 2, **counts,
         "categories": [{"name": f"c{i}", "status": "fail", "screenshot": s} for i, s in enumerate(shots)]}
    return json.dumps(q)


def test_quality_and_its_screenshots_are_copied_into_the_run_dir(box, tmp_path):
    (box.folder / "screenshots").mkdir()
    (box.folder / "screenshots" / "a.png").write_bytes(b"png-a")
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    os.symlink(secret, box.folder / "screenshots" / "link.png")
    (box.folder / "quality.json").write_text(quality([
        str(box.folder / "screenshots" / "a.png"),        # kept, copied
        str(box.folder / "screenshots" / "link.png"),     # a link: dropped
        str(secret),                                      # outside the folder: dropped
        str(box.folder / "screenshots" / ".." / ".." / "secret.txt"),
        None, 7]))
    summary = box.collect()
    assert summary == {"passed": 1, "failed": 1, "blocked": 0, "total": 2, "path": str(box.dest / "quality.json")}
    copy = json.loads((box.dest / "quality.json").read_text())
    shots = [c["screenshot"] for c in copy["categories"]]
    assert shots == [str(box.dest / "screenshots" / "a.png"), None, None, None, None, None]
    assert (box.dest / "screenshots" / "a.png").read_bytes() == b"png-a"
    assert sorted(p.name for p in (box.dest / "screenshots").iterdir()) == ["a.png"]


@pytest.mark.parametrize("make", [
    lambda f, t: os.symlink(t / "elsewhere.json", f / "quality.json"),   # a link to a host file
    lambda f, t: (f / "quality.json").write_text("not json"),
    lambda f, t: (f / "quality.json").write_text("[1, 2]"),
    lambda f, t: (f / "quality.json").write_text('{"passed": 1}'),        # counts missing
    lambda f, t: (f / "quality.json").write_bytes(b" " * (ev.MAX_QUALITY_BYTES + 1)),
    lambda f, t: (f / "quality.json").mkdir(),
])
def test_unusable_quality_is_not_collected_and_no_stale_copy_stays(box, tmp_path, make):
    (tmp_path / "elsewhere.json").write_text(quality([]))  # valid, but not the checks' own file
    (box.dest / "quality.json").write_text(quality([]))    # a stale copy from an earlier run
    make(box.folder, tmp_path)
    assert box.collect() is None
    assert not (box.dest / "quality.json").exists()


def test_a_linked_evidence_folder_is_not_followed(tmp_path):
    e = Evidence(tmp_path / "evidence", tmp_path)
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "quality.json").write_text(quality([]))
    os.symlink(tmp_path / "real", e.folder)
    assert e.collect() is None
    e.prepare()  # replaces the link by an empty folder of its own
    assert e.folder.is_dir() and not e.folder.is_symlink() and not any(e.folder.iterdir())
    assert (tmp_path / "real" / "quality.json").exists()


def test_prepare_empties_what_an_earlier_run_left(box):
    (box.folder / "quality.json").write_text(quality([]))
    box.prepare()
    assert box.collect() is None and box.env() == {"MLXTERM_RUN_DIR": str(box.folder)}
