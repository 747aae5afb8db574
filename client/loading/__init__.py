"""Building a model from a checkpoint: safetensors files read into their final place (``checkpoint``), the
destination pages allocated a window ahead of the readers (``checkpoint_pages``), and a meta model filled from a
checkpoint (``lazy_init``: ``ft.load_model_from_profile``, ``ft.init_empty_weights``)."""
