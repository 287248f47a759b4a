"""The suite's portable checkpoint folder (docs/pretrained.md, Export): what ``flowlm-export`` writes and the suite
reads back by path (``init_from``, ``teacher``, ``flowlm-eval``).

A folder of ``config.json`` (the architecture, the method family, [MASK] id, vocabulary, the run's
hyper-parameters and ``flowlm`` record), ``model.safetensors`` (the checkpoint's ``state_dict``, the EMA weights
when an EMA ran, under the module's own names ``net.*``, dtypes as saved), ``README.md`` (a model card) and the
tokenizer's files when the run had a tokenizer. A DiT network of the MDM, flow or AR family also gets the
transformers files (``transformers_files``): ``AutoModel.from_pretrained(folder, trust_remote_code=True)`` loads it.
A LLaMA-family MDM is written in its source's own layout instead (``source_layout``: SMDM, LLaDA or Dream tensor names
and config keys, which the source's loader and transformers read), and read back into ``net.*`` names. FMLM+ on a
LLaMA-family MDM keeps ``net.*`` and gets its own transformers files (``llama_flow_files``); MLFM is a PEFT adapter
folder over its MDM's export (``mlfm_peft``).
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from torch import Tensor

import flowlm.backbones.dit as dit_module
from flowlm.pretrained import dream, llada, smdm
from flowlm.pretrained.files import check_state
from flowlm.pretrained.llama_family import decoder_config

MARK = "flowlm_export"  # config.json key holding the format version
VERSION = 1
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
CARD = "README.md"
PARTIAL = ".flowlm-export-partial"  # the folder an export is written into before it is moved into place
REMOTE = Path(__file__).with_name("hf_remote")  # the transformers configuration and model shipped in an export
# every shipped model refuses weights that are not the network its config.json describes (hf_remote/flowlm_loading.py)
LOADING = "flowlm_loading.py"
REMOTE_FILES = ("configuration_flowlm.py", "modeling_flowlm.py", LOADING)
AUTO_FAMILIES = ("mdm", "flow", "ar")  # DiT families FlowLMModel loads (MLFM: mlfm_peft; LLaMA family: source_layout)
LAYOUT_KEY = "weights_layout"  # config.json key naming the source layout model.safetensors is in (absent: net.*)


@dataclass(frozen=True)
class SourceLayout:
    """A LLaMA-family source's layout for a ``BidirectionalLM``: its config.json fields for a spec (None: the spec
    is not this layout), the loader's config read back from them, the tensor names both ways, its names' shapes, and
    how transformers loads it (config keys and the remote files shipped, none for a stock class)."""

    fields: Callable[[dict], dict | None]
    read: Callable[[dict], dict]
    to_source: Callable[[dict, dict], dict]
    to_backbone: Callable[[dict, dict], dict]
    expected: Callable[[dict], dict]
    transformers: dict
    remote: tuple[str, ...] = ()


SOURCE_LAYOUTS = {
    "smdm": SourceLayout(
        lambda spec: None if (lit := smdm.litgpt_fields(spec)) is None else {"litgpt_config": lit},
        lambda config: smdm.smdm_config(config["litgpt_config"]),
        smdm.from_backbone_state,
        smdm.to_backbone_state,
        smdm.expected_keys,
        {
            "model_type": "smdm",
            "architectures": ["SMDMForMaskedLM"],
            "auto_map": {
                "AutoConfig": "configuration_smdm.SMDMConfig",
                "AutoModel": "modeling_smdm.SMDMForMaskedLM",
                "AutoModelForCausalLM": "modeling_smdm.SMDMForMaskedLM",
            },
        },
        ("configuration_smdm.py", "modeling_smdm.py", LOADING),
    ),
    "llada": SourceLayout(
        llada.source_config,
        llada.llada_config,
        llada.from_backbone_state,
        llada.to_backbone_state,
        llada.expected_keys,
        {  # LLaDA's own auto_map: its released modeling_llada.py may replace the one shipped here
            "model_type": "llada",
            "architectures": ["LLaDAModelLM"],
            "auto_map": {
                "AutoConfig": "configuration_llada.LLaDAConfig",
                "AutoModel": "modeling_llada.LLaDAModelLM",
                "AutoModelForCausalLM": "modeling_llada.LLaDAModelLM",
            },
        },
        ("configuration_llada.py", "modeling_llada.py", LOADING),
    ),
    "dream": SourceLayout(  # Qwen2's names and keys: transformers' own Qwen2ForCausalLM, no remote code
        dream.source_config,
        dream.dream_config,
        dream.from_backbone_state,
        dream.to_backbone_state,
        dream.expected_keys,
        {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
    ),
}


def decoder_keys(spec: dict) -> dict:
    """transformers' Llama/Qwen2 config keys of a ``BidirectionalLM`` spec: the decoder run bidirectionally."""
    return {
        **decoder_config(spec),
        "rope_parameters": {"rope_type": "default", "rope_theta": spec["rope_theta"]},
        "is_causal": False,  # create_causal_mask → create_bidirectional_mask
        "use_cache": False,
        "pad_token_id": None,
        "bos_token_id": None,
        "eos_token_id": None,
    }


