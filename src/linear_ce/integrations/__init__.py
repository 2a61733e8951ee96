"""Integrations with model libraries.

Each submodule imports its library when it is itself imported, so
``import linear_ce`` never needs them:

- :mod:`linear_ce.integrations.transformers`: Hugging Face ``*ForCausalLM``
  models compute their training loss with :func:`linear_ce.linear_cross_entropy`
  (``pip install linear-ce[transformers]``).
"""
