"""What an unpublish leaves of its target: csi_pmem.driver.host.mounts.remove_target,
which both publishers share (devdax's directory, fsdax's directory or file)."""

from __future__ import annotations

import logging

from csi_pmem.driver.host.mounts import remove_target


def test_a_directory_a_file_and_nothing_are_all_fine(tmp_path):
    (tmp_path / "dir").mkdir()
    (tmp_path / "file").write_bytes(b"")
    for name in ("dir", "file", "never-made"):
        remove_target(str(tmp_path / name))
        assert not (tmp_path / name).exists()


def test_a_link_goes_and_what_it_names_stays(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    remove_target(str(tmp_path / "link"))
    assert not (tmp_path / "link").is_symlink() and (tmp_path / "real").is_dir()


def test_a_directory_with_something_in_it_stays_with_a_warning(tmp_path, caplog):
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "kept").write_text("x")
    with caplog.at_level(logging.WARNING):
        remove_target(str(tmp_path / "dir"))
    assert (tmp_path / "dir" / "kept").exists()
    assert f"left target {tmp_path / 'dir'} in place" in caplog.text
