"""The Hugging Face transformers format of a dlm model.

`reader` reads it back and `names` maps the weight names, both without transformers (the writer is
`dlm.artifacts.hf_export`); `configuration_dlm` and `modeling_dlm` are the files copied into every
export (they import transformers and nothing from dlm).
"""
