"""The serve flags become the core's configuration in one place:
:meth:`csi_pmem.driver.config.ServeConfig.driver_config`."""

from __future__ import annotations

import argparse

from csi_pmem.driver import config
from csi_pmem.driver.config import DriverConfig


def serve_config(monkeypatch, **flags: str) -> config.ServeConfig:
    for key in config.DEFAULTS:
        monkeypatch.delenv(config.env_name(key), raising=False)
    parser = argparse.ArgumentParser()
    config.add_serve_flags(parser)
    argv = [f"{config.flag(k)}={v}" for k, v in flags.items()]
    return config.from_args(parser.parse_args(argv))


def test_the_defaults(monkeypatch):
    cfg = serve_config(monkeypatch, node_id="n1")
    assert cfg.driver_config() == DriverConfig(
        driver_name=config.DEFAULTS["driver_name"], node_id="n1",
        kubelet_dir="/var/lib/kubelet", erase_threads=None, erase_verify="sampled",
        erase_workers=2, scrub=True, erase_wait=5.0, delete_wait=1.0, device_node=False)


def test_every_flag_the_core_reads(monkeypatch):
    cfg = serve_config(monkeypatch, node_id="n2", driver_name="pmem.example.com",
                       kubelet_dir="/k", erase_threads="3", erase_verify="full",
                       erase_workers="4", scrub="off", erase_wait_seconds="7",
                       delete_wait_seconds="0.5", device_node="on")
    assert cfg.driver_config() == DriverConfig(
        driver_name="pmem.example.com", node_id="n2", kubelet_dir="/k", erase_threads=3,
        erase_verify="full", erase_workers=4, scrub=False, erase_wait=7.0, delete_wait=0.5,
        device_node=True)
