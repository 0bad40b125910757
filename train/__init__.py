"""Toy byte-level MoE language model trained on the Python standard library's sources (``python -m train``)."""
