"""An export loads with transformers alone, in a process where the suite cannot be imported, with the suite's logits:
``AutoModel.from_pretrained(folder, trust_remote_code=True)`` for each DiT family (MDM, FMLM+, AR),
``AutoModelForCausalLM`` for a LLaMA-family MDM in its source's layout (SMDM, LLaDA, Dream), and PEFT with the
shipped loader for MLFM's adapter (on the DiT and on each LLaMA-family layout)."""

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

# Run in a fresh interpreter: every package of the suite is blocked, so only torch, transformers (peft) and the files
# in the export folder can serve the load.
BLOCK_SUITE = textwrap.dedent(
    """
    import sys
    for name in ("flowlm", "lightning_modules", "runners", "callbacks", "datamodules", "analysis", "sweeps"):
        sys.modules[name] = None  # `import flowlm` now raises ImportError
    """
)
LOADER = BLOCK_SUITE + textwrap.dedent(
    """
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


def run_without_suite(script: str, cases: dict, tmp_path) -> dict:
    """Run ``script`` (which starts with ``BLOCK_SUITE``) on ``cases`` (saved for it as its argv[1]) in a fresh
    interpreter outside the checkout; its last stdout line, parsed as JSON."""
    torch.save(cases, tmp_path / "cases.pt")
    env = {
        **os.environ,
        "HF_MODULES_CACHE": str(tmp_path / "hf_modules"),  # transformers copies the remote code here
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": "",
    }
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "cases.pt")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _trained(module_class: type, tmp_path, name: str, merge_mlfm: bool = False, **options):
    path = tmp_path / name
    path.mkdir()
    module = write_run_checkpoint(path / "last.ckpt", module_class=module_class, seed=3, **options).eval()
    return module, export(path / "last.ckpt", path / "export", merge_mlfm=merge_mlfm)


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
    worst = run_without_suite(LOADER, cases, tmp_path)  # {family: max |Δ|}
    assert set(worst) == {"mdm", "flow", "ar"}
    assert all(value <= 1e-5 for value in worst.values()), worst  # NaN fails too


# transformers' causal-LM auto class on each LLaMA-family layout: Qwen2 itself (Dream), the shipped Llama subclass
# (LLaDA, SMDM; the source's names read through a registered renaming). Dream's logits are shifted by its convention.
LLAMA_LOADER = BLOCK_SUITE + textwrap.dedent(
    """
    import json

    import torch
    from transformers import AutoModelForCausalLM

    cases = torch.load(sys.argv[1], weights_only=True)
    worst = {}
    for layout, case in cases.items():
        model = AutoModelForCausalLM.from_pretrained(case["folder"], trust_remote_code=True).eval()
        assert type(model).__name__ == case["cls"], (type(model).__name__, case["cls"])
        assert model.config.is_causal is False
        with torch.no_grad():
            logits = model(case["x"]).logits
        if model.config.weights_layout == "dream":  # prediction for position i = output at i - 1
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        assert logits.shape == case["logits"].shape, (layout, logits.shape)
        worst[layout] = (logits - case["logits"]).abs().max().item()
    print(json.dumps(worst))
    """
)


def test_transformers_alone_loads_each_llama_family_layout_with_the_suites_logits(tmp_path):
    """An MDM on SMDM's, LLaDA's and Dream's layout exports in that layout; transformers' AutoModelForCausalLM loads
    it (Qwen2 for Dream, the shipped bidirectional Llama subclass for the others) with the suite's logits."""
    from tests.pretrained.test_fmlm_plus_llama import tiny_llama

    classes = {"smdm": "SMDMForMaskedLM", "llada": "LLaDAModelLM", "dream": "Qwen2ForCausalLM"}
    gen = torch.Generator().manual_seed(0)
    cases = {}
    for layout, cls in classes.items():
        mdm, folder = _trained(MDMModule, tmp_path, layout, backbone=tiny_llama(layout, V))
        x = torch.randint(0, mdm.net.spec["embed_rows"], (3, L), generator=gen)  # every input id, [MASK] too
        with torch.no_grad():
            cases[layout] = {"folder": str(folder), "cls": cls, "x": x, "logits": mdm.net(x)}
    worst = run_without_suite(LLAMA_LOADER, cases, tmp_path)
    assert set(worst) == set(classes)
    assert all(value <= 1e-5 for value in worst.values()), worst  # NaN fails too


def test_an_mlfm_or_llama_family_export_ships_no_dit_transformers_files(tmp_path):
    """Their adapter / source layout is not the DiT's: no half-working FlowLMModel files; and the LLaMA-family
    FMLM+ files are for that network only."""
    from flowlm.pretrained.export import llama_flow_files, transformers_files
    from tests.pretrained.test_fmlm_plus_llama import tiny_llama

    assert transformers_files("mlfm", BACKBONE, V) is None
    assert transformers_files("mdm", {"_target_": "flowlm.backbones.llama.BidirectionalLM"}, V) is None
    sizes = {"data_vocab_size": V, "seq_len": L, "optim": {}}
    flow = FMLMPlusModule(backbone=tiny_llama("llada", V), **sizes)
    llama, flow_state = {**tiny_llama("llada", V), **flow.net.spec}, flow.state_dict()  # the recorded backbone
    assert llama_flow_files("flow", llama, flow_state, lora_alpha=16.0) is not None
    assert llama_flow_files("mdm", llama, flow_state, lora_alpha=16.0) is None  # only the flow family
    dit_flow = FMLMPlusModule(backbone=BACKBONE, **sizes).state_dict()  # FlowLMModel's, not these files
    assert "net.emb_t.mlp.0.weight" in dit_flow and llama_flow_files("flow", BACKBONE, dit_flow, lora_alpha=1) is None
    keys, _ = transformers_files("flow", BACKBONE, V)
    assert keys["dit"]["vocab_size"] == V and keys["dit"]["two_times"] is True
    keys, _ = transformers_files("mdm", BACKBONE, V)
    assert keys["dit"]["vocab_size"] == V + 1 and keys["dit"]["two_times"] is False


# PEFT over each MLFM export's base/; the shipped loader (mlfm_peft.py, from the folder) attaches the time adaLN.
MLFM_LOADER = BLOCK_SUITE + textwrap.dedent(
    """
    import importlib.util
    import json

    import torch
    from peft import PeftModel

    cases = torch.load(sys.argv[1], weights_only=True)
    worst = {}
    for kind, case in cases.items():
        spec = importlib.util.spec_from_file_location(f"mlfm_peft_{kind}", case["folder"] + "/mlfm_peft.py")
        loader = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loader)
        mlfm, merged = loader.load_mlfm(case["folder"]), loader.load_mlfm(case["folder"], merged=True)
        assert isinstance(mlfm.model, PeftModel) and mlfm.model.peft_config["default"].r == 8
        assert not isinstance(merged.model, PeftModel)
        with torch.no_grad():
            logits = {"peft": mlfm(case["z"], case["t"]), "merged": merged(case["z"], case["t"])}
        assert all(v.shape == case["logits"].shape for v in logits.values()), kind
        for way, value in logits.items():
            worst[f"{kind}/{way}"] = (value - case["logits"]).abs().max().item()
        worst[f"{kind}/scale"] = case["logits"].abs().max().item()  # the largest logit, for the merged weights
    print(json.dumps(worst))
    """
)


def test_peft_loads_the_mlfm_adapter_over_its_base_with_the_suites_logits(tmp_path):
    """An MLFM on the DiT and on each LLaMA-family layout exports as a PEFT adapter over base/ (the MDM's own
    export); PEFT + the shipped time adaLN reproduce the suite's logits, and so do the merged weights (merged/, the
    LoRA folded in, no peft); the suite reads base/ as the MDM."""
    from lightning_modules.checkpoints import load_module
    from lightning_modules.mlfm import MLFMModule
    from tests.pretrained.test_export import BACKBONE
    from tests.pretrained.test_fmlm_plus_llama import tiny_llama

    backbones = {"dit": BACKBONE, **{layout: tiny_llama(layout, V) for layout in ("smdm", "llada", "dream")}}
    gen = torch.Generator().manual_seed(0)
    cases = {}
    for kind, backbone in backbones.items():
        options = {"init_from": "mdm.ckpt"} if kind == "dit" else {}  # the DiT's MDM: not read by the export
        mlfm, folder = _trained(MLFMModule, tmp_path, kind, merge_mlfm=True, backbone=backbone, options=options)
        z, t = torch.randn(3, L, mlfm.net.base.d_model, generator=gen), torch.rand(3, generator=gen)
        with torch.no_grad():
            cases[kind] = {"folder": str(folder), "z": z, "t": t, "logits": mlfm.net(z, t, torch.zeros(3))}
        base = load_module(folder / "base").net.state_dict()
        plain = {k.replace(".base_layer", ""): v for k, v in mlfm.net.base.state_dict().items() if ".lora_" not in k}
        assert base.keys() == plain.keys() and all(torch.equal(base[k], v) for k, v in plain.items())
    worst = run_without_suite(MLFM_LOADER, cases, tmp_path)
    assert set(worst) == {f"{kind}/{way}" for kind in backbones for way in ("peft", "merged", "scale")}
    assert all(worst[f"{kind}/peft"] <= 1e-5 for kind in backbones), worst  # NaN fails too
    # folded weights round differently (W + (α/r)·B A against W x + (α/r)·B(A x)): relative to the largest logit
    assert all(worst[f"{kind}/merged"] <= 1e-4 * max(1.0, worst[f"{kind}/scale"]) for kind in backbones), worst


# FMLM+ on each LLaMA-family layout: AutoModel (the shipped FlowLMLlamaFlowModel / FlowLMQwen2FlowModel) at the
# suite's logits and log δ, per-token times, per-sequence times with a pinned set, and ids.
LLAMA_FLOW_LOADER = BLOCK_SUITE + textwrap.dedent(
    """
    import json

    import torch
    from transformers import AutoModel

    cases = torch.load(sys.argv[1], weights_only=True)
    worst = {}
    for kind, case in cases.items():
        model = AutoModel.from_pretrained(case["folder"], trust_remote_code=True).eval()
        assert type(model).__name__ == case["cls"] and model.config.is_causal is False, type(model).__name__
        with torch.no_grad():
            got = {
                "logits": model(x=case["x"], s=case["s"], t=case["t"]).logits,
                "log_delta": model.log_delta(case["x"], case["s"], case["t"]),
                "pinned_logits": model(x=case["x"], s=case["s1"], t=case["t1"], pinned=case["pinned"]).logits,
                "id_logits": model(case["ids"], s=case["s"], t=case["t"]).logits,
            }
        assert all(got[k].shape == case[k].shape for k in got), kind
        diffs = [(got[k] - case[k]).abs().max().item() for k in got]
        worst[kind] = float("nan") if any(d != d for d in diffs) else max(diffs)  # a NaN anywhere fails
    print(json.dumps(worst))
    """
)
LLAMA_FLOW_CLASSES = {"smdm": "FlowLMLlamaFlowModel", "llada": "FlowLMLlamaFlowModel", "dream": "FlowLMQwen2FlowModel"}


def test_transformers_alone_loads_fmlm_plus_on_each_llama_family_layout_with_the_suites_logits(tmp_path):
    """FMLM+ on SMDM's, LLaDA's and Dream's layout (non-zero adaLN, so the times matter), and on LLaDA's with the
    decoder trained through LoRA: AutoModel loads the export with the suite's logits and log δ ([MASK] inside |V| at
    −∞) at per-token times, at per-sequence times with a pinned set and on ids; the suite reads it back bit for bit."""
    from lightning_modules.checkpoints import load_module
    from tests.pretrained.test_fmlm_plus_llama import tiny_llama

    lora = {"cond_dim": 16, "train": ["time_adaln", "lora"], "lora_rank": 4, "lora_alpha": 8.0}
    runs = {layout: (layout, {"cond_dim": 16}) for layout in LLAMA_FLOW_CLASSES} | {"llada_lora": ("llada", lora)}
    gen = torch.Generator().manual_seed(0)
    cases = {}
    for kind, (layout, adapter) in runs.items():
        flow, folder = _trained(
            FMLMPlusModule, tmp_path, kind, backbone=tiny_llama(layout, V), options={"adapter": adapter}
        )
        x = torch.softmax(3 * torch.randn(3, L, V, generator=gen), -1)  # points of the simplex
        s, t = torch.rand(3, L, generator=gen) * 0.5, 0.5 + torch.rand(3, L, generator=gen) * 0.5
        s1, t1 = torch.rand(3, generator=gen) * 0.5, 0.5 + torch.rand(3, generator=gen) * 0.5
        pinned, ids = torch.rand(3, L, generator=gen) < 0.3, torch.randint(0, V, (3, L), generator=gen)
        with torch.no_grad():
            cases[kind] = {
                "folder": str(folder),
                "cls": LLAMA_FLOW_CLASSES[layout],
                **{"x": x, "s": s, "t": t, "s1": s1, "t1": t1, "pinned": pinned, "ids": ids},
                "logits": flow.net(x, s, t),
                "log_delta": flow(x, s, t),
                "pinned_logits": flow.net(x, s1, t1, pinned=pinned),
                "id_logits": flow.net(ids, s, t),
            }
        config = json.loads((folder / "config.json").read_text())
        assert config["model_type"] == f"flowlm-{flow.net.spec['arch']}" and config["is_causal"] is False
        assert (config["flow"]["lora"] is None) == (kind != "llada_lora"), config["flow"]
        assert "`modeling_flowlm_llama.py`" in (folder / "README.md").read_text()
        again = load_module(folder).state_dict()
        assert again.keys() == flow.state_dict().keys()
        assert all(torch.equal(again[k], v) for k, v in flow.state_dict().items())
    worst = run_without_suite(LLAMA_FLOW_LOADER, cases, tmp_path)  # {kind: max |Δ|}
    assert set(worst) == set(runs)
    assert all(value <= 1e-5 for value in worst.values()), worst  # NaN fails too


# Each case's folder with config.json edited (``key``: the path to the edited value), loaded by transformers alone;
# the message each load raised ("loaded" when none).
EDITED_LOADER = BLOCK_SUITE + textwrap.dedent(
    """
    import json
    from pathlib import Path

    import torch
    import transformers

    cases = torch.load(sys.argv[1], weights_only=True)
    said = {}
    for name, case in cases.items():
        path = Path(case["folder"]) / "config.json"
        config = json.loads(path.read_text())
        node = config
        for key in case["key"][:-1]:
            node = node[key]
        node[case["key"][-1]] = case["value"]
        path.write_text(json.dumps(config))
        try:
            getattr(transformers, case["auto"]).from_pretrained(case["folder"], trust_remote_code=True)
            said[name] = "loaded"
        except ValueError as err:
            said[name] = str(err)
    print(json.dumps(said))
    """
)


def test_the_shipped_code_refuses_an_export_whose_config_json_disagrees_with_its_weights(tmp_path):
    """config.json edited to more layers (transformers initialised the missing ones at random: noise logits), fewer
    (the extra weights dropped) or another width (a RuntimeError under a table): the model shipped in the folder
    refuses it, naming the tensors, for the DiT's model and each shipped LLaMA-family one."""
    import shutil

    from tests.pretrained.test_fmlm_plus_llama import tiny_llama

    _, dit = _trained(MDMModule, tmp_path, "dit")
    _, smdm = _trained(MDMModule, tmp_path, "smdm", backbone=tiny_llama("smdm", V))
    _, llada = _trained(MDMModule, tmp_path, "llada", backbone=tiny_llama("llada", V))
    _, flow = _trained(FMLMPlusModule, tmp_path, "flow", backbone=tiny_llama("llada", V), options={"adapter": {}})
    layers = BACKBONE["n_layers"]
    edits = {
        "dit_more_layers": (dit, "AutoModel", ["dit", "n_layers"], layers + 2),
        "dit_fewer_layers": (dit, "AutoModel", ["dit", "n_layers"], layers - 1),
        "dit_wider": (dit, "AutoModel", ["dit", "d_model"], 2 * BACKBONE["d_model"]),
        "smdm_more_layers": (smdm, "AutoModelForCausalLM", ["num_hidden_layers"], 3),
        "llada_more_layers": (llada, "AutoModelForCausalLM", ["num_hidden_layers"], 3),
        "fmlm_plus_more_layers": (flow, "AutoModel", ["num_hidden_layers"], 3),
    }
    cases = {}
    for name, (folder, auto, key, value) in edits.items():
        shutil.copytree(folder, tmp_path / name)
        cases[name] = {"folder": str(tmp_path / name), "auto": auto, "key": key, "value": value}
    said = run_without_suite(EDITED_LOADER, cases, tmp_path)
    for name, message in said.items():
        assert "its config.json does not describe the weights beside it" in message, (name, message)
        assert "restore the config.json that flowlm-export wrote" in message and "\n" not in message, message
    assert "tensor(s) of that network are not in the weights (net.blocks.2." in said["dit_more_layers"]
    assert "tensor(s) of the weights have no place in it (net.blocks.1." in said["dit_fewer_layers"]
    assert "tensor(s) of another shape (net." in said["dit_wider"]
    assert "model.layers.2." in said["smdm_more_layers"] and "model.layers.2." in said["llada_more_layers"]
