"""atomic_path: the target appears complete or not at all, with ordinary permissions."""

import os
import stat

import pytest

from tilewise.atomic import atomic_path


def test_success_renames_into_place_with_umask_permissions(tmp_path):
    target = tmp_path / "out.bin"
    with atomic_path(target) as tmp:
        assert os.path.dirname(tmp) == str(tmp_path) and not target.exists()
        with open(tmp, "wb") as f:
            f.write(b"done")
    assert target.read_bytes() == b"done"
    mask = os.umask(0)
    os.umask(mask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~mask
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]


@pytest.mark.parametrize("error", [RuntimeError("disk full"), KeyboardInterrupt()])
def test_failure_leaves_no_file_and_keeps_an_existing_target(tmp_path, error):
    target = tmp_path / "out.bin"
    target.write_bytes(b"old")
    with pytest.raises(type(error)):
        with atomic_path(target) as tmp:
            with open(tmp, "wb") as f:
                f.write(b"half")
            raise error
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.bin"]
