"""What the user asks for: ``OffloadConfig`` and its validation (``config``), where its values come from (keyword
arguments, ``FT_*`` variables, a file: ``config_loading``), and the include/exclude patterns that pick the traps
(``patterns``). Users reach it as ``ft.OffloadConfig`` and ``ft.load_config*``."""
