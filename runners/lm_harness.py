"""The suite's checkpoints as an lm-evaluation-harness model, ``flowlm`` (docs/evaluation.md).

    python -m runners.lm_harness --model flowlm --model_args checkpoint=PATH,sampler=confidence,nfe=64 --tasks T

lm-eval 0.4.13 knows a model only once its module is imported (it has no plugin entry points): importing this module
registers ``flowlm``, and ``python -m runners.lm_harness`` (``main``, ``flowlm-lm-eval``) is lm-eval's own command line
after that import, each evaluation tracked in MLflow (``tracking_config``, ``log_results``). From Python:
``runners.lm_harness.evaluate(model="flowlm", model_args=..., tasks=...)`` (tracked), or ``import runners.lm_harness``
then ``lm_eval.simple_evaluate`` (untracked).

- ``generate_until``: the checkpoint's family's sampler (a ``conf/sampler`` config) at an NFE budget; the NFE each
  request spent is kept, their mean reported (``get_model_info``: ``results["config"]["flowlm"]``, and logged); with
  ``--apply_chat_template``, prompts in the tokenizer's chat template where it has one, else Vicuna's.
- ``loglikelihood`` / ``loglikelihood_rolling``: an MDM's Monte-Carlo ELBO, an AR model's exact chain rule
  (flowlm/metrics/likelihood.py); flow-map and MLFM checkpoints define no likelihood and refuse them.

Rows have the checkpoint's layout (datamodules/gsm8k.py, datamodules/text.py): ``[BOS] context`` pinned, then the
positions the model fills, ``max_length`` positions in all.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import inspect
import json
import logging
import math
import re
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window, simple_parse_args_string
from omegaconf import DictConfig, OmegaConf
from torch import Tensor
from tqdm import tqdm

from datamodules.sources import load_tokenizer
from flowlm.metrics.likelihood import (
    ESTIMATORS,
    GREEDY_CHECKS,
    ROW_LAYOUTS,
    causal_log_likelihood,
    check_estimator,
    mdm_elbo_estimate,
    mdm_greedy,
    mdm_greedy_iterative,
    row_layout,
)
from flowlm.metrics.mt_bench import chat_renderer, template_kind
from flowlm.options import as_bool, as_int
from flowlm.project import CONF_DIR
from lightning_modules.checkpoints import import_class, load_module, read_checkpoint_meta
from lightning_modules.vocabulary import check_data_tokens
from runners.common import build, use_tf32
from runners.console import SUITE_PACKAGES, console_script
from runners.mlflow_run import tracked_run
from runners.outputs import check_writable

log = logging.getLogger(__name__)

MODEL_NAME = "flowlm"
MODEL_RUN_PREFIX = "lm_eval"  # MLflow: runs lm_eval/<run>/<time>, metrics, params and artifacts lm_eval/...
# The model's settings (FlowLM.summary) and simple_evaluate's arguments an evaluation's MLflow run records as params.
RUN_PARAMS = (
    *("checkpoint", "family", "nfe_budget", "gen_length", "max_length", "estimator", "mc_samples"),
    *("chat_template", "tokenizer", "dtype"),
)
EVALUATE_PARAMS = ("apply_chat_template", "fewshot_as_multiturn", "system_instruction", "gen_kwargs")
SAMPLER_DIR = Path(CONF_DIR) / "sampler"
# The sampler a family generates with when model_args give none (the configs its evaluations use first).
DEFAULT_SAMPLERS = {"mdm": "confidence", "flow": "pr", "mlfm": "mlfm", "ar": "ar"}
# Families that score text: an MDM by its ELBO, AR exactly; the others say why not.
NO_LIKELIHOOD = {
    "flow": "a flow-map model (FMLM, FMLM+, FLM) maps noise to text and defines no likelihood of a text",
    "mlfm": "an MLFM (masked language flow model) maps a bridge to text and defines no likelihood of a text",
}
DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAMPLER_PREFIX = "sampler."
VICUNA_LAYOUT = "vicuna_v1.1: {system} USER: {user} ASSISTANT: {assistant}{eos}USER: ... ASSISTANT:"


def sampler_names() -> list[str]:
    """The sampler configs under conf/sampler."""
    return sorted(p.stem for p in SAMPLER_DIR.glob("*.yaml"))


def samplers_of(family: str) -> list[str]:
    """The sampler configs whose sampler samples ``family`` models (configs whose class does not import: left out)."""
    names = []
    for name in sampler_names():
        try:
            cls = import_class(sampler_config(name)._target_)
        except (ImportError, AttributeError):
            continue
        if getattr(cls, "family", None) == family:
            names.append(name)
    return names


def sampler_config(name: str) -> DictConfig:
    """conf/sampler/<name>.yaml; an unknown name is a ValueError listing the known ones."""
    path = SAMPLER_DIR / f"{name}.yaml"
    if not path.is_file():
        raise ValueError(f"unknown sampler {name!r}: conf/sampler holds {', '.join(sampler_names())}")
    return OmegaConf.load(path)


def sampler_settings(name: str, overrides: dict[str, Any], family: str) -> dict[str, Any]:
    """The resolved config of conf/sampler/<name>.yaml with ``overrides`` (keys of that config), refused unless its
    sampler samples ``family`` models; interpolations of the run config (``a_priori_temperature``) take their
    defaults."""
    cfg = sampler_config(name)
    unknown = sorted(set(overrides) - set(cfg) - {"_target_"})
    if unknown:
        settings = ", ".join(k for k in cfg if k != "_target_")
        raise ValueError(
            f"sampler.{unknown[0]} is not a setting of conf/sampler/{name}.yaml (its settings: {settings})"
        )
    cls = import_class(cfg._target_)
    if cls.family != family:
        raise ValueError(
            f"sampler {name!r} ({cls.__name__}) samples '{cls.family}' models, but the checkpoint is a '{family}' "
            f"model; its samplers: {', '.join(samplers_of(family))}"
        )
    for key, value in overrides.items():
        cfg[key] = value
    return OmegaConf.to_container(cfg, resolve=True)


def nfe_summary(spent: Sequence[int]) -> dict[str, float]:
    """``mean_nfe`` and ``max_nfe`` of the NFE spent per request (per answer turn in runners/mt_bench.py)."""
    return {"mean_nfe": sum(spent) / len(spent), "max_nfe": float(max(spent))}


def request_seed(seed: int, *parts: list[int]) -> int:
    """A generator seed from ``seed`` and a request's token ids: the same request draws the same numbers in any order,
    batch and process."""
    digest = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def cut_at_stops(text: str, until: list[str]) -> str:
    """``text`` up to the earliest occurrence of any non-empty stop sequence."""
    ends = [i for stop in until if stop and (i := text.find(stop)) >= 0]
    return text[: min(ends)] if ends else text


@register_model(MODEL_NAME)
class FlowLM(LM):
    """A flowlm checkpoint (file, sharded folder, export or foreign MDM) for lm-eval; model_args (docs/evaluation.md):

    ``checkpoint``; ``sampler`` (a conf/sampler name of the checkpoint's family; default per family) with
    ``sampler.<key>=value`` settings of that config, ``nfe`` (budget per generation call), ``gen_length`` (positions
    generated after the context; default: the rest of the row); ``max_length`` (row length; default the checkpoint's
    seq_len); ``mc_samples``, ``estimator`` (time | count) for an MDM's ELBO; ``seed``; ``tokenizer``, ``add_bos``
    (default: the checkpoint's data config); ``template`` (auto | tokenizer | vicuna: the chat layout of
    ``--apply_chat_template``), ``system`` (Vicuna's system prompt); ``dtype`` (float32 | bfloat16 | float16
    autocast); ``trust_pickle``.
    ``batch_size``: rows per network call (generation: requests per sampler call; the ELBO: Monte-Carlo rows).
    """

    _read_weights = True  # False in ``check_args``: every check made, the weights never read

    @classmethod
    def check_args(cls, **model_args: Any) -> None:
        """Every check ``model_args`` get (names, values, the checkpoint's record, its tokenizer, the sampler) without
        reading the weights: ``tracked`` runs it before the MLflow run is made (``mc_samples=nan`` left a run)."""
        lm = cls.__new__(cls)
        lm._read_weights = False
        lm.__init__(**model_args)

    def __init__(
        self,
        checkpoint: str,
        sampler: str | None = None,
        nfe: int | None = None,
        gen_length: int | None = None,
        max_length: int | None = None,
        mc_samples: int = 128,
        estimator: str = "auto",
        rows: str = "auto",
        greedy: str = "one_call",
        seed: int = 0,
        tokenizer: str | None = None,
        add_bos: bool | None = None,
        template: str = "auto",
        system: str | None = None,
        dtype: str = "float32",
        trust_pickle: bool = False,
        batch_size: int | str = 1,
        max_batch_size: int | None = None,
        device: str | None = None,
        **options: Any,
    ) -> None:
        super().__init__()
        overrides = {k[len(SAMPLER_PREFIX) :]: v for k, v in options.items() if k.startswith(SAMPLER_PREFIX)}
        unknown = sorted(k for k in options if not k.startswith(SAMPLER_PREFIX))
        if unknown:
            raise TypeError(
                f"flowlm: unknown model_args {', '.join(unknown)} (known: checkpoint, sampler, sampler.<key>, nfe, "
                "gen_length, max_length, mc_samples, estimator, rows, greedy, seed, tokenizer, add_bos, template, "
                "system, dtype, trust_pickle)"
            )
        self.checkpoint = str(checkpoint)
        trust_pickle = as_bool("trust_pickle", trust_pickle)  # lm-eval keeps "no" a (truthy) string
        add_bos = None if add_bos is None else as_bool("add_bos", add_bos)
        self.batch_size = _positive_int("batch_size", batch_size)
        self.mc_samples = _positive_int("mc_samples", mc_samples)
        self.seed = as_int("seed", seed)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {dtype!r}")
        self.dtype = dtype
        self._device = _resolve_device(device)
        use_tf32(self._device.type)  # float32 matmuls on TF32 on CUDA (FLOWLM_TF32=0: off); MT-Bench too

        if estimator not in ESTIMATORS:
            raise ValueError(f"flowlm: estimator must be one of {ESTIMATORS}, got {estimator!r}")
        if rows not in ROW_LAYOUTS:
            raise ValueError(f"flowlm: rows must be one of {ROW_LAYOUTS}, got {rows!r}")
        if greedy not in GREEDY_CHECKS:
            raise ValueError(f"flowlm: greedy must be one of {GREEDY_CHECKS}, got {greedy!r}")
        self.greedy = greedy
        self.estimator, self.rows = estimator, rows

        # everything model_args decide is checked from the checkpoint's record before its weights are read
        meta = read_checkpoint_meta(self.checkpoint, trust_pickle=trust_pickle)
        self.family = meta.get("family")
        data = dict((meta.get("config") or {}).get("data") or {})
        spec = tokenizer or data.get("tokenizer")
        if spec is None:
            raise ValueError(
                f"{self.checkpoint} records no tokenizer (data without one, e.g. Sudoku, or a foreign checkpoint): "
                "lm-eval tasks are text; give model_args tokenizer=NAME_OR_DIR for a text model"
            )
        self.tokenizer_spec = str(spec)
        self.tokenizer = tok = load_tokenizer(spec, data.get("pad_token", "add"))
        self.bos_id = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
        self.eos_id = tok.eos_token_id if tok.eos_token_id is not None else tok.bos_token_id
        self.pad_id = int(tok.pad_token_id)
        if add_bos is None:
            add_bos = bool(data.get("add_bos_eos", True) or data.get("packing") == "wrap") and self.bos_id is not None
        if add_bos and self.bos_id is None:
            raise ValueError(f"add_bos=true but tokenizer {spec!r} has no BOS/EOS token")
        self.head = [self.bos_id] if add_bos else []
        self.template = template_kind(tok, template)  # the chat layout of --apply_chat_template
        self._render = chat_renderer(tok, template, system, drop_bos=bool(self.head))
        self._templated = 0  # prompts rendered in the chat layout
        self.max_length = _positive_int("max_length", max_length or meta.get("seq_len"))
        check_max_length(self.max_length, recorded_context(meta), self.checkpoint, meta.get("seq_len"))
        if gen_length is not None:
            gen_length = _positive_int("gen_length", gen_length)
            if gen_length > self.max_length - len(self.head):
                raise ValueError(
                    f"gen_length={gen_length} leaves no room in a row of max_length={self.max_length} positions "
                    f"({len(self.head)} for BOS)"
                )
        self.gen_length = gen_length
        self.sampler_name = sampler or DEFAULT_SAMPLERS.get(self.family)
        if self.sampler_name is None:
            raise ValueError(f"no default sampler for the '{self.family}' family: give sampler=NAME")
        self.sampler_settings = sampler_settings(self.sampler_name, overrides, self.family)
        self.sampler = build(OmegaConf.create(self.sampler_settings))
        self.nfe = None if nfe is None else _positive_int("nfe", nfe)
        if self.nfe is not None:
            self.sampler.check_budget(self.nfe, free_positions=gen_length)
        if not self._read_weights:
            return

        vocab = len(tok)
        self.module = load_module(
            self.checkpoint, map_location=self._device, data_vocab_size=vocab, trust_pickle=trust_pickle
        ).eval()
        if self.module.data_vocab_size != vocab:
            raise ValueError(
                f"{self.checkpoint} was trained on {self.module.data_vocab_size} data tokens; tokenizer {spec!r} "
                f"(with its PAD) has {vocab}: give the run's tokenizer"
            )
        data_tokens = SimpleNamespace(
            tokenizer=tok,
            tokenizer_name=self.tokenizer_spec,
            vocab_size=vocab,
            pad_id=self.pad_id,
            mask_token_id=tok.mask_token_id,
        )
        check_data_tokens(data_tokens, self.module)
        check_max_length(self.max_length, network_context(self.module), self.checkpoint, meta.get("seq_len"))
        if self.family == "mdm":
            self.estimator = check_estimator(estimator, self.module.denoiser())  # auto: count or time
            self.rows = row_layout(rows, self.module.net)  # auto: the item or max_length rows
        self._nfe: list[int] = []  # NFE spent per generated request
        self._stderr: list[float] = []  # Monte-Carlo standard error per ELBO scored (i.i.d. formula: an upper bound)
        self._warned: set[str] = set()

    # ------------------------------------------------------------------------------------------------ lm-eval
    @property
    def eot_token_id(self) -> int | None:
        """EOS: where a generated answer ends."""
        return self.eos_id

    @property
    def tokenizer_name(self) -> str:
        """The tokenizer's name as lm-eval's HF model gives it ('/' → '__'), ``__vicuna`` added in Vicuna's layout:
        lm-eval keys its cache of chat-templated requests with it."""
        name = self.tokenizer_spec.replace("/", "__")
        return f"{name}__vicuna" if self.template == "vicuna" else name

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        """The chat layout lm-eval records (its evaluation tracker hashes it): None when not asked for, else the
        tokenizer's Jinja template or Vicuna's layout."""
        if not chat_template:
            return None
        return self.tokenizer.chat_template if self.template == "tokenizer" else VICUNA_LAYOUT

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """lm-eval's hook (``--apply_chat_template``): the messages in the checkpoint's chat layout (model_args
        ``template``: the tokenizer's own where it has one, else Vicuna's), open for the answer; a BOS the template
        writes is left to the row. add_generation_prompt=False continues a final assistant message."""
        self._templated += 1
        return self._render(chat_history, add_generation_prompt)

    @property
    def nfe_spent(self) -> list[int]:
        """The NFE each generated request spent, in the order generated (runners/mt_bench.py records it per answer)."""
        return list(self._nfe)

    def get_model_info(self) -> dict:
        """What lm-eval adds to ``results["config"]``: the checkpoint, sampler and budget, the NFE spent."""
        return {MODEL_NAME: self.summary()}

    def summary(self) -> dict:
        """The checkpoint, sampler, budget, row layout, and the NFE / Monte-Carlo statistics so far."""
        info: dict[str, Any] = {
            "checkpoint": self.checkpoint,
            "family": self.family,
            "sampler": self.sampler_name,
            "nfe_budget": self.nfe,
            "gen_length": self.gen_length,
            "max_length": self.max_length,
            "sampler_settings": {k: v for k, v in self.sampler_settings.items() if k != "_target_"},
            "chat_template": self.template if self._templated else None,
            "tokenizer": self.tokenizer_spec,
            "dtype": self.dtype,
            "seed": self.seed,
            "generated": len(self._nfe),
        }
        if self._nfe:
            info |= nfe_summary(self._nfe) | {"nfe_per_request": list(self._nfe)}
        if self.family == "mdm":
            info |= {
                "estimator": self.estimator,
                "mc_samples": self.mc_samples,
                "rows": self.rows,
                "greedy": self.greedy,
            }
        if self._stderr:
            info |= {"scored": len(self._stderr), "mean_mc_stderr": sum(self._stderr) / len(self._stderr)}
        return info

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Each context's answer: the sampler fills the generation window at the NFE budget; the text is cut at EOS
        and at the task's ``until`` stop sequences. The task's other generation settings are the sampler's."""
        if not requests:
            return []
        if self.nfe is None:
            raise ValueError("flowlm: generate_until needs an NFE budget: give model_args nfe=N")
        rows = [self._generation_row(context) for context, _ in (r.args for r in requests)]
        batches = [range(i, min(i + self.batch_size, len(rows))) for i in range(0, len(rows), self.batch_size)]
        layouts = [self._generation_batch([rows[j] for j in batch]) for batch in batches]
        for _, prompt_mask in layouts:  # every budget checked before any sampling
            self.sampler.check_budget(self.nfe, free_positions=int((~prompt_mask).any(0).sum()))
        self._note_generation_kwargs(requests)
        answers: list[str] = []
        denoiser = self.module.denoiser()
        for i, (batch, (tokens, prompt_mask)) in enumerate(
            tqdm(list(zip(batches, layouts, strict=True)), desc="flowlm generate_until", disable=disable_tqdm)
        ):
            gen = torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + i)
            with torch.no_grad(), self._precision():
                out = self.sampler(denoiser, prompt=tokens, prompt_mask=prompt_mask, nfe=self.nfe, generator=gen)
            spent = [int(out.nfe)] * len(batch) if out.row_nfe is None else out.row_nfe.tolist()
            self._nfe.extend(spent)  # the calls each row needed (adaptive samplers: per row)
            for b, j in enumerate(batch):
                start, stop = len(rows[j][0]), len(rows[j][0]) + rows[j][1]
                context, gen_kwargs = requests[j].args
                text = self._decode_answer(out.tokens[b, start:stop].tolist(), _stops(gen_kwargs))
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
                answers.append(text)
        log.info(
            "flowlm: %d answers by %s at NFE budget %d, mean NFE spent %.2f",
            len(self._nfe),
            self.sampler_name,
            self.nfe,
            sum(self._nfe) / len(self._nfe),
        )
        return answers

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """log p(continuation | context): an MDM's ELBO (Monte Carlo), an AR model's exact value; and whether greedy
        decoding gives the continuation."""
        self._refuse("loglikelihood")
        pairs = [self._encode_pair(context, continuation) for context, continuation in (r.args for r in requests)]
        results = self._score(pairs, disable_tqdm=disable_tqdm)
        for request, result in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """log p(text) as the sum over disjoint windows of ``max_length`` − 1 tokens, each scored as ``loglikelihood``
        scores given the token before it (the first: given BOS, or nothing; the last: given as many as fill the row;
        lm-eval's rolling windows with context 1)."""
        self._refuse("loglikelihood_rolling")
        windows, owners = [], []
        prefix = self.bos_id if self.bos_id is not None else 0
        for k, (text,) in enumerate(r.args for r in requests):
            ids = self._encode(text)
            for n, pair in enumerate(get_rolling_token_windows(ids, prefix, self.max_length - 1, 1)):
                context, continuation = make_disjoint_window(pair)
                if n == 0:
                    context = self.head  # the row's own start: [BOS], or nothing
                windows.append((context, continuation))
                owners.append(k)
        totals = [0.0] * len(requests)
        for k, (value, _) in zip(owners, self._score(windows, disable_tqdm=disable_tqdm), strict=True):
            totals[k] += value
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ------------------------------------------------------------------------------------------------ rows
    def _encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(``[BOS] context`` ids, continuation ids) as lm-eval's causal models split them: trailing spaces of the
        context move to the continuation, which is the tail of the whole text's ids."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        if not context:
            return list(self.head), self._encode(continuation)
        whole, ctx = self._encode(context + continuation), self._encode(context)
        return self.head + ctx, whole[len(ctx) :]

    def _fit(self, prefix: list[int], room: int, what: str) -> list[int]:
        """``prefix`` ([BOS] context) cut from the left to ``room`` positions, BOS kept (a warning, once)."""
        if len(prefix) <= room:
            return prefix
        if f"cut:{what}" not in self._warned:
            self._warned.add(f"cut:{what}")
            log.warning("flowlm: %s contexts longer than the row allows are cut from the left (kept: BOS)", what)
        head = prefix[: len(self.head)]
        keep = room - len(head)
        return head + (prefix[len(prefix) - keep :] if keep > 0 else [])

    def _generation_row(self, context: str) -> tuple[list[int], int]:
        """(``[BOS] context`` ids, positions to generate) of one request."""
        prefix = self.head + self._encode(context)
        window = self.gen_length or self.max_length - len(prefix)
        if window < 1:
            raise ValueError(
                f"flowlm: a context of {len(prefix)} tokens fills the row of max_length={self.max_length} positions; "
                "give gen_length=N (the context is then cut from the left to make room)"
            )
        return self._fit(prefix, self.max_length - window, "generation"), window

    def _generation_batch(self, rows: list[tuple[list[int], int]]) -> tuple[Tensor, Tensor]:
        """(tokens, prompt_mask) (B, max_length): the context pinned, the window free, PAD pinned after it."""
        tokens = torch.full((len(rows), self.max_length), self.pad_id, dtype=torch.long)
        prompt_mask = torch.ones((len(rows), self.max_length), dtype=torch.bool)
        for b, (prefix, window) in enumerate(rows):
            tokens[b, : len(prefix)] = torch.tensor(prefix, dtype=torch.long)
            prompt_mask[b, len(prefix) : len(prefix) + window] = False
        return tokens.to(self.device), prompt_mask.to(self.device)

    def _decode_answer(self, ids: list[int], until: list[str] = ()) -> str:
        """The text of generated ids up to the first EOS or PAD (the end of an answer in the training rows), cut at
        the earliest stop sequence of ``until`` in the raw decode, special tokens still in it (a stop that is a
        special token, lm-eval's gsm8k ``<|im_end|>``, would be gone from the clean text and the answer run on past
        it), then without its special tokens."""
        ends = [i for i, t in enumerate(ids) if t in (self.eos_id, self.pad_id)]
        ids = ids[: ends[0]] if ends else ids
        raw = self.tokenizer.decode(ids, skip_special_tokens=False)
        cut = cut_at_stops(raw, until)
        if cut == raw:  # no stop: the clean decode as it always was
            return cut_at_stops(self.tokenizer.decode(ids, skip_special_tokens=True), until)
        for special in sorted(self.tokenizer.all_special_tokens, key=len, reverse=True):
            cut = cut.replace(special, "")
        return cut

    def _note_generation_kwargs(self, requests) -> None:
        ignored = sorted({k for r in requests for k in (r.args[1] or {}) if k != "until"} - self._warned)
        if ignored:
            self._warned.update(ignored)
            log.warning(
                "flowlm ignores the tasks' generation settings %s: the sampler's are conf/sampler/%s.yaml's "
                "(model_args sampler.<key>=...), the window is gen_length",
                ignored,
                self.sampler_name,
            )

    # ------------------------------------------------------------------------------------------------ scoring
    def _refuse(self, request_type: str) -> None:
        if self.family in NO_LIKELIHOOD:
            raise NotImplementedError(
                f"flowlm: {self.checkpoint} is a '{self.family}' checkpoint: {NO_LIKELIHOOD[self.family]}, so "
                f"lm-eval's {request_type} requests (multiple-choice and perplexity tasks) cannot be scored; evaluate "
                "it on generate_until tasks (an MDM or AR checkpoint scores likelihoods)"
            )
        if self.family not in ("mdm", "ar"):
            raise NotImplementedError(f"flowlm: no likelihood for the '{self.family}' family")

    def _score(self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """(log-likelihood, greedy) of each ([BOS] context ids, continuation ids)."""
        fitted = []
        for prefix, continuation in pairs:
            if len(continuation) + len(self.head) > self.max_length:
                raise ValueError(
                    f"flowlm: a continuation of {len(continuation)} tokens does not fit a row of max_length="
                    f"{self.max_length} positions"
                )
            fitted.append((self._fit(prefix, self.max_length - len(continuation), "scored"), continuation))
        group = self.batch_size if self.family == "ar" else max(1, self.batch_size // self.mc_samples)
        # Item rows: the requests in order of length, so that a chunk's rows share few lengths and fill its calls
        # (each request's value is its own: draws seeded by its context, rows computed alone); answered in order.
        order = sorted(range(len(fitted)), key=lambda i: sum(map(len, fitted[i]))) if self.rows == "item" else None
        ordered = fitted if order is None else [fitted[i] for i in order]
        scored: list[tuple[float, bool]] = []
        chunks = [ordered[i : i + group] for i in range(0, len(ordered), group)]
        for chunk in tqdm(chunks, desc=f"flowlm {self.family} likelihood", disable=disable_tqdm):
            scored += self._score_mdm(chunk) if self.family == "mdm" else self._score_ar(chunk)
        if order is None:
            return scored
        out: list[tuple[float, bool]] = [(0.0, False)] * len(fitted)
        for i, value in zip(order, scored, strict=True):
            out[i] = value
        return out

    def _rows(self, pairs, length: int) -> tuple[Tensor, Tensor, Tensor]:
        """(tokens, pinned, scored) (B, length): context pinned, continuation scored, PAD after."""
        tokens = torch.full((len(pairs), length), self.pad_id, dtype=torch.long)
        pinned = torch.zeros((len(pairs), length), dtype=torch.bool)
        scored = torch.zeros_like(pinned)
        for b, (prefix, continuation) in enumerate(pairs):
            tokens[b, : len(prefix) + len(continuation)] = torch.tensor(prefix + continuation, dtype=torch.long)
            pinned[b, : len(prefix)] = True
            scored[b, len(prefix) : len(prefix) + len(continuation)] = True
        return tokens.to(self.device), pinned.to(self.device), scored.to(self.device)

    def _score_mdm(self, pairs) -> list[tuple[float, bool]]:
        """Each pair's ELBO (``mdm_elbo_estimate``: exact where the continuation is short enough to enumerate within
        ``mc_samples`` rows, else the Monte-Carlo mean), on rows of the item alone or of ``max_length`` with the text
        after the continuation masked (``rows``; item rows batched by length). Draws seeded by the context alone: the
        choices of one question share them (common random draws). Greedy: one call with the continuation masked, or
        LLaDA's one commit a call (``greedy=iterative``)."""
        groups: dict[int, list[int]] = {}
        for i, (prefix, continuation) in enumerate(pairs):
            length = len(prefix) + len(continuation) if self.rows == "item" else self.max_length
            groups.setdefault(length, []).append(i)
        out: list[tuple[float, bool]] = [(0.0, False)] * len(pairs)
        denoiser = self.module.denoiser()
        for length, members in groups.items():
            part = [pairs[i] for i in members]
            tokens, pinned, scored = self._rows(part, length)
            generators = [torch.Generator().manual_seed(request_seed(self.seed, prefix)) for prefix, _ in part]
            with torch.no_grad(), self._precision():
                means, stderr = mdm_elbo_estimate(
                    denoiser,
                    tokens,
                    pinned,
                    scored,
                    samples=self.mc_samples,
                    generators=generators,
                    estimator=self.estimator,
                    batch_size=self.batch_size,
                )
                check = mdm_greedy if self.greedy == "one_call" else mdm_greedy_iterative
                greedy = torch.cat(
                    [
                        check(denoiser, *(t[i : i + self.batch_size] for t in (tokens, pinned, scored)))
                        for i in range(0, len(part), self.batch_size)
                    ]
                )
            if self.mc_samples > 1:
                self._stderr += stderr.tolist()
            for i, m, g in zip(members, means.tolist(), greedy.tolist(), strict=True):
                out[i] = (float(m), bool(g))
        return out

    def _score_ar(self, pairs) -> list[tuple[float, bool]]:
        """The exact chain rule over the continuation (rows as long as the longest pair; causal: PAD after is
        never read)."""
        tokens, _, scored = self._rows(pairs, max(len(p) + len(c) for p, c in pairs))
        with torch.no_grad(), self._precision():
            values, greedy = causal_log_likelihood(self.module.denoiser(), tokens, scored)
        return [(float(v), bool(g)) for v, g in zip(values.tolist(), greedy.tolist(), strict=True)]

    def _precision(self):
        dtype = DTYPES[self.dtype]
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=dtype)


def recorded_context(meta: dict) -> tuple[int, str] | None:
    """(positions, why) a checkpoint's network serves, as its record says before the weights are read: a DiT's
    (the suite's, a foreign MDLM) is its ``seq_len``, the rows it was trained on (rotary positions, no table: beyond
    them it computes on positions it never saw); a LLaMA-family backbone's is its ``max_positions`` where the run
    config spells it out; None where the record does not say (``network_context`` tells once it is built)."""
    backbone = (meta.get("config") or {}).get("backbone") or {}
    dit = "source" in meta or (backbone and "_target_" not in backbone)  # a foreign MDM is read into the DiT
    if dit and meta.get("seq_len"):
        return int(meta["seq_len"]), "a DiT trained on rows of that length"
    if backbone.get("max_positions"):
        return int(backbone["max_positions"]), "its decoder's max_positions"
    return None


def network_context(module) -> tuple[int, str] | None:
    """(positions, why) a built network serves: a LLaMA-family decoder's ``max_positions`` (its RoPE config's
    ``max_position_embeddings``: the forward refuses longer rows), else the module's ``seq_len`` (a DiT)."""
    for part in module.modules():
        spec = getattr(part, "spec", None)
        if isinstance(spec, dict) and spec.get("max_positions"):
            return int(spec["max_positions"]), "its decoder's max_positions"
    seq_len = getattr(module, "seq_len", None) or (getattr(module, "hparams", None) or {}).get("seq_len")
    return (int(seq_len), "a DiT trained on rows of that length") if seq_len else None


def check_max_length(max_length: int, context: tuple[int, str] | None, checkpoint: str, seq_len: Any) -> None:
    """Refuse a ``max_length`` longer than the network's ``context`` (``max_length=4096`` on a 128-position model
    ran for minutes on rows it was never trained on, or failed at the first forward)."""
    if context is not None and max_length > context[0]:
        raise ValueError(
            f"flowlm: model_args max_length={max_length} is longer than {checkpoint}'s context of {context[0]} "
            f"positions ({context[1]}): give max_length ≤ {context[0]}, or leave it out (the checkpoint's seq_len, "
            f"{seq_len})"
        )


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"flowlm: {name} must be an integer ≥ 1, got {value!r}")
    return value


def _resolve_device(device: str | None) -> torch.device:
    """``device`` (lm-eval's CLI passes cuda:0 by default); a CUDA device on a machine without one: the CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        _warn_no_cuda(device)
        return torch.device("cpu")
    return resolved


@functools.cache
def _warn_no_cuda(device: str) -> None:
    # once a process: ``tracked`` checks the model_args (FlowLM.check_args) before lm-eval builds the model
    log.warning("flowlm: device %s is not available here; running on the CPU", device)


def _stops(gen_kwargs: dict | None) -> list[str]:
    until = (gen_kwargs or {}).get("until") or []
    return [until] if isinstance(until, str) else list(until)


# ------------------------------------------------------------------------------------------------ MLflow
def tracking_config(
    checkpoint: str,
    *,
    seed: int = 0,
    trust_pickle: bool = False,
    tracking_uri: str | None = None,
    experiment: str | None = None,
) -> DictConfig | None:
    """The MLflow run of an evaluation of ``checkpoint`` (``runners.mlflow_run.tracked_run``), in the suite's store
    (conf/logger/mlflow.yaml: $MLFLOW_TRACKING_URI, else <runs>/mlflow.db) unless ``tracking_uri`` is given ("none":
    untracked). A checkpoint of a run of the suite: the run's experiment (its task), named ``lm_eval/<run>/<time>``
    as flowlm-eval names ``eval/<run>``; an export or a pretrained source: the experiment ``lm_eval``, named
    ``lm_eval/<checkpoint>/<time>``. ``experiment`` names the experiment in both cases."""
    if tracking_uri is not None and tracking_uri.strip().lower() == "none":  # None: the suite's store
        return None
    meta = read_checkpoint_meta(checkpoint, trust_pickle=trust_pickle)
    recorded = meta.get("config") or {}
    own_run = "source" not in meta and bool(recorded.get("name")) and bool(recorded.get("task"))
    cfg = OmegaConf.create(
        {
            "name": f"{MODEL_RUN_PREFIX}/{recorded['name'] if own_run else checkpoint}",
            "task": experiment or (recorded["task"] if own_run else MODEL_RUN_PREFIX),
            "run_name": time.strftime("%Y%m%d-%H%M%S"),
            "seed": int(seed),
            **{k: recorded[k] for k in ("method", "backbone") if recorded.get(k)},
            "paths": {"root": OmegaConf.load(Path(CONF_DIR) / "paths" / "default.yaml").root},
            "logger": OmegaConf.load(Path(CONF_DIR) / "logger" / "mlflow.yaml"),
        }
    )
    if tracking_uri:
        cfg.logger.tracking_uri = tracking_uri
    return cfg


def log_results(logger, results: dict, options: dict | None = None) -> None:
    """An lm-eval evaluation into its MLflow run: every numeric metric per task and group with its stderr
    (``lm_eval/<task>/<metric>/<filter>``), the NFE spent (``lm_eval/mean_nfe``, ``max_nfe``; per request and as a
    histogram in the artifact ``lm_eval/nfe.json``) and the Monte-Carlo stderr; the checkpoint, sampler settings and
    lm-eval's settings (``options``: simple_evaluate's arguments) as params; lm-eval's and each task's version as
    tags; the results (without samples) as the artifact ``lm_eval/results.json``."""
    from lm_eval.utils import handle_non_serializable

    from callbacks.sampling_eval import nfe_histogram

    client, run_id = logger.experiment, logger.run_id
    info = dict(results["config"].get(MODEL_NAME) or {})
    metrics = {}
    for section in ("results", "groups"):
        for task, values in (results.get(section) or {}).items():
            for key, value in values.items():
                if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
                    metric, _, where = key.partition(",")
                    metrics[_metric_name(f"{MODEL_RUN_PREFIX}/{task}/{metric}/{where}".rstrip("/"))] = float(value)
    for key in ("mean_nfe", "max_nfe", "mean_mc_stderr"):
        if key in info:
            metrics[f"{MODEL_RUN_PREFIX}/{key}"] = float(info[key])
    if metrics:
        logger.log_metrics(metrics)
    spent = info.pop("nfe_per_request", [])
    settings = {k: info.get(k) for k in RUN_PARAMS if k in info}
    settings["sampler"] = {"name": info.get("sampler"), **info.get("sampler_settings", {})}
    chosen = {k: (options or {}).get(k) for k in EVALUATE_PARAMS}
    config = results["config"]
    lm_eval_params = {**chosen, "limit": config.get("limit"), "batch_size": config.get("batch_size")}
    lm_eval_params |= {"tasks": ",".join(results.get("results") or {}), "num_fewshot": results.get("n-shot", {})}
    logger.log_hyperparams({**settings, MODEL_RUN_PREFIX: lm_eval_params})
    client.set_tag(run_id, "flowlm.checkpoint", str(info.get("checkpoint")))
    client.set_tag(run_id, "lm_eval.version", str(results.get("lm_eval_version")))
    for task, version in (results.get("versions") or {}).items():
        client.set_tag(run_id, _metric_name(f"lm_eval.task_version.{task}"), str(version))
    output = getattr((options or {}).get("evaluation_tracker"), "output_path", None)
    if output:
        client.set_tag(run_id, "lm_eval.output_path", str(output))
    if spent:
        histogram = nfe_histogram(np.asarray(spent, dtype=np.float64))
        client.log_dict(run_id, {"per_request": spent, "histogram": histogram}, f"{MODEL_RUN_PREFIX}/nfe.json")
    kept = {k: v for k, v in results.items() if k != "samples"}
    text = json.dumps(kept, indent=2, default=handle_non_serializable, ensure_ascii=False)
    client.log_text(run_id, text, f"{MODEL_RUN_PREFIX}/results.json")


def _metric_name(name: str) -> str:
    """``name`` in the characters MLflow allows in metric and tag names."""
    return re.sub(r"[^\w./ -]", "_", name)


LIKELIHOOD_OUTPUTS = ("loglikelihood", "loglikelihood_rolling", "multiple_choice")


def refuse_likelihood_tasks(model_args: dict, call: dict) -> None:
    """Before any request runs: a checkpoint of a family without a likelihood (``NO_LIKELIHOOD``) given a task that
    scores likelihoods is refused, naming the tasks (lm-eval runs the request types one after the other: a mixed run
    refused only when it reaches them had computed its generations first). Reads the tasks' configs (lm-eval's
    ``get_task_dict``) for such checkpoints only."""
    meta = read_checkpoint_meta(
        str(model_args["checkpoint"]), trust_pickle=as_bool("trust_pickle", model_args.get("trust_pickle", False))
    )
    family = meta.get("family")
    if family not in NO_LIKELIHOOD or not call.get("tasks"):
        return
    from lm_eval.tasks import get_task_dict

    def names(node: Any) -> Iterator[str]:
        for key, value in node.items() if isinstance(node, dict) else []:
            if isinstance(value, dict):
                yield from names(value)
            elif getattr(value, "OUTPUT_TYPE", None) in LIKELIHOOD_OUTPUTS:
                yield str(getattr(getattr(value, "config", None), "task", None) or key)

    tasks = call["tasks"] if isinstance(call["tasks"], list) else [call["tasks"]]
    scored = sorted(set(names(get_task_dict(tasks, call.get("task_manager")))))
    if scored:
        raise ValueError(
            f"flowlm: {model_args['checkpoint']} is a '{family}' checkpoint: {NO_LIKELIHOOD[family]}, and tasks "
            f"{', '.join(scored)} score likelihoods: leave them out (it runs generate_until tasks only)"
        )


def check_output_path(evaluation_tracker: Any) -> None:
    """Refuse, before the model is built, an ``--output_path`` that cannot be written: lm-eval writes its results
    there (a ``.json`` path: beside it; else into a folder of the model's name under it) only once every request has
    run."""
    output = getattr(evaluation_tracker, "output_path", None)
    if output:
        path = Path(output)
        check_writable("--output_path", path.parent if path.suffix == ".json" else path)


def tracked(simple_evaluate: Callable, tracking_uri: str | None = None, experiment: str | None = None) -> Callable:
    """``simple_evaluate`` that tracks a ``flowlm`` evaluation in MLflow: its run made (the store reached, the
    checkpoint read) before any compute, ``log_results`` after it, the run FAILED with its error if it raises; any
    other model is evaluated untracked."""

    @functools.wraps(simple_evaluate)
    def evaluate(*args: Any, **kwargs: Any) -> dict | None:
        call = inspect.signature(simple_evaluate).bind(*args, **kwargs).arguments
        check_output_path(call.get("evaluation_tracker"))
        if call.get("model") != MODEL_NAME:
            return simple_evaluate(*args, **kwargs)
        model_args = call.get("model_args") or {}
        if isinstance(model_args, str):
            model_args = simple_parse_args_string(model_args)
        if "checkpoint" not in model_args:
            raise TypeError("flowlm: model_args need checkpoint=PATH")
        # the model as simple_evaluate will build it, its weights not read: a bad value is refused before any run
        built_with = {k: call.get(k) for k in ("batch_size", "max_batch_size", "device")}
        FlowLM.check_args(**model_args, **{k: v for k, v in built_with.items() if v is not None})
        refuse_likelihood_tasks(model_args, call)
        cfg = tracking_config(
            str(model_args["checkpoint"]),
            seed=as_int("seed", model_args.get("seed", 0)),
            trust_pickle=as_bool("trust_pickle", model_args.get("trust_pickle", False)),
            tracking_uri=tracking_uri,
            experiment=experiment,
        )
        with tracked_run(cfg) as logger:
            results = simple_evaluate(*args, **kwargs)
            if logger is not None and results is not None:
                log_results(logger, results, call)
        return results

    return evaluate


def evaluate(*, tracking_uri: str | None = None, experiment: str | None = None, **kwargs: Any) -> dict | None:
    """``lm_eval.simple_evaluate(**kwargs)`` with a ``flowlm`` evaluation tracked in MLflow (``tracked``)."""
    import lm_eval

    return tracked(lm_eval.simple_evaluate, tracking_uri, experiment)(**kwargs)


@console_script(hydra=False, packages=(*SUITE_PACKAGES, "lm_eval"))  # lm-eval's refusals (a task not found) too
def main() -> None:
    """lm-eval's command line (the same arguments as ``lm_eval``) with ``flowlm`` registered and its evaluations
    tracked in MLflow; two arguments of its own: ``--mlflow_tracking_uri URI`` (``none``: untracked) and
    ``--mlflow_experiment NAME`` (``tracking_config``). ``flowlm-lm-eval`` is runners/lm_eval_cli.py, which reads the
    command line before it imports this module (a fast ``--help``); a user error ends either in one line."""
    import lm_eval.evaluator
    from lm_eval.__main__ import cli_evaluate

    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--mlflow_tracking_uri", default=None)
    parser.add_argument("--mlflow_experiment", default=None)
    ours, sys.argv[1:] = parser.parse_known_args(sys.argv[1:])
    # lm-eval's CLI has no hook for its results: its run step reads lm_eval.simple_evaluate when it runs, so the
    # tracked one stands in for it while the command runs
    original = lm_eval.evaluator.simple_evaluate
    lm_eval.evaluator.simple_evaluate = tracked(original, ours.mlflow_tracking_uri, ours.mlflow_experiment)
    try:
        cli_evaluate()
    finally:
        lm_eval.evaluator.simple_evaluate = original


if __name__ == "__main__":
    main()
