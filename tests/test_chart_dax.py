"""The chart for dax regions: ``backend.type`` daxctl and ``ndctl,daxctl``, the
``backend.daxctl`` values as the driver reads them, and ``storageClasses.media`` on every
class, accepted by the driver's own parameter parser (helpers of tests/test_chart.py)."""

from __future__ import annotations

import pytest
from test_chart import Manifests, helm, render, run_helm, serve_config_from  # noqa: F401

from csi_pmem.driver.params import parse


@pytest.mark.parametrize("backend", ["daxctl", "ndctl,daxctl"])
def test_dax_backends_render_as_the_driver_reads_them(helm: str, backend: str) -> None:  # noqa: F811
    escaped = backend.replace(",", "\\,")  # helm --set splits on unescaped commas
    m = Manifests(render(helm, "--set-string", f"backend.type={escaped}",
                         "--set", "backend.daxctl.setup=reconfigure"))
    env = m.env("driver")
    assert (env["CSI_PMEM_BACKEND"], env["CSI_PMEM_DAXCTL"], env["CSI_PMEM_CXL"],
            env["CSI_PMEM_DAX_SETUP"]) == (backend, "daxctl", "cxl", "reconfigure")
    cfg = serve_config_from(env)
    assert cfg.backends == tuple(backend.split(",")) and cfg.dax_setup == "reconfigure"


def test_ndctl_alone_sets_no_dax_variables(helm: str) -> None:  # noqa: F811
    env = Manifests(render(helm)).env("driver")
    assert not {"CSI_PMEM_DAXCTL", "CSI_PMEM_DAX_SETUP"} & set(env)


def test_media_reaches_every_class(helm: str) -> None:  # noqa: F811
    m = Manifests(render(helm, "--set", "storageClasses.media=volatile",
                         "--set", "storageClasses.perNuma={0}"))
    classes = m.all("StorageClass")
    assert len(classes) == 3
    for sc in classes:
        assert sc["parameters"]["media"] == "volatile"
        assert parse(sc["parameters"]).media == "volatile"
    default = Manifests(render(helm)).one("StorageClass", "csi-pmem")
    assert "media" not in default["parameters"]  # any: no parameter


@pytest.mark.parametrize("setting", ["storageClasses.media=dram", "backend.daxctl.setup=on",
                                     "backend.type=daxctl\\,ndctl"])
def test_schema_rejects_bad_dax_values(helm: str, setting: str) -> None:  # noqa: F811
    result = run_helm(helm, "template", "--set-string", setting)
    assert result.returncode != 0 and "values don't meet the specifications" in \
        result.stderr, result.stderr
