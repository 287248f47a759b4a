"""Model views: plain objects over a module's network, reading it as the math does (an MDM's data logits, the flow
map log δ_{s,t} and its head summaries, MLFM's posterior, the causal LM). Samplers and losses call these; the
LightningModules own the training loop around them. A view holds no parameters: the state-dict names are the
module's (``net.*``)."""
