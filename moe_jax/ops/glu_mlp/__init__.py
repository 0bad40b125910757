"""See api.py for the public function."""