def source_layout(
    family: str | None, backbone: dict, state: dict[str, Tensor]
) -> tuple[dict[str, Tensor], dict, Callable[[Path], None]] | None:
    """(tensors under the source's names, config.json keys, a writer of the transformers files) of an MDM whose
    network is a ``BidirectionalLM`` in the SMDM, LLaDA or Dream layout (``state``: the module's ``net.*``); None for
    another family or backbone, or a state with tensors the layout has no name for."""
    if family != "mdm" or "_target_" not in backbone or any(not key.startswith("net.") for key in state):
        return None
    fitting = [(name, layout, layout.fields(backbone)) for name, layout in SOURCE_LAYOUTS.items()]
    fitting = [entry for entry in fitting if entry[2] is not None]
    if not fitting:
        return None
    name, layout, fields = fitting[0]
    cfg = layout.read(fields)
    plain = {key.removeprefix("net."): t for key, t in state.items()}
    tensors = layout.to_source(plain, cfg)
    if set(layout.to_backbone(tensors, cfg)) != set(plain) or not _holds(tensors, layout.expected(cfg)):
        return None
    keys = {**decoder_keys(backbone), **fields, **layout.transformers, LAYOUT_KEY: name}

    def write(folder: Path) -> None:
        for file in layout.remote:
            shutil.copyfile(REMOTE / file, folder / file)

    return tensors, keys, write


def transformers_files(
    family: str | None, backbone: dict, data_vocab_size: int, *, time_conditioning: bool = False
) -> tuple[dict, Callable[[Path], None]] | None:
    """(config.json keys, a writer of the files) that make an export of a DiT network loadable by transformers'
    ``AutoModel`` with ``trust_remote_code``: ``auto_map``, ``dit`` (the DiT's constructor arguments as the module
    built it: |V| + 1 input rows with [MASK] or [START], two times for a flow model, causal for AR) and the
    configuration, the model and the suite's DiT source (``flowlm_dit.py``, torch only) beside the weights. None for
    another backbone or family."""
    if "_target_" in backbone or family not in AUTO_FAMILIES:
        return None
    dit = {**backbone, "vocab_size": data_vocab_size + (family != "flow"), "two_times": family == "flow"}
    if family == "ar":
        dit["causal"] = True
    keys = {
        "architectures": ["FlowLMModel"],
        "auto_map": {"AutoConfig": "configuration_flowlm.FlowLMConfig", "AutoModel": "modeling_flowlm.FlowLMModel"},
        "dit": dit,
        "time_conditioning": time_conditioning,
    }

    def write(folder: Path) -> None:
        for name in REMOTE_FILES:
            shutil.copyfile(REMOTE / name, folder / name)
        shutil.copyfile(dit_module.__file__, folder / "flowlm_dit.py")

    return keys, write


LLAMA_FLOW_FILES = ("configuration_flowlm_llama.py", "modeling_flowlm_llama.py", "flowlm_adaln.py", LOADING)
LLAMA_FLOW_CLASSES = {"llama": "FlowLMLlamaFlowModel", "qwen2": "FlowLMQwen2FlowModel"}  # by the decoder's arch


