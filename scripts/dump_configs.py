"""Dump every config the suite composes, resolved, one sorted JSON per combination: the equivalence check of a
refactor of conf/ (compose before, compose after, diff).

    python scripts/dump_configs.py dump /tmp/configs_before            # on the unchanged tree
    ... edit conf/ ...
    python scripts/dump_configs.py dump /tmp/configs_after
    python scripts/dump_configs.py diff /tmp/configs_before /tmp/configs_after

The combinations, each composed with Hydra's compose API as the console scripts compose them (the resolvers of
runners/resolvers.py and the ``data=from_checkpoint`` node of runners/common.py registered first):

- ``flowlm-train`` (conf/train.yaml): every experiment of conf/experiment/ at the default scale and at every
  scale of conf/scale/*.yaml (an experiment's per-task scale files, ``/scale/<task>@_here_: ${scale}``, follow
  that choice); the bare config and every method at each scale; every hparams_search on the experiments it is
  run with (``hparams_search=sudoku_tables``: each experiment of its sweep, as scripts/tables_campaign.sh runs it);
  ``debug=fast`` / ``debug=short``;
- ``flowlm-eval`` (conf/eval.yaml): every file of conf/eval/ and each sampling-only hparams_search;
- conf/demo.yaml, conf/report.yaml, conf/report_sudoku.yaml.

Each file holds ``config`` (the config, resolved) and ``hydra`` (the parts of the Hydra node a run depends on: the
group choices, run/sweep folders, sweeper, launcher, callbacks, job). Interpolations that need a runtime value are
left as written: ``${now:...}`` (the time) and ``${flowlm.cpu_precision:}`` and the other
resolvers of the machine (its CPU, whether it has a GPU), as is anything else
that does not resolve outside a run (``???`` stays ``???``). Environment variables the configs read (FLOWLM_RUNS,
FLOWLM_DATA, FLOWLM_RESULTS, MLFLOW_TRACKING_URI) are unset, so their defaults are dumped.

Besides ``<name>.json`` (keys sorted), ``ordered/<name>.json`` keeps the composed key order (the order of
``eval.samplers`` is the order of the evaluation table): ``diff`` compares both.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = ("now", "flowlm.cpu_precision", "flowlm.accelerator_precision", "flowlm.auto_accelerator")
RUNTIME += ("flowlm.autocast_dtype",)  # resolvers whose value depends on when or where a run starts
ENV = ("FLOWLM_RUNS", "FLOWLM_DATA", "FLOWLM_RESULTS", "MLFLOW_TRACKING_URI")
HYDRA_KEYS = ("run", "sweep", "sweeper", "launcher", "callbacks", "mode", "searchpath", "output_subdir")
JOB_KEYS = ("name", "chdir", "override_dirname", "config_name")
CKPT = "/ckpt/run/checkpoints/last.ckpt"  # flowlm-eval's ckpt_path (a sweep names its study by its hash)


def stems(folder: Path) -> list[str]:
    return sorted(p.stem for p in folder.glob("*.yaml"))


def sweep_experiments(conf: Path, search: str) -> list[str]:
    """The experiments an hparams_search file sweeps over (its ``hydra.sweeper.params.experiment``), in order."""
    from omegaconf import OmegaConf

    node = OmegaConf.load(conf / "hparams_search" / f"{search}.yaml")
    listed = OmegaConf.select(node, "hydra.sweeper.params.experiment", default=None)
    return [e.strip() for e in str(listed).split(",") if e.strip()] if listed else []


def combinations(conf: Path) -> dict[str, tuple[str, list[str]]]:
    """name → (config name, overrides), for every combination the module docstring lists."""
    out: dict[str, tuple[str, list[str]]] = {}
    scales = stems(conf / "scale")
    experiments = stems(conf / "experiment")

    def add(config: str, overrides: list[str]) -> None:
        name = "__".join([config, *overrides]) if overrides else config
        out[name.replace("/", "_")] = (config, overrides)

    for experiment in experiments:
        add("train", [f"experiment={experiment}"])
        for scale in scales:
            add("train", [f"experiment={experiment}", f"scale={scale}"])
    for scale in [None, *scales]:
        at = [f"scale={scale}"] if scale else []
        add("train", at)
        for method in stems(conf / "method"):
            add("train", [f"method={method}", *at])
    searches = stems(conf / "hparams_search")
    for search in searches:
        listed = sweep_experiments(conf, search)
        if listed:  # the sweep's own jobs, each as the sweeper launches it (its params: scale, seed)
            for experiment in listed:
                add("train", [f"hparams_search={search}", f"experiment={experiment}", "scale=cpu", "seed=0"])
        elif search not in ("mlfm_optuna", "pr_optuna"):  # a training sweep: on an experiment of its docstring
            add("train", [f"hparams_search={search}", "experiment=sudoku_fmlm_plus_scratch_medium", "scale=cpu"])
    for experiment, debug in [("sudoku_mdm_uncond", "fast"), ("sudoku_fmlm_plus_init_easy", "fast")]:
        add("train", [f"experiment={experiment}", "scale=cpu", f"debug={debug}"])
    for experiment in ("owt_mdm", "tinygsm_fmlm_plus_init", "gsm8k_mlfm"):
        add("train", [f"experiment={experiment}", "scale=cpu", "debug=short"])
    add("eval", [f"ckpt_path={CKPT}"])
    for group in stems(conf / "eval"):
        add("eval", [f"ckpt_path={CKPT}", f"eval={group}"])
    for search in ("mlfm_optuna", "pr_optuna", "grid_nfe_seed", "optuna"):
        if search in searches:
            add("eval", [f"ckpt_path={CKPT}", f"hparams_search={search}"])
    for config in ("demo", "report", "report_sudoku"):
        if (conf / f"{config}.yaml").exists():
            add(config, [])
    return out


def resolved(node):
    """``node`` as plain containers, every interpolation resolved that can be; the rest left as written."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(node, DictConfig):
        keys = list(node.keys())
    elif isinstance(node, ListConfig):
        keys = range(len(node))
    else:
        return node
    if node._is_none():
        return None
    out = {} if isinstance(node, DictConfig) else []
    for key in keys:
        child = node._get_node(key)
        if OmegaConf.is_missing(node, key) and not OmegaConf.is_interpolation(node, key):
            value = "???"
        else:
            try:
                value = resolved(node[key])
            except Exception:  # a runtime value (RUNTIME), or one that only resolves inside a run
                value = child._value() if not isinstance(child, DictConfig | ListConfig) else str(child._value())
        if isinstance(out, dict):
            out[str(key)] = value
        else:
            out.append(value)
    return out


