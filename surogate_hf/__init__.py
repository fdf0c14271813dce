"""surogate_hf: low-precision training for the Hugging Face stack."""

__version__ = "0.1.0"
