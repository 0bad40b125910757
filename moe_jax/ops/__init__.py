"""The ops: each folder holds api.py (public function), reference.py (pure JAX) and its kernels."""
