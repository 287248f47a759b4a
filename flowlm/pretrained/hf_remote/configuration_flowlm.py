"""The transformers configuration of a flowlm export (shipped in the folder by ``flowlm-export``; it imports only
transformers): ``AutoConfig.from_pretrained(folder, trust_remote_code=True)``."""

from transformers import PretrainedConfig


class FlowLMConfig(PretrainedConfig):
    """A network the suite trained: ``family`` ("mdm", "flow" or "ar"), ``dit`` (the DiT's constructor arguments,
    every option spelled out), ``data_vocab_size``, ``mask_token_id`` ([MASK], MDM: the DiT's extra last row),
    ``time_conditioning`` (an MDM that reads its time). The run's hyper-parameters and records stay in config.json."""

    model_type = "flowlm-dit"

    def __init__(
        self,
        family: str = "mdm",
        dit: dict | None = None,
        data_vocab_size: int | None = None,
        mask_token_id: int | None = None,
        time_conditioning: bool = False,
        **kwargs,
    ) -> None:
        self.family = family
        self.dit = dict(dit or {})
        self.data_vocab_size = data_vocab_size
        self.mask_token_id = mask_token_id
        self.time_conditioning = time_conditioning
        super().__init__(**kwargs)
