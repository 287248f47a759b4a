"""An export loads with transformers alone: ``AutoModel.from_pretrained(folder, trust_remote_code=True)`` in a
process where the suite cannot be imported gives the suite's logits for each DiT family (MDM, FMLM+, AR)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import torch

from lightning_modules.ar import ARModule
from lightning_modules.fmlm_plus import FMLMPlusModule
from lightning_modules.mdm import MDMModule
from runners.export import export
from tests.pretrained.test_export import BACKBONE, L, V, write_run_checkpoint

# Run in a fresh interpreter: every package of the suite is blocked, so only torch, transformers and the files in
# the export folder can serve the load.
LOADER = textwrap.dedent(
    """
    import sys
    for name in ("flowlm", "lightning_modules", "runners", "callbacks", "datamodules", "analysis", "sweeps"):
        sys.modules[name] = None  # `import flowlm` now raises ImportError
    import json

    import torch
    from transformers import AutoConfig, AutoModel

    cases = torch.load(sys.argv[1], weights_only=True)
    worst = {}
    for family, case in cases.items():
        folder = case["folder"]
        config = AutoConfig.from_pretrained(folder, trust_remote_code=True)
        model = AutoModel.from_pretrained(folder, trust_remote_code=True).eval()
        assert type(model).__name__ == "FlowLMModel" and config.family == family, (type(model), config.family)
        with torch.no_grad():
            if family == "mdm":
                got = {"logits": model(case["x"], t=case["t"]).logits}
            elif family == "flow":
                got = {
                    "logits": model(x=case["x"], s=case["s"], t=case["t"]).logits,
                    "log_delta": model.log_delta(case["x"], case["s"], case["t"]),
                    "pinned_logits": model(x=case["x"], s=case["s1"], t=case["t1"], pinned=case["pinned"]).logits,
                }
            else:
                got = {"logits": model(case["x"]).logits}
        worst[family] = max((got[k] - case[k]).abs().max().item() for k in got)
        assert all(got[k].shape == case[k].shape for k in got), family
    print(json.dumps(worst))
    """
)


def _trained(module_class: type, tmp_path, name: str):
    path = tmp_path / name
    path.mkdir()
    module = write_run_checkpoint(path / "last.ckpt", module_class=module_class, seed=3).eval()
    return module, export(path / "last.ckpt", path / "export")


def test_transformers_alone_loads_every_dit_family_with_the_suites_logits(tmp_path):
    gen = torch.Generator().manual_seed(0)
    cases = {}
    mdm, folder = _trained(MDMModule, tmp_path, "mdm")
    x = torch.randint(0, V + 1, (3, L), generator=gen)  # data ids and [MASK] (id V)
    t = torch.rand(3, generator=gen)
    with torch.no_grad():
        cases["mdm"] = {"folder": str(folder), "x": x, "t": t, "logits": mdm(x, t)}
    flow, folder = _trained(FMLMPlusModule, tmp_path, "flow")
    x = torch.softmax(torch.randn(3, L, V, generator=gen), -1)  # points of the simplex
    s, t = torch.rand(3, L, generator=gen) * 0.5, 0.5 + torch.rand(3, L, generator=gen) * 0.5
    s1, t1 = torch.rand(3, generator=gen) * 0.5, 0.5 + torch.rand(3, generator=gen) * 0.5
    pinned = torch.rand(3, L, generator=gen) < 0.3
    with torch.no_grad():
        cases["flow"] = {
            "folder": str(folder),
            **{"x": x, "s": s, "t": t, "s1": s1, "t1": t1, "pinned": pinned},
            "logits": flow.net(x, s, t),
            "log_delta": flow(x, s, t),
            "pinned_logits": flow.net(x, s1, t1, pinned=pinned),
        }
    ar, folder = _trained(ARModule, tmp_path, "ar")
    x = torch.randint(0, V, (3, L), generator=gen)
    with torch.no_grad():
        cases["ar"] = {"folder": str(folder), "x": x, "logits": ar(x)}
    config = json.loads((folder / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == "modeling_flowlm.FlowLMModel" and config["dit"]["causal"] is True
    torch.save(cases, tmp_path / "cases.pt")
    env = {
        **os.environ,
        "HF_MODULES_CACHE": str(tmp_path / "hf_modules"),  # transformers copies the remote code here
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": "",
    }
    done = subprocess.run(
        [sys.executable, "-c", LOADER, str(tmp_path / "cases.pt")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    worst = json.loads(done.stdout.strip().splitlines()[-1])  # {family: max |Δ|}
    assert set(worst) == {"mdm", "flow", "ar"}
    assert all(value <= 1e-5 for value in worst.values()), worst  # NaN fails too


def test_an_mlfm_or_llama_family_export_ships_no_transformers_files(tmp_path):
    """Their adapter / source layout is not the DiT's: no half-working AutoModel files (the suite still reads them)."""
    from flowlm.pretrained.export import transformers_files

    assert transformers_files("mlfm", BACKBONE, V) is None
    assert transformers_files("mdm", {"_target_": "flowlm.backbones.llama.BidirectionalLM"}, V) is None
    keys, _ = transformers_files("flow", BACKBONE, V)
    assert keys["dit"]["vocab_size"] == V and keys["dit"]["two_times"] is True
    keys, _ = transformers_files("mdm", BACKBONE, V)
    assert keys["dit"]["vocab_size"] == V + 1 and keys["dit"]["two_times"] is False