def hydra_parts(hydra) -> dict:
    from omegaconf import OmegaConf

    parts = {key: resolved(hydra[key]) if key in hydra else None for key in HYDRA_KEYS}
    parts["job"] = {key: resolved(hydra.job)[key] for key in JOB_KEYS if key in hydra.job}
    parts["choices"] = OmegaConf.to_container(hydra.runtime.choices)
    parts["overrides"] = OmegaConf.to_container(hydra.overrides.task)
    return parts


def dump(conf: Path, out: Path, only: str | None) -> int:
    for var in ENV:
        os.environ.pop(var, None)
    sys.path.insert(0, str(ROOT))
    from hydra import compose, initialize_config_dir
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    import runners.common  # noqa: F401  (the resolvers and conf/eval.yaml's data=from_checkpoint node)

    def runtime(name):
        return lambda *args: "${" + name + ":" + ",".join(str(a) for a in args) + "}"

    combos = combinations(conf)
    (out / "ordered").mkdir(parents=True, exist_ok=True)
    failed = 0
    with initialize_config_dir(config_dir=str(conf.resolve()), version_base="1.3"):
        for resolver in RUNTIME:  # after initialize: Hydra registers `now` on import
            OmegaConf.register_new_resolver(resolver, runtime(resolver), replace=True)
        for name, (config, overrides) in combos.items():
            if only and only not in name:
                continue
            try:
                cfg = compose(config_name=config, overrides=overrides, return_hydra_config=True)
                HydraConfig.instance().set_config(cfg)  # ${hydra:...} interpolations
                hydra = hydra_parts(cfg.hydra)
                with_hydra = OmegaConf.to_container(cfg)  # unresolved, to drop the hydra node without resolving
                with_hydra.pop("hydra")
                plain = OmegaConf.create(with_hydra)
                record = {"combination": {"config": config, "overrides": overrides}, "config": resolved(plain)}
                record["hydra"] = hydra
            except Exception as err:  # a combination that does not compose is a result too
                record = {"combination": {"config": config, "overrides": overrides}, "error": repr(err)}
                failed += 1
            (out / f"{name}.json").write_text(json.dumps(record, indent=1, sort_keys=True, default=str) + "\n")
            (out / "ordered" / f"{name}.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"{len(combos)} combinations → {out} ({failed} failed to compose)")
    return 0


def leaves(value, prefix: str = "") -> dict[str, object]:
    """Flat ``a.b.0.c`` → value of a JSON record (an empty container is a leaf)."""
    if isinstance(value, dict) and value:
        return {k: v for key, item in value.items() for k, v in leaves(item, f"{prefix}{key}.").items()}
    if isinstance(value, list) and value:
        return {k: v for i, item in enumerate(value) for k, v in leaves(item, f"{prefix}{i}.").items()}
    return {prefix.rstrip("."): value}


def diff(before: Path, after: Path, verbose: bool) -> int:
    names_b = {p.name for p in before.glob("*.json")}
    names_a = {p.name for p in after.glob("*.json")}
    changed = 0
    for name in sorted(names_b - names_a):
        print(f"only before: {name}")
    for name in sorted(names_a - names_b):
        print(f"only after:  {name}")
    for name in sorted(names_b & names_a):
        b, a = json.loads((before / name).read_text()), json.loads((after / name).read_text())
        lb, la = leaves(b), leaves(a)
        if a != b:
            changed += 1
            print(f"{name}:")
            for key in sorted(lb.keys() | la.keys()):
                if lb.get(key, "<absent>") != la.get(key, "<absent>"):
                    print(f"    {key}: {lb.get(key, '<absent>')!r} → {la.get(key, '<absent>')!r}")
        ordered_b, ordered_a = (d / "ordered" / name for d in (before, after))
        if not (ordered_b.exists() and ordered_a.exists()):
            continue
        # The composed key order of the keys both hold (an added or removed key aside).
        order_b, order_a = (list(leaves(json.loads(o.read_text()))) for o in (ordered_b, ordered_a))
        common = lb.keys() & la.keys()
        if [k for k in order_b if k in common] != [k for k in order_a if k in common]:
            changed += a == b
            print(f"{name}: another key order")
            if verbose:
                lines = difflib.unified_diff(order_b, order_a, lineterm="", n=1)
                print("\n".join(f"    {line}" for line in lines))
    total = len(names_b | names_a)
    print(f"{total} combinations, {changed} differ, {len(names_b ^ names_a)} in one dump only")
    return 1 if changed or names_b ^ names_a else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("dump", help="compose and write every combination")
    p.add_argument("out", type=Path, help="output folder (outside the repository)")
    p.add_argument("--conf", type=Path, default=ROOT / "conf", help="the config folder (default: conf/)")
    p.add_argument("--only", help="only combinations whose name contains this")
    p = sub.add_parser("diff", help="compare two dumps key by key")
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("-v", "--verbose", action="store_true", help="show key-order differences line by line")
    args = parser.parse_args()
    if args.command == "dump":
        return dump(args.conf, args.out, args.only)
    return diff(args.before, args.after, args.verbose)


if __name__ == "__main__":
    sys.exit(main())
