"""flashgen inside other libraries' models. Each submodule imports its library only when imported:

* ``flashgen.integrations.transformers``: ``register()`` makes flashgen a Hugging Face
  transformers attention implementation (``attn_implementation="fg_attention"``).
"""
