"""Checkpoints are data: every torch file the suite reads is unpickled with ``weights_only=True`` and an allow-list
(lightning_modules/checkpoints.py, ``load_torch_file``); a file that needs more is refused before any of it runs,
unless the user trusts it by name (``trust_pickle=True``, ``FLOWLM_TRUST_PICKLE``, ``flowlm-export --trust-pickle``)
(docs/reliability.md, Checkpoints are data)."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path

import pytest
import torch
from conftest import FAST, compose_config
from omegaconf import DictConfig, OmegaConf

from lightning_modules.checkpoints import (
    TRUST_ENV,
    UntrustedCheckpointError,
    load_module,
    load_torch_file,
    read_checkpoint,
    read_checkpoint_meta,
    verify_checkpoint,
)
from lightning_modules.mdm import MDMModule
from runners.export import main as export_main
from tests.pretrained.test_export import write_run_checkpoint


class Payload:
    """Unpickled, it writes ``marker``: what a crafted checkpoint runs on load."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def crafted(path: Path, marker: Path) -> Path:
    """A flowlm checkpoint that also holds a ``Payload``: readable, but only by running the payload."""
    write_run_checkpoint(path)
    ckpt = torch.load(path, weights_only=True)
    ckpt["extra"] = Payload(marker)
    torch.save(ckpt, path)
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The last.ckpt of a 2-step flowlm-train run (Lightning's own checkpoint: loops, callbacks, optimizer)."""
    from conftest import isolate_runs

    from runners.train import train

    root = tmp_path_factory.mktemp("safe_loading")
    mp = pytest.MonkeyPatch()
    isolate_runs(mp, root)
    result = train(compose_config(overrides=["experiment=sudoku_mdm_uncond", "scale=cpu", *FAST, "logger=none"]))
    mp.undo()
    return Path(result["run_dir"], "checkpoints", "last.ckpt")


def test_a_suite_checkpoint_loads_with_weights_only(trained, monkeypatch):
    """A run's checkpoint reads, verifies and loads as a module, every torch.load with weights_only=True."""
    calls = []
    load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: calls.append(k.get("weights_only")) or load(*a, **k))
    verify_checkpoint(trained)
    assert read_checkpoint_meta(trained)["family"] == "mdm"
    assert read_checkpoint(trained)["global_step"] == 2
    assert isinstance(load_module(trained), MDMModule)
    assert calls and all(calls), calls


def test_lightning_omegaconf_hyper_parameters_load(tmp_path):
    """hyper_parameters as a DictConfig (Lightning saves a Container as is, with its type) load with the allow-list:
    flags, interpolations and a filled resolver cache intact, the cache a defaultdict again (a resolver first used
    after loading works)."""
    write_run_checkpoint(tmp_path / "last.ckpt")
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True)
    hparams = OmegaConf.create(ckpt["hyper_parameters"])
    OmegaConf.set_struct(hparams, True)
    ckpt["hyper_parameters"], ckpt["hparams_type"] = hparams, DictConfig
    OmegaConf.register_new_resolver("_saved_", lambda: "saved", use_cache=True)
    OmegaConf.register_new_resolver("_later_", lambda: "later", use_cache=True)
    try:
        data = OmegaConf.create({"steps": [3], "twice": "${steps}", "saved": "${_saved_:}", "later": "${_later_:}"})
        assert data.saved == "saved"  # now in the config's resolver cache
        ckpt["datamodule_hyper_parameters"] = data
        torch.save(ckpt, tmp_path / "omega.ckpt")
        loaded = read_checkpoint(tmp_path / "omega.ckpt")
        data = loaded["datamodule_hyper_parameters"]
        assert OmegaConf.get_cache(data) == {"_saved_": {(): "saved"}}
        assert (data.twice, data.saved, data.later) == ([3], "saved", "later")
    finally:
        OmegaConf.clear_resolver("_saved_")
        OmegaConf.clear_resolver("_later_")
    assert loaded["hparams_type"] is DictConfig and OmegaConf.is_struct(loaded["hyper_parameters"])
    assert isinstance(load_module(tmp_path / "omega.ckpt"), MDMModule)


