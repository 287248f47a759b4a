"""What every transformers model shipped in a flowlm export checks as it loads (shipped by ``flowlm-export`` beside
the weights; transformers only): the weights in the folder are exactly those of the network ``config.json``
describes. transformers loads a folder whose config disagrees with its weights with a warning and random tensors
where they differ (``config.json`` edited from 4 to 6 layers: layers 4 and 5 newly initialised, the logits noise; a
layer fewer: its weights dropped), and a tensor of another shape fails after a table; here each is refused in one
message that names the tensors and the fix.
"""

import logging

# transformers' table of missing / unexpected / mismatched tensors (utils/loading_report.py, logged as a warning by
# modeling_utils' logger): held back while the model loads, shown only when the load goes on without this refusal
REPORT = "LOAD REPORT"
SHOWN = 3  # tensors named per kind in the message


class _HoldReport(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:  # noqa: D102
        if REPORT in str(record.msg):
            self.held.append(record)
            return False
        return True


def _names(keys, shown: int = SHOWN) -> str:
    keys = sorted(keys)
    return ", ".join(keys[:shown]) + (", ..." if len(keys) > shown else "")


def disagreements(info: dict) -> str:
    """What differs between the network a config describes and the weights loaded into it (transformers'
    ``output_loading_info``), in words; empty when they agree."""
    parts = []
    missing, unexpected = info.get("missing_keys") or (), info.get("unexpected_keys") or ()
    mismatched = sorted(info.get("mismatched_keys") or (), key=lambda entry: entry[0])
    if missing:
        parts.append(f"{len(missing)} tensor(s) of that network are not in the weights ({_names(missing)})")
    if unexpected:
        parts.append(f"{len(unexpected)} tensor(s) of the weights have no place in it ({_names(unexpected)})")
    if mismatched:
        shapes = ", ".join(
            f"{key}: {tuple(saved)} in the weights, {tuple(built)} by config.json"
            for key, saved, built in mismatched[:SHOWN]
        )
        parts.append(
            f"{len(mismatched)} tensor(s) of another shape ({shapes}{', ...' if len(mismatched) > SHOWN else ''})"
        )
    return "; ".join(parts)


class WeightsMatchConfig:
    """Placed before transformers' ``PreTrainedModel`` in a shipped model's bases: ``from_pretrained`` raises
    ValueError when the folder's weights and its config.json disagree (``disagreements``), instead of a model with
    newly initialised or dropped tensors."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *args, **kwargs):  # noqa: D102 - transformers' own
        wants_info = kwargs.pop("output_loading_info", False)
        kwargs["ignore_mismatched_sizes"] = True  # a tensor of another shape is reported below, with the others
        logger = logging.getLogger("transformers.modeling_utils")
        hold = _HoldReport()
        logger.addFilter(hold)
        try:
            model, info = super().from_pretrained(
                pretrained_model_name_or_path, *args, output_loading_info=True, **kwargs
            )
        except BaseException:
            logger.removeFilter(hold)
            for record in hold.held:  # another failure: transformers' table explains it
                logger.handle(record)
            raise
        logger.removeFilter(hold)
        problems = disagreements(info)
        if problems:
            raise ValueError(
                f"{pretrained_model_name_or_path}: its config.json does not describe the weights beside it: "
                f"{problems}. The config was edited or belongs to other weights: restore the config.json that "
                "flowlm-export wrote (or export the checkpoint again)"
            )
        for record in hold.held:
            logger.handle(record)
        return (model, info) if wants_info else model