def llama_flow_files(
    family: str | None, backbone: dict, state: dict[str, Tensor], *, lora_alpha: float
) -> tuple[dict, Callable[[Path], None]] | None:
    """(config.json keys, a writer of the files) that make an export of FMLM+ on a LLaMA-family MDM
    (``LlamaFlowNet``; ``state``: the module's ``net.*``) loadable by transformers' ``AutoModel`` with
    ``trust_remote_code``: the decoder's Llama/Qwen2 keys (bidirectional), ``flow`` (|V|, the time embeddings'
    widths read from their weights, Dream's shift, the LoRA factors' rank, ``lora_alpha`` and wrapped Linears when
    the base trained through LoRA), ``auto_map`` and ``modeling_flowlm_llama.py`` with what it imports. The weights
    keep the suite's names: the modeling file builds the same module tree. None for another family or backbone."""
    if family != "flow" or "_target_" not in backbone or any(not key.startswith("net.") for key in state):
        return None
    first = state.get("net.emb_s.mlp.0.weight")
    if first is None or "net.emb_t.mlp.0.weight" not in state:
        return None
    factors = sorted(key for key in state if ".lora_A." in key)
    lora = None
    if factors:  # net.base.<module>.lora_A.default.weight: (r, in)
        targets = [key.removeprefix("net.base.").partition(".lora_A.")[0] for key in factors]
        lora = {"r": int(state[factors[0]].shape[0]), "alpha": float(lora_alpha), "targets": targets}
    flow = {
        "head_rows": backbone["head_rows"],
        "cond_dim": int(first.shape[0]),
        "freq_dim": int(first.shape[1]),
        "shift_logits": bool(backbone.get("shift_logits")),
        "lora": lora,
    }
    arch = backbone.get("arch", "llama")
    cls, config_cls = LLAMA_FLOW_CLASSES[arch], f"FlowLM{'Qwen2' if arch == 'qwen2' else 'Llama'}Config"
    keys = {
        **decoder_keys(backbone),
        "model_type": f"flowlm-{arch}",
        "architectures": [cls],
        "auto_map": {
            "AutoConfig": f"configuration_flowlm_llama.{config_cls}",
            "AutoModel": f"modeling_flowlm_llama.{cls}",
        },
        "flow": flow,
    }

    def write(folder: Path) -> None:
        for name in LLAMA_FLOW_FILES:
            shutil.copyfile(REMOTE / name, folder / name)
        shutil.copyfile(dit_module.__file__, folder / "flowlm_dit.py")  # TimeEmbedding, PinnedCondition

    return keys, write


def _holds(tensors: dict[str, Tensor], expected: dict[str, tuple[int, ...]]) -> bool:
    """Whether ``tensors`` are exactly the names and shapes ``expected``."""
    return tensors.keys() == expected.keys() and all(tuple(t.shape) == expected[k] for k, t in tensors.items())


def is_export(path: Path) -> bool:
    """A folder written by ``write_export`` (its config.json carries ``flowlm_export``)."""
    config = path / CONFIG
    if not (path.is_dir() and config.is_file()):
        return False
    try:
        return MARK in json.loads(config.read_text())
    except (OSError, ValueError):
        return False


def check_target(folder: Path) -> None:
    """ValueError unless ``folder`` is new, or an empty folder but for the leftovers of an interrupted export; the
    message names what it holds (hidden files too)."""
    if not folder.exists():
        return
    if not folder.is_dir():
        raise ValueError(f"export folder {folder} is a file: give a new or empty folder")
    held = sorted(p.name for p in folder.iterdir() if not p.name.startswith(PARTIAL))
    if held:
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        raise ValueError(f"export folder {folder} is not empty ({shown}): give a new or empty folder")


