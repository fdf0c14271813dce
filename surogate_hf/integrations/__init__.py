"""Glue to the Hugging Face stack. Importing this package registers the transformers quantizer."""

from .transformers import SurogateHfQuantizer, SurogateQuantize, export_state_dict
