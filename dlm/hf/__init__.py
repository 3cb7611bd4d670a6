"""The Hugging Face transformers format of a dlm model.

`convert` writes and reads it and needs no transformers; `configuration_dlm` and `modeling_dlm` are
the files copied into every export (they import transformers and nothing from dlm).
"""