def write_export(
    folder: Path, *, state: dict[str, Tensor], config: dict, card: str, files: Callable[[Path], None] | None = None
) -> None:
    """Write config.json (with the format mark), model.safetensors (contiguous copies of ``state``), README.md and
    what ``files`` writes into a folder it is given (the tokenizer's) into ``folder`` (created; empty but for the
    leftovers of an interrupted export, which are removed). ValueError for a config that is not JSON.

    Everything is written into a hidden ``.flowlm-export-partial-*`` folder inside ``folder`` and moved up when
    complete, config.json last: an interrupted export leaves no file that makes ``folder`` an export or non-empty.
    Every file gets the mode a new file gets here (safetensors writes 0600)."""
    from safetensors.torch import save_file

    try:
        text = json.dumps({MARK: VERSION, **config}, indent=2, sort_keys=False, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ValueError(f"the checkpoint's config is not JSON ({err}): it cannot be exported as is") from err
    check_target(folder)
    folder.mkdir(parents=True, exist_ok=True)
    for leftover in folder.glob(f"{PARTIAL}*"):
        if leftover.is_dir():
            shutil.rmtree(leftover)
        else:
            leftover.unlink()
    staging = folder / f"{PARTIAL}-{os.getpid()}"
    staging.mkdir()
    try:
        (staging / CARD).write_text(card)
        save_file({name: t.detach().cpu().contiguous() for name, t in state.items()}, str(staging / WEIGHTS))
        (staging / CONFIG).write_text(text + "\n")
        if files is not None:
            files(staging)
        mode = stat.S_IMODE((staging / CARD).stat().st_mode)
        for path in sorted(staging.iterdir(), key=lambda p: p.name == CONFIG):  # config.json last
            if path.is_file():
                path.chmod(mode)
            os.replace(path, folder / path.name)
        staging.rmdir()
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def read_export(folder: Path) -> tuple[dict, dict[str, Tensor]]:
    """(config, weights) of an export folder; ValueError for another format version or missing weights."""
    from safetensors.torch import load_file

    config = json.loads((folder / CONFIG).read_text())
    if config.get(MARK) != VERSION:
        raise ValueError(f"{folder} is a flowlm export of version {config.get(MARK)}, this suite reads {VERSION}")
    if not (folder / WEIGHTS).is_file():
        raise ValueError(f"{folder} is a flowlm export without its {WEIGHTS}")
    try:
        state = load_file(str(folder / WEIGHTS))
    except Exception as err:  # noqa: BLE001 - safetensors reports a cut file in several ways
        raise ValueError(
            f"{folder} is a corrupt flowlm export: its {WEIGHTS} is unreadable ({type(err).__name__}: {err}); a "
            "truncated copy: copy or export it again"
        ) from err
    if config.get(LAYOUT_KEY) == PEFT_LAYOUT:
        return config, mlfm_from_peft(folder, config, state)
    layout = SOURCE_LAYOUTS.get(config.get(LAYOUT_KEY))
    if config.get(LAYOUT_KEY) is not None and layout is None:
        raise ValueError(f"{folder}: unknown {LAYOUT_KEY} {config[LAYOUT_KEY]!r}; known: {sorted(SOURCE_LAYOUTS)}")
    if layout is None:
        return config, state
    cfg = layout.read(config)  # the source's config, as its loader reads it
    found = {key: tuple(t.shape) for key, t in state.items()}
    check_state(found, layout.expected(cfg), source=str(folder), config=f"{config[LAYOUT_KEY]} config.json")
    return config, {f"net.{key}": t for key, t in layout.to_backbone(state, cfg).items()}


# -------------------------------------------------------------------------------------------- MLFM as PEFT adapter
PEFT_LAYOUT = "mlfm-peft"  # LAYOUT_KEY of an MLFM export: model.safetensors holds the time adaLN only
BASE_DIR = "base"  # the frozen MDM, an export of its own (source layout or DiT transformers files)
MERGED_DIR = "merged"  # optional: base/ with the LoRA folded in, W + (α/r)·B A (the time adaLN stays beside)
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_HEAD = "base_model.model."  # PEFT's prefix of an adapter tensor name


def mlfm_peft(
    state: dict[str, Tensor], *, hparams: dict, base_record: dict, lora: dict, base_name: str, merge: bool = False
) -> tuple[dict[str, Tensor], dict, Callable[[Path], None]] | None:
    """An MLFM checkpoint (``state``: ``net.*``) as a PEFT adapter folder over its frozen MDM: (the time adaLN tensors,
    config.json keys, a writer of ``adapter_config.json``, ``adapter_model.safetensors`` (the LoRA factors under
    PEFT's names), the loader ``mlfm_peft.py`` with ``flowlm_dit.py`` and ``flowlm_adaln.py``, and ``base/``, the
    MDM's own export).

    PEFT carries the LoRA factors only: the time embedding and the per-layer adaLN modulation are not LoRA and act
    through hooks (LLaMA family) or the DiT's ``extra`` modulation, which ``mlfm_peft.load_mlfm`` attaches. ``lora``:
    LoraConfig's ``lora_alpha`` and ``lora_dropout``; ``base_record``: the MDM's flowlm record and hyper-parameters;
    ``base_name``: the named base (``base_model_name_or_path``); ``merge``: also ``merged/``, base/ with the LoRA
    folded in (``fold_lora``; ``load_mlfm(folder, merged=True)`` needs no peft). None when the base loads in no
    transformers class."""
    from peft import LoraConfig

    backbone = hparams["backbone"]
    base_state = {
        "net." + key.removeprefix("net.base.").replace(".base_layer", ""): t
        for key, t in state.items()
        if key.startswith("net.base.") and ".lora_" not in key
    }
    llama = "_target_" in backbone
    vocab = base_record["hyper_parameters"]["data_vocab_size"]

    def mdm_folder(plain: dict[str, Tensor]):  # (tensors, config keys, files) of an MDM export of these weights
        if llama:
            return source_layout("mdm", backbone, plain)
        files = transformers_files("mdm", backbone, vocab)
        return None if files is None else ({k: t.contiguous() for k, t in plain.items()}, *files)

    factors = {k: t for k, t in state.items() if ".lora_" in k}
    rank = next(t.shape[0] for k, t in factors.items() if ".lora_A." in k) if factors else 0
    merged = mdm_folder(fold_lora(base_state, factors, lora["lora_alpha"] / max(rank, 1))) if merge else None
    base_files = mdm_folder(base_state)
    if base_files is None or any(not key.startswith("net.") for key in state):
        return None
    base_state, base_keys, base_write = base_files
    prefix = "" if llama else "net."  # the network inside transformers' model (FlowLMModel.net for a DiT)
    adapter = {}
    for key, t in factors.items():  # net.base.<module>.lora_A.default.weight → base_model.model.<module>.lora_A.weight
        module, _, rest = key.removeprefix("net.base.").partition(".lora_")
        part, _, leaf = rest.partition(".default.")
        adapter[f"{PEFT_HEAD}{prefix}{module}.lora_{part}.{leaf}"] = t.contiguous()
    modules = sorted({key.removeprefix("net.base.").partition(".lora_")[0] for key in factors})
    time = {key.removeprefix("net."): t for key, t in state.items() if not key.startswith("net.base.")}
    info = {"prefix": prefix, "kind": "llama" if llama else "dit", "shift_logits": bool(backbone.get("shift_logits"))}
    info["auto_class"] = "AutoModelForCausalLM" if llama else "AutoModel"
    base_config = {**base_record, **base_keys, "mask_token_id": backbone.get("mask_id", vocab)}

    def write(folder: Path) -> None:
        config = LoraConfig(
            r=rank, target_modules=[prefix + m for m in modules], base_model_name_or_path=base_name, **lora
        )
        config.save_pretrained(str(folder))
        from safetensors.torch import save_file

        save_file(adapter, str(folder / ADAPTER_WEIGHTS))
        for name in ("mlfm_peft.py", "flowlm_adaln.py"):
            shutil.copyfile(REMOTE / name, folder / name)
        shutil.copyfile(dit_module.__file__, folder / "flowlm_dit.py")
        card = f"The frozen MDM under the MLFM adapter in `..` (named base: `{base_name}`).\n"
        write_export(folder / BASE_DIR, state=base_state, config=base_config, card=card, files=base_write)
        if merged is not None:
            card = f"`{BASE_DIR}/` with the MLFM adapter's LoRA folded in (W + (α/r)·B A); not an MDM on its own.\n"
            config = {**base_config, **merged[1], "mlfm_merged": True}
            write_export(folder / MERGED_DIR, state=merged[0], config=config, card=card, files=merged[2])

    return time, {LAYOUT_KEY: PEFT_LAYOUT, "mlfm_peft": {**info, "merged": merged is not None}}, write


def fold_lora(plain: dict[str, Tensor], factors: dict[str, Tensor], scaling: float) -> dict[str, Tensor]:
    """The MDM's ``net.<module>.weight`` + scaling · B A for each module with LoRA factors (``factors``: the MLFM
    state's ``net.base.<module>.lora_{A,B}.default.weight``), computed in float32, stored in the weight's dtype."""
    out = dict(plain)
    for key, a in factors.items():
        if ".lora_A." not in key:
            continue
        module = key.removeprefix("net.base.").partition(".lora_")[0]
        b, weight = factors[key.replace(".lora_A.", ".lora_B.")], plain[f"net.{module}.weight"]
        out[f"net.{module}.weight"] = (weight.float() + scaling * (b.float() @ a.float())).to(weight.dtype)
    return out


def mlfm_from_peft(folder: Path, config: dict, time: dict[str, Tensor]) -> dict[str, Tensor]:
    """An MLFM export's ``net.*`` state from its parts: ``base/`` (the MDM), the PEFT adapter's LoRA factors (a
    wrapped Linear's weight moves to ``<module>.base_layer``) and the time adaLN (``time``)."""
    from safetensors.torch import load_file

    _, base = read_export(folder / BASE_DIR)
    head = PEFT_HEAD + config["mlfm_peft"]["prefix"]
    adapter = load_file(str(folder / ADAPTER_WEIGHTS))
    stray = [key for key in adapter if not key.startswith(head) or ".lora_" not in key]
    if stray:
        raise ValueError(f"{folder / ADAPTER_WEIGHTS} holds tensors that are no LoRA factor under {head!r}: {stray}")
    out = {f"net.{key}": t for key, t in time.items()}
    modules = set()
    for key, t in adapter.items():
        module, _, rest = key.removeprefix(head).partition(".lora_")
        part, _, leaf = rest.partition(".")
        out[f"net.base.{module}.lora_{part}.default.{leaf}"] = t
        modules.add(module)
    for key, t in base.items():
        module, _, leaf = key.removeprefix("net.").rpartition(".")
        out["net.base." + (f"{module}.base_layer.{leaf}" if module in modules else f"{module}.{leaf}")] = t
    return out
