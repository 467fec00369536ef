"""The staged config and tokenizer files read back (csi_pmem.loader.auxfiles), and the
vLLM plugin's settings (csi_pmem.integrations.vllm_settings; no vLLM needed for either)."""

from __future__ import annotations

import pytest

from csi_pmem.integrations.vllm_settings import ENV_MODEL, ENV_VERIFY, ENV_VOLUME, settings
from csi_pmem.loader import (
    ChecksumError,
    LoaderError,
    export_config,
    open_model,
    open_volume,
    read_aux,
)
from csi_pmem.loader.cli import main

import loader_models as lm


@pytest.fixture
def staged(tmp_path):
    src = tmp_path / "src"
    lm.sharded_model(src)  # config.json, an index json and tokenizer/vocab.txt
    return src, lm.staged_volume(src, tmp_path / "vol")


def test_export_config_writes_the_aux_files_only_byte_identical(tmp_path, staged):
    src, vol = staged
    dest = tmp_path / "cfg"
    written = export_config(vol, str(dest))
    got = lm.tree_digest(dest)
    want = {k: v for k, v in lm.tree_digest(src).items() if not k.endswith(".safetensors")}
    assert got == want and len(written) == len(want) == 3
    # Again: nothing changes, and a file edited since is put back.
    (dest / "config.json").write_text("{}")
    export_config(vol, str(dest))
    assert lm.tree_digest(dest) == want
    # The same through csi-pmem-weights, as the docs run it.
    other = tmp_path / "cli"
    assert main(["export-config", str(vol), str(other)]) == 0
    assert lm.tree_digest(other) == want


def test_read_aux_names_what_is_staged(staged):
    _, vol = staged
    with open_volume(vol) as v:
        view = open_model(v)
        assert read_aux(view, "tokenizer/vocab.txt") == b"a\nb\nc\n"
        with pytest.raises(LoaderError, match=r"no staged file 'tokenizer.json'.*config.json"):
            read_aux(view, "tokenizer.json")


def test_damaged_config_is_an_error_and_exit_3(tmp_path, staged, capsys):
    _, vol = staged
    with open_volume(vol, writable=True) as v:
        f = open_model(v).file("config.json")
        v.view(f.offset, 1)[0] ^= 0x20
    with open_volume(vol) as v, pytest.raises(ChecksumError, match=r"config\.json of model"):
        read_aux(open_model(v), "config.json")
    assert main(["export-config", str(vol), str(tmp_path / "out")]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "stage the model again" in err


def test_the_command_writes_and_lists(tmp_path, staged, capsys):
    _, vol = staged
    assert main(["export-config", str(vol), str(tmp_path / "out")]) == 0
    assert sorted(capsys.readouterr().out.split()) == sorted(
        str(p) for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert main(["export-config", str(tmp_path / "missing"), str(tmp_path / "out")]) == 1


def test_vllm_settings_precedence():
    env = {ENV_VOLUME: "/env-vol", ENV_MODEL: "env-model", ENV_VERIFY: "false"}
    s = settings({"volume": "/x", "model": "m", "verify": True}, "/models", env)
    assert (s.volume, s.model, s.verify) == ("/x", "m", True)
    s = settings({}, "/models", env)
    assert (s.volume, s.model, s.verify) == ("/env-vol", "env-model", False)
    s = settings(None, "/models", {})
    assert (s.volume, s.model, s.verify) == ("/models", None, True)


@pytest.mark.parametrize("extra,env,match", [
    ({"volum": "/x"}, {}, "unknown key.*volum.*known: volume, model, verify"),
    ({"model": 3}, {}, "'model' must be a non-empty string"),
    ({"verify": "maybe"}, {}, "'verify' is 'maybe'"),
    ({}, {ENV_VERIFY: "sometimes"}, "CSI_PMEM_VERIFY is 'sometimes'"),
])
def test_vllm_settings_refuse_what_they_do_not_understand(extra, env, match):
    with pytest.raises(LoaderError, match=match):
        settings(extra, "/models", env)
