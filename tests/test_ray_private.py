"""lightray.ray_private: the Ray internals lightray needs, checked against the pinned Ray."""

import socket

from lightray import ray_private


def test_every_private_name_is_there_in_the_pinned_ray():
    assert ray_private.check() == []


def _address_file(tmp_path):
    return tmp_path / "ray_current_cluster"


def test_a_current_cluster_file_naming_a_dead_address_is_removed(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    _address_file(tmp_path).write_text(dead)
    assert ray_private.drop_stale_cluster_address(str(tmp_path)) == dead
    assert not _address_file(tmp_path).exists()


def test_a_current_cluster_file_naming_a_live_address_is_kept(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        live = f"127.0.0.1:{s.getsockname()[1]}"
        _address_file(tmp_path).write_text(live)
        assert ray_private.drop_stale_cluster_address(str(tmp_path)) is None
    assert _address_file(tmp_path).read_text() == live


def test_no_current_cluster_file_is_nothing_to_do(tmp_path):
    assert ray_private.drop_stale_cluster_address(str(tmp_path)) is None
