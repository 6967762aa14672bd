"""gpt2mha's version (the package's ``__version__``; pyproject.toml states the same)."""

__version__ = "0.1.0"
