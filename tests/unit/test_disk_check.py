"""Preflight's disk check asks for the hidden states still to write, not the whole estimate on every run."""

from __future__ import annotations

from conftest import config_dict

from eyrie.config import parse_config
from eyrie.stages.preflight.node import bytes_still_to_write


def test_the_disk_check_counts_only_the_hidden_states_still_to_write(tmp_path):
    config = parse_config(config_dict(tmp_path / "t"))
    hidden = tmp_path / "run" / "extract" / "hidden_states"
    assert bytes_still_to_write(config.train, 1000, hidden) == 1000  # nothing extracted yet
    (hidden / "packs").mkdir(parents=True)
    (hidden / "hs_0.safetensors").write_bytes(b"x" * 300)
    (hidden / "packs" / "0_8.safetensors").write_bytes(b"x" * 400)
    assert bytes_still_to_write(config.train, 1000, hidden) == 300  # a re-run needs only the rest
    (hidden / "hs_1.safetensors").write_bytes(b"x" * 500)
    assert bytes_still_to_write(config.train, 1000, hidden) == 0  # all there: a cached re-run is never refused
    online = parse_config(config_dict(tmp_path / "t", train={"hidden_states": "online"}))
    assert bytes_still_to_write(online.train, 10**15, tmp_path / "none") == 0  # online writes none to the run folder
