"""See api.py for the public functions."""