def test_a_crafted_checkpoint_is_refused_before_it_runs(tmp_path, capsys):
    """Every reader refuses a checkpoint whose unpickling runs code, naming the file and how to trust it; the payload
    never runs."""
    marker = tmp_path / "marker"
    path = crafted(tmp_path / "crafted.ckpt", marker)
    readers = [read_checkpoint, read_checkpoint_meta, verify_checkpoint, load_module, load_torch_file]
    for reader in readers:
        with pytest.raises(UntrustedCheckpointError, match="builtins.exec") as err:
            reader(path)
        assert str(path) in str(err.value) and "trust_pickle=True" in str(err.value) and TRUST_ENV in str(err.value)
    with pytest.raises(UntrustedCheckpointError, match="--trust-pickle"):
        export_main([str(path), str(tmp_path / "out")])
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_the_trust_option_loads_it(tmp_path, monkeypatch, capsys):
    """trust_pickle=True, the file (or its folder) in FLOWLM_TRUST_PICKLE and flowlm-export --trust-pickle unpickle it
    in full: the payload runs and the checkpoint loads."""
    marker = tmp_path / "marker"
    path = crafted(tmp_path / "crafted.ckpt", marker)
    assert read_checkpoint(path, trust_pickle=True)["global_step"] == 42 and marker.read_text() == "ran"
    marker.unlink()
    assert isinstance(load_module(path, trust_pickle=True), MDMModule) and marker.exists()
    for trusted in (path, tmp_path):
        marker.unlink()
        monkeypatch.setenv(TRUST_ENV, f"/nowhere:{trusted}")
        assert isinstance(load_module(path), MDMModule) and marker.exists()
    monkeypatch.delenv(TRUST_ENV)
    marker.unlink()
    export_main([str(path), str(tmp_path / "out"), "--trust-pickle"])
    assert marker.exists() and (tmp_path / "out" / "model.safetensors").is_file()


def write_sharded(folder: Path, meta: dict) -> None:
    """A sharded checkpoint folder (torch.distributed.checkpoint shards + Lightning's meta.pt), one process."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # "torch.distributed is disabled ... single process": as intended here
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"state_dict": {"net.w": torch.ones(3, 2)}}, checkpoint_id=folder, no_dist=True)
    torch.save(meta, folder / "meta.pt")


def test_a_sharded_folder_with_a_crafted_meta_or_index_is_refused(tmp_path, monkeypatch):
    """A sharded folder's meta.pt (torch.load) and shard index .metadata (pickle, which torch reads in full) are
    read under the same rule: refused, payload never run; trusted by folder, read."""
    marker = tmp_path / "marker"
    good = {"flowlm": {"family": "mdm"}, "global_step": 4}
    meta = tmp_path / "meta"
    write_sharded(meta, {**good, "extra": Payload(marker)})
    index = tmp_path / "index"
    write_sharded(index, good)
    metadata = pickle.loads((index / ".metadata").read_bytes())
    metadata.planner_data = {**(metadata.planner_data or {}), "payload": Payload(marker)}
    (index / ".metadata").write_bytes(pickle.dumps(metadata))
    cases = [(meta, "meta.pt", read_checkpoint_meta), (meta, "meta.pt", read_checkpoint), (index, ".metadata", None)]
    for folder, culprit, reader in cases:
        for read in (reader, verify_checkpoint, read_checkpoint) if reader else (verify_checkpoint, read_checkpoint):
            with pytest.raises(UntrustedCheckpointError, match=f"{culprit}.*builtins.exec"):
                read(folder)
    assert not marker.exists()
    monkeypatch.setenv(TRUST_ENV, str(index))
    assert torch.equal(read_checkpoint(index)["state_dict"]["net.w"], torch.ones(3, 2)) and marker.exists()


class _RunsCode:
    """Unpickling it runs code: it touches a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_sharded_folder_with_a_crafted_shard_entry_is_refused_before_it_runs(tmp_path):
    """torch's own planner unpickles a shard's non-tensor entries in full (``load_bytes``): the consolidation reads
    them weights-only, so a crafted entry is refused and runs nothing; trusted by name, it loads."""
    import torch.distributed.checkpoint as dcp

    from lightning_modules.checkpoints import SHARDED_META, UntrustedCheckpointError, consolidate_checkpoint

    marker = tmp_path / "ran"
    folder = tmp_path / "last.ckpt"
    with pytest.warns(UserWarning):  # torch: no process group, a single-process save
        dcp.save({"state_dict": {"w": torch.ones(2), "x": _RunsCode(marker)}}, checkpoint_id=str(folder), no_dist=True)
    torch.save({"flowlm": {}, "global_step": 1}, folder / SHARDED_META)
    with pytest.raises(UntrustedCheckpointError, match="shard entry"):
        consolidate_checkpoint(folder)
    assert not marker.exists()
    consolidate_checkpoint(folder, trust_pickle=True)  # the user's explicit trust
    assert marker.exists()
