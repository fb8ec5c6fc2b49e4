"""Model families: the one seam between the trainer and a model architecture.

``family.py`` holds the protocol and how a family is found (``model.family``) and shaped (the [model]
section or ``model.from_hf``); ``gpt.py`` and ``llama.py`` are the built-in families (``llama_config.py``:
what the llama family reads from and writes to a ``config.json``); ``hf.py`` reads
Hugging Face ``config.json`` and safetensors headers (pure), ``hf_io.py`` loads and exports tensors
(torch); ``build.py`` builds a rank's stage on the meta device and materialises its local shards.

Nothing is imported here: the driver imports ``family`` and the pure halves of the families without
pulling in torch.
"""
