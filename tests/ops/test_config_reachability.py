"""``reachability`` in config.toml reaches the node's NAT service; a typo is a clear error."""

from __future__ import annotations

import pytest

from node.config import NodeConfig
from node.errors import ConfigError
from node.home import NodeHome
from node.ops.daemon import _p2p_config, _settings


def test_reachability_private_reaches_the_nat_config(tmp_path):
    home = NodeHome(tmp_path / "n")
    home.init(NodeConfig(reachability="private"))
    assert _p2p_config(_settings(home.path)).nat.mode == "private"
    other = NodeHome(tmp_path / "m")
    other.init()
    assert _p2p_config(_settings(other.path)).nat.mode == "auto"


def test_a_misspelt_reachability_is_refused(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text('reachability = "privat"\n')
    with pytest.raises(ConfigError, match="reachability must be auto, public or private"):
        NodeConfig.load(path)
