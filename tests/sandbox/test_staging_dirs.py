"""A host's staging directories across worker restarts (belayer/sandbox/staging.py)."""

from __future__ import annotations

from belayer.sandbox.staging import Staging


def test_a_new_worker_removes_what_an_earlier_one_left_mid_import(tmp_path):
    """A worker killed mid-restore leaves its archive in the host's imports directory
    (a whole-host loss wipes the host's storage, not the state directory's staging): the
    next worker of the host, which imports nothing yet, removes it; another host's stays."""
    mine = Staging(tmp_path, lambda: "belayer-sandbox-h1", 1 << 30)
    other = Staging(tmp_path, lambda: "belayer-sandbox-h2", 1 << 30)
    with mine.importing("sbx-a") as d, other.importing("sbx-b") as e:
        (d / "plain.tar").write_bytes(b"x" * 10)
        (d / "fork-sbx-c.tar").write_bytes(b"y")
        (e / "plain.tar").write_bytes(b"z")
        # the worker dies here; the next worker of its host starts
        assert Staging(tmp_path, lambda: "belayer-sandbox-h1", 1 << 30).drop_imports() == 2
        assert not d.exists() and (e / "plain.tar").exists()
    assert mine.drop_imports() == 0
